"""A scripted teacher for the code-repair task, used for the warm start (cold-start SFT).

The teacher knows the fix, but its demonstrations deliberately mix habits that pay off
differently for a learner that does NOT know the fix:

- diagnose first (``run_tests``, ``read_code``, then the patch), read the code only and
  patch without running the tests, or patch at once on a guess (blind);
- sometimes a plausible wrong patch first, then re-run the tests, read, and fix;
- after the right patch, finish at once or re-run the tests first.

Supervised learning copies the mix; RL then moves probability toward the habits that
work for the learner (diagnosing, verifying). That is the seeds' point: a policy-gradient
update does not teach facts, it redistributes probability among behaviours already there.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from consequence.policy.sampler import Sample


@dataclass(frozen=True)
class TeacherHabits:
    """Probabilities of each habit in a demonstration."""

    p_diagnose_first: float = 0.5
    p_read_only: float = 0.3
    p_wrong_patch_first: float = 0.25
    p_verify_before_finish: float = 0.5


def plan_episode(task: Any, rng: random.Random, habits: TeacherHabits = TeacherHabits()) -> list[tuple[str, dict]]:
    """The list of tool calls the teacher will make on ``task`` (a RepairTask).

    Deterministic given the rng state. Every plan ends with the right patch and ``finish``,
    so a demonstration passes the hidden tests unless the environment fails.
    """
    plan: list[tuple[str, dict]] = []
    u = rng.random()
    diagnosed = u < habits.p_diagnose_first + habits.p_read_only
    if u < habits.p_diagnose_first:
        plan += [("run_tests", {}), ("read_code", {})]
    elif diagnosed:
        plan += [("read_code", {})]
    # A wrong patch on the line the fix replaces: the fix then overwrites it, so the
    # demonstration still ends with the reference code.
    decoys = [d for d in task.decoy_patches if d[0] == task.patch[0]]
    if decoys and rng.random() < habits.p_wrong_patch_first:
        line, code = rng.choice(decoys)
        plan += [("replace_line", {"line": line, "code": code}), ("run_tests", {})]
        if not diagnosed:
            plan.append(("read_code", {}))
    line, code = task.patch
    plan.append(("replace_line", {"line": line, "code": code}))
    if rng.random() < habits.p_verify_before_finish:
        plan.append(("run_tests", {}))
    plan.append(("finish", {}))
    return plan


class ScriptedTeacher:
    """A ``generate_fn`` for :func:`consequence.rollout.episodes.run_episodes`.

    Emits each planned call as the exact assistant text the chat template renders for it,
    followed by the end-of-turn token. Log-probs are 0 (the teacher is not a sampler).
    """

    def __init__(self, renderer, plans: list[list[tuple[str, dict]]]):
        self.renderer = renderer
        self.plans = plans
        self.step = [0] * len(plans)

    def __call__(self, prompts: list[list[int]], max_new_tokens: int, episode_indices: list[int]) -> list[Sample]:
        out = []
        for i in episode_indices:
            name, args = self.plans[i][min(self.step[i], len(self.plans[i]) - 1)]
            self.step[i] += 1
            ids = self.renderer.encode(self.renderer.format_call(name, args)) + [self.renderer.eot_id]
            out.append(Sample(ids, [0.0] * len(ids), "stop"))
        return out

"""The repair environments' demonstrator: a scripted solution of a repair task, with habits.

The demonstrator knows the fix (the task's ``patch``), but its demonstrations deliberately
mix habits that pay off differently for a learner that does NOT know the fix:

- diagnose first (``run_tests``, ``read_code``, then the patch), read the code only and
  patch without running the tests, or patch at once on a guess (blind);
- sometimes a plausible wrong patch first (one of the task's ``decoy_patches`` on the line
  the fix replaces), then re-run the tests, read, and fix;
- after the right patch, finish at once or re-run the tests first.

Supervised learning copies the mix; RL then moves probability toward the habits that
work for the learner (diagnosing, verifying). That is the seeds' point: a policy-gradient
update does not teach facts, it redistributes probability among behaviours already there.

:meth:`consequence.envs.repair.tasks.RepairEnvironment.demonstration` plays
:func:`plan_episode` (the ``Environment.demonstration`` hook, docs/environments.md); the
bundled warm start's demonstrations are these plans for draw seed 0, so the plan of a task
and the order in which it draws from the generator must not change
(``tests/envs/test_repair_demonstrator.py`` pins them).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["TeacherHabits", "habits_from", "plan_actions", "plan_episode"]


@dataclass(frozen=True)
class TeacherHabits:
    """Probabilities of each habit in a demonstration (each in [0, 1]).

    Attributes:
        p_diagnose_first: run the tests and read the code before patching.
        p_read_only: only read the code first (when not diagnosing first); the rest patch blind.
        p_wrong_patch_first: try a decoy patch on the fixed line first (when the task has one).
        p_verify_before_finish: re-run the tests after the fix, before ``finish``.
    """

    p_diagnose_first: float = 0.5
    p_read_only: float = 0.3
    p_wrong_patch_first: float = 0.25
    p_verify_before_finish: float = 0.5


def habits_from(habits: TeacherHabits | Mapping[str, float] | None) -> TeacherHabits:
    """``habits`` as :class:`TeacherHabits` (None: the defaults; a mapping: its fields by name).

    Raises:
        ValueError: a mapping with a name that is not a habit, or a value outside [0, 1],
            or ``p_diagnose_first + p_read_only`` above 1.
    """
    if habits is None:
        return TeacherHabits()
    if not isinstance(habits, TeacherHabits):
        names = {f.name for f in fields(TeacherHabits)}
        unknown = sorted(set(habits) - names)
        if unknown:
            raise ValueError(
                f"the repair demonstrator has no habit {', '.join(unknown)} (its habits: {', '.join(sorted(names))})"
            )
        habits = TeacherHabits(**{k: float(v) for k, v in habits.items()})
    bad = {f.name: getattr(habits, f.name) for f in fields(habits) if not 0.0 <= getattr(habits, f.name) <= 1.0}
    if bad:
        raise ValueError(f"repair demonstrator habits must be probabilities in [0, 1], got {bad}")
    if habits.p_diagnose_first + habits.p_read_only > 1.0 + 1e-12:
        raise ValueError(
            f"p_diagnose_first + p_read_only = {habits.p_diagnose_first + habits.p_read_only:g} exceeds 1 "
            "(they are shares of the same first choice)"
        )
    return habits


def plan_episode(task: Any, rng: random.Random, habits: TeacherHabits = TeacherHabits()) -> list[tuple[str, dict]]:
    """The tool calls ``(name, arguments)`` the demonstrator makes on ``task`` (a RepairTask).

    Deterministic given the rng state; it draws, in this order: the first habit, then (when
    the task has a decoy on the fixed line) whether to try it and which, then whether to
    verify before finishing. Every plan ends with the right patch and ``finish``, so a
    demonstration passes the hidden tests unless the environment fails.

    Args:
        task: the task (its ``patch`` and ``decoy_patches`` are read).
        rng: the generator (advanced).
        habits: the probabilities of the habits.

    Returns:
        the calls in order.
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


def plan_actions(task: Any, rng: random.Random, habits: TeacherHabits = TeacherHabits()) -> list[dict]:
    """:func:`plan_episode` in the episode's action format: ``[{"name": ..., "arguments": ...}, ...]``."""
    return [{"name": name, "arguments": arguments} for name, arguments in plan_episode(task, rng, habits)]

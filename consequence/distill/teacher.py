"""A scripted teacher: given actions played through the real environment and harness.

A *plan* is the actions of one episode, in order, in the episode's action format
(docs/environments.md): a tool call ``{"name": str, "arguments": dict}`` (also accepted as a
pair ``(name, arguments)``) or ``{"answer": text}`` (a reply without a tool call); a list
of actions is one assistant turn (its answers' text first, then its calls, each on its own
line: parallel tool calls, or a reply with text before its calls). Plans come from an
environment's demonstrator (``Environment.demonstration``), from a file of
demonstrations (``distill/demonstrations.py``) or from a teacher behind an OpenAI-compatible
URL (``distill/teacher_url.py``); :func:`plan_from_messages` reads a conversation's
assistant turns as a plan.

:class:`ScriptedTeacher` is a ``generate_fn`` for
:func:`consequence.rollout.episodes.run_episodes`: each turn it emits the exact assistant
text the chat template renders for the planned turn (:func:`turn_text`), followed by the
end-of-turn token, so the episode's tokens are those the student would have to sample.
:func:`play_plans` runs plans through fresh episodes and scores them; a demonstration is
used only when the environment's own reward verified it (:func:`verified`), never on the
plan's word.
"""

from __future__ import annotations

import inspect
import json
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from consequence.envs.api import ANSWER_KEY, cannot_demonstrate, has_demonstrator
from consequence.evaluate.episode_eval import solved
from consequence.harness.renderer import Renderer, format_call
from consequence.policy.sampler import Sample
from consequence.records import Trajectory
from consequence.reward.scoring import score_trajectories
from consequence.rollout.episodes import Budgets, EpisodeSpec, run_episodes

__all__ = [
    "PLAN_ENDED",
    "DemoSet",
    "ScriptedTeacher",
    "check_action",
    "demonstration_plans",
    "plan_from_messages",
    "play_plans",
    "read_tool_call",
    "require_demonstrator",
    "turn_text",
    "verified",
    "verify_plans",
]

PLAN_ENDED = "plan_ended"  # truncation reason of an episode its plan did not end


def check_action(action: Any) -> str | None:
    """Why ``action`` is not an action of the episode format, or None when it is one.

    Accepted: ``{"name": str, "arguments": dict}``, ``(name, arguments)``, ``{"answer": str}``.
    """
    if isinstance(action, tuple) and len(action) == 2:
        action = {"name": action[0], "arguments": action[1]}
    if not isinstance(action, dict):
        return f"an action must be a dict, got {type(action).__name__}"
    if ANSWER_KEY in action:
        if not isinstance(action[ANSWER_KEY], str) or set(action) != {ANSWER_KEY}:
            return f'an answer must be {{"answer": text}}, got {action!r:.120}'
        return None
    if not isinstance(action.get("name"), str) or not action["name"]:
        return f'a tool call needs a string "name", got {action!r:.120}'
    if not isinstance(action.get("arguments", {}), dict):
        return f'a tool call\'s "arguments" must be a JSON object (a dict), got {action!r:.120}'
    return None


def _actions(step: Any) -> list[Any]:
    return list(step) if isinstance(step, list) else [step]


def turn_text(step: Any, renderer: Renderer | None = None) -> str:
    """The assistant text of one planned turn (before the end-of-turn token): the turn's
    answers' text as it is, then its calls as ``renderer.format_calls`` writes them (the
    renderer's tool-call format), joined by newlines; without a renderer, each call as
    :func:`consequence.harness.renderer.format_call` writes it (Hermes), one per line.

    Raises:
        ValueError: an action that :func:`check_action` refuses.
    """
    texts, calls = [], []
    for action in _actions(step):
        problem = check_action(action)
        if problem:
            raise ValueError(problem)
        if isinstance(action, tuple):
            calls.append((action[0], action[1]))
        elif ANSWER_KEY in action:
            texts.append(action[ANSWER_KEY])
        else:
            calls.append((action["name"], action.get("arguments", {})))
    if calls:
        texts.append(renderer.format_calls(calls) if renderer else "\n".join(format_call(n, a) for n, a in calls))
    return "\n".join(texts)


class ScriptedTeacher:
    """A ``generate_fn`` for :func:`consequence.rollout.episodes.run_episodes` that plays plans.

    Each call emits the next planned turn of each episode as the renderer's tokens of
    :func:`turn_text` plus the end-of-turn token; log-probs are 0 (the teacher is not a
    sampler). An episode whose plan is spent before the environment ended it gets an empty
    turn cut at the token limit (it ends ``truncated``; :func:`play_plans` names the reason
    ``plan_ended``), never a made-up action.

    Args:
        renderer: the renderer whose tokens the turns are written in.
        plans: one plan per episode spec, in order (see the module doc).

    Raises:
        ValueError: an action that :func:`check_action` refuses.
    """

    def __init__(self, renderer: Renderer, plans: Sequence[Sequence[Any]]):
        self.renderer = renderer
        self.texts = [[turn_text(step, renderer) for step in plan] for plan in plans]
        self.step = [0] * len(plans)
        self.ran_out: set[int] = set()

    def __call__(self, prompts: list[list[int]], max_new_tokens: int, episode_indices: list[int]) -> list[Sample]:
        out = []
        for i in episode_indices:
            if self.step[i] >= len(self.texts[i]):
                self.ran_out.add(i)
                out.append(Sample([], [], "length"))
                continue
            ids = self.renderer.encode(self.texts[i][self.step[i]]) + [self.renderer.eot_id]
            self.step[i] += 1
            out.append(Sample(ids, [0.0] * len(ids), "stop"))
        return out


def play_plans(
    env: Any, tasks: Sequence[Any], plans: Sequence[Sequence[Any]], renderer: Renderer, seed: int = 0
) -> list[Trajectory]:
    """Play each plan through a fresh episode of its task; score the episodes.

    Every episode opens as in training (the environment's system prompt, worked examples and
    its own request), and every observation is the environment's. Scored with the reward
    box (``reward.scoring.score_trajectories``: the verifier score is the primary reward
    component). Budgets are the plans' own (a turn per planned turn, the plan's tool calls);
    an episode whose plan ended before the environment ended it is ``truncated`` with
    ``truncation_reason`` :data:`PLAN_ENDED`.

    Args:
        env: the environment (``consequence.envs.api.Environment``).
        tasks: one task per plan.
        plans: the plans (see the module doc).
        renderer: the renderer of the tokens (the student's, or any, to re-render later).
        seed: each episode's reset seed.

    Returns:
        one scored Trajectory per plan, in order (``task_id`` and ``group_id`` the task's id).

    Raises:
        ValueError: ``tasks`` and ``plans`` differ in length, or an action that
            :func:`check_action` refuses.
    """
    if len(tasks) != len(plans):
        raise ValueError(f"play_plans: {len(tasks)} tasks but {len(plans)} plans")
    if not plans:
        return []
    teacher = ScriptedTeacher(renderer, plans)
    calls = max(sum(ANSWER_KEY not in _as_dict(a) for a in _flat(p)) for p in plans)  # checked by the teacher
    budgets = Budgets(
        max_turns=max(len(p) for p in plans) + 1,  # one more: a spent plan is seen (PLAN_ENDED)
        max_new_tokens=10**6,
        max_total_tokens=10**12,
        max_tool_calls=max(12, calls + 1),
    )
    specs = [
        EpisodeSpec(env.make_episode(t), t.task_id, t.task_id, 0, seed, answer_ends_episode=env.answer_ends_episode)
        for t in tasks
    ]
    trajs = run_episodes(teacher, renderer, specs, budgets, env.system_prompt, examples=env.examples)
    for i in teacher.ran_out:
        if trajs[i].outcome == "truncated":
            trajs[i].truncation_reason = PLAN_ENDED
    score_trajectories(trajs, components=tuple(env.reward_components), reward_range=tuple(env.reward_range))
    return trajs


def _flat(plan: Sequence[Any]) -> list[Any]:
    return [a for step in plan for a in _actions(step)]


def _as_dict(action: Any) -> dict:
    return {"name": action[0], "arguments": action[1]} if isinstance(action, tuple) else action


def verified(t: Trajectory) -> bool:
    """The environment ended the episode and its reward verified it (primary component 1)."""
    return solved(t)


# the other sources of demonstrations, for an environment whose demonstrator cannot give any
OTHER_SOURCES = (
    "give the demonstrations another way: a file (`consequence sft --demos-file FILE` or `consequence demos "
    "--from FILE`: our trajectories .parquet, or .jsonl of OpenAI-style messages) or a teacher behind an "
    "OpenAI-compatible URL (`--teacher-url URL`: a vLLM server, `consequence serve`); docs/distillation.md"
)


def require_demonstrator(env: Any) -> None:
    """Refuse, before any work, an environment that cannot demonstrate its tasks: it has no
    demonstrator, or its options leave it none (``envs.api.cannot_demonstrate``).

    Raises:
        ValueError: names the environment, why, and the other sources (a file, a teacher URL).
    """
    if not has_demonstrator(env):
        raise ValueError(
            f"--env {env.label}: this environment has no demonstrator (Environment.demonstration, "
            f"docs/environments.md), so there is no scripted teacher for it; {OTHER_SOURCES}"
        )
    why = cannot_demonstrate(env)
    if why is not None:
        raise ValueError(f"--env {env.label}: its demonstrator cannot demonstrate here ({why}); {OTHER_SOURCES}")


def demonstration_plans(
    env: Any, tasks: Sequence[Any], rng: random.Random, habits: Mapping[str, float] | None = None
) -> list[list[dict]]:
    """The environment demonstrator's plan of each task (``env.demonstration(task, rng)``, the
    tasks in order, one generator: deterministic in its seed).

    Args:
        env: an environment with a demonstrator.
        tasks: its tasks.
        rng: the generator of the demonstrations' style.
        habits: settings of the demonstrator's style (given as ``habits=`` to a demonstrator
            that declares that keyword; None: its own defaults).

    Returns:
        one list of actions per task.

    Raises:
        ValueError: no demonstrator, or none with these options (:func:`require_demonstrator`;
            a demonstration that raises ``NotImplementedError``, too); ``habits`` for a
            demonstrator that takes none; a demonstrator that returned no list of actions
            (names the task and the action).
    """
    require_demonstrator(env)
    kw: dict[str, Any] = {}
    if habits:
        if "habits" not in inspect.signature(env.demonstration).parameters:
            raise ValueError(
                f"--env {env.label}: its demonstrator takes no habits; leave "
                f"{', '.join(sorted(habits))} at their defaults"
            )
        kw["habits"] = dict(habits)
    plans = []
    for task in tasks:
        try:
            plan = env.demonstration(task, rng, **kw)
        except NotImplementedError as e:  # the documented "cannot demonstrate": nothing is produced
            raise ValueError(
                f"--env {env.label}: its demonstrator cannot demonstrate task {task.task_id!r} ({e}); {OTHER_SOURCES}"
            ) from None
        if not isinstance(plan, list):
            raise ValueError(
                f"--env {env.label}: demonstration() of task {task.task_id!r} returned a "
                f"{type(plan).__name__}, not a list of actions"
            )
        for action in plan:
            problem = check_action(action)
            if problem:
                raise ValueError(f"--env {env.label}: demonstration() of task {task.task_id!r}: {problem}")
        plans.append(plan)
    return plans


@dataclass
class DemoSet:
    """Demonstrations after verification: what was kept, and what was refused and why.

    Attributes:
        kept: the verified episodes (scored trajectories, in the renderer's tokens).
        total: demonstrations considered (rows of a file, or episodes of a demonstrator).
        rejected: reason → count (see docs/distillation.md for the reasons).
        first: reason → where and why its first rejection happened (for the log).
        source: what the demonstrations came from (recorded in ``sft.json``).
    """

    kept: list[Trajectory] = field(default_factory=list)
    total: int = 0
    rejected: Counter = field(default_factory=Counter)
    first: dict[str, str] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)

    def reject(self, reason: str, where: str) -> None:
        """Count one rejection (``where``: which demonstration and why, kept for the first one)."""
        self.rejected[reason] += 1
        self.first.setdefault(reason, where)

    @property
    def acceptance_rate(self) -> float:
        """Kept / considered (0 when nothing was considered)."""
        return len(self.kept) / self.total if self.total else 0.0

    def record(self) -> dict[str, Any]:
        """The JSON record: source, ``episodes`` (considered), ``verified``, ``rejected``,
        ``acceptance_rate`` and each reason's first case."""
        return {
            **self.source,
            "episodes": self.total,
            "verified": len(self.kept),
            "rejected": dict(sorted(self.rejected.items())),
            "acceptance_rate": round(self.acceptance_rate, 6),
            "first_rejection": dict(sorted(self.first.items())),
        }

    def summary(self) -> str:
        """One line: verified of considered, the acceptance rate, the rejections by reason."""
        why = ", ".join(f"{k} {v}" for k, v in sorted(self.rejected.items()))
        return f"{len(self.kept)}/{self.total} demonstrations verified (acceptance rate {self.acceptance_rate:.1%})" + (
            f"; rejected: {why}" if why else ""
        )


def verify_plans(
    env: Any,
    tasks: Sequence[Any],
    plans: Sequence[Sequence[Any]],
    renderer: Renderer,
    seed: int = 0,
    where: Sequence[str] | None = None,
    demos: DemoSet | None = None,
) -> DemoSet:
    """Play the plans (:func:`play_plans`) and keep the verified episodes.

    Rejections: ``env_error`` (the environment failed), ``unfinished`` (the plan ended
    before the episode did), ``not_verified`` (the episode ended, or a budget cut it, and
    the environment's reward did not verify it), ``invalid_tool_call`` (verified, but a tool
    call was refused by the harness: an unknown tool or arguments against the schema).

    Args:
        env, tasks, plans, renderer, seed: as :func:`play_plans`.
        where: one label per plan for the rejection log (default ``task TASK_ID``).
        demos: the set to add to (e.g. one that already counted unreadable rows).

    Returns:
        ``demos`` (or a new set) with ``total`` raised by ``len(plans)``.

    Raises:
        ValueError: as :func:`play_plans`.
    """
    demos = demos if demos is not None else DemoSet()
    demos.total += len(plans)
    labels = list(where) if where is not None else [f"task {t.task_id}" for t in tasks]
    for t, label in zip(play_plans(env, tasks, plans, renderer, seed), labels):
        refused = [kind for c in t.calls for kind in c.invalid_calls]
        if verified(t) and not refused:
            demos.kept.append(t)
        elif verified(t):  # solved, but SFT would teach the call the harness refused
            demos.reject("invalid_tool_call", f"{label}: a tool call the harness refused ({', '.join(refused)})")
        elif t.outcome == "env_error":
            demos.reject("env_error", f"{label}: {t.error}")
        elif t.truncation_reason == PLAN_ENDED:
            demos.reject("unfinished", f"{label}: its actions ended before the episode did")
        else:
            score = "no score" if t.verifier_score is None else f"verifier score {t.verifier_score:g}"
            how = "finished" if t.outcome == "finished" else f"{t.outcome} ({t.truncation_reason})"
            demos.reject("not_verified", f"{label}: the episode {how} with {score}, not 1")
    return demos


def _text(content: Any) -> str | None:
    """A message's content as text (a string, None, or OpenAI text parts), else None."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(c, dict) and c.get("type") == "text" for c in content):
        texts = [c.get("text") for c in content]
        return "".join(texts) if all(isinstance(t, str) for t in texts) else None
    return None


def read_tool_call(call: Any) -> tuple[dict | None, str | None]:
    """``{"name", "arguments"}`` of an OpenAI-shape tool call, or why it is unreadable.

    Args:
        call: ``{"type": "function", "function": {"name": ..., "arguments": ...}}`` (the
            arguments a JSON object as a string, or a dict); a bare ``{"name", "arguments"}`` too.

    Returns:
        ``(action, None)``, or ``(None, reason)`` for no name, another ``type``, or arguments
        that are not a JSON object.
    """
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or (isinstance(call, dict) and call.get("type", "function") != "function"):
        return None, f"a tool call must be {{'type': 'function', 'function': {{...}}}}, got {call!r:.80}"
    name, args = fn.get("name"), fn.get("arguments", {})
    if not isinstance(name, str) or not name:
        return None, f"a tool call without a name: {call!r:.80}"
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return None, f"the arguments of tool call {name!r} are not JSON ({e.msg}): {args!r:.80}"
    if not isinstance(args, dict):
        return None, f"the arguments of tool call {name!r} are not a JSON object: {args!r:.80}"
    return {"name": name, "arguments": args}, None


# the roles of the leading instructions: "developer" is the OpenAI chat format's newer name of "system"
SYSTEM_ROLES = ("system", "developer")


def plan_from_messages(
    messages: Sequence[dict], examples: Sequence[tuple[str, str]] = ()
) -> tuple[list | None, tuple[str, str] | None]:
    """The plan (the assistant turns as actions) of a conversation
    (``distill/demonstrations.py``'s module doc gives the rule: the opening is the
    environment's own, each later assistant message is one turn, tool and user messages are
    observations and not read).

    Args:
        messages: the conversation (OpenAI chat shape, or our trajectories' ``messages``).
        examples: the environment's worked examples (skipped when the conversation holds
            them word for word after its system messages).

    Returns:
        ``(plan, None)``, or ``(None, (reason, detail))`` with reason ``unparsable_row``,
        ``unparsable_tool_call`` or ``no_actions``. A turn with tool calls is a list: its
        text (as ``{"answer": text}``, when not empty) first, then its calls; a turn without
        one is ``{"answer": text}``.
    """
    k = 0
    while k < len(messages) and messages[k].get("role") in SYSTEM_ROLES:
        k += 1
    shots = [{"role": r, "content": c} for q, a in examples for r, c in (("user", q), ("assistant", a))]
    if shots and [{"role": m.get("role"), "content": m.get("content")} for m in messages[k : k + len(shots)]] == shots:
        k += len(shots)
    if k >= len(messages) or messages[k].get("role") != "user":
        return None, ("unparsable_row", "no user message (the request) before the assistant turns")
    plan: list = []
    for no, m in enumerate(messages[k + 1 :], k + 1):
        role = m.get("role")
        if role in ("tool", "user"):
            continue  # an observation: the environment makes its own
        if role != "assistant":
            return None, ("unparsable_row", f"message {no} has role {role!r} (expected assistant, tool or user)")
        text = _text(m.get("content"))
        if text is None:
            return None, ("unparsable_row", f"message {no}: content is neither text nor text parts")
        calls = m.get("tool_calls") or []
        if not isinstance(calls, list):
            return None, ("unparsable_tool_call", f"message {no}: tool_calls is not a list")
        actions = []
        for call in calls:
            action, error = read_tool_call(call)
            if error:
                return None, ("unparsable_tool_call", f"message {no}: {error}")
            actions.append(action)
        if not actions:
            plan.append({ANSWER_KEY: text})
        else:
            turn = ([{ANSWER_KEY: text}] if text.strip() else []) + actions
            plan.append(turn if len(turn) > 1 else turn[0])
    if not plan:
        return None, ("no_actions", "no assistant turn after the request")
    return plan, None

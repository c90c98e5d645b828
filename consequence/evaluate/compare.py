"""Paired evaluation of two policies on the same episodes (docs/design.md §7).

Both policies see the same task instances with the same sampling seeds and the same
budgets; success is the verifier's hidden-test result (the same scoring function as the
training reward). Episodes whose environment failed are excluded from BOTH arms by a
stated rule (pairs stay pairs) and counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from consequence.envs.api import answer_in_text
from consequence.evaluate.episode_eval import parse_error_fraction, solved
from consequence.evaluate.shortcuts import answers, format_metric, shortcut_metrics
from consequence.evaluate.stats import paired_bootstrap_ci
from consequence.records import Trajectory


@dataclass
class ArmResult:
    """Per-episode results of one policy on an evaluation set."""

    name: str
    trajectories: list[Trajectory]

    def successes(self) -> list[float | None]:
        """1.0 / 0.0 per episode; None for an environment error."""
        out: list[float | None] = []
        for t in self.trajectories:
            if t.outcome == "env_error":
                out.append(None)
            else:
                out.append(1.0 if solved(t) else 0.0)
        return out


def paired_comparison(a: ArmResult, b: ArmResult, confidence: float = 0.95, seed: int = 0) -> dict[str, Any]:
    """Success of ``a`` and ``b`` on the same episodes and the paired difference b − a.

    The CI is a bootstrap over problems (episodes of one problem stay together).
    Rule for environment errors: an episode pair is dropped if either arm had one.

    Raises:
        ValueError: the two arms were not run on the same episodes.
    """
    ids_a = [(t.task_id, t.sample_id) for t in a.trajectories]
    ids_b = [(t.task_id, t.sample_id) for t in b.trajectories]
    if ids_a != ids_b:
        raise ValueError("paired comparison needs both policies run on the same episodes, in order")
    sa, sb = a.successes(), b.successes()
    # (index, success of a, success of b) of the episodes where neither had an environment error
    keep = [(i, x, y) for i, (x, y) in enumerate(zip(sa, sb)) if x is not None and y is not None]
    groups = [a.trajectories[i].task_id.split("#")[0] for i, _, _ in keep]
    ci = paired_bootstrap_ci(
        [x for _, x, _ in keep], [y for _, _, y in keep], groups=groups, confidence=confidence, seed=seed
    )
    return {
        **ci,
        "a": a.name,
        "b": b.name,
        "episodes": len(sa),
        "env_errors_excluded": len(sa) - len(keep),
        "confidence": confidence,
    }


def summarize(trajs: Sequence[Trajectory]) -> dict[str, Any]:
    """Outcome shares and costs of a set of episodes; ``success`` is over the episodes whose
    environment did not fail (env errors are excluded, as everywhere; None when every
    episode failed: no episode measured it, and 0.0 would read as "the policy never
    solved one"), the shares over all; then the most common answer, the copied answers and the shortcut diagnostics
    (``evaluate.shortcuts.shortcut_metrics``: tool-call rate, invalid calls, answers; None
    where undefined)."""
    n = max(1, len(trajs))
    valid = [t for t in trajs if t.outcome != "env_error"]
    return {
        "episodes": len(trajs),
        "success": sum(solved(t) for t in valid) / len(valid) if valid else None,
        "finished": sum(t.outcome == "finished" for t in trajs) / n,
        "truncated": sum(t.outcome == "truncated" for t in trajs) / n,
        "env_error": sum(t.outcome == "env_error" for t in trajs) / n,
        "gen_tokens_mean": sum(t.n_generated_tokens for t in trajs) / n,
        "tool_calls_mean": sum(t.n_tool_calls for t in trajs) / n,
        "parse_error_fraction": parse_error_fraction(trajs),
        **top_answer(trajs),
        **copied_answers(trajs),
        **shortcut_metrics(trajs),
    }


def request_text(t: Trajectory) -> str | None:
    """The user message that opened the episode: the last one before the policy's first reply
    (the policy's replies are the last ``len(t.calls)`` assistant messages; earlier ones are
    worked examples), or None without messages."""
    turns = [i for i, m in enumerate(t.messages) if m.get("role") == "assistant"]
    if not t.calls or len(turns) < len(t.calls):
        return None
    first = turns[len(turns) - len(t.calls)]
    users = [m for m in t.messages[:first] if m.get("role") == "user"]
    return str(users[-1].get("content", "")) if users else None


def copied_answers(trajs: Sequence[Trajectory]) -> dict[str, float | None]:
    """``copied_answer_share``: episodes whose final answer is text of their own request
    (``envs.api.answer_in_text``), e.g. a sorting task answered with the words in the order given;
    ``success_not_copied``: the success of the other episodes, over all valid episodes — what
    a policy that copies cannot score (a copier wins exactly where the request already holds
    the answer). Both None when every episode was an env error (nothing measured)."""
    valid = [t for t in trajs if t.outcome != "env_error"]
    if not valid:
        return {"copied_answer_share": None, "success_not_copied": None}
    copied = [answer_in_text(t.final_code, request_text(t)) for t in valid]
    return {
        "copied_answer_share": sum(copied) / len(valid),
        "success_not_copied": sum(solved(t) for t, c in zip(valid, copied) if not c) / len(valid),
    }


def top_answer(trajs: Sequence[Trajectory]) -> dict[str, Any]:
    """The most common answer (``shortcuts.answer_of``: ``final_code`` stripped, the answer
    text or the final program; env_error episodes left out), None without one, and
    ``answered_episodes``, the number of valid episodes with an answer. Its share of them
    is ``top_answer_share`` (``shortcuts.top_answer_share``): a policy that gives one
    answer to every problem scores the share of problems whose answer that is, whatever it
    learned."""
    counts: dict[str, int] = {}
    for a in answers(trajs):
        counts[a] = counts.get(a, 0) + 1
    if not counts:
        return {"top_answer": None, "answered_episodes": 0}
    answer = max(counts, key=counts.__getitem__)  # ties: the first seen
    shown = answer if len(answer) <= 80 else answer[:77] + "..."  # a program can be long: report.json keeps a head
    return {"top_answer": shown, "answered_episodes": sum(counts.values())}


# An arm that gives one final answer in at least this share of its answered episodes (over at
# least CONSTANT_MIN_EPISODES answered) gets a warning in the final report: its success may be a base rate.
CONSTANT_SHARE = 0.9
CONSTANT_MIN_EPISODES = 20


# An RL arm that copies its answer from the request in at least this share of its episodes,
# and more than the warm start by COPY_RISE, gets a warning in the final report.
COPY_SHARE = 0.5
COPY_RISE = 0.1


def copied_answer_warning(split: str, decoding: str, warm: dict[str, Any], rl: dict[str, Any]) -> str | None:
    """A warning when the RL arm's answers are mostly copied from the question, more than the
    warm start's (``warm`` and ``rl`` are :func:`summarize` outputs), else None."""
    share, before = rl.get("copied_answer_share") or 0.0, warm.get("copied_answer_share") or 0.0
    if rl.get("episodes", 0) < CONSTANT_MIN_EPISODES or share < COPY_SHARE or share < before + COPY_RISE:
        return None
    return (
        f"{split}, {decoding}: the RL policy's final answer is text copied from the question in {share:.0%} of "
        f"its episodes (warm start: {before:.0%}); copying wins exactly where the question already holds the "
        f"answer. Success of the answers that are not copies: {format_metric('success', warm.get('success_not_copied'))} → "
        f"{format_metric('success', rl.get('success_not_copied'))} of all valid episodes; read the gain against that."
    )


def constant_answer_warning(split: str, decoding: str, warm: dict[str, Any], rl: dict[str, Any]) -> str | None:
    """A warning when the RL arm answers (nearly) always the same and more so than the warm
    start (``warm`` and ``rl`` are :func:`summarize` outputs), else None. The shares are
    over each arm's answered episodes (``top_answer_share``)."""
    share, before = rl.get("top_answer_share"), warm.get("top_answer_share") or 0.0
    answered = rl.get("answered_episodes", rl.get("episodes", 0))
    if share is None or answered < CONSTANT_MIN_EPISODES or share < CONSTANT_SHARE or share <= before:
        return None
    return (
        f"{split}, {decoding}: the RL policy gave the same final answer {rl['top_answer']!r} in {share:.0%} of its "
        f"answered episodes (warm start: {before:.0%}; {answered} of {rl.get('episodes', answered)} episodes "
        "answered). Its success is then about the share of problems whose answer "
        "that is (a constant policy), not a skill: compare it with that base rate before reading the "
        "difference as a gain."
    )

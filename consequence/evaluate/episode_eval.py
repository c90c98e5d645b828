"""pass@k, uncertainty and cost of multi-turn evaluation episodes (docs/design.md §7).

Input: n scored episodes per task (``sample_id`` 0 … n−1, ``group_id`` = task id).
Success of an episode = the environment ended it (e.g. ``finish``, or an answer) and its
primary reward component (the verifier's score: hidden tests for code) is 1.
Environment errors are excluded from their task's n by a stated rule and counted; a task
left with fewer than k valid episodes is left out of pass@k and counted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from consequence.evaluate.stats import binomial_se, bootstrap_mean_ci, pass_at_k
from consequence.records import Trajectory

EXCLUSION_RULE = (
    "an episode whose environment failed (env_error) is dropped from its task's n; a task with "
    "fewer than k valid episodes is left out of pass@k; both are counted in the report"
)


def solved(t: Trajectory) -> bool:
    """The environment ended the episode and the verifier's score (the primary reward
    component, e.g. every hidden test passed) is 1."""
    return t.outcome == "finished" and t.verifier_score == 1.0


def prompt_too_long(t: Trajectory) -> bool:
    """The first prompt did not fit the token budget: the episode ended before any call."""
    return t.outcome == "truncated" and t.truncation_reason == "total_tokens" and not t.calls


def outcome_shares(trajs: Sequence[Trajectory]) -> dict[str, Any]:
    """How every episode ended, as counts and as shares of ALL episodes (nothing dropped):
    solved, submitted but wrong, truncated by each budget, prompt too long, env_error."""
    counts: dict[str, int] = {}
    for t in trajs:
        if t.outcome == "finished":
            key = "solved" if solved(t) else "submitted_wrong"
        elif t.outcome == "env_error":
            key = "env_error"
        elif prompt_too_long(t):
            key = "prompt_too_long"
        else:
            key = f"truncated_{t.truncation_reason}"
        counts[key] = counts.get(key, 0) + 1
    n = max(1, len(trajs))
    rank = {"solved": 0, "submitted_wrong": 1, "prompt_too_long": 3, "env_error": 4}  # truncated_*: 2
    counts = dict(sorted(counts.items(), key=lambda kv: (rank.get(kv[0], 2), kv[0])))
    return {"episodes": len(trajs), "counts": counts, "shares": {k: v / n for k, v in counts.items()}}


def per_task_counts(trajs: Sequence[Trajectory]) -> list[dict[str, Any]]:
    """One dict per task, in first-seen order: task_id, problem_id, n (valid), c (successes),
    env_errors, generated tokens, tool calls and wall seconds summed over its episodes.

    ``wall_s`` adds each episode's own wall time; the episodes of a batch run concurrently,
    so these overlap and their sum over tasks exceeds the evaluation's wall time (the
    batch's time per episode is ``cost_summary``'s ``wall_s_per_episode``)."""
    tasks: dict[str, dict[str, Any]] = {}
    for t in trajs:
        d = tasks.setdefault(
            t.group_id,
            {
                "task_id": t.group_id,
                "problem_id": t.task_id.split("#")[0],
                "n": 0,
                "c": 0,
                "env_errors": 0,
                "gen_tokens": 0,
                "tool_calls": 0,
                "wall_s": 0.0,
            },
        )
        if t.outcome == "env_error":
            d["env_errors"] += 1
            continue
        d["n"] += 1
        d["c"] += solved(t)
        d["gen_tokens"] += t.n_generated_tokens
        d["tool_calls"] += t.n_tool_calls
        d["wall_s"] += t.wall_time_s or 0.0
    return list(tasks.values())


def summarize_pass_at_k(
    counts: Sequence[dict[str, Any]], ks: Sequence[int], confidence: float = 0.95, seed: int = 0
) -> dict[str, Any]:
    """pass@k (unbiased per task, then the mean over tasks), bootstrap CI over problems, SE.

    Per task pass@k = 1 − C(n−c, k)/C(n, k) (Chen et al. 2021, §2.1, product form); the
    CI resamples problems (a problem's samples stay together; tasks of one problem are
    averaged first); ``binomial_se`` treats the task mean as a proportion over tasks.

    Returns:
        dict k → {pass_at_k, low, high, se, tasks, tasks_excluded}, as strings of k.
    """
    out: dict[str, Any] = {}
    for k in ks:
        rows = [(d["problem_id"], pass_at_k(d["n"], d["c"], k)) for d in counts if d["n"] >= k]
        by_problem: dict[str, list[float]] = {}
        for pid, v in rows:
            by_problem.setdefault(pid, []).append(v)
        values = [sum(v) / len(v) for v in by_problem.values()]
        mean = math.fsum(values) / len(values) if values else float("nan")
        low, high = bootstrap_mean_ci(values, confidence, seed=seed) if len(values) >= 2 else (mean, mean)
        out[str(k)] = {
            "pass_at_k": mean,
            "low": low,
            "high": high,
            "se": binomial_se(mean, len(values)) if values else float("nan"),
            "tasks": len(rows),
            "problems": len(values),
            "tasks_excluded": len(counts) - len(rows),
        }
    return out


def success_at_attempt(trajs: Sequence[Trajectory], k: int) -> dict[str, float]:
    """success@attempt j for j = 1..k (``--attempts k``): the share of valid episodes (env
    errors dropped) solved within j attempts of one episode (solved at its last attempt,
    ``Trajectory.attempts``). Beside pass@k at equal samples: k attempts of one episode
    see the verifier's feedback, k independent samples do not (:func:`attempts_vs_samples`).

    Returns:
        {str(j): share} for j = 1..k; NaN shares without a valid episode.
    """
    valid = [t for t in trajs if t.outcome != "env_error"]
    n = len(valid)
    return {
        str(j): sum(solved(t) and t.attempts <= j for t in valid) / n if n else float("nan") for j in range(1, k + 1)
    }


def attempts_vs_samples(with_attempts: Sequence[Trajectory], samples: Sequence[Trajectory], k: int) -> dict[str, Any]:
    """success within j attempts of one episode vs pass@j of j independent samples, j = 1..k.

    ``with_attempts``: one episode per task run with ``--attempts k``; ``samples``: n ≥ k
    independent one-attempt episodes per task (pass@j unbiased, :func:`summarize_pass_at_k`).
    At j both spend up to j answers per task: the difference is what the feedback buys.

    Returns:
        {str(j): {"success_at_attempt": share, "pass_at_k": mean over tasks}}.
    """
    within = success_at_attempt(with_attempts, k)
    passed = summarize_pass_at_k(per_task_counts(samples), range(1, k + 1))
    return {
        str(j): {"success_at_attempt": within[str(j)], "pass_at_k": passed[str(j)]["pass_at_k"]}
        for j in range(1, k + 1)
    }


def parse_error_fraction(trajs: Sequence[Trajectory]) -> float:
    """Share of model calls whose output the renderer could not parse into tool calls (or an
    answer): the "do tool calls parse" measure of a cold start; 0.0 without calls."""
    calls = [c for t in trajs for c in t.calls]
    return sum(c.parse_error is not None for c in calls) / max(1, len(calls))


def cost_summary(trajs: Sequence[Trajectory], wall_s: float | None = None) -> dict[str, float]:
    """Per-episode cost (generated tokens, tool calls, wall seconds) and cost per success.

    ``wall_s``: the wall time of the whole batch of episodes; episodes run concurrently, so
    the per-episode wall time is ``wall_s / episodes`` (without it: the mean of each
    episode's own start-to-end time, which overlap).
    """
    valid = [t for t in trajs if t.outcome != "env_error"]
    n = max(1, len(valid))
    wins = sum(solved(t) for t in valid)
    tokens = sum(t.n_generated_tokens for t in valid)
    return {
        "episodes": len(valid),
        "success": wins / n,
        "gen_tokens_per_episode": tokens / n,
        "tool_calls_per_episode": sum(t.n_tool_calls for t in valid) / n,
        "parse_error_fraction": parse_error_fraction(trajs),  # all calls, env errors too
        "wall_s_per_episode": (wall_s if wall_s is not None else sum(t.wall_time_s or 0.0 for t in valid)) / n,
        "gen_tokens_per_success": tokens / wins if wins else float("inf"),
    }


def success_under_caps(trajs: Sequence[Trajectory], attribute: str, caps: Sequence[int]) -> list[float]:
    """Success when an episode counts only if it also used ≤ cap of ``attribute``
    (``n_tool_calls`` or ``n_generated_tokens``): the success-vs-cost curve."""
    valid = [t for t in trajs if t.outcome != "env_error"]
    n = max(1, len(valid))
    return [sum(solved(t) and getattr(t, attribute) <= c for t in valid) / n for c in caps]


def distinct_correct(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Diversity beside pass@k: per task (its samples of one instance), the number of distinct
    correct answers (the final code or answer of the solved episodes, trailing whitespace of each
    line ignored). Whether RL only sharpens what the model already does shows here: pass@k can
    stay while the distinct solutions behind it collapse to one.

    Returns:
        ``tasks_solved`` (tasks with at least one solved episode), ``distinct_correct_mean``
        (mean over those tasks of their distinct correct answers; 0 without any),
        ``distinct_per_solved`` (all distinct correct answers / all solved episodes).
    """
    answers: dict[str, set[str]] = {}
    n_solved = 0
    for t in trajs:
        if t.outcome != "env_error" and solved(t):
            n_solved += 1
            text = "\n".join(line.rstrip() for line in (t.final_code or "").strip().splitlines())
            answers.setdefault(t.group_id, set()).add(text)
    distinct = sum(len(a) for a in answers.values())
    return {
        "tasks_solved": float(len(answers)),
        "distinct_correct_mean": distinct / len(answers) if answers else 0.0,
        "distinct_per_solved": distinct / n_solved if n_solved else 0.0,
    }

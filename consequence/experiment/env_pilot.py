"""A policy's pilot on an environment before a run (``consequence env-check ENV --policy M``).

The seeds: measure the acceptance rate on 50–100 tasks before the real run. A pilot samples
G episodes of each of N train tasks with the starting policy (``evaluate.run.evaluate_episodes``,
the episodes of ``consequence eval``), then reports what the budget arithmetic assumes
(:func:`consequence.experiment.pilot.pilot_measures`: success α = the verified share, the
mixed-group fraction = dynamic sampling's α, the truncation share, L̄), the invalid-call rates
by kind, and budgets suggested from the observed distributions (:func:`suggest_budgets`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from consequence.records import Trajectory
from consequence.rollout.episodes import Budgets

__all__ = [
    "BINDING_SHARE",
    "check_pilot_fits",
    "invalid_call_rates",
    "nearest_rank",
    "run_policy_pilot",
    "suggest_budgets",
]

# A budget that cut more than this share of the pilot's episodes was binding: the observed
# distribution is censored at it, so its 95th percentile says nothing about the need.
BINDING_SHARE = 0.05


def nearest_rank(values: Sequence[float], q: float = 0.95) -> float:
    """The ``q`` quantile by the nearest-rank rule: the ⌈q·n⌉-th smallest value (an observed
    value, so a count stays a whole number).

    Raises:
        ValueError: no value, or ``q`` outside (0, 1].
    """
    if not values or not 0 < q <= 1:
        raise ValueError(f"nearest_rank: need values and 0 < q <= 1, got {len(values)} values and q={q}")
    return sorted(values)[math.ceil(q * len(values)) - 1]


def invalid_call_rates(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Invalid tool calls per model call, by kind, over the scored episodes' calls.

    ``unparsable``: a call whose output stopped (not cut at the token limit) and did not parse
    (``ModelCall.parse_error``; for an environment whose replies must be tool calls this
    includes a reply with none); ``unknown_tool`` and ``bad_arguments``: the harness refused
    a parsed call (``ModelCall.invalid_calls``). ``invalid`` is their sum; ``model_calls`` the
    denominator.
    """
    calls = [c for t in trajs if t.outcome != "env_error" for c in t.calls]
    n = max(1, len(calls))
    unparsable = sum(c.parse_error is not None and c.stop_reason == "stop" for c in calls)
    kinds = {k: sum(c.invalid_calls.count(k) for c in calls) for k in ("unknown_tool", "bad_arguments")}
    out = {"model_calls": float(len(calls)), "unparsable": unparsable / n}
    out |= {k: v / n for k, v in kinds.items()}
    out["invalid"] = (unparsable + sum(kinds.values())) / n
    return out


def suggest_budgets(trajs: Sequence[Trajectory], budgets: Budgets) -> list[dict[str, Any]]:
    """A suggested value of each episode budget from the pilot's episodes.

    Rule: the 95th percentile (nearest rank) of what the episodes used, when the pilot's own
    budget cut at most :data:`BINDING_SHARE` of them; else twice the pilot's budget (the
    distribution was censored at it: pilot again with the larger budget to measure it).

    - ``max_turns``: model calls per episode (cut: ``truncation_reason == "max_turns"``);
    - ``max_new_tokens``: sampled tokens per model call (cut: ``"max_new_tokens"``);
    - ``max_total_tokens``: per episode, the last call's context tokens plus the suggested
      ``max_new_tokens`` (a call needs room for a whole reply; cut: ``"total_tokens"``).

    Returns:
        one dict per budget: ``option``, ``pilot`` (the budget the pilot ran under),
        ``p95``, ``max`` (observed), ``cut_share``, ``suggested``, ``rule``.
    """
    scored = [t for t in trajs if t.outcome != "env_error" and t.calls]
    if not scored:
        return []
    cut = {
        r: sum(t.truncation_reason == r for t in scored) / len(scored)
        for r in ("max_turns", "max_new_tokens", "total_tokens")
    }
    turns = _line("--max-turns", budgets.max_turns, [len(t.calls) for t in scored], cut["max_turns"])
    new = _line(
        "--max-new-tokens",
        budgets.max_new_tokens,
        [len(c.output_ids) for t in scored for c in t.calls],
        cut["max_new_tokens"],
    )
    context = [len(t.calls[-1].context_ids) + new["suggested"] for t in scored]
    total = _line("--max-total-tokens", budgets.max_total_tokens, context, cut["total_tokens"])
    return [turns, new, total]


def _line(option: str, pilot: int, used: list[int], cut_share: float) -> dict[str, Any]:
    p95 = int(nearest_rank(used))
    binding = cut_share > BINDING_SHARE
    return {
        "option": option,
        "pilot": pilot,
        "p95": p95,
        "max": max(used),
        "cut_share": cut_share,
        "suggested": 2 * pilot if binding else max(1, p95),
        "rule": (
            f"{cut_share:.0%} of episodes were cut by {option} {pilot} (> {BINDING_SHARE:.0%}): 2 × the budget, pilot again"
            if binding
            else "95th percentile (nearest rank) of the pilot"
        ),
    }


def check_pilot_fits(tokenizer, env, split: str, tasks: int, seed: int, budgets: Budgets) -> None:
    """Refuse, before any work, budgets in which no pilot episode could make a model call: the
    check of ``consequence eval`` (``evaluate.run.check_budget_fits``) on the very instances
    :func:`run_policy_pilot` draws (``evaluate_episodes``' draw with ``seed``).

    Raises:
        ValueError: names ``--max-total-tokens`` and the smallest budget that fits.
    """
    from consequence.evaluate.run import check_budget_fits, problem_count
    from consequence.harness.renderer import Renderer
    from consequence.seeding import seed_of

    drawn = env.sample(split, problem_count(env, split, tasks), seed=seed_of(seed, "eval", split))
    check_budget_fits(Renderer(tokenizer, env.tools), env, drawn, budgets)


def run_policy_pilot(
    model_path: Path,
    env,
    *,
    tasks: int = 50,
    group: int = 8,
    budgets: Budgets = Budgets(),
    temperature: float = 1.0,
    seed: int = 0,
    split: str = "train",
) -> dict[str, Any]:
    """The pilot: ``group`` episodes of each of ``tasks`` instances of ``split`` (drawn with
    ``seed``) sampled from the policy at ``model_path`` under ``budgets``.

    Returns:
        ``{"tasks", "group", "measured": pilot_measures(...), "success_alpha",
        "mixed_group_fraction", "truncated", "env_errors", "invalid_calls": invalid_call_rates(...),
        "suggested_budgets": suggest_budgets(...), "warnings": [...]}``.

    Raises:
        ValueError: ``tasks`` or ``group`` < 1; as ``evaluate_episodes`` (no problem in the
            split, a token budget no prompt fits); no valid episode (every one an env_error).
    """
    from consequence.evaluate.run import evaluate_episodes
    from consequence.experiment.pilot import pilot_measures

    if tasks < 1 or group < 1:
        raise ValueError(f"--pilot-tasks {tasks} / --group {group}: give at least 1 of each")
    ev = evaluate_episodes(
        model_path, env, split, group, [1], problems=tasks, temperature=temperature, seed=seed, budgets=budgets,
        selection=("first",), recovery=False, purpose="consequence env-check --policy",
    )  # fmt: skip
    measured = pilot_measures(ev.result)
    episodes = ev.episodes
    out = {
        "model": str(model_path),
        "split": split,
        "tasks": int(measured["tasks"]),
        "group": group,
        "temperature": temperature,
        "measured": measured,
        "success_alpha": measured["verified_share"],
        "mixed_group_fraction": measured["mixed_group_fraction"],
        "truncated": measured["truncated"],
        "env_errors": sum(t.outcome == "env_error" for t in episodes) / max(1, len(episodes)),
        "invalid_calls": invalid_call_rates(episodes),
        "suggested_budgets": suggest_budgets(episodes, budgets),
    }
    out["warnings"] = _warnings(out)
    return out


def _warnings(p: dict[str, Any]) -> list[str]:
    """What makes the pilot's numbers a bad start for RL, each with what to do."""
    out = []
    if p["mixed_group_fraction"] == 0:
        out.append(
            "no group of the pilot is mixed (all G succeed or all fail): a group baseline (grpo, rloo) gets no "
            "signal; start from a stronger or weaker policy, an easier task split, or a larger --group"
        )
    if p["success_alpha"] == 0:
        out.append("no episode succeeded: there is nothing to reinforce; warm-start the policy (consequence sft)")
    if p["env_errors"] > 0:
        out.append(f"{p['env_errors']:.0%} of the pilot's episodes were env_errors: fix the environment first")
    return out

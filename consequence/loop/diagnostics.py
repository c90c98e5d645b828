"""Training diagnostics beyond reward: per-iteration extras and warnings (issue 4).

:func:`iteration_extras` adds what a researcher checks first when a run goes wrong
(lengths, rows per trajectory, tool-call histogram, env-error rate, why groups were
dropped). :func:`warnings_for` reads the metrics so far and returns the warnings that
apply at this iteration; the trainer prints them and logs them in ``metrics.jsonl`` (key
``warnings``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any, TypeGuard

from consequence.credit.batch import credit_rewards
from consequence.records import Trajectory, trajectory_to_rows

ENTROPY_COLLAPSE = 0.2  # warn when entropy falls below this fraction of the first iteration's
FIRST_STEP_RATIO_TOL = 0.01  # |ρ − 1| on the first step of an iteration (on-policy) above this
STALE_OUTSIDE_BAND = 0.01  # share of a stale batch's target tokens with π_old/μ outside [0.5, 2] above this
TRUNCATION_RISE = 0.10  # warn when the truncated share grew by this much over the last 3 iterations


def component_means(scored: Sequence[Trajectory]) -> dict[str, float]:
    """Mean of each named reward component over scored trajectories (a component a
    trajectory lacks counts 0), so the parts of ``reward_mean`` are logged separately."""
    names = list(dict.fromkeys(k for t in scored for k in t.reward_components))
    n = max(1, len(scored))
    return {k: sum(t.reward_components.get(k, 0.0) for t in scored) / n for k in names}


def iteration_extras(trajs: Sequence[Trajectory]) -> dict[str, Any]:
    """Per-iteration diagnostics of the collected batch.

    Returns:
        gen_tokens_max, rows_per_trajectory (mean; a row is split where a prompt does not
        extend the previous one), env_error_rate, tool_histogram (tool name → calls),
        groups_all_equal (groups whose credited rewards are identical: no group-relative
        signal) and groups_no_valid (every member an env_error or without a generated
        token: nothing credited; docs/cases.md, case 15).
    """
    n = max(1, len(trajs))
    hist: Counter[str] = Counter()
    for t in trajs:
        hist.update(t.tool_histogram or {})
    trained = [t for t in trajs if t.calls]
    groups: dict[str, set] = {}
    for t, r in zip(trajs, credit_rewards(list(trajs))):
        groups.setdefault(t.group_id, set())
        if r is not None:
            groups[t.group_id].add(r)
    return {
        "gen_tokens_max": max((t.n_generated_tokens for t in trajs), default=0),
        "rows_per_trajectory": sum(len(trajectory_to_rows(t)) for t in trained) / max(1, len(trained)),
        "env_error_rate": sum(t.outcome == "env_error" for t in trajs) / n,
        "tool_histogram": dict(sorted(hist.items())),
        "groups_all_equal": sum(len(v) == 1 for v in groups.values()),
        "groups_no_valid": sum(len(v) == 0 for v in groups.values()),
    }


def _stale_gap(m: dict[str, Any]) -> bool:
    """A stale batch with many tokens outside the IS band, trained without TIS or masked IS."""
    outside = m.get("is_ratio_outside_band")
    corrected = "tis_weight_mean" in m or "is_masked_token_fraction" in m
    return m.get("lag_max", 0) > 0 and _num(outside) and outside > STALE_OUTSIDE_BAND and not corrected


def _stale_gap_warning(history: Sequence[dict[str, Any]]) -> list[str]:
    """Once per run (the first iteration where it holds): stale batches far from the trainer, uncorrected."""
    now = history[-1]
    if not _stale_gap(now) or any(_stale_gap(h) for h in history[:-1]):
        return []
    return [
        f"stale batches are far from the trainer: {now['is_ratio_outside_band']:.1%} of target tokens have "
        f"π_old/μ outside [0.5, 2] at lag {now['lag_max']} (sampler–trainer KL "
        f"{now.get('sampler_trainer_kl', float('nan')):.2g}); without a correction the PPO ratio is taken "
        "against the stale sampler: --is-mask token or --tis-cap 2 corrects it (docs/async.md §3)"
    ]


def first_step_ratio_tol(manifest: dict[str, Any]) -> float:
    """|ρ − 1| above which the first step's ratio is warned about, for the run of ``manifest``:
    :data:`FIRST_STEP_RATIO_TOL` in float32; with ``--dtype bfloat16``, e^tol − 1 for the
    tolerance the pre-step ratio check derived for this run's logits
    (``policy.device.logprob_tolerance``: two bfloat16 computations of one log-prob differ
    by up to tol nats), or no warning (inf) when the checks did not run and no tolerance was derived."""
    if manifest.get("config", {}).get("dtype", "float32") == "float32":
        return FIRST_STEP_RATIO_TOL
    results = (manifest.get("checks") or {}).get("results") or []
    tol = next((r.get("tolerance") for r in results if r.get("name") == "ratio"), None)
    return math.expm1(tol) if isinstance(tol, (int, float)) and math.isfinite(tol) else math.inf


def warnings_for(history: Sequence[dict[str, Any]], first_step_tol: float = FIRST_STEP_RATIO_TOL) -> list[str]:
    """Warnings that the newest metrics (``history[-1]``) trigger, given all before it;
    ``first_step_tol`` is the |ρ − 1| of the first step's ratio warned about
    (:func:`first_step_ratio_tol`).

    A metric that an iteration does not report (left out, ``None`` or NaN: e.g. no
    optimizer step trained a row) neither triggers a warning nor stops one; the entropy
    baseline is the first iteration that reports an entropy.
    """
    if not history:
        return []
    now, out = history[-1], []
    first_ent = next((h["entropy"] for h in history if _num(h.get("entropy"))), None)
    ent = now.get("entropy")
    if _num(first_ent) and _num(ent) and first_ent > 0 and ent < ENTROPY_COLLAPSE * first_ent:
        out.append(
            f"entropy collapse: {ent:.4f} nats/token, below {ENTROPY_COLLAPSE:.0%} of the first "
            f"iteration's {first_ent:.4f}; sampling is nearly deterministic and exploration has stopped"
        )
    lo, hi = now.get("first_step_ratio_min"), now.get("first_step_ratio_max")
    if now.get("lag_max", 0) > 0:  # a stale batch: its gap to the trainer is expected, and measured apart
        out += _stale_gap_warning(history)
    elif _num(lo) and _num(hi) and max(1 - lo, hi - 1) > first_step_tol:
        out.append(
            f"ratio far from 1 on the first step ({lo:.4f} … {hi:.4f}): the trainer's log-probs differ "
            "from the sampler's; check temperature / top-k / top-p and the weights used for rollouts"
        )
    trunc = [h["truncated_fraction"] for h in history[-3:] if _num(h.get("truncated_fraction"))]
    if len(trunc) == 3 and trunc[0] < trunc[1] < trunc[2] and trunc[2] - trunc[0] >= TRUNCATION_RISE:
        out.append(
            f"truncated episodes rising: {trunc[0]:.2f} → {trunc[2]:.2f} over 3 iterations; the policy "
            "is running into its budgets"
        )
    if now.get("rejection_attempts") and not now.get("rejection_accepted"):
        out.append(
            f"rejection sampling accepted none of {int(now['rejection_attempts'])} episodes: this iteration "
            "trained nothing; the student does not yet solve these tasks (a warm start, an easier task "
            "or more episodes per task would give it demonstrations)"
        )
    vals = [
        (h["reward_mean"], h["val_success"])
        for h in history
        if _num(h.get("val_success")) and _num(h.get("reward_mean"))
    ]
    if _num(now.get("val_success")) and len(vals) >= 3:
        (r0, v0), (r1, v1) = vals[-3], vals[-1]
        if r1 > r0 + 0.05 and v1 <= v0:
            out.append(
                f"training reward rose {r0:.2f} → {r1:.2f} while validation success went {v0:.2f} → "
                f"{v1:.2f}: possible reward hacking or overfitting to training problems; read trajectories"
            )
    return out


def _num(x: object) -> TypeGuard[float]:
    """A finite number (not None, NaN, ±inf or a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

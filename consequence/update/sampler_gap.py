"""The gap between the policy that sampled a batch (μ) and the trainer's π_old, and masked IS.

μ is what the sampler reported while it generated: an older policy version (an
asynchronous rollout worker, docs/async.md), another engine (vLLM), or the same weights
through other kernels. π_old is the trainer's recomputation, with its current weights,
just before the first optimizer step on the batch. Their per-token ratio r = π_old / μ is
the importance weight of the decoupled objective (Fu et al. 2025, AReaL §5.2: the PPO clip
is taken against π_old, the behaviour gap is corrected by r). Two corrections of it:

    TIS      weight each token by min(r, C)                          (regularizers.tis_weights)
    masked   drop tokens with r outside [low, high], or whole rows whose geometric-mean
             ratio exp(mean log r) lies outside it; the kept tokens are not reweighted
             (the rejection half alone)

Both together (``--is-mask token --tis-cap high``) weight every kept token by r and drop the
rest: the token-level masked importance sampling r·1[r in band] of Liu et al. 2025, "When
Speed Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch" (§4;
the sequence level with ``--is-mask sequence`` masks rows, TIS still weights tokens).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from consequence.records import TrainingRow

__all__ = ["apply_is_mask", "is_mask_keep", "sampler_gap_metrics"]


def is_mask_keep(
    old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, low: float, high: float, level: str
) -> Tensor:
    """Which target tokens of one row masked importance sampling keeps.

    Args:
        old_logprobs: [T] float logπ_old (the trainer's recomputation), aligned with the row's input_ids.
        sampler_logprobs: [T] float logμ (the sampler's, same positions).
        mask: [T] loss mask (> 0 on target tokens).
        low, high: the band of r = π_old / μ that is kept, 0 < low < 1 < high.
        level: ``"token"`` (each token by its own r) or ``"sequence"`` (the row is kept whole
            when exp(mean over its targets of log r) is in the band, else dropped whole).

    Returns:
        [T] bool, detached: True = the token stays in the loss (False off target).

    Raises:
        ValueError: an unknown level, a band that does not contain 1, or shapes that differ.
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"masked IS level must be 'token' or 'sequence', got {level!r}")
    if not 0 < low < 1 < high:
        raise ValueError(f"masked IS band must satisfy 0 < low < 1 < high, got [{low}, {high}]")
    if old_logprobs.shape != sampler_logprobs.shape or old_logprobs.shape != mask.shape:
        raise ValueError(
            f"old_logprobs {tuple(old_logprobs.shape)}, sampler_logprobs "
            f"{tuple(sampler_logprobs.shape)} and mask {tuple(mask.shape)} must have one shape"
        )
    with torch.no_grad():
        on = mask > 0
        log_r = torch.where(on, old_logprobs - sampler_logprobs, torch.zeros_like(old_logprobs))
        lo, hi = math.log(low), math.log(high)
        if level == "token":
            return on & (log_r >= lo) & (log_r <= hi)
        mean = log_r.sum() / on.sum().clamp(min=1)
        return on & bool((mean >= lo) & (mean <= hi))


def apply_is_mask(
    rows: Sequence[TrainingRow], sampler_logprobs: Sequence[Sequence[float]], low: float, high: float, level: str
) -> tuple[list[TrainingRow], dict[str, float]]:
    """Rows whose loss masks leave out what masked IS rejects (:func:`is_mask_keep`).

    The rows' ``old_logprobs`` must be the trainer's recomputation. A rejected token leaves
    the loss entirely, denominators included (the step's totals count only kept targets): it
    is treated as never sampled, not as a zero-weight sample that would shrink the gradient.

    Returns:
        (new rows, ``{"is_masked_token_fraction": masked / target tokens,
        "is_masked_rows": rows with every target masked}``).
    """
    out, masked, total, rows_out = [], 0, 0, 0
    for r, mu in zip(rows, sampler_logprobs):
        mask = torch.tensor(r.loss_mask)
        keep = is_mask_keep(
            torch.tensor(r.old_logprobs, dtype=torch.float64),
            torch.tensor(mu, dtype=torch.float64),
            mask,
            low,
            high,
            level,
        )
        n_on, n_keep = int((mask > 0).sum()), int(keep.sum())
        masked, total = masked + n_on - n_keep, total + n_on
        rows_out += int(n_on > 0 and n_keep == 0)
        out.append(dataclasses.replace(r, loss_mask=[int(k) for k in keep.tolist()]) if n_keep < n_on else r)
    return out, {"is_masked_token_fraction": masked / total if total else 0.0, "is_masked_rows": float(rows_out)}


def sampler_gap_metrics(
    old_logprobs: Sequence[Sequence[float]],
    sampler_logprobs: Sequence[Sequence[float]],
    masks: Sequence[Sequence[int]],
    low: float | None = None,
    high: float | None = None,
) -> dict[str, float]:
    """The behaviour ratio r = π_old / μ over every target token of a batch.

    Args:
        old_logprobs, sampler_logprobs, masks: per row, aligned with its ``input_ids``
            (``TrainingRow.old_logprobs`` as sampled, the trainer's recomputation, the loss mask).
        low, high: when given, the share of target tokens whose r lies outside [low, high]
            is reported (what token-level masked IS would drop).

    Returns:
        ``is_ratio_mean`` / ``is_ratio_min`` / ``is_ratio_max`` of r, and
        ``sampler_trainer_kl``: KL(μ ‖ π_old) in nats per token estimated on μ's own samples
        with k3 = r − 1 − log r (Schulman 2020, "Approximating KL divergence"; ≥ 0, unbiased);
        ``is_ratio_outside_band`` with a band. Empty dict when the batch has no target token.
    """
    olds, mus = [], []
    for o, m, k in zip(old_logprobs, sampler_logprobs, masks):
        on = torch.tensor(k) > 0
        olds.append(torch.tensor(o, dtype=torch.float64)[on])
        mus.append(torch.tensor(m, dtype=torch.float64)[on])
    if not olds or sum(x.numel() for x in olds) == 0:
        return {}
    log_r = torch.cat(olds) - torch.cat(mus)
    r = log_r.exp()
    out = {
        "is_ratio_mean": float(r.mean()),
        "is_ratio_min": float(r.min()),
        "is_ratio_max": float(r.max()),
        "sampler_trainer_kl": float((r - 1 - log_r).mean()),
    }
    if low is not None and high is not None:
        out["is_ratio_outside_band"] = float(((r < low) | (r > high)).double().mean())
    return out

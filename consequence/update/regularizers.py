"""Terms that modify the surrogate: KL to a reference, truncated importance sampling,
off-policy sequence masking (update box, docs/design.md §5).

All inputs are per-token [N, T] float32 log-probs of the sampled target tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from consequence.credit.kl import KL_ESTIMATORS, kl_estimate  # noqa: F401  (one definition, used by both boxes)


def tis_weights(
    old_logprobs: Tensor, sampler_logprobs: Tensor, cap: float = 2.0, *, mask: Tensor | None = None
) -> Tensor:
    """Truncated importance-sampling weights sg(min(π_old / μ, C)) per token.

    Corrects for the sampler (μ, e.g. an inference engine) and the trainer's recomputation
    of the same behaviour policy (π_old) giving different probabilities (Yao et al. 2025,
    "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training", §2).

    Args:
        old_logprobs: [N, T] logπ_old recomputed by the trainer.
        sampler_logprobs: [N, T] logμ reported by the sampler.
        cap: C > 0.
        mask: [N, T] loss mask (> 0 = target) or None (every position is a target). Off
            the mask the log-ratio is replaced by 0 before exp, so the weight there is
            min(1, C) whatever the two log-probs hold (±inf, NaN): a NaN weight times an
            objective of 0 would still be a NaN gradient.

    Returns:
        [N, T] float32 weights in (0, C], detached.

    Raises:
        ValueError: cap not positive or shapes differ.
    """
    if cap <= 0:
        raise ValueError(f"TIS cap C must be positive, got {cap}")
    if old_logprobs.shape != sampler_logprobs.shape:
        raise ValueError("old_logprobs and sampler_logprobs differ in shape")
    if mask is not None and mask.shape != old_logprobs.shape:
        raise ValueError(f"mask {tuple(mask.shape)} and old_logprobs {tuple(old_logprobs.shape)} differ")
    with torch.no_grad():
        log_r = old_logprobs - sampler_logprobs
        if mask is not None:
            log_r = torch.where(mask > 0, log_r, torch.zeros_like(log_r))
        return torch.exp(log_r).clamp(max=cap)


def offpolicy_sequence_mask(
    logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor, mask: Tensor, delta: float
) -> Tensor:
    """Rows to drop: negative advantage AND large divergence from the behaviour policy.

    KL(μ ‖ π_θ) of row i is estimated by the mean over its targets of logμ − logπ_θ; a
    row with A_i < 0 and estimate > delta is masked (DeepSeek-AI 2025, DeepSeek-V3.2
    §3.1, "off-policy sequence masking": such sequences push the policy away from
    samples it no longer produces).

    Args:
        logprobs, behaviour_logprobs, mask: [N, T]; advantages: [N] or [N, T] (a row's
            advantage is its mean over targets).
        delta: threshold in nats per token (> 0).

    Returns:
        [N] bool, True = drop the row, detached.
    """
    with torch.no_grad():
        m = mask > 0
        L = m.sum(-1).clamp(min=1)
        diff = torch.where(m, behaviour_logprobs - logprobs, torch.zeros_like(logprobs))
        kl = diff.sum(-1) / L
        adv = torch.as_tensor(advantages, dtype=logprobs.dtype, device=logprobs.device)
        if adv.dim() == 2:
            adv = torch.where(m, adv, torch.zeros_like(adv)).sum(-1) / L
        return (adv < 0) & (kl > delta)

"""KL estimators between the policy and a reference, per sampled token (Schulman 2020).

One definition for both uses: the credit box's KL reward penalty and the update box's
KL loss term (``consequence.update.regularizers`` re-exports it).
"""

from __future__ import annotations

import torch
from torch import Tensor

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from tokens sampled from π_θ.

    With log r = logπ_θ − logπ_ref (Schulman 2020, "Approximating KL Divergence"):
    k1 = log r (unbiased, high variance, can be negative), k2 = ½ (log r)²,
    k3 = (e^{−log r} − 1) + log r (unbiased, always ≥ 0; the GRPO paper's choice,
    Shao et al. 2024, §4.1, eq. 4).

    Args:
        logprobs: [N, T] logπ_θ (gradient flows through it).
        ref_logprobs: [N, T] logπ_ref of the same tokens (no gradient).
        estimator: one of :data:`KL_ESTIMATORS`.

    Returns:
        [N, T] float32 estimate (differentiable in ``logprobs``).

    Raises:
        ValueError: unknown estimator or shapes differ.
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} differ")
    log_r = logprobs - ref_logprobs.detach()
    if estimator == "k1":
        return log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        return torch.expm1(-log_r) + log_r
    raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")

"""KL estimators between the policy and a reference, per sampled token (Schulman 2020).

One definition for both uses: the credit box's KL reward penalty and the update box's
KL loss term (``consequence.update.regularizers`` re-exports it). With a frozen teacher in
place of the reference, the negated k1 is the dense per-token advantage of on-policy
distillation (:func:`reverse_kl_advantages`).
"""

from __future__ import annotations

import torch
from torch import Tensor

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3", *, mask: Tensor | None = None) -> Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from tokens sampled from π_θ.

    With log r = logπ_θ − logπ_ref (Schulman 2020, "Approximating KL Divergence"):
    k1 = log r (unbiased, high variance, can be negative), k2 = ½ (log r)²,
    k3 = (e^{−log r} − 1) + log r (unbiased, always ≥ 0; the GRPO paper's choice,
    Shao et al. 2024, §4.1, eq. 4).

    Args:
        logprobs: [N, T] logπ_θ (gradient flows through it).
        ref_logprobs: [N, T] logπ_ref of the same tokens (no gradient).
        estimator: one of :data:`KL_ESTIMATORS`.
        mask: [N, T] loss mask (> 0 = target) or None (every position is a target). Off
            the mask both log-probs are replaced by 0 BEFORE the estimator, so the estimate
            there is 0 with no gradient whatever they held: k3's e^{−log r} of a reference
            log-prob of 1e4 is inf, and the backward pass of a mask multiplied in
            afterwards would be 0 · inf = NaN.

    Returns:
        [N, T] float32 estimate (differentiable in ``logprobs``).

    Raises:
        ValueError: unknown estimator or shapes differ.
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} differ")
    ref_logprobs = ref_logprobs.detach()
    if mask is not None:
        if mask.shape != logprobs.shape:
            raise ValueError(f"mask {tuple(mask.shape)} and logprobs {tuple(logprobs.shape)} differ")
        m = mask > 0
        logprobs = torch.where(m, logprobs, torch.zeros_like(logprobs))
        ref_logprobs = torch.where(m, ref_logprobs, torch.zeros_like(ref_logprobs))
    log_r = logprobs - ref_logprobs
    if estimator == "k1":
        return log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        return torch.expm1(-log_r) + log_r
    raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")


def reverse_kl_advantages(
    student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """Dense per-token advantages of on-policy distillation: ``A_t = log p_T(y_t) − log q(y_t)``.

    The negative of the sampled-token reverse-KL estimate ``k1_t = log q(y_t) − log p_T(y_t)``
    (Schulman 2020's k1 for KL(q ‖ p_T)): a token the teacher finds likelier than the student
    did is pushed up (on-policy distillation as in tinker-cookbook, verl and prime-rl;
    Agarwal et al. 2024 §3). Used as the advantage of a
    policy-gradient update (any surrogate), it minimises KL(q ‖ p) in expectation over the
    student's own samples.

    Args:
        student_logprobs: [N, T] float, log q of the sampled tokens (the behaviour policy's).
        teacher_logprobs: [N, T] float, log p_T of the same tokens.
        loss_mask: [N, T] {0, 1}, the student's target positions.

    Returns:
        (advantages [N, T] float32, detached, 0 off the mask; metrics ``reverse_kl``: the mean
        of k1 over target tokens, ``n_tokens``).

    Raises:
        ValueError: shapes differ, or the mask has no target.
    """
    if not (student_logprobs.shape == teacher_logprobs.shape == loss_mask.shape):
        raise ValueError(
            f"shapes differ: student {tuple(student_logprobs.shape)}, teacher "
            f"{tuple(teacher_logprobs.shape)}, mask {tuple(loss_mask.shape)}"
        )
    on = loss_mask > 0
    n = float(on.sum())
    if n == 0:
        raise ValueError("reverse_kl_advantages: the loss mask has no target token")
    # select, not multiply: a non-target position may hold ±inf or NaN (a prompt token the
    # sampler never scored), and inf · 0 = NaN would reach the advantages and the metric
    zero = torch.zeros((), dtype=torch.float32)
    student = torch.where(on, student_logprobs.float().detach(), zero)
    k1 = student - torch.where(on, teacher_logprobs.float().detach(), zero)
    return -k1, {"reverse_kl": float(k1.sum()) / n, "n_tokens": n}

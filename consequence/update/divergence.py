"""Per-token divergences between a student and a frozen teacher (a loss term of the update box;
the distillation box re-exports them).

Two kinds of supervision at every student target position t (the teacher scores the
student's own context, on-policy or not):

- a **scalar**: the sampled-token estimate of the reverse KL,
  ``k1_t = log q_θ(y_t | ·) − log p_T(y_t | ·)`` (q = student, p = teacher, y_t the
  sampled token), whose negative is a dense per-token advantage
  (:func:`consequence.credit.kl.reverse_kl_advantages`; the on-policy distillation of tinker-cookbook, verl and
  prime-rl; Agarwal et al. 2024 §3 with the sampled-token estimator);
- the teacher's **distribution**: a full divergence over the vocabulary at temperature τ
  (both logits divided by τ), optionally restricted to the teacher's top-k tokens (both
  distributions renormalised over those k):

  - forward KL(p ‖ q) = Σ_v p_v (log p_v − log q_v)  (mode covering; SFT on soft labels),
  - reverse KL(q ‖ p) = Σ_v q_v (log q_v − log p_v)  (mode seeking),
  - generalised JSD_β(p ‖ q) = β KL(p ‖ m) + (1 − β) KL(q ‖ m), m = β p + (1 − β) q
    (GKD, Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
    Self-Generated Mistakes", §3.1 eq. 2; β = 0 and β = 1 are 0 — this module then
    returns forward KL (β = 0) and reverse KL (β = 1), as TRL's GKD loss does, so β moves
    from one to the other).

All functions work on float32 logits [N, T, V] and return [N, T] float32 (nats), to be
reduced with the loss mask like any per-token term.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

__all__ = ["token_divergence"]

Kind = Literal["forward", "reverse", "jsd"]


def _log_probs(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    s = student_logits.float() / temperature
    t = teacher_logits.float() / temperature
    if top_k:
        idx = t.topk(top_k, dim=-1).indices  # the teacher's k most likely tokens
        s, t = s.gather(-1, idx), t.gather(-1, idx)
    return F.log_softmax(s, -1), F.log_softmax(t, -1)


def token_divergence(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    kind: Kind = "reverse",
    beta: float = 0.5,
    temperature: float = 1.0,
    top_k: int = 0,
    *,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Divergence between teacher p and student q at every position (module doc).

    Args:
        student_logits: [N, T, V] (or [T, V]) float, differentiable.
        teacher_logits: same shape, float; detached here (the teacher is frozen).
        kind: ``"forward"`` KL(p‖q), ``"reverse"`` KL(q‖p) or ``"jsd"`` JSD_β.
        beta: β of ``"jsd"`` in [0, 1] (0: forward KL, 1: reverse KL).
        temperature: τ > 0 applied to both logits.
        top_k: 0 = the whole vocabulary; k ≥ 1 = the teacher's top k tokens, renormalised.
        mask: [N, T] loss mask (> 0 = target) or None (every position counts). Off the mask
            both logits are replaced by 0 before the softmaxes, so the divergence there is
            exactly 0 with no gradient, whatever the logits held (±inf or NaN logits give
            NaN log-softmaxes, and 0 · NaN is NaN in the backward pass).

    Returns:
        [N, T] float32 divergences in nats (≥ 0).

    Raises:
        ValueError: shapes differ, an unknown kind, β outside [0, 1], τ ≤ 0, top_k
            negative or above the vocabulary, or a mask of another shape than [N, T].
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} differ: teacher and student must share the tokenizer"
        )
    if kind not in ("forward", "reverse", "jsd"):
        raise ValueError(f"divergence kind {kind!r}: use forward, reverse or jsd")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"JSD beta {beta}: must be in [0, 1] (0 = forward KL, 1 = reverse KL)")
    if temperature <= 0:
        raise ValueError(f"distillation temperature {temperature}: must be > 0")
    if not 0 <= top_k <= student_logits.shape[-1]:
        raise ValueError(f"top_k {top_k}: must be 0 (whole vocabulary) or 1..{student_logits.shape[-1]}")
    if mask is not None and mask.shape != student_logits.shape[:-1]:
        raise ValueError(
            f"mask {tuple(mask.shape)} does not match the logits' positions "
            f"{tuple(student_logits.shape[:-1])}; pass the loss mask of the same positions"
        )
    out = _divergence(student_logits, teacher_logits.detach(), kind, beta, temperature, top_k, mask)
    # exactly 0 off the mask (JSD's log m of two equal uniforms is only log(1/V) to rounding)
    return out if mask is None else torch.where(mask > 0, out, torch.zeros_like(out))


def _divergence(student_logits, teacher_logits, kind, beta, temperature, top_k, mask):
    """:func:`token_divergence` after its checks, logits selected to 0 off the mask first."""
    if mask is not None:
        keep = (mask > 0).unsqueeze(-1)
        student_logits = torch.where(keep, student_logits, torch.zeros_like(student_logits))
        teacher_logits = torch.where(keep, teacher_logits, torch.zeros_like(teacher_logits))
    lq, lp = _log_probs(student_logits, teacher_logits, temperature, top_k)
    if kind == "jsd" and beta == 0.0:
        kind = "forward"
    elif kind == "jsd" and beta == 1.0:
        kind = "reverse"
    if kind == "forward":
        return (lp.exp() * (lp - lq)).sum(-1)
    if kind == "reverse":
        return (lq.exp() * (lq - lp)).sum(-1)
    # log m = log(β p + (1 − β) q), computed in log space
    lm = torch.logsumexp(torch.stack([lp + torch.log(torch.tensor(beta)), lq + torch.log(torch.tensor(1 - beta))]), 0)
    return beta * (lp.exp() * (lp - lm)).sum(-1) + (1 - beta) * (lq.exp() * (lq - lm)).sum(-1)

"""Reductions of per-token objectives to one scalar (update box, docs/design.md §5).

The per-token objectives themselves live in :mod:`consequence.update.surrogates`.

Sign convention: the functions here return OBJECTIVES (to be maximised). The loss that
is minimised by the optimizer is ``loss = -reduce_tokens(objective, mask, ...)``; e.g.
GRPO rewards (1,0,0,0), lengths (2,4,4,6), ρ = 1 give objective −1/(2√3) with
``token_mean`` and hence loss +1/(2√3) ≈ 0.2887 (docs/design.md §8).

A reduction is defined over the whole optimizer step: a micro-batch passes the step's
global totals so that the sum of the micro-batches' reduced values (and gradients)
equals the unsplit batch's (docs/cases.md, case 01).
"""

from __future__ import annotations

import torch
from torch import Tensor

REDUCTIONS: tuple[str, ...] = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def reduce_tokens(
    per_token: Tensor,
    mask: Tensor,
    reduction: str,
    *,
    total_tokens: float | None = None,
    total_seqs: float | None = None,
    norm_const: float | None = None,
) -> Tensor:
    """Reduce per-token terms u_ik with target mask m_ik to one scalar (docs/design.md §5).

    - ``"token_mean"``: Σ_i Σ_k m u / total_tokens (DAPO, Yu et al. 2025, §3.3).
    - ``"seq_mean_token_mean"``: Σ_i (1/L_i) Σ_k m u / total_seqs (GRPO, Shao et al.
      2024, DeepSeekMath §4.1, eq. 3).
    - ``"seq_mean_token_sum_norm"``: Σ_i Σ_k m u / (norm_const · total_seqs) (Dr.GRPO,
      Liu et al. 2025, §3).

    with L_i = Σ_k m_ik. The totals are those of the WHOLE optimizer step; a micro-batch
    passes them so that summing micro-batch values equals the unsplit value (case 01).
    When omitted they come from this batch: ``total_tokens`` = Σ m, ``total_seqs`` = the
    number of rows with at least one target (rows without targets carry no signal and
    add nothing), ``norm_const`` = the largest L_i. Masked-out positions never enter the
    result, even if they hold NaN/inf.

    Args:
        per_token: [N, T] float tensor of per-token terms.
        mask: [N, T] target mask (float or bool; 1 = target).
        reduction: one of :data:`REDUCTIONS`.

    Returns:
        scalar float tensor (0 with a graph attached when there are no targets).

    Raises:
        ValueError: unknown reduction, shape mismatch, or a non-positive total.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; valid: {', '.join(REDUCTIONS)}")
    if per_token.shape != mask.shape:
        raise ValueError(f"per_token {tuple(per_token.shape)} and mask {tuple(mask.shape)} differ")
    m = mask.to(per_token.dtype)
    u = torch.where(m > 0, per_token, torch.zeros_like(per_token)) * m
    L = m.sum(dim=-1)  # [N]
    if reduction == "token_mean":
        denom = float(L.sum().item()) if total_tokens is None else float(total_tokens)
        if denom == 0.0:
            return u.sum() * 0.0
        if denom < 0:
            raise ValueError(f"total_tokens must be positive, got {total_tokens}")
        return u.sum() / denom
    n_seqs = float((L > 0).sum().item()) if total_seqs is None else float(total_seqs)
    if n_seqs == 0.0:
        return u.sum() * 0.0
    if n_seqs < 0:
        raise ValueError(f"total_seqs must be positive, got {total_seqs}")
    if reduction == "seq_mean_token_mean":
        per_seq = u.sum(dim=-1) / L.clamp(min=1.0)
        return per_seq.sum() / n_seqs
    c = float(L.max().item()) if norm_const is None else float(norm_const)
    if c <= 0:
        raise ValueError(f"norm_const must be positive, got {norm_const}")
    return u.sum() / (c * n_seqs)

"""Per-token surrogate objectives (update box, docs/design.md §5).

Every surrogate returns an OBJECTIVE per token (to be maximised), the detached ratio it
used and where clipping removed the token's gradient. The reduction to one scalar is
:func:`consequence.update.losses.reduce_tokens`; ``loss = −reduce(objective)``.

Shapes: ``logprobs`` / ``old_logprobs`` [N, T] float32 (logπ_θ with gradient, logπ_old
without), ``advantages`` [N] (one per sequence, broadcast over T) or [N, T], ``mask``
[N, T] (1 = target token). ρ = exp(logπ_θ − logπ_old) per token.

Masked positions never reach an exp, a log or a division: every surrogate takes the loss
mask (``mask=``) and replaces log-probs, old log-probs and advantages off the mask by 0
with ``torch.where`` BEFORE computing. A position outside the mask may hold anything (an
old log-prob of −1e4 or ±inf from an endpoint, NaN, an advantage of 1e30); multiplying by
the mask afterwards is not enough: exp(1e4) = inf, and the backward pass of ``inf · 0``
is NaN even though the forward value is finite (``tests/update/test_masked_positions.py``).
Without ``mask`` every position counts as a target.

| name | per-token objective | source |
|---|---|---|
| ``pg`` | A · logπ_θ | Williams 1992 (REINFORCE) |
| ``ppo_clip`` | min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A) | Schulman et al. 2017, eq. 7; DAPO §3.1 for ε_high |
| ``dual_clip`` | ppo_clip, and for A < 0 at least c·A | Ye et al. 2020, "Mastering Complex Control in MOBA Games", §3.2 |
| ``gspo`` | min(s_i A_i, clip(s_i)A_i), s_i = exp(mean_t(logπ_θ − logπ_old)) | Zheng et al. 2025, GSPO §4.1, eq. 5–7 |
| ``gspo_token`` | as gspo with s_it = sg(s_i)·π_θ(y_t)/sg(π_θ(y_t)) | GSPO §4.3, eq. 13 |
| ``cispo`` | sg(clip(ρ, 1−ε_low, 1+ε_high)) · A · logπ_θ | MiniMax-M1 2025, §3.1, eq. 4 |
"""

from __future__ import annotations

from typing import overload

import torch
from torch import Tensor

SURROGATES: tuple[str, ...] = ("pg", "ppo_clip", "dual_clip", "gspo", "gspo_token", "cispo")


def _broadcast_adv(advantages: Tensor, like: Tensor) -> Tensor:
    adv = torch.as_tensor(advantages, dtype=like.dtype, device=like.device)
    if adv.dim() == 1:
        if adv.shape[0] != like.shape[0]:
            raise ValueError(f"advantages [{adv.shape[0]}] do not match {tuple(like.shape)} rows")
        adv = adv.unsqueeze(-1)
    elif adv.shape != like.shape:
        raise ValueError(f"advantages {tuple(adv.shape)} do not match {tuple(like.shape)}")
    return adv.expand_as(like)


def _check_pair(logprobs: Tensor, old_logprobs: Tensor) -> None:
    if logprobs.shape != old_logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and old_logprobs {tuple(old_logprobs.shape)} differ")


@overload
def _select(
    mask: Tensor | None, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor
) -> tuple[Tensor, Tensor, Tensor]: ...
@overload
def _select(
    mask: Tensor | None, logprobs: Tensor, old_logprobs: None, advantages: Tensor
) -> tuple[Tensor, None, Tensor]: ...
def _select(
    mask: Tensor | None, logprobs: Tensor, old_logprobs: Tensor | None, advantages: Tensor
) -> tuple[Tensor, Tensor | None, Tensor]:
    """(logprobs, old_logprobs, advantages [N, T]) with every non-target position set to 0.

    Done on the INPUTS, before any exp: ``torch.where``'s backward gives exactly 0 to the
    unselected branch, whereas a mask multiplied in afterwards meets exp(huge) = inf there
    and 0 · inf = NaN in the backward pass. Advantages are broadcast to [N, T] first, so a
    row without targets may carry any advantage too.
    """
    adv = _broadcast_adv(advantages, logprobs)
    if mask is None:
        return logprobs, old_logprobs, adv
    if mask.shape != logprobs.shape:
        raise ValueError(
            f"mask {tuple(mask.shape)} and logprobs {tuple(logprobs.shape)} differ; "
            "pass the loss mask of the same [N, T] positions"
        )
    m = mask > 0
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    old = None if old_logprobs is None else torch.where(m, old_logprobs, zero.to(old_logprobs.dtype))
    return torch.where(m, logprobs, zero), old, torch.where(m, adv, zero)


def clipped_surrogate(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    *,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO clipped surrogate per token (Schulman et al. 2017, eq. 7), asymmetric clip.

    ρ = exp(logπ_θ − logπ_old); objective = min(ρA, clip(ρ, 1−eps_low, 1+eps_high)·A).
    ``eps_low = eps_high = 0.2`` is PPO; ``eps_high = 0.28`` is DAPO clip-higher (Yu et
    al. 2025, §3.1). Example: ρ = 1.3, ε = 0.2 gives 2.078 for A = 1.732 and −0.750 for
    A = −0.577 (docs/design.md §8).

    Args:
        logprobs: [N, T] float32, logπ_θ of the target tokens (carries the gradient).
        old_logprobs: [N, T] float32, logπ_old of the same tokens (no gradient needed).
        advantages: [N, T] or [N] (broadcast over T) float32.
        eps_low, eps_high: clip range [1 − eps_low, 1 + eps_high].
        mask: [N, T] loss mask (> 0 = target), or None (every position is a target).
            Off the mask the inputs are replaced by 0 before exp (module doc), so those
            positions hold ρ = 1, objective 0 and give no gradient whatever they stored.

    Returns:
        (objective [N, T] float32 — to MAXIMISE,
         ratio [N, T] float32 — detached,
         is_clipped [N, T] bool — True where the clipped branch is active and the token
         gives no gradient: A > 0 and ρ > 1+eps_high, or A < 0 and ρ < 1−eps_low).

    Raises:
        ValueError: shapes (log-probs, advantages, mask) do not match.
    """
    _check_pair(logprobs, old_logprobs)
    logprobs, old_logprobs, adv = _select(mask, logprobs, old_logprobs, advantages)
    ratio = torch.exp(logprobs - old_logprobs)
    return _clip(ratio, adv, eps_low, eps_high)


def _clip(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor, Tensor]:
    clip_high = (adv > 0) & (ratio > 1.0 + eps_high)
    clip_low = (adv < 0) & (ratio < 1.0 - eps_low)
    is_clipped = clip_high | clip_low
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high).detach() * adv
    # Equal in value to min(ρA, clip(ρ)A); written with where so the active branch and
    # its (zero) gradient are explicit rather than relying on min's tie-breaking.
    objective = torch.where(is_clipped, clipped, ratio * adv)
    return objective, ratio.detach(), is_clipped


def policy_gradient_objective(logprobs: Tensor, advantages: Tensor, *, mask: Tensor | None = None) -> Tensor:
    """Vanilla policy-gradient objective per token, A · logπ_θ (REINFORCE; Williams 1992).

    Args:
        logprobs: [N, T] float32 logπ_θ of the target tokens.
        advantages: [N, T] or [N] float32.
        mask: [N, T] loss mask or None (all targets); off the mask log-prob and advantage
            are replaced by 0 first (module doc): objective 0, no gradient.

    Returns:
        [N, T] float32 objective to MAXIMISE (its gradient is A ∇logπ).
    """
    logprobs, _, adv = _select(mask, logprobs, None, advantages)
    return adv * logprobs


def dual_clip_surrogate(logprobs, old_logprobs, advantages, eps_low=0.2, eps_high=0.2, c=3.0, *, mask=None):
    """PPO clip with a second bound for negative advantages (Ye et al. 2020, §3.2).

    For A < 0: objective = max(min(ρA, clip(ρ)A), c·A), so a token whose ratio has grown
    past c cannot make the loss unboundedly large and gives no gradient. ``c > 1``.
    Shapes, ``mask`` and returns as :func:`clipped_surrogate`; ``is_clipped`` also marks
    tokens held at c·A.

    Raises:
        ValueError: shapes differ or ``c <= 1``.
    """
    if c <= 1.0:
        raise ValueError(f"dual-clip constant c must be > 1, got {c}")
    _check_pair(logprobs, old_logprobs)
    logprobs, old_logprobs, adv = _select(mask, logprobs, old_logprobs, advantages)
    obj, ratio, is_clipped = clipped_surrogate(logprobs, old_logprobs, adv, eps_low, eps_high)
    floor = (adv < 0) & (obj < c * adv)
    obj = torch.where(floor, (c * adv).detach(), obj)
    return obj, ratio, is_clipped | floor


def _seq_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """[N, 1] mean over target tokens of logπ_θ − logπ_old (0 for a row without targets)."""
    m = mask > 0
    diff = torch.where(m, logprobs - old_logprobs, torch.zeros_like(logprobs))
    L = m.sum(-1, keepdim=True).clamp(min=1).to(logprobs.dtype)
    return diff.sum(-1, keepdim=True) / L


def _seq_advantage(advantages: Tensor, like: Tensor, name: str) -> Tensor:
    adv = torch.as_tensor(advantages, dtype=like.dtype, device=like.device)
    if adv.dim() != 1:
        raise ValueError(f"{name} needs one advantage per sequence ([N]), got shape {tuple(adv.shape)}")
    return _broadcast_adv(adv, like)


def gspo_surrogate(logprobs, old_logprobs, advantages, mask, eps_low=3e-4, eps_high=4e-4):
    """GSPO sequence-level clipped objective (Zheng et al. 2025, §4.1, eq. 5–7).

    s_i = exp((1/L_i) Σ_t m_it (logπ_θ − logπ_old)) is clipped as a whole; every target
    token of sequence i carries the same value min(s_i A_i, clip(s_i)A_i), so the
    ``seq_mean_token_mean`` reduction gives the paper's mean over sequences. The paper's
    ranges are tiny (3e-4 / 4e-4) because s_i is a geometric mean.

    Args:
        mask: [N, T] target mask; advantages must be [N] (one per sequence). Off the mask
            the inputs are replaced by 0 before anything is computed (module doc).

    Returns:
        (objective [N, T], sequence ratio s_i broadcast [N, T] detached, is_clipped [N, T]).

    Raises:
        ValueError: shapes differ or advantages are per token.
    """
    _check_pair(logprobs, old_logprobs)
    adv = _seq_advantage(advantages, logprobs, "gspo")
    logprobs, old_logprobs, adv = _select(mask, logprobs, old_logprobs, adv)
    s = torch.exp(_seq_log_ratio(logprobs, old_logprobs, mask)).expand_as(logprobs)
    return _clip(s, adv, eps_low, eps_high)


def gspo_token_surrogate(logprobs, old_logprobs, advantages, mask, eps_low=3e-4, eps_high=4e-4):
    """GSPO-token (Zheng et al. 2025, §4.3, eq. 13): s_it = sg(s_i) · π_θ(y_t)/sg(π_θ(y_t)).

    Its value is s_i at every token, its gradient s_i A_it ∇logπ_θ(y_t): with one
    advantage per sequence it equals :func:`gspo_surrogate` in value and gradient, and it
    also accepts per-token advantages [N, T].

    Returns:
        as :func:`gspo_surrogate`.
    """
    _check_pair(logprobs, old_logprobs)
    logprobs, old_logprobs, adv = _select(mask, logprobs, old_logprobs, advantages)
    log_s = _seq_log_ratio(logprobs, old_logprobs, mask).detach()
    # logπ − sg(logπ) is 0 in value; it needs the selection above (−inf − (−inf) = NaN)
    s_t = torch.exp(log_s + logprobs - logprobs.detach())
    return _clip(s_t, adv, eps_low, eps_high)


def cispo_surrogate(logprobs, old_logprobs, advantages, eps_low=1.0, eps_high=0.28, *, mask=None):
    """CISPO (MiniMax-M1, Chen et al. 2025, §3.1, eq. 4): sg(clip(ρ, 1−ε_low, 1+ε_high)) · A · logπ_θ.

    The clipped ratio is a detached weight, so every token keeps a gradient, which
    flows through logπ_θ only (unlike PPO, where a clipped token gives none).
    ``eps_low = 1`` (no lower bound) is the paper's choice. ``mask`` as in
    :func:`clipped_surrogate`.

    Returns:
        (objective [N, T], ratio [N, T] detached, is_clipped [N, T]: weight was clipped).
    """
    _check_pair(logprobs, old_logprobs)
    logprobs, old_logprobs, adv = _select(mask, logprobs, old_logprobs, advantages)
    ratio = torch.exp(logprobs - old_logprobs).detach()
    weight = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    is_clipped = (ratio > 1.0 + eps_high) | (ratio < 1.0 - eps_low)
    return weight * adv * logprobs, ratio, is_clipped


def surrogate_objective(
    name: str,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip_c: float = 3.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Dispatch to the surrogate ``name`` (one of :data:`SURROGATES`; table in the module doc).

    Returns:
        (objective [N, T] to maximise, ratio [N, T] detached, is_clipped [N, T] bool).

    Raises:
        ValueError: unknown name, or the surrogate's own shape errors.
    """
    if mask.shape != logprobs.shape:
        raise ValueError(f"mask {tuple(mask.shape)} and logprobs {tuple(logprobs.shape)} differ")
    _check_pair(logprobs, old_logprobs)
    if name == "pg":
        # Non-target positions may hold -inf (outside a top-k/top-p support) or anything
        # else: every surrogate selects them out before exp (module doc).
        lp, old, _ = _select(mask, logprobs, old_logprobs, advantages)
        ratio = torch.exp(lp - old).detach()
        return (
            policy_gradient_objective(logprobs, advantages, mask=mask),
            ratio,
            torch.zeros_like(mask, dtype=torch.bool),
        )
    if name == "ppo_clip":
        return clipped_surrogate(logprobs, old_logprobs, advantages, eps_low, eps_high, mask=mask)
    if name == "dual_clip":
        return dual_clip_surrogate(logprobs, old_logprobs, advantages, eps_low, eps_high, dual_clip_c, mask=mask)
    if name == "gspo":
        return gspo_surrogate(logprobs, old_logprobs, advantages, mask, eps_low, eps_high)
    if name == "gspo_token":
        return gspo_token_surrogate(logprobs, old_logprobs, advantages, mask, eps_low, eps_high)
    if name == "cispo":
        return cispo_surrogate(logprobs, old_logprobs, advantages, eps_low, eps_high, mask=mask)
    raise ValueError(f"unknown surrogate {name!r}; valid: {', '.join(SURROGATES)}")

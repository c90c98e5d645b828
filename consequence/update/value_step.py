"""One optimizer step of the critic (PPO's value head), clipped value loss.

Per target token: ½ · max((V − R)², (V_old + clip(V − V_old, −ε_v, ε_v) − R)²), averaged
over all target tokens of the step (token-mean over the whole step, so micro-batching
does not change the gradient). The clipped term is PPO's value clipping (Schulman et al.
2017 reference implementation; analysed in Engstrom et al. 2020, "Implementation
Matters in Deep Policy Gradients", §3).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from consequence.credit.value import ValueModel
from consequence.records import TrainingRow, pad_rows
from consequence.update.step import NonFiniteError


def _pad(values: Sequence[Sequence[float]], idx: Sequence[int], S: int) -> torch.Tensor:
    out = torch.zeros((len(idx), S), dtype=torch.float32)
    for j, i in enumerate(idx):
        out[j, : len(values[i])] = torch.tensor(values[i], dtype=torch.float32)
    return out


def value_step(
    critic: ValueModel,
    optimizer: torch.optim.Optimizer,
    rows: Sequence[TrainingRow],
    returns: Sequence[Sequence[float]],
    old_values: Sequence[Sequence[float]],
    pad_id: int,
    clip: float = 0.2,
    micro_batch_size: int = 32,
    max_grad_norm: float = 1.0,
) -> dict[str, float]:
    """Fit V to the GAE returns on every target token; one optimizer step.

    Args:
        rows: training rows (targets = generated tokens).
        returns: per row, value targets aligned with ``input_ids`` (from
            :func:`consequence.credit.returns.gae`).
        old_values: per row, the critic's values when the batch was collected, aligned
            the same way (position t = V of the state before token t).
        clip: ε_v of value clipping (``<= 0`` turns it off).

    Returns:
        ``value_n_tokens`` (targets fitted) and, when there was at least one target,
        ``value_loss`` (float, squared units of reward; the critic then stepped). The
        explained variance of V_old is a property of the whole batch, not of a step:
        :func:`consequence.credit.value.explained_variance`.

    Raises:
        ValueError: lengths differ.
        NonFiniteError (a FloatingPointError): a non-finite value loss (rows of its
            micro-batch) or critic gradient (all rows); the critic does not step.
    """
    if not (len(rows) == len(returns) == len(old_values)):
        raise ValueError(f"{len(rows)} rows, {len(returns)} returns, {len(old_values)} old values")
    n_tok = sum(sum(1 for m in r.loss_mask[1:] if m) for r in rows)
    optimizer.zero_grad(set_to_none=True)
    device = next(critic.parameters()).device
    loss_sum = 0.0
    for start in range(0, len(rows), micro_batch_size):
        idx = list(range(start, min(start + micro_batch_size, len(rows))))
        batch = pad_rows([rows[i] for i in idx], pad_id)
        S = batch["input_ids"].shape[1]
        mask = batch["loss_mask"][:, 1:].to(device) > 0
        if not mask.any():
            continue
        ret = _pad(returns, idx, S)[:, 1:].to(device)
        v_old = _pad(old_values, idx, S)[:, 1:].to(device)
        v = critic(batch["input_ids"].to(device), batch["attention_mask"].to(device))[:, :-1]
        # Select before squaring: a non-target position may hold a return or old value of
        # ±inf (or V may be NaN on padding); (V − inf)² selected away afterwards still sends
        # 0 · 2(V − inf) = NaN into the critic's gradient.
        zero = torch.zeros((), dtype=v.dtype, device=device)
        v, ret, v_old = (torch.where(mask, x, zero) for x in (v, ret, v_old))
        loss_tok = (v - ret) ** 2
        if clip > 0:
            v_clip = v_old + torch.clamp(v - v_old, -clip, clip)
            loss_tok = torch.maximum(loss_tok, (v_clip - ret) ** 2)
        loss = 0.5 * torch.where(mask, loss_tok, torch.zeros_like(loss_tok)).sum() / max(n_tok, 1)
        if not torch.isfinite(loss):
            raise NonFiniteError("value_loss", idx, f"micro-batch value loss {loss.item()}")
        loss.backward()
        loss_sum += float(loss.item())
    if n_tok == 0:
        return {"value_n_tokens": 0.0}  # nothing to fit: no gradient, no step
    grad_norm = torch.nn.utils.clip_grad_norm_(critic.parameters(), max_grad_norm if max_grad_norm > 0 else math.inf)
    if not torch.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteError("value_gradient", range(len(rows)), f"critic grad norm {float(grad_norm)}")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"value_loss": loss_sum, "value_n_tokens": float(n_tok)}

"""One optimizer step of the clipped surrogate with gradient accumulation (update box).

Alignment (DESIGN.md §2): logits at position j predict token j+1, so the log-probs
returned by ``logprob_fn`` (``[N, S-1]``) pair with ``input_ids[:, 1:]``,
``loss_mask[:, 1:]`` and ``old_logprobs[:, 1:]``.

The reduction is defined over the whole step: every micro-batch is reduced with the
step's global totals (target tokens, sequences with a target, length constant), so the
accumulated gradient equals the unsplit batch's for every reduction
(shared/cases/01-token-mean-microbatch.md). Loss sign: ``loss = −reduce(objective)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from consequence.records import TrainingRow
from consequence.update.losses import REDUCTIONS, clipped_surrogate, reduce_tokens


@dataclass
class UpdateConfig:
    """Settings of one PPO/GRPO optimizer step.

    Attributes:
        clip_eps_low, clip_eps_high: clip range [1 − low, 1 + high] (PPO 0.2/0.2, DAPO 0.2/0.28).
        reduction: one of ``REDUCTIONS``.
        micro_batch_size: rows per forward/backward pass (gradient accumulation).
        max_grad_norm: global gradient-norm clip (``<= 0`` or ``inf`` disables clipping).
        temperature: passed to ``logprob_fn``; must equal the sampling temperature.
        norm_const: L_const of ``seq_mean_token_sum_norm`` (Dr.GRPO: the max generation
            length); ``None`` uses the largest target count of a row in the step.
    """

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    reduction: str = "token_mean"
    micro_batch_size: int = 16
    max_grad_norm: float = 1.0
    temperature: float = 1.0
    norm_const: float | None = None


def pad_rows(rows: Sequence[TrainingRow], pad_id: int) -> dict[str, Tensor]:
    """Right-pad training rows into tensors.

    Returns:
        dict with ``input_ids`` [N, S] long (``pad_id`` on padding), ``attention_mask``
        [N, S] long (1 on real tokens), ``loss_mask`` [N, S] float32 and ``old_logprobs``
        [N, S] float32 (0 on padding); S = longest row.

    Raises:
        ValueError: no rows, or an empty row.
    """
    if len(rows) == 0:
        raise ValueError("pad_rows: no rows")
    S = max(len(r.input_ids) for r in rows)
    if S == 0:
        raise ValueError("pad_rows: every row is empty")
    N = len(rows)
    input_ids = torch.full((N, S), int(pad_id), dtype=torch.long)
    attention_mask = torch.zeros((N, S), dtype=torch.long)
    loss_mask = torch.zeros((N, S), dtype=torch.float32)
    old_logprobs = torch.zeros((N, S), dtype=torch.float32)
    for i, r in enumerate(rows):
        n = len(r.input_ids)
        if n == 0:
            raise ValueError(f"pad_rows: row {i} is empty")
        input_ids[i, :n] = torch.tensor(r.input_ids, dtype=torch.long)
        attention_mask[i, :n] = 1
        loss_mask[i, :n] = torch.tensor(r.loss_mask, dtype=torch.float32)
        old_logprobs[i, :n] = torch.tensor(r.old_logprobs, dtype=torch.float32)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "old_logprobs": old_logprobs,
    }


def _call_logprob_fn(logprob_fn: Callable[..., Any], model, input_ids, attention_mask, temperature):
    out = logprob_fn(model, input_ids, attention_mask, temperature=temperature)
    if isinstance(out, (tuple, list)):
        lp = out[0]
        ent = out[1] if len(out) > 1 else None
    else:
        lp, ent = out, None
    return lp, ent


def _step_totals(rows: Sequence[TrainingRow], cfg: UpdateConfig) -> tuple[float, float, float]:
    lengths = []
    for i, r in enumerate(rows):
        if r.loss_mask and r.loss_mask[0]:
            raise ValueError(
                f"row {i} has a target at position 0, which no logit predicts; "
                "the first token of a row must be context"
            )
        lengths.append(float(sum(1 for m in r.loss_mask[1:] if m)))
    total_tokens = sum(lengths)
    total_seqs = float(sum(1 for L in lengths if L > 0))
    norm_const = float(cfg.norm_const) if cfg.norm_const is not None else max(lengths, default=0.0)
    return total_tokens, total_seqs, norm_const


def accumulate_gradients(
    model: torch.nn.Module,
    rows: Sequence[TrainingRow],
    advantages_N: Sequence[float],
    cfg: UpdateConfig,
    pad_id: int,
    logprob_fn: Callable[..., Any],
) -> dict[str, float]:
    """Forward/backward the step's micro-batches, ADDING −reduce(objective) gradients to
    ``.grad`` of the model's parameters; no clipping, no optimizer step.

    Rows are sorted by length and cut into micro-batches of ``cfg.micro_batch_size``;
    each is reduced with the step's global totals, so the accumulated gradient does not
    depend on the split. Objective: PPO clip (Schulman et al. 2017, eq. 7) with
    DAPO's asymmetric range (Yu et al. 2025); reductions per DESIGN.md §5.

    Args:
        model: the policy; ``logprob_fn(model, input_ids [n,S] long, attention_mask [n,S]
            long, temperature=T)`` returns ``(logprobs [n,S-1] float32, entropy [n,S-1]
            float32 or None)`` or just the logprobs tensor.
        rows: training rows; ``old_logprobs`` are the behaviour log-probs of targets.
        advantages_N: one finite advantage per row (env_error rows must be dropped first).

    Returns:
        metrics: loss (step loss = Σ micro-batch losses), ratio_mean/min/max, clip_frac_low,
        clip_frac_high, entropy (token means over targets; NaN when unavailable),
        n_tokens, n_rows.

    Raises:
        ValueError: lengths differ, unknown reduction, bad advantage, target at position 0.
        FloatingPointError: log-probs on targets or a micro-batch loss are not finite.
    """
    if cfg.reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {cfg.reduction!r}; valid: {', '.join(REDUCTIONS)}")
    if len(rows) != len(advantages_N):
        raise ValueError(f"{len(rows)} rows but {len(advantages_N)} advantages")
    if cfg.micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {cfg.micro_batch_size}")
    adv_all = []
    for i, a in enumerate(advantages_N):
        if a is None or not math.isfinite(float(a)):
            raise ValueError(
                f"advantage of row {i} is {a!r}; drop env_error rows (advantage None) before the update"
            )
        adv_all.append(float(a))
    total_tokens, total_seqs, norm_const = _step_totals(rows, cfg)
    device = next(model.parameters()).device

    order = sorted(range(len(rows)), key=lambda i: len(rows[i].input_ids))
    loss_sum = 0.0
    n_tok = 0
    ratio_sum = 0.0
    ratio_min = math.inf
    ratio_max = -math.inf
    n_clip_low = 0
    n_clip_high = 0
    ent_sum = 0.0
    ent_n = 0
    for start in range(0, len(order), cfg.micro_batch_size):
        idx = order[start : start + cfg.micro_batch_size]
        mb_rows = [rows[i] for i in idx]
        if not any(any(r.loss_mask[1:]) for r in mb_rows):
            continue  # no targets: adds nothing to the loss, the gradient or the totals
        batch = {k: v.to(device) for k, v in pad_rows(mb_rows, pad_id).items()}
        lp, ent = _call_logprob_fn(
            logprob_fn, model, batch["input_ids"], batch["attention_mask"], cfg.temperature
        )
        mask = batch["loss_mask"][:, 1:]
        old = batch["old_logprobs"][:, 1:]
        if lp.shape != mask.shape:
            raise ValueError(f"logprob_fn returned {tuple(lp.shape)}, expected {tuple(mask.shape)}")
        tmask = mask > 0
        if not torch.isfinite(lp[tmask]).all():
            raise FloatingPointError("logprobs (policy log-probs of target tokens) are not finite")
        adv = torch.tensor([adv_all[i] for i in idx], dtype=lp.dtype, device=device)
        obj, ratio, is_clipped = clipped_surrogate(lp, old, adv, cfg.clip_eps_low, cfg.clip_eps_high)
        red = reduce_tokens(
            obj, mask, cfg.reduction,
            total_tokens=total_tokens, total_seqs=total_seqs, norm_const=norm_const,
        )
        loss = -red
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss is not finite ({loss.item()}) in micro-batch at row {start}")
        loss.backward()
        loss_sum += float(loss.item())
        with torch.no_grad():
            r_t = ratio[tmask]
            n_tok += int(r_t.numel())
            ratio_sum += float(r_t.double().sum())
            ratio_min = min(ratio_min, float(r_t.min()))
            ratio_max = max(ratio_max, float(r_t.max()))
            a_t = adv.unsqueeze(-1).expand_as(ratio)[tmask]
            c_t = is_clipped[tmask]
            n_clip_high += int((c_t & (a_t > 0)).sum())
            n_clip_low += int((c_t & (a_t < 0)).sum())
            if ent is not None:
                e_t = ent[tmask]
                ent_sum += float(e_t.double().sum())
                ent_n += int(e_t.numel())
    nan = float("nan")
    return {
        "loss": loss_sum,
        "ratio_mean": ratio_sum / n_tok if n_tok else nan,
        "ratio_min": ratio_min if n_tok else nan,
        "ratio_max": ratio_max if n_tok else nan,
        "clip_frac_low": n_clip_low / n_tok if n_tok else 0.0,
        "clip_frac_high": n_clip_high / n_tok if n_tok else 0.0,
        "entropy": ent_sum / ent_n if ent_n else nan,
        "n_tokens": float(n_tok),
        "n_rows": float(len(rows)),
    }


def ppo_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rows: Sequence[TrainingRow],
    advantages_N: Sequence[float],
    cfg: UpdateConfig,
    pad_id: int,
    logprob_fn: Callable[..., Any],
) -> dict[str, float]:
    """One optimizer step: zero grads, :func:`accumulate_gradients`, check that every
    gradient is finite, clip the global grad norm to ``cfg.max_grad_norm``,
    ``optimizer.step()``, ``optimizer.zero_grad()``.

    Objective per token: PPO clip (Schulman et al. 2017, eq. 7; DAPO clip-higher, Yu et
    al. 2025), reduced per ``cfg.reduction`` over the whole step (DESIGN.md §5);
    loss = −objective. Tensor shapes: see :func:`accumulate_gradients`.

    Returns:
        metrics of :func:`accumulate_gradients` plus ``grad_norm`` (before clipping).

    Raises:
        ValueError: see :func:`accumulate_gradients`.
        FloatingPointError: the loss, the log-probs or a parameter's gradient (named) is
            not finite; the optimizer does not step and the gradients are zeroed.
    """
    optimizer.zero_grad(set_to_none=True)
    try:
        metrics = accumulate_gradients(model, rows, advantages_N, cfg, pad_id, logprob_fn)
        params = [p for p in model.parameters() if p.grad is not None]
        bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
        if bad:
            raise FloatingPointError(f"gradient is not finite for parameter(s): {', '.join(bad[:5])}")
        if params:
            max_norm = cfg.max_grad_norm if cfg.max_grad_norm and cfg.max_grad_norm > 0 else math.inf
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        else:
            grad_norm = 0.0
        if not math.isfinite(grad_norm):
            raise FloatingPointError(f"grad_norm is not finite ({grad_norm})")
    except Exception:  # never leave half-accumulated gradients behind
        optimizer.zero_grad(set_to_none=True)
        raise
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    metrics["grad_norm"] = grad_norm
    return metrics

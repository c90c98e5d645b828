"""Supervised fine-tuning on demonstration records (distillation box): hard targets.

The rows are harness records (``records.TrainingRow``, as the RL update trains on): the
loss mask is 1 on the policy's own tokens (each assistant turn, its end-of-turn token
included) and 0 on everything the environment or the template wrote (system prompt, task,
tool observations: context only). The objective of one optimizer step over rows
``R`` with ``T = Σ_r Σ_t mask_rt`` target tokens is the token mean over the whole step,

    L = −(1 / T) Σ_r Σ_t mask_rt · log π_θ(y_rt | y_r,<t),

accumulated over micro-batches with the step's ``T`` (never a per-micro-batch mean), so
the gradient does not depend on how the step is cut (the RL update's rule, docs/design.md
§5, case 01). AdamW, linear warm-up then cosine decay to 0, gradient-norm clip.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from consequence.policy.logprobs import accepts_target_mask, token_logprobs
from consequence.records import TrainingRow, pad_rows

__all__ = ["SFTConfig", "sft_step_gradients", "sft_steps", "train_sft", "bucketed_batches"]


@dataclass(frozen=True)
class SFTConfig:
    """Settings of :func:`train_sft`.

    Attributes:
        learning_rate: peak AdamW learning rate (after warm-up).
        epochs: passes over the rows (fractional: the steps are ``int(epochs · rows / rows_per_step)``).
        rows_per_step: rows per optimizer step.
        micro_batch_size: rows per forward/backward (≤ rows_per_step; the step's gradient is
            the same for every split, to float rounding).
        weight_decay, betas: AdamW's.
        warmup_fraction: share of the steps with a linearly rising learning rate (≥ 1 step).
        max_grad_norm: clip of the step's gradient norm.
        seed: order of the rows (length-bucketed batches in a seeded random order).
    """

    learning_rate: float = 3e-3
    epochs: float = 8.0
    rows_per_step: int = 32
    micro_batch_size: int = 32
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_fraction: float = 0.05
    max_grad_norm: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rows_per_step < 1 or self.micro_batch_size < 1:
            raise ValueError(
                f"rows_per_step and micro_batch_size must be >= 1, got {self.rows_per_step}, {self.micro_batch_size}"
            )
        if not (self.learning_rate > 0 and self.epochs > 0):
            raise ValueError(f"learning_rate and epochs must be > 0, got {self.learning_rate}, {self.epochs}")

    def as_dict(self) -> dict:
        return asdict(self)


def sft_step_gradients(
    model: torch.nn.Module,
    rows: Sequence[TrainingRow],
    pad_id: int,
    micro_batch_size: int,
    logprob_fn: Callable = token_logprobs,
) -> dict[str, float]:
    """Add ∇L of one step (the module doc's token mean over all ``rows``) to ``.grad``.

    Args:
        model: the policy (a causal LM; PEFT models train only their adapter).
        rows: the step's rows; ``loss_mask`` marks the targets.
        pad_id: padding id of the tokenizer.
        micro_batch_size: rows per forward/backward.
        logprob_fn: ``(model, input_ids [n,S] long, attention_mask [n,S] long) ->
            (logprobs [n,S-1] float32, entropy or None)``.

    Returns:
        ``loss`` (L, nats per target token), ``n_targets`` (T), ``n_rows``.

    Raises:
        ValueError: no row has a target (L would be 0 / 0).
    """
    total = sum(sum(r.loss_mask[1:]) for r in rows)
    if total == 0:
        raise ValueError("SFT step without a target token: every row's loss mask is 0 after position 0")
    loss_sum = 0.0
    device = next(model.parameters()).device
    for a in range(0, len(rows), micro_batch_size):
        batch = pad_rows(rows[a : a + micro_batch_size], pad_id)
        mask = batch["loss_mask"][:, 1:].to(device)
        heads = {"target_mask": mask > 0} if accepts_target_mask(logprob_fn) else {}  # no LM head on the prompt
        lp, _ = logprob_fn(model, batch["input_ids"].to(device), batch["attention_mask"].to(device), **heads)
        loss = -(lp * mask).sum() / total
        loss.backward()
        loss_sum += float(loss.item())
    return {"loss": loss_sum, "n_targets": float(total), "n_rows": float(len(rows))}


def train_sft(
    model: torch.nn.Module,
    rows: Sequence[TrainingRow],
    pad_id: int,
    cfg: SFTConfig = SFTConfig(),
    log: Callable[[str], None] = print,
    progress: Callable[[int, int, float], None] | None = None,
    logprob_fn: Callable = token_logprobs,
) -> list[float]:
    """Fine-tune ``model`` on ``rows`` (module doc's loss); returns the loss of every step.

    Args:
        model: trained in place (its ``requires_grad`` parameters: all, or a LoRA adapter's).
        rows: demonstration rows (targets = the policy's own tokens).
        pad_id: padding id.
        cfg: :class:`SFTConfig`.
        log: a line every 50 steps and at the end.
        progress: ``progress(step_done, steps, loss)`` after every step (progress bars).
        logprob_fn: as :func:`sft_step_gradients`.

    Returns:
        losses: one float per optimizer step (nats per target token).

    Raises:
        ValueError: no rows, or no trainable parameter.
    """
    if not rows:
        raise ValueError("SFT needs at least one demonstration row")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("SFT: the model has no trainable parameter")
    opt = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, betas=cfg.betas)
    steps = sft_steps(cfg, len(rows))
    warmup = max(1, math.floor(steps * cfg.warmup_fraction + 1e-9))  # + 1e-9: 0.05 · 20k is 1.0 − ε in floats
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))
    )
    g = torch.Generator().manual_seed(cfg.seed)
    batches: list[list[int]] = []
    losses: list[float] = []
    micro = min(cfg.micro_batch_size, cfg.rows_per_step)
    model.train()
    for step in range(steps):
        if not batches:
            batches = bucketed_batches([len(r.input_ids) for r in rows], cfg.rows_per_step, g)
        step_rows = [rows[i] for i in batches.pop()]
        opt.zero_grad(set_to_none=True)
        m = sft_step_gradients(model, step_rows, pad_id, micro, logprob_fn)
        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        opt.step()
        sched.step()
        losses.append(m["loss"])
        if step % 50 == 0 or step == steps - 1:
            log(f"SFT step {step + 1}/{steps}  loss {m['loss']:.4f}")
        if progress is not None:
            progress(step + 1, steps, m["loss"])
    model.eval()
    return losses


def sft_steps(cfg: SFTConfig, n_rows: int) -> int:
    """Optimizer steps of :func:`train_sft` over ``n_rows`` rows: ``int(epochs · rows / rows_per_step)``, ≥ 1."""
    return max(1, int(cfg.epochs * n_rows / cfg.rows_per_step))


def bucketed_batches(lengths: list[int], batch_size: int, g: torch.Generator) -> list[list[int]]:
    """One epoch of batches of similar length (less padding), in a seeded random order."""
    order = torch.randperm(len(lengths), generator=g).tolist()
    batches = []
    span = batch_size * 16
    for start in range(0, len(order), span):
        chunk = sorted(order[start : start + span], key=lambda i: lengths[i])
        batches += [chunk[k : k + batch_size] for k in range(0, len(chunk), batch_size)]
    perm = torch.randperm(len(batches), generator=g).tolist()
    return [batches[i] for i in perm]

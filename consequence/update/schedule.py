"""Learning-rate schedules of the policy's optimizer (update box): linear warm-up, then a
constant, linear or cosine learning rate that decays to a floor.

The schedule counts optimizer steps *taken*. ``update()`` (``consequence.loop.learner``)
steps the scheduler right after each ``optimizer.step()``, and only then: a step in which no
row trained (every advantage 0) applies no gradient and does not advance the schedule. So
optimizer step ``k`` (0-based, counting steps taken) runs at ``peak · lr_factor(k, ...)``.
The total is the steps a run schedules, ``iterations × epochs_per_batch × mini_batches``;
a run that skips steps ends before the end of its schedule (above ``--min-lr``).
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = ["SCHEDULES", "lr_factor", "make_scheduler"]

SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str, min_ratio: float) -> float:
    """The learning rate of optimizer step ``step`` as a fraction of the peak (``--learning-rate``).

    With W = ``warmup_steps``, T = ``total_steps``, m = ``min_ratio`` (``--min-lr`` / peak) and
    the decay's progress p = min(1, (step − W) / (T − W)):

        warm-up (step < W):   step / W                       (0 at step 0, as in Hugging Face
                                                              transformers' ``get_*_schedule_with_warmup``)
        constant:             1
        linear:               m + (1 − m) · (1 − p)
        cosine:               m + (1 − m) · ½ (1 + cos(π p))  (SGDR, Loshchilov & Hutter 2017, eq. 5,
                                                              one cycle without restarts)

    At ``step == T`` (after the run's last step) linear and cosine reach m; the run's last
    step, T − 1, runs just above it. Steps past T stay at m.

    Args:
        step: optimizer steps taken before this one (≥ 0).
        total_steps: steps of the whole schedule (> ``warmup_steps``).
        warmup_steps: steps of linear warm-up from 0 (≥ 0).
        schedule: one of :data:`SCHEDULES`.
        min_ratio: the floor as a fraction of the peak, in [0, 1]; unused by ``constant``.

    Returns:
        a float in [0, 1].

    Raises:
        ValueError: an unknown schedule, a negative step or warm-up, ``total_steps <=
            warmup_steps``, or ``min_ratio`` outside [0, 1].
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {schedule!r}; one of {', '.join(SCHEDULES)}")
    if step < 0 or warmup_steps < 0 or total_steps <= warmup_steps:
        raise ValueError(
            f"need step >= 0 and 0 <= warmup_steps < total_steps, got {step}, {warmup_steps}, {total_steps}"
        )
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_ratio must be in [0, 1], got {min_ratio}")
    if step < warmup_steps:
        return step / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    decay = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * decay


def make_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int, schedule: str, min_lr: float
) -> torch.optim.lr_scheduler.LambdaLR | None:
    """A ``LambdaLR`` that sets every param group's lr to ``lr · lr_factor(k, ...)``, where lr is
    the group's learning rate now (the peak) and k the scheduler's steps so far; it sets step
    0's learning rate on creation. Call its ``step()`` once after each optimizer step taken.

    Returns:
        None for ``constant`` without warm-up: the learning rate never changes, and the
        optimizer is left exactly as it was (no ``initial_lr`` key in its groups).

    Raises:
        ValueError: as :func:`lr_factor`, or ``min_lr`` above a group's learning rate.
    """
    if schedule == "constant" and warmup_steps == 0:
        return None
    peak = optimizer.param_groups[0]["lr"]
    if any(g["lr"] != peak for g in optimizer.param_groups):
        raise ValueError("make_scheduler: every param group must have the same learning rate")
    if min_lr > peak:
        raise ValueError(f"min_lr {min_lr} is above the learning rate {peak}")
    min_ratio = min_lr / peak
    lr_factor(0, total_steps, warmup_steps, schedule, min_ratio)  # bad settings fail here, not at a later step
    factor = functools.partial(
        lr_factor, total_steps=total_steps, warmup_steps=warmup_steps, schedule=schedule, min_ratio=min_ratio
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

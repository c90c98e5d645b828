"""The learner and the credit and update steps of the loop (``consequence.loop.train``).

    credit    credit box: a scalar advantage per trajectory (REINFORCE … Dr.GRPO), or
              per-token GAE with a value head (PPO); KL as a reward penalty goes here
    update    update box: epochs × mini-batches of optimizer steps on the chosen
              surrogate, ratios against the behaviour snapshot

Every recipe in ``consequence/recipes`` is these two functions with different settings;
the batch they work on comes from a batch source (``consequence.loop.sources``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from consequence.config import TrainConfig
from consequence.credit.batch import Batch, assign_credit, training_rows
from consequence.credit.value import ValueModel, explained_variance
from consequence.policy.logprobs import enable_gradient_checkpointing, lm_head_split, token_logprobs
from consequence.policy.lora import frozen_copy
from consequence.policy.packing import packing_refusal
from consequence.records import Trajectory
from consequence.update.sampler_gap import apply_is_mask, sampler_gap_metrics
from consequence.update.schedule import make_scheduler
from consequence.update.step import NonFiniteError, UpdateConfig, compute_logprobs, ppo_step
from consequence.update.value_step import value_step


@dataclass
class Learner:
    """What the update changes or consults: policy, optimizer, frozen reference, critic,
    frozen teacher (on-policy distillation)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    update_cfg: UpdateConfig
    reference: torch.nn.Module | None = None
    critic: ValueModel | None = None
    critic_optimizer: torch.optim.Optimizer | None = None
    teacher: torch.nn.Module | None = None
    data_parallel: Any = None  # --update-ranks > 1: a consequence.update.data_parallel.DataParallelUpdate
    reference_version: int = 0  # the policy version π_ref holds: 0 = the starting policy (--ref-refresh-every)
    # --lr-schedule / --warmup-steps: stepped once per optimizer step taken (update.schedule); None = constant lr
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    # π_ref's log-probs of stored rows (--distill-data), computed once per row and reference version
    ref_cache: dict[tuple, list[float]] = field(default_factory=dict)
    ref_cache_version: int = 0


def make_learner(
    cfg: TrainConfig,
    model: torch.nn.Module,
    reference: torch.nn.Module | None = None,
    teacher: torch.nn.Module | None = None,
) -> Learner:
    """Optimizer, update settings, and the reference / critic / teacher the recipe needs.

    Raises:
        ValueError: ``--advantage reverse_kl`` or ``--distill-loss`` without a ``teacher`` module.
    """
    ucfg = UpdateConfig(
        surrogate=cfg.surrogate,
        clip_eps_low=cfg.clip_eps,
        clip_eps_high=cfg.clip_eps_high or cfg.clip_eps,
        dual_clip_c=cfg.dual_clip_c,
        reduction=cfg.reduction,
        micro_batch_size=cfg.micro_batch_size,
        temperature=cfg.temperature,
        norm_const=float(cfg.norm_const) if cfg.norm_const else None,
        tis_cap=cfg.tis_cap,
        kl_coef=cfg.kl_coef if cfg.kl_mode == "loss" else 0.0,
        kl_estimator=cfg.kl_estimator,
        entropy_coef=cfg.entropy_coef,
        offpolicy_delta=cfg.offpolicy_delta,
        distill_loss=cfg.distill_loss,
        distill_beta=cfg.distill_beta,
        distill_temperature=cfg.distill_temperature,
        distill_top_k=cfg.distill_top_k,
        pg_coef=cfg.task_reward_weight if cfg.distill_loss != "none" else 1.0,
        dtype=cfg.dtype,
    )
    if cfg.packing and (why := packing_refusal(model, lm_head_split(model))) is not None:
        raise ValueError(f"--packing: {why}; train without --packing")
    trainable = [p for p in model.parameters() if p.requires_grad]  # all of them, or a LoRA adapter's A and B
    learner = Learner(model, torch.optim.AdamW(trainable, lr=cfg.learning_rate, weight_decay=0.0), ucfg)
    steps = cfg.iterations * cfg.epochs_per_batch * cfg.mini_batches  # every optimizer step the run schedules
    learner.scheduler = make_scheduler(learner.optimizer, steps, cfg.warmup_steps, cfg.lr_schedule, cfg.min_lr)
    if cfg.advantage == "reverse_kl" or cfg.distill_loss != "none":
        if teacher is None:
            raise ValueError(
                "--advantage reverse_kl / --distill-loss need a loaded teacher (consequence.distill.teacher_model)"
            )
        learner.teacher = teacher.eval().requires_grad_(False)  # frozen: never in the optimizer
    if uses_reference(cfg):
        learner.reference = reference if reference is not None else copy.deepcopy(model).eval()
    if cfg.advantage == "gae":
        learner.critic = ValueModel(model)
        learner.critic_optimizer = torch.optim.AdamW(
            learner.critic.parameters(), lr=cfg.value_learning_rate, weight_decay=0.0
        )
    if cfg.gradient_checkpointing:  # after the reference and critic are copied: only the policy recomputes layers
        enable_gradient_checkpointing(model)
    if cfg.update_ranks > 1:  # rank 0 of data-parallel steps; refuses what it cannot run
        from consequence.update.data_parallel import DataParallelUpdate, check_rank_count

        check_rank_count(cfg.update_ranks)
        dp = DataParallelUpdate(cfg.update_ranks, strategy=cfg.update_strategy)  # ddp replicas or fsdp shards
        learner.data_parallel = dp.launch(type(model).__module__)
    return learner


def refresh_due(cfg: TrainConfig, it: int) -> bool:
    """Whether π_ref becomes the current policy after iteration ``it`` (``--ref-refresh-every N``:
    after iterations N − 1, 2N − 1, …, i.e. at policy versions N, 2N, …; never after the last)."""
    n = cfg.ref_refresh_every
    return n > 0 and uses_reference(cfg) and (it + 1) % n == 0 and it + 1 < cfg.iterations


def uses_reference(cfg: TrainConfig) -> bool:
    """Whether the run holds a frozen π_ref: for a KL term, or as DPO's reference (credit.dpo)."""
    return cfg.kl_coef > 0 or cfg.advantage == "dpo"


def refresh_reference(learner: Learner, version: int) -> None:
    """π_ref ← a frozen copy of the current policy (a LoRA adapter folded in), at policy
    ``version``: the KL then pulls toward where the policy was at most ``--ref-refresh-every``
    iterations ago instead of toward the start (the reference "fixed at the initial model or
    updated every stated number of steps" of docs/design.md §5; ProRL's reference policy
    reset, Liu et al. 2025; TR-DPO's hard update, Gorbatovski et al. 2024). A new object:
    the starting policy the final evaluation compares against is not touched."""
    learner.reference = frozen_copy(learner.model)
    learner.reference_version = version


# ---- credit box ----------------------------------------------------------------------
def credit(trajs: list[Trajectory], cfg: TrainConfig, learner: Learner, pad_id: int, from_data: bool = False) -> Batch:
    """Advantages over complete groups, before any mini- or micro-batching (docs/design.md §4).

    The credit box does the work (:func:`consequence.credit.batch.assign_credit`); here
    only the reference policy's log-probs are computed for it (a forward pass of the
    update box's model code), when the recipe has a KL term, and the teacher's, for
    on-policy distillation (at the sampling temperature; its time is ``teacher_s``).
    ``from_data``: the episodes are stored ones (``--distill-data``): π_ref's log-probs of a
    row are computed once per reference version and kept, and DPO gets π_θ's own log-probs
    (a forward pass without gradient), since the rows' are another sampler's.
    """
    rows, owner = training_rows(trajs)
    ref = teacher = policy = None
    if learner.reference is not None:  # no rows (every episode an env_error): nothing to run, an empty list
        ref = (
            _reference_logprobs(learner, rows, cfg, pad_id)
            if from_data
            else _logprobs(learner.reference, rows, cfg, pad_id)
        )
    if from_data and cfg.advantage == "dpo":
        policy = _logprobs(learner.model, rows, cfg, pad_id)
    t0 = time.perf_counter()
    if cfg.advantage == "reverse_kl":  # a --distill-loss teacher runs in the update instead
        assert learner.teacher is not None  # make_learner refuses reverse_kl without a teacher
        teacher = (
            compute_logprobs(  # on the teacher's device (--teacher-device); the lists come back
                learner.teacher, rows, pad_id, logprob_fn(cfg), cfg.temperature, cfg.micro_batch_size, cfg.dtype
            )
            if rows
            else []
        )
    batch = assign_credit(
        trajs,
        rows,
        owner,
        cfg,
        ref_logprobs=ref,
        critic=learner.critic,
        pad_id=pad_id,
        teacher_logprobs=teacher,
        policy_logprobs=policy,
    )
    if cfg.advantage == "reverse_kl":
        batch.metrics["teacher_s"] = time.perf_counter() - t0
    return batch


def _logprobs(model, rows, cfg: TrainConfig, pad_id: int) -> list[list[float]]:
    """``model``'s log-probs of every position of ``rows`` (no gradient), under the sampler's processing."""
    if not rows:
        return []
    return compute_logprobs(model, rows, pad_id, logprob_fn(cfg), cfg.temperature, cfg.micro_batch_size, cfg.dtype)


def _reference_logprobs(learner: Learner, rows, cfg: TrainConfig, pad_id: int) -> list[list[float]]:
    """π_ref's log-probs of stored rows, each computed once per reference version (DPO's
    reference log-probs, precomputed as the paper's offline setting does)."""
    if learner.ref_cache_version != learner.reference_version:
        learner.ref_cache, learner.ref_cache_version = {}, learner.reference_version
    keys = [(tuple(r.input_ids), tuple(r.loss_mask)) for r in rows]
    todo = [j for j, k in enumerate(keys) if k not in learner.ref_cache]
    for j, lp in zip(todo, _logprobs(learner.reference, [rows[j] for j in todo], cfg, pad_id)):
        learner.ref_cache[keys[j]] = lp
    return [learner.ref_cache[k] for k in keys]


# ---- update box ----------------------------------------------------------------------
def logprob_fn(cfg: TrainConfig):
    """The trainer's log-prob function under the sampler's processed distribution."""
    return functools.partial(
        token_logprobs,
        with_entropy=True,
        entropy_grad=cfg.entropy_coef > 0,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        packing=cfg.packing,
    )


def update(
    batch: Batch, cfg: TrainConfig, learner: Learner, pad_id: int, seed: int, divergence_only: bool = False
) -> dict[str, float]:
    """``epochs_per_batch`` × ``mini_batches`` optimizer steps on one collected batch.

    Each epoch shuffles the rows (when ``mini_batches > 1``) and cuts them into exactly
    ``mini_batches`` parts whose sizes differ by at most 1. π_old is the behaviour
    snapshot: the sampler's log-probs, or with TIS the trainer's recomputation before the
    first step (and the sampler's μ goes to the TIS weights); either is scored on the
    supports the sampler drew from (``TrainingRow.keep_ids``). ``divergence_only`` (a batch
    of ``--distill-data``, which the student did not sample) trains the distillation loss
    alone: the policy-gradient term's weight is 0.

    Returns:
        the steps merged by :func:`merge_steps` (steps whose rows were all skipped add
        nothing to means and extremes; the counts of steps taken and skipped), plus
        ``value_explained_var`` of the critic over all target tokens of the batch when
        a critic is trained and it is defined, and ``lr``: the policy's learning rate of
        the last optimizer step taken (when none was taken, the one the next step will
        take). Every value is a finite float. ``learner.scheduler`` (``--lr-schedule``)
        steps once after each optimizer step taken, never after a skipped one.

    Raises:
        ValueError: the batch has fewer rows than ``mini_batches`` (nothing is applied).
        NonFiniteError: a NaN / ±inf advantage, log-prob, ratio, KL, loss or gradient;
            the message names the tensor and the trajectories (task, group, sample) of
            the rows involved. That optimizer step is not taken (earlier ones were).
    """
    lr = _policy_lr(learner)
    if not batch.rows:
        return {"n_updates": 0.0, "optimizer_steps_taken": 0.0, "optimizer_steps_skipped": 0.0, "lr": lr}
    rows = batch.rows
    _check_mini_batches(len(rows), cfg.mini_batches)
    lp_fn = logprob_fn(cfg)
    gap: dict[str, float] = {}
    if needs_recompute(cfg):
        rows, gap = _recompute_old(rows, batch.sampler_logprobs, cfg, learner, pad_id, lp_fn)
    batch = dataclasses.replace(batch, rows=rows)
    ucfg = dataclasses.replace(learner.update_cfg, pg_coef=0.0) if divergence_only else learner.update_cfg
    step = ppo_step if learner.data_parallel is None else learner.data_parallel.ppo_step
    rng = random.Random(seed)
    steps: list[dict[str, float]] = []
    for _ in range(cfg.epochs_per_batch):
        order = list(range(len(rows)))
        if cfg.mini_batches > 1:
            rng.shuffle(order)
        for part in _chunks(order, cfg.mini_batches):
            mini = batch.select(part)
            with _naming_trajectories(batch, part, len(steps)):
                lr_now = _policy_lr(learner)
                m = step(
                    learner.model,
                    learner.optimizer,
                    mini.rows,
                    mini.advantages,
                    ucfg,
                    pad_id,
                    lp_fn,
                    ref_logprobs=mini.ref_logprobs,
                    sampler_logprobs=mini.sampler_logprobs,
                    teacher=learner.teacher,  # read only with a --distill-loss
                )
                if m.get("optimizer_stepped", 1.0) > 0:  # merge_steps' rule: the schedule counts steps taken
                    lr = lr_now
                    if learner.scheduler is not None:
                        learner.scheduler.step()
                steps.append(m | _critic_step(learner, mini, cfg, pad_id))
    merged = merge_steps(steps) | gap | {"lr": lr}
    if cfg.distill_loss != "none":  # cost: the teacher ran one forward over every row of every step
        merged["teacher_forward_tokens"] = float(cfg.epochs_per_batch * sum(len(r.input_ids) for r in rows))
        merged["distill_targets"] = merged.get("n_tokens", 0.0)
    if learner.critic is not None:
        assert batch.returns is not None and batch.old_values is not None  # a critic means GAE, which fills both
        ev = explained_variance(rows, batch.returns, batch.old_values)
        if ev is not None and math.isfinite(ev):
            merged["value_explained_var"] = ev
    return merged


def _policy_lr(learner: Learner) -> float:
    """The learning rate the policy's next optimizer step takes (make_learner's groups share one)."""
    return float(learner.optimizer.param_groups[0]["lr"])


def needs_recompute(cfg: TrainConfig) -> bool:
    """Whether the trainer recomputes π_old before the first step: for TIS and masked IS and
    under ``--dtype bfloat16`` (which then take it as π_old), and under rollout workers (for
    the sampler–trainer gap metrics)."""
    return cfg.tis_cap > 0 or cfg.is_mask != "none" or cfg.rollout_workers > 0 or recompute_is_old(cfg)


def recompute_is_old(cfg: TrainConfig) -> bool:
    """Whether the trainer's recomputation replaces the sampler's log-probs as π_old: with TIS
    or masked IS (the sampler's μ goes to their weights), and with ``--dtype bfloat16``, where
    the sampler's and the trainer's log-probs of one token differ by bfloat16 rounding (up to
    ``policy.device.logprob_tolerance``; 0.19 nats seen on SmolLM2-135M): measured against μ,
    the first step's ratio would hold rounding noise that the clip range (ε = 0.2) already cuts."""
    return cfg.tis_cap > 0 or cfg.is_mask != "none" or cfg.dtype != "float32"


def _recompute_old(rows, sampler_logprobs, cfg: TrainConfig, learner: Learner, pad_id: int, lp_fn):
    """π_old recomputed with the current weights; the sampler–trainer gap; TIS / masked IS rows.

    Returns:
        (rows to train on, metrics of ``update.sampler_gap``). Unless :func:`recompute_is_old`
        the rows keep the sampler's log-probs as π_old (the recomputation only measures the gap).
    """
    old = compute_logprobs(learner.model, rows, pad_id, lp_fn, cfg.temperature, cfg.micro_batch_size, cfg.dtype)
    band = (cfg.is_mask_low, cfg.is_mask_high)
    gap = sampler_gap_metrics(old, sampler_logprobs, [r.loss_mask for r in rows], *band)
    if not recompute_is_old(cfg):
        return rows, gap
    rows = [dataclasses.replace(r, old_logprobs=o) for r, o in zip(rows, old)]
    if cfg.is_mask != "none":
        rows, masked = apply_is_mask(rows, sampler_logprobs, *band, cfg.is_mask)
        gap |= masked
    return rows, gap


@contextlib.contextmanager
def _naming_trajectories(batch: Batch, part: list[int], k: int):
    """Re-raise a NonFiniteError of optimizer step ``k`` (on rows ``part`` of ``batch``)
    naming the trajectories (task, group, sample) of its rows."""
    try:
        yield
    except NonFiniteError as e:
        where = [part[j] for j in e.rows]
        raise NonFiniteError(
            e.tensor, where, f"{e.detail}; optimizer step {k + 1} not taken; trajectories: {batch.describe_rows(where)}"
        ) from e


def _critic_step(learner: Learner, mini: Batch, cfg: TrainConfig, pad_id: int) -> dict[str, float]:
    """One optimizer step of the critic on the mini-batch (GAE), or nothing without one."""
    if learner.critic is None:
        return {}
    # make_learner gives a critic its optimizer; a critic means GAE, which fills returns and values
    assert learner.critic_optimizer is not None
    assert mini.returns is not None and mini.old_values is not None
    return value_step(
        learner.critic,
        learner.critic_optimizer,
        mini.rows,
        mini.returns,
        mini.old_values,
        pad_id,
        cfg.value_clip,
        cfg.micro_batch_size,
    )


def _check_mini_batches(n_rows: int, mini_batches: int) -> None:
    """Exactly ``mini_batches`` steps per epoch need at least one row per step."""
    if mini_batches < 1:
        raise ValueError(f"--mini-batches must be >= 1, got {mini_batches}")
    if n_rows < mini_batches:
        raise ValueError(
            f"--mini-batches {mini_batches} asks for {mini_batches} optimizer steps per epoch, but this "
            f"iteration has only {n_rows} training row(s) (environment errors or the overlong filter removed "
            f"the others); nothing was applied. Lower --mini-batches to at most {n_rows}, or raise "
            "--tasks-per-iteration / --group-size so that every step gets a row"
        )


def _chunks(order: list[int], n: int) -> list[list[int]]:
    """``order`` cut into exactly ``n`` consecutive parts, sizes ⌈len/n⌉ first then ⌊len/n⌋.

    Raises:
        ValueError: fewer items than parts (a part would be empty).
    """
    if not 1 <= n <= len(order):
        raise ValueError(f"cannot cut {len(order)} rows into {n} non-empty mini-batches")
    q, r = divmod(len(order), n)
    bounds = [k * q + min(k, r) for k in range(n + 1)]
    return [order[bounds[k] : bounds[k + 1]] for k in range(n)]


# Per-token means: weighted by the target tokens each step trained on (``n_tokens``).
_TOKEN_MEANS = (
    "ratio_mean",
    "clip_frac_low",
    "clip_frac_high",
    "entropy",
    "kl_ref",
    "tis_weight_mean",
    "distill_divergence",
)
_COUNTS = (
    "n_tokens",
    "n_rows",
    "n_rows_trained",
    "rows_skipped_zero_advantage",
    "offpolicy_masked_rows",
    "value_n_tokens",
)
# step bookkeeping, consumed by merge_steps
_SKIP = ("optimizer_stepped",)


def merge_steps(steps: list[dict[str, float]]) -> dict[str, float]:
    """The metrics of one update from the metrics of its optimizer steps.

    Rules (a step that trained no row, i.e. ``n_rows_trained == 0``, contributes only to
    the counts):
      * token means (ratio_mean, clip fractions, entropy, kl_ref, tis_weight_mean):
        Σ_k n_tokens_k · m_k / Σ_k n_tokens_k over the steps that trained, so equal to the
        mean over every target token trained on;
      * ratio_min / ratio_max: the extremes over the steps that trained (order-free);
      * value_loss: weighted by ``value_n_tokens``; loss and grad_norm (one value per
        step): plain mean over the steps that trained;
      * counts (n_tokens, n_rows, n_rows_trained, rows_skipped_zero_advantage,
        offpolicy_masked_rows, value_n_tokens): summed over all steps (a row counts once
        per epoch);
      * any other key: plain mean over the steps that report it.
    A metric no trained step reports is left out; non-finite values never enter.

    Returns:
        the merged metrics plus ``n_updates`` (steps scheduled), ``optimizer_steps_taken``,
        ``optimizer_steps_skipped`` (every row's advantage 0: no gradient, no step) and
        ``first_step_ratio_min`` / ``first_step_ratio_max`` of the first step that
        trained (on-policy, so ≈ 1); every value a finite float.
    """
    trained = [s for s in steps if s.get("n_rows_trained", 1.0) > 0]
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for s in steps for k in s):
        if key in _SKIP:
            continue
        if key in _COUNTS:
            out[key] = sum(s.get(key, 0.0) for s in steps)
        elif key in _TOKEN_MEANS:
            _weighted(out, key, [(s.get(key), s.get("n_tokens", 0.0)) for s in trained])
        elif key == "value_loss":
            _weighted(out, key, [(s.get(key), s.get("value_n_tokens", 0.0)) for s in steps])
        elif key in ("ratio_min", "ratio_max"):
            vals = [s[key] for s in trained if _finite(s.get(key))]
            if vals:
                out[key] = min(vals) if key == "ratio_min" else max(vals)
        else:
            _weighted(out, key, [(s.get(key), 1.0) for s in (trained if key in ("loss", "grad_norm") else steps)])
    first = next((s for s in trained if _finite(s.get("ratio_min")) and _finite(s.get("ratio_max"))), None)
    if first is not None:
        out["first_step_ratio_min"], out["first_step_ratio_max"] = first["ratio_min"], first["ratio_max"]
    taken = sum(1 for s in steps if s.get("optimizer_stepped", 1.0) > 0)
    out |= {
        "n_updates": float(len(steps)),
        "optimizer_steps_taken": float(taken),
        "optimizer_steps_skipped": float(len(steps) - taken),
    }
    return out


def _weighted(out: dict[str, float], key: str, pairs: list[tuple[Any, float]]) -> None:
    """out[key] = Σ w·x / Σ w over finite x with w > 0; left out when there is none."""
    pairs = [(float(x), float(w)) for x, w in pairs if _finite(x) and w > 0]
    total = sum(w for _, w in pairs)
    if total > 0:
        out[key] = sum(x * w for x, w in pairs) / total


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

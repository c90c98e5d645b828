"""One optimizer step of any surrogate, with gradient accumulation (update box).

Alignment (docs/design.md §2): logits at position j predict token j+1, so the log-probs
returned by ``logprob_fn`` (``[N, S-1]``) pair with ``input_ids[:, 1:]``,
``loss_mask[:, 1:]`` and ``old_logprobs[:, 1:]``.

The reduction is defined over the whole step: every micro-batch is reduced with the
step's global totals (target tokens, sequences with a target, length constant), so the
accumulated gradient equals the unsplit batch's for every reduction
(docs/cases.md, case 01). Loss sign: ``loss = −reduce(objective)``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from consequence.policy.device import model_device, precision
from consequence.policy.logprobs import accepts_target_mask, auto_chunk_size, logprobs_from_logits
from consequence.policy.shared_prefix import shared_prefix_len
from consequence.records import TrainingRow, pad_rows
from consequence.update.distill_chunks import can_chunk, distill_chunked
from consequence.update.divergence import Kind, token_divergence
from consequence.update.losses import REDUCTIONS, reduce_tokens
from consequence.update.regularizers import kl_estimate, offpolicy_sequence_mask, tis_weights
from consequence.update.surrogates import SURROGATES, surrogate_objective


@dataclass
class UpdateConfig:
    """Settings of one optimizer step (update box, docs/design.md §5).

    Attributes:
        surrogate: one of ``SURROGATES`` (``consequence.update.surrogates``).
        clip_eps_low, clip_eps_high: clip range [1 − low, 1 + high] (PPO 0.2/0.2, DAPO
            0.2/0.28, GSPO 3e-4/4e-4; CISPO clips its detached weight with them).
        dual_clip_c: the bound c·A of ``dual_clip`` for A < 0 (c > 1).
        reduction: one of ``REDUCTIONS``.
        micro_batch_size: rows per forward/backward pass (gradient accumulation).
        max_grad_norm: global gradient-norm clip (``<= 0`` or ``inf`` disables clipping).
        temperature: passed to ``logprob_fn``; must equal the sampling temperature.
        norm_const: L_const of ``seq_mean_token_sum_norm`` (Dr.GRPO: the max generation
            length); ``None`` uses the largest target count of a row in the step.
        tis_cap: C of truncated importance sampling (0 = off); needs sampler log-probs.
        kl_coef: β of the KL-to-reference loss term (0 = off); needs reference log-probs.
        kl_estimator: ``k1``, ``k2`` or ``k3``.
        entropy_coef: c_H of the entropy bonus (0 = off); ``logprob_fn`` must return an
            entropy that carries a gradient.
        offpolicy_delta: threshold of off-policy sequence masking in nats/token (0 = off).
        distill_loss: ``"none"``, or the per-token divergence to a frozen teacher subtracted
            from the objective at every target (``forward``, ``reverse`` or ``jsd``;
            :func:`consequence.update.divergence.token_divergence`; GKD, Agarwal et al.
            2024 §3.1); needs ``teacher`` in :func:`accumulate_gradients`.
        distill_beta, distill_temperature, distill_top_k: β of JSD_β, τ applied to both
            logits, the teacher's top-k support (0 = whole vocabulary).
        pg_coef: weight of the surrogate term (1 for RL; with a distillation loss the
            weight of the task reward's policy gradient, 0 = the divergence alone).
        dtype: ``float32``, or ``bfloat16``: the micro-batches' forward passes (policy and
            teacher) run under bfloat16 autocast (``policy.device.precision``), the
            log-probs, losses, gradients and the optimizer stay float32.
    """

    surrogate: str = "ppo_clip"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip_c: float = 3.0
    reduction: str = "token_mean"
    micro_batch_size: int = 16
    max_grad_norm: float = 1.0
    temperature: float = 1.0
    norm_const: float | None = None
    tis_cap: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    offpolicy_delta: float = 0.0
    distill_loss: str = "none"
    distill_beta: float = 0.5
    distill_temperature: float = 1.0
    distill_top_k: int = 0
    pg_coef: float = 1.0
    dtype: str = "float32"

    def clip_bounds(self) -> dict[str, float]:
        """The keyword arguments of :func:`~consequence.update.surrogates.surrogate_objective`."""
        return {"eps_low": self.clip_eps_low, "eps_high": self.clip_eps_high, "dual_clip_c": self.dual_clip_c}


def _call_logprob_fn(logprob_fn: Callable[..., Any], model, batch: dict[str, Tensor], temperature: float):
    """``logprob_fn`` on a padded batch; the stored supports go with it when the rows have them.

    A ``logprob_fn`` that cannot take ``keep_index`` / ``keep_rows`` fails with a
    TypeError on rows with stored supports instead of silently recomputing top-k / top-p
    from logits the sampler never saw.
    """
    support: dict[str, Tensor] = {k: batch[k] for k in ("keep_index", "keep_rows") if k in batch}
    if "loss_mask" in batch and accepts_target_mask(logprob_fn):  # prompt positions: no LM head needed
        support["target_mask"] = batch["loss_mask"][:, 1:] > 0
    out = logprob_fn(model, batch["input_ids"], batch["attention_mask"], temperature=temperature, **support)
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
                f"row {i} has a target at position 0, which no logit predicts; the first token of a row must be context"
            )
        lengths.append(float(sum(1 for m in r.loss_mask[1:] if m)))
    total_tokens = sum(lengths)
    total_seqs = float(sum(1 for L in lengths if L > 0))
    norm_const = float(cfg.norm_const) if cfg.norm_const is not None else max(lengths, default=0.0)
    return total_tokens, total_seqs, norm_const


TokenValues = Sequence[Sequence[float]]  # one list per row, aligned with row.input_ids


class NonFiniteError(FloatingPointError, ValueError):
    """A tensor of the update holds NaN or ±inf.

    Attributes:
        tensor: which tensor (``advantage``, ``logprobs``, ``ratio``, ``kl_ref``, ``loss``,
            ``gradient``), as named in the message.
        rows: indices into the ``rows`` passed to the step (sorted, unique) whose values
            are not finite; for ``loss`` and ``gradient`` every row of the micro-batch that
            produced them, since a scalar cannot be split further.
        detail: extra text of the message (parameter names, values).

    Subclasses ``ValueError`` too, because a non-finite advantage was a ``ValueError``
    before (callers that catch it keep working).
    """

    def __init__(self, tensor: str, rows: Sequence[int], detail: str = "") -> None:
        self.tensor, self.rows, self.detail = tensor, sorted(set(int(r) for r in rows)), detail
        super().__init__(
            f"{tensor} is not finite in row(s) {self.rows} of the optimizer step" + (f" ({detail})" if detail else "")
        )


def _bad_rows(values: Tensor, tmask: Tensor, idx: Sequence[int]) -> list[int]:
    """Rows (from ``idx``) with a non-finite value on a target position of [n, S-1] ``values``."""
    bad = (~torch.isfinite(values.detach()) & tmask).any(-1)
    return [idx[j] for j in bad.nonzero().flatten().tolist()]


def _check_advantages(rows: Sequence[TrainingRow], advantages: Sequence[Any]) -> list[Any]:
    """Each row's advantage: a finite float, or a per-token list finite on its targets."""
    if len(rows) != len(advantages):
        raise ValueError(f"{len(rows)} rows but {len(advantages)} advantages")
    out: list[Any] = []
    for i, (r, a) in enumerate(zip(rows, advantages)):
        if isinstance(a, (list, tuple)):
            if len(a) != len(r.input_ids):
                raise ValueError(f"row {i}: {len(a)} per-token advantages for {len(r.input_ids)} tokens")
            if not all(math.isfinite(float(x)) for x, m in zip(a, r.loss_mask) if m):
                raise NonFiniteError("advantage", [i], "a per-token advantage on a target")
            out.append([float(x) for x in a])
            continue
        if a is None:
            raise ValueError(f"advantage of row {i} is None; drop env_error rows before the update")
        if not math.isfinite(float(a)):
            raise NonFiniteError("advantage", [i], f"value {a!r}")
        out.append(float(a))
    return out


def _pad_values(values: TokenValues, idx: Sequence[int], S: int) -> Tensor:
    out = torch.zeros((len(idx), S), dtype=torch.float32)
    for j, i in enumerate(idx):
        v = values[i]
        out[j, : len(v)] = torch.tensor(v, dtype=torch.float32)
    return out


def _micro_advantages(adv_all: list[Any], idx: Sequence[int], S: int) -> Tensor:
    """[n] when every row has a scalar advantage, else [n, S-1] aligned with the targets."""
    if all(not isinstance(adv_all[i], list) for i in idx):
        return torch.tensor([adv_all[i] for i in idx], dtype=torch.float32)
    full = torch.zeros((len(idx), S), dtype=torch.float32)
    for j, i in enumerate(idx):
        a = adv_all[i]
        if isinstance(a, list):
            full[j, : len(a)] = torch.tensor(a, dtype=torch.float32)
        else:
            full[j] = a
    return full[:, 1:]


def _check_needs(cfg: UpdateConfig, ref_logprobs, sampler_logprobs) -> None:
    if cfg.reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {cfg.reduction!r}; valid: {', '.join(REDUCTIONS)}")
    if cfg.surrogate not in SURROGATES:
        raise ValueError(f"unknown surrogate {cfg.surrogate!r}; valid: {', '.join(SURROGATES)}")
    if cfg.micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {cfg.micro_batch_size}")
    if cfg.kl_coef and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (log-probs of the frozen reference policy)")
    if cfg.tis_cap and sampler_logprobs is None:
        raise ValueError(
            "tis_cap > 0 needs sampler_logprobs (the rows' old_logprobs must then be "
            "the trainer's recomputation of the behaviour policy)"
        )


class _Metrics:
    """Token-level sums of one step, turned into means at the end."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.loss_sum = 0.0
        self.n_tok = 0
        self.n_rows_run = 0
        self.ratio_min = math.inf
        self.ratio_max = -math.inf
        self.n_rows_masked = 0

    @torch.no_grad()
    def micro_batch(
        self, loss: Tensor, ratio: Tensor, is_clipped: Tensor, adv: Tensor, ent: Tensor | None, tmask: Tensor, n: int
    ) -> None:
        """Record one micro-batch of ``n`` rows that ran: its loss, and the ratio, clip and
        entropy values on its targets ``tmask`` [n, S-1] (before any off-policy mask)."""
        r_t = ratio[tmask]
        self.n_tok += int(r_t.numel())
        self.add("ratio", r_t)
        self.ratio_min = min(self.ratio_min, float(r_t.min()))
        self.ratio_max = max(self.ratio_max, float(r_t.max()))
        a_t = (adv.unsqueeze(-1).expand_as(ratio) if adv.dim() == 1 else adv)[tmask]
        c_t = is_clipped[tmask]
        self.add("clip_high", (c_t & (a_t > 0)).float())
        self.add("clip_low", (c_t & (a_t < 0)).float())
        if ent is not None:
            self.add("entropy", ent.detach()[tmask])
        self.loss_sum += float(loss.item())
        self.n_rows_run += n

    def result(self, n_rows: int, n_skipped: int) -> dict[str, float]:
        """The step's metrics (see :func:`ppo_step`)."""
        return {
            "loss": self.loss_sum,
            **self.means(),
            "offpolicy_masked_rows": float(self.n_rows_masked),
            "rows_skipped_zero_advantage": float(n_skipped),
            "n_tokens": float(self.n_tok),
            "n_rows": float(n_rows),
            "n_rows_trained": float(self.n_rows_run),
        }

    def add(self, name: str, values: Tensor) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + float(values.double().sum())

    def means(self) -> dict[str, float]:
        """Token means over the targets that ran; a metric without data is left out."""
        if not self.n_tok:
            return {}
        names = {
            "ratio": "ratio_mean",
            "clip_low": "clip_frac_low",
            "clip_high": "clip_frac_high",
            "entropy": "entropy",
            "kl_ref": "kl_ref",
            "tis_weight": "tis_weight_mean",
            "distill_divergence": "distill_divergence",
        }
        out = {names[k]: v / self.n_tok for k, v in self.sums.items()}
        return out | {"ratio_min": self.ratio_min, "ratio_max": self.ratio_max}


def ppo_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    rows: Sequence[TrainingRow],
    advantages_N: Sequence[Any],
    cfg: UpdateConfig,
    pad_id: int,
    logprob_fn: Callable[..., Any],
    *,
    ref_logprobs: TokenValues | None = None,
    sampler_logprobs: TokenValues | None = None,
    teacher: torch.nn.Module | None = None,
    totals: tuple[float, float, float] | None = None,
) -> dict[str, float]:
    """One optimizer step on ``rows``: per micro-batch, the policy's log-probs, the
    surrogate, its regularizers, −reduce(objective) with the step's totals, backward; then
    the global grad-norm clip and ``optimizer.step()``.

    Per target token the objective is ``pg_coef · (surrogate × TIS weight − β·KL + c_H·H)
    − D(teacher ‖ student)`` (docs/design.md §5; the surrogate from ``cfg.surrogate``: the
    PPO clip of Schulman et al. 2017 eq. 7 by default; D only with ``cfg.distill_loss``).
    Rows are sorted by length and cut into micro-batches of ``cfg.micro_batch_size``; each
    is reduced with the step's global totals, so the accumulated gradient does not depend
    on the split (case 01). Rows with advantage 0 everywhere (all-equal groups) are counted
    in the totals but not run when there is no KL, entropy or distillation term: their
    gradient is exactly 0. Ratio, clip and entropy metrics cover the rows that ran. When
    no row ran, the optimizer does not step.

    Args:
        model: the policy; ``logprob_fn(model, input_ids [n,S] long, attention_mask [n,S]
            long, temperature=T)`` returns ``(logprobs [n,S-1] float32, entropy [n,S-1]
            float32 or None)`` or just the logprobs tensor; when rows store the sampler's
            supports it also gets ``keep_index`` [K,3] long and ``keep_rows`` [n] bool
            (``records.pad_rows``) and must score targets on them
            (``policy.logprobs.token_logprobs``).
        optimizer: steps the parameters; ``None`` only ADDS the step's gradient to
            ``.grad`` (no zeroing, clipping or step: :func:`accumulate_gradients`).
        rows: training rows; ``old_logprobs`` are logπ_old of the targets (the behaviour
            snapshot: sampler log-probs, or the trainer's recomputation when TIS is on).
        advantages_N: per row a finite float (broadcast to its targets) or a list of
            per-token advantages aligned with ``row.input_ids`` (GAE, returns-to-go).
            env_error rows must be dropped first.
        ref_logprobs: per row, logπ_ref aligned with ``input_ids`` (needed for ``kl_coef``).
        sampler_logprobs: per row, logμ of the sampler aligned with ``input_ids`` (for
            TIS and off-policy masking; default: the rows' ``old_logprobs``).
        teacher: the frozen teacher of ``cfg.distill_loss`` (same tokenizer); its logits
            come without gradient, and the student's from one forward that also gives the
            log-probs (``logprob_fn`` is not called then; full ``[n, S-1, V]`` logits).
        totals: ``(target tokens, sequences with a target, length constant)`` of the whole
            optimizer step when ``rows`` are one shard of it (data parallel); default: those
            of ``rows``. Each micro-batch is divided by the step's own totals, never by a
            shard's and rescaled afterwards, so a shard's gradient is bit for bit the sum of
            the same micro-batches' gradients in one process.

    Returns:
        metrics: loss (step loss = Σ micro-batch losses), n_tokens (targets that ran),
        n_rows, n_rows_trained (rows that ran a forward/backward),
        rows_skipped_zero_advantage, offpolicy_masked_rows, and over the targets that
        ran: ratio_mean, ratio_min, ratio_max, clip_frac_low, clip_frac_high, entropy,
        kl_ref, tis_weight_mean, distill_divergence (token means; a metric without data is
        left out, never NaN); with an optimizer also ``optimizer_stepped`` (1.0 or 0.0)
        and, when it stepped, ``grad_norm`` (before clipping).

    Raises:
        ValueError: lengths differ, unknown reduction/surrogate, bad advantage, a target
            at position 0, a needed input missing.
        NonFiniteError (a FloatingPointError): an advantage, log-prob, ratio or KL on a
            target, a micro-batch loss, or a gradient is NaN or ±inf; ``rows`` names the
            rows involved and, for a gradient, the message the parameters. The optimizer
            does not step and its gradients are zeroed.
    """
    if optimizer is not None:  # the gradients below (accumulate_gradients: optimizer=None), then the step
        gradients = functools.partial(
            accumulate_gradients, model, rows, advantages_N, cfg, pad_id, logprob_fn,
            ref_logprobs=ref_logprobs, sampler_logprobs=sampler_logprobs, teacher=teacher, totals=totals,
        )  # fmt: skip
        return optimizer_step(model, optimizer, cfg.max_grad_norm, gradients)
    adv_all = _checked_inputs(rows, advantages_N, cfg, ref_logprobs, sampler_logprobs, teacher)
    total_tokens, total_seqs, norm_const = _step_totals(rows, cfg) if totals is None else totals
    live = [i for i in range(len(rows)) if not _contributes_nothing(adv_all[i], cfg)]
    met = _Metrics()
    for idx, mb in _micro_batches(model, rows, live, adv_all, cfg, pad_id, ref_logprobs, sampler_logprobs):
        with precision(cfg.dtype, mb["input_ids"].device):  # the forward only: backward outside autocast
            lp, ent, div = _policy_forward(model, mb, cfg, logprob_fn, teacher, idx)
        old, adv, mask = mb["old_logprobs"][:, 1:], mb["advantages"], mb["loss_mask"][:, 1:]
        # PPO's clipped surrogate by default; GRPO, DAPO, GSPO, CISPO … (docs/design.md §5)
        obj, ratio, is_clipped = surrogate_objective(cfg.surrogate, lp, old, adv, mask, **cfg.clip_bounds())
        _check_finite(ratio, mask > 0, idx, "ratio", "π/π_old of target tokens; check the rows' old_logprobs")
        obj, mask = _regularized(obj, lp, ent, div, mb, cfg, met, idx)
        loss = -reduce_tokens(
            obj, mask, cfg.reduction, total_tokens=total_tokens, total_seqs=total_seqs, norm_const=norm_const
        )
        _backward(loss, model, idx)
        met.micro_batch(loss, ratio, is_clipped, adv, ent, mb["loss_mask"][:, 1:] > 0, len(idx))
    return met.result(len(rows), len(rows) - len(live))


def optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    max_grad_norm: float,
    gradients: Callable[[], dict[str, float]],
) -> dict[str, float]:
    """One optimizer step around ``gradients()`` (which accumulates the step's gradients into
    ``model`` and returns its metrics, with ``n_rows`` and ``n_rows_trained``): the global
    grad-norm clip and ``optimizer.step()`` when some row trained, gradients zeroed before and
    after. Shared by the single process, DDP replicas and FSDP shards (a sharded gradient's
    norm is its full norm, the same on every rank).

    Returns:
        the metrics of ``gradients()`` with ``optimizer_stepped`` (1.0 or 0.0) and, when it
        stepped, ``grad_norm`` (before clipping).

    Raises:
        whatever ``gradients()`` raises, or NonFiniteError for a non-finite global grad norm;
        the optimizer does not step and its gradients are zeroed (never half-accumulated
        gradients left behind).
    """
    optimizer.zero_grad(set_to_none=True)
    try:
        metrics = gradients()
        stepped = metrics["n_rows_trained"] > 0
        grad_norm = _clip_grad_norm(model, max_grad_norm, int(metrics["n_rows"])) if stepped else None
    except BaseException:
        optimizer.zero_grad(set_to_none=True)
        raise
    if grad_norm is not None:  # some row trained (stepped)
        optimizer.step()
        metrics["grad_norm"] = grad_norm
    optimizer.zero_grad(set_to_none=True)
    metrics["optimizer_stepped"] = float(stepped)
    return metrics


def accumulate_gradients(
    model: torch.nn.Module,
    rows: Sequence[TrainingRow],
    advantages_N: Sequence[Any],
    cfg: UpdateConfig,
    pad_id: int,
    logprob_fn: Callable[..., Any],
    *,
    ref_logprobs: TokenValues | None = None,
    sampler_logprobs: TokenValues | None = None,
    teacher: torch.nn.Module | None = None,
    totals: tuple[float, float, float] | None = None,
) -> dict[str, float]:
    """The micro-batches of :func:`ppo_step` without its optimizer: ADDS −reduce(objective)
    gradients to ``.grad`` of the model's parameters; no zeroing, clipping or step (a
    data-parallel shard, the pre-step checks). Arguments, metrics and errors as
    :func:`ppo_step` (no ``optimizer_stepped`` / ``grad_norm``; gradients are left as they
    are on an error)."""
    return ppo_step(
        model,
        None,
        rows,
        advantages_N,
        cfg,
        pad_id,
        logprob_fn,
        ref_logprobs=ref_logprobs,
        sampler_logprobs=sampler_logprobs,
        teacher=teacher,
        totals=totals,
    )


def _checked_inputs(rows, advantages_N, cfg: UpdateConfig, ref_logprobs, sampler_logprobs, teacher) -> list[Any]:
    """Refuse a step that cannot run; each row's checked advantage."""
    _check_needs(cfg, ref_logprobs, sampler_logprobs)
    if cfg.distill_loss != "none" and teacher is None:
        raise ValueError(f"distill_loss {cfg.distill_loss!r} needs the frozen teacher (teacher=...)")
    return _check_advantages(rows, advantages_N)


def _micro_batches(model, rows, live: list[int], adv_all, cfg: UpdateConfig, pad_id, ref_logprobs, sampler_logprobs):
    """``(idx, padded batch on the model's device)`` per micro-batch of the ``live`` rows,
    sorted by length; a micro-batch without a target is not yielded (it adds nothing)."""
    device = next(model.parameters()).device
    for idx in _micro_batch_groups(rows, live, cfg.micro_batch_size):
        batch = pad_rows([rows[i] for i in idx], pad_id)
        S = batch["input_ids"].shape[1]
        batch["advantages"] = _micro_advantages(adv_all, idx, S)
        if ref_logprobs is not None:
            batch["ref_logprobs"] = _pad_values(ref_logprobs, idx, S)
        if sampler_logprobs is not None:
            batch["sampler_logprobs"] = _pad_values(sampler_logprobs, idx, S)
        yield idx, {k: v.to(device) for k, v in batch.items()}


def _micro_batch_groups(rows: Sequence[TrainingRow], live: list[int], size: int) -> list[list[int]]:
    """The row indices of each micro-batch of :func:`_micro_batches`: the ``live`` rows sorted
    by length, cut every ``size`` rows, those without a target left out."""
    order = sorted(live, key=lambda i: len(rows[i].input_ids))
    groups = [order[start : start + size] for start in range(0, len(order), size)]
    return [idx for idx in groups if any(any(rows[i].loss_mask[1:]) for i in idx)]


def _contributes_nothing(adv: Any, cfg: UpdateConfig) -> bool:
    """A row whose advantage is 0 on every token adds exactly 0 to every surrogate's
    gradient (each is A times something); without KL or entropy terms it can skip the
    forward/backward (a distillation loss trains every row). It still counts in the step's
    totals, so the gradient is unchanged."""
    if cfg.kl_coef or cfg.entropy_coef or cfg.distill_loss != "none":
        return False
    return all(a == 0.0 for a in adv) if isinstance(adv, list) else adv == 0.0


def _check_finite(values: Tensor, tmask: Tensor, idx: Sequence[int], tensor: str, detail: str) -> None:
    """Raise NonFiniteError naming the rows with a NaN / ±inf of ``values`` on a target."""
    if bad := _bad_rows(values, tmask, idx):
        raise NonFiniteError(tensor, bad, detail)


def _backward(loss: Tensor, model: torch.nn.Module, idx: Sequence[int]) -> None:
    """``loss.backward()``, checking the loss and then the accumulated gradients per
    micro-batch, so the rows that made a NaN are known."""
    if not torch.isfinite(loss):
        raise NonFiniteError("loss", idx, f"micro-batch loss {loss.item()}")
    loss.backward()
    _check_grads(model, idx)


def _check_grads(model: torch.nn.Module, idx: Sequence[int]) -> None:
    """Raise NonFiniteError naming parameters whose accumulated gradient is NaN or ±inf."""
    # FSDP2's sharded gradients (DTensor): this rank's shard, with no collective (update.fsdp agrees on errors)
    grads = [(n, _local(p.grad)) for n, p in model.named_parameters() if p.grad is not None]
    if not grads or bool(torch.stack([torch.isfinite(g).all() for _, g in grads]).all()):
        return  # one device sync per micro-batch; names are looked up only on failure
    bad = [n for n, g in grads if not torch.isfinite(g).all()]
    raise NonFiniteError("gradient", idx, "parameter(s) " + ", ".join(bad[:5]))


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _policy_forward(model, mb: dict[str, Tensor], cfg: UpdateConfig, logprob_fn, teacher, idx: Sequence[int]):
    """``(log-probs [n, S-1], entropy [n, S-1] or None, divergence to the teacher [n, S-1]
    or None)`` of one micro-batch; the log-probs checked finite on the targets."""
    div = None
    if cfg.distill_loss != "none":
        lp, ent, div = _distill_forward(model, teacher, mb, cfg)
    else:
        lp, ent = _call_logprob_fn(logprob_fn, model, mb, cfg.temperature)
    mask = mb["loss_mask"][:, 1:]
    if lp.shape != mask.shape:
        raise ValueError(f"logprob_fn returned {tuple(lp.shape)}, expected {tuple(mask.shape)}")
    _check_finite(lp, mask > 0, idx, "logprobs", "policy log-probs of target tokens")
    return lp, ent, div


def _regularized(obj, lp, ent, div, mb: dict[str, Tensor], cfg: UpdateConfig, met: _Metrics, idx: Sequence[int]):
    """The surrogate's per-token objective with the TIS weight, the off-policy sequence
    mask, the KL to the reference, the entropy bonus, the task weight ``pg_coef`` and the
    divergence to the teacher, as configured (docs/design.md §5); returns ``(objective
    [n, S-1], loss mask [n, S-1])`` and records their metrics in ``met``."""
    mask, old, adv = mb["loss_mask"][:, 1:], mb["old_logprobs"][:, 1:], mb["advantages"]
    tmask = mask > 0
    behaviour = mb["sampler_logprobs"][:, 1:] if "sampler_logprobs" in mb else old
    if cfg.tis_cap:
        w = tis_weights(old, behaviour, cfg.tis_cap, mask=tmask)  # off target: min(1, C), never NaN
        obj = obj * w
        met.add("tis_weight", w[tmask])
    if cfg.offpolicy_delta:
        drop = offpolicy_sequence_mask(lp, behaviour, adv, mask, cfg.offpolicy_delta)
        met.n_rows_masked += int(drop.sum())
        mask = mask * (~drop).unsqueeze(-1).to(mask.dtype)
    if "ref_logprobs" in mb:
        kl = kl_estimate(lp, mb["ref_logprobs"][:, 1:], cfg.kl_estimator, mask=tmask)
        # a -inf reference log-prob (outside its top-k/top-p)
        _check_finite(kl, tmask, idx, "kl_ref", "KL estimate to the reference on target tokens")
        met.add("kl_ref", kl.detach()[tmask])
        if cfg.kl_coef:
            obj = obj - cfg.kl_coef * kl
    if cfg.entropy_coef:
        if ent is None or not ent.requires_grad:
            raise ValueError(
                "entropy_coef > 0 needs logprob_fn to return an entropy with a gradient "
                "(token_logprobs(..., with_entropy=True, entropy_grad=True))"
            )
        obj = obj + cfg.entropy_coef * torch.where(tmask, ent, 0.0)
    if cfg.pg_coef != 1.0:
        obj = cfg.pg_coef * obj if cfg.pg_coef else torch.zeros_like(obj)  # 0 · ±inf would be nan
    if div is not None:
        div = torch.where(tmask, div, 0.0)
        _check_finite(div, tmask, idx, "distill_divergence", "divergence to the teacher on target tokens")
        obj = obj - div
        met.add("distill_divergence", div.detach()[tmask])
    return obj, mask


def _distill_forward(
    model, teacher, batch: dict[str, Tensor], cfg: UpdateConfig
) -> tuple[Tensor, Tensor | None, Tensor]:
    """One student forward giving log-probs [n, S-1], entropy and, with the teacher's
    logits (no gradient), the per-token divergence [n, S-1] of ``cfg.distill_loss``.

    Large vocabularies (the rows' float32 logits above ``AUTO_CHUNK_BYTES``, or a long prefix
    shared by every row) go through :func:`~consequence.update.distill_chunks.distill_chunked`:
    the same values at the target positions without holding the full logits."""
    ids, am = batch["input_ids"], batch["attention_mask"]
    kind = cast(Kind, cfg.distill_loss)  # not "none" here; token_divergence refuses any other name
    shared = shared_prefix_len(ids, am)
    if "keep_index" not in batch and auto_chunk_size(model, ids, am, shared) and can_chunk(model, teacher):
        return distill_chunked(
            model,
            teacher,
            ids,
            am,
            batch["loss_mask"][:, 1:] > 0,
            cfg.temperature,
            cfg.entropy_coef > 0,
            kind,
            cfg.distill_beta,
            cfg.distill_temperature,
            cfg.distill_top_k,
            shared=shared,
        )
    logits = model(input_ids=ids, attention_mask=am).logits[:, :-1].float()
    lp, ent = logprobs_from_logits(
        logits,
        ids,
        am,
        cfg.temperature,
        with_entropy=True,
        entropy_grad=cfg.entropy_coef > 0,
        keep_index=batch.get("keep_index"),
        keep_rows=batch.get("keep_rows"),
    )
    with torch.no_grad():
        t_dev = model_device(teacher)  # --teacher-device: the rows go there, its logits come back
        t_logits = teacher(input_ids=ids.to(t_dev), attention_mask=am.to(t_dev)).logits[:, :-1].float()
        t_logits = t_logits.to(logits.device)
    div = token_divergence(
        logits,
        t_logits,
        kind,
        cfg.distill_beta,
        cfg.distill_temperature,
        cfg.distill_top_k,
        mask=batch["loss_mask"][:, 1:] > 0,
    )
    return lp, ent, div


def _clip_grad_norm(model: torch.nn.Module, max_grad_norm: float, n_rows: int) -> float:
    """Global norm before clipping (every gradient was checked finite per micro-batch).

    Raises:
        NonFiniteError: the norm itself overflows; all ``n_rows`` rows share the blame.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    max_norm = max_grad_norm if max_grad_norm and max_grad_norm > 0 else math.inf
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    # FSDP2's sharded gradients (DTensor) give a DTensor norm: its full value, the same on every rank
    grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if not math.isfinite(grad_norm):
        raise NonFiniteError("gradient", range(n_rows), f"global grad norm {grad_norm}")
    return grad_norm


@torch.no_grad()
def compute_logprobs(
    model: torch.nn.Module,
    rows: Sequence[TrainingRow],
    pad_id: int,
    logprob_fn: Callable[..., Any],
    temperature: float = 1.0,
    micro_batch_size: int = 32,
    dtype: str = "float32",
) -> list[list[float]]:
    """Log-probs of every row's tokens under ``model`` (no gradient), aligned with
    ``row.input_ids`` (position 0 holds 0: no logit predicts it).

    Used for the behaviour snapshot (π_old recomputed by the trainer) and the frozen
    reference policy (π_ref). Targets are scored on the support the sampler drew them
    from when the rows store it (``TrainingRow.keep_ids``), whatever the weights of
    ``model``; a token outside its support holds -inf. The forward passes run on ``model``'s
    device in ``dtype`` (``policy.device.precision``); the log-probs come back as float32.

    Returns:
        list of N lists of floats, lengths ``len(row.input_ids)``.
    """
    device = next(model.parameters()).device
    out: list[list[float]] = [[] for _ in rows]
    for start in range(0, len(rows), micro_batch_size):
        idx = list(range(start, min(start + micro_batch_size, len(rows))))
        batch = {k: v.to(device) for k, v in pad_rows([rows[i] for i in idx], pad_id).items()}
        with precision(dtype, device):
            lp, _ = _call_logprob_fn(logprob_fn, model, batch, temperature)
        lp = lp.float().cpu()  # one copy per micro-batch: the rows keep their log-probs as lists
        for j, i in enumerate(idx):
            n = len(rows[i].input_ids)
            out[i] = [0.0] + lp[j, : n - 1].tolist()
    return out

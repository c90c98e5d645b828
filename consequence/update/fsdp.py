"""FSDP2 (``fully_shard``) as the strategy of ``--update-ranks N`` (update box, issue 34).

``--update-strategy fsdp``: every rank holds a SHARD (1/N) of the trained policy's
parameters, of their gradients and of the optimizer's state, instead of a whole replica
(``--update-strategy ddp``, ``update.data_parallel``); for a policy whose optimizer state
does not fit one device. One optimizer step, on every rank:

1. the rank's shard of the step's rows (``data_parallel.shard_rows``) is checked and
   counted; the counts (target tokens, sequences, longest target count) and the number of
   micro-batches are exchanged, so every rank divides by the step's GLOBAL totals (as DDP
   does, docs/async.md §7) and knows the largest micro-batch count K;
2. every rank runs exactly K forward/backward passes: its own micro-batches, then one-token
   passes whose loss is multiplied by 0 (:func:`_idle_pass`). FSDP's forward and backward
   are collectives (each FSDP unit all-gathers its parameters before its forward and its
   backward, and reduce-scatters its gradient after the backward), so every rank must run
   the SAME sequence of passes, whatever its shard;
3. each backward's reduce-scatter SUMS the ranks' gradients (:func:`shard_learner` sets
   every unit's divide factor to 1 and forces a plain SUM: FSDP's default divides by N,
   which would be the mean of N shard gradients, but each rank's loss is already its share
   of the step's loss, so the sum over ranks is the single-process gradient);
4. the sharded gradient's global norm is clipped (one all-reduce: the same norm on every
   rank), each rank steps the optimizer on its shard, and the trained parameters are
   gathered (``DTensor.full_tensor()``) into rank 0's full model, which samples, evaluates
   and is checkpointed.

Agreement without deadlock: no check raises between two collectives. A rank whose
micro-batch fails (a non-finite log-prob, ratio, KL or loss, a bad row) records the error,
still runs that pass's backward through zeros (:class:`_RootOutputs`) and one-token passes
for the rest of the step; after the K-th pass the errors are exchanged and every rank
raises the same one (``agreement.raise_agreed``), with no optimizer step and zeroed
gradients. A non-finite gradient is found on the shard that holds it, after the pass
that made it, and blamed on that pass's rows on every rank.

Requirements: the log-prob function calls the ROOT module's forward exactly once per
micro-batch (``policy.logprobs.token_logprobs`` does under FSDP: ``lm_head_split`` returns
``None`` for a ``fully_shard`` root, so the trunk and the head never run on their own).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from consequence.records import TrainingRow
from consequence.update.agreement import Collective, DataParallelError, error_info, merge_rank_metrics, raise_agreed
from consequence.update.step import (
    NonFiniteError,
    TokenValues,
    UpdateConfig,
    _checked_inputs,
    _contributes_nothing,
    _local,
    _Metrics,
    _micro_batch_groups,
    _step_totals,
    accumulate_gradients,
    optimizer_step,
)


# ---- the sharded learner --------------------------------------------------------------------
def optimizer_spec(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What builds the same optimizer over another copy of ``model``: its class, defaults and
    param groups, each group's parameters named by their names in ``model`` (no tensors, no state).

    Raises:
        ValueError: the optimizer steps a tensor that is not a parameter of ``model``.
    """
    name_of = {id(p): n for n, p in model.named_parameters()}
    groups = []
    for g in optimizer.param_groups:
        if any(id(p) not in name_of for p in g["params"]):
            raise ValueError(
                "--update-strategy fsdp: the optimizer steps a tensor that is not a parameter of the policy"
            )
        groups.append({"names": [name_of[id(p)] for p in g["params"]], "hyper": _hyper(g)})
    return {"class": type(optimizer), "defaults": dict(optimizer.defaults), "groups": groups}


def param_names(spec: dict[str, Any]) -> list[str]:
    """The parameters' names in the order of ``optimizer.state_dict()``'s indices (groups in order)."""
    return [n for g in spec["groups"] for n in g["names"]]


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def shard_learner(model: torch.nn.Module, spec: dict[str, Any]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``fully_shard`` ``model`` in place over the default process group and build the optimizer
    of ``spec`` (:func:`optimizer_spec`) over its sharded parameters. A collective: every rank
    calls it at once with identical copies of the model.

    Units: each transformer block (the classes in Hugging Face's ``_no_split_modules``, e.g.
    ``LlamaDecoderLayer``) and the root, which holds the rest (embeddings, final norm, LM
    head: a tied head is the embedding itself, so it cannot be a unit of its own). A model
    without ``_no_split_modules`` is one unit. Every unit reduce-scatters with a plain SUM
    (divide factor 1 and ``set_force_sum_reduction_for_comms``: a divide factor alone makes
    FSDP use ``PREMUL_SUM``, which gloo refuses).

    Returns:
        ``(model, optimizer)``: the same module object (its class now ``FSDP<Name>``, its
        parameters DTensors holding this rank's shard) and an optimizer of the spec's class
        with the spec's param groups and hyper-parameters, and no state.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    get_base = getattr(model, "get_base_model", None)  # PEFT: the wrapped model names its blocks
    base = get_base() if callable(get_base) else model
    blocks |= set(getattr(base, "_no_split_modules", None) or [])
    for module in list(model.modules())[1:]:
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):  # every unit, not only the root: each reduces its own gradients
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    params = dict(model.named_parameters())
    groups = [{"params": [params[n] for n in g["names"]], **g["hyper"]} for g in spec["groups"]]
    cls = spec["class"]
    accepted = inspect.signature(cls).parameters
    optimizer = cls(groups, **{k: v for k, v in spec["defaults"].items() if k in accepted})
    optimizer.defaults.update(spec["defaults"])  # e.g. AdamW's decoupled_weight_decay, not an argument
    return model, optimizer


# ---- one step (runs on every rank) ------------------------------------------------------------
class _RootOutputs:
    """Watches the root module's forward passes during one step (a forward hook).

    ``anchor``: the sum of the last forward's first logit column, a scalar on that forward's
    graph that keeps no logits alive; ``0 · anchor`` backpropagates zeros through every unit
    the forward ran, so a pass whose loss failed still runs its backward's collectives.
    ``calls``: root forwards since :meth:`reset`; ``backward_ran``: whether a gradient
    reached the last forward's logits.
    """

    anchor: torch.Tensor | None

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.reset()

    def __enter__(self) -> _RootOutputs:
        self._handle = self.model.register_forward_hook(self._seen)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()
        self.anchor = None

    def reset(self) -> None:
        self.calls, self.anchor, self.backward_ran = 0, None, False

    def _seen(self, module, args, out) -> None:
        logits = _logits(out)
        self.calls += 1
        if logits.requires_grad:
            self.anchor = logits[..., :1].float().sum()
            logits.register_hook(self._mark)

    def _mark(self, grad) -> None:
        self.backward_ran = True


def _logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0]


def _idle_pass(model: torch.nn.Module, pad_id: int) -> None:
    """One forward of a single pad token through the root, times 0, and its backward: the
    collectives of one pass, adding exactly 0 to every gradient."""
    ids = torch.full((1, 1), pad_id, dtype=torch.long, device=next(model.parameters()).device)
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    (_logits(out).float().sum() * 0.0).backward()


def _finish_failed_pass(model: torch.nn.Module, pad_id: int, outs: _RootOutputs, col: Collective) -> None:
    """The backward the other ranks run in this pass, after this rank's micro-batch failed: through
    zeros on the forward that ran (or a whole idle pass when the forward never ran)."""
    try:
        if outs.backward_ran:
            return
        if outs.anchor is None:
            _idle_pass(model, pad_id)
        else:
            (outs.anchor * 0.0).backward()
    except RuntimeError as e:  # the pass's collectives cannot be completed: the group is out of step
        raise DataParallelError(
            f"update rank {col.rank} of {col.world}: a failed micro-batch's FSDP backward did not complete: {e}"
        ) from e


def _nonfinite_shards(model: torch.nn.Module) -> list[str]:
    """Names of the parameters whose gradient shard on THIS rank holds a NaN / ±inf (local: no collective)."""
    bad = []
    for n, p in model.named_parameters():
        if p.grad is not None and not bool(torch.isfinite(_local(p.grad)).all()):
            bad.append(n)
    return bad


def fsdp_gradients(
    model: torch.nn.Module,
    rows: Sequence[TrainingRow],
    advantages_N: Sequence[Any],
    cfg: UpdateConfig,
    pad_id: int,
    logprob_fn: Callable[..., Any],
    *,
    row_ids: Sequence[int] | None = None,
    ref_logprobs: TokenValues | None = None,
    sampler_logprobs: TokenValues | None = None,
    group=None,
) -> dict[str, float]:
    """ADD the full step's gradient of −reduce(objective) to the sharded ``.grad`` on every rank.

    Every rank of the default process group calls this at once with ``model`` sharded by
    :func:`shard_learner` and its own shard of the step (arguments as
    ``data_parallel.data_parallel_gradients``). Afterwards each trainable parameter's
    ``.grad`` is a DTensor whose full value is the SUM over ranks of the shards' gradients
    computed with the step's global totals: the gradient of the whole step in one process,
    up to float32 summation order (each pass's gradients are reduce-scattered, then added
    to the earlier passes'). Start from zero gradients.

    Args:
        group: the group of the agreement collectives (default: the default group; the
            FSDP collectives always run on the model's mesh).

    Returns:
        the step's metrics merged over ranks (``agreement.merge_rank_metrics``), the same
        on every rank and equal to one process's.

    Raises:
        NonFiniteError / ValueError: a rank's shard had a NaN/±inf tensor or a bad row; raised on
            EVERY rank with the same message (rows as step indices, the rank that found it
            named); the gradients are then left partial (callers zero them).
        DataParallelError: a collective failed or timed out (a rank died or hung).
    """
    col = Collective(group)
    row_ids = list(range(len(rows))) if row_ids is None else list(row_ids)
    own: BaseException | None = None
    plan: _Plan | None = None
    try:
        plan = _Plan(rows, advantages_N, cfg, row_ids, ref_logprobs, sampler_logprobs)
        mine: tuple = (plan.totals, len(plan.groups), None)
    except Exception as e:  # noqa: BLE001 - agreed below, re-raised on every rank
        own, mine = e, (None, 0, error_info(e, row_ids, col.rank))
    got = col.gather("the shards' counts (target tokens, sequences, longest target count, micro-batches)", mine)
    raise_agreed([g[2] for g in got], col.world, own)
    assert plan is not None  # raise_agreed raised this rank's own error
    counts = [g[0] for g in got]
    totals = (
        math.fsum(c[0] for c in counts),
        math.fsum(c[1] for c in counts),
        float(cfg.norm_const) if cfg.norm_const is not None else max(c[2] for c in counts),
    )
    failed, per_pass = _run_passes(model, plan, cfg, pad_id, logprob_fn, totals, max(g[1] for g in got), col)
    return _agreed_metrics(col, None if failed is not None else plan.metrics(per_pass), plan.groups, row_ids, failed)


class _Plan:
    """One rank's shard of the step, checked: advantages, its own totals, the rows that run and
    their micro-batches (cut as ``update.step.ppo_step`` cuts them).

    Raises:
        NonFiniteError / ValueError: as ``ppo_step``'s input checks.
    """

    def __init__(self, rows, advantages_N, cfg: UpdateConfig, row_ids: list[int], ref_logprobs, sampler_logprobs):
        if len(row_ids) != len(rows):
            raise ValueError(f"{len(row_ids)} row_ids for {len(rows)} rows")
        self.rows, self.ref_logprobs, self.sampler_logprobs = rows, ref_logprobs, sampler_logprobs
        self.adv_all = _checked_inputs(rows, advantages_N, cfg, ref_logprobs, sampler_logprobs, None)
        self.totals = _step_totals(rows, cfg)
        self.live = [i for i in range(len(rows)) if not _contributes_nothing(self.adv_all[i], cfg)]
        self.groups = _micro_batch_groups(rows, self.live, cfg.micro_batch_size)

    def run(self, k: int, model, cfg: UpdateConfig, pad_id: int, logprob_fn, totals) -> dict[str, float]:
        """Micro-batch ``k``: ``ppo_step``'s forward, loss and backward on its rows alone, divided by
        the step's global ``totals``; its metrics."""
        idx = self.groups[k]
        pick = lambda xs: None if xs is None else [xs[i] for i in idx]  # noqa: E731
        one = dataclasses.replace(cfg, micro_batch_size=len(idx))  # the rows are one micro-batch
        return accumulate_gradients(
            model,
            [self.rows[i] for i in idx],
            [self.adv_all[i] for i in idx],
            one,
            pad_id,
            logprob_fn,
            ref_logprobs=pick(self.ref_logprobs),
            sampler_logprobs=pick(self.sampler_logprobs),
            totals=totals,
        )

    def metrics(self, per_pass: list[dict[str, float]]) -> dict[str, float]:
        """The shard's metrics, as ``ppo_step`` reports a step: the passes' merged (a pass is a
        micro-batch, merged as shards are), with the shard's rows and skipped rows."""
        shard = _Metrics().result(len(self.rows), len(self.rows) - len(self.live))  # the keys of a step of no pass
        return shard | merge_rank_metrics(per_pass) | {k: shard[k] for k in ("n_rows", "rows_skipped_zero_advantage")}


def _run_passes(
    model, plan: _Plan, cfg: UpdateConfig, pad_id: int, logprob_fn, totals, passes: int, col: Collective
) -> tuple[tuple[BaseException, int] | None, list[dict[str, float]]]:
    """``passes`` forward/backward passes (the same number on every rank): the shard's micro-batches,
    then idle passes; after a failure only idle passes. Returns the first failure and its pass
    (or ``None``), and the metrics of the micro-batches that ran."""
    failed: tuple[BaseException, int] | None = None
    per_pass: list[dict[str, float]] = []
    with _RootOutputs(model) as outs:
        for k in range(passes):
            outs.reset()
            try:
                if k < len(plan.groups) and failed is None:
                    per_pass.append(plan.run(k, model, cfg, pad_id, logprob_fn, totals))
                    if outs.calls != 1:
                        raise ValueError(
                            f"--update-strategy fsdp: the log-prob function ran the policy's forward {outs.calls} "
                            "times for one micro-batch; FSDP needs exactly one root forward per micro-batch "
                            "(policy.logprobs.token_logprobs runs one)"
                        )
                else:
                    _idle_pass(model, pad_id)
            except DataParallelError:
                raise
            except Exception as e:  # noqa: BLE001 - recorded; raised after the step's last pass
                if isinstance(e, dist.DistError):
                    raise DataParallelError(
                        f"update rank {col.rank} of {col.world}: an FSDP collective failed: {e}"
                    ) from e
                failed = failed or (e, k)
                _finish_failed_pass(model, pad_id, outs, col)
            if failed is None and (bad := _nonfinite_shards(model)):  # a shard another rank's pass made non-finite
                blame = plan.groups[k] if k < len(plan.groups) else []
                failed = (NonFiniteError("gradient", blame, _grad_detail(bad, k)), k)
    return failed, per_pass


def _grad_detail(bad: list[str], k: int) -> str:
    return (
        "parameter(s) " + ", ".join(bad[:5]) + f" (the gradient after micro-batch {k} of every update rank, "
        "summed over the ranks)"
    )


def _agreed_metrics(
    col: Collective,
    metrics: dict[str, float] | None,
    groups: list[list[int]],
    row_ids: list[int],
    failed: tuple[BaseException, int] | None,
) -> dict[str, float]:
    """Exchange the ranks' metrics and errors; raise the agreed error or return the merged metrics.

    The error raised is the first in step order: the earliest pass (an input error, found
    before any pass, was raised earlier), at one pass a failed check before a gradient made
    non-finite by it, then the lowest rank. A non-finite gradient is the sum of every rank's
    pass k, so it names the rows of pass k on every rank."""
    own = failed[0] if failed is not None else None
    info = None if failed is None else error_info(failed[0], row_ids, col.rank) | {"pass": failed[1]}
    gathered = col.gather("the shards' metrics and errors", (metrics, info, [[row_ids[i] for i in g] for g in groups]))
    infos = [g[1] for g in gathered]
    for i in infos:
        if i is not None and i.get("tensor") == "gradient":
            i["rows"] = sorted(r for g in gathered for r in (g[2][i["pass"]] if i["pass"] < len(g[2]) else []))
    first = sorted(
        (i for i in infos if i is not None), key=lambda i: (i["pass"], i.get("tensor") == "gradient", i["rank"])
    )
    raise_agreed(first[:1], col.world, own)
    return merge_rank_metrics([g[0] for g in gathered])


def fsdp_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rows: Sequence[TrainingRow],
    advantages_N: Sequence[Any],
    cfg: UpdateConfig,
    pad_id: int,
    logprob_fn: Callable[..., Any],
    *,
    row_ids: Sequence[int] | None = None,
    ref_logprobs: TokenValues | None = None,
    sampler_logprobs: TokenValues | None = None,
    full_model: torch.nn.Module | None = None,
    group=None,
) -> dict[str, float]:
    """One optimizer step of ``update.step.ppo_step`` over FSDP2 shards (every rank calls it).

    :func:`fsdp_gradients`, then the global grad-norm clip of the sharded gradients (the
    same norm on every rank) and ``optimizer.step()`` on this rank's shard; then the trained
    parameters are gathered into ``full_model`` (rank 0's full policy; ``None`` on the other
    ranks, which take part in the gathers). When no row of any shard ran, no optimizer steps.

    Returns:
        the metrics of ``ppo_step`` for the whole step, the same on every rank (with
        ``grad_norm`` before clipping when it stepped, and ``optimizer_stepped``).

    Raises:
        NonFiniteError / ValueError: as :func:`fsdp_gradients`, or a non-finite global grad
            norm; no optimizer step, the gradients zeroed, on every rank.
        DataParallelError: a collective failed or timed out.
    """

    def gradients() -> dict[str, float]:
        return fsdp_gradients(
            model,
            rows,
            advantages_N,
            cfg,
            pad_id,
            logprob_fn,
            row_ids=row_ids,
            ref_logprobs=ref_logprobs,
            sampler_logprobs=sampler_logprobs,
            group=group,
        )

    metrics = optimizer_step(model, optimizer, cfg.max_grad_norm, gradients)
    if metrics["optimizer_stepped"] > 0:
        gather_trained(model, full_model)
    return metrics


def gather_trained(model: torch.nn.Module, full_model: torch.nn.Module | None) -> None:
    """Copy the full value of every trainable sharded parameter into ``full_model``'s parameter of
    the same name (a LoRA run: the adapter alone). A collective (one all-gather per parameter):
    every rank calls it; ranks without a full model pass ``None``."""
    dest = dict(full_model.named_parameters()) if full_model is not None else {}
    try:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.requires_grad:
                    full = p.full_tensor() if hasattr(p, "full_tensor") else p
                    if full_model is not None:
                        dest[n].copy_(full)
    except RuntimeError as e:
        raise DataParallelError(f"the trained parameters' all-gather into rank 0's policy did not complete: {e}") from e


# ---- full state dicts: checkpoints and resumes ----------------------------------------------------
def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The sharded optimizer's state gathered whole (``get_optimizer_state_dict`` with
    ``full_state_dict=True, cpu_offload=True``): on rank 0 ``{"state": {name: {...}},
    "param_groups": [...]}`` keyed by parameter names, CPU tensors; ``{}`` on the other ranks.
    A collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    try:
        return get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    except RuntimeError as e:
        raise DataParallelError(f"the optimizer state's gather onto rank 0 did not complete: {e}") from e


def index_keyed(named: dict[str, Any], names: list[str], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A name-keyed full optimizer state (:func:`full_optimizer_state`) in ``optimizer.state_dict()``'s
    format: state keyed by the parameters' indices (``names[i]`` is index i), the param
    groups of ``optimizer`` (the original, whose hyper-parameters the shards copy each step)."""
    index = {n: i for i, n in enumerate(names)}
    return {
        "state": {index[n]: s for n, s in named.get("state", {}).items()},
        "param_groups": optimizer.state_dict()["param_groups"],
    }


def name_keyed(indexed: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """``optimizer.state_dict()`` (keys: indices) keyed by parameter names, as ``set_optimizer_state_dict`` takes it."""
    return {
        "state": {names[i]: s for i, s in indexed["state"].items()},
        "param_groups": [{**_hyper(g), "params": [names[i] for i in g["params"]]} for g in indexed["param_groups"]],
    }


def load_full_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    what: dict[str, bool],
    model_state: dict[str, Any] | None = None,
    optimizer_state: dict[str, Any] | None = None,
) -> None:
    """Load rank 0's full weights and/or optimizer state into every rank's shards (broadcast from
    rank 0, each rank keeping its shard). A collective; ``what`` (``{"model": bool,
    "optimizer": bool}``) is the same on every rank; only rank 0 passes the states (the
    model's full ``state_dict()``, the optimizer's in :func:`name_keyed` form)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    try:
        if what["model"]:
            set_model_state_dict(model, model_state or {}, options=opts)
        if what["optimizer"]:
            set_optimizer_state_dict(model, optimizer, optimizer_state or {}, options=opts)
    except RuntimeError as e:
        raise DataParallelError(f"rank 0's weights / optimizer state did not reach the FSDP shards: {e}") from e

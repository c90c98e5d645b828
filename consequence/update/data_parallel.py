"""Data-parallel optimizer steps over ``torch.distributed`` (gloo, CPU) ranks (update box, issue 18).

One optimizer step of :func:`consequence.update.step.ppo_step`, split over ``world_size``
processes that each hold a replica of the policy and of its optimizer:

1. the step's rows are sharded across ranks (:func:`shard_rows`: deterministic, balanced
   by tokens, i.e. by ``len(row.input_ids)``, the cost of a row's forward/backward);
2. the reduction's totals are made GLOBAL: every rank contributes its shard's counts
   (target tokens, sequences with a target, largest target count) and all ranks use the
   sums (the max for the length constant);
3. each rank accumulates its shard's gradient of −reduce(objective) with those global
   totals (under DDP's ``no_sync``), then ``torch.nn.parallel.DistributedDataParallel``
   all-reduces them with a SUM hook: every rank holds exactly the full-batch gradient
   (:func:`wrap_for_data_parallel` says why a sum and not DDP's mean);
4. each rank clips the global grad norm (the same on every rank: same gradient) and steps
   its own optimizer, so the replicas stay identical (checked after every step).

Why global counts: every reduction (docs/design.md §5) divides a sum over target tokens
by a total of the whole step (target tokens for ``token_mean``, sequences for the
``seq_mean_*`` ones, times the length constant for ``seq_mean_token_sum_norm``). A rank
that divided by its own shard's total would weight its tokens by 1/(its own count), so
the average of the ranks' gradients is not the batch gradient once shards differ in size
(docs/cases.md, case 01 — the same bug as per-micro-batch means). With the global totals
the sum of the ranks' gradients IS the single-process gradient, for any sharding.

:func:`~consequence.update.step.accumulate_gradients` computes its totals from the rows
it is given; a rank runs it on its shard and multiplies the result (gradient and loss)
by ``shard total / global total``. Every reduction is Σ(...)/total with the total a
constant of the step, so that product is the shard's gradient with the global total (up
to float rounding, ~1e-7 relative); the length constant is passed as the global one.

Agreement: a rank's error in its shard (a NaN advantage, a non-finite log-prob, loss or
gradient, a bad row) is exchanged before any gradient is all-reduced, and every rank then
raises the same error (rows named by their index in the whole step), so one rank's NaN
stops every rank, and no rank waits for a collective another rank will never enter.
Every collective is bounded by the process group's timeout; a timeout or a dead peer ends
in :class:`DataParallelError` naming what was waited for.

:class:`DataParallelUpdate` is the trainer's side (``--update-ranks N``): the trainer is
rank 0 and spawns N − 1 rank processes on loopback that each hold a replica of the
learner (model + optimizer, copied from rank 0 at the first step and again whenever rank
0's weights changed outside a data-parallel step). With ``--update-strategy fsdp`` the
ranks hold FSDP2 shards instead of replicas (``update.fsdp``; the launch, the sharding of
rows, the global totals and the error agreement are the same).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import functools
import gc
import math
import os
import pickle
import signal
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from consequence.records import TrainingRow
from consequence.update import fsdp
from consequence.update.agreement import Collective as _Collective
from consequence.update.agreement import DataParallelError, merge_rank_metrics
from consequence.update.agreement import error_info as _error_info
from consequence.update.agreement import raise_agreed as _raise_agreed
from consequence.update.launch import join_launched_group, launched_by_torchrun, receive_message, scatter_messages
from consequence.update.step import (
    NonFiniteError,
    TokenValues,
    UpdateConfig,
    _check_needs,
    _contributes_nothing,
    _step_totals,
    accumulate_gradients,
    optimizer_step,
)

DEFAULT_TIMEOUT_S = 600.0  # one collective: covers the slowest rank's forward/backward of its shard
START_TIMEOUT_S = 180.0  # a rank process starting (imports, unpickling the model) and joining the group


# ---- sharding -------------------------------------------------------------------------
def shard_rows(
    rows: Sequence[TrainingRow],
    world_size: int,
    advantages_N: Sequence[Any] | None = None,
    cfg: UpdateConfig | None = None,
) -> list[list[int]]:
    """Deterministic shards of a step's rows, balanced by tokens.

    Greedy longest-first: rows in order of decreasing ``len(input_ids)`` (ties: lower
    index first), each to the rank with the fewest tokens so far (ties: lower rank). A
    row that will not run a forward/backward (advantage 0 everywhere and no KL, entropy
    or distillation term; :func:`~consequence.update.step.accumulate_gradients` skips it)
    weighs 0 when ``advantages_N`` and ``cfg`` are given.

    Returns:
        ``world_size`` lists of row indices, each ascending; together a partition of
        ``range(len(rows))`` (a shard may be empty when there are fewer rows than ranks).

    Raises:
        ValueError: ``world_size < 1``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")

    def weight(i: int) -> int:
        if advantages_N is not None and cfg is not None:
            a = advantages_N[i]
            if a is not None and not isinstance(a, (list, tuple)) and not math.isfinite(float(a)):
                return len(rows[i].input_ids)  # a NaN advantage still goes somewhere (and is reported there)
            if a is not None and _contributes_nothing(list(a) if isinstance(a, tuple) else a, cfg):
                return 0
        return len(rows[i].input_ids)

    load = [0] * world_size
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(rows)), key=lambda i: (-weight(i), i)):
        k = min(range(world_size), key=lambda r: (load[r], r))
        shards[k].append(i)
        load[k] += weight(i)
    return [sorted(s) for s in shards]


# ---- one data-parallel step (runs on every rank) ----------------------------------------
def data_parallel_gradients(
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
    ddp: DistributedDataParallel | None = None,
) -> dict[str, float]:
    """ADD the full step's gradient of −reduce(objective) to ``.grad`` on every rank.

    Every rank of ``group`` (default: the default process group) calls this at once with
    its own shard of the step (``rows``, ``advantages_N`` and the per-token lists as in
    :func:`~consequence.update.step.accumulate_gradients`: ``old_logprobs``,
    ``ref_logprobs``, ``sampler_logprobs`` aligned with ``row.input_ids``, float lists).
    Afterwards each trainable parameter's ``.grad`` (float32, the parameter's shape) is the
    SUM over ranks of the shards' gradients computed with the step's global totals, i.e.
    the gradient of the whole step in one process; a parameter no rank's shard reached
    keeps ``.grad = None`` (as in one process). Start from zero gradients.

    Args:
        row_ids: the shard's indices in the whole step (``shard_rows(...)[rank]``), used to
            name rows in errors; default ``range(len(rows))``.
        ddp: ``model`` wrapped by :func:`wrap_for_data_parallel` (made once per learner and
            reused); default: wrapped for this call (a collective of its own).

    Returns:
        the step's metrics merged over ranks (:func:`merge_rank_metrics`), identical on
        every rank and equal to one process's (loss summed, token means weighted by each
        rank's ``n_tokens``, ratio extremes over all ranks, counts summed).

    Raises:
        NonFiniteError / ValueError: one rank's shard had a NaN/±inf tensor or a bad row;
            raised on EVERY rank with the same message (rows as step indices, the rank that
            found it named); no gradient was all-reduced and ``.grad`` is left as it was
            after this rank's accumulation (callers zero it).
        DataParallelError: a collective failed or timed out (a rank died or hung).
    """
    col = _Collective(group)
    row_ids = list(range(len(rows))) if row_ids is None else list(row_ids)
    if len(row_ids) != len(rows):
        raise ValueError(f"{len(row_ids)} row_ids for {len(rows)} rows")
    own: BaseException | None = None
    local = None
    try:
        _check_needs(cfg, ref_logprobs, sampler_logprobs)
        local = _step_totals(rows, cfg)
    except Exception as e:  # noqa: BLE001 - agreed below, re-raised on every rank
        own = e
    got = col.gather(
        "the shards' counts (target tokens, sequences, longest target count)",
        (local, None if own is None else _error_info(own, row_ids, col.rank)),
    )
    _raise_agreed([g[1] for g in got], col.world, own)
    counts = [g[0] for g in got]
    tokens = math.fsum(c[0] for c in counts)
    seqs = math.fsum(c[1] for c in counts)
    norm = float(cfg.norm_const) if cfg.norm_const is not None else max(c[2] for c in counts)
    metrics: dict[str, float] | None = None
    ddp = wrap_for_data_parallel(model, group) if ddp is None else ddp
    try:  # every micro-batch divided by the step's global totals: Σ_ranks of the gradients is one process's
        with ddp.no_sync():  # accumulate locally; _synchronize sums once
            metrics = accumulate_gradients(
                model,
                rows,
                advantages_N,
                cfg,
                pad_id,
                logprob_fn,
                ref_logprobs=ref_logprobs,
                sampler_logprobs=sampler_logprobs,
                totals=(tokens, seqs, norm),
            )
    except Exception as e:  # noqa: BLE001
        own = e
    gathered = col.gather(
        "the shards' metrics and errors", (metrics, None if own is None else _error_info(own, row_ids, col.rank))
    )
    _raise_agreed([g[1] for g in gathered], col.world, own)
    merged = merge_rank_metrics([g[0] for g in gathered])
    if merged.get("n_rows_trained", 0) > 0:  # the same decision on every rank (gathered counts)
        _synchronize(ddp, pad_id, col)
    return merged


def wrap_for_data_parallel(model: torch.nn.Module, group=None) -> DistributedDataParallel:
    """``model`` in ``torch.nn.parallel.DistributedDataParallel`` whose all-reduce SUMS.

    A collective (DDP checks the replicas' parameter shapes and broadcasts rank 0's
    values): every rank of ``group`` calls it at once, after the group formed. The
    wrapper holds ``model`` (no copy). DDP's default hook averages the ranks' gradients
    (Σ_r g_r / W); ours sums them (:func:`_sum_hook`), because each rank's gradient is
    already its shard's part of the step's loss (the step's GLOBAL totals divide it), so the
    sum over ranks is the single-process gradient and no loss is rescaled by W.
    ``find_unused_parameters``: a trainable parameter outside the forward (a value head)
    must not stall the reduction.
    """
    ddp = DistributedDataParallel(model, process_group=group, forward_sync_buffers=False, find_unused_parameters=True)
    ddp.register_comm_hook(group, _sum_hook)
    return ddp


def _sum_hook(group, bucket):  # no annotations: DDP checks them, and this module's are strings
    """DDP communication hook: Σ over ranks of one gradient bucket (``dist.GradBucket``), no
    division by W; returns the future of the summed flat buffer."""
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _synchronize(ddp: DistributedDataParallel, pad_id: int, col: _Collective) -> None:
    """Sum the ranks' accumulated ``.grad`` through DDP's reducer.

    The micro-batches ran on the bare module under ``no_sync()``, so their gradients were
    only accumulated locally (a rank may have run none: every row skipped, or an empty
    shard). One forward of a single pad token through the wrapper, times 0, then backward:
    DDP's hooks fire on every parameter of the forward and all-reduce the buckets, which
    hold the accumulated gradients (torch's documented ``no_sync`` accumulation). Every
    rank runs exactly one such backward per step, however uneven the shards.
    """
    device = next(ddp.module.parameters()).device
    ids = torch.full((1, 1), pad_id, dtype=torch.long, device=device)
    try:
        out = ddp(input_ids=ids, attention_mask=torch.ones_like(ids))
        logits = out.logits if hasattr(out, "logits") else out[0]
        (logits.float().sum() * 0.0).backward()
    except RuntimeError as e:  # gloo / NCCL timeouts and closed connections surface here
        raise DataParallelError(
            f"update rank {col.rank} of {col.world}: the gradients' all-reduce (DistributedDataParallel) "
            f"did not complete: every rank must enter it, within the process group's timeout "
            f"(--update-ranks; a rank died or hung): {e}"
        ) from e


def data_parallel_step(
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
    group=None,
    ddp: DistributedDataParallel | None = None,
    check_replicas: bool = True,
) -> dict[str, float]:
    """One optimizer step of :func:`~consequence.update.step.ppo_step`, data-parallel.

    Every rank passes its shard (see :func:`data_parallel_gradients`); then each clips the
    (identical) global grad norm to ``cfg.max_grad_norm`` and steps its optimizer, so the
    replicas stay identical. When no row of any shard ran (every advantage 0, no KL or
    entropy term) no optimizer steps.

    Args:
        ddp: as :func:`data_parallel_gradients`.
        check_replicas: after the step, compare a float64 checksum of every rank's
            trainable parameters (one more collective).

    Returns:
        the metrics of ``ppo_step`` for the whole step (the same on every rank):
        :func:`merge_rank_metrics` of the shards, ``grad_norm`` (before clipping, when it
        stepped) and ``optimizer_stepped``.

    Raises:
        NonFiniteError / ValueError: as :func:`data_parallel_gradients`, or a non-finite
            global grad norm (then on every rank, since the gradient is the same); the
            optimizer does not step and the gradients are zeroed.
        DataParallelError: a collective failed or timed out, or the replicas differ.
    """

    def gradients() -> dict[str, float]:
        return data_parallel_gradients(
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
            ddp=ddp,
        )

    metrics = optimizer_step(model, optimizer, cfg.max_grad_norm, gradients)
    if check_replicas:
        check_replicas_equal(model, group)
    return metrics


def parameter_checksum(model: torch.nn.Module) -> list[float]:
    """Float64 sums of the trainable parameters' values and |values| (a cheap replica check)."""
    with torch.no_grad():
        ps = [p.detach() for p in model.parameters() if p.requires_grad]
        return [
            math.fsum(float(p.sum(dtype=torch.float64)) for p in ps),
            math.fsum(float(p.abs().sum(dtype=torch.float64)) for p in ps),
        ]


def check_replicas_equal(model: torch.nn.Module, group=None) -> None:
    """Raise DataParallelError unless every rank's trainable parameters have the same checksum."""
    col = _Collective(group)
    sums = col.gather("the replicas' parameter checksums", parameter_checksum(model))
    if any(s != sums[0] for s in sums):
        raise DataParallelError(
            f"the update ranks' policy replicas differ after the optimizer step "
            f"(checksums by rank: {sums}); the ranks must start from the same weights "
            "and optimizer state"
        )


# ---- the trainer's side: rank 0 and its rank processes -----------------------------------
def max_update_ranks() -> int:
    """The most ``--update-ranks`` this machine runs: one rank per usable CPU core, 2 at least."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(2, cores)


def check_rank_count(n: int) -> None:
    """Refuse more ``--update-ranks`` than this machine runs (:func:`max_update_ranks`). The
    settings data parallelism cannot run with are refused by the config itself
    (``TrainConfig``'s ``_update_ranks_fit``).

    Under torchrun (:func:`~consequence.update.launch.launched_by_torchrun`) the ranks are
    torchrun's processes, on this node or others: ``n`` must be their number.

    Raises:
        ValueError: more ranks than ``max_update_ranks()``; the message says how many fit. Under
            torchrun: ``n`` is not ``WORLD_SIZE``.
    """
    if (launched := launched_by_torchrun()) is not None:
        if n != launched[1]:
            raise ValueError(
                f"--update-ranks {n}, but torchrun started {launched[1]} processes (WORLD_SIZE): every rank "
                f"but rank 0 serves the update, so give --update-ranks {launched[1]}"
            )
        return
    if n > (cap := max_update_ranks()):
        raise ValueError(
            f"--update-ranks {n} would start {n} processes on loopback, each with a copy of the policy "
            f"and optimizer, on a machine with {os.cpu_count()} CPU cores; use at most {cap} "
            "(one rank per core; 2 at least, to test data parallelism)"
        )


class _Ranks:
    """The rank processes and their pipes (kept apart from the owner, for its finalizer)."""

    def __init__(self) -> None:
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.owns_group = False
        self.launched = False  # the other ranks were started by torchrun, not by us

    def describe(self) -> str:
        out = []
        for k, p in enumerate(self.procs, start=1):
            state = "alive" if p.is_alive() else f"exited with code {p.exitcode}"
            out.append(f"rank {k} (pid {p.pid}) {state}")
        return ", ".join(out) or "none started"

    def dead(self) -> list[str]:
        return [
            f"update rank {k} (pid {p.pid}) exited with code {p.exitcode}" + self._last_words(k - 1)
            for k, p in enumerate(self.procs, start=1)
            if not p.is_alive()
        ]

    def _last_words(self, j: int) -> str:
        try:
            while self.conns[j].poll(0):
                msg = self.conns[j].recv()
                if isinstance(msg, tuple) and msg and msg[0] == "error":
                    return f": {msg[1]}"
        except (EOFError, OSError):
            pass
        return ""

    def shutdown(self) -> None:
        """Ask every rank process to stop, then terminate and kill the ones that did not
        (ranks torchrun launched are told to stop through the group; torchrun ends them)."""
        if self.launched and dist.is_initialized():
            with contextlib.suppress(RuntimeError):  # a rank already gone: torchrun tears the job down
                scatter_messages([("stop",)] * (dist.get_world_size() - 1))
        self.launched = False
        for c in self.conns:
            with contextlib.suppress(OSError, ValueError):  # a rank whose pipe is already closed
                c.send(("stop",))
        deadline = time.monotonic() + 10.0
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)
        for c in self.conns:
            with contextlib.suppress(OSError):
                c.close()
        self.procs, self.conns = [], []
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_group = False


class DataParallelUpdate:
    """Rank 0 of ``--update-ranks N``: runs every optimizer step data-parallel.

    The trainer process is rank 0; at the first step it spawns N − 1 rank processes on
    loopback (gloo, a TCP store on a port the OS picks), each with a copy of the policy
    and of its optimizer (pickled from rank 0). Each step, rank 0 shards the rows
    (:func:`shard_rows`), sends each rank its shard through a pipe, and every rank runs
    :func:`data_parallel_step`; rank 0's model and optimizer end up exactly as the other
    replicas. Rank 0's weights are checked before each step; weights changed outside a
    data-parallel step (a resume state loaded, ...) are sent again.

    :meth:`ppo_step` has the signature of :func:`consequence.update.step.ppo_step`.
    :meth:`close` stops the rank processes (also run at garbage collection and at exit);
    the rank processes ignore Ctrl-C (the trainer handles it and closes them) and exit when
    the trainer's end of their pipe closes (the trainer died).

    Args:
        world_size: N ≥ 2 ranks including this process.
        timeout_s: bound of every collective (and of the group's start).
        start_timeout_s: bound of a rank process's start (spawn, imports, the model copy).
        threads_per_rank: torch threads of each rank during a step (default: the CPU
            count over N, at least 1); rank 0's setting is restored after each step.
        strategy: ``"ddp"`` (each rank a replica of the policy and optimizer) or ``"fsdp"``
            (each rank a ``fully_shard`` shard of a training copy and of the optimizer state,
            ``update.fsdp``): rank 0 then keeps its own full policy for sampling, evaluation
            and checkpoints, updated after every step, and its optimizer keeps the param
            groups (the lr schedule writes them) but no state (:meth:`full_optimizer_state`).

    Raises:
        ValueError: ``world_size < 2`` or an unknown ``strategy``.
    """

    def __init__(
        self,
        world_size: int,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        start_timeout_s: float = START_TIMEOUT_S,
        threads_per_rank: int | None = None,
        strategy: str = "ddp",
    ) -> None:
        if world_size < 2:
            raise ValueError(f"a data-parallel update needs at least 2 ranks, got {world_size}")
        if strategy not in ("ddp", "fsdp"):
            raise ValueError(f"unknown update strategy {strategy!r}; valid: ddp, fsdp (--update-strategy)")
        self.strategy = strategy
        self._fsdp: tuple[torch.nn.Module, torch.optim.Optimizer] | None = None  # rank 0's shards (fsdp)
        self._names: list[str] = []  # fsdp: the optimizer's parameters by name, in state_dict index order
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self.threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
        self._ranks = _Ranks()
        self._finalizer = weakref.finalize(self, self._ranks.shutdown)
        self._broken: str | None = None
        self._checksum: list[float] | None = None  # rank 0's parameters after the last data-parallel step
        self._model_id: int | None = None  # the model the replicas copy, once started
        self._ddp: DistributedDataParallel | None = None  # rank 0's wrapper of that model
        self._launched_at = 0.0
        self._launched = launched_by_torchrun()  # (rank, world size) when torchrun started this process
        if self._launched is not None:
            check_rank_count(world_size)  # torchrun's WORLD_SIZE

    # -- life cycle
    def launch(self, model_module: str | None = None) -> DataParallelUpdate:
        """Spawn the rank processes now (they import torch and ``model_module`` while the
        trainer rolls out); the policy copy follows at the first step. Idempotent.

        Raises:
            DataParallelError: this process already has a torch.distributed default group.
        """
        import importlib
        import multiprocessing as mp

        if self._ranks.procs or self._broken or self._launched:
            return self  # torchrun started the other ranks
        if dist.is_initialized():
            raise DataParallelError(
                "--update-ranks needs this process's torch.distributed default group, but one "
                "is already initialized; run one data-parallel trainer per process"
            )
        importlib.import_module("consequence.update.data_parallel")  # the spawned processes' entry point
        self._store = dist.TCPStore(
            "127.0.0.1",
            0,
            self.world_size,
            True,
            timeout=datetime.timedelta(seconds=self.start_timeout_s),
            wait_for_workers=False,
        )
        ctx = mp.get_context("spawn")
        r = self._ranks
        for rank in range(1, self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_rank_main,
                name=f"consequence-update-rank-{rank}",
                daemon=True,
                args=(
                    rank,
                    self.world_size,
                    self._store.port,
                    child,
                    self.timeout_s,
                    self.start_timeout_s,
                    self.threads,
                    model_module,
                ),
            )
            p.start()
            child.close()
            r.procs.append(p)
            r.conns.append(parent)
        self._launched_at = time.monotonic()
        return self

    def _wait_for(self, what: str, deadline: float) -> None:
        hint = (
            "; the rank processes are started with multiprocessing's spawn, which imports the main module "
            'again: a script that trains must do so under `if __name__ == "__main__":`'
        )
        r = self._ranks
        for k, conn in enumerate(r.conns, start=1):
            while not conn.poll(0.2):
                if not r.procs[k - 1].is_alive() or time.monotonic() > deadline:
                    self._fail(f"update rank {k} was not {what} within {self.start_timeout_s:.0f} s of its start{hint}")
            msg = self._recv(conn, k, what)
            if msg[0] == "error":
                self._fail(f"update rank {k} failed to start: {msg[1]}")

    def start(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Launch if needed, send the replicas their copy of ``model`` and ``optimizer``, form the
        gloo group (the first :meth:`ppo_step` does this itself). Idempotent.

        Raises:
            DataParallelError: a rank process did not start within ``start_timeout_s``, or the
                group did not form within ``timeout_s`` (the message names the rank).
        """
        if not self.started:
            self._start(model, optimizer)

    def _start(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self._launched:
            self._join_launched(model, optimizer)
        else:
            self._start_spawned(model, optimizer)
        try:
            if self.strategy == "fsdp":  # a training copy: the original stays whole, for sampling
                spec = fsdp.optimizer_spec(model, optimizer)
                self._names = fsdp.param_names(spec)
                self._fsdp = fsdp.shard_learner(copy.deepcopy(model), spec)
            else:
                self._ddp = wrap_for_data_parallel(model)
        except RuntimeError as e:
            self._fail(f"the update ranks did not wrap or shard their copies of the policy together: {e}")
        self._model_id = id(model)
        self._checksum = parameter_checksum(model)

    def _replica_bytes(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bytes:
        try:
            return pickle.dumps(_replica_state(model, optimizer, self.strategy), protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            self._fail(f"the policy and its optimizer cannot be copied to the update ranks (pickle: {e})")
            raise  # _fail raised already

    def _join_launched(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Rank 0 of a torchrun launch: form the group from the environment, send the copy."""
        try:
            join_launched_group(self.timeout_s)
            self._ranks.owns_group = self._ranks.launched = True
            dist.broadcast_object_list([self._replica_bytes(model, optimizer)], src=0)
        except RuntimeError as e:
            self._fail(f"the torchrun-launched update ranks did not take the policy copy: {e}")

    def _start_spawned(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.launch(type(model).__module__)
        r = self._ranks
        deadline = self._launched_at + self.start_timeout_s
        self._wait_for("up (spawned, imports done)", deadline)
        init = self._replica_bytes(model, optimizer)
        for k, conn in enumerate(r.conns, start=1):
            self._send(conn, ("init", init), f"the policy copy to update rank {k}")
        self._wait_for("ready (policy copy loaded)", time.monotonic() + self.start_timeout_s)
        try:
            dist.init_process_group(
                "gloo",
                store=self._store,
                rank=0,
                world_size=self.world_size,
                timeout=datetime.timedelta(seconds=self.timeout_s),
            )
        except RuntimeError as e:
            self._fail(
                f"the gloo process group of {self.world_size} update ranks did not form within "
                f"{self.timeout_s:.0f} s: {e}"
            )
        r.owns_group = True

    def close(self) -> None:
        """Stop the rank processes and destroy the process group (idempotent).

        Rank 0's shards and DDP wrapper go first: their gloo work objects must be freed while
        the group exists; freed later, at interpreter exit, they abort the process (SIGABRT,
        "terminate called without an active exception")."""
        self._fsdp, self._ddp = None, None
        gc.collect()
        self._finalizer()

    def __enter__(self) -> DataParallelUpdate:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def started(self) -> bool:
        return self._model_id is not None

    # -- errors and messages
    def _fail(self, msg: str) -> None:
        dead = self._ranks.dead()
        full = msg + (f"; {'; '.join(dead)}" if dead else "") + f" (rank processes: {self._ranks.describe()})"
        self._broken = full
        self.close()
        raise DataParallelError(full)

    def _send(self, conn, msg, what: str) -> None:
        try:
            conn.send(msg)
        except (OSError, ValueError) as e:
            self._fail(f"could not send {what} to an update rank ({e})")

    def _recv(self, conn, rank: int, what: str):
        try:
            return conn.recv()
        except (EOFError, OSError) as e:
            self._fail(f"update rank {rank} closed its pipe while rank 0 waited for {what} ({e!r})")

    def _send_jobs(self, jobs: list[dict[str, Any]]) -> None:
        """Each rank k ≥ 1 its step (``jobs[k - 1]``): through its pipe, or, for ranks that
        torchrun launched, one ``scatter_object_list`` over the process group."""
        if self._launched:
            try:
                scatter_messages([("step", j) for j in jobs])
            except RuntimeError as e:
                self._fail(f"the step's shards did not reach the torchrun-launched update ranks: {e}")
            return
        for k, conn in enumerate(self._ranks.conns, start=1):
            self._send(conn, ("step", jobs[k - 1]), "the step's shard")

    # -- the step
    def ppo_step(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        rows: Sequence[TrainingRow],
        advantages_N: Sequence[Any],
        cfg: UpdateConfig,
        pad_id: int,
        logprob_fn: Callable[..., Any],
        *,
        ref_logprobs: TokenValues | None = None,
        sampler_logprobs: TokenValues | None = None,
        teacher: torch.nn.Module | None = None,
    ) -> dict[str, float]:
        """:func:`consequence.update.step.ppo_step` over ``world_size`` ranks (same arguments,
        same returned metrics, same errors with rows named by their index in ``rows``).

        Raises:
            ValueError: a ``teacher`` or a distillation loss (not data-parallel), or as ppo_step.
            NonFiniteError: as ppo_step, whichever rank's shard held the non-finite tensor.
            DataParallelError: a rank process died, a wait timed out, or the replicas differ;
                the rank processes are stopped and the object cannot step again.
        """
        if teacher is not None or cfg.distill_loss != "none":
            raise ValueError("a data-parallel update (--update-ranks > 1) holds no teacher; use --update-ranks 1")
        if self._broken:
            raise DataParallelError(f"the data-parallel update stopped earlier: {self._broken}")
        if not self.started:
            self._start(model, optimizer)
        elif id(model) != self._model_id:
            raise ValueError("this DataParallelUpdate holds replicas of another model; make one per learner")
        r = self._ranks
        if r.dead():
            self._fail("an update rank process is gone before the optimizer step")
        state = None
        if self._fsdp is not None:
            state = self._fsdp_pending(model, optimizer)
        elif parameter_checksum(model) != self._checksum:  # weights changed outside a data-parallel step
            state = _resync_state(model, optimizer)
        shards = shard_rows(rows, self.world_size, advantages_N, cfg)
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        jobs = []
        for k in range(1, self.world_size):
            pick = lambda xs, s=shards[k]: None if xs is None else [xs[i] for i in s]  # noqa: E731
            jobs.append(
                {
                    "rows": pick(rows),
                    "advantages": pick(advantages_N),
                    "row_ids": shards[k],
                    "ref_logprobs": pick(ref_logprobs),
                    "sampler_logprobs": pick(sampler_logprobs),
                    "cfg": cfg,
                    "pad_id": pad_id,
                    "logprob_fn": logprob_fn,
                    "hyper": hyper,
                    "state": state,
                }
            )
        self._send_jobs(jobs)
        threads = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        mine = shards[0]
        args = ([rows[i] for i in mine], [advantages_N[i] for i in mine], cfg, pad_id, logprob_fn)
        kw: dict[str, Any] = {
            "row_ids": mine,
            "ref_logprobs": None if ref_logprobs is None else [ref_logprobs[i] for i in mine],
            "sampler_logprobs": None if sampler_logprobs is None else [sampler_logprobs[i] for i in mine],
        }
        try:
            if self._fsdp is not None:
                m = self._fsdp_step(model, optimizer, state, hyper, args, kw)
            else:
                m = data_parallel_step(model, optimizer, *args, **kw, ddp=self._ddp)
        except DataParallelError as e:
            self._fail(f"the data-parallel optimizer step failed: {e}")
        finally:
            torch.set_num_threads(threads)
        self._checksum = parameter_checksum(model)
        return m

    # -- fsdp: rank 0's full policy and stateless optimizer beside its shards
    def _fsdp_pending(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, bool] | None:
        """What of rank 0's learner changed outside an fsdp step and must reach the shards: its
        trained weights (the checksum moved), or an optimizer state (rank 0's optimizer holds
        none in fsdp mode, so one that has some was loaded into it: a resume)."""
        what = {"model": parameter_checksum(model) != self._checksum, "optimizer": bool(optimizer.state)}
        return what if any(what.values()) else None

    def _fsdp_step(self, model, optimizer, pending, hyper, args, kw) -> dict[str, float]:
        """Rank 0's part of an fsdp step: pending weights / optimizer state into every rank's
        shards (then rank 0's optimizer holds no state again), the lr schedule's hyper-parameters,
        the step, and the trained parameters gathered back into ``model``."""
        assert self._fsdp is not None
        shard, shard_opt = self._fsdp
        if pending is not None:
            opt_state = fsdp.name_keyed(optimizer.state_dict(), self._names) if pending["optimizer"] else None
            fsdp.load_full_state(shard, shard_opt, pending, model.state_dict() if pending["model"] else None, opt_state)
            optimizer.state.clear()
        for g, h in zip(shard_opt.param_groups, hyper):
            g.update(h)
        return fsdp.fsdp_step(shard, shard_opt, *args, **kw, full_model=model)

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The policy optimizer's whole state in ``optimizer.state_dict()``'s format (what a resume
        state saves and ``optimizer.load_state_dict`` reads back), ``optimizer`` being rank 0's.

        ``ddp``, or before the first step: ``optimizer.state_dict()`` (rank 0's replica holds
        it all). ``fsdp``: the shards' states gathered onto rank 0 (a collective: every rank
        takes part), keyed by the parameters' indices in ``optimizer``. A state loaded into
        ``optimizer`` afterwards (a resume) reaches the shards at the next step.

        Raises:
            DataParallelError: the update stopped earlier, or the gather failed.
        """
        if self._fsdp is None or optimizer.state:  # not sharded yet, or a loaded state not yet sent
            return optimizer.state_dict()
        if self._broken:
            raise DataParallelError(f"the data-parallel update stopped earlier: {self._broken}")
        self._send_all(("optimizer_state",), "the request for the optimizer state")
        try:
            named = fsdp.full_optimizer_state(*self._fsdp)
        except DataParallelError as e:
            self._fail(f"the optimizer state was not gathered: {e}")
        return fsdp.index_keyed(named, self._names, optimizer)

    def _send_all(self, msg: tuple, what: str) -> None:
        """``msg`` to every rank k ≥ 1 (pipes, or a scatter to torchrun's ranks)."""
        if self._launched:
            try:
                scatter_messages([msg] * (self.world_size - 1))
            except RuntimeError as e:
                self._fail(f"{what} did not reach the torchrun-launched update ranks: {e}")
            return
        for conn in self._ranks.conns:
            self._send(conn, msg, what)


def _replica_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, strategy: str = "ddp") -> dict[str, Any]:
    """What a rank process needs to hold its learner. ``ddp``: model and optimizer pickled
    together (pickle keeps the optimizer's groups pointing at the model's parameters).
    ``fsdp``: the model and the optimizer's spec (``fsdp.optimizer_spec``), without state: each
    rank shards both, and a state reaches the shards by broadcast (``fsdp.load_full_state``)."""
    if strategy == "fsdp":
        return {"strategy": "fsdp", "model": model, "optimizer_spec": fsdp.optimizer_spec(model, optimizer)}
    return {"model": model, "optimizer": optimizer}


def _hold_replica(replica: dict[str, Any]) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """A rank's learner from rank 0's copy: ``(model, optimizer, DDP wrapper)``, or for fsdp
    ``(sharded model, sharded optimizer, None)``. A collective: rank 0 wraps or shards its own
    copy at the same point (``DataParallelUpdate._start``)."""
    if replica.get("strategy") == "fsdp":
        model, optimizer = fsdp.shard_learner(replica["model"], replica["optimizer_spec"])
        return model, optimizer, None
    return replica["model"], replica["optimizer"], wrap_for_data_parallel(replica["model"])


def _resync_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Rank 0's weights and optimizer state, for replicas that already exist."""
    return {"model_state": model.state_dict(), "optimizer_state": optimizer.state_dict()}


def _load_replica(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    model.load_state_dict(state["model_state"])
    optimizer.load_state_dict(state["optimizer_state"])


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    conn,
    timeout_s: float,
    start_timeout_s: float,
    threads: int,
    model_module: str | None = None,
) -> None:
    """A rank process: build the replica, join the group, then run the steps rank 0 sends.

    Exits on ``("stop",)``, when rank 0's end of the pipe closes (rank 0 died), or after
    a collective failed (the group is then unusable; the reason is sent to rank 0 first).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    torch.set_num_threads(threads)
    try:
        if model_module:  # the model's code, imported while rank 0 rolls out
            import importlib

            importlib.import_module(model_module)
        conn.send(("up",))
        msg = conn.recv()
        replica = pickle.loads(msg[1])
        conn.send(("ready",))
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=datetime.timedelta(seconds=start_timeout_s))
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
        )
        model, optimizer, ddp = _hold_replica(replica)  # a collective: rank 0 wraps its model at the same point
    except EOFError:
        return
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, which names it
        _tell(conn, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}")
        raise SystemExit(1) from None  # the error went to rank 0 above; the exit code says which kind
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return  # rank 0 is gone
            if msg[0] == "stop":
                return
            try:
                _serve(model, optimizer, ddp, msg)
            except DataParallelError as e:
                _tell(conn, str(e))
                raise SystemExit(2) from None
            except Exception as e:  # noqa: BLE001
                _tell(conn, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}")
                raise SystemExit(3) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _serve(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ddp: DistributedDataParallel | None, msg) -> None:
    """One message of rank 0 on a rank k ≥ 1: a step (:func:`run_job`), or, with fsdp, its part
    of gathering the optimizer state onto rank 0 (``DataParallelUpdate.full_optimizer_state``)."""
    if msg[0] == "optimizer_state":
        fsdp.full_optimizer_state(model, optimizer)  # rank 0 keeps the gathered state; this rank gets {}
    else:
        run_job(model, optimizer, ddp, msg[1])


def run_job(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ddp: DistributedDataParallel | None, job) -> None:
    """One step on a rank k ≥ 1: rank 0's weights if they changed outside a step, its
    optimizer hyper-parameters (a schedule), then :func:`data_parallel_step` on the shard.
    An agreed error (NonFiniteError, ValueError: raised on rank 0 too) leaves the group in
    step and is not re-raised here. ``ddp`` ``None``: ``model`` and ``optimizer`` are this
    rank's FSDP shards (``--update-strategy fsdp``), and the step is ``fsdp.fsdp_step``.

    Raises:
        DataParallelError: a collective failed; the group cannot be used afterwards.
    """
    if job["state"] is not None:  # fsdp: by broadcast into the shards; ddp: into the replica
        (fsdp.load_full_state if ddp is None else _load_replica)(model, optimizer, job["state"])
    for g, h in zip(optimizer.param_groups, job["hyper"]):
        g.update(h)
    step = fsdp.fsdp_step if ddp is None else functools.partial(data_parallel_step, ddp=ddp)
    with contextlib.suppress(NonFiniteError, ValueError):
        step(
            model,
            optimizer,
            job["rows"],
            job["advantages"],
            job["cfg"],
            job["pad_id"],
            job["logprob_fn"],
            row_ids=job["row_ids"],
            ref_logprobs=job["ref_logprobs"],
            sampler_logprobs=job["sampler_logprobs"],
        )


def _tell(conn, text: str) -> None:
    with contextlib.suppress(OSError, ValueError):  # rank 0 is gone: nobody to tell
        conn.send(("error", text))


def serve_update_rank(timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Rank k ≥ 1 of a torchrun launch (docs/async.md §7): hold a replica (or, with
    ``--update-strategy fsdp``, shards) and run rank 0's steps until it sends stop. The replica
    is rank 0's policy and optimizer, pickled and broadcast over the group (the same copy a
    spawned rank gets through its pipe).

    Raises:
        RuntimeError: this process was not launched as a rank k ≥ 1, or a collective failed
            (rank 0 died: torchrun then ends the job).
    """
    launched = launched_by_torchrun()
    if launched is None or launched[0] == 0:
        raise RuntimeError("serve_update_rank runs on the ranks k >= 1 that torchrun started")
    join_launched_group(timeout_s)
    try:
        got: list[Any] = [None]
        dist.broadcast_object_list(got, src=0)
        model, optimizer, ddp = _hold_replica(pickle.loads(got[0]))  # a collective, as on rank 0
        while (msg := receive_message())[0] != "stop":
            _serve(model, optimizer, ddp, msg)
    finally:
        dist.destroy_process_group()

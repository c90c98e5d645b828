"""The trainer's side of asynchronous rollouts: Ray actors, versioned weights, the queue.

    publish(model, v)   the trainer's weights after v updates → Ray's object store
    next_batch(it)      start batches on idle workers (admission rule), wait for one to
                        finish, drop it if too stale, return the first fresh one; every
                        wait bounded by --rollout-timeout

Batches are numbered like the synchronous loop's iterations and carry their seeds, so
with k = 0 batch ``it`` is rolled out with version ``it`` by one worker at a time: the
synchronous run, in other processes. Batches are consumed in the order they finish.
A worker that dies is replaced and its batch re-run (counted); a batch the trainer never
consumes (cancelled at the end) is counted too. Nothing is lost silently.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from collections import deque
from collections.abc import Callable, Set
from dataclasses import dataclass
from typing import Any

import torch

from consequence.config import TrainConfig
from consequence.scale.staleness import lag, lag_metrics, may_start
from consequence.scale.worker import RolloutWorker, trainable_state

__all__ = ["AsyncRollouts", "RolloutError", "batches_done", "worker_runtime_env", "worker_threads"]

MAX_ATTEMPTS = 3  # runs of one batch (a worker died under it) before the run stops


class RolloutError(RuntimeError):
    """The rollout workers cannot go on: Ray unreachable, a worker that does not start, a wait
    past ``--rollout-timeout``, a batch that keeps killing its worker. The message says which
    and what to do; ``consequence train`` stops with it (the newest resume state is intact)."""

    rollouts = True  # resume.stop_message says it as is


def _cause(error: Exception) -> str:
    """The last ``SomethingError: message`` line of a Ray error's text (the worker's own error)."""
    lines = [ln.strip() for ln in str(error).splitlines() if re.match(r"\s*[\w.]+(Error|Exception): ", ln)]
    return lines[-1] if lines else str(error).splitlines()[0]


@dataclass
class _Job:
    batch: int
    worker: int
    version: int
    ref: Any  # ray.ObjectRef of RolloutWorker.run
    started: float
    attempt: int


def worker_threads(cfg: TrainConfig, cores: int | None = None) -> int:
    """Torch threads of each rollout worker.

    On a local instance the trainer's threads (``cores``, default ``torch.get_num_threads()``)
    are the machine's share: the c = min(N, k + 1) batches that can run at once split them,
    ⌊cores / c⌋ each, so with k = 0 a worker takes them all, as the synchronous loop does
    (the same kernels, the same log-probs to the bit). The trainer keeps its threads: on
    2 cores, giving the update 1 thread while a worker has the other made 6 iterations 15 %
    slower than letting both use 2 (benchmarks/results/bench_async*.json). On a cluster each
    worker asks Ray for 1 CPU and takes 1 thread.
    """
    cores = cores or torch.get_num_threads()
    if cfg.ray_address:
        return 1
    return max(1, cores // min(cfg.rollout_workers, cfg.max_staleness + 1))


def worker_runtime_env(threads: int) -> dict[str, Any]:
    """The Ray runtime environment of a rollout worker with ``threads`` torch threads.

    The thread count is set through the environment the process starts with
    (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``; Ray would set 1) rather than by calling
    ``torch.set_num_threads`` in it: that call also switches MKL's dynamic threading off
    (ATen's ``set_num_threads``), which may change float results, so a worker would no
    longer compute bit for bit as the trainer, which never calls it. Neither process calls
    it, and with k = 0 the worker's rollouts are the synchronous loop's.
    """
    return {"env_vars": {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}}


def batches_done(history: list[dict[str, Any]]) -> set[int]:
    """Batch indices a resumed run must not roll out again: consumed or dropped by the
    iterations in ``history`` (their metrics lines' ``batch`` and ``dropped_batches``)."""
    done = {m["batch"] for m in history if "batch" in m}
    for m in history:
        done.update(m.get("dropped_batches", []))
    return done


class AsyncRollouts:
    """Rollout workers on Ray and the queue of scored batches (docs/async.md).

    Args:
        cfg: the run's config: ``rollout_workers`` (N), ``max_staleness`` (k),
            ``ray_address``, ``rollout_timeout``.
        model_path: the starting policy folder every worker loads first.
        done: batch indices already consumed or dropped (a resumed run: :func:`batches_done`);
            the lowest missing indices are rolled out first, so no batch is lost or duplicated.
        log: one line per event worth telling the user (worker started, replaced).

    Raises:
        RolloutError: Ray cannot start or reach ``ray_address``, or a worker does not start
            within ``rollout_timeout`` or fails to (the message names the worker and the
            cluster's CPUs, or the worker's own error).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        model_path: str,
        done: Set[int] = frozenset(),
        log: Callable[[str], None] = lambda line: None,
        ray_module=None,
        worker_cls=RolloutWorker,
    ):
        if ray_module is None:
            import ray as ray_module
        ray = ray_module  # tests pass a scripted stand-in to fix the order in which batches finish

        self.cfg, self.model_path, self.log, self.k = cfg, str(model_path), log, cfg.max_staleness
        self._ray = ray
        self._own_ray = not ray.is_initialized()
        if self._own_ray:
            self._init_ray()
        top = max(done, default=-1)
        self.todo: deque[int] = deque(sorted(set(range(top + 1)) - set(done)))
        self.next_new = top + 1
        self.jobs: dict[int, _Job] = {}  # by worker slot
        self.finished: list[tuple[dict[str, Any], _Job]] = []  # in order of completion
        self.attempts: dict[int, int] = {}
        self.version, self.state_ref = -1, None
        self.reruns = 0
        # the trainer's threads are left as they are (worker_runtime_env says why)
        self.threads = worker_threads(cfg)
        self.actor_cls = ray.remote(num_cpus=1)(worker_cls)
        self.workers = [self._start_worker(i) for i in range(cfg.rollout_workers)]
        self.where = self._wait_ready(list(range(cfg.rollout_workers)))

    # ---- set-up and teardown ------------------------------------------------------------
    def _init_ray(self) -> None:
        kw: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
        if self.cfg.ray_address:
            kw["address"] = self.cfg.ray_address
        else:  # a new local instance (not $RAY_ADDRESS), sized so that every worker fits
            kw |= {"address": "local", "num_cpus": max(os.cpu_count() or 1, self.cfg.rollout_workers)}
        try:
            self._ray.init(**kw)
        except (ConnectionError, RuntimeError, ValueError) as e:
            where = (
                f"the Ray cluster at --ray-address {self.cfg.ray_address}"
                if self.cfg.ray_address
                else "a local Ray instance"
            )
            raise RolloutError(
                f"could not start or reach {where}: {e}. Start a cluster with `ray start --head` and "
                "pass the address it prints, or drop --ray-address for a local instance"
            ) from e

    def _start_worker(self, slot: int):
        return self.actor_cls.options(
            scheduling_strategy="SPREAD", runtime_env=worker_runtime_env(self.threads)
        ).remote(self.cfg, self.model_path, self.threads, slot, sys.path)

    def _wait_ready(self, slots: list[int]) -> dict[int, dict[str, Any]]:
        refs = {self.workers[s].ready.remote(): s for s in slots}
        ready, pending = self._ray.wait(list(refs), num_returns=len(refs), timeout=self.cfg.rollout_timeout)
        if pending:
            cpus = self._ray.cluster_resources().get("CPU", 0)
            raise RolloutError(
                f"rollout worker(s) {sorted(refs[p] for p in pending)} did not start within "
                f"--rollout-timeout {self.cfg.rollout_timeout:g} s; each needs 1 CPU of the Ray "
                f"cluster, which has {cpus:g}: add nodes or lower --rollout-workers"
            )
        where = {}
        for ref in ready:
            try:
                where[refs[ref]] = self._get(ref, f"start of rollout worker {refs[ref]}")
            except self._ray.exceptions.RayActorError as e:  # its __init__ raised: say the worker's own error
                raise RolloutError(f"rollout worker {refs[ref]} failed to start: {_cause(e)}") from None
            w = where[refs[ref]]
            node = f" (Ray node {w['node'][:8]})" if w.get("node") else ""
            self.log(f"rollout worker {refs[ref]}: pid {w['pid']} on {w['host']}{node}, {w['threads']} torch threads")
        return where

    def close(self) -> dict[str, int]:
        """Cancel unconsumed batches, stop the workers (and Ray when this object started it).

        Returns:
            ``unconsumed_batches``: started or finished batches no iteration trained on.
        """
        unconsumed = len(self.jobs) + len(self.finished)
        if self.cfg.rollout_engine != "ours":  # an engine's own processes end before their actor (bounded wait)
            self._ray.wait([w.close.remote() for w in self.workers], num_returns=len(self.workers), timeout=60)
        for w in self.workers:
            with contextlib.suppress(Exception):  # an actor that already died needs no kill
                self._ray.kill(w)
        self.jobs.clear()
        self.finished.clear()
        if self._own_ray and self._ray.is_initialized():
            self._ray.shutdown()
        return {"unconsumed_batches": unconsumed}

    # ---- weights ------------------------------------------------------------------------
    def publish(self, model: torch.nn.Module, version: int) -> None:
        """Make ``version`` of the trainer's weights the one new batches start with.

        The state is copied into Ray's object store once; workers fetch it when their next
        batch starts (``RolloutWorker.run``), so a batch in flight keeps its version.
        """
        self.version, self.state_ref = version, self._ray.put(trainable_state(model))

    # ---- the queue ----------------------------------------------------------------------
    def next_batch(
        self, it: int, show: Callable[[str], None] = lambda text: None
    ) -> tuple[list, dict[str, Any], dict[str, Any]]:
        """The trajectories iteration ``it`` trains on (trainer version ``it``).

        Returns:
            (trajectories, the worker's collect stats, scheduler metrics: ``batch``,
            ``sampled_version``, lag metrics, ``dropped_batches``, ``rerun_batches``,
            ``queue_wait_s``, ``worker_rollout_s``, ``rollout_worker``).

        Raises:
            RolloutError: no batch finished within ``rollout_timeout`` (names the batches in
                flight, their workers and how long each has run), or a batch killed its
                worker ``MAX_ATTEMPTS`` times.
        """
        if self.version != it:
            raise RuntimeError(
                f"iteration {it} asked for a batch, but the newest published version is "
                f"{self.version}: publish the weights after every update"
            )
        t0, dropped, dropped_lags, reruns0 = time.perf_counter(), [], [], self.reruns
        while True:
            self._dispatch()
            while self.finished:
                result, job = self.finished.pop(0)
                n = len({t.group_id for t in result["trajectories"]})
                if lag(it, job.version) > self.k:
                    dropped.append(job.batch)
                    dropped_lags += [lag(it, job.version)] * n
                    continue
                self._dispatch(consuming=1)  # before the update: idle workers start the next batches now
                metrics = {
                    "batch": job.batch,
                    "sampled_version": job.version,
                    "dropped_batches": dropped,
                    **lag_metrics([lag(it, job.version)] * n, dropped_lags),
                    "rerun_batches": self.reruns - reruns0,
                    "queue_wait_s": time.perf_counter() - t0,
                    "worker_rollout_s": result["rollout_s"],
                    "rollout_worker": job.worker,
                }
                return result["trajectories"], result["stats"], metrics
            show(self._waiting_text(it))
            self._wait_one(t0)

    def _dispatch(self, consuming: int = 0) -> None:
        """Start batches on idle workers while the admission rule allows; ``consuming = 1``
        while the batch just taken is still to be trained on (its update comes first)."""
        for slot in range(len(self.workers)):
            ahead = len(self.jobs) + len(self.finished) + consuming
            if slot in self.jobs or not may_start(ahead, self.k):
                continue
            batch = self.todo.popleft() if self.todo else self._new_batch()
            ref = self.workers[slot].run.remote(batch, self.version, [self.state_ref])
            self.jobs[slot] = _Job(batch, slot, self.version, ref, time.perf_counter(), self.attempts.get(batch, 0) + 1)

    def _new_batch(self) -> int:
        self.next_new += 1
        return self.next_new - 1

    def _wait_one(self, t0: float) -> None:
        """Wait (bounded) until a job finishes; a job whose worker died is re-queued."""
        by_ref = {job.ref: slot for slot, job in self.jobs.items()}
        left = self.cfg.rollout_timeout - (time.perf_counter() - t0)
        ready, _ = self._ray.wait(list(by_ref), num_returns=1, timeout=max(0.0, left))
        if not ready:
            now = time.perf_counter()
            running = ", ".join(
                f"batch {j.batch} on worker {s} (version {j.version}, {now - j.started:.0f} s)"
                for s, j in sorted(self.jobs.items())
            )
            raise RolloutError(
                f"waited {self.cfg.rollout_timeout:g} s (--rollout-timeout) for a rollout batch; in "
                f"flight: {running or 'nothing'}. A worker may be stuck in an episode: raise "
                "--rollout-timeout if batches are this slow, else look at the workers' logs "
                "(/tmp/ray/session_latest/logs)"
            )
        slot = by_ref[ready[0]]
        job = self.jobs.pop(slot)
        try:
            result = self._ray.get(ready[0])
        except self._ray.exceptions.RayActorError as e:
            self._replace(slot, job, e)
            return
        except self._ray.exceptions.RayTaskError as e:  # the batch's own error (a bad environment ...): as is
            raise e.as_instanceof_cause() from None
        self.finished.append((result, job))

    def _replace(self, slot: int, job: _Job, error: Exception) -> None:
        """A worker died under ``job``: start a new worker in its slot and run the batch again."""
        self.attempts[job.batch] = job.attempt
        if job.attempt >= MAX_ATTEMPTS:
            raise RolloutError(
                f"batch {job.batch} was started {job.attempt} times and each time its rollout worker "
                f"died (last: {str(error).splitlines()[0]}); an episode of it may crash the "
                "worker process (memory, a native crash): see /tmp/ray/session_latest/logs"
            )
        self.reruns += 1
        self.todo.appendleft(job.batch)
        self.log(
            f"rollout worker {slot} died during batch {job.batch} ({str(error).splitlines()[0][:120]}); "
            "starting a new one and re-running the batch"
        )
        self.workers[slot] = self._start_worker(slot)
        self.where.update(self._wait_ready([slot]))

    def _get(self, ref, what: str):
        try:
            return self._ray.get(ref, timeout=self.cfg.rollout_timeout)
        except self._ray.exceptions.GetTimeoutError as e:
            raise RolloutError(f"waited {self.cfg.rollout_timeout:g} s (--rollout-timeout) for the {what}") from e
        except self._ray.exceptions.RayTaskError as e:
            raise e.as_instanceof_cause() from None

    def _waiting_text(self, it: int) -> str:
        running = ", ".join(f"{j.batch}@v{j.version}" for _, j in sorted(self.jobs.items()))
        return f"iteration {it}: waiting for rollout workers (batches in flight: {running or 'none'})"

"""Concurrent requests sampled together: one ``generate`` call per batch (the policy's sampler).

Requests queue up while a batch is sampled; the next batch takes every queued request
with the same sampling settings (up to ``max_batch``), after waiting ``wait_s`` for more
to arrive, and again while more keep arriving (``keep_waiting``). Each session's K/V is kept from one call to the next
(``policy.prefix_cache``; the most recent ``4 × max_batch``, at least 256), so a turn
prefills only its new tokens. A request with a
``seed`` is sampled alone, with its own ``torch.Generator``, so the same request gives
the same sample; the others share the batcher's generator.

Sampling runs in one worker thread, so the event loop keeps serving while the model
works. A request whose client went away before its batch started is dropped from it; one
that leaves during sampling finishes with the batch, so no batch waits on a client: its
result is discarded when the request is cancelled, or kept when the caller waits for it
(:meth:`Batcher.submit`, :attr:`Job.started`: the session recorder keeps every sampled
reply, docs/agents.md §5).

A request may ask for the top alternatives of each token (``SamplingParams.top_logprobs``,
which changes nothing sampled: such requests share batches with the others) and for each
token as it is sampled (``on_token``, called in the sampling thread: token-by-token
streaming), and for a grammar its sample must follow (``grammar``: ``tool_choice`` required,
``response_format`` JSON; ``serve.structured``): each such request gets its own grammar
state and shares batches with the others (the sampler masks row by row).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import itertools
import time
from collections import deque
from collections.abc import Callable, Collection, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from consequence.policy.constrained import Grammar
from consequence.policy.prefix_cache import PrefixCache, generate_with_prefix
from consequence.policy.sampler import Sample, SamplingParams

MIN_CACHED_SESSIONS = 256


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    key: Hashable | None  # the session whose K/V may be reused, or None
    seed: int | None
    future: asyncio.Future  # made by the batcher's loop when the request is queued
    started: bool = False  # taken into a batch: its sample will exist whatever the client does
    on_token: Callable[[int, float], None] | None = None  # (token id, log-prob) as sampled, sampling thread
    grammar: Grammar | None = None  # the grammar its sample follows (constrained decoding), or None


@dataclass
class Job:
    """The queued requests of one call (:meth:`Batcher.submit`)."""

    requests: list[_Request]

    @property
    def started(self) -> bool:
        """Some of its requests are being (or were) sampled."""
        return any(r.started for r in self.requests)

    async def result(self) -> list[Sample]:
        """One sample per prompt, in order.

        Raises:
            RuntimeError: the batcher stopped (the server is shutting down) or the batch failed.
            asyncio.CancelledError: cancelled; its requests are then dropped (not yet in a
                batch) or their samples discarded.
        """
        try:
            return list(await asyncio.gather(*(r.future for r in self.requests)))
        except asyncio.CancelledError:
            self.cancel()
            raise

    def cancel(self) -> None:
        """Drop its requests that wait for a batch; discard the samples of those in one."""
        for r in self.requests:
            r.future.cancel()


@dataclass
class BatchStats:
    """Counters for benchmarks, ``GET /health`` and ``GET /metrics``: batches run, requests
    sampled, the largest batch, requests dropped because their client left before sampling,
    tokens sampled, batches by size, and the recent batches' (end time in
    ``time.monotonic`` seconds, tokens) for a tokens/s rate."""

    batches: int = 0
    requests: int = 0
    largest: int = 0
    dropped: int = 0
    tokens: int = 0
    sizes: dict[int, int] = field(default_factory=dict)
    recent: deque = field(default_factory=lambda: deque(maxlen=4096))

    def add(self, size: int, tokens: int) -> None:
        """Count one finished batch of ``size`` requests that sampled ``tokens`` tokens."""
        self.batches += 1
        self.requests += size
        self.largest = max(self.largest, size)
        self.tokens += tokens
        self.sizes[size] = self.sizes.get(size, 0) + 1
        self.recent.append((time.monotonic(), tokens))

    def tokens_per_s(self, window_s: float = 60.0) -> float:
        """Tokens sampled per second over the last ``window_s`` seconds."""
        since = time.monotonic() - window_s
        return sum(n for t, n in self.recent if t >= since) / window_s


# The most wait_s periods a batch waits for a burst to finish arriving (10 x 5 ms = 50 ms).
MAX_WAIT_ROUNDS = 10


class Batcher:
    """Collects sampling requests and runs them in batches (see the module doc).

    Args:
        model: the policy (sampled in eval mode, without gradients).
        stop_ids: ids that end a completion (the renderer's end-of-turn and EOS).
        seed: seed of the shared generator.
        max_batch: the most requests in one ``generate`` call.
        wait_s: how long a batch waits for more requests after its first, and again
            after each wait in which more arrived (``keep_waiting``).
    """

    def __init__(self, model, stop_ids: Collection[int], seed: int = 0, max_batch: int = 64, wait_s: float = 0.005):
        self.model, self.stop_ids = model, set(stop_ids)
        self.max_batch, self.wait_s = max_batch, wait_s
        self.max_cached = max(MIN_CACHED_SESSIONS, 4 * max_batch)  # sessions whose K/V is kept
        self.generator = torch.Generator().manual_seed(seed)
        self.cache = PrefixCache()
        self.stats = BatchStats()
        self.in_flight = 0  # requests being sampled now
        self._queue: asyncio.Queue[_Request] | None = None
        self._task: asyncio.Task | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sampler")
        self._anon = itertools.count()

    def start(self) -> None:
        """Start the batching loop on the running event loop."""
        self._queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        """Stop the loop; queued requests fail with ``RuntimeError`` (the server is shutting down)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):  # the cancellation just asked for
                await self._task
        while self._queue is not None and not self._queue.empty():
            r = self._queue.get_nowait()
            if not r.future.done():
                r.future.set_exception(RuntimeError("the server is shutting down"))
        self._pool.shutdown(wait=True)

    @property
    def queued(self) -> int:
        """Requests waiting for a batch."""
        return 0 if self._queue is None else self._queue.qsize()

    async def sample(
        self, prompts: list[list[int]], params: SamplingParams, key: Hashable | None = None, seed: int | None = None
    ) -> list[Sample]:
        """Sample one completion per prompt (the ``n`` choices of a request share ``key``).

        Raises:
            RuntimeError: the batcher is stopped.
            asyncio.CancelledError: the caller was cancelled (the request is dropped or discarded).
        """
        return await self.submit(prompts, params, key, seed).result()

    def submit(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        key: Hashable | None = None,
        seed: int | None = None,
        on_token: Callable[[int, int, float], None] | None = None,
        grammar: Grammar | None = None,
    ) -> Job:
        """Queue one request per prompt (as :meth:`sample`) and return them as a :class:`Job`,
        whose :attr:`Job.started` tells whether sampling began.

        Args:
            on_token: ``on_token(k, token_id, logprob)`` for each token of prompt ``k`` as it
                is sampled, called in the sampling thread (hand it to the event loop with
                ``loop.call_soon_threadsafe``).
            grammar: every prompt's sample follows it (each with its own grammar state).

        Raises:
            RuntimeError: the batcher is stopped.
        """
        if self._queue is None or self._task is None or self._task.done():
            raise RuntimeError("the server is shutting down")
        loop = asyncio.get_running_loop()
        reqs = [
            _Request(
                p,
                params,
                key if k == 0 else None,
                choice_seed(seed, k),
                loop.create_future(),
                on_token=None if on_token is None else functools.partial(on_token, k),
                grammar=grammar,
            )
            for k, p in enumerate(prompts)
        ]
        for r in reqs:
            self._queue.put_nowait(r)
        return Job(reqs)

    def forget(self, keys: Collection[Hashable]) -> None:
        """Drop the stored K/V of ended sessions."""
        for k in keys:
            self.cache.entries.pop(k, None)

    async def _loop(self) -> None:
        assert self._queue is not None
        pending: list[_Request] = []
        while True:
            if not pending:
                pending.append(await self._queue.get())
                await self._gather(len(pending))
            while not self._queue.empty():
                pending.append(self._queue.get_nowait())
            live = [r for r in pending if not r.future.done()]
            self.stats.dropped += len(pending) - len(live)
            batch, pending = _take_batch(live, self.max_batch)
            for r in batch:  # set on the event loop, before it yields: a caller sees it or can still drop r
                r.started = True
            if batch:
                await self._run(batch)

    async def _gather(self, pending: int) -> None:
        """Wait ``wait_s`` for more requests, again while more keep arriving (a burst of
        concurrent clients lands over tens of ms), at most ``MAX_WAIT_ROUNDS`` times."""
        for rounds in range(1, MAX_WAIT_ROUNDS + 1):
            before = self.queued
            await asyncio.sleep(self.wait_s)
            if not keep_waiting(self.queued - before, pending + self.queued, self.max_batch, rounds):
                return

    async def _run(self, batch: list[_Request]) -> None:
        self.in_flight = len(batch)
        try:
            samples = await asyncio.get_running_loop().run_in_executor(self._pool, self._generate, batch)
        except Exception as e:  # noqa: BLE001  (a failed batch fails its requests, never the loop)
            for r in batch:
                if not r.future.done():
                    r.future.set_exception(e)
            return
        finally:
            self.in_flight = 0
        self.stats.add(len(batch), sum(len(s.output_ids) for s in samples))
        for r, s in zip(batch, samples):
            if not r.future.done():  # a client that left: its sample is discarded
                r.future.set_result(s)

    def _generate(self, batch: list[_Request]) -> list[Sample]:
        # the batch's settings, with as many alternatives per token as any of its requests asks for
        params = dataclasses.replace(batch[0].params, top_logprobs=max(r.params.top_logprobs for r in batch))
        gen = self.generator if batch[0].seed is None else torch.Generator().manual_seed(batch[0].seed)
        anon = [("anonymous", next(self._anon)) for _ in batch]
        keys = [r.key if r.key is not None else a for r, a in zip(batch, anon)]
        streams = [r.on_token for r in batch]
        on_token = None if not any(streams) else functools.partial(_route_token, streams)
        grammars = [r.grammar.start() if r.grammar is not None else None for r in batch]  # one state per row
        out = generate_with_prefix(
            self.model,
            [r.prompt for r in batch],
            keys,
            params,
            self.stop_ids,
            self.cache,
            gen,
            on_token,
            grammars if any(g is not None for g in grammars) else None,
        )
        out = [_own_top(s, r.params.top_logprobs) for s, r in zip(out, batch)]
        self.forget(anon)  # rows without a session never call again
        # Bound the stored K/V: the oldest sessions' go first (a dropped entry costs a full
        # prefill of that session's next call, never a different sample).
        for k in list(self.cache.entries)[: max(0, len(self.cache.entries) - self.max_cached)]:
            del self.cache.entries[k]
        return out


def keep_waiting(arrived: int, waiting: int, max_batch: int, rounds: int) -> bool:
    """Whether a batch about to start waits one more ``wait_s``: requests arrived during the
    last wait (``arrived`` > 0), the batch is not full (``waiting`` < ``max_batch``), and
    fewer than ``MAX_WAIT_ROUNDS`` waits were spent. A lone request waits once.

    Measured (benchmarks/bench_serve_vllm.py, SmolLM2, 32 concurrent clients): a single
    5 ms wait started a batch of 4 and left 28 queued behind it for the whole batch.
    """
    return arrived > 0 and waiting < max_batch and rounds < MAX_WAIT_ROUNDS


def _route_token(streams: list, i: int, token: int, logprob: float) -> None:
    """Hand a token of batch row ``i`` to its request's ``on_token`` (when it streams)."""
    if streams[i] is not None:
        streams[i](token, logprob)


def _own_top(sample: Sample, n: int) -> Sample:
    """``sample`` with the alternatives its own request asked for (the batch sampled the most any asked)."""
    if sample.top_logprobs is None:
        return sample
    return dataclasses.replace(sample, top_logprobs=[t[:n] for t in sample.top_logprobs] if n else None)


def choice_seed(seed: int | None, k: int) -> int | None:
    """The seed of choice ``k`` of a seeded request: ``seed`` itself for the first (so ``n`` = 1
    keeps its sample), a seed derived from (``seed``, ``k``) for the others, so the ``n``
    choices differ from each other and the same request gives the same ``n`` samples."""
    if seed is None or k == 0:
        return seed
    digest = hashlib.sha256(f"{seed}/{k}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # within torch.Generator.manual_seed's range


def _take_batch(pending: list[_Request], max_batch: int) -> tuple[list[_Request], list[_Request]]:
    """The next batch: the first request and those queued after it with the same settings
    and without a seed (a seeded request runs alone), one per session key; the rest stay."""
    if not pending:
        return [], []
    first = pending[0]
    if first.seed is not None:
        return [first], pending[1:]
    batch, rest, keys = [first], [], {first.key}
    settings = dataclasses.replace(first.params, top_logprobs=0)  # alternatives change nothing sampled
    for r in pending[1:]:
        same = dataclasses.replace(r.params, top_logprobs=0) == settings and r.seed is None
        if same and len(batch) < max_batch and (r.key is None or r.key not in keys):
            batch.append(r)
            keys.add(r.key)
        else:
            rest.append(r)
    return batch, rest

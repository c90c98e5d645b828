"""Prefix reuse across the turns of multi-turn episodes (the rollout hot path, policy box).

Turn t+1 of an episode prompts the model with turn t's context, the tokens it sampled and
the observation the chat template appends, so almost all of the new prompt was already
run through the model. :class:`PrefixCache` keeps each episode's K/V from its last call;
:func:`generate_with_prefix` prefills only the tokens after the stored prefix and then
decodes with ``sampler.generate``'s own loop (``sampler.decode``: same processed
distribution, generator use, stop handling and ``Sample`` record). Prefill work per episode falls
from Σ_t |context_t| to about |context_final| (measured in
benchmarks/bench_generation.py).

Exactness: the reused K/V of a sampled token was computed in a decode step rather than in
a prefill of the whole context, so log-probs agree with a full prefill only to float32
rounding (~1e-6 here), not bit for bit; the trainer recomputes π_old anyway and the
pre-step checks compare it with the stored sampler log-probs. A prompt that does not
extend its episode's stored prefix (the context builder rewrote history) is prefilled
from scratch. The cache holds K/V of one set of weights: make a new one whenever the
weights change (``rollout.sampling.policy_generate_fn`` makes one per rollout round).
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from consequence.policy.device import precision
from consequence.policy.sampler import (
    PREFILL_CHUNK_TOKENS,
    Constraints,
    Generators,
    OnToken,
    Sample,
    SamplingParams,
    _FastLlama,
    check_constraints,
    decode,
    generate,
)
from consequence.policy.shared_prefix import SHARED_PREFIX_MIN_TOKENS


@dataclass
class _Entry:
    ids: list[int]  # tokens whose K/V is stored (the prompt + all sampled tokens but the last)
    k: list[torch.Tensor]  # per layer [n_kv, P, D]
    v: list[torch.Tensor]


@dataclass
class PrefixCache:
    """Per-episode K/V of the tokens already run through the model (one set of weights).

    Attributes:
        entries: episode key → stored prefix.
        reused_tokens, prefilled_tokens: counters over all calls (prompt tokens taken
            from the cache / run through the model), for benchmarks and metrics.
    """

    entries: dict[Hashable, _Entry] = field(default_factory=dict)
    reused_tokens: int = 0
    prefilled_tokens: int = 0

    def keep_only(self, keys: Collection[Hashable]) -> None:
        """Forget every episode not in ``keys`` (ended episodes never call again)."""
        for k in [k for k in self.entries if k not in keys]:
            del self.entries[k]

    def prefix_len(self, key: Hashable, prompt: Sequence[int]) -> int:
        """Length of the stored prefix of ``key`` when it is a strict prefix of ``prompt``, else 0."""
        e = self.entries.get(key)
        if e is None or len(e.ids) >= len(prompt) or list(prompt[: len(e.ids)]) != e.ids:
            return 0
        return len(e.ids)


def generate_with_prefix(
    model,
    prompts: list[list[int]],
    keys: Sequence[Hashable],
    params: SamplingParams,
    stop_ids: Collection[int],
    cache: PrefixCache,
    generator: Generators = None,
    on_token: OnToken | None = None,
    constraints: Constraints = None,
) -> list[Sample]:
    """``sampler.generate`` for episodes whose prompts extend their previous call's.

    Args:
        prompts: token ids per row (each non-empty).
        keys: one hashable episode key per row (distinct within a call).
        cache: updated in place with every row's new prefix.
        generator: one for the batch or one per row (``sampler.Generators``).
        on_token: called for each token as it is sampled (``sampler.generate``).
        constraints: one grammar state per prompt, or ``None`` (``sampler.generate``).

    Returns:
        one ``Sample`` per prompt, in order. Models without the fast Llama path fall back
        to ``sampler.generate`` (no reuse).

    Raises:
        ValueError: an empty prompt, or ``keys`` not one per prompt.
    """
    if len(keys) != len(prompts):
        raise ValueError(f"generate_with_prefix: {len(keys)} keys for {len(prompts)} prompts")
    check_constraints(constraints, len(prompts))
    if not prompts or params.max_new_tokens <= 0 or not _FastLlama.supports(model):
        return generate(model, prompts, params, stop_ids, generator, on_token, constraints)
    if any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), precision(params.dtype, next(model.parameters()).device):
            return _run(
                _FastLlama(model), prompts, list(keys), params, set(stop_ids), cache, generator, on_token, constraints
            )
    finally:
        if was_training:
            model.train()


def _run(
    fast: _FastLlama, prompts, keys, params, stop_ids, cache: PrefixCache, generator, on_token=None, constraints=None
) -> list[Sample]:
    n = len(prompts)
    pre = [cache.prefix_len(k, p) for k, p in zip(keys, prompts)]
    stored: list[_Entry | None] = [cache.entries[k] if p else None for k, p in zip(keys, pre)]
    shared = _shared_prefix(fast, [p for p, q in zip(prompts, pre) if q == 0])
    if shared is not None:  # first turns that open alike (system prompt, worked examples): prefilled once
        for i, p in enumerate(pre):
            if p == 0 and tuple(prompts[i][: len(shared.ids)]) == tuple(shared.ids):
                pre[i], stored[i] = len(shared.ids), shared
        cache.prefilled_tokens += len(shared.ids)  # run once; each row's copy counts as reused below
    # Rows without a stored prefix and with the same prompt (a group's first turn) are
    # prefilled once and their cache rows copied, as in ``sampler.generate``.
    uniq: dict[object, int] = {}
    src = [
        uniq.setdefault(tuple(p) if stored[i] is None or stored[i] is shared else ("row", i), len(uniq))
        for i, p in enumerate(prompts)
    ]
    first = {u: i for i, u in reversed(list(enumerate(src)))}  # unique row -> its first original row
    rows_u = [first[u] for u in range(len(uniq))]
    lens = [len(prompts[i]) for i in rows_u]
    L, U = max(lens), len(rows_u)
    S = max(len(prompts[i]) - pre[i] for i in rows_u)  # prefill window: the last S slots of every row
    fast.alloc(U, L + params.max_new_tokens)
    ids = torch.zeros(U, L, dtype=torch.long)
    key_valid = torch.zeros(U, L + params.max_new_tokens, dtype=torch.bool)
    for u, i in enumerate(rows_u):
        ids[u, L - lens[u] :] = torch.tensor(prompts[i], dtype=torch.long)
        key_valid[u, L - lens[u] : L] = True
    pos = (key_valid[:, :L].long().cumsum(-1) - 1).clamp_min(0)
    ids, key_valid, pos = ids.to(fast.device), key_valid.to(fast.device), pos.to(fast.device)  # built on the CPU
    _restore(fast, [stored[i] for i in rows_u], [pre[i] for i in rows_u], lens, L)
    cache.reused_tokens += sum(max(0, ln - S) for ln in lens)  # slots before the window
    cache.prefilled_tokens += sum(min(ln, S) for ln in lens)
    step_rows = max(1, PREFILL_CHUNK_TOKENS // S)
    logits = torch.cat(
        [
            fast.forward(ids[r, L - S :], pos[r, L - S :], L - S, key_valid[r], rows=r)
            for r in (slice(a, min(U, a + step_rows)) for a in range(0, U, step_rows))
        ],
        0,
    )
    next_pos = pos[:, -1] + 1
    if U != n:
        rows = torch.tensor(src, dtype=torch.long, device=fast.device)
        fast.select_rows(rows)
        logits, key_valid, next_pos = (
            logits.index_select(0, rows),
            key_valid.index_select(0, rows),
            next_pos.index_select(0, rows),
        )

    def keep(b: int, i: int, out: list[int]) -> None:  # a row leaves the batch: store its prefix
        _store(fast, cache, keys[i], b, prompts[i], out, L)

    return decode(
        fast,
        logits,
        key_valid,
        next_pos,
        L,
        n,
        params,
        stop_ids,
        generator,
        on_leave=keep,
        on_token=on_token,
        constraints=constraints,
    )


def _restore(fast: _FastLlama, stored: list[_Entry | None], pre, lens, L: int) -> None:
    """Copy each row's stored prefix K/V into its slots (left padding: a row ends at slot L)."""
    for i, (e, p) in enumerate(zip(stored, pre)):
        if p == 0 or e is None:  # no prefix to restore (a stored entry comes with p > 0)
            continue
        s0 = L - lens[i]
        for li in range(len(fast.layers)):
            fast.k_cache[li][i, :, s0 : s0 + p] = e.k[li][:, :p]
            fast.v_cache[li][i, :, s0 : s0 + p] = e.v[li][:, :p]


# A prefix shared by the first turns of a call is prefilled once when it is at least
# SHARED_PREFIX_MIN_TOKENS long and at least two distinct prompts start with it (few-shot
# prompts: SmolLM2 with two worked examples shares ~190 of ~230 prompt tokens, and an
# evaluation batch of 192 distinct questions prefills 44 k tokens without sharing, 8 k with it).


def _shared_prefix(fast: _FastLlama, prompts: list[list[int]]) -> _Entry | None:
    """K/V of the longest prefix all ``prompts`` share (one row, positions 0..P-1), or None when
    fewer than two distinct prompts share at least SHARED_PREFIX_MIN_TOKENS tokens. The
    prefix stops one token short of the shortest prompt, so every row still prefills a token
    (its next-token logits come from that pass)."""
    distinct = list({tuple(p): None for p in prompts})
    if len(distinct) < 2:
        return None
    P = min(len(p) for p in distinct) - 1
    first = distinct[0]
    for p in distinct[1:]:
        P = next((j for j in range(P) if p[j] != first[j]), P)
    if P < SHARED_PREFIX_MIN_TOKENS:
        return None
    ids = torch.tensor([first[:P]], dtype=torch.long, device=fast.device)
    pos = torch.arange(P, device=fast.device)[None]
    fast.alloc(1, P)
    for a in range(0, P, PREFILL_CHUNK_TOKENS):  # chunks of the one row: same slots, causal over the cache
        b = min(P, a + PREFILL_CHUNK_TOKENS)
        fast.forward(ids[:, a:b], pos[:, a:b], a, torch.ones(1, b, dtype=torch.bool, device=fast.device))
    return _Entry(list(first[:P]), [c[0].clone() for c in fast.k_cache], [c[0].clone() for c in fast.v_cache])


def _store(fast: _FastLlama, cache: PrefixCache, key, b: int, prompt: list[int], out: list[int], L: int) -> None:
    """Keep the K/V of batch row ``b``: the prompt and every sampled token that was fed back."""
    fed = out[:-1]  # the last sampled token was never run through the model
    s0, end = L - len(prompt), L + len(fed)
    cache.entries[key] = _Entry(
        prompt + fed, [c[b, :, s0:end].clone() for c in fast.k_cache], [c[b, :, s0:end].clone() for c in fast.v_cache]
    )

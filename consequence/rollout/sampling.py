"""Adapter from the policy's batched sampler to the rollout's ``generate_fn``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from consequence.policy.prefix_cache import PrefixCache, generate_with_prefix
from consequence.policy.sampler import SamplingParams

# The K/V of the episodes in flight at once stays under this (float32: SmolLM2-135M holds 46 KB
# per token, so 91 episodes of 1,024 tokens; 480 at once took 16.7 GB of a 24 GB machine).
ROLLOUT_KV_BUDGET_BYTES = 4 << 30


def kv_bytes_per_token(model) -> int | None:
    """Bytes of K/V one token of context holds in the sampler's cache (keys and values of
    every layer, in the parameters' dtype); None when the model's config does not say."""
    c = getattr(model, "config", None)
    layers = getattr(c, "num_hidden_layers", None)
    heads = getattr(c, "num_attention_heads", None)
    if not layers or not heads:
        return None
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or getattr(c, "hidden_size", 0) // heads
    if not head_dim:
        return None
    itemsize = next(model.parameters()).element_size()
    return 2 * layers * kv_heads * head_dim * itemsize


def episodes_in_flight(model, max_total_tokens: int, budget_bytes: int = ROLLOUT_KV_BUDGET_BYTES) -> int | None:
    """How many episodes of at most ``max_total_tokens`` tokens fit ``budget_bytes`` of K/V
    (``run_episodes``'s ``max_live``); None (no bound) when the model's K/V size is unknown."""
    per_token = kv_bytes_per_token(model)
    if per_token is None:
        return None
    return max(1, budget_bytes // (per_token * max(1, max_total_tokens)))


def policy_generate_fn(model, params: SamplingParams, stop_ids, seed: int, episode_seeds: Sequence[int] | None = None):
    """A ``generate_fn(prompts, max_new_tokens, episode_indices)`` sampling from ``model``.

    Random streams: by default one torch.Generator seeded with ``seed`` drives every call,
    so a batch of episodes is reproducible on CPU, but a single token that lands otherwise
    (a float32 difference) shifts every later draw of every episode. With
    ``episode_seeds`` (one per episode index) each episode samples from its own generator
    seeded with its entry, so its tokens depend only on its own prompts and stream, not on
    the rest of the batch (the evaluation's rule, ``sampler.draw``).

    Each episode's K/V is kept from one call to the next (``policy.prefix_cache``), so a turn
    prefills only its new tokens; the cache lives as long as this function, which must not
    outlive the weights it sampled with (one per rollout round), and forgets episodes that
    stopped calling.
    """
    gen = torch.Generator().manual_seed(seed)
    streams = None if episode_seeds is None else [torch.Generator().manual_seed(s) for s in episode_seeds]
    cache = PrefixCache()

    def fn(prompts: list[list[int]], max_new_tokens: int, episode_indices: list[int]):
        p = dataclasses.replace(params, max_new_tokens=max_new_tokens)
        cache.keep_only(set(episode_indices))
        rows = gen if streams is None else [streams[i] for i in episode_indices]
        return generate_with_prefix(model, prompts, episode_indices, p, stop_ids, cache, generator=rows)

    fn.prefix_cache = cache  # type: ignore[attr-defined]  # for metrics and benchmarks

    return fn

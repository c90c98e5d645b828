"""Adapter from the policy's batched sampler to the rollout's ``generate_fn``."""

from __future__ import annotations

import dataclasses

import torch

from consequence.policy.sampler import SamplingParams, generate


def policy_generate_fn(model, params: SamplingParams, stop_ids, seed: int):
    """A ``generate_fn(prompts, max_new_tokens, episode_indices)`` sampling from ``model``.

    One torch.Generator seeded with ``seed`` drives every call, so a batch of episodes is
    reproducible on CPU.
    """
    gen = torch.Generator().manual_seed(seed)

    def fn(prompts: list[list[int]], max_new_tokens: int, episode_indices: list[int]):
        p = dataclasses.replace(params, max_new_tokens=max_new_tokens)
        return generate(model, prompts, p, stop_ids, generator=gen)

    return fn

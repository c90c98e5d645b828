"""The sampler's top alternatives (``SamplingParams.top_logprobs``) and per-token callback
(``on_token``): they report the processed distribution each token was drawn from, and change
nothing that is sampled (consequence.policy.sampler; the endpoint's ``top_logprobs`` and
token-by-token streaming, docs/agents.md §5)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from consequence.policy.logprobs import process_logits
from consequence.policy.prefix_cache import PrefixCache, generate_with_prefix
from consequence.policy.sampler import SamplingParams, generate
from consequence.policy.tiny import load_policy

BUNDLED = "consequence/assets/tiny-repair"


@pytest.fixture(scope="module")
def policy():
    return load_policy(BUNDLED)


def _prompts(tok):
    return [tok.encode(t, add_special_tokens=False) for t in ("def add(a, b):", "fix the bug in add", "x x x x")]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, max_new_tokens=8),
        SamplingParams(temperature=1.0, top_k=4, top_p=0.9, max_new_tokens=8),
        SamplingParams(temperature=0.0, max_new_tokens=8),
    ],
)
def test_alternatives_are_the_processed_distribution_and_change_nothing_sampled(policy, params):
    model, tok = policy
    prompts = _prompts(tok)
    plain = generate(model, prompts, params, {0}, torch.Generator().manual_seed(7))
    asked = generate(model, prompts, dataclasses.replace(params, top_logprobs=5), {0}, torch.Generator().manual_seed(7))
    for a, b, prompt in zip(plain, asked, prompts):
        assert (a.output_ids, a.logprobs, a.keep_ids, a.top_logprobs) == (b.output_ids, b.logprobs, b.keep_ids, None)
        assert len(b.top_logprobs) == len(b.output_ids)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + b.output_ids])).logits[0, len(prompt) - 1 : -1].float()
        # greedy reports the unprocessed T = 1 distribution (logprobs module doc)
        t = params.temperature or 1.0
        k, p = (params.top_k, params.top_p) if params.temperature else (0, 1.0)
        logp = torch.log_softmax(process_logits(logits, t, k, p), -1)
        for j, top in enumerate(b.top_logprobs):
            finite = int(torch.isfinite(logp[j]).sum())
            assert len(top) == min(5, finite)  # no token outside the support
            want = logp[j].topk(len(top)).values.tolist()
            # a full forward against the cached decode, float32: 1e-4 (as the endpoint's identity tests)
            assert max(abs(lp - w) for (_i, lp), w in zip(top, want)) < 1e-4
            assert [lp for _i, lp in top] == sorted((lp for _i, lp in top), reverse=True)
            if params.temperature == 0:
                assert top[0][0] == b.output_ids[j]  # greedy takes the most probable


def test_on_token_sees_every_kept_token_in_order(policy):
    model, tok = policy
    prompts = _prompts(tok)
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    seen: dict[int, list[tuple[int, float]]] = {0: [], 1: [], 2: []}
    out = generate_with_prefix(
        model,
        prompts,
        ["a", "b", "c"],
        params,
        {0},
        PrefixCache(),
        torch.Generator().manual_seed(3),
        lambda i, t, lp: seen[i].append((t, lp)),
    )
    ref = generate_with_prefix(
        model, prompts, ["a", "b", "c"], params, {0}, PrefixCache(), torch.Generator().manual_seed(3)
    )
    for i, (s, r) in enumerate(zip(out, ref)):
        assert s.output_ids == r.output_ids  # the callback changes nothing
        assert seen[i] == list(zip(s.output_ids, s.logprobs))

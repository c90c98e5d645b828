"""Prefix reuse across turns gives the episodes a full prefill gives (policy.prefix_cache)."""

import pytest
import torch

from consequence.envs.registry import load_environment
from consequence.envs.repair.env import SYSTEM_PROMPT, TOOLS, RepairEnv
from consequence.harness.renderer import Renderer
from consequence.policy.prefix_cache import PrefixCache, generate_with_prefix
from consequence.policy.sampler import SamplingParams, generate
from consequence.policy.tiny import load_policy
from consequence.rollout.episodes import Budgets, EpisodeSpec, run_episodes
from consequence.seeding import seed_of

BUNDLED = "consequence/assets/tiny-repair"


@pytest.fixture(scope="module")
def policy():
    model, tok = load_policy(BUNDLED)
    return model, Renderer(tok, TOOLS)


def _episodes(model, renderer, params, cached: bool, n_tasks=6, group=1):
    tasks = load_environment("repair", 0).sample("validation", n_tasks, seed=3)
    gen, cache = torch.Generator().manual_seed(0), PrefixCache()

    def fn(prompts, max_new_tokens, idx):
        if cached:
            return generate_with_prefix(model, prompts, idx, params, renderer.stop_ids, cache, gen)
        return generate(model, prompts, params, renderer.stop_ids, gen)

    specs = [
        EpisodeSpec(RepairEnv(t), t.task_id, t.task_id, g, seed_of(0, i, g))
        for i, t in enumerate(tasks)
        for g in range(group)
    ]
    return run_episodes(fn, renderer, specs, Budgets(4, 24, 768), SYSTEM_PROMPT), cache


@pytest.mark.parametrize(
    "params,group",
    [
        (SamplingParams(temperature=0.0, max_new_tokens=24), 1),
        (SamplingParams(temperature=1.0, max_new_tokens=24), 3),
        (SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=24), 2),
    ],
)
@pytest.mark.slow
def test_multi_turn_episodes_equal_full_prefill(policy, params, group):
    model, renderer = policy
    full, _ = _episodes(model, renderer, params, cached=False, group=group)
    reused, cache = _episodes(model, renderer, params, cached=True, group=group)
    assert sum(len(t.calls) for t in full) > len(full)  # multi-turn: later calls had a prefix to reuse
    assert cache.reused_tokens > 0  # later calls took their prefix from the cache
    for a, b in zip(full, reused):
        assert [c.output_ids for c in a.calls] == [c.output_ids for c in b.calls]
        assert [c.context_ids for c in a.calls] == [c.context_ids for c in b.calls]
        for ca, cb in zip(a.calls, b.calls):
            assert ca.sample_logprobs == pytest.approx(cb.sample_logprobs, abs=1e-4)
            assert getattr(ca, "keep_ids", None) == getattr(cb, "keep_ids", None)


def test_a_prompt_that_does_not_extend_the_prefix_is_prefilled_from_scratch(policy):
    model, renderer = policy
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    cache = PrefixCache()
    p = renderer.prompt_ids([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "fix add"}])
    first = generate_with_prefix(model, [p], [7], params, renderer.stop_ids, cache)[0]
    assert cache.prefix_len(7, p + first.output_ids + [5]) == len(p) + len(first.output_ids) - 1
    edited = list(p)
    edited[len(p) // 2] = (edited[len(p) // 2] + 1) % 700  # history rewritten in the middle
    assert cache.prefix_len(7, edited + [5]) == 0
    want = generate(model, [edited], params, renderer.stop_ids)[0]
    got = generate_with_prefix(model, [edited], [7], params, renderer.stop_ids, cache)[0]
    assert got.output_ids == want.output_ids
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)


def test_keep_only_forgets_ended_episodes(policy):
    model, renderer = policy
    cache = PrefixCache()
    p = renderer.prompt_ids([{"role": "user", "content": "hello"}])
    generate_with_prefix(model, [p, p + [5]], [1, 2], SamplingParams(0.0, max_new_tokens=3), renderer.stop_ids, cache)
    assert set(cache.entries) == {1, 2}
    cache.keep_only({2})
    assert set(cache.entries) == {2}
    with pytest.raises(ValueError, match="2 keys for 1 prompts"):
        generate_with_prefix(model, [p], [1, 2], SamplingParams(), renderer.stop_ids, cache)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.0, max_new_tokens=24), SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=24)],
)
@pytest.mark.slow
def test_a_prefix_shared_by_first_turns_is_prefilled_once(policy, params, monkeypatch):
    """The repair prompts of different tasks share their first 78 tokens (system prompt and
    tool specs). With the threshold lowered below that, the prefix runs once per call and
    every episode equals the direct computation (tokens exact, log-probs to 1e-4)."""
    import consequence.policy.prefix_cache as pc

    model, renderer = policy
    full, _ = _episodes(model, renderer, params, cached=False, group=2)
    direct, direct_cache = _episodes(model, renderer, params, cached=True, group=2)
    monkeypatch.setattr(pc, "SHARED_PREFIX_MIN_TOKENS", 16)
    shared, cache = _episodes(model, renderer, params, cached=True, group=2)
    first = [t.calls[0].context_ids for t in shared[::2]]  # 6 distinct first prompts
    P = next(j for j in range(min(map(len, first))) if len({p[j] for p in first}) > 1)
    assert P == 78
    # first turns of the 6 tasks: the shared 78 tokens run once; each row then prefills the last
    # S slots, S its longest suffix (later turns are the same in both runs)
    lens = [len(p) for p in first]
    S = max(n - P for n in lens)
    assert direct_cache.prefilled_tokens - cache.prefilled_tokens == sum(lens) - (P + sum(min(n, S) for n in lens))
    assert sum(lens) - (P + sum(min(n, S) for n in lens)) > 4 * P
    for a, b in zip(full, shared):
        assert [c.output_ids for c in a.calls] == [c.output_ids for c in b.calls]
        assert [c.context_ids for c in a.calls] == [c.context_ids for c in b.calls]
        for ca, cb in zip(a.calls, b.calls):
            assert ca.sample_logprobs == pytest.approx(cb.sample_logprobs, abs=1e-4)
    assert [[c.output_ids for c in t.calls] for t in direct] == [[c.output_ids for c in t.calls] for t in shared]

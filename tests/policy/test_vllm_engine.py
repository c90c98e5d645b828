"""The vLLM rollout engine keeps the sampler's contract (consequence/policy/vllm_engine.py,
docs/vllm.md): token ids and log μ as sampled, the keep-sampling mask, the ratio against
the trainer at 1 up to a measured bound, and weight updates by version.

The engine tests need vLLM, which lives in its own environment (`make vllm-env`;
`.ci/run` runs this file there after the main suite); in the main environment they are
skipped and only the checks that need no engine run. One engine start (~40 s on 2 cores)
is shared by the module.
"""

from __future__ import annotations

import math

import pytest
import torch

from consequence.policy.sampler import SamplingParams, generate
from consequence.policy.vllm_engine import BUILD_HINT, VllmEngine, _support_request, vllm_available

HAVE_VLLM = vllm_available()
needs_vllm = pytest.mark.skipif(
    not HAVE_VLLM,
    reason="vLLM is not installed here; it runs in .venv-vllm (make vllm-env; .ci/run runs this file there)",
)

# Measured on the tiny policy in float32 (docs/vllm.md): max |log μ_vLLM − log π_trainer|
# over the sampled tokens of these tests was 9.5e-7 (sampled, T = 1), 2.6e-6 (top-k 20 +
# top-p 0.9, T = 0.8) and 1.8e-6 (greedy after a weight update); over the 5,629 tokens of
# benchmarks/bench_engines.py it was 2.9e-5 at most (mean 6.6e-8). The bound is 3x that.
LOGPROB_TOL = 1e-4

TEXTS = [
    "Fix the bug in add(a, b).",
    "The test test_max fails: expected 3, got 2.",
    "Read the code of file main.py, then run the tests.",
    "hello",
]


def test_top_p_alone_needs_the_whole_vocabulary():
    assert _support_request(SamplingParams(1.0, 0, 1.0), 768, 1024) is None
    assert _support_request(SamplingParams(0.0, 5, 0.5), 768, 1024) is None  # greedy: no support
    assert _support_request(SamplingParams(1.0, 20, 0.9), 768, 1024) == 21
    assert _support_request(SamplingParams(1.0, 0, 0.9), 768, 1024) == 768
    with pytest.raises(ValueError, match="whole vocabulary"):
        _support_request(SamplingParams(1.0, 0, 0.9), 49152, 1024)


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed: the missing-vLLM message cannot be provoked")
def test_without_vllm_the_engine_says_how_to_build_its_environment(tmp_path):
    with pytest.raises(ImportError, match="make vllm-env") as e:
        VllmEngine(tmp_path)
    assert BUILD_HINT in str(e.value)


# ---- with an engine -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from consequence.distill.warmstart import ensure_warmstart

    folder = ensure_warmstart()
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    prompts = []
    for t in TEXTS:
        text = tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
        prompts.append(tok.encode(text, add_special_tokens=False))
    stop_ids = [tok.convert_tokens_to_ids("<|im_end|>")]
    return folder, model, prompts, stop_ids


@pytest.fixture(scope="module")
def engine(tiny):
    eng = VllmEngine(tiny[0], max_model_len=1024, seed=0)
    yield eng
    eng.close()


def trainer_logprobs(model, prompts, samples, params: SamplingParams) -> list[list[float]]:
    """log π_trainer of each sampled token, on the sampler's stored supports (as the update does)."""
    from consequence.policy.logprobs import token_logprobs

    rows = [p + s.output_ids for p, s in zip(prompts, samples)]
    S = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    am = torch.zeros(len(rows), S, dtype=torch.long)
    keep = []
    for i, (r, p, s) in enumerate(zip(rows, prompts, samples)):
        ids[i, : len(r)] = torch.tensor(r)
        am[i, : len(r)] = 1
        for k, sup in enumerate(s.keep_ids or []):
            keep += [(i, len(p) + k, t) for t in sup]
    keep_index = torch.tensor(keep, dtype=torch.long).view(-1, 3) if keep else None
    with torch.no_grad():
        lp, _ = token_logprobs(model, ids, am, params.temperature, params.top_k, params.top_p, keep_index=keep_index)
    return [
        lp[i, len(p) - 1 : len(p) - 1 + len(s.output_ids)].tolist() for i, (p, s) in enumerate(zip(prompts, samples))
    ]


def max_gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def check_contract(samples, params: SamplingParams, stop_ids):
    for s in samples:
        assert len(s.logprobs) == len(s.output_ids) > 0
        assert all(math.isfinite(x) and x <= 0 for x in s.logprobs)
        if s.stop_reason == "stop":
            assert s.output_ids[-1] in stop_ids and not set(s.output_ids[:-1]) & set(stop_ids)
        else:
            assert s.stop_reason == "length" and len(s.output_ids) == params.max_new_tokens
            assert not set(s.output_ids) & set(stop_ids)


@needs_vllm
def test_sampled_tokens_and_logprobs_match_the_trainer(engine, tiny):
    _, model, prompts, stop_ids = tiny
    params = SamplingParams(temperature=1.0, max_new_tokens=24)
    fn = engine.generate_fn(params, stop_ids, seed=7)
    samples = fn(prompts, 24, list(range(len(prompts))))
    check_contract(samples, params, stop_ids)
    assert all(s.keep_ids is None for s in samples)
    assert fn.version == engine.version == 0
    gap = max_gap([s.logprobs for s in samples], trainer_logprobs(model, prompts, samples, params))
    print(
        f"sampled T=1: max |log mu_vllm - log pi_trainer| = {gap:.2e} over {sum(len(s.output_ids) for s in samples)} tokens"
    )
    assert gap < LOGPROB_TOL
    # the same seed on the same weights draws the same tokens; another seed draws others
    again = engine.generate_fn(params, stop_ids, seed=7)(prompts, 24, list(range(len(prompts))))
    assert [s.output_ids for s in again] == [s.output_ids for s in samples]
    other = engine.generate_fn(params, stop_ids, seed=8)(prompts, 24, list(range(len(prompts))))
    assert [s.output_ids for s in other] != [s.output_ids for s in samples]


@needs_vllm
def test_top_k_top_p_report_the_support_the_trainer_scores_on(engine, tiny):
    from consequence.policy.logprobs import keep_mask

    _, model, prompts, stop_ids = tiny
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=16)
    samples = engine.generate_fn(params, stop_ids, seed=3)(prompts, 16, list(range(len(prompts))))
    check_contract(samples, params, stop_ids)
    n_tok = 0
    for p, s in zip(prompts, samples):
        assert s.keep_ids is not None and len(s.keep_ids) == len(s.output_ids)
        # on unchanged weights the stored support is the one logprobs.keep_mask computes
        with torch.no_grad():
            logits = model(torch.tensor([p + s.output_ids])).logits[0, len(p) - 1 : len(p) - 1 + len(s.output_ids)]
        ours = keep_mask(logits.float() / params.temperature, params.top_k, params.top_p)
        for k, (t, sup) in enumerate(zip(s.output_ids, s.keep_ids)):
            assert sup == sorted(sup) and t in sup and 1 <= len(sup) <= params.top_k
            assert sup == ours[k].nonzero().flatten().tolist()
            n_tok += 1
    gap = max_gap([s.logprobs for s in samples], trainer_logprobs(model, prompts, samples, params))
    print(f"top-k 20 + top-p 0.9, T=0.8: max |Δ log-prob| = {gap:.2e} over {n_tok} tokens")
    assert gap < LOGPROB_TOL


@needs_vllm
def test_weight_update_by_version(engine, tiny):
    _, model, prompts, stop_ids = tiny
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    before = engine.generate_fn(params, stop_ids, seed=0)(prompts, 16, list(range(len(prompts))))

    g = torch.Generator().manual_seed(0)
    perturbed = {
        k: v + 0.5 * v.std() * torch.randn(v.shape, generator=g) if v.ndim == 2 else v.clone()
        for k, v in model.state_dict().items()
    }
    new = type(model)(model.config).eval()
    new.load_state_dict(perturbed)
    if new.config.tie_word_embeddings:
        new.tie_weights()
    engine.load_weights(new.state_dict(), version=5)
    assert engine.version == 5

    fn = engine.generate_fn(params, stop_ids, seed=0)
    after = fn(prompts, 16, list(range(len(prompts))))
    assert fn.version == 5
    check_contract(after, params, stop_ids)
    ours = generate(new, prompts, params, stop_ids)  # our sampler, greedy, on the new weights
    assert [s.output_ids for s in after] == [s.output_ids for s in ours]
    assert [s.output_ids for s in after] != [s.output_ids for s in before]
    gap = max_gap([s.logprobs for s in after], trainer_logprobs(new, prompts, after, params))
    print(f"greedy after load_weights: max |Δ log-prob| = {gap:.2e}; load took {engine.load_seconds:.2f} s")
    assert gap < LOGPROB_TOL

    engine.load_weights(model.state_dict(), version=6)  # back to the original weights
    again = engine.generate_fn(params, stop_ids, seed=0)(prompts, 16, list(range(len(prompts))))
    assert [s.output_ids for s in again] == [s.output_ids for s in before]
    assert max_gap([s.logprobs for s in again], [s.logprobs for s in before]) < LOGPROB_TOL

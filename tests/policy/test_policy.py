"""Tests for consequence.policy: tokenizer, chat template, fast sampler, trainer log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from consequence.policy.logprobs import keep_mask, process_logits, token_logprobs
from consequence.policy.sampler import SamplingParams, _FastLlama, generate
from consequence.policy.tiny import TOOL_TOKENS, build_model, build_tokenizer, load_policy

CORPUS = [
    "<|im_start|>system\nYou write Python.<|im_end|>\n<|im_start|>user\nAdd two numbers.<|im_end|>\n",
    '<|im_start|>assistant\n<tool_call>\n{"name": "run", "arguments": {"cmd": "ls -la"}}\n</tool_call><|im_end|>\n',
    "<|im_start|>user\n<tool_response>\nfile.py\n</tool_response><|im_end|>\n",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
] * 20


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(CORPUS, vocab_size=400)


@pytest.fixture(scope="module")
def model(tok):
    m = build_model(tok, seed=0)
    with torch.no_grad():  # sharper than the 0.02-std init, so greedy has no near-ties
        for p in m.parameters():
            if p.dim() > 1:
                p.mul_(2.0)
    return m


def _rand_prompts(V: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (n,), generator=g).tolist() for n in lengths]


def _right_pad(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    S = max(map(len, seqs))
    ids = torch.zeros(len(seqs), S, dtype=torch.long)
    am = torch.zeros(len(seqs), S, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        am[i, : len(s)] = 1
    return ids, am


# -- tokenizer & template ---------------------------------------------------------------


def test_special_tokens_single_ids_and_visible(tok):
    for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", *TOOL_TOKENS):
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1, (t, ids)
        assert tok.decode(ids, skip_special_tokens=False) == t
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    text = '<|im_start|>assistant\n<tool_call>\n{"name": "x"}\n</tool_call><|im_end|>'
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    # The tool tags are not "special": the harness finds them even when specials are skipped.
    assert "<tool_call>" in tok.decode(ids, skip_special_tokens=True)
    assert tok.convert_tokens_to_ids("<tool_call>") in ids


def test_tokenizer_round_trip(tok, model, tmp_path):
    tok.save_pretrained(tmp_path)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    m2, t2 = load_policy(tmp_path)
    text = "<|im_start|>user\nprint(add(1, 2)) <tool_response>ok</tool_response><|im_end|>"
    assert t2.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    assert t2.chat_template == tok.chat_template
    assert t2.pad_token_id == tok.pad_token_id and t2.eos_token_id == tok.eos_token_id
    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        assert torch.equal(m2(ids).logits, model(ids).logits)


def test_load_policy_errors(tok, tmp_path):
    with pytest.raises(FileNotFoundError, match="no policy"):
        load_policy(tmp_path / "missing")
    t = build_tokenizer(CORPUS[:4], vocab_size=300)
    t.chat_template = None
    t.save_pretrained(tmp_path)
    build_model(t).save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ValueError, match="no chat template"):
        load_policy(tmp_path)


def test_chat_template_exact(tok):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "run",
                "description": "Run a shell command.",
                "parameters": {
                    "type": "object",
                    "properties": {"cmd": {"type": "string"}, "timeout": {"type": "integer"}},
                },
            },
        },
        {
            "type": "function",
            "function": {
                "name": "submit",
                "description": "Finish.",
                "parameters": {"type": "object", "properties": {}},
            },
        },
    ]
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "List files."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "run", "arguments": {"cmd": "ls"}}},
                {"type": "function", "function": {"name": "run", "arguments": {"cmd": "pwd"}}},
            ],
        },
        {"role": "tool", "content": "a.py"},
        {"role": "tool", "content": "/work"},
        {"role": "assistant", "content": "Done."},
    ]
    got = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    want = (
        "<|im_start|>system\nBe brief.\n# Tools\n"
        "run(cmd: string, timeout: integer): Run a shell command.\n"
        "submit(): Finish.<|im_end|>\n"
        "<|im_start|>user\nList files.<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "run", "arguments": {"cmd": "ls"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "run", "arguments": {"cmd": "pwd"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\na.py\n</tool_response>\n"
        "<tool_response>\n/work\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nDone.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert got == want
    # No tools, no system message: no system turn; no generation prompt when not asked.
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n"


# -- processing helper -------------------------------------------------------------------


def test_process_logits_temperature_case():
    logits = torch.tensor([2.0, 1.0, 0.0])
    lp = torch.log_softmax(process_logits(logits, temperature=0.5), -1)
    assert lp[0].item() == pytest.approx(-0.1429, abs=1e-4)
    assert lp[0].item() != pytest.approx(-0.8152, abs=1e-3)  # T=1 log-prob divided by T
    assert lp[0].item() != pytest.approx(-0.4076, abs=1e-3)  # log-softmax at T=1
    # Greedy (T=0) reports the unprocessed T=1 log-prob.
    lp0 = torch.log_softmax(process_logits(logits, temperature=0.0), -1)
    assert lp0[0].item() == pytest.approx(2.0 - math.log(math.exp(2) + math.exp(1) + 1), abs=1e-6)


def test_top_k_case():
    logits = torch.tensor([3.0, 1.0, 2.0, 0.0])
    p = torch.softmax(process_logits(logits, top_k=2), -1)
    e = torch.tensor([math.exp(3), 0, math.exp(2), 0])
    assert torch.allclose(p, e / e.sum(), atol=1e-6)


def test_top_p_case():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    keep = keep_mask(logits, top_p=0.8)
    assert keep.tolist() == [True, True, False, False]
    p = torch.softmax(process_logits(logits, top_p=0.8), -1)
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=1e-6)
    # Trainer with the same keep mask: ratio exactly 1 on the kept tokens.
    mu = torch.log(torch.tensor([0.625, 0.375]))
    pi = torch.log_softmax(process_logits(logits, top_p=0.8), -1)[:2]
    assert torch.allclose(torch.exp(pi - mu), torch.ones(2), atol=1e-6)
    # Negative control: the unmasked trainer (plain softmax) is off by 1/0.8.
    assert torch.exp(probs[:2].log() - mu).tolist() == pytest.approx([0.8, 0.8], abs=1e-6)
    # A target outside the support gets -inf.
    assert pi.shape == (2,) and torch.log_softmax(process_logits(logits, top_p=0.8), -1)[3] == float("-inf")


# -- forward & generation ----------------------------------------------------------------


def test_fast_forward_matches_hf(model, tok):
    V = len(tok)
    prompts = _rand_prompts(V, [30, 17, 5], seed=1)
    fast = _FastLlama(model)
    L = 30
    ids = torch.zeros(3, L, dtype=torch.long)
    valid = torch.zeros(3, L, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, L - len(p) :] = torch.tensor(p)
        valid[i, L - len(p) :] = True
    pos = (valid.long().cumsum(-1) - 1).clamp_min(0)
    fast.alloc(3, L)
    with torch.inference_mode():
        ours = fast.forward(ids, pos, 0, valid, all_logits=True)
        for i, p in enumerate(prompts):
            ref = model(torch.tensor([p])).logits[0]
            assert (ours[i, L - len(p) :] - ref).abs().max().item() < 1e-4
        # Negative control: no rotation (all positions 0) must not match. (A constant shift
        # of positions would match: RoPE attention only sees relative positions.)
        bad = fast.forward(ids, torch.zeros_like(pos), 0, valid, all_logits=True)
        ref = model(torch.tensor([prompts[2]])).logits[0]
        assert (bad[2, -5:] - ref).abs().max().item() > 1e-3


def test_greedy_matches_hf_generate(model, tok):
    prompts = _rand_prompts(len(tok), [12, 7], seed=2)
    out = generate(model, prompts, SamplingParams(temperature=0, max_new_tokens=12), stop_ids=[])
    for p, s in zip(prompts, out):
        with torch.inference_mode():
            hf = model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False,
                max_new_tokens=12,
                min_new_tokens=12,
                pad_token_id=tok.pad_token_id,
            )
        assert s.output_ids == hf[0, len(p) :].tolist()
        assert s.stop_reason == "length" and len(s.logprobs) == 12
        # Greedy log-probs are under the unprocessed T=1 distribution.
        ids, am = _right_pad([p + s.output_ids])
        with torch.no_grad():
            lp, _ = token_logprobs(model, ids, am, temperature=0.0)
        assert torch.allclose(lp[0, len(p) - 1 :], torch.tensor(s.logprobs), atol=1e-4)


def test_batch_equals_single_rows(model, tok):
    prompts = _rand_prompts(len(tok), [25, 3, 11, 25], seed=3)
    params = SamplingParams(temperature=0, max_new_tokens=10)
    batch = generate(model, prompts, params, stop_ids=[])
    for p, s in zip(prompts, batch):
        alone = generate(model, [p], params, stop_ids=[])[0]
        assert alone.output_ids == s.output_ids
        assert alone.logprobs == pytest.approx(s.logprobs, abs=1e-4)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_new_tokens=20),
        SamplingParams(temperature=0.5, max_new_tokens=20),
        SamplingParams(temperature=1.0, top_k=5, max_new_tokens=20),
        SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=20),
    ],
    ids=["T1", "T0.5", "topk5", "topp0.8"],
)
def test_sampler_logprobs_match_trainer(model, tok, params):
    prompts = _rand_prompts(len(tok), [15, 9, 15, 4], seed=4)
    prompts[2] = list(prompts[0])  # a duplicated prompt (shared prefill)
    out = generate(model, prompts, params, stop_ids=[], generator=torch.Generator().manual_seed(5))
    assert out[0].output_ids != out[2].output_ids  # duplicates sample independently
    ids, am = _right_pad([p + s.output_ids for p, s in zip(prompts, out)])
    lp, ent = token_logprobs(model, ids, am, params.temperature, params.top_k, params.top_p, with_entropy=True)
    assert lp.dtype == torch.float32 and lp.shape == (4, ids.shape[1] - 1)
    for i, (p, s) in enumerate(zip(prompts, out)):
        assert len(s.output_ids) == 20 and s.stop_reason == "length"
        trainer = lp[i, len(p) - 1 : len(p) - 1 + len(s.output_ids)]
        ratio = torch.exp(trainer - torch.tensor(s.logprobs))
        assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-4), ratio
    assert (lp[1, len(prompts[1]) + 20 - 1 :] == 0).all()  # padded targets
    assert torch.isfinite(ent).all() and (ent >= -1e-6).all()
    if params.top_k:
        assert (ent <= math.log(params.top_k) + 1e-4).all()
    # Negative control: the unprocessed distribution does not match when processing is on.
    lp_raw, _ = token_logprobs(model, ids, am)
    p0, s0 = prompts[0], out[0]
    diff = (lp_raw[0, len(p0) - 1 : len(p0) - 1 + 20] - torch.tensor(s0.logprobs)).abs().max()
    if params.temperature != 1.0 or params.top_k or params.top_p < 1:
        assert diff > 1e-3


def test_token_logprobs_entropy_and_grad(model, tok):
    prompts = _rand_prompts(len(tok), [6, 4], seed=6)
    ids, am = _right_pad(prompts)
    lp, ent = token_logprobs(model, ids, am, with_entropy=True)
    with torch.no_grad():
        logits = model(ids).logits[:, :-1]
    direct = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert torch.allclose(lp[0], direct[0], atol=1e-5)
    p = torch.softmax(logits, -1)
    assert torch.allclose(ent[0], -(p * p.log()).sum(-1)[0], atol=1e-5)
    lp.sum().backward()
    g = model.model.embed_tokens.weight.grad
    assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
    model.zero_grad(set_to_none=True)


def test_stop_reason_and_row_dropping(model, tok):
    V = len(tok)
    prompts = _rand_prompts(V, [10, 6, 14, 8, 10, 3, 7, 12], seed=7)
    stop = list(range(3, V, 9))  # frequent stops: rows finish at different steps
    params = SamplingParams(temperature=1.0, max_new_tokens=30)
    out = generate(model, prompts, params, stop_ids=stop, generator=torch.Generator().manual_seed(8))
    reasons = {s.stop_reason for s in out}
    assert reasons == {"stop", "length"} or reasons == {"stop"}
    assert len({len(s.output_ids) for s in out}) > 1
    for s in out:
        assert len(s.output_ids) == len(s.logprobs) >= 1
        if s.stop_reason == "stop":
            assert s.output_ids[-1] in stop and not set(s.output_ids[:-1]) & set(stop)
        else:
            assert len(s.output_ids) == 30 and not set(s.output_ids) & set(stop)
    ids, am = _right_pad([p + s.output_ids for p, s in zip(prompts, out)])
    lp, _ = token_logprobs(model, ids, am)
    for i, (p, s) in enumerate(zip(prompts, out)):
        t = lp[i, len(p) - 1 : len(p) - 1 + len(s.output_ids)]
        assert torch.allclose(t, torch.tensor(s.logprobs), atol=1e-4)
    # Greedy: without stop ids the row runs to max_new_tokens; with one it stops on it.
    p = prompts[0]
    g = generate(model, [p], SamplingParams(temperature=0, max_new_tokens=5), stop_ids=[])[0]
    k = g.output_ids.index(g.output_ids[2])  # first occurrence of that id
    s1 = generate(model, [p], SamplingParams(temperature=0, max_new_tokens=5), stop_ids=[g.output_ids[2]])[0]
    assert s1.stop_reason == "stop" and s1.output_ids == g.output_ids[: k + 1]
    assert s1.logprobs == pytest.approx(g.logprobs[: k + 1], abs=1e-5)
    assert g.stop_reason == "length" and len(g.output_ids) == 5


def test_hf_fallback_matches_fast(model, tok, monkeypatch):
    prompts = _rand_prompts(len(tok), [9, 4], seed=9)
    params = SamplingParams(temperature=0.7, top_k=20, max_new_tokens=8)
    fast = generate(model, prompts, params, stop_ids=[], generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(_FastLlama, "supports", staticmethod(lambda m: False))
    slow = generate(model, prompts, params, stop_ids=[], generator=torch.Generator().manual_seed(3))
    for a, b in zip(fast, slow):
        assert a.output_ids == b.output_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_kv_slots_never_written_are_zero_and_give_finite_logits(model, tok):
    """A masked slot enters attention as weight 0 × value: it must not hold uninitialised
    memory (0 × NaN = NaN), e.g. when prefix reuse fills only some slots."""
    fast = _FastLlama(model)
    fast.alloc(2, 6)
    assert all(bool((c == 0).all()) for c in fast.k_cache + fast.v_cache)
    key_valid = torch.zeros(2, 6, dtype=torch.bool)
    key_valid[:, 4] = True  # slots 0-3 were never written
    with torch.inference_mode():
        logits = fast.forward(torch.tensor([[5], [7]]), torch.tensor([[0], [0]]), 4, key_valid)
        hf = model(input_ids=torch.tensor([[5], [7]])).logits[:, -1]
    assert torch.isfinite(logits).all() and torch.allclose(logits, hf, atol=1e-4)

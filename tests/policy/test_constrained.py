"""Constrained decoding in our sampler (consequence.policy.constrained, sampler ``constraints``):
the reply follows the grammar, each token was drawn from the masked distribution, and the
recorded support makes the trainer's log-prob of every constrained token equal the sampler's
(ratio 1 on fresh samples), the pre-step check included.

The bundled tiny model writes Python-ish text; without a grammar its replies are never JSON
(checked below), so a valid reply here is the grammar's doing."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
import torch

from consequence.config import TrainConfig
from consequence.harness.renderer import Renderer
from consequence.loop.checks import check_ratio
from consequence.loop.learner import logprob_fn
from consequence.policy.constrained import Grammar, GrammarError, engine_tokenizer, json_schema_grammar
from consequence.policy.device import FLOAT32_LOGPROB_TOL, logprob_tolerance
from consequence.policy.logprobs import keep_mask
from consequence.policy.sampler import SamplingParams, generate
from consequence.policy.tiny import load_policy
from consequence.records import ModelCall, Trajectory, read_trajectories, trajectory_to_rows, write_trajectories
from consequence.update.step import compute_logprobs

BUNDLED = "consequence/assets/tiny-repair"
PAD = 0
# bounded values, so that every reply ends within the token budget
SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["add", "sub", "mul"]},
        "note": {"type": "string", "maxLength": 6},
    },
    "required": ["n", "ok", "kind", "note"],
    "additionalProperties": False,
}
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def setup():
    model, tok = load_policy(BUNDLED)
    renderer = Renderer(tok, [])
    prompt = renderer.prompt_ids([{"role": "user", "content": "fix add"}])
    grammar = Grammar(json_schema_grammar(SCHEMA), engine_tokenizer(tok, renderer.stop_ids))
    return model, tok, renderer, prompt, grammar


def _sample(setup, params, constrained=True, seed=0):
    model, _tok, renderer, prompt, grammar = setup
    gens = [torch.Generator().manual_seed(seed * 10 + k) for k in range(len(SEEDS))]
    cons = [grammar.start() for _ in SEEDS] if constrained else None
    return generate(model, [prompt] * len(SEEDS), params, renderer.stop_ids, gens, constraints=cons)


def _text(tok, renderer, s) -> str:
    ids = s.output_ids[:-1] if s.output_ids and s.output_ids[-1] in renderer.stop_ids else s.output_ids
    return tok.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["T1", "T0"])
def test_reply_under_a_json_schema_parses_and_validates(setup, temperature):
    _model, tok, renderer, _prompt, _grammar = setup
    params = SamplingParams(temperature=temperature, max_new_tokens=48)
    for s in _sample(setup, params):
        assert s.stop_reason == "stop" and s.output_ids[-1] in renderer.stop_ids and s.constrained
        jsonschema.validate(json.loads(_text(tok, renderer, s)), SCHEMA)
    # negative control: the same sampling without the grammar is not JSON
    for s in _sample(setup, params, constrained=False):
        assert not s.constrained
        with pytest.raises(json.JSONDecodeError):
            json.loads(_text(tok, renderer, s))


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.0, 4, 1.0)], ids=["T1", "T0.7-p0.9", "k4"]
)
def test_each_token_is_drawn_from_the_masked_distribution_and_its_support_is_recorded(setup, temperature, top_k, top_p):
    model, _tok, _renderer, prompt, grammar = setup
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=48)
    for s in _sample(setup, params, seed=1):
        replay = grammar.start()
        assert s.keep_ids is not None and len(s.keep_ids) == len(s.output_ids)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + s.output_ids])).logits[0].float() / temperature
        V = logits.shape[-1]
        for k, (t, keep, mu) in enumerate(zip(s.output_ids, s.keep_ids, s.logprobs)):
            allowed = replay.allowed(V)
            z = logits[len(prompt) - 1 + k]
            cut = keep_mask(z.masked_fill(~allowed, float("-inf")), top_k, top_p)
            want = allowed if cut is None else allowed & cut  # top-k / top-p rank the allowed ids only
            assert keep == want.nonzero().flatten().tolist() and t in keep
            zk = z[keep]
            # the token's log-prob renormalised over its support (here from the HF forward: the
            # sampler's own forward differs by float32 rounding, the ratio tolerance below)
            assert mu == pytest.approx(float(zk[keep.index(t)] - torch.logsumexp(zk, 0)), abs=FLOAT32_LOGPROB_TOL)
            replay.advance(t)


def _rows(samples, prompt):
    trajs = [
        Trajectory(
            "t",
            "g",
            i,
            i,
            0,
            calls=[
                ModelCall(
                    prompt, s.output_ids, s.logprobs, s.stop_reason, keep_ids=s.keep_ids, constrained=s.constrained
                )
            ],
        )
        for i, s in enumerate(samples)
    ]
    return [r for i, t in enumerate(trajs) for r in trajectory_to_rows(t, i)]


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.0, 4, 1.0), (0.0, 0, 1.0)],
    ids=["T1", "T0.7-p0.9", "k4", "T0"],
)
def test_ratio_is_one_on_constrained_tokens(setup, temperature, top_k, top_p):
    """exp(log π_trainer − log μ_sampler) = 1 on every sampled constrained token, within the
    float32 tolerance of ``policy.device.logprob_tolerance`` (12 u Z: two computations, each
    rounding the logits at most u·Z, each log-softmax doubling it); the pre-step check passes."""
    model, _tok, _renderer, prompt, _grammar = setup
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=48)
    samples = _sample(setup, params, seed=2)
    rows = _rows(samples, prompt)
    cfg = TrainConfig(temperature=temperature, top_k=top_k, top_p=top_p) if temperature else TrainConfig()
    fn = logprob_fn(cfg)
    trainer = compute_logprobs(model, rows, PAD, fn, temperature)
    with torch.no_grad():
        z = max(float(model(input_ids=torch.tensor([r.input_ids])).logits.abs().max()) for r in rows)
    tol = logprob_tolerance("float32", z)
    n = 0
    for r, lp in zip(rows, trainer):
        for m, a, b in zip(r.loss_mask, lp, r.old_logprobs):
            if m:
                assert abs(math.exp(a - b) - 1) <= math.expm1(tol), (a, b)
                n += 1
    assert n == sum(len(s.output_ids) for s in samples)
    assert check_ratio(model, rows, PAD, fn, temperature).passed
    if temperature == 0:
        assert all(s.keep_ids is None for s in samples)  # greedy: log-probs under the unmasked T = 1 distribution
        return
    # negative controls: without the recorded support the trainer scores the constrained tokens
    # under the unmasked distribution (ratio far from 1), and so does the pre-step check's
    # recomputation when the rows are not marked as constrained
    bare = _rows([s.__class__(s.output_ids, s.logprobs, s.stop_reason, None, None, True) for s in samples], prompt)
    worst = max(
        abs(a - b)
        for r, lp in zip(bare, compute_logprobs(model, bare, PAD, fn, temperature))
        for m, a, b in zip(r.loss_mask, lp, r.old_logprobs)
        if m
    )
    assert worst > 10 * tol
    unmarked = [r.__class__(**{**vars(r), "constrained": False}) for r in rows]
    assert not check_ratio(model, unmarked, PAD, fn, temperature).passed


def test_a_schema_the_engine_cannot_compile_is_a_grammar_error(setup):
    _model, tok, renderer, _prompt, _grammar = setup
    with pytest.raises(GrammarError, match="foo"):
        Grammar(
            json_schema_grammar({"type": "object", "properties": {"a": {"type": "foo"}}}),
            engine_tokenizer(tok, renderer.stop_ids),
        )
    with pytest.raises(GrammarError, match="must be an object"):
        json_schema_grammar(["not", "a", "schema"])  # type: ignore[arg-type]


def test_constraints_must_be_one_per_prompt(setup):
    model, _tok, renderer, prompt, grammar = setup
    with pytest.raises(ValueError, match="one per prompt"):
        generate(
            model, [prompt, prompt], SamplingParams(max_new_tokens=2), renderer.stop_ids, constraints=[grammar.start()]
        )


def test_the_constrained_mark_is_stored_and_reaches_the_rows(tmp_path):
    call = ModelCall([1, 2], [4, 9], [-0.1, -0.2], "stop", keep_ids=[[3, 4], [9]], constrained=True)
    t = Trajectory("t", "g", 0, 0, 0, calls=[call, ModelCall([1, 2, 4, 9, 7], [5], [-0.3], "stop")])
    write_trajectories(tmp_path / "t.parquet", [t])
    (back,) = read_trajectories(tmp_path / "t.parquet")
    assert [c.constrained for c in back.calls] == [True, False] and back == t
    (row,) = trajectory_to_rows(back)
    assert row.constrained  # one call of the row was constrained
    d = t.to_dict()
    del d["calls"][0]["constrained"]  # a file written before the field existed
    assert Trajectory.from_dict(d).calls[0].constrained is False

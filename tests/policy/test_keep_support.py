"""The keep-sampling mask: π_θ and π_ref score a target on the support the sampler drew it from.

Case 14 (docs/cases.md): with top-p, a support recomputed from the *current* logits after
the weights moved can exclude the token that was sampled (log-prob −inf, ratio 0 / NaN).
The sampler stores each token's support; every log-prob of the trainer uses it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch

from consequence.config import TrainConfig
from consequence.loop.checks import check_ratio
from consequence.loop.learner import logprob_fn
from consequence.policy.logprobs import keep_mask, mask_to_support, token_logprobs
from consequence.policy.sampler import SamplingParams, generate
from consequence.policy.tiny import build_model, build_tokenizer
from consequence.records import (
    ModelCall,
    TrainingRow,
    Trajectory,
    pad_rows,
    read_trajectories,
    trajectory_to_rows,
    write_trajectories,
)
from consequence.update.step import UpdateConfig, compute_logprobs, ppo_step

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "<|im_start|>user\nfix it<|im_end|>\n",
    '<tool_call>\n{"name": "run_tests", "arguments": {}}\n</tool_call>',
] * 20
PAD = 0


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(CORPUS, vocab_size=320)


def _model(tok, seed=0, scale=3.0):
    m = build_model(tok, seed=seed)
    with torch.no_grad():  # sharper than the init: a top-p 0.9 support is then a small set
        for p in m.parameters():
            if p.dim() > 1:
                p.mul_(scale)
    return m.eval()


def _perturb(model, std=0.3, seed=1):
    """The weights move after sampling (optimizer steps, epochs, asynchronous collection)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std * p.detach().abs().mean())


def _rows(model, tok, params, n_prompts=4, seed=0):
    """Sample ``n_prompts`` two-call trajectories with ``params``; return (trajectories, rows)."""
    g = torch.Generator().manual_seed(seed)
    V = len(tok)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in (7, 5, 9, 4)[:n_prompts]]
    first = generate(model, prompts, params, stop_ids=[], generator=g)
    obs = [5, 6]
    second_ctx = [p + s.output_ids + obs for p, s in zip(prompts, first)]
    second = generate(model, second_ctx, params, stop_ids=[], generator=g)
    trajs = []
    for i, (p, a, b, ctx) in enumerate(zip(prompts, first, second, second_ctx)):
        calls = [
            ModelCall(p, a.output_ids, a.logprobs, a.stop_reason, observation_ids=obs, keep_ids=a.keep_ids),
            ModelCall(ctx, b.output_ids, b.logprobs, b.stop_reason, keep_ids=b.keep_ids),
        ]
        trajs.append(Trajectory("t", "g", i, i, 0, calls=calls, reward=float(i % 2)))
    return trajs, [r for i, t in enumerate(trajs) for r in trajectory_to_rows(t, i)]


def _direct(model, row: TrainingRow, temperature: float) -> list[float]:
    """log softmax over the stored support, by hand, of every target of ``row``."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([row.input_ids])).logits[0].float() / temperature
    out = []
    for j, m in enumerate(row.loss_mask):
        if m:
            keep = torch.tensor(row.keep_ids[j])
            z = logits[j - 1, keep]
            out.append(float(z[keep.tolist().index(row.input_ids[j])] - torch.logsumexp(z, 0)))
    return out


def test_mask_to_support_by_hand():
    # logits [2, 1, 0, -1] at the only target position (input position 1), support {0, 2}:
    # log p(2) = 0 − log(e² + e⁰) = −2.1269
    proc = torch.tensor([[[2.0, 1.0, 0.0, -1.0]]])
    keep_index = torch.tensor([[0, 1, 0], [0, 1, 2]])
    lp = torch.log_softmax(mask_to_support(proc, keep_index), -1)
    assert lp[0, 0].tolist()[1] == float("-inf") and lp[0, 0].tolist()[3] == float("-inf")
    assert lp[0, 0, 2].item() == pytest.approx(-math.log(math.exp(2) + 1), abs=1e-6)
    assert lp[0, 0, 0].item() == pytest.approx(2 - math.log(math.exp(2) + 1), abs=1e-6)
    with pytest.raises(ValueError, match="position 0"):
        mask_to_support(proc, torch.tensor([[0, 0, 1]]))


def test_sampler_stores_the_support_it_drew_from(tok):
    model = _model(tok)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=12)
    prompts = [[5, 9, 11, 40], [7, 8]]
    out = generate(model, prompts, params, stop_ids=[], generator=torch.Generator().manual_seed(3))
    for p, s in zip(prompts, out):
        assert s.keep_ids is not None and len(s.keep_ids) == len(s.output_ids)
        ids = torch.tensor([p + s.output_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float() / params.temperature
        for k, (t, keep, mu) in enumerate(zip(s.output_ids, s.keep_ids, s.logprobs)):
            pos = len(p) - 1 + k
            want = keep_mask(logits[pos], top_p=0.9).nonzero().flatten().tolist()
            assert keep == want and t in keep  # the top-p set of the behaviour logits, sampled id inside
            z = logits[pos, keep]
            assert mu == pytest.approx(float(z[keep.index(t)] - torch.logsumexp(z, 0)), abs=1e-4)
    # no cut, no stored support: full vocabulary at T, and greedy
    assert generate(model, prompts, SamplingParams(max_new_tokens=3), [])[0].keep_ids is None
    assert generate(model, prompts, SamplingParams(temperature=0, top_p=0.5, max_new_tokens=3), [])[0].keep_ids is None
    topk = generate(model, prompts, SamplingParams(top_k=7, max_new_tokens=3), [])[0]
    assert [len(k) for k in topk.keep_ids] == [7, 7, 7]


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, 0, 0.9), (0.7, 0, 0.8), (1.0, 20, 1.0), (1.0, 20, 0.9)],
    ids=["p0.9", "T0.7-p0.8", "k20", "k20-p0.9"],
)
def test_target_logprobs_stay_on_the_stored_support_after_the_weights_move(tok, temperature, top_k, top_p):
    model = _model(tok)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=16)
    _, rows = _rows(model, tok, params)
    fn = logprob_fn(TrainConfig(temperature=temperature, top_k=top_k, top_p=top_p))
    on_policy = compute_logprobs(model, rows, PAD, fn, temperature)
    for r, lp in zip(rows, on_policy):  # on the behaviour weights: ratio 1
        diff = [abs(a - b) for a, b, m in zip(lp, r.old_logprobs, r.loss_mask) if m]
        assert max(diff) < 1e-4
    _perturb(model)
    moved = compute_logprobs(model, rows, PAD, fn, temperature)
    bare = compute_logprobs(model, [dataclasses.replace(r, keep_ids=None) for r in rows], PAD, fn, temperature)
    n_outside = 0
    for r, lp, lp_bare in zip(rows, moved, bare):
        got = [x for x, m in zip(lp, r.loss_mask) if m]
        assert all(math.isfinite(x) for x in got)
        assert got == pytest.approx(_direct(model, r, temperature), abs=1e-4)
        n_outside += sum(1 for x, m in zip(lp_bare, r.loss_mask) if m and x == float("-inf"))
    # the old rule (support recomputed from the moved logits) loses sampled tokens
    if top_p < 1.0:
        assert n_outside > 0


def test_update_ratio_is_one_on_the_first_step_and_moves_only_with_the_weights(tok):
    model = _model(tok)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=16)
    trajs, rows = _rows(model, tok, params)
    fn = logprob_fn(TrainConfig(top_p=0.9))
    adv = [1.0 if trajs[r.traj_index].reward else -1.0 for r in rows]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the first step leaves the weights as they were
    m0 = ppo_step(model, opt, rows, adv, UpdateConfig(), PAD, fn)
    assert 1 - 1e-4 < m0["ratio_min"] <= m0["ratio_max"] < 1 + 1e-4
    _perturb(model, std=0.5)
    ref = _model(tok)  # the frozen reference at the sampling weights
    ref_lp = compute_logprobs(ref, rows, PAD, fn)
    cfg = UpdateConfig(kl_coef=0.05, tis_cap=2.0, entropy_coef=0.01)
    tis_old = compute_logprobs(model, rows, PAD, fn)  # TIS: π_old recomputed by the trainer
    rows_tis = [dataclasses.replace(r, old_logprobs=o) for r, o in zip(rows, tis_old)]
    ent_fn = logprob_fn(TrainConfig(top_p=0.9, entropy_coef=0.01))
    m1 = ppo_step(
        model,
        opt,
        rows_tis,
        adv,
        cfg,
        PAD,
        ent_fn,
        ref_logprobs=ref_lp,
        sampler_logprobs=[r.old_logprobs for r in rows],
    )
    assert all(math.isfinite(v) for v in m1.values())
    assert m1["kl_ref"] > 1e-3 and abs(m1["tis_weight_mean"] - 1.0) > 1e-3  # the weights did move
    assert m1["ratio_min"] == pytest.approx(1.0, abs=1e-4)  # against the recomputed π_old


def test_a_logprob_fn_that_ignores_the_support_is_refused(tok):
    model = _model(tok)
    _, rows = _rows(model, tok, SamplingParams(top_p=0.9, max_new_tokens=6), n_prompts=2)
    with pytest.raises(TypeError, match="keep_index"):
        compute_logprobs(model, rows, PAD, lambda m, ids, am, temperature=1.0: token_logprobs(m, ids, am))


def test_check_ratio_on_stored_supports_with_negative_controls(tok):
    model = _model(tok)
    _, rows = _rows(model, tok, SamplingParams(top_p=0.9, max_new_tokens=16))
    fn = logprob_fn(TrainConfig(top_p=0.9))
    good = check_ratio(model, rows, PAD, fn, 1.0)
    assert good.passed and "stored supports" in good.detail
    # a trainer that scores on the full vocabulary (support ignored) is caught
    full = functools.partial(token_logprobs, top_p=1.0)

    def no_support(m, ids, am, temperature=1.0, keep_index=None, keep_rows=None):
        return full(m, ids, am, temperature)

    assert check_ratio(model, rows, PAD, no_support, 1.0).passed is False
    # the config's top-p is not the sampler's: the recomputed supports disagree
    assert check_ratio(model, rows, PAD, logprob_fn(TrainConfig(top_p=0.5)), 1.0).passed is False
    # the weights are not the behaviour snapshot
    moved = _model(tok)
    _perturb(moved)
    assert check_ratio(moved, rows, PAD, fn, 1.0).passed is False


def test_supports_travel_from_calls_to_rows_to_tensors_and_parquet(tmp_path):
    c1 = ModelCall([1, 2], [4, 9], [-0.1, -0.2], "stop", observation_ids=[7], keep_ids=[[3, 4], [9]])
    c2 = ModelCall([1, 2, 4, 9, 7], [5], [-0.3], "stop")  # sampled on the full vocabulary
    t = Trajectory("p", "g", 0, 0, 0, calls=[c1, c2])
    [row] = trajectory_to_rows(t)
    assert row.input_ids == [1, 2, 4, 9, 7, 5]
    assert row.keep_ids == [None, None, [3, 4], [9], None, None]
    plain = TrainingRow([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0])
    b = pad_rows([plain, row], pad_id=0)
    assert b["keep_index"].tolist() == [[1, 2, 3], [1, 2, 4], [1, 3, 9]] and b["keep_rows"].tolist() == [False, True]
    assert "keep_index" not in pad_rows([plain], pad_id=0)
    path = tmp_path / "iter_0000.parquet"
    write_trajectories(path, [t])
    assert read_trajectories(path)[0].calls[0].keep_ids == [[3, 4], [9]] and read_trajectories(path)[0] == t
    with pytest.raises(ValueError, match="outside its stored support"):
        ModelCall([1], [4], [-0.1], "stop", keep_ids=[[3, 5]])
    with pytest.raises(ValueError, match="one support per sampled token"):
        ModelCall([1], [4, 5], [-0.1, -0.1], "stop", keep_ids=[[4]])

"""Chunked target log-probs and entropy (policy/logprobs.py, token_logprobs) equal the direct
computation (token_logprobs_unchunked, the whole [N, S-1, V] logits) in value and gradient.

A random small Llama (vocabulary 2000, tied and untied head); rows of different lengths
(right padding), loss masks that skip positions, chunk sizes that do not divide the
number of targets; every sampling mode: temperature 1 and ≠ 1, greedy (T = 0), top-k,
top-p, both, and the sampler's stored supports (keep_index / keep_rows), with and
without an entropy gradient. Tolerance: 1e-5 absolute (+ 1e-6 relative for gradients).
"""

from __future__ import annotations

import copy
import functools
import math
from types import SimpleNamespace

import pytest
import torch

from consequence.policy.logprobs import (
    enable_gradient_checkpointing,
    keep_mask,
    lm_head_split,
    process_logits,
    token_logprobs,
    token_logprobs_unchunked,
)

V = 2000
LENGTHS = (13, 9, 5)  # right-padded to 13: 12 + 8 + 4 = 24 real targets
ATOL, RTOL = 1e-5, 1e-6


def _llama(tied: bool, seed: int = 0, scale: float = 4.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        pad_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        m = LlamaForCausalLM(cfg).float().eval()
        with torch.no_grad():  # a peakier head than the init: top-p keeps a few dozen ids, not all 2000
            m.get_output_embeddings().weight.mul_(scale)
    return m


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def model(request):
    return _llama(request.param)


def _sample_batch(model, temperature, top_k, top_p, seed=0):
    """Rows sampled token by token from ``model`` under the processed distribution (so
    targets lie inside their top-k / top-p supports), right-padded; the support of
    every sampled token is stored as keep_index."""
    g = torch.Generator().manual_seed(seed)
    S = max(LENGTHS)
    ids = torch.zeros((len(LENGTHS), S), dtype=torch.long)
    ids[:, 0] = torch.randint(1, V, (len(LENGTHS),), generator=g)
    keep = []
    with torch.no_grad():
        for j in range(1, S):
            logits = model(input_ids=ids[:, :j]).logits[:, -1].float()
            T = temperature or 1.0
            proc = process_logits(logits, T, top_k, top_p)
            ids[:, j] = torch.multinomial(torch.softmax(proc, -1), 1, generator=g).squeeze(1)
            km = keep_mask(logits / T, top_k, top_p)
            if km is not None:
                for i, kept in enumerate(km):
                    if j < LENGTHS[i]:
                        keep += [(i, j, int(t)) for t in kept.nonzero().flatten()]
    am = torch.zeros_like(ids)
    for i, n in enumerate(LENGTHS):
        am[i, :n] = 1
        ids[i, n:] = 0
    keep_index = torch.tensor(keep, dtype=torch.long).reshape(-1, 3)
    return ids, am, keep_index


def _loss_mask(am):
    m = am[:, 1:].clone().float()
    m[0, :3] = 0  # a prompt
    m[1, 5] = 0  # an observation inside the row
    return m


def _run(model, ids, am, chunk_size, entropy_grad=True, **kw):
    """(lp [N,S-1], ent [N,S-1], {param: grad}) of a loss on masked targets + entropy."""
    model.zero_grad(set_to_none=True)
    lp, ent = token_logprobs(model, ids, am, with_entropy=True, entropy_grad=entropy_grad, chunk_size=chunk_size, **kw)
    m = _loss_mask(am) > 0
    w = torch.linspace(-1.0, 1.0, lp.numel()).view_as(lp)
    loss = torch.where(m & torch.isfinite(lp), lp * w, 0.0).sum()
    if entropy_grad:
        loss = loss + 0.1 * torch.where(m, ent, 0.0).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return lp.detach(), ent.detach(), grads


def _assert_same(got, want):
    lp, ent, grads = got
    lp0, ent0, grads0 = want
    torch.testing.assert_close(lp, lp0, atol=ATOL, rtol=0)  # -inf (outside the support) must match too
    torch.testing.assert_close(ent, ent0, atol=ATOL, rtol=0)
    assert grads.keys() == grads0.keys() and grads0
    for n in grads0:
        torch.testing.assert_close(grads[n], grads0[n], atol=ATOL, rtol=RTOL, msg=n)


MODES = {
    "T1": dict(temperature=1.0),
    "T0.7": dict(temperature=0.7),
    "greedy": dict(temperature=0.0, top_p=0.5),  # T = 0: the raw distribution, filters ignored
    "top_k": dict(temperature=1.0, top_k=50),
    "top_p": dict(temperature=0.8, top_p=0.9),
    "top_k_top_p": dict(temperature=1.2, top_k=40, top_p=0.8),
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_chunked_equals_unchunked_in_every_mode(model, mode):
    kw = MODES[mode]
    ids, am, _ = _sample_batch(model, kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0))
    want = _run(model, ids, am, 0, **kw)
    lp0 = want[0]
    assert torch.isfinite(lp0).all()  # sampled under the same processing: every target in its support
    assert (lp0[am[:, 1:] == 0] == 0).all() and (lp0[am[:, 1:] > 0] < 0).all()
    for chunk in (5, 7, 24, 1000):  # 24 targets: chunks that do not divide it, one chunk, a single oversize one
        _assert_same(_run(model, ids, am, chunk, **kw), want)
    _assert_same(_run(model, ids, am, None, **kw), want)  # the default


def test_greedy_and_t1_are_the_plain_log_softmax(model):
    """Direct computation by hand: log_softmax of the model's logits, gathered."""
    ids, am, _ = _sample_batch(model, 1.0, 0, 1.0)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=am).logits[:, :-1].float(), -1)
        want = logp.gather(-1, ids[:, 1:, None]).squeeze(-1) * am[:, 1:]
        want_ent = -(logp.exp() * logp).sum(-1) * am[:, 1:]
        for T in (0.0, 1.0):
            lp, ent = token_logprobs(model, ids, am, T, with_entropy=True, chunk_size=7)
            torch.testing.assert_close(lp, want, atol=ATOL, rtol=0)
            torch.testing.assert_close(ent, want_ent, atol=ATOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 0.9), (0.7, 30, 1.0), (1.3, 40, 0.8)])
def test_stored_supports_chunked_equal_unchunked_and_by_hand(model, temperature, top_k, top_p):
    """Supports stored by a behaviour model, scored by moved weights (keep_index); row 1
    has no stored supports (keep_rows False): top-k / top-p of the current logits."""
    behaviour = _llama(tied=model.config.tie_word_embeddings, seed=1)
    ids, am, keep_index = _sample_batch(behaviour, temperature, top_k, top_p)
    keep_index = keep_index[keep_index[:, 0] != 1]
    keep_index = keep_index[(keep_index[:, 0] != 0) | (keep_index[:, 1] != 4)]  # a target without support
    keep_rows = torch.tensor([True, False, True])
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, keep_index=keep_index, keep_rows=keep_rows)
    want = _run(model, ids, am, 0, **kw)
    for chunk in (5, 7, 1000):
        _assert_same(_run(model, ids, am, chunk, **kw), want)
    lp = token_logprobs(model, ids, am, chunk_size=5, **kw)[0]
    # by hand: log-softmax of the current logits / T over the stored support
    with torch.no_grad():
        z = model(input_ids=ids, attention_mask=am).logits[:, :-1].float() / temperature
    for i, j in [(0, 3), (2, 2), (0, 11)]:
        sup = keep_index[(keep_index[:, 0] == i) & (keep_index[:, 1] == j), 2]
        zz = z[i, j - 1, sup]
        hand = float(zz[(sup == ids[i, j]).nonzero()[0, 0]] - torch.logsumexp(zz, 0))
        assert lp[i, j - 1].item() == pytest.approx(hand, abs=ATOL)
    # row 0, target 4 has no stored support: the full vocabulary at T
    assert lp[0, 3].item() == pytest.approx(float(torch.log_softmax(z[0, 3], -1)[ids[0, 4]]), abs=ATOL)


@pytest.mark.slow
def test_entropy_without_gradient_and_no_grad_path(model):
    ids, am, _ = _sample_batch(model, 0.8, 0, 0.9)
    want = _run(model, ids, am, 0, entropy_grad=False, temperature=0.8, top_p=0.9)
    got = _run(model, ids, am, 7, entropy_grad=False, temperature=0.8, top_p=0.9)
    _assert_same(got, want)
    lp, ent = token_logprobs(model, ids, am, 0.8, top_p=0.9, with_entropy=True, chunk_size=7)
    assert lp.requires_grad and not ent.requires_grad
    with torch.no_grad():  # compute_logprobs: no checkpointing, same values
        lp_n, ent_n = token_logprobs(model, ids, am, 0.8, top_p=0.9, with_entropy=True, chunk_size=5)
        assert token_logprobs(model, ids, am, 0.8, top_p=0.9, chunk_size=5)[1] is None
    torch.testing.assert_close(lp_n, want[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(ent_n, want[1], atol=ATOL, rtol=0)


def test_trunk_head_split_tied_and_untied():
    for tied in (True, False):
        m = _llama(tied)
        trunk, head = lm_head_split(m)
        assert trunk is m.model and head is m.lm_head
        assert (head.weight is m.model.embed_tokens.weight) == tied
    assert lm_head_split(TinyLM()) is None  # not a Hugging Face causal LM: run whole


class TinyLM(torch.nn.Module):
    """A model that is not a Hugging Face causal LM: ``.logits`` only, fp16 logits."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Embedding(V, 8)
        self.head = torch.nn.Linear(8, V)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, input_ids, attention_mask=None):
        h = torch.tanh(self.emb(input_ids).cumsum(1))
        return SimpleNamespace(logits=self.head(h).half())


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_k=50, top_p=0.9)])
def test_model_without_split_chunks_its_processing(kw):
    m = TinyLM()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, V, (3, 13), generator=g)
    am = torch.ones_like(ids)
    am[1, 9:] = am[2, 5:] = 0
    _assert_same(_run(m, ids, am, 7, **kw), _run(m, ids, am, 0, **kw))


@pytest.mark.slow
def test_errors_and_edge_cases(model):
    ids, am, keep_index = _sample_batch(model, 1.0, 0, 0.9)
    for bad in (
        torch.tensor([[0, 0, 1]]),
        torch.tensor([[0, 13, 1]]),
        torch.tensor([[3, 2, 1]]),
        torch.tensor([[0, 2, V]]),
    ):
        with pytest.raises(ValueError, match="keep_index names a position"):
            token_logprobs(model, ids, am, keep_index=bad, chunk_size=5)
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(model, ids, am, chunk_size=-1)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(model, ids, am, temperature=-1.0)
    # rows of one token: no target at all; shapes and the graph as unchunked
    one = torch.tensor([[5], [7]])
    lp, ent = token_logprobs(model, one, torch.ones_like(one), with_entropy=True, entropy_grad=True, chunk_size=4)
    lp0, ent0 = token_logprobs_unchunked(model, one, torch.ones_like(one), with_entropy=True, entropy_grad=True)
    assert lp.shape == lp0.shape == ent.shape == (2, 0) and lp.requires_grad and ent.requires_grad
    # every target padded but the first row's: still equal
    am2 = am.clone()
    am2[1:, 1:] = 0
    _assert_same(_run(model, ids, am2, 5, temperature=0.9), _run(model, ids, am2, 0, temperature=0.9))


def _count_attention_calls(model):
    calls = {"n": 0}

    def hook(*_):
        calls["n"] += 1

    handle = model.model.layers[0].self_attn.register_forward_hook(hook)
    return calls, handle


@pytest.mark.slow
def test_gradient_checkpointing_same_values_and_layers_recomputed(model):
    ids, am, keep_index = _sample_batch(model, 0.8, 0, 0.9)
    kw = dict(temperature=0.8, top_p=0.9, keep_index=keep_index)
    want = _run(model, ids, am, 0, **kw)
    ckpt = copy.deepcopy(model)
    enable_gradient_checkpointing(ckpt)
    assert getattr(ckpt, "is_activation_checkpointing", None) or ckpt.is_gradient_checkpointing
    assert ckpt.training
    calls, handle = _count_attention_calls(ckpt)
    got = _run(ckpt, ids, am, 7, **kw)
    handle.remove()
    assert calls["n"] == 2  # forward, then again in the backward: the layer's activations were not stored
    _assert_same(got, want)
    calls, handle = _count_attention_calls(model)
    _run(model, ids, am, 7, **kw)
    handle.remove()
    assert calls["n"] == 1  # without the option: stored
    with pytest.raises(ValueError, match="gradient_checkpointing"):
        enable_gradient_checkpointing(TinyLM())


@pytest.mark.slow
def test_ppo_step_gradient_unchanged_by_chunking():
    """The trainer's path (accumulate_gradients, micro-batches, stored supports)."""
    from consequence.records import TrainingRow
    from consequence.update.step import UpdateConfig, accumulate_gradients

    model = _llama(tied=True)
    ids, am, keep_index = _sample_batch(model, 0.9, 0, 0.9)
    with torch.no_grad():
        lp, _ = token_logprobs_unchunked(model, ids, am, 0.9, top_p=0.9, keep_index=keep_index)
    rows = []
    for i, n in enumerate(LENGTHS):
        mask = [0, 0] + [1] * (n - 2)
        keep = [None] * n
        for r, j, t in keep_index.tolist():
            if r == i:
                keep[j] = (keep[j] or []) + [t]
        old = [0.0] + [float(x) - 0.05 * (k % 3) for k, x in enumerate(lp[i, : n - 1])]
        rows.append(
            TrainingRow(
                ids[i, :n].tolist(), mask, [o if m else 0.0 for o, m in zip(old, mask)], traj_index=i, keep_ids=keep
            )
        )
    cfg = UpdateConfig(micro_batch_size=2, temperature=0.9, entropy_coef=0.01)
    grads = []
    for chunk in (0, 5):
        fn = functools.partial(token_logprobs, with_entropy=True, entropy_grad=True, top_p=0.9, chunk_size=chunk)
        model.zero_grad(set_to_none=True)
        met = accumulate_gradients(model, rows, [1.0, -0.5, 2.0], cfg, 0, fn)
        assert math.isfinite(met["loss"]) and met["n_tokens"] == sum(n - 2 for n in LENGTHS)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=ATOL, rtol=RTOL, msg=n)
    assert any(float(g.abs().max()) > 1e-3 for g in grads[0].values())


def test_make_learner_turns_on_gradient_checkpointing_for_the_policy_only():
    from consequence.config import TrainConfig
    from consequence.loop.learner import make_learner

    def on(m):
        return any(getattr(mod, "gradient_checkpointing", False) for mod in m.modules())

    model = _llama(tied=True)
    make_learner(TrainConfig(), model)
    assert not on(model) and not model.training  # default off: the model is left as it was
    learner = make_learner(TrainConfig(gradient_checkpointing=True, kl_coef=0.1), model)
    assert on(learner.model) and learner.model.training
    assert not on(learner.reference) and not learner.reference.training


def test_default_chunks_only_when_the_full_logits_are_large(monkeypatch):
    """chunk_size=None: the direct computation, bit for bit, while the real targets' logits
    fit AUTO_CHUNK_BYTES (the tiny policy's runs do not change); chunked above it."""
    import consequence.policy.logprobs as L

    model = _llama(tied=True)
    ids, am, _ = _sample_batch(model, 1.0, 0, 1.0)
    with torch.no_grad():
        want = token_logprobs_unchunked(model, ids, am, with_entropy=True)
        small = token_logprobs(model, ids, am, with_entropy=True)
        assert torch.equal(small[0], want[0]) and torch.equal(small[1], want[1])
        assert L.auto_chunk_size(model, ids, am) == 0
        monkeypatch.setattr(L, "AUTO_CHUNK_BYTES", 24 * V * 4 - 1)  # 24 real targets × V × 4 bytes
        assert L.auto_chunk_size(model, ids, am) == L.DEFAULT_CHUNK_SIZE
        big = token_logprobs(model, ids, am, with_entropy=True)
    torch.testing.assert_close(big[0], want[0], atol=ATOL, rtol=0)


def test_target_mask_computes_only_the_loss_positions(model):
    """target_mask (the loss mask): the same log-probs and entropy there, 0 elsewhere."""
    ids, am, _ = _sample_batch(model, 1.0, 0, 1.0)
    tm = _loss_mask(am) > 0
    with torch.no_grad():
        want_lp, want_ent = token_logprobs_unchunked(model, ids, am, 0.9, with_entropy=True)
        lp, ent = token_logprobs(model, ids, am, 0.9, with_entropy=True, chunk_size=5, target_mask=tm)
    torch.testing.assert_close(lp[tm], want_lp[tm], atol=ATOL, rtol=0)
    torch.testing.assert_close(ent[tm], want_ent[tm], atol=ATOL, rtol=0)
    assert bool((lp[~tm] == 0).all()) and bool((ent[~tm] == 0).all())
    assert int(tm.sum()) < int(am[:, 1:].sum())  # some real targets were left out

"""Padding-free packing (policy/packing.py, ``--packing``): rows of very uneven length run as one
packed sequence give the padded batch's log-probs, entropies, loss and gradients, and a row's
log-probs do not depend on the rows packed beside it.

A random small Llama (2 layers, float32). Tolerances: the issue's 1e-5, checked against the
float32 rounding actually present — a float64 copy of the same model gives the exact values,
and the packed float32 result may differ from them by at most a few times what the padded
float32 result does (both are the same sums in another order)."""

from __future__ import annotations

import functools

import pytest
import torch

from consequence.policy import logprobs as L
from consequence.policy.packing import packed_hidden, packed_positions, packing_refusal
from consequence.records import TrainingRow
from consequence.update.step import UpdateConfig, ppo_step

V = 300
LENGTHS = (7, 61, 3, 40, 25)  # very uneven: padded, the batch is 5 × 61 = 305 positions for 136 tokens


def _llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(cfg).float()


def _batch(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = max(lengths)
    ids = torch.randint(1, V, (len(lengths), S), generator=g)
    am = torch.ones_like(ids)
    for i, n in enumerate(lengths):
        ids[i, n:], am[i, n:] = 0, 0
    return ids, am


def test_positions_restart_at_each_row():
    assert packed_positions(torch.tensor([2, 3, 1])).tolist() == [0, 1, 0, 1, 2, 0]


def test_packed_hidden_states_equal_the_padded_ones_at_every_real_position():
    model = _llama()
    ids, am = _batch()
    with torch.no_grad():
        padded = model.model(input_ids=ids, attention_mask=am, use_cache=False).last_hidden_state
        packed = packed_hidden(model.model, ids, am)
        exact = model.double().model(input_ids=ids, attention_mask=am, use_cache=False).last_hidden_state
    real = am.bool()
    assert (packed[~real] == 0).all()
    rounding = (padded[real].double() - exact[real]).abs().max().item()
    err = (packed[real].double() - exact[real]).abs().max().item()
    assert err <= max(8 * rounding, 1e-6) and err <= 1e-5, (err, rounding)
    # without the block-diagonal mask, row 1 would see row 0's tokens: a negative control
    leaked = model.float().model(input_ids=ids[am.bool()][None], use_cache=False).last_hidden_state[0]
    assert (leaked[LENGTHS[0] : LENGTHS[0] + LENGTHS[1]] - padded[1, : LENGTHS[1]]).abs().max() > 1e-2


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (20, 0.9)])
def test_logprobs_entropy_and_gradients_equal_the_padded_batch(top_k, top_p):
    model = _llama()
    ids, am = _batch()
    target = am[:, 1:].bool()
    grads = {}
    out = {}
    for packing in (False, True):
        model.zero_grad()
        lp, ent = L.token_logprobs(
            model, ids, am, 0.8, top_k, top_p, with_entropy=True, entropy_grad=True, chunk_size=16, packing=packing
        )
        (lp[target].sum() + 0.1 * ent[target].sum()).backward()
        out[packing] = (lp.detach(), ent.detach())
        grads[packing] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for a, b in zip(out[True], out[False]):
        torch.testing.assert_close(a[target], b[target], atol=1e-5, rtol=0)
        assert (a[~target] == 0).all()
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_a_rows_logprobs_do_not_depend_on_its_neighbours():
    model = _llama()
    ids, am = _batch()
    with torch.no_grad():
        alone = L.token_logprobs(model, ids[1:2, : LENGTHS[1]], am[1:2, : LENGTHS[1]], chunk_size=0)[0]
        beside = L.token_logprobs(model, ids, am, chunk_size=0, packing=True)[0]
        others = torch.cat([ids[:1], ids[1:2], ids[3:]]), torch.cat([am[:1], am[1:2], am[3:]])
        beside_others = L.token_logprobs(model, *others, chunk_size=0, packing=True)[0]
    n = LENGTHS[1] - 1
    torch.testing.assert_close(beside[1, :n], alone[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(beside_others[1, :n], alone[0], atol=1e-5, rtol=0)


def _rows(ids, am):
    rows = []
    for i in range(ids.shape[0]):
        n = int(am[i].sum())
        seq = ids[i, :n].tolist()
        mask = [0] * 2 + [1] * (n - 2)  # a 2-token prompt, then sampled targets
        rows.append(TrainingRow(input_ids=seq, loss_mask=mask, old_logprobs=[0.0] * n, traj_index=i))
    return rows


def test_a_ppo_step_with_packing_is_the_padded_step():
    ids, am = _batch()
    rows = _rows(ids, am)
    with torch.no_grad():  # π_old = π: the recorded log-probs are the model's own
        lp, _ = L.token_logprobs(_llama(), ids, am, chunk_size=0)
    for i, r in enumerate(rows):
        r.old_logprobs = [0.0] + lp[i, : len(r.input_ids) - 1].tolist()
    cfg = UpdateConfig(micro_batch_size=2, reduction="token_mean")
    adv = [[0.0] * len(r.input_ids) for r in rows]
    for i, a in enumerate(adv):
        a[:] = [(-1.0) ** i * (1 + i / 4)] * len(a)
    got = {}
    for packing in (False, True):
        model = _llama()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        fn = functools.partial(L.token_logprobs, with_entropy=True, packing=packing)
        metrics = ppo_step(model, opt, rows, adv, cfg, 0, fn)
        got[packing] = (metrics, {n: p.detach().clone() for n, p in model.named_parameters()})
    for key in ("loss", "grad_norm", "entropy", "ratio_mean"):
        assert got[True][0][key] == pytest.approx(got[False][0][key], rel=1e-5, abs=1e-7), key
    for name, w in got[False][1].items():
        torch.testing.assert_close(got[True][1][name], w, atol=1e-6, rtol=1e-5, msg=name)


def test_a_model_that_cannot_be_packed_is_refused_with_the_reason():
    class NoTrunk(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None):
            raise AssertionError("never called")

    assert "not a plain-head" in packing_refusal(NoTrunk(), L.lm_head_split(NoTrunk()))
    model = _llama()
    assert packing_refusal(model, L.lm_head_split(model)) is None
    model.config._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in packing_refusal(model, L.lm_head_split(model))
    ids, am = _batch()
    with pytest.raises(ValueError, match="--packing: .*train without --packing"):
        L.token_logprobs(NoTrunk(), ids, am, packing=True)
    with pytest.raises(ValueError, match="not right-padded"):
        packed_hidden(_llama().model, ids.flip(1), am.flip(1))


def test_settings_packing_cannot_serve_are_refused():
    from consequence.config import TrainConfig

    assert TrainConfig(packing=True).packing
    with pytest.raises(ValueError, match="--packing with --update-strategy fsdp is not supported"):
        TrainConfig(packing=True, update_ranks=2, update_strategy="fsdp")
    assert TrainConfig(packing=True, update_ranks=2).packing  # DDP replicas pack their own micro-batches

"""Surrogates, regularisers and the step built from them (docs/design.md §5, issue 3)."""

import math

import pytest
import torch

from consequence.credit.advantages import group_advantages
from consequence.update.losses import REDUCTIONS, reduce_tokens
from consequence.update.regularizers import kl_estimate, offpolicy_sequence_mask, tis_weights
from consequence.update.step import UpdateConfig, accumulate_gradients, compute_logprobs
from consequence.update.surrogates import SURROGATES, surrogate_objective
from tiny_lm import PAD, TinyLM, grads_of, make_rows, ref_logprobs


def _lp(values):
    return torch.tensor([values], dtype=torch.float64, requires_grad=True)


def test_gspo_ratio_is_exponentiated_mean_log_ratio():
    lp = _lp([-1.0, -2.0, -0.5, -3.0])
    old = torch.tensor([[-1.2, -1.9, -0.9, -9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    obj, ratio, clipped = surrogate_objective("gspo", lp, old, torch.tensor([1.0]), mask, eps_low=0.5, eps_high=0.5)
    s = math.exp((0.2 - 0.1 + 0.4) / 3)  # the masked-out 4th token does not count
    assert ratio[0, :3].tolist() == pytest.approx([s] * 3)
    assert obj[0, :3].tolist() == pytest.approx([s] * 3) and not clipped.any()
    # d s / d lp_t = s / L for every target token
    reduce_tokens(obj, mask, "seq_mean_token_mean").backward()
    assert lp.grad[0].tolist() == pytest.approx([s / 3] * 3 + [0.0])


def test_gspo_clips_the_sequence_ratio():
    lp, old = _lp([0.0, 0.0]), torch.tensor([[-0.1, -0.1]], dtype=torch.float64)
    obj, ratio, clipped = surrogate_objective(
        "gspo", lp, old, torch.tensor([1.0]), torch.ones(1, 2), eps_low=3e-4, eps_high=4e-4
    )
    assert ratio[0, 0].item() == pytest.approx(math.exp(0.1))
    assert clipped.all() and obj[0].tolist() == pytest.approx([1.0004, 1.0004])


def test_gspo_token_equals_gspo_in_value_and_gradient():
    torch.manual_seed(0)
    base = torch.randn(3, 5, dtype=torch.float64) * 0.02
    old = torch.randn(3, 5, dtype=torch.float64) * 0.02
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0]])
    adv = torch.tensor([1.0, -0.5, 2.0])
    out = {}
    for name in ("gspo", "gspo_token"):
        lp = base.clone().requires_grad_(True)
        obj, _, _ = surrogate_objective(name, lp, old, adv, mask, eps_low=0.05, eps_high=0.05)
        reduce_tokens(obj, mask, "seq_mean_token_mean").backward()
        out[name] = (torch.where(mask > 0, obj, 0).detach(), lp.grad)
    assert torch.allclose(out["gspo"][0], out["gspo_token"][0])
    assert torch.allclose(out["gspo"][1], out["gspo_token"][1])


def test_cispo_gradient_flows_only_through_logprob():
    # ρ = e^0.5 ≈ 1.65 > 1.28: the weight is clipped to 1.28, yet the token keeps a gradient
    lp, old = _lp([-1.0]), torch.tensor([[-1.5]], dtype=torch.float64)
    obj, ratio, clipped = surrogate_objective(
        "cispo", lp, old, torch.tensor([2.0]), torch.ones(1, 1), eps_low=1.0, eps_high=0.28
    )
    assert clipped.item() and obj.item() == pytest.approx(1.28 * 2.0 * -1.0)
    obj.sum().backward()
    assert lp.grad.item() == pytest.approx(1.28 * 2.0)  # w·A, with w detached
    ppo_lp = _lp([-1.0])
    ppo, _, _ = surrogate_objective("ppo_clip", ppo_lp, old, torch.tensor([2.0]), torch.ones(1, 1))
    ppo.sum().backward()
    assert ppo_lp.grad.item() == 0.0  # PPO drops the same token


def test_dual_clip_bounds_negative_advantages():
    A = torch.tensor([-1.0])
    lp, old = _lp([math.log(4.0)]), torch.zeros(1, 1, dtype=torch.float64)
    obj, _, clipped = surrogate_objective("dual_clip", lp, old, A, torch.ones(1, 1), dual_clip_c=3.0)
    assert obj.item() == pytest.approx(-3.0) and clipped.item()
    obj.sum().backward()
    assert lp.grad.item() == 0.0
    lp2 = _lp([math.log(2.0)])
    obj2, _, clipped2 = surrogate_objective("dual_clip", lp2, old, A, torch.ones(1, 1), dual_clip_c=3.0)
    assert obj2.item() == pytest.approx(-2.0) and not clipped2.item()  # above c·A: plain PPO


def test_pg_is_advantage_times_logprob():
    lp = _lp([-1.0, -2.0])
    obj, ratio, clipped = surrogate_objective("pg", lp, lp.detach(), torch.tensor([3.0]), torch.ones(1, 2))
    assert obj[0].tolist() == [-3.0, -6.0] and ratio[0].tolist() == [1.0, 1.0] and not clipped.any()


def test_nan_free_with_minus_inf_outside_targets():
    lp = torch.tensor([[float("-inf"), -1.0]], requires_grad=True)
    old = torch.tensor([[float("-inf"), -1.1]])
    mask = torch.tensor([[0, 1]])
    for name in SURROGATES:
        obj, _, _ = surrogate_objective(name, lp, old, torch.tensor([1.0]), mask)
        reduce_tokens(obj, mask, "token_mean").backward()
        assert torch.isfinite(lp.grad).all(), name
        lp.grad = None


def test_kl_estimators_reference_values():
    lp, ref = torch.tensor([[0.5, 0.0]]), torch.tensor([[0.0, 0.0]])
    assert kl_estimate(lp, ref, "k1")[0].tolist() == pytest.approx([0.5, 0.0])
    assert kl_estimate(lp, ref, "k2")[0].tolist() == pytest.approx([0.125, 0.0])
    assert kl_estimate(lp, ref, "k3")[0].tolist() == pytest.approx([math.exp(-0.5) - 1 + 0.5, 0.0])
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(lp, ref, "k4")


def test_tis_weights_are_capped_and_carry_no_gradient():
    old = torch.tensor([[math.log(0.9), math.log(0.3)]], requires_grad=True)
    mu = torch.tensor([[math.log(0.3), math.log(0.6)]])
    w = tis_weights(old, mu, cap=2.0)
    assert w[0].tolist() == pytest.approx([2.0, 0.5]) and not w.requires_grad
    with pytest.raises(ValueError, match="positive"):
        tis_weights(old, mu, cap=0.0)


def test_offpolicy_mask_drops_only_negative_far_rows():
    lp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    mu = torch.tensor([[-0.2, -0.2], [-0.2, -0.2], [-1.0, -1.0]])  # KL(μ‖π) ≈ 0.8, 0.8, 0
    drop = offpolicy_sequence_mask(lp, mu, torch.tensor([-1.0, 1.0, -1.0]), torch.ones(3, 2), delta=0.5)
    assert drop.tolist() == [True, False, False]


# ---- the step: every surrogate and reduction, split or not ---------------------------------
CONFIGS = [dict(surrogate=s) for s in SURROGATES] + [
    dict(surrogate="ppo_clip", tis_cap=1.5),
    dict(surrogate="ppo_clip", kl_coef=0.1, kl_estimator="k3"),
    dict(surrogate="cispo", entropy_coef=0.01),
]


def _extras(model, rows, cfg):
    g = torch.Generator().manual_seed(7)
    kw = {}
    if cfg.get("kl_coef"):
        kw["ref_logprobs"] = [[x + 0.1 * float(torch.randn(1, generator=g)) for x in r.old_logprobs] for r in rows]
    if cfg.get("tis_cap"):
        kw["sampler_logprobs"] = [[x + 0.4 * float(torch.randn(1, generator=g)) for x in r.old_logprobs] for r in rows]
    return kw


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("extra", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_uneven_micro_batches_give_the_unsplit_gradient(reduction, extra):
    model = TinyLM()
    rows = make_rows(model, [3, 1, 6, 2, 5, 4, 7], perturb=0.3, seed=1)
    adv = [1.0, -0.5, 0.3, -1.2, 0.8, 0.0, -0.4]
    kw = _extras(model, rows, extra)

    def grads(mbs):
        model.zero_grad(set_to_none=True)
        cfg = UpdateConfig(reduction=reduction, micro_batch_size=mbs, **extra)
        m = accumulate_gradients(model, rows, adv, cfg, PAD, ref_logprobs, **kw)
        g = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return g, m

    whole, m_whole = grads(100)
    assert any(v.abs().sum() > 0 for v in whole.values())
    for mbs in (2, 3, 5):  # 7 rows: uneven last micro-batch
        split, m_split = grads(mbs)
        for n in whole:
            assert torch.allclose(split[n], whole[n], atol=1e-6, rtol=0), (mbs, n)
        assert m_split["loss"] == pytest.approx(m_whole["loss"], abs=1e-6)


def test_per_token_advantages_equal_broadcast_scalars():
    model = TinyLM(2)
    rows = make_rows(model, [3, 4], perturb=0.2, seed=3)
    scalar, _ = grads_of(model, rows, [0.7, -0.4], UpdateConfig(micro_batch_size=1))
    per_tok = [[0.7] * len(rows[0].input_ids), [-0.4] * len(rows[1].input_ids)]
    tok, _ = grads_of(model, rows, per_tok, UpdateConfig(micro_batch_size=1))
    for n in scalar:
        assert torch.allclose(scalar[n], tok[n], atol=1e-7)


@pytest.mark.parametrize("surrogate", SURROGATES)
def test_equal_rewards_give_zero_gradient_for_every_surrogate(surrogate):
    model = TinyLM()
    rows = make_rows(model, [3, 2, 4, 5], perturb=0.3)
    adv = group_advantages([1, 1, 1, 1], ["g"] * 4, "grpo")
    g, _ = grads_of(model, rows, adv, UpdateConfig(surrogate=surrogate, micro_batch_size=3))
    assert all(torch.equal(v, torch.zeros_like(v)) for v in g.values())


def test_needed_inputs_are_checked_before_work():
    model = TinyLM()
    rows = make_rows(model, [2])
    with pytest.raises(ValueError, match="ref_logprobs"):
        accumulate_gradients(model, rows, [1.0], UpdateConfig(kl_coef=0.1), PAD, ref_logprobs)
    with pytest.raises(ValueError, match="sampler_logprobs"):
        accumulate_gradients(model, rows, [1.0], UpdateConfig(tis_cap=2.0), PAD, ref_logprobs)
    with pytest.raises(ValueError, match="unknown surrogate"):
        accumulate_gradients(model, rows, [1.0], UpdateConfig(surrogate="trpo"), PAD, ref_logprobs)
    with pytest.raises(ValueError, match="2 per-token advantages"):
        accumulate_gradients(model, rows, [[1.0, 2.0]], UpdateConfig(), PAD, ref_logprobs)


def test_compute_logprobs_reproduces_the_behaviour_logprobs():
    model = TinyLM(5)
    rows = make_rows(model, [3, 6, 1], seed=2)
    got = compute_logprobs(model, rows, PAD, ref_logprobs, micro_batch_size=2)
    for r, lp in zip(rows, got):
        assert len(lp) == len(r.input_ids)
        for o, x, m in zip(r.old_logprobs, lp, r.loss_mask):
            if m:
                assert x == pytest.approx(o, abs=1e-6)

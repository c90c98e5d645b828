import math

import pytest
import torch

from consequence.credit.advantages import group_advantages
from consequence.records import TrainingRow, pad_rows
from consequence.update.losses import REDUCTIONS
from consequence.update.step import UpdateConfig, ppo_step
from tiny_lm import PAD, TinyLM, V, grads_of, make_rows, ref_logprobs  # noqa: F401  (re-used by name)


def test_pad_rows():
    rows = [TrainingRow([5, 6, 7], [0, 1, 1], [0.0, -0.5, -0.25]), TrainingRow([3, 4], [0, 1], [0.0, -1.0])]
    b = pad_rows(rows, pad_id=9)
    assert b["input_ids"].tolist() == [[5, 6, 7], [3, 4, 9]]
    assert b["input_ids"].dtype == torch.long
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert b["loss_mask"].tolist() == [[0, 1, 1], [0, 1, 0]] and b["loss_mask"].dtype == torch.float32
    assert b["old_logprobs"].tolist() == [[0.0, -0.5, -0.25], [0.0, -1.0, 0.0]]
    with pytest.raises(ValueError):
        pad_rows([], 0)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_split_gradient_equals_unsplit(reduction):
    model = TinyLM()
    lengths = [3, 1, 6, 2, 5, 4, 7]
    rows = make_rows(model, lengths, perturb=0.3, seed=1)  # ratios != 1, some clipped
    rows.append(TrainingRow([4, 5, 6], [0, 0, 0], [0.0, 0.0, 0.0], traj_index=99))  # no targets
    adv = [1.0, -0.5, 0.3, -1.2, 0.8, 0.0, -0.4, 2.0]
    whole, m_whole = grads_of(model, rows, adv, UpdateConfig(reduction=reduction, micro_batch_size=100))
    assert m_whole["clip_frac_low"] + m_whole["clip_frac_high"] > 0  # clipping exercised
    assert any(v.abs().sum() > 0 for v in whole.values())
    for mbs in (1, 2, 3, 5):
        split, m_split = grads_of(model, rows, adv, UpdateConfig(reduction=reduction, micro_batch_size=mbs))
        for n in whole:
            assert torch.allclose(split[n], whole[n], atol=1e-6, rtol=0), (reduction, mbs, n)
        assert m_split["loss"] == pytest.approx(m_whole["loss"], abs=1e-6)
        # the row with advantage 0 (length 4) is counted in the totals but not run
        assert m_split["n_tokens"] == m_whole["n_tokens"] == sum(lengths) - 4
        assert m_split["rows_skipped_zero_advantage"] == 1.0


def test_split_gradient_matches_direct_unsplit_computation():
    """Independent check: token_mean loss computed by hand over the padded batch."""
    model = TinyLM(3)
    rows = make_rows(model, [2, 5, 3], perturb=0.2, seed=4)
    adv = [0.7, -1.1, 0.4]
    got, _ = grads_of(model, rows, adv, UpdateConfig(micro_batch_size=1))
    b = pad_rows(rows, PAD)
    lp, _ = ref_logprobs(model, b["input_ids"], b["attention_mask"])
    m = b["loss_mask"][:, 1:]
    ratio = torch.exp(lp - b["old_logprobs"][:, 1:])
    A = torch.tensor(adv)[:, None]
    obj = torch.minimum(ratio * A, torch.clamp(ratio, 0.8, 1.2) * A)
    loss = -(obj * m).sum() / m.sum()
    model.zero_grad()
    loss.backward()
    for n, p in model.named_parameters():
        assert torch.allclose(got[n], p.grad, atol=1e-6), n


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_skipping_zero_advantage_rows_keeps_the_gradient(reduction):
    """Direct computation over ALL rows (zero-advantage ones in every denominator)."""
    model = TinyLM(3)
    rows = make_rows(model, [2, 5, 3, 4], perturb=0.2, seed=4)
    adv = [0.7, 0.0, -1.1, 0.0]
    got, m = grads_of(model, rows, adv, UpdateConfig(reduction=reduction, micro_batch_size=2))
    assert m["rows_skipped_zero_advantage"] == 2.0
    b = pad_rows(rows, PAD)
    lp, _ = ref_logprobs(model, b["input_ids"], b["attention_mask"])
    mask = b["loss_mask"][:, 1:]
    ratio = torch.exp(lp - b["old_logprobs"][:, 1:])
    A = torch.tensor(adv)[:, None]
    obj = torch.minimum(ratio * A, torch.clamp(ratio, 0.8, 1.2) * A) * mask
    L = mask.sum(-1)
    if reduction == "token_mean":
        loss = -obj.sum() / L.sum()
    elif reduction == "seq_mean_token_mean":
        loss = -(obj.sum(-1) / L).sum() / 4
    else:
        loss = -obj.sum() / (L.max() * 4)
    model.zero_grad()
    loss.backward()
    for n, p in model.named_parameters():
        assert torch.allclose(got[n], p.grad, atol=1e-6), n


def test_equal_rewards_give_exactly_zero_gradient():
    model = TinyLM()
    rows = make_rows(model, [3, 2, 4, 5], perturb=0.3)
    adv = group_advantages([1, 1, 1, 1], ["g"] * 4, "grpo")
    assert adv == [0.0] * 4
    for red in REDUCTIONS:
        g, _ = grads_of(model, rows, adv, UpdateConfig(reduction=red, micro_batch_size=3))
        assert all(torch.equal(v, torch.zeros_like(v)) for v in g.values())


def test_reference_losses_through_ppo_step():
    """Rewards (1,0,0,0), target lengths (2,4,4,6), rho = 1 (docs/design.md §8); loss = -objective."""
    adv = group_advantages([1, 0, 0, 0], ["g"] * 4, "grpo")
    expected = {
        "seq_mean_token_mean": 0.0,
        "token_mean": 1 / (2 * math.sqrt(3)),
        "seq_mean_token_sum_norm": 1 / (3 * math.sqrt(3)),
    }
    for red, want in expected.items():
        model = TinyLM()
        rows = make_rows(model, [2, 4, 4, 6])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        before = [p.detach().clone() for p in model.parameters()]
        m = ppo_step(
            model, opt, rows, adv, UpdateConfig(reduction=red, micro_batch_size=3, norm_const=6), PAD, ref_logprobs
        )
        assert m["loss"] == pytest.approx(want, abs=1e-5), red
        assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
        assert m["ratio_min"] == pytest.approx(1.0, abs=1e-5) and m["ratio_max"] == pytest.approx(1.0, abs=1e-5)
        assert m["clip_frac_low"] == 0.0 and m["clip_frac_high"] == 0.0
        assert m["n_tokens"] == 16 and m["n_rows"] == 4
        assert m["entropy"] > 0 and m["grad_norm"] > 0
        assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        assert all(p.grad is None for p in model.parameters())


def test_temperature_is_passed_to_logprob_fn():
    model = TinyLM()
    rows = make_rows(model, [3, 4], temperature=0.5)
    g, m = grads_of(model, rows, [1.0, -1.0], UpdateConfig(temperature=0.5))
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    _, m1 = grads_of(model, rows, [1.0, -1.0], UpdateConfig(temperature=1.0))
    assert abs(m1["ratio_mean"] - 1.0) > 1e-3  # negative control: wrong temperature


def test_grad_norm_clipped():
    model = TinyLM()
    rows = make_rows(model, [3, 4, 5], perturb=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    m = ppo_step(model, opt, rows, [3.0, -2.0, 1.0], UpdateConfig(max_grad_norm=1e-3), PAD, ref_logprobs)
    step = torch.sqrt(sum(((p.detach() - b) ** 2).sum() for p, b in zip(model.parameters(), before)))
    assert m["grad_norm"] > 1e-3
    assert step.item() == pytest.approx(1e-3, rel=1e-3)


def test_nonfinite_loss_raises_and_does_not_step():
    model = TinyLM()
    rows = make_rows(model, [3, 4])
    rows[1].old_logprobs[-1] = -math.inf  # ratio = inf, A < 0 -> loss inf
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(FloatingPointError, match=r"ratio is not finite in row\(s\) \[1\]"):
        ppo_step(model, opt, rows, [1.0, -1.0], UpdateConfig(micro_batch_size=1), PAD, ref_logprobs)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())


def test_nonfinite_logprobs_raise():
    model = TinyLM()
    rows = make_rows(model, [3])
    with torch.no_grad():
        model.head.bias[0] = float("nan")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(FloatingPointError, match="logprobs"):
        ppo_step(model, opt, rows, [1.0], UpdateConfig(), PAD, ref_logprobs)


def test_input_errors_and_logprob_fn_without_entropy():
    model = TinyLM()
    rows = make_rows(model, [3, 2])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="env_error"):
        ppo_step(model, opt, rows, [1.0, None], UpdateConfig(), PAD, ref_logprobs)
    with pytest.raises(ValueError):
        ppo_step(model, opt, rows, [1.0], UpdateConfig(), PAD, ref_logprobs)
    with pytest.raises(ValueError, match="position 0"):
        ppo_step(model, opt, [TrainingRow([1, 2], [1, 1], [-1.0, -1.0])], [1.0], UpdateConfig(), PAD, ref_logprobs)
    with pytest.raises(ValueError, match="token_mean"):
        ppo_step(model, opt, rows, [1.0, 1.0], UpdateConfig(reduction="sum"), PAD, ref_logprobs)
    m = ppo_step(model, opt, rows, [1.0, -1.0], UpdateConfig(), PAD, lambda *a, **k: ref_logprobs(*a, **k)[0])
    assert "entropy" not in m and m["n_tokens"] == 5  # no entropy returned: left out, never NaN

import math

import pytest
import torch

from consequence.credit.advantages import group_advantages
from consequence.update.losses import REDUCTIONS, reduce_tokens
from consequence.update.surrogates import clipped_surrogate, policy_gradient_objective

S3 = math.sqrt(3)


def _lp(ratio: float, shape=(1, 1)):
    old = torch.zeros(shape)
    new = torch.full(shape, math.log(ratio), requires_grad=True)
    return new, old


def test_surrogate_reference_values():
    new, old = _lp(1.3, (2, 1))
    adv = torch.tensor([1.732, -0.577])
    obj, ratio, clipped = clipped_surrogate(new, old, adv, 0.2, 0.2)
    assert obj[:, 0].tolist() == pytest.approx([2.078, -0.750], abs=1e-3)
    assert ratio[:, 0].tolist() == pytest.approx([1.3, 1.3])
    assert clipped[:, 0].tolist() == [True, False]


def test_surrogate_equals_min_formula():
    torch.manual_seed(0)
    lp = torch.randn(5, 7) * 0.3
    old = torch.randn(5, 7) * 0.3
    adv = torch.randn(5, 7)
    obj, ratio, _ = clipped_surrogate(lp, old, adv, 0.2, 0.28)
    r = torch.exp(lp - old)
    ref = torch.minimum(r * adv, torch.clamp(r, 0.8, 1.28) * adv)
    assert torch.allclose(obj, ref, atol=1e-7)


def test_clip_direction_positive_advantage_no_grad():
    new, old = _lp(1.3)
    obj, _, clipped = clipped_surrogate(new, old, torch.tensor([1.0]))
    loss = -obj.sum()
    loss.backward()
    assert clipped.item() is True
    assert new.grad.item() == 0.0


def test_clip_direction_negative_advantage_pushes_ratio_down():
    new, old = _lp(1.3)
    obj, _, clipped = clipped_surrogate(new, old, torch.tensor([-1.0]))
    (-obj.sum()).backward()
    assert clipped.item() is False
    # d loss / d logprob = -A * rho = 1.3 > 0: gradient descent lowers logprob, hence rho
    assert new.grad.item() == pytest.approx(1.3)


def test_clip_low_side():
    new, old = _lp(0.7)
    obj, _, clipped = clipped_surrogate(new, old, torch.tensor([-1.0]))
    (-obj.sum()).backward()
    assert clipped.item() is True and new.grad.item() == 0.0 and obj.item() == pytest.approx(-0.8)
    new, old = _lp(0.7)
    obj, _, clipped = clipped_surrogate(new, old, torch.tensor([1.0]))
    (-obj.sum()).backward()
    assert clipped.item() is False and new.grad.item() == pytest.approx(-0.7)


def test_dapo_clip_higher():
    new, old = _lp(1.25)
    obj, _, clipped = clipped_surrogate(new, old, torch.tensor([1.0]), 0.2, 0.28)
    assert clipped.item() is False and obj.item() == pytest.approx(1.25)


def test_policy_gradient_objective():
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]])
    out = policy_gradient_objective(lp, torch.tensor([2.0, -1.0]))
    assert torch.allclose(out, torch.tensor([[-2.0, -4.0], [0.5, 0.1]]))


def _reference_batch():
    adv = group_advantages([1, 0, 0, 0], ["g"] * 4, "grpo")
    lengths = [2, 4, 4, 6]
    T = 6
    mask = torch.zeros(4, T)
    for i, L in enumerate(lengths):
        mask[i, :L] = 1
    lp = torch.zeros(4, T)  # rho = 1
    obj, _, _ = clipped_surrogate(lp, lp.clone(), torch.tensor(adv))
    return obj, mask


def test_reference_losses_sign_convention():
    """loss = -reduce(objective); values of docs/design.md §8."""
    obj, mask = _reference_batch()
    loss = {r: -reduce_tokens(obj, mask, r).item() for r in REDUCTIONS}
    assert loss["seq_mean_token_mean"] == pytest.approx(0.0, abs=1e-6)
    assert loss["token_mean"] == pytest.approx(1 / (2 * S3), abs=1e-5)
    assert loss["token_mean"] == pytest.approx(0.2887, abs=1e-4)
    assert -reduce_tokens(obj, mask, "seq_mean_token_sum_norm", norm_const=6).item() == pytest.approx(
        1 / (3 * S3), abs=1e-5
    )
    assert loss["seq_mean_token_sum_norm"] == pytest.approx(0.1925, abs=1e-4)  # default: max L = 6


def test_case01_token_mean_microbatch():
    a = torch.full((1, 100), 0.5)
    b = torch.full((1, 900), 0.3)
    total = reduce_tokens(a, torch.ones_like(a), "token_mean", total_tokens=1000) + reduce_tokens(
        b, torch.ones_like(b), "token_mean", total_tokens=1000
    )
    assert total.item() == pytest.approx(0.32)
    wrong = (
        reduce_tokens(a, torch.ones_like(a), "token_mean") + reduce_tokens(b, torch.ones_like(b), "token_mean")
    ) / 2
    assert wrong.item() == pytest.approx(0.4)  # what splitting without global totals gives
    # a micro-batch whose only row has no targets adds nothing
    empty = reduce_tokens(torch.full((1, 5), 7.0), torch.zeros(1, 5), "token_mean", total_tokens=1000)
    assert empty.item() == 0.0


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_split_sum_equals_unsplit(reduction):
    torch.manual_seed(1)
    u = torch.randn(5, 8)
    mask = (torch.rand(5, 8) > 0.4).float()
    mask[2] = 0  # a row without targets
    L = mask.sum(-1)
    kw = dict(total_tokens=L.sum().item(), total_seqs=float((L > 0).sum()), norm_const=8.0)
    whole = reduce_tokens(u, mask, reduction, **kw)
    parts = sum(reduce_tokens(u[s], mask[s], reduction, **kw) for s in (slice(0, 2), slice(2, 3), slice(3, 5)))
    assert parts.item() == pytest.approx(whole.item(), abs=1e-6)
    assert reduce_tokens(u, mask, reduction, norm_const=8.0).item() == pytest.approx(whole.item(), abs=1e-6)


def test_masked_nan_ignored_and_errors():
    u = torch.tensor([[1.0, float("nan")]])
    m = torch.tensor([[1.0, 0.0]])
    for r in REDUCTIONS:
        assert reduce_tokens(u, m, r).item() == 1.0
    with pytest.raises(ValueError, match="token_mean"):
        reduce_tokens(u, m, "sum")
    with pytest.raises(ValueError):
        reduce_tokens(u, torch.ones(2, 2), "token_mean")

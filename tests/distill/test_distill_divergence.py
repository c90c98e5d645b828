"""Per-token teacher–student divergences: hand-computed values, limits, and refusals."""

from __future__ import annotations

import math

import pytest
import torch

from consequence.distill.divergence import reverse_kl_advantages, token_divergence

# teacher p = [0.8, 0.2], student q = [0.5, 0.5] (logits = log-probs)
P = torch.log(torch.tensor([[[0.8, 0.2]]]))
Q = torch.log(torch.tensor([[[0.5, 0.5]]]))


def test_divergences_by_hand():
    # KL(p‖q) = 0.8 ln 1.6 + 0.2 ln 0.4; KL(q‖p) = 0.5 ln(5/8) + 0.5 ln 2.5
    assert float(token_divergence(Q, P, "forward")) == pytest.approx(
        0.8 * math.log(1.6) + 0.2 * math.log(0.4), abs=1e-6
    )
    assert float(token_divergence(Q, P, "reverse")) == pytest.approx(0.22314355, abs=1e-6)
    # m = [0.65, 0.35]: 0.5 KL(p‖m) + 0.5 KL(q‖m)
    assert float(token_divergence(Q, P, "jsd", beta=0.5)) == pytest.approx(0.05067184, abs=1e-6)
    # τ = 2: p ∝ √0.8, √0.2 = [2/3, 1/3], q stays uniform
    assert float(token_divergence(Q, P, "forward", temperature=2.0)) == pytest.approx(0.05663301, abs=1e-6)
    assert float(token_divergence(Q, P, "reverse", top_k=1)) == pytest.approx(0.0, abs=1e-7)  # one token: no divergence


def test_jsd_ends_are_forward_and_reverse_and_agree_with_torch_on_a_vocabulary():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 3, 50, generator=g), torch.randn(2, 3, 50, generator=g)
    ref_fwd = torch.nn.functional.kl_div(s.log_softmax(-1), t.log_softmax(-1), log_target=True, reduction="none").sum(
        -1
    )
    assert torch.allclose(token_divergence(s, t, "forward"), ref_fwd, atol=1e-6)
    assert torch.allclose(token_divergence(s, t, "jsd", beta=0.0), ref_fwd, atol=1e-6)
    assert torch.allclose(token_divergence(s, t, "jsd", beta=1.0), token_divergence(s, t, "reverse"), atol=1e-6)
    mid = token_divergence(s, t, "jsd", beta=0.3)
    assert mid.shape == (2, 3) and bool((mid > 0).all()) and bool((mid < math.log(2) + 1e-6).all())  # JSD ≤ ln 2


def test_the_gradient_reaches_the_student_only():
    s = torch.zeros(1, 1, 2, requires_grad=True)
    t = P.clone().requires_grad_(True)
    token_divergence(s, t, "reverse").sum().backward()
    assert s.grad is not None and float(s.grad.abs().sum()) > 0 and t.grad is None


def test_reverse_kl_advantages_by_hand():
    lq = torch.tensor([[-1.0, -2.0, -0.5]])
    lp = torch.tensor([[-0.5, -3.0, -9.0]])
    mask = torch.tensor([[1, 1, 0]])
    adv, m = reverse_kl_advantages(lq, lp, mask)
    assert adv.tolist() == [[0.5, -1.0, 0.0]]  # log p − log q on targets, 0 off the mask
    assert m == {"reverse_kl": pytest.approx(0.25), "n_tokens": 2.0}  # mean of (−0.5, +1.0)
    with pytest.raises(ValueError, match="no target"):
        reverse_kl_advantages(lq, lp, torch.zeros(1, 3))


def test_refusals_name_the_setting():
    with pytest.raises(ValueError, match="share the tokenizer"):
        token_divergence(torch.zeros(1, 1, 3), torch.zeros(1, 1, 4))
    with pytest.raises(ValueError, match="beta"):
        token_divergence(Q, P, "jsd", beta=1.5)
    with pytest.raises(ValueError, match="temperature"):
        token_divergence(Q, P, temperature=0.0)
    with pytest.raises(ValueError, match="top_k"):
        token_divergence(Q, P, top_k=3)
    with pytest.raises(ValueError, match="kind"):
        token_divergence(Q, P, "tv")

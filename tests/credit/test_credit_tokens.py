"""Token-level credit (returns-to-go, GAE), REINFORCE++ and the bandit of docs/design.md §8."""

import math
import random

import pytest

from consequence.credit.advantages import group_advantages
from consequence.credit.returns import discounted_returns, gae


def test_case10_returns_carry_through_observations():
    mask = [1, 1, 0, 0, 1, 1]
    rewards = [0, 0, 0, 0, 0, 1.0]
    assert discounted_returns(rewards, mask, gamma=1.0) == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    adv, ret = gae(rewards, [0.0] * 6, mask, gamma=1.0, lam=1.0)
    assert adv == ret == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]


def test_discount_counts_generated_tokens_only():
    # γ = 0.5, four generated tokens: the observation in between is not a time step
    assert discounted_returns([0, 0, 0, 0, 1.0], [1, 0, 1, 1, 1], 0.5) == [0.125, 0.0, 0.25, 0.5, 1.0]


def test_gae_by_hand():
    # generated positions 0, 1, 4; values before each; γ = 0.9, λ = 0.5; terminal after
    mask = [1, 1, 0, 0, 1]
    values = [0.2, 0.4, 99.0, 99.0, 0.5]  # the values at observation positions are ignored
    rewards = [0, 0, 0, 0, 1.0]
    d2 = 1.0 + 0.9 * 0.0 - 0.5
    d1 = 0.0 + 0.9 * 0.5 - 0.4
    d0 = 0.0 + 0.9 * 0.4 - 0.2
    a2 = d2
    a1 = d1 + 0.45 * a2
    a0 = d0 + 0.45 * a1
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.5, last_value=0.0)
    assert adv == pytest.approx([a0, a1, 0, 0, a2])
    assert ret == pytest.approx([a0 + 0.2, a1 + 0.4, 0, 0, a2 + 0.5])


def test_gae_lambda_one_is_return_minus_value_and_bootstraps_after_truncation():
    mask = [1, 0, 1, 1]
    values = [0.3, 0.0, -0.2, 0.7]
    adv, _ = gae([0, 0, 0.5, 0], values, mask, gamma=0.8, lam=1.0, last_value=2.0)
    g = [0.8 * 0.5 + 0.8**3 * 2.0, 0, 0.5 + 0.8**2 * 2.0, 0.8 * 2.0]  # returns incl. bootstrap
    assert adv == pytest.approx([g[0] - 0.3, 0, g[2] + 0.2, g[3] - 0.7])


def test_reward_on_an_observation_is_an_error():
    with pytest.raises(ValueError, match="not a generated token"):
        discounted_returns([0, 1.0], [1, 0])
    with pytest.raises(ValueError, match="gamma"):
        gae([1.0], [0.0], [1], gamma=1.5)


def test_reinforce_pp_normalises_over_the_batch():
    adv = group_advantages([1, 0, 0, 0, 1, 1, 1, None], list("aaaabbbb"), "reinforce_pp")
    m, sd = 4 / 7, math.sqrt((4 * (3 / 7) ** 2 + 3 * (4 / 7) ** 2) / 7)
    assert adv[:7] == pytest.approx([(r - m) / sd for r in [1, 0, 0, 0, 1, 1, 1]], abs=1e-5)
    assert adv[7] is None


def _bandit_gradient(estimator: str, G: int, n_groups: int, seed: int = 0) -> float:
    """Mean over groups of (1/G) Σ_i A_i ∂logπ(a_i)/∂θ on the two-action bandit.

    π(A) = σ(θ) at θ = 0, so p = 0.5 and ∂logπ/∂θ = 1 − p for A, −p for B.
    """
    rng = random.Random(seed)
    p, qa, qb = 0.5, 0.75, 0.35
    actions, rewards, groups = [], [], []
    for g in range(n_groups):
        for _ in range(G):
            a = rng.random() < p
            actions.append(a)
            rewards.append(float(rng.random() < (qa if a else qb)))
            groups.append(str(g))
    adv = group_advantages(rewards, groups, estimator)
    total = sum(A * ((1 - p) if a else -p) for A, a in zip(adv, actions))
    return total / (G * n_groups)


@pytest.mark.slow
def test_bandit_self_including_mean_shrinks_by_g_minus_1_over_g_and_loo_is_unbiased():
    G, n = 4, 40_000  # per-group estimate has sd ≈ 0.2, so the mean's sd ≈ 0.001
    exact = 0.25 * (0.75 - 0.35)
    assert exact == pytest.approx(0.1)
    assert _bandit_gradient("dr_grpo", G, n) == pytest.approx((G - 1) / G * exact, abs=0.004)
    assert _bandit_gradient("rloo", G, n) == pytest.approx(exact, abs=0.004)
    assert _bandit_gradient("reinforce", G, n) == pytest.approx(exact, abs=0.006)

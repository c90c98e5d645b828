"""DPO's pairs and per-pair loss (credit/dpo.py), against hand-computed values."""

import math

import pytest

from consequence.credit.dpo import pair_loss
from consequence.records import Trajectory
from consequence.reward.preferences import preference_pairs


def _t(group, sample, score, outcome="finished"):
    return Trajectory(group, group, sample, 0, 0, outcome=outcome, reward=score, verifier_score=score)


def test_pairs_are_every_verified_episode_against_every_failed_one_of_its_group():
    trajs = [
        _t("a", 0, 1.0),
        _t("a", 1, 0.0),
        _t("a", 2, 1.0, "truncated"),  # cut by a budget: not verified, so a rejected side
        _t("a", 3, 1.0),
        _t("b", 0, 1.0),  # a group of successes only: no pair
        _t("b", 1, 1.0),
        _t("c", 0, 0.0),  # not credited (no rows): left out
    ]
    credited = [True] * 6 + [False]
    assert preference_pairs(trajs, credited) == [(0, 1), (0, 2), (3, 1), (3, 2)]


@pytest.mark.parametrize(
    ("h", "beta", "loss", "eps", "value", "slope"),
    [
        # h = 0: σ(0) = 1/2, so ℓ = log 2 and dℓ/dh = −β/2 (eq. 7)
        (0.0, 0.1, "sigmoid", 0.0, math.log(2), -0.05),
        # label smoothing ε = 0.1 at h = 0: ℓ = log 2, dℓ/dh = −β(0.9·½ − 0.1·½) = −0.04
        (0.0, 0.1, "sigmoid", 0.1, math.log(2), -0.04),
        # h = 20, β = 0.1: βh = 2; ℓ = log(1 + e^−2) = 0.126928…, dℓ/dh = −0.1·σ(−2) = −0.0119203…
        (20.0, 0.1, "sigmoid", 0.0, math.log1p(math.exp(-2.0)), -0.1 / (1 + math.exp(2.0))),
        # IPO (Azar et al. eq. 17), β = 0.1: target margin 1/(2β) = 5; h = 3 → (3 − 5)² = 4, slope 2(3 − 5) = −4
        (3.0, 0.1, "ipo", 0.0, 4.0, -4.0),
    ],
)
def test_pair_loss_and_its_slope(h, beta, loss, eps, value, slope):
    got_value, got_slope = pair_loss(h, beta, loss, eps)
    assert got_value == pytest.approx(value, rel=1e-12) and got_slope == pytest.approx(slope, rel=1e-12)


def test_pair_loss_is_stable_far_from_zero_and_refuses_an_unknown_loss():
    value, slope = pair_loss(-1e4, 1.0)  # log σ(−1e4) would underflow if computed directly
    assert value == pytest.approx(1e4) and slope == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="unknown DPO loss 'hinge'; valid: sigmoid, ipo"):
        pair_loss(0.0, 0.1, "hinge")


def test_a_dpo_run_that_would_train_another_loss_is_refused_before_any_work():
    from consequence.config import TrainConfig
    from consequence.recipes import load_recipe

    cfg = load_recipe("dpo").train_config()
    assert (cfg.surrogate, cfg.reduction, cfg.norm_const, cfg.kl_coef) == ("pg", "seq_mean_token_sum_norm", 1, 0.0)
    with pytest.raises(ValueError, match="--advantage dpo needs --surrogate pg, --reduction seq_mean_token_sum_norm"):
        TrainConfig(advantage="dpo")  # the defaults: PPO clip, token mean, one epoch
    with pytest.raises(ValueError, match="--mini-batches 1"):
        load_recipe("dpo").train_config(mini_batches=2)
    with pytest.raises(ValueError, match="--dpo-beta has no effect with --advantage grpo"):
        TrainConfig(dpo_beta=0.5)
    with pytest.raises(ValueError, match="--dpo-label-smoothing has no effect with --dpo-loss ipo"):
        load_recipe("dpo").train_config(dpo_loss="ipo", dpo_label_smoothing=0.1)

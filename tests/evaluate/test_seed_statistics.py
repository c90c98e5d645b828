"""Statistics over training seeds (consequence.evaluate.seeds) against direct computations."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from consequence.evaluate.seeds import (
    arm_difference,
    iqm,
    performance_profile,
    probability_of_improvement,
    two_level_bootstrap,
    two_level_resamples,
)


def _exact_two_level(table: list[list[int]]) -> dict[Fraction, Fraction]:
    """The exact distribution of the two-level bootstrap statistic by enumeration: every draw
    of S seeds, then every draw of each drawn seed's problems, each equally likely."""
    S = len(table)
    dist: dict[Fraction, Fraction] = {}
    for seeds in itertools.product(range(S), repeat=S):
        per_slot = [list(itertools.product(table[s], repeat=len(table[s]))) for s in seeds]
        p_seeds = Fraction(1, S**S)
        for draws in itertools.product(*per_slot):
            value = sum(Fraction(sum(d), len(d)) for d in draws) / S
            p = p_seeds * math.prod(Fraction(1, len(slot)) for slot in per_slot)
            dist[value] = dist.get(value, Fraction(0)) + p
    return dist


@pytest.mark.parametrize("table", [[[0, 1], [1, 1]], [[0, 0, 1], [1, 1], [0, 1, 1]]])
def test_two_level_bootstrap_matches_the_enumerated_distribution(table):
    n_boot = 20_000
    est, low, high = two_level_bootstrap(table, n_boot=n_boot, seed=0)
    assert est == pytest.approx(np.mean([np.mean(r) for r in table]), abs=1e-15)  # mean of seed means
    dist = _exact_two_level(table)
    assert sum(dist.values()) == 1
    # The Monte-Carlo CDF of the resamples lies within the DKW band of the exact CDF: a bound
    # that fails with probability < 1e-9 for any seed of the generator (and this one is fixed).
    rng_stats = two_level_resamples(table, n_boot, seed=0)  # what two_level_bootstrap took quantiles of
    eps = math.sqrt(math.log(2 / 1e-9) / (2 * n_boot))
    support = sorted(dist)
    cdf = np.cumsum([float(dist[v]) for v in support])
    for v, F in zip(support, cdf):
        assert abs((rng_stats <= float(v) + 1e-12).mean() - F) <= eps

    # the percentile interval lies between the exact quantiles at 2.5 % ∓ eps and 97.5 % ± eps
    def quantile(q):
        return float(support[int(np.searchsorted(cdf, q - 1e-12))])

    assert quantile(0.025 - eps) <= low <= quantile(0.025 + eps)
    assert quantile(0.975 - eps) <= high <= quantile(0.975 + eps)


def _exact_crossed(x: list[list[int]], y: list[list[int]]) -> dict[Fraction, Fraction]:
    """The exact distribution of arm_difference's statistic: every draw of the P problems
    (shared), of X's seeds and of Y's seeds, each equally likely."""
    P, dist = len(x[0]), {}
    n = P**P * len(x) ** len(x) * len(y) ** len(y)

    def mean(arm, seeds, problems):
        return sum(Fraction(sum(arm[s][j] for j in problems), P) for s in seeds) / len(seeds)

    for problems in itertools.product(range(P), repeat=P):
        for sx in itertools.product(range(len(x)), repeat=len(x)):
            for sy in itertools.product(range(len(y)), repeat=len(y)):
                v = mean(x, sx, problems) - mean(y, sy, problems)
                dist[v] = dist.get(v, Fraction(0)) + Fraction(1, n)
    return dist


def test_arm_difference_matches_the_enumerated_crossed_bootstrap():
    x, y = [[0, 1, 1], [1, 1, 0]], [[0, 0, 1], [1, 0, 0], [0, 0, 0]]
    n_boot = 20_000
    est, low, high = arm_difference(x, y, n_boot=n_boot, seed=0)
    assert est == pytest.approx(2 / 3 - 2 / 9, abs=1e-15)  # 4/6 solved minus 2/9
    dist = _exact_crossed(x, y)
    support = sorted(dist)
    cdf = np.cumsum([float(dist[v]) for v in support])
    eps = math.sqrt(math.log(2 / 1e-9) / (2 * n_boot))  # DKW: fails with probability < 1e-9

    def quantile(q):
        return float(support[int(np.searchsorted(cdf, q - 1e-12))])

    assert quantile(0.025 - eps) <= low <= quantile(0.025 + eps)
    assert quantile(0.975 - eps) <= high <= quantile(0.975 + eps)


def test_arm_difference_of_a_constant_shift_is_that_shift():
    """Problems shared by both arms: a problem's difficulty cancels; y = x − 0.25 on every
    problem and seed, so every resample (same problems, any seeds of equal rows) is 0.25."""
    x = [[0.5, 1.0, 0.25, 0.75]] * 3
    y = [[v - 0.25 for v in x[0]]] * 2
    assert arm_difference(x, y, n_boot=500) == pytest.approx((0.25, 0.25, 0.25), abs=1e-12)
    with pytest.raises(ValueError, match="same problems"):
        arm_difference(x, [[0.5, 1.0]])


def test_one_seed_is_a_bootstrap_over_problems_only():
    """With one seed, every resample draws that seed: the statistic is a problem resample's mean."""
    stats = two_level_resamples([[0, 1, 1, 1]], n_boot=4000, seed=1)
    exact = {
        Fraction(k, 4): Fraction(math.comb(4, k) * 3**k, 4**4) for k in range(5)
    }  # k successes of 4 draws at p = 3/4
    eps = math.sqrt(math.log(2 / 1e-9) / (2 * 4000))
    for v, p in exact.items():
        assert abs((np.abs(stats - float(v)) < 1e-12).mean() - float(p)) <= eps


def test_iqm_probability_of_improvement_and_profiles_by_hand():
    assert iqm([1, 2, 3, 4, 100]) == pytest.approx(3.0)  # ⌊5/4⌋ = 1 cut from each end: mean of 2, 3, 4
    assert iqm([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]) == pytest.approx(0.45)  # 2 cut: mean of 0.3 … 0.6
    assert iqm([0.5]) == 0.5
    # X = (0.3, 0.5), Y = (0.3, 0.4): pairs 0.3-0.3 tie, 0.3<0.4, 0.5>0.3, 0.5>0.4 → (2 + ½)/4
    assert probability_of_improvement([0.3, 0.5], [0.3, 0.4]) == pytest.approx(0.625)
    assert probability_of_improvement([0.3, 0.4], [0.3, 0.5]) == pytest.approx(0.375)  # the complement
    assert performance_profile([0.2, 0.4, 0.4, 0.9], [0.0, 0.4, 0.5, 1.0]) == [1.0, 0.25, 0.25, 0.0]


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: two_level_bootstrap([]), "no training seed"),
        (lambda: two_level_bootstrap([[0.5], []]), "seed 1: give a non-empty list"),
        (lambda: two_level_bootstrap([[float("nan")]]), "seed 0: a per-problem score is NaN"),
        (lambda: two_level_bootstrap([[1.0]], confidence=1.0), "confidence must be in"),
        (lambda: two_level_resamples([[1.0]], n_boot=0), "n_boot must be >= 1"),
        (lambda: iqm([]), "at least one finite score"),
        (lambda: probability_of_improvement([], [1.0]), "at least one score"),
    ],
)
def test_bad_input_is_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()

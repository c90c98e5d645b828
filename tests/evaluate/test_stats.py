import math

import numpy as np
import pytest

from consequence.evaluate.stats import binomial_se, mean_pass_at_k, paired_bootstrap_ci, pass_at_k


def test_pass_at_k_reference(capsys):
    unbiased = pass_at_k(10, 2, 3)
    naive = 1 - (1 - 2 / 10) ** 3
    print(f"pass@3 n=10 c=2: unbiased {unbiased:.4f}, naive {naive:.4f}")
    assert unbiased == pytest.approx(1 - 56 / 120)
    assert unbiased == pytest.approx(0.5333, abs=1e-4)
    assert naive == pytest.approx(0.488)
    assert unbiased != pytest.approx(naive, abs=1e-2)


def test_pass_at_k_matches_combinations():
    for n in range(1, 12):
        for c in range(n + 1):
            for k in range(1, n + 1):
                want = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)


def test_pass_at_k_large_n_stable():
    v = pass_at_k(2000, 3, 100)
    assert 0 < v < 1 and math.isfinite(v)
    assert pass_at_k(5, 0, 2) == 0.0 and pass_at_k(5, 4, 2) == 1.0


def test_pass_at_k_errors():
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)  # n < k
    with pytest.raises(ValueError):
        pass_at_k(5, 6, 1)  # c > n
    with pytest.raises(ValueError):
        pass_at_k(5, 1, 0)


def test_mean_pass_at_k_per_task_then_average():
    counts = [(10, 2), (10, 10), (10, 0)]
    assert mean_pass_at_k(counts, 3) == pytest.approx((1 - 56 / 120 + 1 + 0) / 3)
    # negative control: from the average pass@1 (0.4) the value would be different
    assert mean_pass_at_k(counts, 3) != pytest.approx(1 - (1 - 0.4) ** 3, abs=1e-3)
    # case 04: dropped episodes stay in the denominator
    assert mean_pass_at_k([(1, 1)] * 40 + [(1, 0)] * 60, 1) == pytest.approx(0.40)
    with pytest.raises(ValueError):
        mean_pass_at_k([], 1)


def test_binomial_se_reference():
    se = binomial_se(0.5, 200)
    assert se == pytest.approx(0.035, abs=5e-4)
    assert 100 * 1.96 * se == pytest.approx(6.9, abs=0.05)
    with pytest.raises(ValueError):
        binomial_se(0.5, 0)
    with pytest.raises(ValueError):
        binomial_se(1.5, 10)


def test_paired_bootstrap_identical():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 2, 60).astype(float)
    groups = [f"t{i // 3}" for i in range(60)]
    res = paired_bootstrap_ci(a, a.copy(), groups, n_resamples=2000)
    assert res["diff"] == 0.0 and res["low"] <= 0.0 <= res["high"]
    assert res["ties"] == 20 and res["b_wins"] == res["a_wins"] == 0
    assert res["n"] == 60 and res["n_groups"] == 20


@pytest.mark.parametrize("method", ["percentile", "BCa"])
def test_paired_bootstrap_strong_effect(method):
    rng = np.random.default_rng(1)
    a = rng.normal(0.3, 0.1, 90)
    b = a + 0.2 + rng.normal(0, 0.02, 90)
    groups = [f"t{i // 3}" for i in range(90)]
    res = paired_bootstrap_ci(a, b, groups, n_resamples=2000, method=method)
    assert res["diff"] == pytest.approx(np.mean(b) - np.mean(a))
    assert res["low"] > 0 and res["low"] < res["diff"] < res["high"]
    assert res["b_wins"] == 30 and res["a_wins"] == 0
    assert res["a_mean"] == pytest.approx(np.mean(a)) and res["b_mean"] == pytest.approx(np.mean(b))


def test_paired_bootstrap_no_effect_contains_zero_and_is_reproducible():
    rng = np.random.default_rng(2)
    a = rng.normal(0.5, 0.2, 50)
    b = a + rng.normal(0, 0.2, 50)
    b = b - (b.mean() - a.mean())  # exactly zero mean difference
    r1 = paired_bootstrap_ci(a, b, n_resamples=2000, seed=3)
    r2 = paired_bootstrap_ci(a, b, n_resamples=2000, seed=3)
    assert r1 == r2
    assert r1["low"] < 0 < r1["high"] and r1["n_groups"] == 50


def test_paired_bootstrap_groups_stay_together():
    # per-group averaging: 2 tasks with 1 and 3 episodes, each task counts once
    a = [0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    b = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    g = ["x", "y", "y", "y", "z", "z"]
    res = paired_bootstrap_ci(a, b, g, n_resamples=500)
    assert res["diff"] == pytest.approx(2 / 3) and res["n_groups"] == 3
    assert res["b_wins"] == 2 and res["ties"] == 1


def test_paired_bootstrap_errors():
    with pytest.raises(ValueError):
        paired_bootstrap_ci([1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        paired_bootstrap_ci([1.0, 2.0], [1.0, 2.0], ["g", "g"])
    with pytest.raises(ValueError):
        paired_bootstrap_ci([1.0, float("nan")], [1.0, 2.0])
    with pytest.raises(ValueError):
        paired_bootstrap_ci([1.0, 2.0], [1.0, 2.0], method="magic")

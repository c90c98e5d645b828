"""Labs: every printed number against its exact value (docs/design.md §8) or a Monte-Carlo bound."""

import math

import pytest
from typer.testing import CliRunner

from consequence.cli import app
from consequence.labs import LABS, baseline, clip, importance, lag, mixed_groups, passk, reduction, shaping

NAMES = ["baseline", "importance", "clip", "reduction", "mixed-groups", "passk", "shaping", "lag"]


def _within(mean, target, std, n, k=4.0):
    return abs(mean - target) < k * std / math.sqrt(n)


def test_registry_names():
    assert list(LABS) == NAMES


@pytest.mark.slow
def test_baseline(tmp_path):
    out = baseline.run(tmp_path, seed=0, n_groups=20_000, steps=300)
    n = out["groups"]
    assert n == 20_000
    assert out["exact gradient at p=0.5"] == pytest.approx(0.1)
    assert _within(out["reinforce mean"], 0.1, out["reinforce std"], n)
    assert _within(out["rloo mean"], 0.1, out["rloo std"], n)
    assert _within(out["dr_grpo mean"], 0.075, out["dr_grpo std"], n)
    assert out["expected shrinkage (G-1)/G"] == 0.75
    assert out["shrinkage dr_grpo/exact"] == pytest.approx(out["dr_grpo mean"] / 0.1)
    assert abs(out["shrinkage dr_grpo/exact"] - 0.75) < 4 * out["dr_grpo std"] / math.sqrt(n) / 0.1
    # the self-including mean is biased: 0.1 is far outside its Monte-Carlo band
    assert not _within(out["dr_grpo mean"], 0.1, out["dr_grpo std"], n)
    # exact stds at p = 0.5 (single-group variances computed by hand): reinforce 0.1275/4,
    # rloo = G/(G-1) · dr_grpo on the same draws (R_i − mean_{j≠i} = G/(G−1) (R_i − mean))
    assert out["reinforce std"] == pytest.approx(math.sqrt(0.1275 / 4), rel=0.03)
    assert out["rloo std"] == pytest.approx(4 / 3 * out["dr_grpo std"], rel=1e-9)
    assert out["reinforce std"] > out["rloo std"]
    assert out["grpo mean"] > 0.1  # std normalisation rescales the gradient (not an unbiased estimate)
    assert out["grpo std"] > 0
    for est in ("reinforce", "dr_grpo", "rloo", "grpo"):
        assert out[f"{est} final p(A)"] > 0.9
    assert (tmp_path / "baseline.png").stat().st_size > 10_000


def test_baseline_exact_gradient_negative_control():
    assert baseline.exact_gradient(0.5) == pytest.approx(0.1)
    assert baseline.exact_gradient(0.9) == pytest.approx(0.9 * 0.1 * 0.4)


def test_baseline_prints_the_tutorials_one_sample_estimates(tmp_path):
    """The tutorial ("The gradient with only two actions"): at p = 0.5 one sample's estimate
    R(1{a=A} − p) is +0.5 for A rewarded, −0.5 for B rewarded, 0 without reward; averaged
    over the outcomes it is the exact gradient 0.1. Float64 on numbers ≤ 1: each value passes
    through at most ~10 roundings of ≤ 2^-53 ≈ 1.1e-16, so 1e-15 bounds the error."""
    out = baseline.run(tmp_path, seed=0, n_groups=10, steps=1)  # these values do not depend on the draws
    key = "one-sample estimate (no baseline), {}".format
    assert out[key("A rewarded")] == pytest.approx(0.5, abs=1e-15)
    assert out[key("B rewarded")] == pytest.approx(-0.5, abs=1e-15)
    assert out[key("A not rewarded")] == 0.0 and out[key("B not rewarded")] == 0.0
    assert out[key("mean")] == pytest.approx(0.1, abs=1e-15)
    assert out[key("mean")] == pytest.approx(out["exact gradient at p=0.5"], abs=1e-15)


def test_one_sample_estimates_follow_the_score_away_from_one_half():
    # p = 0.9: the score is 1{a=A} − p, so A rewarded gives 0.1 and B rewarded −0.9; their
    # weighted mean is again the exact gradient p(1−p)(q_A − q_B) = 0.036
    est = baseline.one_sample_estimates(0.9)
    assert est["A rewarded"] == pytest.approx(0.1, abs=1e-15)
    assert est["B rewarded"] == pytest.approx(-0.9, abs=1e-15)
    assert est["mean"] == pytest.approx(baseline.exact_gradient(0.9), abs=1e-15)
    # negative control: the p = 0.5 values are not what p = 0.9 gives
    assert est["A rewarded"] != pytest.approx(0.5)
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="strictly between 0 and 1"):
            baseline.one_sample_estimates(bad)


def test_importance(tmp_path):
    out = importance.run(tmp_path, seed=0)
    n = out["estimates"]
    assert out["weight A (pi/mu)"] == pytest.approx(3.0)
    assert out["weight B (pi/mu)"] == pytest.approx(0.5)
    assert out["exact E_pi[r]"] == pytest.approx(0.59)
    assert out["exact E_mu[w r]"] == pytest.approx(0.59)
    assert _within(out["weighted mean"], 0.59, out["weighted std (24 samples)"], n)
    assert out["exact E_mu[r]"] == pytest.approx(0.43)
    assert _within(out["unweighted mean"], 0.43, out["unweighted std (24 samples)"], n)
    assert not _within(out["unweighted mean"], 0.59, out["unweighted std (24 samples)"], n)
    # exact spread of a 24-sample mean: Var[w r] = Σ μ(a) w(a)² q(a) − 0.59²
    var_w = 0.2 * 9 * 0.75 + 0.8 * 0.25 * 0.35 - 0.59**2
    assert out["weighted std (24 samples)"] == pytest.approx(math.sqrt(var_w / 24), rel=0.03)
    assert out["unweighted std (24 samples)"] == pytest.approx(math.sqrt(0.43 * 0.57 / 24), rel=0.03)
    assert (tmp_path / "importance.png").is_file()


def test_clip(tmp_path):
    out = clip.run(tmp_path)
    assert out["A=+1 eps 0.2: zero gradient edge rho"] == pytest.approx(1.2)
    assert out["A=+1 eps 0.2: zero gradient side"] == "above"
    assert out["A=+1 clip-higher 0.2/0.28: zero gradient edge rho"] == pytest.approx(1.28)
    assert out["A=+1 clip-higher 0.2/0.28: zero gradient side"] == "above"
    for s in ("eps 0.2", "clip-higher 0.2/0.28"):
        assert out[f"A=-1 {s}: zero gradient edge rho"] == pytest.approx(0.8)
        assert out[f"A=-1 {s}: zero gradient side"] == "below"
    assert out["rho=1.3 eps=0.2 A=1.732"] == pytest.approx(2.078, abs=5e-4)
    assert out["rho=1.3 eps=0.2 A=-0.577"] == pytest.approx(-0.750, abs=5e-4)
    assert (tmp_path / "clip.png").is_file()


def test_clip_gradient_exactly_zero_beyond_the_edge():
    rho = clip.rho_grid()
    _, g = clip.surrogate_and_grad(rho, 1.0, 0.2, 0.2)
    assert bool((g[rho > 1.2] == 0).all()) and bool((g[rho < 1.2] != 0).all())
    _, g = clip.surrogate_and_grad(rho, -1.0, 0.2, 0.2)
    assert bool((g[rho < 0.8] == 0).all()) and bool((g[rho > 0.8] != 0).all())
    _, g = clip.surrogate_and_grad(rho, 1.0, 0.2, 0.28)
    assert bool((g[rho > 1.28] == 0).all()) and bool((g[rho < 1.28] != 0).all())
    # negative control: without clipping (huge eps) the gradient never vanishes
    _, g = clip.surrogate_and_grad(rho, 1.0, 10.0, 10.0)
    with pytest.raises(ValueError):
        clip.zero_grad_edge(rho, g)


def test_clip_prints_the_rise_before_the_clip_eps_times_pi_old(tmp_path):
    """The tutorial (the clip's relative bound, after its A = ±1, ε = 0.2 example): with
    ε = 0.2 a token's probability can rise by ε·π_old before its term flattens: 0.002 at
    π_old = 0.01, 0.1 at π_old = 0.5 (0.0028 and 0.14 with DAPO's ε_high = 0.28). Tolerance:
    the bisection ends within 2^-60 ≈ 9e-19 of the edge, and exp(logπ − logπ_old) rounds
    by a few ulps (≤ 1e-15 relative) near 1 + ε, so 1e-15 absolute bounds the error."""
    out = clip.run(tmp_path)
    for name, eps in (("eps 0.2", 0.2), ("clip-higher 0.2/0.28", 0.28)):
        for pi_old in (0.01, 0.5):
            top = out[f"A>0 {name}, pi_old={pi_old:g}: largest pi with gradient"]
            rise = out[f"A>0 {name}, pi_old={pi_old:g}: rise eps*pi_old"]
            assert top == pytest.approx((1 + eps) * pi_old, abs=1e-15)
            assert rise == pytest.approx(eps * pi_old, abs=1e-15)
    assert out["A>0 eps 0.2, pi_old=0.01: rise eps*pi_old"] == pytest.approx(0.002, abs=1e-15)
    assert out["A>0 eps 0.2, pi_old=0.5: rise eps*pi_old"] == pytest.approx(0.1, abs=1e-15)


def test_largest_prob_with_gradient_is_the_surrogates_edge():
    top = clip.largest_prob_with_gradient(0.01)
    # the edge is the surrogate's own: a gradient just below it, none just above (1e-9 relative
    # is far above the bisection's width and the rounding of the ratio)
    assert clip._has_gradient(top * (1 - 1e-9), 0.01, 0.2, 0.2)
    assert not clip._has_gradient(top * (1 + 1e-9), 0.01, 0.2, 0.2)
    # negative controls: a probability cannot pass 1, so at π_old = 0.9 the rise is 0.1, not
    # ε·π_old = 0.18 (the term never flattens); bad inputs are refused
    assert clip.largest_prob_with_gradient(0.9) == 1.0
    with pytest.raises(ValueError, match="probability in"):
        clip.largest_prob_with_gradient(0.0)
    with pytest.raises(ValueError, match="excludes 1"):
        clip.largest_prob_with_gradient(0.5, eps_low=-0.1, eps_high=-0.05)


def test_reduction(tmp_path):
    out = reduction.run(tmp_path)
    s3 = math.sqrt(3)
    for i, a in enumerate((s3, -1 / s3, -1 / s3, -1 / s3)):
        L = reduction.LENGTHS[i]
        assert out[f"advantage seq {i + 1} (len {L})"] == pytest.approx(a, abs=1e-5)
    assert out["loss token_mean"] == pytest.approx(1 / (2 * s3), abs=1e-5)
    assert out["loss seq_mean_token_mean"] == pytest.approx(0.0, abs=1e-9)
    assert out["loss seq_mean_token_sum_norm"] == pytest.approx(1 / (3 * s3), abs=1e-5)
    expected = {
        "token_mean": [1 / 16] * 4,
        "seq_mean_token_mean": [1 / 8, 1 / 16, 1 / 16, 1 / 24],
        "seq_mean_token_sum_norm": [1 / 24] * 4,
    }
    for red, ws in expected.items():
        for i, w in enumerate(ws):
            assert out[f"token weight {red} seq {i + 1}"] == pytest.approx(w)
    assert out["sum of weights token_mean"] == pytest.approx(1.0)
    assert out["sum of weights seq_mean_token_mean"] == pytest.approx(1.0)
    assert out["sum of weights seq_mean_token_sum_norm"] == pytest.approx(16 / 24)
    assert (tmp_path / "reduction.png").is_file()


def test_mixed_groups(tmp_path):
    out = mixed_groups.run(tmp_path, seed=0, n_groups=20_000)
    assert out["mixed p=0.5 G=4"] == pytest.approx(0.875)
    assert out["mixed p=0.01 G=4"] == pytest.approx(0.0394, abs=5e-5)
    assert out["mixed p=0.01 G=16"] == pytest.approx(0.1485, abs=5e-5)
    for p, G in mixed_groups.SIMULATED:
        q = mixed_groups.mixed_probability(p, G)
        assert _within(out[f"simulated p={p} G={G} (20000 groups)"], q, math.sqrt(q * (1 - q)), 20_000)
    assert (tmp_path / "mixed-groups.png").is_file()


def test_passk(tmp_path):
    out = passk.run(tmp_path)
    assert out["unbiased pass@3"] == pytest.approx(1 - 56 / 120)
    assert out["naive pass@3"] == pytest.approx(0.488)
    assert out["unbiased pass@1"] == pytest.approx(0.2) and out["naive pass@1"] == pytest.approx(0.2)
    assert out["unbiased pass@5"] == pytest.approx(1 - 56 / 252)  # 1 − C(8,5)/C(10,5)
    assert out["naive pass@5"] == pytest.approx(1 - 0.8**5)
    assert out["unbiased pass@9"] == 1.0  # n − c < k: every draw of 9 holds a correct one
    assert out["naive pass@9"] == pytest.approx(1 - 0.8**9)
    assert (tmp_path / "passk.png").is_file()


def test_shaping(tmp_path):
    out = shaping.run(tmp_path)
    g = 0.95
    true = {
        "patch blind, finish": 0.3 * g,
        "patch blind x2, finish": (1 - 0.7**2) * g**2,
        "test, patch, finish": 0.8 * g**2,
        "test, patch, retest, repatch if failing, finish": 0.8 * g**3 + 0.2 * 0.8 * g**4,
        "stall: test x8, patch, finish": 0.8 * g**9,
        "spam tests until budget": 0.0,
    }
    tests_run = {
        "patch blind, finish": [],
        "patch blind x2, finish": [],
        "test, patch, finish": [0],
        "test, patch, retest, repatch if failing, finish": [0, 2],
        "stall: test x8, patch, finish": list(range(8)),
        "spam tests until budget": list(range(10)),
    }
    assert list(true) == list(shaping.POLICIES)
    for n, v in true.items():
        assert out[f"true: {n}"] == pytest.approx(v)
        assert out[f"shaped: {n}"] == pytest.approx(v - 0.2)  # Φ(s_T) − Φ(s_0) = 0 − 0.2
        assert out[f"shaped - true: {n}"] == pytest.approx(-0.2)
        assert out[f"bonus: {n}"] == pytest.approx(v + sum(0.1 * g**t for t in tests_run[n]))
    assert out["expected shift Φ(s_T) - Φ(s_0)"] == pytest.approx(-0.2)
    assert out["ranking true"] == out["ranking shaped"] == "4 > 3 > 5 > 2 > 1 > 6"
    assert out["ranking bonus"] == "5 > 4 > 3 > 6 > 2 > 1"
    assert out["same ranking true/shaped"] is True and out["same ranking true/bonus"] is False
    # the bonus puts the stalling test-spammer above the honest policy; the true reward does not
    assert out[f"bonus: {shaping.STALL}"] > out[f"bonus: {shaping.HONEST}"]
    assert out[f"true: {shaping.STALL}"] < out[f"true: {shaping.HONEST}"]
    assert (tmp_path / "shaping.png").is_file()


def test_shaping_negative_control():
    # a potential that is not 0 at the terminal state breaks the invariance (the return then
    # moves by Φ(s_T), which differs between policies that did and did not run tests)
    saved = shaping.phi
    try:
        shaping.phi = lambda tested, done: 0.5 * tested
        spam = shaping.expected_return(shaping.POLICIES["spam tests until budget"], "shaped")
        blind = shaping.expected_return(shaping.POLICIES["patch blind, finish"], "shaped")
    finally:
        shaping.phi = saved
    assert spam == pytest.approx(0.5 * 0.95**10)  # γ^T Φ(s_T) − Φ(s_0), Φ(s_T) = 0.5: spam gains 0.30
    assert blind == pytest.approx(0.3 * 0.95)


@pytest.mark.slow
def test_lag(tmp_path):
    out = lag.run(tmp_path, seed=0, n_groups=40_000, steps=300)
    n = out["groups"]
    assert n == 40_000
    assert out["exact gradient at p=0.5"] == pytest.approx(0.1)
    names = ["0", "1", "2", "4", "8", "inf"]
    exact_kept = [0.25, 0.4375, 1 - 0.75**3, 1 - 0.75**5, 1 - 0.75**9, 1.0]
    for name, f in zip(names, exact_kept):
        assert out[f"k={name} exact kept fraction"] == pytest.approx(f)
        assert abs(out[f"k={name} kept fraction"] - f) <= 4 * math.sqrt(f * (1 - f) / n)
        assert _within(out[f"k={name} bias"], out[f"k={name} exact bias"], out[f"k={name} bias std error"], 1)
        assert out[f"k={name} final p(A)"] > 0.9
    kept = [out[f"k={s} kept fraction"] for s in names]
    assert kept == sorted(kept) and len(set(kept)) == len(kept)
    assert out["k=inf kept fraction"] == 1.0
    assert out["k=0 exact bias"] == pytest.approx(0.0, abs=1e-15)
    exact = [abs(out[f"k={s} exact bias"]) for s in names]
    assert all(a < b for a, b in zip(exact, exact[1:]))
    assert out["k=inf exact bias"] == pytest.approx(-0.0277, abs=5e-5)
    measured = [abs(out[f"k={s} bias"]) for s in names]
    se = [out[f"k={s} bias std error"] for s in names]
    assert all(b > a - 4 * (sa + sb) for a, b, sa, sb in zip(measured, measured[1:], se, se[1:]))
    assert abs(out["k=0 bias"]) < 4 * se[0]
    assert not _within(out["k=inf bias"], 0.0, se[-1], 1)  # the uncorrected stale gradient is biased
    assert (tmp_path / "lag.png").is_file()


def test_lag_expected_estimate_unbiased_only_on_policy():
    assert lag.expected_estimate(0.5, 0.5) == pytest.approx(0.1)
    assert lag.expected_estimate(0.8, 0.8) == pytest.approx(0.8 * 0.2 * 0.4)
    assert lag.expected_estimate(0.3, 0.5) != pytest.approx(0.1)


def test_cli_lab(tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["lab", "passk", "--out", str(tmp_path)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "0.5333" in res.output and "0.4880" in res.output
    assert str(tmp_path / "passk.png") in res.output
    assert not list(tmp_path.glob(".*tmp*"))  # atomic write left no temp file


def test_cli_unknown_lab_exits_2(tmp_path):
    res = CliRunner().invoke(app, ["lab", "nope", "--out", str(tmp_path)], env={"COLUMNS": "200"})
    assert res.exit_code == 2
    for name in NAMES:
        assert name in res.output
    assert not list(tmp_path.iterdir())

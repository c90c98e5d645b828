"""Lab ``lag``: stale samples from an asynchronous collector bias the on-policy gradient.

Two-action bandit (q_A = 0.75, q_B = 0.35, p = σ(θ) = P(A)). The learner is at θ = 0
(p = 0.5, exact gradient p(1−p)(q_A−q_B) = 0.1); the policy version v steps back has
θ = −0.4·v (the policy has been improving linearly). Each group of G = 4 samples comes
from one version, lag L ~ geometric with P(L = l) = (1−ρ)ρ^l, ρ = 0.75 (mean 3 versions).
A staleness threshold k keeps a group only if L ≤ k, so the kept fraction is 1 − ρ^(k+1).

The estimate is the uncorrected on-policy formula (1/G) Σ_i A_i ∂logπ_θ(a_i)/∂θ with the
current θ, no importance weight, and A_i from ``group_advantages(..., "rloo")``. Its
expectation for a group from a policy with P(A) = m is
E[r s] − E[r] E[s] = m(1−p)q_A − (1−m)p q_B − (m q_A + (1−m) q_B)(m − p), which equals the
exact gradient only for m = p (lag 0).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from consequence.credit.advantages import group_advantages
from consequence.figures import pyplot, save_figure

Q_A, Q_B, G = 0.75, 0.35, 4
RHO = 0.75  # geometric lag, mean RHO/(1−RHO) = 3 versions
DRIFT = 0.4  # θ of the version l steps back: θ_now − DRIFT·l
THRESHOLDS: tuple[float, ...] = (0, 1, 2, 4, 8, math.inf)


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def kept_fraction(k: float) -> float:
    """P(L ≤ k) = 1 − ρ^(k+1) (1 for k = ∞)."""
    return 1.0 if math.isinf(k) else 1.0 - RHO ** (k + 1)


def expected_estimate(m: float, p: float) -> float:
    """E of the RLOO on-policy-formula estimate when actions come from P(A) = m, learner at p."""
    e_rs = m * (1 - p) * Q_A - (1 - m) * p * Q_B
    return e_rs - (m * Q_A + (1 - m) * Q_B) * (m - p)


def exact_bias(k: float, theta: float = 0.0, lmax: int = 400) -> float:
    """E[estimate | L ≤ k] − p(1−p)(q_A−q_B) at the learner's θ."""
    p = sigmoid(theta)
    top = lmax if math.isinf(k) else int(k)
    w = [(1 - RHO) * RHO**ell for ell in range(top + 1)]
    e = sum(wl * expected_estimate(sigmoid(theta - DRIFT * ell), p) for ell, wl in enumerate(w)) / sum(w)
    return e - p * (1 - p) * (Q_A - Q_B)


def _group_estimates(theta_now: float, sampler_theta: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One estimate per group: groups sampled from σ(sampler_theta[g]), scored at theta_now."""
    n = len(sampler_theta)
    p = sigmoid(theta_now)
    m = 1.0 / (1.0 + np.exp(-sampler_theta))
    took_a = rng.random((n, G)) < m[:, None]
    reward = (rng.random((n, G)) < np.where(took_a, Q_A, Q_B)).astype(float)
    ids = [str(g) for g in range(n) for _ in range(G)]
    adv = np.array(group_advantages(reward.ravel().tolist(), ids, "rloo"), dtype=float)
    score = np.where(took_a, 1.0 - p, -p)  # d logπ_θ(a)/dθ at the current θ
    return (adv.reshape(n, G) * score).mean(axis=1)


def train(k: float, seed: int, steps: int = 300, lr: float = 0.5, groups_per_step: int = 8) -> float:
    """Final p(A) of SGD from θ0 = 0 when groups come from stale versions and lag > k is dropped."""
    rng = np.random.default_rng(seed)
    thetas = [0.0]  # θ of version v
    for t in range(steps):
        lag = np.minimum(rng.geometric(1 - RHO, groups_per_step) - 1, t)
        keep = lag <= k
        if keep.any():
            est = _group_estimates(thetas[-1], np.array([thetas[t - ell] for ell in lag[keep]]), rng)
            thetas.append(thetas[-1] + lr * float(est.mean()))
        else:
            thetas.append(thetas[-1])
    return sigmoid(thetas[-1])


def run(out_dir: Path, seed: int = 0, n_groups: int = 40_000, steps: int = 300) -> dict:
    rng = np.random.default_rng(seed)
    lag = rng.geometric(1 - RHO, n_groups) - 1  # the same draws for every threshold
    est = _group_estimates(0.0, -DRIFT * lag.astype(float), rng)
    exact = 0.25 * (Q_A - Q_B)
    out: dict = {"exact gradient at p=0.5": exact, "groups": n_groups}
    for k in THRESHOLDS:
        name = "inf" if math.isinf(k) else str(int(k))
        kept = est[lag <= k]
        out[f"k={name} kept fraction"] = len(kept) / n_groups
        out[f"k={name} exact kept fraction"] = kept_fraction(k)
        out[f"k={name} bias"] = float(kept.mean()) - exact
        out[f"k={name} bias std error"] = float(kept.std(ddof=1)) / math.sqrt(len(kept))
        out[f"k={name} exact bias"] = exact_bias(k)
        out[f"k={name} final p(A)"] = train(k, seed, steps)

    names = ["inf" if math.isinf(k) else str(int(k)) for k in THRESHOLDS]
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = np.arange(len(names))
    ax1.plot(x, [out[f"k={n} exact kept fraction"] for n in names], "k--", label="exact 1 − ρ^(k+1)")
    ax1.plot(x, [out[f"k={n} kept fraction"] for n in names], "o", label=f"measured ({n_groups} groups)")
    ax1.set(
        title="fraction of groups kept (lag ~ geometric, mean 3)",
        xlabel="staleness threshold k",
        ylabel="kept fraction",
        ylim=(0, 1.05),
    )
    ax2.plot(x, [abs(out[f"k={n} exact bias"]) for n in names], "k--", label="exact")
    ax2.errorbar(
        x,
        [abs(out[f"k={n} bias"]) for n in names],
        yerr=[2 * out[f"k={n} bias std error"] for n in names],
        fmt="o",
        capsize=3,
        label="measured ± 2 s.e.",
    )
    ax2.set(
        title=f"|bias| of the uncorrected gradient (exact {exact:.2f})",
        xlabel="staleness threshold k",
        ylabel="|E[estimate] − exact gradient|",
    )
    for ax in (ax1, ax2):
        ax.set_xticks(x, names)
        ax.legend(fontsize=8)
    out["png"] = str(save_figure(fig, out_dir, "lag"))
    return out

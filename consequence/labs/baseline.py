"""Lab ``baseline``: which baseline keeps the policy gradient unbiased (docs/design.md §8).

Two-action bandit, p = σ(θ) = P(A), Bernoulli rewards with q_A = 0.75, q_B = 0.35. At
p = 0.5 the exact gradient of the expected reward is p(1−p)(q_A−q_B) = 0.1. Each
estimate is (1/G) Σ_i A_i ∂logπ(a_i)/∂θ over one group of G = 4, with A_i from
:func:`consequence.credit.advantages.group_advantages`.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from consequence.credit.advantages import group_advantages
from consequence.figures import pyplot, save_figure

Q_A, Q_B, G = 0.75, 0.35, 4
# label -> estimator name of group_advantages
ESTIMATORS = {"no baseline": "reinforce", "self-including mean": "dr_grpo",
              "leave-one-out": "rloo", "mean/std (GRPO)": "grpo"}


def exact_gradient(p: float) -> float:
    """d E[r] / dθ for p = σ(θ): p(1−p)(q_A − q_B)."""
    return p * (1 - p) * (Q_A - Q_B)


def _estimates(theta: float, n_groups: int, estimator: str, rng: np.random.Generator) -> np.ndarray:
    """One score-function gradient estimate per group: [n_groups] float64."""
    p = 1.0 / (1.0 + math.exp(-theta))
    took_a = rng.random((n_groups, G)) < p
    reward = (rng.random((n_groups, G)) < np.where(took_a, Q_A, Q_B)).astype(float)
    ids = [str(g) for g in range(n_groups) for _ in range(G)]
    adv = np.array(group_advantages(reward.ravel().tolist(), ids, estimator), dtype=float)
    score = np.where(took_a, 1.0 - p, -p)  # d logπ(a)/dθ
    return (adv.reshape(n_groups, G) * score).mean(axis=1)


def train_curve(estimator: str, seed: int, steps: int = 300, lr: float = 0.5,
                groups_per_step: int = 8) -> list[float]:
    """p(A) after each SGD step on θ (θ0 = 0) with the given estimator."""
    rng = np.random.default_rng(seed)
    theta, ps = 0.0, []
    for _ in range(steps):
        theta += lr * float(_estimates(theta, groups_per_step, estimator, rng).mean())
        ps.append(1.0 / (1.0 + math.exp(-theta)))
    return ps


def run(out_dir: Path, seed: int = 0, n_groups: int = 20_000, steps: int = 300) -> dict:
    # the same draws for every estimator (common random numbers): only the baseline differs
    samples = {lab: _estimates(0.0, n_groups, est, np.random.default_rng(seed)) for lab, est in ESTIMATORS.items()}
    curves = {lab: train_curve(est, seed, steps) for lab, est in ESTIMATORS.items()}
    exact = exact_gradient(0.5)
    out: dict = {"exact gradient at p=0.5": exact, "groups": n_groups}
    for lab, est in ESTIMATORS.items():
        out[f"{est} mean"] = float(samples[lab].mean())
        out[f"{est} std"] = float(samples[lab].std(ddof=1))
        out[f"{est} final p(A)"] = curves[lab][-1]
    out["shrinkage dr_grpo/exact"] = out["dr_grpo mean"] / exact
    out["expected shrinkage (G-1)/G"] = (G - 1) / G

    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    bins = np.linspace(-0.6, 0.8, 71)
    for lab, est in ESTIMATORS.items():
        ax1.hist(samples[lab], bins=bins, histtype="step", lw=1.5,
                 label=f"{est}: mean {out[est + ' mean']:.3f}, std {out[est + ' std']:.3f}")
        ax2.plot(range(1, steps + 1), curves[lab], label=f"{lab} ({est})")
    ax1.axvline(exact, color="k", ls="--", label=f"exact gradient {exact:.2f}")
    ax1.set(title=f"gradient estimates at p=0.5 (groups of G={G})", xlabel="estimate", ylabel="groups")
    ax1.legend(fontsize=8)
    ax2.axhline(0.9, color="grey", ls=":")
    ax2.set(title="SGD on θ (lr 0.5, 8 groups/step, same seed)", xlabel="step", ylabel="p(A)", ylim=(0.4, 1.0))
    ax2.legend(fontsize=8)
    out["png"] = str(save_figure(fig, out_dir, "baseline"))
    return out

"""Lab ``baseline``: which baseline keeps the policy gradient unbiased (docs/design.md §8).

Two-action bandit, p = σ(θ) = P(A), Bernoulli rewards with q_A = 0.75, q_B = 0.35. At
p = 0.5 the exact gradient of the expected reward is p(1−p)(q_A−q_B) = 0.1. Each
estimate is (1/G) Σ_i A_i ∂logπ(a_i)/∂θ over one group of G = 4, with A_i from
:func:`consequence.credit.advantages.group_advantages`.

The lab also prints the three values one sample can give with no baseline (the tutorial,
"The gradient with only two actions"): R(1{a=A} − p) = +0.5 for A rewarded, −0.5 for B
rewarded and 0 for no reward at p = 0.5. A rewarded B is pushed up in its own sample;
only the average, weighted by how often each outcome happens, points towards A.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import cast

import numpy as np
import torch

from consequence.credit.advantages import group_advantages
from consequence.figures import pyplot, save_figure

Q_A, Q_B, G = 0.75, 0.35, 4
# label -> estimator name of group_advantages
ESTIMATORS = {
    "no baseline": "reinforce",
    "self-including mean": "dr_grpo",
    "leave-one-out": "rloo",
    "mean/std (GRPO)": "grpo",
}


def exact_gradient(p: float) -> float:
    """d E[r] / dθ for p = σ(θ): p(1−p)(q_A − q_B)."""
    return p * (1 - p) * (Q_A - Q_B)


def one_sample_estimates(p: float = 0.5) -> dict[str, float]:
    """The single-sample REINFORCE estimate A · ∂logπ(a)/∂θ of every outcome, and its mean.

    A comes from ``group_advantages(..., "reinforce")`` (A = R, no baseline); the score
    ∂logπ(a)/∂θ is autograd's, through ``log_softmax`` of the logits (θ, 0) with
    θ = logit(p), so p = σ(θ) = π(A). Outcomes: ``"A rewarded"``, ``"B rewarded"`` (R = 1),
    ``"A not rewarded"``, ``"B not rewarded"`` (R = 0). ``"mean"`` weights each by its
    probability (p·q_A, (1 − p)·q_B, p·(1 − q_A), (1 − p)·(1 − q_B)): the exact gradient
    (the tutorial, "The gradient with only two actions": +0.5, −0.5, 0, 0 and mean 0.1 at
    p = 0.5).

    Args:
        p: π(A), in (0, 1).

    Returns:
        float values keyed by outcome, plus ``"mean"``.

    Raises:
        ValueError: p not in (0, 1).
    """
    if not 0.0 < p < 1.0:
        raise ValueError(f"p = {p}: π(A) must lie strictly between 0 and 1")
    theta = torch.tensor(math.log(p / (1 - p)), dtype=torch.float64, requires_grad=True)
    logpi = torch.stack([theta, torch.zeros((), dtype=torch.float64)]).log_softmax(0)  # [2]: A, B
    score = [float(g) for g in (torch.autograd.grad(logpi[a], theta, retain_graph=True)[0] for a in (0, 1))]
    outcomes = {
        "A rewarded": (0, 1.0, p * Q_A),
        "B rewarded": (1, 1.0, (1 - p) * Q_B),
        "A not rewarded": (0, 0.0, p * (1 - Q_A)),
        "B not rewarded": (1, 0.0, (1 - p) * (1 - Q_B)),
    }
    # one sample per group: with "reinforce" the advantage is the reward itself
    # every reward is a number, so every member has an advantage (none is None)
    adv = cast(list[float], group_advantages([r for _, r, _ in outcomes.values()], list(outcomes), "reinforce"))
    out = {name: a * score[act] + 0.0 for a, (name, (act, _, _)) in zip(adv, outcomes.items())}  # + 0.0: no "-0"
    out["mean"] = sum(out[name] * prob for name, (_, _, prob) in outcomes.items())
    return out


def _estimates(theta: float, n_groups: int, estimator: str, rng: np.random.Generator) -> np.ndarray:
    """One score-function gradient estimate per group: [n_groups] float64."""
    p = 1.0 / (1.0 + math.exp(-theta))
    took_a = rng.random((n_groups, G)) < p
    reward = (rng.random((n_groups, G)) < np.where(took_a, Q_A, Q_B)).astype(float)
    ids = [str(g) for g in range(n_groups) for _ in range(G)]
    adv = np.array(group_advantages(reward.ravel().tolist(), ids, estimator), dtype=float)
    score = np.where(took_a, 1.0 - p, -p)  # d logπ(a)/dθ
    return (adv.reshape(n_groups, G) * score).mean(axis=1)


def train_curve(estimator: str, seed: int, steps: int = 300, lr: float = 0.5, groups_per_step: int = 8) -> list[float]:
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
    for outcome, value in one_sample_estimates(0.5).items():
        out[f"one-sample estimate (no baseline), {outcome}"] = value
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
        ax1.hist(
            samples[lab],
            bins=bins,
            histtype="step",
            lw=1.5,
            label=f"{est}: mean {out[est + ' mean']:.3f}, std {out[est + ' std']:.3f}",
        )
        ax2.plot(range(1, steps + 1), curves[lab], label=f"{lab} ({est})")
    ax1.axvline(exact, color="k", ls="--", label=f"exact gradient {exact:.2f}")
    ax1.set(title=f"gradient estimates at p=0.5 (groups of G={G})", xlabel="estimate", ylabel="groups")
    ax1.legend(fontsize=8)
    ax2.axhline(0.9, color="grey", ls=":")
    ax2.set(title="SGD on θ (lr 0.5, 8 groups/step, same seed)", xlabel="step", ylabel="p(A)", ylim=(0.4, 1.0))
    ax2.legend(fontsize=8)
    out["png"] = str(save_figure(fig, out_dir, "baseline"))
    return out

"""Lab ``importance``: importance weights correct samples of μ to expectations under π.

μ(A) = 0.2 collects the data, π(A) = 0.6 is the target; the weights π/μ are 3 for A and
0.5 for B. Bernoulli rewards with means r(A) = 0.75, r(B) = 0.35 give
E_π[r] = 0.6·0.75 + 0.4·0.35 = 0.59 (docs/design.md §8). Each estimate averages
w(a)·r over 24 samples drawn from μ.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from consequence.figures import pyplot, save_figure

MU_A, PI_A, R_A, R_B, N_SAMPLES = 0.2, 0.6, 0.75, 0.35, 24


def run(out_dir: Path, seed: int = 0, n_estimates: int = 20_000) -> dict:
    rng = np.random.default_rng(seed)
    w_a, w_b = PI_A / MU_A, (1 - PI_A) / (1 - MU_A)
    target = PI_A * R_A + (1 - PI_A) * R_B
    took_a = rng.random((n_estimates, N_SAMPLES)) < MU_A
    reward = (rng.random(took_a.shape) < np.where(took_a, R_A, R_B)).astype(float)
    weighted = (np.where(took_a, w_a, w_b) * reward).mean(axis=1)
    naive = reward.mean(axis=1)
    out: dict[str, Any] = {  # numbers, and the figure's path
        "weight A (pi/mu)": w_a,
        "weight B (pi/mu)": w_b,
        "exact E_pi[r]": target,
        "exact E_mu[w r]": MU_A * w_a * R_A + (1 - MU_A) * w_b * R_B,
        "estimates": n_estimates,
        "weighted mean": float(weighted.mean()),
        "weighted std (24 samples)": float(weighted.std(ddof=1)),
        "unweighted mean": float(naive.mean()),
        "exact E_mu[r]": MU_A * R_A + (1 - MU_A) * R_B,
        "unweighted std (24 samples)": float(naive.std(ddof=1)),
    }

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bins = np.linspace(0, 1.6, 81)
    ax.hist(
        weighted,
        bins=bins,
        alpha=0.6,
        label=f"importance-weighted: mean {out['weighted mean']:.3f}, std {out['weighted std (24 samples)']:.3f}",
    )
    ax.hist(
        naive,
        bins=bins,
        alpha=0.6,
        label=f"unweighted: mean {out['unweighted mean']:.3f}, std {out['unweighted std (24 samples)']:.3f}",
    )
    ax.axvline(target, color="k", ls="--", label=f"E_π[r] = {target:.2f}")
    ax.set(
        title=f"{N_SAMPLES}-sample estimates from μ(A)={MU_A} of E_π[r], π(A)={PI_A}", xlabel="estimate", ylabel="count"
    )
    ax.legend(fontsize=8)
    out["png"] = str(save_figure(fig, out_dir, "importance"))
    return out

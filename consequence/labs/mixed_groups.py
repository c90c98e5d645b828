"""Lab ``mixed-groups``: how often a group of G binary rewards carries a signal.

A group-relative advantage is zero unless the group's rewards differ; with success
probability p that happens with probability 1 − p^G − (1−p)^G (docs/design.md §8). One point
per marked case is checked by simulation with
:func:`consequence.credit.advantages.mixed_group_fraction`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from consequence.credit.advantages import mixed_group_fraction
from consequence.figures import pyplot, save_figure

MARKS = ((0.5, 4), (0.01, 4), (0.01, 16))
SIMULATED = ((0.5, 4), (0.01, 16))
GS = (2, 4, 8, 16, 64)


def mixed_probability(p: float, G: int) -> float:
    """1 − p^G − (1−p)^G."""
    return 1.0 - p**G - (1.0 - p) ** G


def simulate(p: float, G: int, n_groups: int, rng: np.random.Generator) -> float:
    rewards = (rng.random(n_groups * G) < p).astype(float).tolist()
    ids = [str(g) for g in range(n_groups) for _ in range(G)]
    return mixed_group_fraction(rewards, ids)


def run(out_dir: Path, seed: int = 0, n_groups: int = 20_000) -> dict:
    rng = np.random.default_rng(seed)
    out: dict = {}
    for p, G in MARKS:
        out[f"mixed p={p} G={G}"] = mixed_probability(p, G)
    for p, G in SIMULATED:
        out[f"simulated p={p} G={G} ({n_groups} groups)"] = simulate(p, G, n_groups, rng)

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    ps = 1.0 / (1.0 + np.exp(-np.linspace(-7.0, 7.0, 600)))  # even on the logit axis
    for G in GS:
        ax.plot(ps, [mixed_probability(float(p), G) for p in ps], label=f"G = {G}")
    for p, G in MARKS:
        y = mixed_probability(p, G)
        ax.plot([p], [y], "ko", ms=4)
        ax.annotate(f"{100 * y:.2f} % (p={p}, G={G})", (p, y), textcoords="offset points", xytext=(8, -4), fontsize=8)
    for p, G in SIMULATED:
        ax.plot([p], [out[f"simulated p={p} G={G} ({n_groups} groups)"]], "rx", ms=8)
    ax.set_xscale("logit")
    ax.set(
        title="groups with mixed rewards: 1 − p^G − (1−p)^G (x: simulated)",
        xlabel="success probability p",
        ylabel="fraction of mixed groups",
        ylim=(0, 1.02),
    )
    ax.legend(fontsize=8)
    out["png"] = str(save_figure(fig, out_dir, "mixed-groups"))
    return out

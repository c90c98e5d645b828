"""Lab ``passk``: the unbiased pass@k estimator against the naive plug-in.

From n = 10 samples with c = 2 correct, :func:`consequence.evaluate.stats.pass_at_k`
gives 1 − C(n−c, k)/C(n, k) (0.533 at k = 3); the naive 1 − (1 − c/n)^k (0.488) treats the
samples as if drawn with replacement and underestimates.
"""

from __future__ import annotations

from pathlib import Path

from consequence.evaluate.stats import pass_at_k
from consequence.figures import pyplot, save_figure

N, C = 10, 2


def naive_pass_at_k(n: int, c: int, k: int) -> float:
    """1 − (1 − c/n)^k (biased)."""
    return 1.0 - (1.0 - c / n) ** k


def run(out_dir: Path, seed: int = 0) -> dict:
    ks = list(range(1, N + 1))
    unbiased = [pass_at_k(N, C, k) for k in ks]
    naive = [naive_pass_at_k(N, C, k) for k in ks]
    out: dict = {}
    for k in (1, 3, 5, 9):
        out[f"unbiased pass@{k}"] = unbiased[k - 1]
        out[f"naive pass@{k}"] = naive[k - 1]

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(ks, unbiased, "o-", label="unbiased 1 − C(n−c,k)/C(n,k)")
    ax.plot(ks, naive, "s--", label="naive 1 − (1 − c/n)^k")
    ax.annotate(
        f"k=3: {unbiased[2]:.3f} vs {naive[2]:.3f}",
        (3, unbiased[2]),
        textcoords="offset points",
        xytext=(10, -25),
        fontsize=9,
        arrowprops={"arrowstyle": "->"},
    )
    ax.set(title=f"pass@k from n={N} samples, c={C} correct", xlabel="k", ylabel="pass@k", ylim=(0, 1.05))
    ax.legend()
    out["png"] = str(save_figure(fig, out_dir, "passk"))
    return out

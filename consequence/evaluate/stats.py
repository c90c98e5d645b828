"""Evaluation statistics: pass@k, binomial standard errors, paired bootstrap (docs/design.md §7)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task from n samples with c correct (Chen et al. 2021, §2.1).

    pass@k = 1 − C(n−c, k) / C(n, k), computed in the numerically stable product form
    1 − Π_{i=n−c+1}^{n} (1 − k/i). Example: n = 10, c = 2, k = 3 gives 1 − 56/120 ≈ 0.5333
    (the naive 1 − (1 − c/n)^k = 0.488 is biased).

    Raises:
        ValueError: k < 1, c < 0, n < k, or c > n.
    """
    n, c, k = int(n), int(c), int(k)
    if k < 1:
        raise ValueError(f"pass@k needs k >= 1, got k={k}")
    if c < 0:
        raise ValueError(f"number correct c={c} is negative")
    if n < k:
        raise ValueError(f"pass@{k} needs at least k samples; got n={n}")
    if c > n:
        raise ValueError(f"c={c} correct out of n={n} samples is impossible")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_pass_at_k(counts: Sequence[tuple[int, int]], k: int) -> float:
    """pass@k per task, then averaged over tasks (never from the average pass@1).

    Args:
        counts: one ``(n, c)`` per task (samples, correct). Dropped episodes must stay in
            n (docs/cases.md, case 04).

    Raises:
        ValueError: no tasks, or an invalid (n, c, k) (see :func:`pass_at_k`).
    """
    if len(counts) == 0:
        raise ValueError("mean_pass_at_k: no tasks")
    return math.fsum(pass_at_k(n, c, k) for n, c in counts) / len(counts)


def binomial_se(p: float, n: int) -> float:
    """Standard error sqrt(p(1−p)/n) of a success rate p over n independent tasks.

    Example: 200 tasks at 0.5 → 0.0354; the 95 % half-width 1.96·SE ≈ 6.9 points.

    Raises:
        ValueError: n < 1 or p outside [0, 1].
    """
    if n < 1:
        raise ValueError(f"binomial_se needs n >= 1, got {n}")
    if not (0.0 <= p <= 1.0):
        raise ValueError(f"p={p} is not a probability")
    return math.sqrt(p * (1.0 - p) / n)


def paired_bootstrap_ci(
    a: Sequence[float],
    b: Sequence[float],
    groups: Sequence[str] | None = None,
    confidence: float = 0.95,
    n_resamples: int = 10000,
    seed: int = 0,
    method: str = "percentile",
) -> dict:
    """Paired bootstrap CI of mean(b) − mean(a) over the same episodes, resampled by task.

    ``a[i]`` and ``b[i]`` are the scores of systems A and B on the same episode i.
    Episodes of one task (``groups[i]``) stay together: each system's scores are first
    averaged per group, then ``scipy.stats.bootstrap(..., paired=True)`` resamples the
    groups (Efron & Tibshirani 1993). So every task counts once; ``diff``, ``a_mean`` and
    ``b_mean`` are means over groups of per-group means (equal to episode means when all
    groups have the same size). ``groups=None`` treats each episode as its own group.

    Args:
        method: ``"percentile"`` (default; robust for bounded, discrete scores) or
            ``"BCa"`` (bias-corrected and accelerated), passed to scipy.

    Returns:
        dict with ``diff``, ``low``, ``high`` (CI of the difference), ``a_mean``,
        ``b_mean``, ``n`` (episodes), ``n_groups``, and per-group counts ``b_wins``,
        ``a_wins``, ``ties``. When every per-group difference is equal the bootstrap
        distribution is degenerate and ``low == high == diff``.

    Raises:
        ValueError: lengths differ, fewer than 2 groups, a score is not finite,
            confidence not in (0, 1), or unknown method.
    """
    from scipy import stats

    if method not in ("percentile", "BCa", "basic"):
        raise ValueError(f"unknown method {method!r}; valid: percentile, BCa, basic")
    if not (0.0 < confidence < 1.0):
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    a_arr = np.asarray(a, dtype=float)
    b_arr = np.asarray(b, dtype=float)
    if a_arr.shape != b_arr.shape or a_arr.ndim != 1:
        raise ValueError(f"a and b must be paired 1-D sequences; got {a_arr.shape} and {b_arr.shape}")
    if not (np.isfinite(a_arr).all() and np.isfinite(b_arr).all()):
        raise ValueError("scores must be finite (exclude env_error episodes by a stated rule first)")
    if groups is None:
        groups = [str(i) for i in range(len(a_arr))]
    if len(groups) != len(a_arr):
        raise ValueError(f"{len(groups)} group labels for {len(a_arr)} episodes")
    index: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        index.setdefault(g, []).append(i)
    if len(index) < 2:
        raise ValueError(f"paired bootstrap needs at least 2 groups, got {len(index)}")
    a_g = np.array([a_arr[ix].mean() for ix in index.values()])
    b_g = np.array([b_arr[ix].mean() for ix in index.values()])
    d_g = b_g - a_g
    diff = float(d_g.mean())
    if np.ptp(d_g) == 0.0:
        low = high = diff
    else:
        res = stats.bootstrap(
            (a_g, b_g),
            lambda x, y, axis=-1: np.mean(y, axis=axis) - np.mean(x, axis=axis),
            paired=True,
            vectorized=True,
            confidence_level=confidence,
            n_resamples=n_resamples,
            method=method,
            rng=np.random.default_rng(seed),
        )
        low = float(res.confidence_interval.low)
        high = float(res.confidence_interval.high)
    return {
        "diff": diff,
        "low": low,
        "high": high,
        "a_mean": float(a_g.mean()),
        "b_mean": float(b_g.mean()),
        "n": int(len(a_arr)),
        "n_groups": int(len(index)),
        "b_wins": int((d_g > 0).sum()),
        "a_wins": int((d_g < 0).sum()),
        "ties": int((d_g == 0).sum()),
    }


def bootstrap_mean_ci(
    values: Sequence[float], confidence: float = 0.95, n_resamples: int = 10000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean of per-problem scores (Efron & Tibshirani 1993).

    ``values`` holds one number per problem (e.g. its pass@k), so resampling problems
    keeps the samples of one problem together. Returns ``(low, high)``; a constant input
    gives ``low == high == mean`` (degenerate bootstrap distribution).

    Raises:
        ValueError: fewer than 2 values, a non-finite value, or confidence not in (0, 1).
    """
    from scipy import stats

    if not (0.0 < confidence < 1.0):
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    x = np.asarray(values, dtype=float)
    if x.ndim != 1 or len(x) < 2:
        raise ValueError(f"bootstrap needs at least 2 problems, got {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("values must be finite")
    if np.ptp(x) == 0.0:
        return float(x[0]), float(x[0])
    res = stats.bootstrap(
        (x,),
        np.mean,
        confidence_level=confidence,
        n_resamples=n_resamples,
        method="percentile",
        vectorized=True,
        rng=np.random.default_rng(seed),
    )
    return float(res.confidence_interval.low), float(res.confidence_interval.high)

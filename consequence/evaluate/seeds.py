"""Statistics over training seeds: what a method does, not what one run did (issue 32).

A number about a method has two kinds of noise: which training seed ran (the run) and which
problems and samples evaluated it. The evaluation episodes are fixed by the evaluation seed
(the same for every run, ``--eval-seed``), and these statistics aggregate per-problem
success over the runs of one arm:

* :func:`two_level_bootstrap`: the mean over seeds of each seed's mean over problems, with a
  percentile CI that resamples seeds, then problems within each resampled seed (the
  hierarchical bootstrap of nested data; Davison & Hinkley 1997, §3.8);
* :func:`iqm`: the interquartile mean of per-seed scores (Agarwal et al. 2021, "Deep RL at
  the edge of the statistical precipice", §4: robust to an outlying run, less noisy than the
  median);
* :func:`probability_of_improvement`: P(X > Y) + ½·P(X = Y) for a seed of arm X against a seed
  of arm Y (the same paper's §4, the Mann-Whitney U statistic over n·m pairs);
* :func:`performance_profile`: the share of seeds whose score exceeds each threshold τ (§4).

The ``rliable`` package computes the last three; its bootstrap resamples runs within each
task rather than seeds then problems, and it brings ``arch``, ``seaborn``, ``pandas`` and
``absl``, so these few lines are our own, tested against direct computations.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _table(per_seed: Sequence[Sequence[float]]) -> list[np.ndarray]:
    """Each seed's per-problem scores as float64 arrays; refuses what cannot be aggregated."""
    rows = [np.asarray(r, dtype=np.float64) for r in per_seed]
    if not rows:
        raise ValueError("no training seed: give one row of per-problem scores per seed")
    for s, r in enumerate(rows):
        if r.ndim != 1 or r.size == 0:
            raise ValueError(f"seed {s}: give a non-empty list of per-problem scores, got shape {r.shape}")
        if not np.isfinite(r).all():
            raise ValueError(f"seed {s}: a per-problem score is NaN or infinite")
    return rows


def two_level_bootstrap(
    per_seed: Sequence[Sequence[float]], confidence: float = 0.95, n_boot: int = 10_000, seed: int = 0
) -> tuple[float, float, float]:
    """Mean over seeds of the per-seed mean over problems, with a two-level percentile CI.

    Each of ``n_boot`` resamples draws S seeds with replacement from the S given, then, for
    each drawn seed, as many problems as it has with replacement from its own problems;
    the statistic is the mean over the drawn seeds of their resampled problem means.

    Args:
        per_seed: one row per training seed, each that run's per-problem scores (e.g. the
            success of each test problem; rows may differ in length).
        confidence: of the two-sided percentile interval.
        n_boot: resamples.
        seed: of the resampling generator (the interval is deterministic in it).

    Returns:
        ``(estimate, low, high)``: the estimate is the plain mean of the per-seed means;
        with one seed the interval is over problems only, and it says nothing about seeds.

    Raises:
        ValueError: no seed, an empty or non-finite row, ``confidence`` outside (0, 1),
            ``n_boot`` < 1.
    """
    rows = _table(per_seed)
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    stats = two_level_resamples(per_seed, n_boot, seed)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(stats, [alpha, 1 - alpha])
    return float(np.mean([r.mean() for r in rows])), float(low), float(high)


def two_level_resamples(per_seed: Sequence[Sequence[float]], n_boot: int = 10_000, seed: int = 0) -> np.ndarray:
    """The ``n_boot`` resampled statistics of :func:`two_level_bootstrap`, float64 ``[n_boot]``.

    Raises:
        ValueError: as :func:`two_level_bootstrap`.
    """
    rows = _table(per_seed)
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    rng = np.random.default_rng(seed)
    S = len(rows)
    stats = np.empty(n_boot)
    for start in range(0, n_boot, 1000):  # chunks bound the memory at 1000 × S × P
        b = min(1000, n_boot - start)
        picked = rng.integers(0, S, size=(b, S))
        total = np.zeros(b)
        for s, r in enumerate(rows):
            # every drawn copy of seed s gets its own resample of s's problems: S candidate
            # resamples per row, of which the first (copies of s) count
            copies = (picked == s).sum(axis=1)
            means = r[rng.integers(0, r.size, size=(b, S, r.size))].mean(axis=2)  # [b, S]
            total += (means * (np.arange(S) < copies[:, None])).sum(axis=1)
        stats[start : start + b] = total / S
    return stats


def iqm(scores: Sequence[float]) -> float:
    """Interquartile mean: ``scipy.stats.trim_mean(scores, 0.25)``, the mean after cutting
    ⌊n/4⌋ scores from each end (as rliable's ``aggregate_iqm``; Agarwal et al. 2021, §4).

    Raises:
        ValueError: no score, or a non-finite one.
    """
    from scipy.stats import trim_mean

    x = np.asarray(scores, dtype=np.float64)
    if x.size == 0 or not np.isfinite(x).all():
        raise ValueError("iqm needs at least one finite score")
    return float(trim_mean(x, 0.25))


def probability_of_improvement(x: Sequence[float], y: Sequence[float]) -> float:
    """P(X > Y) + ½·P(X = Y) over every pair of a score of arm X and one of arm Y (per seed).

    Raises:
        ValueError: an empty arm.
    """
    a, b = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if a.size == 0 or b.size == 0:
        raise ValueError("each arm needs at least one score")
    diff = a[:, None] - b[None, :]
    return float(((diff > 0).sum() + 0.5 * (diff == 0).sum()) / diff.size)


def performance_profile(scores: Sequence[float], thresholds: Sequence[float]) -> list[float]:
    """The share of ``scores`` strictly above each threshold τ (a run-score distribution).

    Raises:
        ValueError: no score.
    """
    x = np.asarray(scores, dtype=np.float64)
    if x.size == 0:
        raise ValueError("a performance profile needs at least one score")
    return [float((x > t).mean()) for t in thresholds]

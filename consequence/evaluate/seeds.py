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
* :func:`arm_difference`: arm X − arm Y, two arms with their own training seeds evaluated on
  the same problems: a crossed design (problems are shared, seeds are not), so a resample
  draws the problems once for both arms and each arm's seeds on their own;
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


def arm_difference(
    x: Sequence[Sequence[float]],
    y: Sequence[Sequence[float]],
    confidence: float = 0.95,
    n_boot: int = 10_000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """Arm X − arm Y in mean success, each arm's runs scored on the same P problems, with a
    percentile CI of the crossed bootstrap.

    The statistic is (1/S_X)·Σ_s mean_j x[s, j] − (1/S_Y)·Σ_s mean_j y[s, j]. The training seeds
    of two arms are different runs (seed k of one algorithm is unrelated to seed k of another),
    but the problems are the same ones: each resample draws P problem indices once (shared by
    both arms and all their seeds, so a problem's own difficulty cancels as in a paired test),
    then S_X seeds of X and S_Y seeds of Y with replacement, each arm's on its own (the
    bootstrap of a crossed design; Owen 2007, "The pigeonhole bootstrap", §2). Per chunk of
    at most 1000 resamples the generator draws, in this order, the problems ``[b, P]``, X's
    seeds ``[b, S_X]`` and Y's seeds ``[b, S_Y]``.

    Args:
        x, y: one row per training seed of each arm, the per-problem scores over the same
            problems in the same order (every row of both arms has length P).
        confidence: of the two-sided percentile interval.
        n_boot: resamples.
        seed: of the resampling generator.

    Returns:
        ``(estimate, low, high)``.

    Raises:
        ValueError: as :func:`two_level_bootstrap`, or rows of different lengths.
    """
    rows_x, rows_y = _table(x), _table(y)
    if len({r.size for r in rows_x + rows_y}) != 1:
        raise ValueError("arm_difference needs every seed of both arms scored on the same problems (equal row lengths)")
    X, Y = np.stack(rows_x), np.stack(rows_y)  # [S_X, P], [S_Y, P]
    if not 0 < confidence < 1 or n_boot < 1:
        raise ValueError(f"confidence must be in (0, 1) and n_boot >= 1, got {confidence}, {n_boot}")
    rng = np.random.default_rng(seed)
    P = X.shape[1]
    stats = np.empty(n_boot)
    for start in range(0, n_boot, 1000):
        b = min(1000, n_boot - start)
        problems = rng.integers(0, P, size=(b, P))
        px, py = rng.integers(0, X.shape[0], size=(b, X.shape[0])), rng.integers(0, Y.shape[0], size=(b, Y.shape[0]))
        xm = X[:, problems].mean(axis=2)  # [S_X, b]: each seed's mean over the drawn problems
        ym = Y[:, problems].mean(axis=2)
        cols = np.arange(b)[:, None]
        stats[start : start + b] = xm[px, cols].mean(axis=1) - ym[py, cols].mean(axis=1)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(stats, [alpha, 1 - alpha])
    return float(X.mean(axis=1).mean() - Y.mean(axis=1).mean()), float(low), float(high)


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

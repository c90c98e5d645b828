"""Lag and the bounded-staleness rule (docs/async.md §1–§2).

A policy *version* counts the optimizer updates applied: version v are the weights after
iterations 0 … v−1, so iteration ``it`` trains with version ``it`` and publishes ``it + 1``.
A batch's *lag* is the trainer's version when the batch is consumed minus the version that
sampled it, counted at consumption, so the time a finished batch waited in the queue counts.

Two rules keep lag at most k (``--max-staleness``):

    admission   a batch is started only if, consumed after the batches already started or
                waiting, it would be at most k versions old: position ≤ k, where position is
                the number of started-but-unconsumed batches ahead of it;
    drop        a batch whose lag exceeds k when it is consumed is dropped and counted (it
                finished late: batches started after it were consumed first, or it was re-run
                after a worker died).

With k = 0 the admission rule lets one batch run at a time, sampled with the newest
weights: the synchronous loop. Each worker holds one batch (running, or finished until the
trainer takes it when it asks for its next batch), so N workers keep at most N batches
ahead: batches that finish in order are at most min(k, N) versions old.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

__all__ = ["lag", "may_start", "lag_metrics", "pipeline_warning"]


def lag(trainer_version: int, sampled_version: int) -> int:
    """Versions between the weights that sampled a batch and those it is trained on (≥ 0).

    Raises:
        ValueError: the batch was sampled by a version the trainer has not reached (a
            bookkeeping error: workers only ever receive published versions).
    """
    if sampled_version > trainer_version:
        raise ValueError(
            f"a batch sampled by version {sampled_version} reached the trainer at version "
            f"{trainer_version}: versions are published only after the update that makes them"
        )
    return trainer_version - sampled_version


def may_start(ahead: int, max_staleness: int) -> bool:
    """Admission: a new batch with ``ahead`` started-but-unconsumed batches before it is
    consumed at trainer version (newest published) + ``ahead`` at the earliest, with the
    newest weights: lag ``ahead`` ≤ k."""
    return ahead <= max_staleness


def lag_metrics(consumed: Iterable[int], dropped: Iterable[int]) -> dict[str, object]:
    """Per-iteration metrics of the lags of groups consumed and dropped.

    Args:
        consumed: the lag of every group trained on in the iteration.
        dropped: the lag of every group dropped for staleness while looking for the batch.

    Returns:
        ``lag_histogram`` {lag as str: groups, consumed and dropped}, ``lag_mean`` / ``lag_max``
        over consumed groups (0 when none), ``dropped_stale_groups``.
    """
    consumed, dropped = list(consumed), list(dropped)
    hist = Counter(consumed) + Counter(dropped)
    return {
        "lag_histogram": {str(k): hist[k] for k in sorted(hist)},
        "lag_mean": sum(consumed) / len(consumed) if consumed else 0.0,
        "lag_max": max(consumed, default=0),
        "dropped_stale_groups": len(dropped),
    }


def pipeline_warning(workers: int, max_staleness: int) -> str | None:
    """What a worker count and k leave unused, as a warning line (None when they fit).

    At most k + 1 batches run at once (admission), and each of the N workers holds one
    batch, so N > k + 1 leaves workers waiting, and k > N is never reached by batches that
    finish in order (only an overtaken batch can be older than N; it is kept up to k).
    """
    if workers > max_staleness + 1:
        return (
            f"at most --max-staleness + 1 = {max_staleness + 1} batch(es) can run at once, so "
            f"{workers - max_staleness - 1} of the {workers} rollout workers will wait; raise --max-staleness "
            "to use them (docs/async.md §2)"
        )
    if max_staleness > workers:
        return (
            f"each of the {workers} rollout worker(s) holds one batch, so batches that finish in order are "
            f"at most {workers} version(s) old, not {max_staleness}; use --rollout-workers {max_staleness} "
            "to pipeline that deep (docs/async.md §2)"
        )
    return None

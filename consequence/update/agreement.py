"""What the update ranks agree on (update box, issues 18 and 34): one collective at a time
with a named failure, the same error raised on every rank, and the step's metrics merged.

Shared by the two strategies of ``--update-ranks N`` (``update.data_parallel``: DDP
replicas; ``update.fsdp``: FSDP2 shards). A rank never raises on its own inside a step:
it sends its error (or ``None``) with its shard's result in one ``all_gather_object``, and
every rank then raises the error of the lowest rank that failed (:func:`raise_agreed`),
so no rank waits for a collective another rank will never enter.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from consequence.update.step import NonFiniteError

COUNTS = ("n_tokens", "n_rows", "n_rows_trained", "rows_skipped_zero_advantage", "offpolicy_masked_rows")


class DataParallelError(RuntimeError):
    """A rank died, a collective timed out, or the replicas diverged; the message names
    the rank and what was waited for. The process group cannot be used afterwards."""


class Collective:
    """Runs one collective; a backend error (timeout, dead peer) becomes DataParallelError."""

    def __init__(self, group=None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def __call__(self, what: str, fn: Callable[..., Any], *args, **kw) -> Any:
        try:
            return fn(*args, group=self.group, **kw)
        except RuntimeError as e:  # DistBackendError / gloo timeouts and closed connections
            raise DataParallelError(
                f"update rank {self.rank} of {self.world}: {what} did not complete: every rank must enter it, "
                f"within the process group's timeout (--update-ranks; a rank died, hung or raised outside "
                f"the step): {e}"
            ) from e

    def gather(self, what: str, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order (``all_gather_object``)."""
        out: list[Any] = [None] * self.world
        self("all_gather_object of " + what, dist.all_gather_object, out, obj)
        return out


def error_info(e: BaseException, row_ids: Sequence[int], rank: int) -> dict[str, Any]:
    """What the other ranks need to raise the same error (rows mapped to the step's indices)."""
    info: dict[str, Any] = {
        "rank": rank,
        "type": type(e).__name__,
        "message": str(e),
        "traceback": "".join(traceback.format_exception(e))[-4000:],
    }
    if isinstance(e, NonFiniteError):
        info |= {"tensor": e.tensor, "rows": [row_ids[j] for j in e.rows if 0 <= j < len(row_ids)], "detail": e.detail}
    return info


def raise_agreed(infos: list[dict[str, Any] | None], world: int, own: BaseException | None) -> None:
    """Raise, on every rank, the error of the lowest rank that failed (the same message everywhere)."""
    failed = [i for i in infos if i is not None]
    if not failed:
        return
    info = failed[0]
    where = f"found by update rank {info['rank']} of {world}"
    if info["type"] == "NonFiniteError":
        err: Exception = NonFiniteError(
            info["tensor"], info["rows"], f"{info['detail']}; {where}" if info["detail"] else where
        )
    elif info["type"] == "ValueError":
        err = ValueError(f"{info['message']} ({where})")
    else:
        err = DataParallelError(f"{info['type']}: {info['message']} ({where})\n{info['traceback']}")
    raise err from own


def merge_rank_metrics(per_rank: Sequence[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from the ranks' shard metrics (equal to one process's).

    Rules: ``loss`` (each rank's already scaled to the global totals) and the counts
    (``n_tokens``, ``n_rows``, ``n_rows_trained``, ``rows_skipped_zero_advantage``,
    ``offpolicy_masked_rows``, any other ``n_*``) are summed; ``*_min`` / ``*_max`` are the
    extremes over the ranks that report them; every other key is a per-token mean of the
    targets that ran, weighted by each rank's ``n_tokens`` (ranks that trained no token
    add nothing). A key no rank reports is left out.
    """
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for m in per_rank for k in m):
        have = [m for m in per_rank if key in m]
        if key == "loss" or key in COUNTS or key.startswith("n_"):
            out[key] = math.fsum(float(m[key]) for m in have)
        elif key.endswith("_min"):
            out[key] = min(float(m[key]) for m in have)
        elif key.endswith("_max"):
            out[key] = max(float(m[key]) for m in have)
        else:
            w = [(float(m[key]), float(m.get("n_tokens", 0.0))) for m in have]
            tot = math.fsum(x for _, x in w)
            if tot > 0:
                out[key] = math.fsum(v * x for v, x in w) / tot
    return out

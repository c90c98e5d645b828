"""How much padding-free packing could save over the update's length-sorted padding.

The update sorts a step's rows by length before cutting micro-batches
(``update.step._micro_batches``), so a micro-batch pads only to the longest of rows of
similar length. Packing (one concatenated sequence per micro-batch, per-row positions, a
block-diagonal mask) computes the real tokens only, so on this compute-bound path its
speed-up is at most padded tokens / real tokens. This script measures that ceiling on the
training rows of finished runs (each trajectory's full sequence: its last call's context
and output), for sorted padding and, for comparison, for padding in the batch's own order
(a collator that does not sort). It counts tokens; it times nothing.

Prints a table and writes JSON (``--out``, default ``benchmarks/results/packing_bound.json``).
Run: ``.venv/bin/python benchmarks/packing_bound.py RUN:MICRO_BATCH [RUN:MICRO_BATCH ...]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pyarrow.parquet as pq


def row_lengths(path: Path) -> list[int]:
    """Token length of each trajectory's training row, in the file's order."""
    out = []
    for r in pq.read_table(path, columns=["calls"]).to_pylist():
        if r["calls"]:
            last = r["calls"][-1]
            out.append(len(last["context_ids"]) + len(last["output_ids"]))
    return out


def padded(lengths: list[int], micro: int) -> int:
    """Tokens computed when consecutive ``micro`` rows pad to their longest."""
    return sum(max(lengths[i : i + micro]) * len(lengths[i : i + micro]) for i in range(0, len(lengths), micro))


def bound(run: Path, micro: int) -> dict:
    real = sorted_pad = unsorted_pad = 0
    files = sorted((run / "trajectories").glob("iter_*.parquet"))
    for f in files:
        lengths = row_lengths(f)
        real += sum(lengths)
        sorted_pad += padded(sorted(lengths), micro)
        unsorted_pad += padded(lengths, micro)
    return {
        "run": str(run),
        "micro_batch": micro,
        "iterations": len(files),
        "real_tokens": real,
        "padded_sorted": sorted_pad,
        "padded_unsorted": unsorted_pad,
        "ceiling_vs_sorted": sorted_pad / real,
        "ceiling_vs_unsorted": unsorted_pad / real,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="RUN_FOLDER:MICRO_BATCH_SIZE")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "packing_bound.json")
    args = ap.parse_args()
    rows = []
    for spec in args.runs:
        run, _, micro = spec.rpartition(":")
        if not run or not micro.isdigit() or not (Path(run) / "trajectories").is_dir():
            print(f"error: {spec!r}: give RUN_FOLDER:MICRO_BATCH_SIZE of a run with trajectories/", file=sys.stderr)
            return 2
        rows.append(bound(Path(run), int(micro)))
    print("| run | micro-batch | real tokens | padded (sorted) | ceiling vs sorted | ceiling vs unsorted |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['run']} | {r['micro_batch']} | {r['real_tokens']:,} | {r['padded_sorted']:,} | "
            f"{r['ceiling_vs_sorted']:.3f}× | {r['ceiling_vs_unsorted']:.3f}× |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"command": " ".join(sys.argv), "results": rows}, indent=2))
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

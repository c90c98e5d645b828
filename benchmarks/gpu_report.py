"""The table of ``benchmarks/gpu_check.sh``: per-iteration speed and memory of one run, and
its pre-step checks (the recorded-vs-recomputed log-prob check follows the dtype).

Reads ``RUN/metrics.jsonl`` and ``RUN/manifest.json`` (any run: CPU or CUDA, float32 or
bfloat16), prints a table and writes JSON (``--out``, default
``benchmarks/results/gpu_check.json``; a temporary file, then a rename).
Run: ``.venv/bin/python benchmarks/gpu_report.py RUN [RUN ...] [--out FILE]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

COLUMNS = (
    "rollout_tokens_per_s",
    "rollout_s",
    "credit_s",
    "update_s",
    "iteration_s",
    "peak_rss_gib",
    "device_peak_gib",
)


def summarize(run: Path) -> dict:
    """Medians over the run's iterations of COLUMNS, its devices and dtype, and its checks.

    Raises:
        FileNotFoundError: ``run`` has no metrics.jsonl or manifest.json.
    """
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    manifest = json.loads((run / "manifest.json").read_text())
    med = {}
    for k in COLUMNS:
        vals = [m[k] for m in lines if isinstance(m.get(k), int | float)]
        med[k] = statistics.median(vals) if vals else None
    return {
        "run": str(run),
        "iterations": len(lines),
        "devices": manifest.get("devices") or manifest.get("policy_training", {}).get("devices"),
        "dtype": manifest.get("config", {}).get("dtype", "float32"),  # runs before --dtype: float32
        "medians": med,
        "checks": (manifest.get("checks") or {}).get("results", []),
    }


def _fmt(x) -> str:
    return "—" if x is None else f"{x:,.3g}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gpu_check.json")
    args = ap.parse_args()
    missing = [str(r) for r in args.runs if not (r / "metrics.jsonl").exists() or not (r / "manifest.json").exists()]
    if missing:
        print(
            f"error: no metrics.jsonl / manifest.json in {', '.join(missing)}: give finished run folders",
            file=sys.stderr,
        )
        return 2
    rows = [summarize(r) for r in args.runs]
    print("| run | dtype | iterations | " + " | ".join(COLUMNS) + " |")
    print("|---|---|---|" + "---|" * len(COLUMNS))
    for r in rows:
        print(
            f"| {r['run']} | {r['dtype']} | {r['iterations']} | "
            + " | ".join(_fmt(r["medians"][k]) for k in COLUMNS)
            + " |"
        )
    print("\n(medians over iterations; seconds, tokens/s, GiB)\n")
    for r in rows:
        for c in r["checks"]:
            print(f"{r['run']}: check {c['name']}: {'passed' if c['passed'] else 'FAILED'}: {c['detail']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"command": " ".join(sys.argv), "runs": rows}, indent=2))
    os.replace(tmp, args.out)
    print(f"\nwrote {args.out}")
    return 0 if all(c["passed"] for r in rows for c in r["checks"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())

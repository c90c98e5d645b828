"""Throughput of the synchronous loop vs rollout workers on Ray, on the default task.

    python benchmarks/bench_async.py [--iterations 6] [--out benchmarks/results/bench_async.json]

Each setting is one `consequence train` process on the default task (repair, the tiny warm
start, 16 tasks × 8 rollouts per iteration), without validation or final evaluation, run
one after the other on the same machine. Measured from the run's own files:

    trajectories/s, generated tokens/s   over the training loop (iterations' wall time,
                                         `iteration_s` summed: Ray start and model loading
                                         excluded, shown apart as start_s)
    loop_s                               wall time to the same number of updates
    trainer wait                         seconds the trainer waited for batches (rollout_s)
    mean lag                             versions between sampling and training

Prints a table and writes JSON. Timings on a shared machine are noisy: compare the rows of
one run of this script, as ratios to the synchronous row.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETTINGS = [
    ("sync", []),
    ("1 worker, k=1", ["--rollout-workers", "1", "--max-staleness", "1"]),
    ("2 workers, k=1", ["--rollout-workers", "2", "--max-staleness", "1"]),
    ("2 workers, k=2", ["--rollout-workers", "2", "--max-staleness", "2"]),
]


def run_one(name: str, extra: list[str], iterations: int, folder: Path) -> dict:
    run = folder / name.replace(" ", "_").replace(",", "").replace("=", "")
    cmd = [
        str(Path(sys.executable).with_name("consequence")),
        "train",
        "--iterations",
        str(iterations),
        "--eval-every",
        "0",
        "--final-eval-episodes",
        "0",
        "--skip-checks",
        "--run-dir",
        str(run),
        *extra,
    ]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    total = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(f"{name} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    ms = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    loop = sum(m["iteration_s"] for m in ms)
    trajs = 16 * 8 * len(ms)  # B × G per iteration (no dynamic sampling)
    tokens = sum(m["gen_tokens_total"] for m in ms)
    return {
        "setting": name,
        "iterations": len(ms),
        "loop_s": loop,
        "start_s": total - loop,
        "trajectories_per_s": trajs / loop,
        "tokens_per_s": tokens / loop,
        "trainer_wait_s": sum(m["rollout_s"] for m in ms),
        "update_s": sum(m["update_s"] for m in ms),
        "lag_mean": sum(m.get("lag_mean", 0.0) for m in ms) / len(ms),
        "dropped_stale_groups": sum(m.get("dropped_stale_groups", 0) for m in ms),
        "success_mean": sum(m["success"] for m in ms) / len(ms),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--out", default="benchmarks/results/bench_async.json")
    ap.add_argument("--only", default="", help="settings to run again, separated by ; (the others are kept from --out)")
    args = ap.parse_args()
    only = {s.strip() for s in args.only.split(";") if s.strip()}
    kept = {r["setting"]: r for r in json.loads(Path(args.out).read_text())["rows"]} if only else {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in SETTINGS:
            if only and name not in only:
                rows.append(kept[name])
                continue
            print(f"running {name} ...", flush=True)
            rows.append(run_one(name, extra, args.iterations, Path(tmp)))
    base = rows[0]["loop_s"]
    print(f"\n{args.iterations} iterations of the default task (16 tasks × 8 rollouts), {os.cpu_count()} cores\n")
    print(
        "| setting | loop s | speed-up | trajectories/s | tokens/s | trainer wait s | update s | mean lag | dropped groups | start s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['setting']} | {r['loop_s']:.0f} | {base / r['loop_s']:.2f}× | {r['trajectories_per_s']:.2f} | "
            f"{r['tokens_per_s']:.0f} | {r['trainer_wait_s']:.0f} | {r['update_s']:.0f} | {r['lag_mean']:.2f} | "
            f"{r['dropped_stale_groups']} | {r['start_s']:.0f} |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_suffix(".tmp")
    tmp_out.write_text(json.dumps({"iterations": args.iterations, "cores": os.cpu_count(), "rows": rows}, indent=2))
    tmp_out.replace(out)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

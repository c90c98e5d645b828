"""Learning with bounded staleness k = 0, 1, 2, 4 on the default task, with and without the
correction (the real version of the `lag` lab; docs/async.md §5).

    python benchmarks/bench_staleness.py [--iterations 18] [--episodes 200] [--workers 2]
                                         [--out benchmarks/results/bench_staleness.json]

Each setting is one `consequence train` process on the default task (repair, the tiny warm
start, 16 tasks × 8 rollouts per iteration, GRPO) with N = max(--workers, k) rollout workers
on a local Ray instance (each worker holds one batch, so k deep needs k workers) and
--max-staleness k; "-masked" adds --is-mask token (π_old recomputed by the
trainer, tokens with π_old/μ outside [0.5, 2] left out of the loss, the kept ones not
reweighted), "-mis" adds --is-mask token --tis-cap 2 (kept tokens weighted by π_old/μ:
Liu et al. 2025's token-level masked IS). The final evaluation
is the run's own paired comparison on the test split (sampled at T = 1 with the same seeds for the warm
start and the RL checkpoint; 95 % paired bootstrap CI over problems). Reported per setting:

    RL success, difference to the warm start [CI]     from report.json
    mean lag, dropped fraction                        groups dropped / (consumed + dropped)
    ratio spread                                      min and max of π_old/μ over the run
    sampler–trainer KL                                mean over iterations (k3, nats/token)
    clip fraction                                     mean of clip_frac_low + clip_frac_high

With k > 0, which batch is consumed when depends on timing, so two runs of one setting
can differ; with k = 0 a run is the synchronous run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MASK = ["--is-mask", "token"]
MIS = [*MASK, "--tis-cap", "2"]
# name: (max staleness k, correction options)
SETTINGS = {
    "k0": (0, []),
    "k1": (1, []),
    "k1-masked": (1, MASK),
    "k2": (2, []),
    "k2-masked": (2, MASK),
    "k2-mis": (2, MIS),
    "k4": (4, []),
    "k4-masked": (4, MASK),
    "k4-mis": (4, MIS),
}
DEFAULT = [n for n in SETTINGS if not n.endswith("-mis")]  # the full table; the -mis rows on request (--only)


def run_one(name: str, args, folder: Path) -> dict:
    k, correction = SETTINGS[name]
    workers = max(args.workers, k)  # each worker holds one batch: k deep needs k workers (docs/async.md §2)
    run = folder / name
    cmd = [
        str(Path(sys.executable).with_name("consequence")),
        "train",
        "--iterations",
        str(args.iterations),
        "--rollout-workers",
        str(workers),
        "--max-staleness",
        str(k),
        "--eval-every",
        "0",
        "--final-eval-episodes",
        str(args.episodes),
        "--final-eval-splits",
        "test",
        "--final-eval-decoding",
        "sampled",
        "--run-dir",
        str(run),
        *correction,
    ]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{name} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    ms = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    report = json.loads((run / "report.json").read_text())
    res = next(r for r in report["results"] if r["split"].startswith("test") and r["decoding"] == "sampled")
    cmp = res["comparison"]
    consumed = sum(sum(m["lag_histogram"].values()) - m["dropped_stale_groups"] for m in ms)
    dropped = sum(m["dropped_stale_groups"] for m in ms)
    return {
        "setting": name,
        "max_staleness": k,
        "rollout_workers": workers,
        "masked_is": bool(correction),
        "correction": " ".join(correction),
        "wall_s": time.perf_counter() - t0,
        "warmstart_success": res["warm_start"]["success"],
        "rl_success": res["rl"]["success"],
        "difference": cmp["diff"],
        "ci": [cmp["low"], cmp["high"]],
        "lag_mean": sum(m["lag_mean"] for m in ms) / len(ms),
        "lag_histogram": _sum_hist(ms),
        "dropped_fraction": dropped / max(1, consumed + dropped),
        "is_ratio_min": min(m["is_ratio_min"] for m in ms if "is_ratio_min" in m),
        "is_ratio_max": max(m["is_ratio_max"] for m in ms if "is_ratio_max" in m),
        "sampler_trainer_kl": sum(m.get("sampler_trainer_kl", 0.0) for m in ms) / len(ms),
        "masked_token_fraction": sum(m.get("is_masked_token_fraction", 0.0) for m in ms) / len(ms),
        "clip_fraction": sum(m.get("clip_frac_low", 0.0) + m.get("clip_frac_high", 0.0) for m in ms) / len(ms),
        "train_success_last3": sum(m["success"] for m in ms[-3:]) / 3,
    }


def _sum_hist(ms: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in ms:
        for lag, n in m["lag_histogram"].items():
            out[lag] = out.get(lag, 0) + n
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=18)
    ap.add_argument("--episodes", type=int, default=200, help="final-evaluation episodes on the test split")
    ap.add_argument("--workers", type=int, default=2, help="rollout workers (at least k for max staleness k)")
    ap.add_argument(
        "--only",
        default="",
        help=f"comma-separated settings to run, of {', '.join(SETTINGS)} (default: all but the -mis ones)",
    )
    ap.add_argument("--out", default="benchmarks/results/bench_staleness.json")
    args = ap.parse_args()
    only = {s for s in args.only.split(",") if s}
    if unknown := sorted(only - set(SETTINGS)):
        raise SystemExit(f"--only: unknown setting(s) {', '.join(unknown)}; choose from {', '.join(SETTINGS)}")
    out = Path(args.out)
    rows = json.loads(out.read_text())["rows"] if only and out.exists() else []
    with tempfile.TemporaryDirectory() as tmp:
        for name in SETTINGS:
            if name not in (only or DEFAULT):
                continue
            print(f"running {name} ...", flush=True)
            rows = [r for r in rows if r["setting"] != name] + [run_one(name, args, Path(tmp))]
            _write(out, args, rows)
    print(
        f"\n{args.iterations} iterations × 16 tasks × 8 rollouts, max({args.workers}, k) rollout workers; final "
        f"evaluation: {args.episodes} test episodes, sampled (T = 1), paired with the warm start\n"
    )
    print(
        "| setting | RL success | difference [95 % CI] | mean lag | lags (groups) | dropped | π_old/μ min … max "
        "| sampler–trainer KL | masked tokens | clip fraction | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: list(SETTINGS).index(r["setting"])):
        print(
            f"| {r['setting']} | {r['rl_success']:.1%} | {r['difference'] * 100:+.1f} [{r['ci'][0] * 100:+.1f}, "
            f"{r['ci'][1] * 100:+.1f}] | {r['lag_mean']:.2f} | {r['lag_histogram']} | {r['dropped_fraction']:.1%} | "
            f"{r['is_ratio_min']:.3f} … {r['is_ratio_max']:.2f} | {r['sampler_trainer_kl']:.2e} | "
            f"{r['masked_token_fraction']:.2%} | {r['clip_fraction']:.4f} | {r['wall_s']:.0f} |"
        )
    print(f"\nwrote {out}")


def _write(out: Path, args, rows: list[dict]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"iterations": args.iterations, "episodes": args.episodes, "rows": rows}, indent=2))
    tmp.replace(out)


if __name__ == "__main__":
    main()

"""Distillation against RL on the default task: same warm start, same sampling budget.

Each method is one ``consequence train`` command from the bundled warm start, with the
same iterations × tasks × rollouts (so about the same student tokens generated), then the
run's own final paired evaluation (warm start vs the trained policy, the same sampled
episodes of the test split, paired bootstrap 95 % CI over problems):

- ``grpo``: the default loop (task reward only; no teacher);
- ``on_policy_distill``: ``--recipe on_policy_distill`` (advantage log π_T − log μ per token);
- ``gkd``: ``--recipe gkd`` (JSD_β=0.5 to the teacher over the vocabulary, no reward);
- ``kd_rl``: ``--recipe gkd --task-reward-weight 1`` (the divergence plus GRPO's term);
- ``gkd_lambda``: ``--recipe gkd --distill-lambda 0.5 --distill-data DATA``: half of the
  iterations (a seeded draw) train the JSD on the teacher's own episodes of train problems
  instead of the student's samples (GKD's λ, Agarwal et al. 2024 §3.2). DATA is made once by
  ``consequence eval --model TEACHER --split train -n 1 --no-recovery`` (one sampled episode
  per train problem, T = 1); its generated tokens are counted as ``teacher_generated_tokens``;
- ``rejection_sft``: ``--recipe rejection_sft`` (no teacher: SFT on the student's own
  verified, distinct episodes; acceptance rate and attempts per accepted episode logged).

Teacher: a stronger model with the student's tokenizer, by default the RL checkpoint of the
default run (``runs/repair-default/checkpoints/final``: ``make demo`` makes it).

Run: ``.venv/bin/python benchmarks/distill_compare.py [--teacher DIR] [--iterations 8]``
(about 3 min per method on 2 cores). Prints a table, writes
``benchmarks/results/distill_compare.json`` and ``docs/img/distill-compare.png``
(success against student tokens generated and against teacher forward tokens).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = {
    "grpo": [],
    "on_policy_distill": ["--recipe", "on_policy_distill"],
    "gkd": ["--recipe", "gkd"],
    "kd_rl": ["--recipe", "gkd", "--task-reward-weight", "1"],
    "rejection_sft": ["--recipe", "rejection_sft"],
    "gkd_lambda": ["--recipe", "gkd", "--distill-lambda", "0.5"],
}
NEEDS_TEACHER = ("on_policy_distill", "gkd", "kd_rl", "gkd_lambda")
NEEDS_DATA = ("gkd_lambda",)


def teacher_data(args) -> tuple[Path, int]:
    """The teacher's sampled episodes of every train problem (made once), and their generated tokens."""
    out = Path(args.runs) / "teacher-data"
    if not (out / "episodes.parquet").exists():
        cmd = [
            str(Path(sys.executable).with_name("consequence")),
            "eval",
            "--model",
            str(args.teacher),
            "--split",
            "train",
            "-n",
            "1",
            "--no-recovery",
            "--seed",
            str(args.seed),
            "--out",
            str(out),
        ]
        print("$ " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    from consequence.records import read_trajectories

    trajs = read_trajectories(out / "episodes.parquet")
    return out / "episodes.parquet", sum(t.n_generated_tokens for t in trajs)


def run(method: str, args, run_dir: Path) -> dict:
    """Train one method (or reuse a finished run of the same command) and read its numbers."""
    cmd = [
        str(Path(sys.executable).with_name("consequence")),
        "train",
        *METHODS[method],
        "--iterations",
        str(args.iterations),
        "--seed",
        str(args.seed),
        "--eval-every",
        "0",
        "--final-eval-splits",
        "test",
        "--final-eval-decoding",
        "sampled",
        "--final-eval-episodes",
        str(args.episodes),
        "--run-dir",
        str(run_dir),
    ]
    if method in NEEDS_TEACHER:
        cmd += ["--teacher", str(args.teacher)]
    data_tokens = 0
    if method in NEEDS_DATA:
        data, data_tokens = teacher_data(args)
        cmd += ["--distill-data", str(data)]
    t0 = time.perf_counter()
    if not (run_dir / "report.json").exists() or args.fresh:
        print("$ " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    report = json.loads((run_dir / "report.json").read_text())
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    row = next(r for r in report["results"] if r["decoding"] == "sampled")
    c = row["comparison"]
    return {
        "method": method,
        "command": " ".join(cmd[1:]),
        "iterations": len(metrics),
        "student_tokens": sum(m["gen_tokens_total"] for m in metrics),
        "teacher_forward_tokens": sum(m.get("teacher_forward_tokens", 0.0) for m in metrics),
        "teacher_generated_tokens": data_tokens,
        "fixed_data_iterations": sum(m.get("fixed_data_batch", 0.0) for m in metrics),
        "supervised_positions": sum(m.get("distill_targets", m.get("n_tokens", 0.0)) for m in metrics),
        "acceptance_rate": (
            sum(m["rejection_accepted"] for m in metrics) / max(1.0, sum(m["rejection_attempts"] for m in metrics))
            if "rejection_attempts" in metrics[0]
            else None
        ),
        "warm_start": c["a_mean"],
        "after": c["b_mean"],
        "diff": c["diff"],
        "low": c["low"],
        "high": c["high"],
        "problems": c["n_groups"],
        "episodes": c["n"],
        "train_seconds": report["train_seconds"],
        "wall_s_this_call": wall,
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in (
        (axes[0], "student_tokens", "student tokens generated"),
        (axes[1], "teacher_forward_tokens", "teacher forward tokens"),
    ):
        for r in rows:
            ax.errorbar(
                r[key],
                100 * r["after"],
                yerr=[[100 * (r["diff"] - r["low"])], [100 * (r["high"] - r["diff"])]],
                fmt="o",
                capsize=4,
                label=r["method"],
            )
            ax.annotate(
                r["method"],
                (r[key], 100 * r["after"]),
                textcoords="offset points",
                xytext=(6, 0),
                fontsize=7,
                va="center",
            )
        ax.axhline(100 * rows[0]["warm_start"], color="grey", ls="--", lw=1, label="warm start")
        ax.set_xlim(left=0, right=1.25 * max(r[key] for r in rows) or 1.0)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x / 1000:.0f}k"))
        ax.set_xlabel(label)
        ax.set_ylabel("sampled success, test split (%)")
    axes[0].legend(fontsize=8)
    fig.suptitle("Distillation vs RL from the same warm start (bars: paired 95 % CI of the gain)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def _merged(args, rows: list[dict]) -> list[dict]:
    """The new rows in place of (or after) the same methods' rows of an existing result file of
    the same teacher, iterations, seed and episodes: a method added later joins the table."""
    path = Path(args.out)
    if not path.exists():
        return rows
    old = json.loads(path.read_text())
    same = (old.get("teacher"), old.get("iterations"), old.get("seed"), old.get("episodes")) == (
        str(Path(args.teacher).resolve()),
        args.iterations,
        args.seed,
        args.episodes,
    )
    if not same:
        return rows
    new = {r["method"]: r for r in rows}
    kept = [new.pop(r["method"], r) for r in old["rows"]]
    return kept + list(new.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--teacher", default=str(ROOT / "runs/repair-default/checkpoints/final"))
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--episodes", type=int, default=400, help="final sampled test episodes per arm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--runs", default=str(ROOT / "runs/distill-compare"))
    ap.add_argument("--fresh", action="store_true", help="retrain even where a finished run exists")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/distill_compare.json"))
    ap.add_argument("--plot", default=str(ROOT / "docs/img/distill-compare.png"))
    args = ap.parse_args()
    if not (Path(args.teacher) / "config.json").exists():
        raise SystemExit(
            f"no teacher model at {args.teacher}: run `make demo` (the default run's RL checkpoint) "
            "or give --teacher DIR, a model sharing the bundled tokenizer"
        )
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    rows = _merged(args, [run(m, args, Path(args.runs) / m) for m in methods])
    print(
        "\n| method | student tokens | teacher forward tokens | sampled success, warm start → after | gain [95 % CI] | train s |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['method']} | {r['student_tokens']:,} | {int(r['teacher_forward_tokens']):,} | "
            f"{100 * r['warm_start']:.1f} → {100 * r['after']:.1f} % | {100 * r['diff']:+.1f} "
            f"[{100 * r['low']:+.1f}, {100 * r['high']:+.1f}] | {r['train_seconds']:.0f} |"
        )
    out = {
        "teacher": str(Path(args.teacher).resolve()),
        "iterations": args.iterations,
        "seed": args.seed,
        "episodes": args.episodes,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    plot(rows, Path(args.plot))
    print(f"written: {args.out}, {args.plot}")


if __name__ == "__main__":
    main()

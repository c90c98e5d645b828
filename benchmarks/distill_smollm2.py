"""The real-model distillation experiment: SmolLM2-135M-Instruct teaches a smaller student built
from it (issue 16).

Student: ``consequence shrink smollm2-135m-instruct --layers 10`` (10 of the 30 decoder layers,
evenly spaced, the first and last kept; the same tokenizer, embeddings and width). Task: the
R1-Zero letter-counting setting of ``configs/smollm2-reasoning-gym.yaml`` (reasoning-gym
``letter_counting``, 3–6 words, 2 worked examples; 2,392 train / 299 validation / 300 test
problems). Method: GKD with λ = 0.5 (``--recipe gkd --distill-lambda 0.5``): half of the
iterations (a seeded draw) train JSD_0.5 to the teacher on the student's own samples, the
others on fixed data, the teacher's own sampled answers to train problems (T = 0.7), made
once with ``consequence eval``. The final paired comparison of the run: the shrunk student
(warm start) against the distilled student on the 300 test problems, greedy and sampled;
the teacher's own test success (the same problems and decoding) is measured beside it.

Run: ``python benchmarks/distill_smollm2.py [--iterations 12] [--layers 10]`` (about 25 min on
2 cores). Prints a table and writes ``benchmarks/results/distill_smollm2.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).with_name("consequence"))
TEACHER = "smollm2-135m-instruct"
CONFIG = ROOT / "configs/smollm2-reasoning-gym.yaml"
ENV = [
    "--env",
    "reasoning-gym",
    "--env-option",
    "dataset=letter_counting",
    "--env-option",
    "config={min_words: 3, max_words: 6}",
    "--env-option",
    "size=3000",
    "--env-option",
    "shots=2",
    "--max-turns",
    "1",
    "--max-new-tokens",
    "48",
    "--max-total-tokens",
    "512",
]


def sh(cmd: list[str], done: Path) -> None:
    """Run one CLI command unless its output already exists (reruns reuse finished steps)."""
    if done.exists():
        return
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def teacher_eval(out: Path, split: str, temperature: float, problems: int = 0) -> dict:
    cmd = [
        CLI,
        "eval",
        "--model",
        TEACHER,
        *ENV,
        "--split",
        split,
        "-n",
        "1",
        "--temperature",
        str(temperature),
        "--no-recovery",
        "--out",
        str(out),
    ] + (["--problems", str(problems)] if problems else [])
    sh(cmd, out / "eval.json")
    return json.loads((out / "eval.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--learning-rate", default="5e-5")
    ap.add_argument("--data-problems", type=int, default=256, help="train problems the teacher answers once")
    ap.add_argument("--runs", default=str(ROOT / "runs/distill-smollm2"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/distill_smollm2.json"))
    args = ap.parse_args()
    runs = Path(args.runs)
    student = runs / f"student-{args.layers}l"
    sh([CLI, "shrink", TEACHER, "--layers", str(args.layers), "--out", str(student)], student / "config.json")
    data = teacher_eval(runs / "teacher-data", "train", 0.7, args.data_problems)
    run = runs / "gkd-lambda"
    sh(
        [
            CLI,
            "train",
            "--config",
            str(CONFIG),
            "--model",
            str(student),
            "--recipe",
            "gkd",
            "--teacher",
            TEACHER,
            "--distill-lambda",
            "0.5",
            "--distill-data",
            str(runs / "teacher-data" / "episodes.parquet"),
            "--iterations",
            str(args.iterations),
            "--learning-rate",
            args.learning_rate,
            "--final-eval-splits",
            "test",
            "--run-dir",
            str(run),
        ],
        run / "report.json",
    )
    teacher = {d: teacher_eval(runs / f"teacher-test-{d}", "test", t) for d, t in (("greedy", 0.0), ("sampled", 0.7))}
    report = json.loads((run / "report.json").read_text())
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows = []
    for r in report["results"]:
        c = r["comparison"]
        rows.append(
            {
                "decoding": r["decoding"],
                "student_before": c["a_mean"],
                "student_after": c["b_mean"],
                "diff": c["diff"],
                "low": c["low"],
                "high": c["high"],
                "problems": c["n_groups"],
                "teacher": teacher[r["decoding"]]["cost"]["success"],
            }
        )
    student_its = [m for m in metrics if not m.get("fixed_data_batch")]
    out = {
        "teacher": TEACHER,
        "student_layers": args.layers,
        "iterations": len(metrics),
        "learning_rate": float(args.learning_rate),
        "fixed_data_iterations": sum(m.get("fixed_data_batch", 0.0) for m in metrics),
        "teacher_data_episodes": data["outcomes"]["episodes"],
        "teacher_data_success": data["cost"]["success"],
        "teacher_data_tokens": data["cost"]["gen_tokens_per_episode"] * data["outcomes"]["episodes"],
        "student_tokens": sum(m["gen_tokens_total"] for m in metrics),
        "teacher_forward_tokens": sum(m.get("teacher_forward_tokens", 0.0) for m in metrics),
        "divergence_per_iteration": [m.get("distill_divergence") for m in metrics],
        "student_success_per_iteration": [m["success"] for m in student_its],
        "train_seconds": report["train_seconds"],
        "rows": rows,
    }
    print(
        f"\nstudent: {args.layers} of 30 layers; {out['iterations']} iterations, {out['fixed_data_iterations']:.0f} "
        f"of them on the teacher's data; JSD_0.5 {out['divergence_per_iteration'][0]:.3f} → "
        f"{out['divergence_per_iteration'][-1]:.3f} nats/token; {report['train_seconds'] / 60:.1f} min"
    )
    print("| decoding | student before → after | gain [95 % CI] | teacher |")
    print("|---|---|---|---|")
    for r in rows:
        teacher_s = f"{100 * r['teacher']:.1f} %"
        print(
            f"| {r['decoding']} | {100 * r['student_before']:.1f} → {100 * r['student_after']:.1f} % | "
            f"{100 * r['diff']:+.1f} [{100 * r['low']:+.1f}, {100 * r['high']:+.1f}] | {teacher_s} |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()

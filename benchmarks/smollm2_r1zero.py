"""Full fine-tuning against LoRA on the R1-Zero-style SmolLM2 run (issue 15, measurement 1).

Reads finished ``consequence train`` run folders (their metrics.jsonl, report.json,
manifest.json and, when present, the ``/usr/bin/time -v`` log beside the command), prints
one table and writes ``benchmarks/results/smollm2_r1zero.json``:

- seconds per iteration: rollout and update, means over all iterations, and the update's
  seconds per 32 trained rows (rows of zero advantage are skipped, and how many there are
  differs between the arms, so per-row time is the comparison at equal work);
- peak resident memory of the whole run (``Maximum resident set size`` of ``time -v``);
- the final paired comparison (warm start vs RL, same episodes) per split and decoding,
  with its 95 % bootstrap CI over problems, as report.json has it, and for each arm what
  its answers were, recomputed from the run's ``eval/*.parquet`` episodes: the share of the
  most common answer, the share copied from the question, and the success of the answers
  that are not copies (``consequence.evaluate.compare.summarize``).

The runs themselves (about 23 min each on 2 cores, the final evaluation of 2,400 episodes included):

    /usr/bin/time -v consequence train --config configs/smollm2-reasoning-gym.yaml \\
        --run-dir runs/smollm2-letters-full 2> runs/smollm2-letters-full.time
    /usr/bin/time -v consequence train --config configs/smollm2-reasoning-gym.yaml \\
        --lora-rank 16 --learning-rate 1e-4 --run-dir runs/smollm2-letters-lora 2> runs/smollm2-letters-lora.time

Run: ``python benchmarks/smollm2_r1zero.py full=runs/smollm2-letters-full[:TIME_LOG] lora=... [out=FILE.json]``
(default output: ``benchmarks/results/smollm2_r1zero.json``).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

from consequence.fileio import write_text_atomic

OUT = Path(__file__).with_name("results") / "smollm2_r1zero.json"


def summarize(run: Path, time_log: Path | None) -> dict:
    """Timings, memory, settings and the final comparison of one run folder."""
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    report = json.loads((run / "report.json").read_text())
    manifest = json.loads((run / "manifest.json").read_text())
    trained = [m for m in metrics if m.get("n_rows_trained")]
    rows_trained = sum(m["n_rows_trained"] for m in trained)
    out = {
        "run": str(run),
        "iterations": len(metrics),
        "policy_training": manifest.get("policy_training"),
        "learning_rate": manifest["config"]["learning_rate"],
        "rollout_s_mean": statistics.fmean(m["rollout_s"] for m in metrics),
        "update_s_mean": statistics.fmean(m["update_s"] for m in metrics),
        "update_s_per_32_rows": 32 * sum(m["update_s"] for m in trained) / rows_trained if rows_trained else None,
        "rows_trained": rows_trained,
        "train_seconds": report.get("train_seconds"),
        "success_per_iteration": [m["success"] for m in metrics],
        "entropy_per_iteration": [m.get("entropy") for m in metrics],
        "final": report_rows(report, run),
    }
    if time_log is not None and time_log.is_file():
        kb = re.search(r"Maximum resident set size \(kbytes\): (\d+)", time_log.read_text())
        out["peak_rss_gb"] = int(kb.group(1)) * 1024 / 1e9 if kb else None
    return out


def report_rows(report: dict, run: Path) -> list[dict]:
    """The paired rows of report.json: split, decoding, both arms, difference and CI, plus
    each arm's answer shares from its episodes."""
    from consequence.evaluate.compare import summarize as summarize_episodes
    from consequence.records import read_trajectories

    rows = []
    for r in report.get("results", []):
        c = r["comparison"]
        split = r["split"].split(" ")[0]
        row = {
            "split": split,
            "decoding": r["decoding"],
            "warm_start": c["a_mean"],
            "rl": c["b_mean"],
            "difference": c["diff"],
            "ci_low": c["low"],
            "ci_high": c["high"],
            "problems": c["n_groups"],
            "episodes": c["n"],
        }
        for arm, tag in (("warm_start", "warmstart"), ("rl", "rl")):
            f = run / "eval" / f"{split}-{r['decoding']}-{tag}.parquet"
            if f.is_file():
                s = summarize_episodes(read_trajectories(f))
                row[f"{arm}_answers"] = {
                    k: s[k] for k in ("top_answer", "top_answer_share", "copied_answer_share", "success_not_copied")
                }
        rows.append(row)
    return rows


def main(argv: list[str]) -> None:
    arms, out = {}, OUT
    for arg in argv:
        name, _, spec = arg.partition("=")
        if name == "out":
            out = Path(spec)
            continue
        folder, _, log = spec.partition(":")
        arms[name] = summarize(Path(folder), Path(log) if log else None)
    print(
        f"{'arm':<6} {'trained params':>15} {'rollout s':>10} {'update s':>9} {'update s / 32 rows':>19} "
        f"{'peak GB':>8} {'wall min':>9}"
    )
    for name, a in arms.items():
        pt = a["policy_training"] or {}
        print(
            f"{name:<6} {pt.get('trainable_parameters', 0):>15,} {a['rollout_s_mean']:>10.1f} "
            f"{a['update_s_mean']:>9.1f} {a['update_s_per_32_rows'] or float('nan'):>19.1f} "
            f"{a.get('peak_rss_gb') or float('nan'):>8.1f} {(a['train_seconds'] or 0) / 60:>9.1f}"
        )
    for name, a in arms.items():
        for r in a["final"]:
            print(
                f"{name:<6} {r['split']:<8} {r['decoding']:<8} {100 * r['warm_start']:5.1f} % -> "
                f"{100 * r['rl']:5.1f} %  {100 * r['difference']:+5.1f} pts [{100 * r['ci_low']:+.1f}, "
                f"{100 * r['ci_high']:+.1f}]  ({r['problems']} problems)"
            )
            for arm in ("warm_start", "rl"):
                if ans := r.get(f"{arm}_answers"):
                    print(
                        f"{'':<6} {arm:<10} top answer {100 * ans['top_answer_share']:5.1f} %, copied from the "
                        f"question {100 * ans['copied_answer_share']:5.1f} %, success not copied "
                        f"{100 * ans['success_not_copied']:5.1f} %"
                    )
    write_text_atomic(out, json.dumps(arms, indent=2))
    print(f"written: {out}")


if __name__ == "__main__":
    main(sys.argv[1:])

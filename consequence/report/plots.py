"""Plots and the Markdown report of a training run."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from consequence.fileio import write_text_atomic

_PANELS = [
    ("reward_mean", "train reward (mean)"),
    ("val_success", "validation success (greedy)"),
    ("mixed_group_fraction", "groups with mixed rewards"),
    ("diagnose_first", "episodes that diagnose first"),
    ("entropy", "entropy (nats/token)"),
    ("clip_frac", "clip fraction"),
    ("gen_tokens_mean", "generated tokens / episode"),
    ("tool_calls_mean", "tool calls / episode"),
    ("rollout_tokens_per_s", "rollout tokens/s"),
]


def _overoptimisation(ax, rows: list[dict[str, Any]]) -> str:
    """The learned reward σ(r) and the verifier's success per iteration on one panel: a learned
    reward that keeps rising while success falls is optimised past its agreement with the truth."""
    for key in ("learned_reward_mean", "judge_score_mean", "success"):  # (--judge-url: the judge's score/10)
        pts = [(r["iteration"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), ms=4, label=key)
    ax.legend(fontsize=7)
    return "reward, learned reward, verifier success"


def plot_metrics(metrics_jsonl: Path, out_png: Path) -> None:
    """One panel per curve of ``metrics.jsonl``; written atomically as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(metrics_jsonl).read_text().splitlines() if line.strip()]
    for r in rows:
        r["clip_frac"] = r.get("clip_frac_low", 0.0) + r.get("clip_frac_high", 0.0)
    fig, axes = plt.subplots(3, 3, figsize=(13, 9))
    for ax, (key, title) in zip(axes.flat, _PANELS):
        pts = [(r["iteration"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o" if key == "val_success" else None, ms=4, label=key)
        if key == "reward_mean" and any(
            r.get("learned_reward_mean") is not None or r.get("judge_score_mean") is not None for r in rows
        ):
            title = _overoptimisation(ax, rows)  # --reward-model: the learned reward beside the verifier's success
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("iteration", fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = out_png.with_name(f".{out_png.name}.tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, out_png)


def _seed_line(report: dict[str, Any]) -> list[str]:
    """How many training seeds stand behind the numbers (one, for a run's own report)."""
    seeds = report.get("training_seeds")
    if not seeds:
        return []
    return [
        f"One training seed ({', '.join(map(str, seeds))}; evaluation seed {report.get('eval_seed', '?')}): the "
        "CIs cover problems and evaluation sampling, not training seeds (`consequence experiment` runs several)."
    ]


def _start_line(report: dict[str, Any]) -> list[str]:
    """Which policy is the warm start: the folder RL started from, and a cold start's origin
    (nothing for a report written before it was recorded)."""
    start = report.get("start_model")
    if not start:
        return []
    line = f"Warm start (the policy RL started from): `{start['path']}`"
    cold = start.get("cold_start")
    if cold:
        line += (
            f", the cold start of `{cold['model'] or cold['student']}`: SFT on {cold['verified']} verified "
            f"demonstrations (of {cold['episodes']} demonstrator episodes) of {cold['environment']}, built "
            f"{cold['built']} (cold_start.json)"
        )
    return [line + "."]


def _shortcut_table(results: list[dict[str, Any]]) -> list[str]:
    """Per split and decoding, each shortcut diagnostic (``evaluate.shortcuts``) of the warm
    start → the RL checkpoint; nothing for a report written before they existed."""
    from consequence.evaluate.shortcuts import SHORTCUT_METRICS, format_metric

    rows = [r for r in results if "tool_call_rate" in r.get("rl", {})]
    if not rows:
        return []
    lines = [
        "",
        "Shortcut diagnostics, warm start → RL, per split and decoding (environment errors left out; "
        "— where undefined; definitions: docs/evaluation.md):",
        "",
        "| measure | " + " | ".join(f"{r['split'].split(' ')[0]}, {r['decoding']}" for r in rows) + " |",
        "|---|" + "---|" * len(rows),
    ]
    for key, label in SHORTCUT_METRICS:
        cells = [
            f"{format_metric(key, r['warm_start'].get(key))} → {format_metric(key, r['rl'].get(key))}" for r in rows
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def write_markdown_report(report: dict[str, Any], out_md: Path) -> None:
    """The final comparison as a Markdown table (atomically)."""
    lines = ["# Final report: warm start vs RL checkpoint", ""]
    lines += [f"> **Warning:** {w}\n" for w in report.get("warnings", [])]
    lines += [
        f"Same episodes for both policies; {report['episodes_per_split']} episodes per split; "
        f"budgets {report['budgets']}.",
        "Difference = RL − warm start, with a 95 % paired bootstrap CI over problems "
        "(episodes of one problem resampled together). Environment errors excluded from both arms.",
        *_seed_line(report),
        *_start_line(report),
        "",
        "| split | decoding | warm start | RL | difference | 95 % CI | problems | env errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        c = r["comparison"]
        lines.append(
            f"| {r['split']} | {r['decoding']} | {100 * c['a_mean']:.1f} % | {100 * c['b_mean']:.1f} % | "
            f"{100 * c['diff']:+.1f} pts | [{100 * c['low']:+.1f}, {100 * c['high']:+.1f}] | "
            f"{c['n_groups']} | {c['env_errors_excluded']} |"
        )
    lines += _shortcut_table(report["results"])
    if "train_seconds" in report:
        lines += ["", f"Wall time of the whole run: {report['train_seconds'] / 60:.1f} min."]
    touched = report.get("splits_touched", [])
    if touched:
        lines += ["", "Splits touched:"] + [f"- {t['split']}: {t['purpose']}" for t in touched]
    write_text_atomic(out_md, "\n".join(lines) + "\n")

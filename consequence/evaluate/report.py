"""Reports of ``consequence eval`` and ``compare``: report.md, compare.md and the cost plots.

Every file a report links is written beside it (``cost.png`` for an evaluation,
``cost-a.png`` / ``cost-b.png`` for the two arms of a comparison).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from consequence.evaluate.settings import describe
from consequence.evaluate.shortcuts import SHORTCUT_METRICS, format_metric
from consequence.figures import pyplot, save_figure
from consequence.fileio import strict_json, write_text_atomic
from consequence.records import write_trajectories

# Every file ``consequence eval`` may write into its output folder (``write_outputs``; a
# single-turn evaluation writes eval.json alone).
EVAL_FILES: tuple[str, ...] = ("eval.json", "episodes.parquet", "recovery_episodes.parquet", "report.md", "cost.png")


def remove_stale(out: Path, written: list[str]) -> list[str]:
    """Remove the files of :data:`EVAL_FILES` in ``out`` that this evaluation did not write
    (``written``): an earlier evaluation's, which would otherwise pass for this one's. Other
    files in the folder are left alone. Returns the names removed."""
    stale = [n for n in EVAL_FILES if n not in written and (out / n).is_file()]
    for name in stale:
        (out / name).unlink(missing_ok=True)
    return stale


def write_outputs(ev, out: Path) -> tuple[list[str], list[str]]:
    """eval.json, episodes.parquet (and recovery_episodes.parquet when the recovery
    diagnostic ran), report.md and cost.png into ``out``, each written atomically; the files
    of :data:`EVAL_FILES` an earlier evaluation left there and this one did not write are
    removed (:func:`remove_stale`). ``ev``: an ``EpisodeEval``.

    Returns:
        (the names written, in order; the names of an earlier evaluation's files removed).
    """
    out.mkdir(parents=True, exist_ok=True)
    result = dict(ev.result)
    written = []
    if ev.episodes:
        write_trajectories(out / "episodes.parquet", ev.episodes)
        result["episodes_file"] = str(out / "episodes.parquet")
        written.append("episodes.parquet")
    if ev.recovery_episodes:
        write_trajectories(out / "recovery_episodes.parquet", ev.recovery_episodes)
        result["recovery_episodes_file"] = str(out / "recovery_episodes.parquet")
        written.append("recovery_episodes.parquet")
    written = ["eval.json", *written, "report.md", "cost.png"]
    removed = remove_stale(out, written)
    write_text_atomic(out / "eval.json", strict_json(result, indent=1))
    plot_costs(result, out / "cost.png")
    write_text_atomic(out / "report.md", markdown(result))
    return written, removed


def write_compare(res: dict[str, Any], out: Path) -> None:
    """compare.json, compare.md and each arm's cost plot (cost-a.png, cost-b.png)."""
    out.mkdir(parents=True, exist_ok=True)
    for arm in ("a", "b"):
        plot_costs(res[arm], out / f"cost-{arm}.png")
    write_text_atomic(out / "compare.json", strict_json(res, indent=1, default=str))
    write_text_atomic(out / "compare.md", compare_markdown(res))


def _pct(v: float) -> str:
    return f"{100 * v:.1f} %"


def markdown(result: dict[str, Any], cost_png: str = "cost.png") -> str:
    """The human-readable report of one evaluation (``cost_png``: the plot it links)."""
    s = result["settings"]
    b = s["budgets"]
    lines = [f"# Evaluation: {s['tasks']} / {s['split']}", ""]
    lines += [f"> **Warning:** {w}" for w in result.get("warnings", [])]
    lines += [f"> Note: {n}" for n in result.get("notes", [])]
    lines += [
        f"Model `{s['model']}`; {s['problems']} problem{'s' if s['problems'] != 1 else ''} × n = {s['n']} samples at temperature "
        f"{s['temperature']}, seed {s['seed']}, split seed {s['split_seed']}. Budget per episode: {b['max_turns']} turns, "
        f"{b['max_new_tokens']} tokens per call, {b['max_total_tokens']} tokens in all, "
        f"{b['max_tool_calls']} tool calls."
    ]
    if s.get("provenance"):
        lines += ["", describe(s["provenance"])]
    lines += [
        "",
        "## pass@k (a correct candidate exists among k)",
        "",
        "| k | pass@k | 95 % CI (bootstrap over problems) | binomial SE (k = 1) | tasks | excluded |",
        "|---|---|---|---|---|---|",
    ]
    for k, v in result["pass_at_k"].items():
        se = f"{v['se']:.3f}" if k == "1" else "—"  # pass@k for k > 1 is not a proportion of Bernoulli trials
        lines.append(
            f"| {k} | {v['pass_at_k']:.3f} | [{v['low']:.3f}, {v['high']:.3f}] | {se} | "
            f"{v['tasks']} | {v['tasks_excluded']} |"
        )
    if d := result.get("diversity"):
        lines += [
            "",
            f"Diversity: {d['distinct_correct_mean']:.2f} distinct correct answers per solved task "
            f"({int(d['tasks_solved'])} tasks with a success; {d['distinct_per_solved']:.2f} distinct per "
            "solved episode): pass@k with one answer behind it is sharpening, not new solutions.",
        ]
    o = result["outcomes"]
    lines += [
        "",
        "Outcomes of all episodes (every one stays in the denominator): "
        + ", ".join(f"{name.replace('_', ' ')} {_pct(v)}" for name, v in o["shares"].items())
        + ".",
    ]
    lines += _selection_lines(result.get("final_selection", {}))
    lines += _recovery_lines(result.get("recovery"))
    lines += attempts_lines(result.get("attempts"))
    c = result["cost"]
    lines += [
        "",
        "## Cost and errors",
        "",
        f"Cost per episode: {c['gen_tokens_per_episode']:.1f} generated tokens, "
        f"{c['tool_calls_per_episode']:.2f} tool calls ({100 * c.get('parse_error_fraction', 0.0):.1f} % of all "
        "model calls did not parse, those cut at the token limit and of env-error episodes included), "
        f"{c['wall_s_per_episode']:.2f} s of wall time (the batch's time / episodes); "
        + (
            f"{c['gen_tokens_per_success']:.0f} generated tokens per success"
            if math.isfinite(c.get("gen_tokens_per_success") or math.inf)
            else "no success, so no tokens per success"
        )
        + f" (curves: [{cost_png}]({cost_png})).",
        f"Environment errors: {result['env_errors']} ({result['exclusion_rule']}). Sandbox re-runs: "
        f"{result.get('env_retries', 0)} ({result.get('retry_rule', 'no retry rule recorded')}).",
        f"Isolation: {', '.join(f'{k}={v}' for k, v in s['isolation'].items())}.",
    ]
    lines += shortcut_lines(result.get("shortcuts"))
    lines += [
        "",
        "## Splits touched",
        "",
    ]
    for t in result.get("splits_touched", []):
        lines.append(
            f"- {t['split']} of {t['tasks']} (split seed {t['split_seed']}) by {t['purpose']}, "
            f"{t['time']}; ledger `{t['ledger']}`"
        )
    if s["split"] == "test":
        lines.append("\nThis evaluation touched the **test** split: do not use it to choose settings or checkpoints.")
    return "\n".join(lines) + "\n"


def shortcut_lines(shortcuts: dict[str, Any] | None) -> list[str]:
    """The section of the shortcut diagnostics (``evaluate.shortcuts``): one table row per
    number; nothing for a result written before they existed."""
    if not shortcuts:
        return []
    lines = [
        "",
        "## Shortcut diagnostics",
        "",
        "Is a success a skill or a shortcut? Environment errors left out; the answer is the episode's final "
        "answer (its `final_code`, stripped), the tool value the last tool result that is not an error; "
        "— where undefined (docs/evaluation.md).",
        "",
        "| measure | value |",
        "|---|---|",
    ]
    lines += [f"| {label} | {format_metric(key, shortcuts.get(key))} |" for key, label in SHORTCUT_METRICS]
    return lines


def _selection_lines(sel: dict[str, Any]) -> list[str]:
    if not sel:
        return []
    ks = list(next(iter(sel.values())))
    lines = [
        "",
        "## Final-selection success (one of k candidates submitted, judged by the verifier)",
        "",
        "| rule | " + " | ".join(f"k = {k}" for k in ks) + " |",
        "|---|" + "---|" * len(ks),
    ]
    for rule, by_k in sel.items():
        cells = [f"{v['success']:.3f} [{v['low']:.3f}, {v['high']:.3f}]" for v in by_k.values()]
        lines.append(f"| {rule} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Each task's valid episodes are cut into ⌊n/k⌋ disjoint blocks of k; the rule picks one "
        "submitted candidate per block (first: the first submission; majority: the most frequent final "
        "answer (program, for code); visible: the most visible tests passed), ties to the earliest; a block without a "
        "submission fails. 95 % CI: bootstrap over problems. pass@k above is the oracle's upper bound.",
    ]
    return lines


def attempts_lines(att: dict[str, Any] | None) -> list[str]:
    """The report's recovery-with-feedback table (``eval --attempts k``): success within j attempts
    of one episode beside pass@j of j independent plain episodes, j = 1..k; none without it."""
    if not att:
        return []
    lines = [
        "",
        f"## Recovery with feedback (--attempts {att['k']})",
        "",
        f"{att['episodes']} episodes, each answering up to {att['k']} times (a wrong answer reopened with the "
        "environment's feedback), on the plain episodes' random streams. At j both columns spend up to j "
        "answers per task: success within j attempts sees the verifier's feedback, pass@j draws j independent "
        "samples.",
        "",
        "| j | success within j attempts | pass@j (independent samples) |",
        "|---|---|---|",
    ]
    return lines + [f"| {j} | {v['success_at_attempt']:.3f} | {v['pass_at_k']:.3f} |" for j, v in att["by_j"].items()]


def _recovery_lines(rec: dict[str, Any] | None) -> list[str]:
    if rec is None:
        return []
    if rec.get("not_run"):  # no task has a wrong first patch (e.g. question-answer environments)
        return [
            "",
            "## Recovery from the same wrong first patch",
            "",
            f"Not run: none of the {rec['tasks_without_wrong_patch']} tasks has a wrong first patch to open "
            "with (the diagnostic needs a task's decoy; --no-recovery skips it).",
        ]
    r, p = rec["recovery"], rec["plain_success_same_tasks"]
    return [
        "",
        "## Recovery from the same wrong first patch",
        "",
        f"Every episode opens with {rec['opening']}; the policy continues from the failing report.",
        "",
        "| | success | 95 % CI | problems |",
        "|---|---|---|---|",
        f"| recovered after the wrong patch | {r['pass_at_k']:.3f} | [{r['low']:.3f}, {r['high']:.3f}] | {r['problems']} |",
        f"| plain episodes, same tasks | {p['pass_at_k']:.3f} | [{p['low']:.3f}, {p['high']:.3f}] | {p['problems']} |",
        "",
        f"{rec['tasks']} tasks; {rec['tasks_without_wrong_patch']} tasks without a wrong patch left out; "
        f"{rec['env_errors']} environment errors. The opened state is not the natural one: read the "
        "recovery rate next to the plain success.",
    ]


def compare_markdown(res: dict[str, Any]) -> str:
    """The report of ``consequence compare``: paired differences, then each policy's report."""
    s = res["a"]["settings"]
    lines = [f"# Comparison on {s['tasks']} / {s['split']}", ""]
    lines += [f"> **Warning:** {w}" for w in res["a"].get("warnings", [])]
    lines += [
        f"A = `{res['a']['settings']['model']}`, B = `{res['b']['settings']['model']}`; the same "
        f"{s['problems']} problems × n = {s['n']} episodes with the same seeds for both. B − A with a 95 % "
        "paired bootstrap CI over problems; a pair is dropped when either arm had an environment error."
    ]
    if s.get("provenance"):
        lines += ["", describe(s["provenance"])]
    lines += [
        "",
        "| measure | A | B | B − A | 95 % CI | problems won B / A / tied | pairs excluded |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, what in (("paired", "success"), ("paired_recovery", "recovery after the same wrong first patch")):
        if key in res:
            c = res[key]
            lines.append(
                f"| {what} | {c['a_mean']:.3f} | {c['b_mean']:.3f} | {c['diff']:+.3f} | "
                f"[{c['low']:+.3f}, {c['high']:+.3f}] | {c['b_wins']} / {c['a_wins']} / {c['ties']} | "
                f"{c['env_errors_excluded']} |"
            )
    for arm in ("a", "b"):
        body = markdown({**res[arm], "warnings": []}, cost_png=f"cost-{arm}.png").split("\n", 1)[1]
        lines += ["", f"# Policy {arm.upper()}", body]
    return "\n".join(lines) + "\n"


def plot_costs(result: dict[str, Any], path: Path) -> None:
    """Success against caps on tool calls and on generated tokens, side by side (PNG)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, key, label in (
        (axes[0], "success_vs_tool_call_cap", "tool calls ≤ cap"),
        (axes[1], "success_vs_token_cap", "generated tokens ≤ cap"),
    ):
        caps = [int(c) for c in result[key]]
        ax.plot(caps, list(result[key].values()), marker="o")
        ax.set_xlabel(label)
        ax.set_ylabel("success")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    fig.suptitle(f"success vs cost ({result['settings']['tasks']} / {result['settings']['split']})")
    save_figure(fig, path.parent, path.stem)

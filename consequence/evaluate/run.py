"""``consequence eval`` and ``consequence compare``: evaluate policies on a task split.

Multi-turn sources (``repair``, ``humaneval-repair``) run n episodes per task through the
training harness with fixed budgets; ``humaneval`` samples n single-turn completions
(``consequence.evaluate.completions``). Results go to an output folder: ``eval.json``
(every number, the settings, the budgets, the exclusion rule), ``episodes.parquet``
(raw per-episode results), ``report.md`` and ``cost.png``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from consequence.envs.repair_env import TOOLS
from consequence.envs.sandbox import ENV_RETRIES, isolation_report, run_tests
from consequence.envs.sources import TASK_SOURCES, load_task_source
from consequence.evaluate.compare import ArmResult, paired_comparison
from consequence.evaluate.episode_eval import (EXCLUSION_RULE, cost_summary, outcome_shares, per_task_counts,
                                               success_under_caps, summarize_pass_at_k)
from consequence.evaluate.recovery import recovery_openings
from consequence.evaluate.rollouts import sample_episodes
from consequence.evaluate.selection import SELECTION_RULES, check_rules, summarize_selection
from consequence.evaluate.splits import record_touch, reuse_warning
from consequence.fileio import write_text_atomic
from consequence.figures import pyplot, save_figure
from consequence.harness.renderer import Renderer
from consequence.policy.tiny import load_policy
from consequence.records import Trajectory, write_trajectories
from consequence.rollout.episodes import Budgets
from consequence.seeding import seed_of

EVAL_SOURCES: tuple[str, ...] = (*TASK_SOURCES, "humaneval")
TOOL_CAPS = (1, 2, 3, 4, 5, 6, 8, 10)
TOKEN_CAPS = (32, 64, 96, 128, 192, 256, 384)


def resolve_model(path: str | None, option: str = "--model") -> Path:
    """A checkpoint folder; a run folder means its ``checkpoints/final``; None = the bundled model.

    Raises:
        ValueError: the path does not exist or holds no ``config.json``.
    """
    if path is None:
        from consequence.policy.tiny import BUNDLED

        return BUNDLED
    p = Path(path)
    if (p / "checkpoints" / "final" / "config.json").is_file():
        return p / "checkpoints" / "final"
    if not (p / "config.json").is_file():
        raise ValueError(f"{option} {p}: " + ("no such folder" if not p.exists() else
                         "neither a checkpoint folder (config.json) nor a run folder (checkpoints/final)"))
    return p


def check_request(tasks: str, split: str, n: int, ks: list[int], temperature: float = 1.0,
                  problems: int = 0) -> None:
    """Reject a bad request before any work.

    Raises:
        ValueError: unknown task source or split, n < 1, some k > n or k < 1, a negative
            temperature or number of problems.
    """
    if temperature < 0:
        raise ValueError(f"--temperature {temperature}: must be >= 0 (0 = greedy)")
    if problems < 0:
        raise ValueError(f"--problems {problems}: must be >= 0 (0 = every problem of the split)")
    if tasks not in EVAL_SOURCES:
        raise ValueError(f"--tasks {tasks!r}: valid sources are {', '.join(EVAL_SOURCES)}")
    valid = ("train", "validation", "test", "all") if tasks == "humaneval" else ("train", "validation", "test")
    if split not in valid:
        raise ValueError(f"--split {split!r}: valid splits for {tasks} are {', '.join(valid)}")
    if n < 1:
        raise ValueError(f"-n must be >= 1 (samples per task), got {n}")
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ValueError(f"-k {bad}: every k must be between 1 and n = {n} (pass@k needs n >= k samples)")


@dataclass
class EpisodeEval:
    """One evaluation: the numbers (``result``, what ``eval.json`` holds) and the raw
    scored episodes, plain and (when run) from the recovery diagnostic's opening."""

    result: dict[str, Any]
    episodes: list[Trajectory]
    recovery_episodes: list[Trajectory] = field(default_factory=list)


def evaluate_episodes(model_path: Path, tasks: str, split: str, n: int, ks: list[int], *, problems: int = 0,
                      temperature: float = 1.0, seed: int = 0, budgets: Budgets = Budgets(), split_seed: int = 0,
                      selection: Sequence[str] = SELECTION_RULES, recovery: bool = True,
                      purpose: str = "consequence eval", companions: Sequence[Path] = ()) -> EpisodeEval:
    """n episodes per task of the split's problems (``problems`` of them, drawn with ``seed``, when > 0).

    Reports pass@k (unbiased, per task then averaged, bootstrap CI over problems),
    final-selection success per rule and k, outcome shares (a prompt that does not fit
    stays in the denominator: case 04), cost and success against caps, environment
    errors with the exclusion rule, the recovery diagnostic (n more episodes per task
    that has a wrong first patch), and the split touch (recorded in the ledger once the
    model has loaded, with a warning when policies other than this one and its
    ``companions`` — the other arm of a comparison — were evaluated on test before).

    Raises:
        ValueError: unknown selection rule.
    """
    selection = check_rules(selection)
    source = load_task_source(tasks, split_seed)
    pool = source.split[split]
    count = min(problems, len(pool)) if problems else len(pool)
    task_list = source.sample(split, count, seed=seed_of(seed, "eval", split))
    model, tok = load_policy(model_path)
    mine = [str(model_path), *map(str, companions)]
    warning = reuse_warning(tasks, split_seed, mine) if split == "test" else None
    touch = record_touch(tasks, split_seed, split, purpose, [str(model_path)])
    renderer = Renderer(tok, TOOLS)
    t0 = time.perf_counter()
    trajs = sample_episodes(model, renderer, task_list, n, budgets, seed, temperature)
    plain_wall = time.perf_counter() - t0
    counts = per_task_counts(trajs)
    by_id = {t.task_id: t for t in task_list}
    result = {
        "settings": {"model": str(model_path), "tasks": tasks, "split": split, "split_seed": split_seed,
                     "problems": count, "n": n, "ks": ks, "temperature": temperature, "seed": seed,
                     "budgets": vars(budgets), "isolation": isolation_report()},
        "exclusion_rule": EXCLUSION_RULE,
        "env_errors": sum(d["env_errors"] for d in counts),
        "env_retries": sum(t.env_retries for t in trajs),
        "retry_rule": f"a sandbox that cannot start is re-run (same code, tests, limits) up to {ENV_RETRIES} more "
                      "times; still failing, the episode is an env_error",
        "pass_at_k": summarize_pass_at_k(counts, ks, seed=seed),
        "final_selection": summarize_selection(trajs, ks, selection, lambda t: _visible_passed(t, by_id), seed=seed),
        "outcomes": outcome_shares(trajs),
        "cost": cost_summary(trajs, wall_s=plain_wall),
        "success_vs_tool_call_cap": dict(zip(map(str, TOOL_CAPS), success_under_caps(trajs, "n_tool_calls", TOOL_CAPS))),
        "success_vs_token_cap": dict(zip(map(str, TOKEN_CAPS), success_under_caps(trajs, "n_generated_tokens", TOKEN_CAPS))),
        "per_task": counts,
        "splits_touched": [touch],
        "warnings": [warning] if warning else [],
    }
    rtrajs: list[Trajectory] = []
    if recovery:
        kept, openings = recovery_openings(task_list)
        rtrajs = sample_episodes(model, renderer, kept, n, budgets, seed_of(seed, "recovery"), temperature,
                                 openings=openings) if kept else []
        result["recovery"] = recovery_summary(trajs, rtrajs, len(task_list), seed)
    result["wall_s"] = time.perf_counter() - t0
    return EpisodeEval(result, trajs, rtrajs)


def _visible_passed(t: Trajectory, tasks_by_id: dict) -> int:
    """Visible tests the episode's final program passes (sandboxed; the selection rule's signal)."""
    tests = tasks_by_id[t.task_id].visible_tests
    return run_tests(t.final_code or "", tests).passed if tests else 0


def recovery_summary(trajs: Sequence[Trajectory], recovery_trajs: Sequence[Trajectory], n_tasks: int,
                     seed: int = 0) -> dict[str, Any]:
    """Recovery rate from the wrong first patch beside the plain success on the same tasks.

    Both are the mean over problems of the per-task success rate (pass@1), with a
    bootstrap CI over problems; environment errors are excluded by the same rule.
    """
    ids = {t.group_id for t in recovery_trajs}
    plain = summarize_pass_at_k(per_task_counts([t for t in trajs if t.group_id in ids]), [1], seed=seed)["1"]
    rec = summarize_pass_at_k(per_task_counts(recovery_trajs), [1], seed=seed)["1"]
    return {"opening": "replace_line with the task's first decoy on the bug line, then run_tests",
            "tasks": len(ids), "tasks_without_wrong_patch": n_tasks - len(ids),
            "env_errors": sum(t.outcome == "env_error" for t in recovery_trajs),
            "recovery": rec, "plain_success_same_tasks": plain}


def write_outputs(ev: EpisodeEval, out: Path) -> None:
    """eval.json, episodes.parquet (and recovery_episodes.parquet), report.md and cost.png
    into ``out``, each written atomically."""
    out.mkdir(parents=True, exist_ok=True)
    result = {**ev.result, "episodes_file": str(out / "episodes.parquet")}
    if ev.episodes:
        write_trajectories(out / "episodes.parquet", ev.episodes)
    if ev.recovery_episodes:
        write_trajectories(out / "recovery_episodes.parquet", ev.recovery_episodes)
        result["recovery_episodes_file"] = str(out / "recovery_episodes.parquet")
    write_text_atomic(out / "eval.json", json.dumps(result, indent=1))
    write_text_atomic(out / "report.md", markdown(result))
    _plot_costs(result, out / "cost.png")


def _pct(v: float) -> str:
    return f"{100 * v:.1f} %"


def markdown(result: dict[str, Any]) -> str:
    """The human-readable report of one evaluation."""
    s = result["settings"]
    b = s["budgets"]
    lines = [f"# Evaluation: {s['tasks']} / {s['split']}", ""]
    lines += [f"> **Warning:** {w}" for w in result.get("warnings", [])]
    lines += [f"Model `{s['model']}`; {s['problems']} problem{'s' if s['problems'] != 1 else ''} × n = {s['n']} samples at temperature "
              f"{s['temperature']}, seed {s['seed']}. Budget per episode: {b['max_turns']} turns, "
              f"{b['max_new_tokens']} tokens per call, {b['max_total_tokens']} tokens in all, "
              f"{b['max_tool_calls']} tool calls.", "",
              "## pass@k (a correct candidate exists among k)", "",
              "| k | pass@k | 95 % CI (bootstrap over problems) | binomial SE (k = 1) | tasks | excluded |",
              "|---|---|---|---|---|---|"]
    for k, v in result["pass_at_k"].items():
        se = f"{v['se']:.3f}" if k == "1" else "—"  # pass@k for k > 1 is not a proportion of Bernoulli trials
        lines.append(f"| {k} | {v['pass_at_k']:.3f} | [{v['low']:.3f}, {v['high']:.3f}] | {se} | "
                     f"{v['tasks']} | {v['tasks_excluded']} |")
    o = result["outcomes"]
    lines += ["", "Outcomes of all episodes (every one stays in the denominator): "
              + ", ".join(f"{name.replace('_', ' ')} {_pct(v)}" for name, v in o["shares"].items()) + "."]
    lines += _selection_lines(result.get("final_selection", {}))
    lines += _recovery_lines(result.get("recovery"))
    c = result["cost"]
    lines += ["", "## Cost and errors", "",
              f"Cost per episode: {c['gen_tokens_per_episode']:.1f} generated tokens, "
              f"{c['tool_calls_per_episode']:.2f} tool calls, {c['wall_s_per_episode']:.2f} s of wall time (the batch's time / episodes); "
              f"{c['gen_tokens_per_success']:.0f} generated tokens per success (curves: `cost.png`).",
              f"Environment errors: {result['env_errors']} ({result['exclusion_rule']}). Sandbox re-runs: "
              f"{result.get('env_retries', 0)} ({result.get('retry_rule', 'no retry rule recorded')}).",
              f"Isolation: {', '.join(f'{k}={v}' for k, v in s['isolation'].items())}.", "",
              "## Splits touched", ""]
    for t in result.get("splits_touched", []):
        lines.append(f"- {t['split']} of {t['tasks']} (split seed {t['split_seed']}) by {t['purpose']}, "
                     f"{t['time']}; ledger `{t['ledger']}`")
    if s["split"] == "test":
        lines.append("\nThis evaluation touched the **test** split: do not use it to choose settings or checkpoints.")
    return "\n".join(lines) + "\n"


def _selection_lines(sel: dict[str, Any]) -> list[str]:
    if not sel:
        return []
    ks = list(next(iter(sel.values())))
    lines = ["", "## Final-selection success (one of k candidates submitted, judged on hidden tests)", "",
             "| rule | " + " | ".join(f"k = {k}" for k in ks) + " |", "|---|" + "---|" * len(ks)]
    for rule, by_k in sel.items():
        cells = [f"{v['success']:.3f} [{v['low']:.3f}, {v['high']:.3f}]" for v in by_k.values()]
        lines.append(f"| {rule} | " + " | ".join(cells) + " |")
    lines += ["", "Each task's valid episodes are cut into ⌊n/k⌋ disjoint blocks of k; the rule picks one "
              "submitted candidate per block (first: the first submission; majority: the most frequent final "
              "program; visible: the most visible tests passed), ties to the earliest; a block without a "
              "submission fails. 95 % CI: bootstrap over problems. pass@k above is the oracle's upper bound."]
    return lines


def _recovery_lines(rec: dict[str, Any] | None) -> list[str]:
    if rec is None:
        return []
    r, p = rec["recovery"], rec["plain_success_same_tasks"]
    return ["", "## Recovery from the same wrong first patch", "",
            f"Every episode opens with {rec['opening']}; the policy continues from the failing report.",
            "", "| | success | 95 % CI | problems |", "|---|---|---|---|",
            f"| recovered after the wrong patch | {r['pass_at_k']:.3f} | [{r['low']:.3f}, {r['high']:.3f}] | {r['problems']} |",
            f"| plain episodes, same tasks | {p['pass_at_k']:.3f} | [{p['low']:.3f}, {p['high']:.3f}] | {p['problems']} |",
            "", f"{rec['tasks']} tasks; {rec['tasks_without_wrong_patch']} tasks without a wrong patch left out; "
            f"{rec['env_errors']} environment errors. The opened state is not the natural one: read the "
            "recovery rate next to the plain success."]


def compare_policies(a: Path, b: Path, tasks: str, split: str, n: int, *, ks: Sequence[int] = (1,),
                     problems: int = 0, temperature: float = 1.0, seed: int = 0, budgets: Budgets = Budgets(),
                     recovery: bool = True) -> dict[str, Any]:
    """Both policies on the same task instances with the same seeds; paired difference of
    success (b − a) with a bootstrap CI over problems, and per-problem wins; with
    ``recovery`` the same for the recovery diagnostic (same openings, same seeds). Each
    policy's own report (pass@k and final selection at ``ks``) is kept under "a" / "b"."""
    kw = dict(problems=problems, temperature=temperature, seed=seed, budgets=budgets, recovery=recovery,
              purpose="consequence compare")
    ea = evaluate_episodes(a, tasks, split, n, list(ks), companions=[b], **kw)
    eb = evaluate_episodes(b, tasks, split, n, list(ks), companions=[a], **kw)
    out = {"a": ea.result, "b": eb.result,
           "paired": paired_comparison(ArmResult(str(a), ea.episodes), ArmResult(str(b), eb.episodes), seed=seed)}
    if recovery and ea.recovery_episodes:
        out["paired_recovery"] = paired_comparison(ArmResult(str(a), ea.recovery_episodes),
                                                   ArmResult(str(b), eb.recovery_episodes), seed=seed)
    return out


def compare_markdown(res: dict[str, Any]) -> str:
    """The report of ``consequence compare``: paired differences, then each policy's report."""
    s = res["a"]["settings"]
    lines = [f"# Comparison on {s['tasks']} / {s['split']}", ""]
    lines += [f"> **Warning:** {w}" for w in res["a"].get("warnings", [])]
    lines += [f"A = `{res['a']['settings']['model']}`, B = `{res['b']['settings']['model']}`; the same "
              f"{s['problems']} problems × n = {s['n']} episodes with the same seeds for both. B − A with a 95 % "
              "paired bootstrap CI over problems; a pair is dropped when either arm had an environment error.", "",
              "| measure | A | B | B − A | 95 % CI | problems won B / A / tied | pairs excluded |",
              "|---|---|---|---|---|---|---|"]
    for key, what in (("paired", "success"), ("paired_recovery", "recovery after the same wrong first patch")):
        if key in res:
            c = res[key]
            lines.append(f"| {what} | {c['a_mean']:.3f} | {c['b_mean']:.3f} | {c['diff']:+.3f} | "
                         f"[{c['low']:+.3f}, {c['high']:+.3f}] | {c['b_wins']} / {c['a_wins']} / {c['ties']} | "
                         f"{c['env_errors_excluded']} |")
    if res["a"]["settings"]["model"] == res["b"]["settings"]["model"]:
        lines += ["", "A and B are the same checkpoint folder: the difference measures nothing but the evaluation."]
    for arm in ("a", "b"):
        body = markdown({**res[arm], "warnings": []}).split("\n", 1)[1]
        lines += ["", f"# Policy {arm.upper()}", body]
    return "\n".join(lines) + "\n"


def _plot_costs(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, key, label in ((axes[0], "success_vs_tool_call_cap", "tool calls ≤ cap"),
                           (axes[1], "success_vs_token_cap", "generated tokens ≤ cap")):
        caps = [int(c) for c in result[key]]
        ax.plot(caps, list(result[key].values()), marker="o")
        ax.set_xlabel(label)
        ax.set_ylabel("success")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    fig.suptitle(f"success vs cost ({result['settings']['tasks']} / {result['settings']['split']})")
    save_figure(fig, path.parent, path.stem)

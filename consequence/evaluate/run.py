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
from pathlib import Path
from typing import Any

from consequence.envs.repair_env import TOOLS
from consequence.envs.sandbox import isolation_report
from consequence.envs.sources import TASK_SOURCES, load_task_source
from consequence.evaluate.compare import ArmResult, paired_comparison
from consequence.evaluate.episode_eval import (EXCLUSION_RULE, cost_summary, per_task_counts, success_under_caps,
                                               summarize_pass_at_k)
from consequence.evaluate.rollouts import sample_episodes
from consequence.figures import pyplot, save_figure
from consequence.harness.renderer import Renderer
from consequence.policy.tiny import load_policy
from consequence.records import write_trajectories
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


def evaluate_episodes(model_path: Path, tasks: str, split: str, n: int, ks: list[int], *, problems: int = 0,
                      temperature: float = 1.0, seed: int = 0, budgets: Budgets = Budgets(), split_seed: int = 0):
    """n episodes per task of the split's problems (the first ``problems`` when > 0).

    Returns:
        (result dict for ``eval.json``, scored trajectories).
    """
    source = load_task_source(tasks, split_seed)
    pool = source.split[split]
    count = min(problems, len(pool)) if problems else len(pool)
    task_list = source.sample(split, count, seed=seed_of(seed, "eval", split))
    model, tok = load_policy(model_path)
    renderer = Renderer(tok, TOOLS)
    t0 = time.perf_counter()
    trajs = sample_episodes(model, renderer, task_list, n, budgets, seed, temperature)
    counts = per_task_counts(trajs)
    result = {
        "settings": {"model": str(model_path), "tasks": tasks, "split": split, "split_seed": split_seed,
                     "problems": count, "n": n, "ks": ks, "temperature": temperature, "seed": seed,
                     "budgets": vars(budgets), "isolation": isolation_report()},
        "exclusion_rule": EXCLUSION_RULE,
        "env_errors": sum(d["env_errors"] for d in counts),
        "pass_at_k": summarize_pass_at_k(counts, ks, seed=seed),
        "cost": cost_summary(trajs),
        "success_vs_tool_call_cap": dict(zip(map(str, TOOL_CAPS), success_under_caps(trajs, "n_tool_calls", TOOL_CAPS))),
        "success_vs_token_cap": dict(zip(map(str, TOKEN_CAPS), success_under_caps(trajs, "n_generated_tokens", TOKEN_CAPS))),
        "per_task": counts,
        "wall_s": time.perf_counter() - t0,
    }
    return result, trajs


def write_outputs(result: dict[str, Any], trajs, out: Path) -> None:
    """eval.json, episodes.parquet, report.md and cost.png into ``out`` (each atomically)."""
    out.mkdir(parents=True, exist_ok=True)
    result = {**result, "episodes_file": str(out / "episodes.parquet")}
    if trajs:
        write_trajectories(out / "episodes.parquet", trajs)
    _atomic(out / "eval.json", json.dumps(result, indent=1))
    _atomic(out / "report.md", markdown(result))
    _plot_costs(result, out / "cost.png")


def markdown(result: dict[str, Any]) -> str:
    """The human-readable report of one evaluation."""
    s = result["settings"]
    b = s["budgets"]
    lines = [f"# Evaluation: {s['tasks']} / {s['split']}", "",
             f"Model `{s['model']}`; {s['problems']} problems × n = {s['n']} samples at temperature "
             f"{s['temperature']}, seed {s['seed']}. Budget per episode: {b['max_turns']} turns, "
             f"{b['max_new_tokens']} tokens per call, {b['max_total_tokens']} tokens in all, "
             f"{b['max_tool_calls']} tool calls.", "",
             "| k | pass@k | 95 % CI (bootstrap over problems) | binomial SE | tasks | excluded |",
             "|---|---|---|---|---|---|"]
    for k, v in result["pass_at_k"].items():
        lines.append(f"| {k} | {v['pass_at_k']:.3f} | [{v['low']:.3f}, {v['high']:.3f}] | {v['se']:.3f} | "
                     f"{v['tasks']} | {v['tasks_excluded']} |")
    c = result["cost"]
    lines += ["", f"Cost per episode: {c['gen_tokens_per_episode']:.1f} generated tokens, "
                  f"{c['tool_calls_per_episode']:.2f} tool calls, {c['wall_s_per_episode']:.2f} s; "
                  f"{c['gen_tokens_per_success']:.0f} generated tokens per success.",
              f"Environment errors: {result['env_errors']} ({result['exclusion_rule']}).",
              f"Isolation: {', '.join(f'{k}={v}' for k, v in s['isolation'].items())}.", ""]
    if s["split"] == "test":
        lines.append("This evaluation touched the **test** split: do not use it to choose settings or checkpoints.")
    return "\n".join(lines) + "\n"


def compare_policies(a: Path, b: Path, tasks: str, split: str, n: int, *, problems: int = 0,
                     temperature: float = 1.0, seed: int = 0, budgets: Budgets = Budgets()) -> dict[str, Any]:
    """Both policies on the same task instances with the same seeds; paired difference of
    success (b − a) with a bootstrap CI over problems, and per-problem wins."""
    ra, ta = evaluate_episodes(a, tasks, split, n, [1], problems=problems, temperature=temperature,
                               seed=seed, budgets=budgets)
    rb, tb = evaluate_episodes(b, tasks, split, n, [1], problems=problems, temperature=temperature,
                               seed=seed, budgets=budgets)
    cmp = paired_comparison(ArmResult(str(a), ta), ArmResult(str(b), tb), seed=seed)
    return {"a": ra, "b": rb, "paired": cmp}


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


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)

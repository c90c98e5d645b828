"""Every recipe on the default task with the same budget: test success, wall time, tokens.

Each recipe starts from the bundled warm start and trains for the same number of
iterations (B tasks × G rollouts kept per iteration; DAPO's dynamic sampling generates
more and the table says how many). Then the final policy and the warm start play the
same test-split episodes (same instances, same sampling seeds, temperature 1), and the
table reports success with a 95 % bootstrap CI over problems and the paired difference
to the warm start. One training seed per recipe (stated in the output).

Run: ``python benchmarks/bench_recipes.py [--iterations 10 --test-episodes 400]``.
Writes ``benchmarks/results/recipes.json`` and the table between the markers in
``docs/algorithms.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.console import Console

from consequence.distill.warmstart import BUNDLED
from consequence.envs.registry import load_environment
from consequence.evaluate.compare import ArmResult, paired_comparison, summarize
from consequence.evaluate.rollouts import run_eval
from consequence.evaluate.stats import paired_bootstrap_ci
from consequence.harness.renderer import Renderer
from consequence.loop.train import train
from consequence.policy.tiny import load_policy
from consequence.recipes import BASELINE, differences, load_recipe, recipe_names
from consequence.rollout.episodes import Budgets
from consequence.seeding import seed_of

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- recipes-table:begin -->", "<!-- recipes-table:end -->"


def _success_ci(arm: ArmResult) -> dict:
    s = [x for x in arm.successes() if x is not None]
    groups = [t.task_id.split("#")[0] for t, x in zip(arm.trajectories, arm.successes()) if x is not None]
    ci = paired_bootstrap_ci([0.0] * len(s), s, groups=groups)
    return {"success": ci["b_mean"], "low": ci["low"], "high": ci["high"]}


def _evaluate(model_dir: Path, name: str, env, tasks, seed: int) -> ArmResult:
    model, tok = load_policy(model_dir)
    renderer = Renderer(tok, env.tools)
    budgets = Budgets()
    return ArmResult(name, run_eval(model, renderer, env, tasks, budgets, seed, greedy=False))


def run_recipe(name: str, args, env, tasks, warm: ArmResult) -> dict:
    recipe = load_recipe(name)
    run_dir = Path(args.runs) / name
    cfg = recipe.train_config(
        run_dir=str(run_dir),
        model=str(BUNDLED),
        iterations=args.iterations,
        tasks_per_iteration=args.tasks,
        group_size=args.group,
        seed=args.seed,
        eval_every=0,
        final_eval_episodes=0,
    )
    t0 = time.perf_counter()
    train(cfg, Console(quiet=True))
    wall = time.perf_counter() - t0
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    arm = _evaluate(run_dir / "checkpoints" / "final", name, env, tasks, args.seed)
    changed = sorted(differences(load_recipe(BASELINE), recipe))
    return {
        "recipe": name,
        "title": recipe.title,
        "boxes_changed": changed,
        "train_wall_s": wall,
        "generated_tokens": sum(m["gen_tokens_total"] for m in metrics),
        "episodes_generated": sum(m.get("groups_generated", args.tasks) * args.group for m in metrics),
        "optimizer_steps": sum(m.get("n_updates", 0) for m in metrics),
        "test": _success_ci(arm),
        "vs_warm_start": paired_comparison(warm, arm, seed=args.seed),
        "test_summary": summarize(arm.trajectories),
    }


def table(results: list[dict], warm: dict, args) -> str:
    lines = [
        f"Same budget for every recipe: {args.iterations} iterations × {args.tasks} tasks × {args.group} rollouts "
        f"kept per iteration, from the bundled warm start, training seed {args.seed} (one seed: differences of a "
        f"few points are within seed-to-seed noise). Test split: {args.test_episodes} episodes, sampled at "
        f"temperature 1, the same instances and seeds for every policy. Warm start on the same episodes: "
        f"{100 * warm['success']:.1f} % [{100 * warm['low']:.1f}, {100 * warm['high']:.1f}].",
        "",
        "| recipe | boxes changed vs REINFORCE | test success % [95 % CI] | Δ vs warm start, points [95 % CI] "
        "| train wall time (min) | generated tokens | episodes generated | optimizer steps |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        t, d = r["test"], r["vs_warm_start"]
        lines.append(
            f"| {r['title']} | {', '.join(r['boxes_changed']) or '—'} | {100 * t['success']:.1f} "
            f"[{100 * t['low']:.1f}, {100 * t['high']:.1f}] | {100 * d['diff']:+.1f} [{100 * d['low']:+.1f}, "
            f"{100 * d['high']:+.1f}] | {r['train_wall_s'] / 60:.1f} | {r['generated_tokens']:,.0f} | "
            f"{r['episodes_generated']:,} | {r['optimizer_steps']:.0f} |"
        )
    lines += [
        "",
        f"Produced by `python benchmarks/bench_recipes.py --iterations {args.iterations} "
        f"--test-episodes {args.test_episodes}` (2 CPU cores).",
    ]
    return "\n".join(lines)


def write_docs(text: str, path: Path) -> None:
    doc = path.read_text() if path.exists() else "# Algorithms\n\n" + BEGIN + "\n" + END + "\n"
    if BEGIN not in doc:
        doc += "\n" + BEGIN + "\n" + END + "\n"
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(head + BEGIN + "\n" + text + "\n" + END + tail)
    tmp.replace(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", nargs="*", default=recipe_names())
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--test-episodes", type=int, default=400)
    ap.add_argument("--runs", default=str(ROOT / "benchmarks" / "runs" / "recipes"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "recipes.json"))
    ap.add_argument("--docs", default=str(ROOT / "docs" / "algorithms.md"))
    args = ap.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    env = load_environment("repair", 0)  # the default task, split seed 0 (its test split: make_tasks over it)
    tasks = env.sample("test", args.test_episodes, seed=seed_of(args.seed, "bench-test"))
    warm = _evaluate(BUNDLED, "warm start", env, tasks, args.seed)
    warm_ci = _success_ci(warm)
    print(f"warm start: test success {100 * warm_ci['success']:.1f} %", flush=True)
    results = []
    for name in args.recipes:
        results.append(run_recipe(name, args, env, tasks, warm))
        r = results[-1]
        print(
            f"{name:10s} test {100 * r['test']['success']:.1f} %  Δ {100 * r['vs_warm_start']['diff']:+.1f}  "
            f"wall {r['train_wall_s'] / 60:.1f} min",
            flush=True,
        )
        out = {"args": vars(args), "warm_start": warm_ci, "results": results}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(args.out).with_name(".recipes.json.tmp")
        tmp.write_text(json.dumps(out, indent=2))
        tmp.replace(args.out)
    text = table(results, warm_ci, args)
    print(text)
    write_docs(text, Path(args.docs))


if __name__ == "__main__":
    main()

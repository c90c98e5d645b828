"""``consequence eval`` and ``consequence compare``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from consequence.cli.app import app
from consequence.cli.common import check_model_dir, check_run_dir, console, parse_ks, quiet_libraries


@app.command("eval")
def eval_cmd(model: Optional[str] = typer.Option(None, help="Checkpoint folder, or a run folder (its checkpoints/final); default: the bundled tiny model."),
             tasks: str = typer.Option("repair", help="Task source: repair, humaneval-repair (multi-turn, with tools) or humaneval (single-turn completion)."),
             split: str = typer.Option("validation", help="train, validation or test (humaneval also: all, the 164 problems); the test split is only run when asked for, and the report says so."),
             n: int = typer.Option(10, "-n", help="Samples per task."),
             k: str = typer.Option("1", "-k", help="Comma-separated k of pass@k, each <= n."),
             problems: int = typer.Option(0, help="Evaluate only this many problems of the split (0 = all): drawn with --seed for repair sources, the first ones for humaneval."),
             temperature: float = typer.Option(1.0, help="Sampling temperature (0 = greedy; then n = 1 makes sense)."),
             seed: int = typer.Option(0, help="Seed of the instances and the sampling."),
             selection: str = typer.Option("first,majority,visible", help="Final-selection rules, comma-separated: first (first submission), majority (most frequent final program), visible (most visible tests passed)."),
             recovery: bool = typer.Option(True, help="Also run the recovery diagnostic: n more episodes per task, each opened with the same wrong first patch."),
             out: Path = typer.Option(Path("runs/eval"), help="Output folder: eval.json, episodes.parquet, recovery_episodes.parquet, report.md, cost.png (humaneval: eval.json).")) -> None:
    """Evaluate a policy: pass@k and final-selection success with bootstrap CIs over problems,
    the recovery diagnostic, outcomes, budgets, cost, env errors and the split touched."""
    from consequence.evaluate.run import check_request, evaluate_episodes, resolve_model, write_outputs
    from consequence.evaluate.selection import check_rules

    try:
        ks = parse_ks(k)
        check_request(tasks, split, n, ks, temperature, problems)
        rules = check_rules([r.strip() for r in selection.split(",") if r.strip()])
        model_path = resolve_model(model)
        check_model_dir(str(model_path), chat_template=tasks != "humaneval")
        check_run_dir(out, "--out")
    except ValueError as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(2)
    quiet_libraries()
    if tasks == "humaneval":
        from consequence.envs.code_tasks import load_humaneval
        from consequence.evaluate.completions import evaluate_completions, save_eval

        from consequence.evaluate.splits import record_touch, reuse_warning

        task_list = load_humaneval(split, seed=0)
        if problems:
            task_list = task_list[:problems]
        console.print(f"HumanEval {split}: {len(task_list)} problems × n = {n} completions of {model_path} "
                      "(single-turn: --selection and --recovery do not apply)")
        warning = reuse_warning(tasks, 0, [str(model_path)]) if split == "test" else None
        res = evaluate_completions(model_path, task_list, n=n, ks=tuple(ks), temperature=temperature, seed=seed)
        res.settings |= {"tasks": tasks, "split": split, "split_seed": 0, "warnings": [warning] if warning else [],
                         "splits_touched": [record_touch(tasks, 0, split, "consequence eval", [str(model_path)])]}
        path = save_eval(res, out / "eval.json")
        if warning:
            console.print(f"[yellow]warning:[/] {escape(warning)}")
        console.print(res.summary())
        console.print(f"written: {path}")
        return
    console.print(f"{tasks} {split}: {str(problems) + ' (drawn with --seed)' if problems else 'all'} problems of the split "
                  f"× n = {n} episodes of {model_path}")
    ev = evaluate_episodes(model_path, tasks, split, n, ks, problems=problems, temperature=temperature,
                           seed=seed, selection=rules, recovery=recovery)
    write_outputs(ev, out)
    console.print((out / "report.md").read_text(), markup=False, highlight=False)
    for w in ev.result["warnings"]:
        console.print(f"[yellow]warning:[/] {escape(w)}")
    console.print(f"written: {out}/eval.json, episodes.parquet{', recovery_episodes.parquet' if recovery else ''}, "
                  "report.md, cost.png")


@app.command("compare")
def compare_cmd(a: str = typer.Argument(..., metavar="A", help="Policy A: checkpoint or run folder."),
                b: str = typer.Argument(..., metavar="B", help="Policy B: checkpoint or run folder."),
                tasks: str = typer.Option("repair", help="repair or humaneval-repair."),
                split: str = typer.Option("validation", help="train, validation or test (test only when asked for; choose settings on validation)."),
                n: int = typer.Option(4, "-n", help="Episodes per task for each policy."),
                k: str = typer.Option("1", "-k", help="Comma-separated k of pass@k and final selection in each policy's report, each <= n."),
                problems: int = typer.Option(0, help="Only this many problems, drawn with --seed (0 = all; at least 2 for a CI)."),
                temperature: float = typer.Option(1.0, help="Sampling temperature, the same for both."),
                seed: int = typer.Option(0, help="Seed of the instances and the sampling, the same for both."),
                recovery: bool = typer.Option(True, help="Also compare recovery from the same wrong first patch (n more episodes per task and policy)."),
                out: Path = typer.Option(Path("runs/compare"), help="Output folder for compare.json and compare.md.")) -> None:
    """Two policies on the same tasks and seeds: success of each, paired difference B − A with a
    95 % bootstrap CI over problems, and how many problems each wins."""
    from consequence.fileio import write_text_atomic
    from consequence.evaluate.run import check_request, compare_markdown, compare_policies, resolve_model

    try:
        if tasks == "humaneval":
            raise ValueError("compare runs multi-turn sources (repair, humaneval-repair)")
        ks = parse_ks(k)
        check_request(tasks, split, n, ks, temperature, problems)
        if problems == 1:
            raise ValueError("--problems 1: a paired CI over problems needs at least 2 problems")
        pa, pb = resolve_model(a, "A"), resolve_model(b, "B")
        for p, name in ((pa, "A"), (pb, "B")):
            check_model_dir(str(p), name)
        check_run_dir(out, "--out")
    except ValueError as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(2)
    quiet_libraries()
    res = compare_policies(pa, pb, tasks, split, n, ks=ks, problems=problems, temperature=temperature, seed=seed,
                           recovery=recovery)
    write_text_atomic(out / "compare.json", __import__("json").dumps(res, indent=1, default=str))
    write_text_atomic(out / "compare.md", compare_markdown(res))
    for key, what in (("paired", "success"), ("paired_recovery", "recovery after the same wrong first patch")):
        if key not in res:
            continue
        c = res[key]
        console.print(f"[bold]{what}[/]\nA {escape(str(pa))}: {c['a_mean']:.3f}\nB {escape(str(pb))}: {c['b_mean']:.3f}\n"
                      f"B − A = {c['diff']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}] (95 % CI, bootstrap over "
                      f"{c['n_groups']} problems); problems won: B {c['b_wins']}, A {c['a_wins']}, tied {c['ties']}; "
                      f"env-error pairs excluded: {c['env_errors_excluded']}")
    for w in res["a"]["warnings"]:
        console.print(f"[yellow]warning:[/] {escape(w)}")
    console.print(f"written: {out}/compare.json, compare.md")



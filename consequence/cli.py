"""Command-line interface: ``consequence train | warmstart``."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from consequence.config import TrainConfig

def _quiet_libraries() -> None:
    """Our progress bar is the one to read: silence transformers' load/save bars."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="consequence: reinforcement learning of language-model agents.")
console = Console(soft_wrap=True)


def _train(config: Optional[Path] = None, resume: Optional[Path] = None, **options) -> None:
    given = {k: v for k, v in options.items() if v is not None}
    try:
        if resume is not None:
            from consequence.resume import resume_config

            cfg = resume_config(resume, given, config)
        else:
            cfg = _new_config(config, given)
        _check_model_dir(cfg.model)
        _check_run_dir(Path(cfg.run_dir))
    except ValueError as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(2)
    _run_train(cfg, resume=resume is not None)


def _new_config(config: Optional[Path], given: dict) -> TrainConfig:
    """Recipe, then the YAML file, then the command-line options (ValueError on bad input)."""
    base: dict = {}
    if given.get("recipe"):
        from consequence.recipes import load_recipe

        recipe = load_recipe(given["recipe"])
        base = {"run_dir": f"runs/repair-{recipe.name}", **recipe.config, "recipe": recipe.name}
        given.pop("recipe")
    return TrainConfig.from_yaml(config, base, **given) if config else TrainConfig.checked(**{**base, **given})


def _run_train(cfg: TrainConfig, resume: bool) -> None:
    """Train; a run stopped by a numerics error or a full disk exits 1 with its message."""
    from consequence.train import RunStopped, train

    _quiet_libraries()
    try:
        train(cfg, console, resume=resume)
    except RunStopped as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(1)
    except ValueError as e:  # bad input found while loading (model, resume state)
        console.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(2)


def _check_model_dir(model: str | None, option: str = "--model", chat_template: bool = True) -> None:
    """A local checkpoint needs its config and tokenizer files (checked before any work)."""
    if model is None:
        return
    p = Path(model)
    if not p.is_dir():
        raise ValueError(f"{option} {p}: no such directory (give a local Hugging Face checkpoint folder)")
    missing = [n for n in ("config.json",) if not (p / n).is_file()]
    if not any((p / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
        missing.append("tokenizer.json or tokenizer_config.json")
    if missing:
        raise ValueError(f"{option} {p}: not a Hugging Face checkpoint, missing {', '.join(missing)} "
                         "(save both the model and its tokenizer with save_pretrained)")
    if chat_template and not _has_chat_template(p):
        raise ValueError(f"{option} {p}: the tokenizer has no chat template, which the harness needs to render "
                         "conversations and tool calls; set tokenizer.chat_template (e.g. "
                         "consequence.policy.tiny.chat_template(), Qwen2.5 layout) and save_pretrained it again")


def _has_chat_template(p: Path) -> bool:
    """Where transformers looks for a chat template: its own files, or tokenizer_config.json."""
    import json

    if (p / "chat_template.jinja").is_file() or (p / "chat_template.json").is_file():
        return True
    if any((p / "additional_chat_templates").glob("*.jinja")):
        return True
    try:
        return bool(json.loads((p / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def _check_run_dir(run: Path, option: str = "--run-dir") -> None:
    try:
        run.mkdir(parents=True, exist_ok=True)
        probe = run / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"{option} {run}: cannot write there ({e.strerror or e})") from None


def _train_signature() -> inspect.Signature:
    """One CLI option per TrainConfig field, with the field's description as help text."""
    params = [inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path],
                                default=typer.Option(None, "--config", help="YAML file with the same options; command-line options override it.")),
              inspect.Parameter("resume", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path],
                                default=typer.Option(None, "--resume", metavar="RUN_DIR", help=(
                                    "Continue the run in RUN_DIR from its last resume state (checkpoints/state-NNNN), "
                                    "with the config saved in RUN_DIR/config.yaml; other options must match it.")))]
    for name, field in TrainConfig.model_fields.items():
        ann, choices = _option_type(field.annotation)
        default_text = {"model": "bundled tiny warm start"}.get(name, "none") if field.default is None else str(field.default)
        help_text = field.description + (f" One of: {', '.join(choices)}." if choices else "")
        params.append(inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, annotation=Optional[ann],
            default=typer.Option(None, "--" + name.replace("_", "-"),
                                 help=f"{escape(help_text)} \\[default: {escape(default_text)}]", show_default=False)))
    return inspect.Signature(params)


def _option_type(annotation) -> tuple[type, list[str]]:
    """CLI type of a config field, and its allowed values when it is a Literal."""
    if annotation in (int, float, bool):
        return annotation, []
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is list:
        return list[str], list(typing.get_args(args[0]))
    if typing.get_origin(annotation) is typing.Literal:
        return str, list(args)
    return str, []


_train.__signature__ = _train_signature()


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        console.print(f"consequence {version('consequence')}")
        raise typer.Exit()


@app.callback()
def main(show_version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                           help="Print the version and exit.")) -> None:
    """consequence: reinforcement learning of language-model agents."""
app.command("train", help="Train the policy on the code-repair task (default: GRPO advantages with token-mean and no KL, as in DAPO / Dr.GRPO; --recipe picks another algorithm, e.g. grpo for the paper's settings). Runs end to end on CPU.")(_train)


@app.command("explain")
def explain(recipes: list[str] = typer.Argument(..., help="One recipe (its boxes) or two (their difference): "
                                                          "reinforce, rloo, ppo, grpo, dr_grpo, dapo, gspo, cispo, or YAML paths.")) -> None:
    """Show a recipe as the seven boxes of the loop, or the difference between two recipes."""
    from consequence.recipes import load_recipe
    from consequence.report.explain import render_difference, render_recipe

    try:
        loaded = [load_recipe(r) for r in recipes]
    except ValueError as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(2)
    if len(loaded) == 1:
        render_recipe(loaded[0], console)
    elif len(loaded) == 2:
        render_difference(loaded[0], loaded[1], console)
    else:
        console.print("[red]error:[/] give one recipe, or two to compare")
        raise typer.Exit(2)


@app.command("warmstart")
def warmstart(seed: int = typer.Option(0, help="Seed of the problem split (train split) and the teacher."),
              demos: int = typer.Option(4000, min=10, help="Teacher demonstrations to generate."),
              epochs: float = typer.Option(8.0, min=0.01, help="SFT epochs."),
              force: bool = typer.Option(False, help="Rebuild even if the cached checkpoint exists."),
              bundle: bool = typer.Option(False, help="Write into the package's bundled checkpoint (maintainers).")) -> None:
    """Build (or show) the tiny warm-start checkpoint: scripted teacher demos, then SFT.

    Settings other than the defaults are built once (about 30 min on 2 cores) and cached
    in $CONSEQUENCE_CACHE (default ~/.cache/consequence).
    """
    from consequence.warmstart import BUNDLED, WarmstartConfig, build_warmstart, ensure_warmstart, warmstart_path

    _quiet_libraries()
    cfg = WarmstartConfig(seed=seed, n_demos=demos, sft_epochs=epochs)
    if bundle or force:
        path = build_warmstart(cfg, BUNDLED if bundle else warmstart_path(cfg), console.print)
    else:
        path = ensure_warmstart(cfg, console.print)
    console.print(f"warm-start checkpoint: {path}")


@app.command("lab")
def lab(name: str = typer.Argument(..., help="Lab to run (see docs/labs.md)."),
        out: Path = typer.Option(Path("runs/labs"), help="Folder for the lab's PNG."),
        seed: int = typer.Option(0, help="Random seed of the lab.")) -> None:
    """Run one lab: print its numbers and write its figure (docs/labs.md)."""
    from rich.table import Table

    from consequence.labs import LABS

    if name not in LABS:
        console.print(f"[red]error:[/] unknown lab {escape(name)!r}; labs: {', '.join(LABS)}")
        raise typer.Exit(2)
    result = dict(LABS[name](out, seed=seed))
    png = result.pop("png")
    table = Table(title=f"lab {name} (seed {seed})")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    for key, value in result.items():
        table.add_row(escape(key), f"{value:.4f}" if isinstance(value, float) else escape(str(value)))
    console.print(table)
    console.print(f"figure: {png}")


@app.command("reproduce")
def reproduce_cmd(run: Path = typer.Argument(..., help="Run folder with a manifest.json."),
                  run_dir: Optional[Path] = typer.Option(None, help="Folder of the new run (default: RUN-reproduce).")) -> None:
    """Run a training job again from its manifest and compare the metrics of the two runs."""
    from rich.table import Table

    from consequence.report.manifest import read_manifest
    from consequence.reproduce import compare_metrics, drift, reproduce_config

    try:
        cfg = reproduce_config(run, run_dir)
        _check_run_dir(Path(cfg.run_dir))
        differences = drift(read_manifest(run))
    except ValueError as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(2)
    for d in differences:
        console.print(f"[yellow]differs from the recorded run:[/] {escape(d)}")
    _run_train(cfg, resume=False)
    table = Table(title=f"{run} vs {cfg.run_dir}")
    for col in ("iteration", "reward then", "reward now", "max |Δ| of compared metrics"):
        table.add_column(col, justify="right")
    for r in compare_metrics(run, Path(cfg.run_dir)):
        table.add_row(str(r["iteration"]), f"{r['reward_then']:.4f}", f"{r['reward_now']:.4f}", f"{r['max_abs_diff']:.2e}")
    console.print(table)


def _ks(text: str) -> list[int]:
    try:
        ks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        ks = []
    if not ks:
        raise ValueError(f"-k {text!r}: give comma-separated integers, e.g. 1,4,16")
    return ks


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
        ks = _ks(k)
        check_request(tasks, split, n, ks, temperature, problems)
        rules = check_rules([r.strip() for r in selection.split(",") if r.strip()])
        model_path = resolve_model(model)
        _check_model_dir(str(model_path), chat_template=tasks != "humaneval")
        _check_run_dir(out, "--out")
    except ValueError as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(2)
    _quiet_libraries()
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
        ks = _ks(k)
        check_request(tasks, split, n, ks, temperature, problems)
        if problems == 1:
            raise ValueError("--problems 1: a paired CI over problems needs at least 2 problems")
        pa, pb = resolve_model(a, "A"), resolve_model(b, "B")
        for p, name in ((pa, "A"), (pb, "B")):
            _check_model_dir(str(p), name)
        _check_run_dir(out, "--out")
    except ValueError as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(2)
    _quiet_libraries()
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


@app.command("view")
def view(run_dir: Path = typer.Argument(..., help="Run directory of `consequence train`."),
         out: Optional[Path] = typer.Option(None, help="HTML file to write [default: RUN_DIR/viewer.html]."),
         iteration: Optional[int] = typer.Option(None, help="Show only this iteration (0-based, as in trajectories/iter_NNNN.parquet)."),
         with_current_logprobs: bool = typer.Option(False, help="Recompute each token's log-prob with the checkpoint saved "
                                                    "after its iteration (else final): one forward pass per trajectory."),
         limit: int = typer.Option(200, min=1, help="Most trajectories on the page (whole groups, spread over iterations).")) -> None:
    """Write one static HTML page of a run's trajectories, tokens coloured by loss-mask role (docs/viewer.md)."""
    from consequence.report.viewer import ViewerError, build_page, write_page

    try:
        html, summary = build_page(run_dir, iteration, with_current_logprobs, limit, log=console.print)
    except ViewerError as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(2)
    path = write_page(html, out or run_dir / "viewer.html")
    left = f", {summary['n_left_out']} left out (page limit {limit})" if summary["n_left_out"] else ""
    console.print(f"{summary['n_shown']} trajectories{left}: {path} ({len(html.encode()) / 1e6:.2f} MB)")


if __name__ == "__main__":
    app()

"""``consequence train`` (one option per TrainConfig field) and ``consequence reproduce``."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from consequence.cli.app import app
from consequence.cli.common import check_model_dir, check_run_dir, console, quiet_libraries
from consequence.config import TrainConfig


def _train(config: Optional[Path] = None, resume: Optional[Path] = None, **options) -> None:
    given = {k: v for k, v in options.items() if v is not None}
    try:
        if resume is not None:
            from consequence.resume import resume_config

            cfg = resume_config(resume, given, config)
        else:
            cfg = _new_config(config, given)
        check_model_dir(cfg.model)
        check_run_dir(Path(cfg.run_dir))
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

    quiet_libraries()
    try:
        train(cfg, console, resume=resume)
    except RunStopped as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(1)
    except ValueError as e:  # bad input found while loading (model, resume state)
        console.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(2)


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


app.command("train", help="Train the policy on the code-repair task (default: GRPO advantages with token-mean and no KL, as in DAPO / Dr.GRPO; --recipe picks another algorithm, e.g. grpo for the paper's settings). Runs end to end on CPU.")(_train)


@app.command("reproduce")
def reproduce_cmd(run: Path = typer.Argument(..., help="Run folder with a manifest.json."),
                  run_dir: Optional[Path] = typer.Option(None, help="Folder of the new run (default: RUN-reproduce).")) -> None:
    """Run a training job again from its manifest and compare the metrics of the two runs."""
    from rich.table import Table

    from consequence.report.manifest import read_manifest
    from consequence.reproduce import compare_metrics, drift, reproduce_config

    try:
        cfg = reproduce_config(run, run_dir)
        check_run_dir(Path(cfg.run_dir))
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



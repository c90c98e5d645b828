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


def _train(config: Optional[Path] = None, **options) -> None:
    given = {k: v for k, v in options.items() if v is not None}
    try:
        base: dict = {}
        if given.get("recipe"):
            from consequence.recipes import load_recipe

            recipe = load_recipe(given["recipe"])
            base = {"run_dir": f"runs/repair-{recipe.name}", **recipe.config, "recipe": recipe.name}
            given.pop("recipe")
        cfg = TrainConfig.from_yaml(config, base, **given) if config else TrainConfig.checked(**{**base, **given})
        _check_model_dir(cfg.model)
        _check_run_dir(Path(cfg.run_dir))
    except ValueError as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(2)
    from consequence.train import train

    _quiet_libraries()
    train(cfg, console)


def _check_model_dir(model: str | None) -> None:
    """A local checkpoint needs its config and tokenizer files (checked before any work)."""
    if model is None:
        return
    p = Path(model)
    if not p.is_dir():
        raise ValueError(f"--model {p}: no such directory (give a local Hugging Face checkpoint folder)")
    missing = [n for n in ("config.json",) if not (p / n).is_file()]
    if not any((p / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
        missing.append("tokenizer.json or tokenizer_config.json")
    if missing:
        raise ValueError(f"--model {p}: not a Hugging Face checkpoint, missing {', '.join(missing)} "
                         "(save both the model and its tokenizer with save_pretrained)")


def _check_run_dir(run: Path) -> None:
    try:
        run.mkdir(parents=True, exist_ok=True)
        probe = run / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"--run-dir {run}: cannot write there ({e.strerror or e})") from None


def _train_signature() -> inspect.Signature:
    """One CLI option per TrainConfig field, with the field's description as help text."""
    params = [inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path],
                                default=typer.Option(None, "--config", help="YAML file with the same options; command-line options override it."))]
    for name, field in TrainConfig.model_fields.items():
        ann, choices = _option_type(field.annotation)
        default_text = "bundled tiny warm start" if field.default is None else str(field.default)
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
app.command("train", help="Train the policy on the code-repair task (default: GRPO; --recipe picks another algorithm). Runs end to end on CPU.")(_train)


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

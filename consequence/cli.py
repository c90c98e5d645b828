"""Command-line interface: ``consequence train | warmstart``."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from consequence.config import TrainConfig

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="consequence: reinforcement learning of language-model agents.")
console = Console(soft_wrap=True)


def _train(config: Optional[Path] = None, **options) -> None:
    given = {k: v for k, v in options.items() if v is not None}
    try:
        cfg = TrainConfig.from_yaml(config, **given) if config else TrainConfig.checked(**given)
    except ValueError as e:
        console.print(f"[red]error:[/] {e}")
        raise typer.Exit(2)
    if cfg.model and not Path(cfg.model).is_dir():
        console.print(f"[red]error:[/] --model {cfg.model}: no such directory (give a local Hugging Face checkpoint)")
        raise typer.Exit(2)
    from consequence.train import train

    train(cfg, console)


def _train_signature() -> inspect.Signature:
    """One CLI option per TrainConfig field, with the field's description as help text."""
    params = [inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path],
                                default=typer.Option(None, "--config", help="YAML file with the same options; command-line options override it."))]
    for name, field in TrainConfig.model_fields.items():
        ann = field.annotation if field.annotation in (int, float) else str
        default_text = "bundled tiny warm start" if field.default is None else str(field.default)
        params.append(inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, annotation=Optional[ann],
            default=typer.Option(None, "--" + name.replace("_", "-"), help=f"{field.description} [default: {default_text}]",
                                 show_default=False)))
    return inspect.Signature(params)


_train.__signature__ = _train_signature()
app.command("train", help="Train the policy with GRPO on the code-repair task (defaults run end to end on CPU).")(_train)


@app.command("warmstart")
def warmstart(seed: int = typer.Option(0, help="Seed of the task split and the teacher."),
              demos: int = typer.Option(4000, help="Teacher demonstrations to generate."),
              epochs: float = typer.Option(8.0, help="SFT epochs."),
              force: bool = typer.Option(False, help="Rebuild even if the cached checkpoint exists."),
              bundle: bool = typer.Option(False, help="Write into the package's bundled checkpoint (maintainers).")) -> None:
    """Build (or show) the tiny warm-start checkpoint: scripted teacher demos, then SFT."""
    from consequence.warmstart import BUNDLED, WarmstartConfig, build_warmstart, ensure_warmstart, warmstart_path

    cfg = WarmstartConfig(seed=seed, n_demos=demos, sft_epochs=epochs)
    if bundle or force:
        path = build_warmstart(cfg, BUNDLED if bundle else warmstart_path(cfg), console.print)
    else:
        path = ensure_warmstart(cfg, console.print)
    console.print(f"warm-start checkpoint: {path}")


if __name__ == "__main__":
    app()

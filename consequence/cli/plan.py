"""``consequence plan``: the budget arithmetic of a run before any work, or beside what a run spent."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from consequence.cli.app import app
from consequence.cli.common import console, parse_env_options
from consequence.cli.train import _refuse, train_parameters

_PLAN_HELP = (
    "The budget of a training run before any work: trajectories (K·B·G), rollouts generated "
    "(÷ α under dynamic sampling), generated tokens (× L̄), accepted episodes, teacher-scored "
    "tokens, demonstration attempts (N/α), validation and final-evaluation episodes, each with "
    "its formula. Takes `consequence train`'s options; with --env-option or --tasks-file the environment is "
    "made and refused as train refuses it (an unknown option, no train split). With --run RUN_DIR: the same lines "
    "planned from that run's settings and its measured L̄ and α, beside what it spent."
)


def _plan(
    config: Path | None = None,
    run: Path | None = None,
    mean_tokens: float | None = None,
    acceptance_rate: float = 1.0,
    demonstrations: int = 0,
    demo_acceptance_rate: float = 1.0,
    as_json: bool = False,
    **options: Any,
) -> None:
    from consequence.config import generation_budget
    from consequence.experiment.budget import plan_lines, read_spent

    given = {k: v for k, v in options.items() if v is not None and v != [] and v != ()}
    try:
        if "env_options" in given:
            given["env_options"] = parse_env_options(given["env_options"])
        spent = None
        if run is not None:
            mine = {"--mean-tokens": mean_tokens is not None, "--acceptance-rate": acceptance_rate != 1.0,
                    "--demonstrations": demonstrations != 0, "--demo-acceptance-rate": demo_acceptance_rate != 1.0}  # fmt: skip
            extra = [f"--{k.replace('_', '-')}" for k in given] + [k for k, on in mine.items() if on]
            if extra or config is not None:
                raise ValueError(
                    f"--run plans from that run's own settings and measured L̄ and α: drop "
                    f"{', '.join(extra or ['--config'])}"
                )
            cfg, spent = read_spent(run)
            measured = {x.quantity: x.value for x in spent}
            mean_tokens = measured.get("L̄, measured", mean_tokens)
            acceptance_rate = measured.get("α, measured", acceptance_rate)
        else:
            from consequence.recipes import resolve_config

            cfg = resolve_config(config, given)
            if cfg.env_options or cfg.tasks_file:  # options of the environment: refused here as train refuses them
                from consequence.envs.registry import env_of

                env_of(cfg).check_splits({"train": "training"})
            _check_assumptions(cfg, acceptance_rate, demonstrations, demo_acceptance_rate)
        assumed = "measured" if run is not None and mean_tokens is not None else "given"
        if mean_tokens is None:  # the most one episode can generate: an upper bound
            mean_tokens, assumed = (
                float(generation_budget(cfg.max_turns, cfg.max_new_tokens, cfg.max_total_tokens)),
                "L_max",
            )
        planned = plan_lines(cfg, mean_tokens, acceptance_rate, demonstrations, demo_acceptance_rate)
    except ValueError as e:
        _refuse(e)
    l_max = generation_budget(cfg.max_turns, cfg.max_new_tokens, cfg.max_total_tokens)
    warnings = []
    if mean_tokens > l_max:
        warnings.append(
            f"L̄ = {mean_tokens:g} is above the episode's generation budget L_max = "
            f"min(max_turns·max_new_tokens, max_total_tokens) = {l_max}, which no trajectory can exceed: "
            "raise --max-new-tokens / --max-total-tokens or lower --mean-tokens"
        )
    if as_json:
        out = {"mean_tokens": mean_tokens, "mean_tokens_from": assumed, "acceptance_rate": acceptance_rate}
        out["warnings"] = warnings
        out["planned"] = [vars(x) for x in planned]
        if spent is not None:
            out["spent"] = [vars(x) for x in spent]
        console.print_json(json.dumps(out))
        return
    for w in warnings:
        console.print(f"[yellow]warning:[/] {escape(w)}")
    _print(planned, spent, mean_tokens, assumed, acceptance_rate)


def _check_assumptions(cfg, acceptance_rate: float, demonstrations: int, demo_acceptance_rate: float) -> None:
    """An assumption nothing in the plan reads is refused, as a training setting would be."""
    if acceptance_rate != 1.0 and not (cfg.dynamic_sampling or cfg.advantage == "rejection"):
        raise ValueError(
            "--acceptance-rate has no effect without --dynamic-sampling or --advantage rejection "
            "(what the run keeps of what it generates); drop --acceptance-rate"
        )
    if cfg.advantage == "rejection" and acceptance_rate == 0:
        raise ValueError("--acceptance-rate 0 under --advantage rejection keeps nothing: give a rate in (0, 1]")
    if demo_acceptance_rate != 1.0 and not demonstrations:
        raise ValueError("--demo-acceptance-rate has no effect without --demonstrations N; drop it or give N")
    if demonstrations and demo_acceptance_rate == 0:
        raise ValueError("--demo-acceptance-rate 0 never yields a demonstration: give a rate in (0, 1]")


def _print(planned, spent, mean_tokens: float, assumed: str, acceptance_rate: float) -> None:
    note = {
        "L_max": "the episode's generation budget min(max_turns·max_new_tokens, max_total_tokens), an upper bound; give --mean-tokens for an estimate",
        "given": "--mean-tokens",
        "measured": "measured in the run",
    }[assumed]
    table = Table(title=f"budget: L̄ = {mean_tokens:,.1f} tokens per trajectory ({note}); α = {acceptance_rate:g}")
    for col in ("quantity", "planned: formula", "planned", "unit"):
        table.add_column(col, justify="right" if col == "planned" else "left")
    done = {x.quantity: x for x in spent or []}
    if spent is not None:
        table.add_column("spent: from", justify="left")
        table.add_column("spent", justify="right")
    for x in planned:
        row = [x.quantity, escape(x.formula), _number(x.value), x.unit]
        if spent is not None:
            s = done.pop(x.quantity, None)
            row += [escape(s.formula), _number(s.value)] if s else ["", ""]
        table.add_row(*row)
    for s in done.values():  # spent only (wall time, the measured L̄ and α)
        table.add_row(
            s.quantity, "", "", s.unit, escape(s.formula), f"{s.value:,.3g}" if s.value < 10 else f"{s.value:,.0f}"
        )
    console.print(table)


def _number(x: float) -> str:
    """A count as a whole number, anything else with the digits that matter (``--json`` has all)."""
    return (
        f"{x:,.0f}"
        if float(x).is_integer() and abs(x) < 1e15
        else f"{x:,.4g}"
        if abs(x) < 10
        else f"{x:,.1f}"
        if abs(x) < 1e15
        else f"{x:.3e}"
    )


def _signature() -> inspect.Signature:
    own = [
        (
            "config",
            Path | None,
            typer.Option(None, "--config", help="YAML file of the run's options, as `train --config`."),
        ),
        (
            "run",
            Path | None,
            typer.Option(
                None,
                "--run",
                metavar="RUN_DIR",
                help="A finished or stopped run: plan from its settings and its measured L̄ and α, beside what it spent.",
            ),
        ),
        (
            "mean_tokens",
            float | None,
            typer.Option(
                None,
                "--mean-tokens",
                min=0,
                help="L̄: generated tokens per trajectory (default: the episode's generation budget, an upper bound).",
            ),
        ),
        (
            "acceptance_rate",
            float,
            typer.Option(
                1.0,
                "--acceptance-rate",
                min=0,
                max=1,
                help="α: the share of mixed groups kept under --dynamic-sampling, of verified episodes under --advantage rejection.",
            ),
        ),
        (
            "demonstrations",
            int,
            typer.Option(
                0, "--demonstrations", min=0, help="N demonstrations to collect for a cold start (attempts N/α)."
            ),
        ),
        (
            "demo_acceptance_rate",
            float,
            typer.Option(
                1.0,
                "--demo-acceptance-rate",
                min=0,
                max=1,
                help="The share of the demonstrator's attempts that verify.",
            ),
        ),
        ("as_json", bool, typer.Option(False, "--json", help="Print the lines as JSON instead of a table.")),
    ]
    params = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, annotation=a, default=d) for n, a, d in own]
    return inspect.Signature(
        params + [p for p in train_parameters() if p.name not in ("config", "resume", "print_config", "tasks")]
    )


_plan.__signature__ = _signature()  # type: ignore[attr-defined]  # Typer reads the options from it
app.command("plan", help=_PLAN_HELP)(_plan)

"""``consequence env-check ENV``: check an environment before spending a budget on it (issue 37).

The checks are ``experiment/env_check.py``'s, the policy pilot ``experiment/env_pilot.py``'s;
this module reads the options, refuses a mistake before any work, prints the table, writes
the JSON report and sets the exit status (0: every check passed or is not available; 1: a
check failed; 2: a refused option).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from consequence.cli.app import app
from consequence.cli.common import check_model_dir, check_out_file, console, parse_env_options, quiet_libraries

_MARK = {True: "[green]✓[/]", False: "[red]✗[/]", None: "[dim]–[/]"}


@app.command("env-check")
def env_check_cmd(
    env: str = typer.Argument(..., help="The environment: a name (`consequence envs`), module:attr, or a .jsonl task file."),
    env_option: list[str] = typer.Option([], "--env-option", help="Environment option KEY=VALUE (repeatable)."),
    tasks_file: Path | None = typer.Option(None, "--tasks-file", help="Task file of the jsonl environment."),
    split_seed: int = typer.Option(0, "--split-seed", help="Seed of the environment's problem split."),
    split: str = typer.Option("train", "--split", help="The split the checked instances come from: train, validation or test."),
    tasks: int = typer.Option(10, "--tasks", min=1, help="Task instances to check (each played 4 times: reference, empty, malformed, wrong)."),
    seed: int = typer.Option(0, "--seed", min=0, help="Seed of the instances, the demonstrations' style, every reset and the pilot."),
    policy: str | None = typer.Option(None, "--policy", metavar="MODEL", help="Also run a pilot of this policy (a checkpoint or run folder, or a registered name); its tokenizer renders the checks' plays."),
    pilot_tasks: int | None = typer.Option(None, "--pilot-tasks", min=1, help="Pilot: task instances (default 50; the seeds advise 50–100)."),
    group: int | None = typer.Option(None, "--group", min=1, help="Pilot: episodes per task, G (default: train's --group-size, 8)."),
    temperature: float | None = typer.Option(None, "--temperature", min=0.0, help="Pilot: sampling temperature (default: train's, 1.0)."),
    max_turns: int | None = typer.Option(None, "--max-turns", min=1, help="Pilot: model calls per episode (default: train's, 8)."),
    max_new_tokens: int | None = typer.Option(None, "--max-new-tokens", min=1, help="Pilot: tokens per model call (default: train's, 48)."),
    max_total_tokens: int | None = typer.Option(None, "--max-total-tokens", min=16, help="Pilot: context + generated tokens per episode (default: train's, 768)."),
    out: Path | None = typer.Option(None, "--out", help="Write the report as JSON to this file (atomically)."),
) -> None:  # fmt: skip
    """Check an environment before a run: reference solutions score the maximum, known-bad
    answers (empty, malformed call, wrong answer) the minimum and never env_error, a reset is
    reproducible from its seed, tool schemas are valid JSON Schema, rewards stay in the declared
    range, and the environment's time per step and episode; with --policy, a pilot's success α,
    mixed-group fraction, truncation and invalid-call rates and suggested budgets. Exit 1 when a
    check fails (docs/environments.md)."""
    pilot_given = {"--pilot-tasks": pilot_tasks, "--group": group, "--temperature": temperature, "--max-turns": max_turns,
                   "--max-new-tokens": max_new_tokens, "--max-total-tokens": max_total_tokens}  # fmt: skip
    try:
        environment, model_path, pilot = _prepare(
            env, env_option, tasks_file, split_seed, split, policy, pilot_given, out
        )
        from consequence.experiment.env_check import load_tokenizer

        quiet_libraries()
        tokenizer = load_tokenizer(model_path)
        if pilot is not None:  # a budget no pilot episode can act in is refused before any work
            from consequence.experiment.env_pilot import check_pilot_fits

            check_pilot_fits(tokenizer, environment, split, pilot["tasks"], seed, pilot["budgets"])
        report: dict[str, Any] = {"settings": {"env": env, "env_options": environment.options, "split_seed": split_seed,
                                               "split": split, "tasks": tasks, "seed": seed, "policy": policy}}  # fmt: skip
        report |= _check(environment, tokenizer, split, tasks, seed)
        if pilot is not None and model_path is not None:
            report["pilot"] = _pilot(environment, model_path, split, seed, pilot)
    except ValueError as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(2) from None
    if out is not None:
        _write(out, report)
    if not report["passed"]:
        raise typer.Exit(1)


def _prepare(env, env_option, tasks_file, split_seed, split, policy, pilot_given, out):
    """The environment, the policy's folder and the pilot's settings (None without --policy),
    every option checked before any work.

    Raises:
        ValueError: a pilot option without --policy, an unknown split, an unwritable --out,
            an environment or policy that cannot be loaded (each names the option).
    """
    from consequence.envs.registry import environment_options, load_environment

    given = [k for k, v in pilot_given.items() if v is not None]
    if given and policy is None:
        raise ValueError(
            f"{', '.join(given)}: options of the pilot, which runs only with --policy MODEL; give --policy or drop them"
        )
    if split not in ("train", "validation", "test"):
        raise ValueError(f"--split {split!r}: give train, validation or test")
    if out is not None:
        check_out_file(out)
    options = environment_options(parse_env_options(env_option), str(tasks_file) if tasks_file else None)
    environment = load_environment(env, split_seed, options)
    environment.check_splits({split: f"--split {split}"})
    if policy is None:
        return environment, None, None
    from consequence.evaluate.run import resolve_model

    model_path = resolve_model(policy, "--policy")
    check_model_dir(str(model_path), "--policy")
    return environment, model_path, _pilot_settings(pilot_given)


def _pilot_settings(given: dict[str, Any]) -> dict[str, Any]:
    """The pilot's tasks, G, temperature and budgets: the options given, else 50 tasks and train's defaults."""
    from consequence.config import TrainConfig
    from consequence.rollout.episodes import Budgets

    fields = ("group_size", "temperature", "max_turns", "max_new_tokens", "max_total_tokens")
    value = {k: TrainConfig.model_fields[k].default for k in fields}
    for k in fields[1:]:
        if given[f"--{k.replace('_', '-')}"] is not None:
            value[k] = given[f"--{k.replace('_', '-')}"]
    return {
        "tasks": given["--pilot-tasks"] or 50,
        "group": given["--group"] or value["group_size"],
        "temperature": value["temperature"],
        "budgets": Budgets(value["max_turns"], value["max_new_tokens"], value["max_total_tokens"]),
    }


def _check(environment, tokenizer, split: str, tasks: int, seed: int) -> dict[str, Any]:
    """Run the checks, print their table, and return the report's checks part.

    Raises:
        ValueError: the split holds no task, or the environment cannot draw its instances.
    """
    from consequence.experiment.env_check import failed, run_checks

    console.print(f"env-check {escape(environment.label)}: {tasks} {split} instance(s), seed {seed}")
    rows = run_checks(environment, tokenizer, tasks=tasks, seed=seed, split=split)
    table = Table(title=f"env-check: {escape(environment.label)}")
    for col in ("", "check", "value", "message"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(_MARK[r.passed], r.name, escape(r.value), escape(r.message))
    console.print(table)
    bad, unavailable = failed(rows), sum(r.passed is None for r in rows)
    if bad:
        console.print(f"[red]{len(bad)} check(s) failed:[/] {', '.join(r.name for r in bad)}")
    else:
        console.print("[green]every check passed[/]" + (f" ({unavailable} not available)" if unavailable else ""))
    return {"environment": environment.describe(), "passed": not bad, "checks": [r.to_dict() for r in rows]}


def _pilot(environment, model_path: Path, split: str, seed: int, pilot: dict[str, Any]) -> dict[str, Any]:
    """Run the policy pilot and print its tables.

    Raises:
        ValueError: as :func:`consequence.experiment.env_pilot.run_policy_pilot` (no valid episode).
    """
    from consequence.experiment.env_pilot import run_policy_pilot

    console.print(f"pilot: {escape(str(model_path))}, {pilot['tasks']} {split} task(s) × G = {pilot['group']}")
    p = run_policy_pilot(model_path, environment, split=split, seed=seed, **pilot)
    _print_pilot(p)
    return p


def _print_pilot(p: dict[str, Any]) -> None:
    table = Table(title=f"pilot: {p['tasks']} task(s) × G = {p['group']}")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    inv = p["invalid_calls"]
    for name, value in (
        ("success α (verified share)", p["success_alpha"]),
        ("mixed-group fraction (dynamic sampling's α)", p["mixed_group_fraction"]),
        ("truncated share", p["truncated"]),
        ("env_error share", p["env_errors"]),
        ("invalid calls per model call", inv["invalid"]),
        ("  unparsable", inv["unparsable"]),
        ("  unknown tool", inv["unknown_tool"]),
        ("  bad arguments", inv["bad_arguments"]),
    ):
        table.add_row(name, f"{value:.3f}")
    table.add_row("L̄ (generated tokens per episode)", f"{p['measured']['mean_tokens']:.1f}")
    console.print(table)
    budgets = Table(title="suggested budgets")
    for col in ("option", "pilot", "p95", "max", "cut", "suggested", "rule"):
        budgets.add_column(col)
    for b in p["suggested_budgets"]:
        budgets.add_row(b["option"], str(b["pilot"]), str(b["p95"]), str(b["max"]), f"{b['cut_share']:.0%}", str(b["suggested"]), escape(b["rule"]))  # fmt: skip
    console.print(budgets)
    for w in p["warnings"]:
        console.print(f"[yellow]warning:[/] {escape(w)}")


def _write(out: Path, report: dict[str, Any]) -> None:
    from consequence.fileio import strict_json, write_text_atomic

    write_text_atomic(out, strict_json(report, indent=2, default=str) + "\n")
    console.print(f"written: {escape(str(out))}")

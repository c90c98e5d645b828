"""``consequence experiment PLAN.yaml``: arms × training seeds at one budget, on Ray."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from consequence.cli.app import app
from consequence.cli.common import console, quiet_libraries
from consequence.cli.train import _refuse


@app.command("experiment")
def experiment_cmd(
    plan: Path = typer.Argument(
        ..., help="The experiment file: base settings, seeds, budget, arms (docs/experiments.md)."
    ),
    out: Path | None = typer.Option(
        None, "--out", help="Folder of the experiment (default: runs/experiments/<file stem>)."
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Show the arms, their budgets and the runs, and exit without training."
    ),
    cpus_per_run: int = typer.Option(
        1, "--cpus-per-run", min=1, help="CPUs (and torch threads) of each run's Ray task."
    ),
    ray_address: str | None = typer.Option(
        None, "--ray-address", help="A running Ray cluster (HOST:PORT or auto); default: a local instance."
    ),
    pilot: int | None = typer.Option(
        None,
        "--pilot",
        min=1,
        metavar="N",
        help=(
            "Before any training: each arm's starting policy on N train tasks × G samples; report the "
            "mixed-group fraction, verified share, truncation rate, L̄ and the budget each arm would "
            "need, then exit (OUT/pilot.json)."
        ),
    ),
    report_finished: bool = typer.Option(
        False,
        "--report-finished",
        help=(
            "Train nothing: aggregate the arms whose every training seed has finished (the others are "
            "named and left out) into OUT/partial/experiment.{json,md,png}, e.g. while the experiment "
            "still runs."
        ),
    ),
) -> None:
    """Train every arm of PLAN.yaml with every training seed, each an ordinary run folder under the
    experiment's folder, after checking that the arms spend the same budget. Started again after
    an interruption (even kill -9) it skips finished runs and resumes the others."""
    from consequence.cli.common import check_run_dir
    from consequence.cli.train import check_before_work
    from consequence.experiment.run import check_budgets, execute, run_config
    from consequence.experiment.spec import load_experiment

    try:
        if sum([pilot is not None, dry_run, report_finished]) > 1:
            raise ValueError("--pilot, --dry-run and --report-finished are different modes: give one of them")
        exp = load_experiment(plan, out)
        check_run_dir(exp.folder, "--out", keep=False)
        for arm, seed in exp.runs():  # every run's settings, model and environment, before any work
            cfg = run_config(exp, arm, seed)
            try:
                check_before_work(cfg)
            except ValueError as e:
                raise ValueError(f"arm {arm.name}: {e}") from None
        budgets = check_budgets(exp)
    except ValueError as e:
        _refuse(e)
    _show_plan(exp, budgets)
    if dry_run:
        return
    if pilot is not None:
        _pilot(exp, pilot)
        return
    if report_finished:
        _report(exp, partial=True)
        return
    quiet_libraries()
    view = _Progress(exp)
    try:
        states = execute(exp, cpus_per_run, ray_address, show=view.update)
    except (ValueError, RuntimeError) as e:
        view.close()
        _refuse(e)
    except KeyboardInterrupt:
        view.close()
        console.print("[yellow]interrupted: run the same command again to resume (finished runs are kept)[/]")
        raise typer.Exit(130) from None
    view.close()
    failed = [s for s in states if s.status == "failed"]
    if failed:
        for s in failed:
            why = f"{escape(s.reason)}; " if s.reason else ""
            console.print(f"[red]failed:[/] {s.arm} seed {s.seed}: {why}see {escape(str(s.log))}")
        console.print("Run the same command again to resume the failed runs (finished ones are kept).")
        raise typer.Exit(1)
    _report(exp)


def _finished_arms(exp, trained: list) -> list:
    """The trained arms whose every seed's run finished; the others are named on the console.

    Raises:
        typer.Exit: no trained arm has finished every seed (the message says which runs are missing).
    """
    from consequence.experiment.run import run_config, run_status

    done: list[tuple[Any, list[int]]] = []
    left: list[tuple[Any, list[int]]] = []
    for arm in trained:
        missing = [s for s in exp.seeds if run_status(run_config(exp, arm, s), exp.run_dir(arm.name, s)) != "finished"]
        (left if missing else done).append((arm, missing))
    for arm, missing in left:
        console.print(f"left out: arm {arm.name} (seeds {', '.join(map(str, missing))} not finished)")
    if not done:
        _refuse(ValueError("no trained arm has finished all its training seeds yet; run the experiment first"))
    return [arm for arm, _ in done]


def _pilot(exp, n_tasks: int) -> None:
    """Run the pilot, print each arm's measures and budget, write OUT/pilot.json."""
    from consequence.experiment.pilot import run_pilot
    from consequence.fileio import strict_json, write_text_atomic

    quiet_libraries()
    try:
        result = run_pilot(exp, n_tasks)
    except ValueError as e:
        _refuse(e)
    path = write_text_atomic(exp.folder / "pilot.json", strict_json(result, indent=2))
    table = Table(title=f"pilot: {n_tasks} train tasks × G samples per arm, the starting policy")
    for col in ("arm", "L̄", "mixed groups", "verified", "truncated", "α used", "episodes", "generated tokens"):
        table.add_column(col, justify="left" if col == "arm" else "right")
    for name, r in result.items():
        m, lines = r["measured"], {x["quantity"]: x["value"] for x in r["planned"]}
        episodes = lines.get("rollouts generated", lines.get("trajectories trained on", 0.0))
        table.add_row(
            name,
            f"{m['mean_tokens']:.1f}",
            f"{100 * m['mixed_group_fraction']:.1f} %",
            f"{100 * m['verified_share']:.1f} %",
            f"{100 * m['truncated']:.1f} %",
            f"{r['acceptance_rate']:.3f}",
            f"{episodes:,.0f}",
            f"{lines.get('generated tokens', 0.0):,.1f}",
        )
    console.print(table)
    console.print(f"written: {escape(str(path))} (each arm's eval report under {escape(str(exp.folder / 'pilot'))})")


def _show_plan(exp, budgets: dict[str, tuple[float, str]]) -> None:
    seeds = f"{len(exp.seeds)} training seed{'s' if len(exp.seeds) > 1 else ''}"
    table = Table(title=f"experiment {exp.folder}: {seeds}, evaluation seed {exp.eval_seed}")
    for col in ("arm", f"{exp.equalise.replace('_', ' ')} per run", "formula", "runs"):
        table.add_column(col)
    for arm in exp.arms:
        if arm.trains:
            value, formula = budgets[arm.name]
            table.add_row(arm.name, f"{value:,.0f}", escape(formula), str(len(exp.seeds)))
        else:
            table.add_row(arm.name, "0", "no training: the starting policy, on the same episodes", "0")
    console.print(table)


class _Progress:
    """Arms × seeds: each run's status and iterations done, redrawn in place on a terminal,
    one line per change in a log."""

    def __init__(self, exp) -> None:
        self.exp, self.live = exp, None
        self.last: dict[tuple[str, int], str] = {}
        if console.is_terminal:
            from rich.live import Live

            self.live = Live(console=console, refresh_per_second=2)
            self.live.start()

    @staticmethod
    def _done(st) -> int:
        metrics = st.folder / "metrics.jsonl"
        if st.status != "running" or not metrics.is_file():
            return 0
        return sum(1 for line in metrics.read_text().splitlines() if line.strip())

    def _cell(self, st) -> str:
        done = self._done(st)
        if st.status == "running":
            return f"running {done} it, {time.time() - (st.started or time.time()):.0f} s"
        if st.status == "finished":
            return f"finished in {st.seconds:.0f} s"
        if st.status == "failed" and st.reason:
            return f"failed: {st.reason}"
        return st.status

    def update(self, states) -> None:
        if self.live is not None:
            table = Table(title="runs (arm × training seed)")
            table.add_column("arm")
            for s in self.exp.seeds:
                table.add_column(f"seed {s}")
            for arm in (a for a in self.exp.arms if a.trains):
                table.add_row(arm.name, *(self._cell(st) for st in states if st.arm == arm.name))
            self.live.update(table)
            return
        for st in states:  # a line when a run's status or its iterations done change
            key, now = (st.arm, st.seed), f"{st.status} {self._done(st)}"
            if self.last.get(key) != now:
                self.last[key] = now
                console.print(f"{st.arm} seed {st.seed}: {self._cell(st)}")
                sys.stdout.flush()

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()


def _report(exp, partial: bool = False) -> None:
    """Aggregate every arm over its training seeds and write experiment.json / .md / .png;
    ``partial``: only the arms whose every run finished, into OUT/partial/."""
    from consequence.experiment.aggregate import aggregate, write_report
    from consequence.experiment.budget import read_spent
    from consequence.experiment.curves import report_views

    trained = [a for a in exp.arms if a.trains]
    if partial:
        trained = _finished_arms(exp, trained)
    runs = {a.name: [exp.run_dir(a.name, s) for s in exp.seeds] for a in trained}
    arms = {  # a no-training arm reads the warm-start files of the first trained arm's runs
        a.name: runs[a.name] if a.trains else runs[trained[0].name] for a in exp.arms if a.name in runs or not a.trains
    }
    try:
        result = aggregate(arms, no_training={a.name for a in exp.arms if not a.trains})
        spent = {name: [read_spent(r)[1] for r in folders] for name, folders in runs.items()}
        curves, swept = report_views(exp, trained)
        paths = write_report(exp.folder / "partial" if partial else exp.folder, result, spent, curves, swept)
    except ValueError as e:
        _refuse(e)
    for entry in result["results"]:
        table = Table(title=f"{entry['split']}, {entry['decoding']}: success over training seeds")
        for col in ("arm", "mean", "95 % CI (seeds, then problems)", "IQM", "seeds", "problems", "minus the start"):
            table.add_column(col, justify="left" if col == "arm" else "right")
        for name, st in entry["arms"].items():
            vs = next(iter(st.get("vs", {}).values()), None)  # paired by problem, two-level CI
            table.add_row(
                name,
                f"{100 * st['mean']:.1f} %",
                f"[{100 * st['low']:.1f}, {100 * st['high']:.1f}]",
                f"{100 * st['iqm']:.1f} %",
                str(st["n_seeds"]),
                str(st["n_problems"]),
                f"{100 * vs['mean']:+.1f} [{100 * vs['low']:+.1f}, {100 * vs['high']:+.1f}]" if vs else "",
            )
        console.print(table)
    console.print("written: " + ", ".join(escape(str(p)) for p in paths))

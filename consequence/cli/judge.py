"""``consequence judge-check``: can an LLM judge be trusted on these episodes? (reward/judge_validity.py)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from consequence.cli.app import app
from consequence.cli.common import check_out_file, console, parse_env_options
from consequence.reward.judge_client import DEFAULT_KEY_ENV


@app.command("judge-check")
def judge_check_cmd(
    data: list[Path] = typer.Option(
        ...,
        "--data",
        help="Labelled episodes: a run's trajectories/ folder or Parquet files (repeatable); the verifier's pass / fail is the label.",
    ),
    judge_url: str = typer.Option(
        ..., "--judge-url", help="The judge: an OpenAI-compatible server's URL, e.g. http://127.0.0.1:8000/v1."
    ),
    judge_model: str = typer.Option(..., "--judge-model", help="The model name the judge's server serves."),
    judge_rubric: Path | None = typer.Option(
        None, "--judge-rubric", help="A text file with the criteria the judge grades by (default: --env's own rubric)."
    ),
    env: str | None = typer.Option(
        None,
        "--env",
        help="The environment whose rubric the judge uses when no --judge-rubric is given (calculator has one).",
    ),
    env_option: list[str] = typer.Option([], "--env-option", help="Option KEY=VALUE of --env (repeatable)."),
    judge_api_key_env: str = typer.Option(
        DEFAULT_KEY_ENV,
        "--judge-api-key-env",
        help="The environment variable holding the judge's API key (the default may be unset: no key).",
    ),
    judge_concurrency: int = typer.Option(8, "--judge-concurrency", min=1, help="Judgements in flight at once."),
    judge_retries: int = typer.Option(
        2, "--judge-retries", min=0, help="Retries after a timeout, a connection error or an HTTP 408 / 429 / 5xx."
    ),
    judge_timeout: float = typer.Option(
        60.0, "--judge-timeout", min=0.001, help="Seconds each request may wait for its reply."
    ),
    max_items: int = typer.Option(
        200, "--max-items", min=1, help="Labelled episodes judged one by one at most (a seeded sample when more)."
    ),
    max_pairs: int = typer.Option(
        50,
        "--max-pairs",
        min=0,
        help="(verified, failed) pairs of one task judged in both orders A/B and B/A at most (a seeded sample).",
    ),
    threshold: float = typer.Option(
        0.5, "--threshold", min=0.01, max=1.0, help="score/10 at or above which the judge passes an episode."
    ),
    seed: int = typer.Option(0, "--seed", min=0, help="Seeds the samples of items and pairs."),
    out: Path = typer.Option(..., "--out", help="Write the report as JSON to this file (atomically)."),
) -> None:
    """Measure a judge on episodes a verifier labelled, before training on it: its agreement with
    the labels (accuracy, Cohen's κ), its position bias (the share of pairs whose choice flips when
    the two answers swap places) and its length bias (Pearson r of score and answer length, overall
    and within passed / failed; agreement on the shorter and the longer half); every number with
    the items behind it (docs/environments.md)."""
    from consequence.cli.reward import _episodes
    from consequence.fileio import strict_json, write_text_atomic
    from consequence.reward.judge import Judge, resolve_rubric
    from consequence.reward.judge_client import JudgeEndpoint, probe_judge
    from consequence.reward.judge_validity import judge_validity

    endpoint = JudgeEndpoint(judge_url, judge_model, judge_api_key_env, judge_timeout, judge_retries, judge_concurrency)
    try:  # every mistake refused before the first judgement
        check_out_file(out)
        rubric, source = resolve_rubric(str(judge_rubric) if judge_rubric else None, _env(env, env_option))
        trajs = _episodes(data)
        probe_judge(endpoint)
        console.print(
            f"judge-check: {escape(judge_model)} at {escape(endpoint.as_dict()['url'])} on {len(trajs)} episodes "
            f"({escape(source)} rubric)"
        )
        judge = Judge(endpoint, rubric)
        with _judging() as shown:
            report: dict[str, Any] = judge_validity(trajs, judge, max_items, max_pairs, seed, threshold, shown)
    except ValueError as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(2) from None
    report = {
        "settings": {
            "data": [str(p) for p in data],
            **endpoint.as_dict(),
            "rubric_source": source,
            "max_items": max_items,
            "max_pairs": max_pairs,
            "threshold": threshold,
            "seed": seed,
        },
        "requests": {"judgements": judge.asked, "cache_hits": judge.cache_hits, **_http_counts(judge)},
        **report,
    }
    console.print(_table(report))
    write_text_atomic(out, strict_json(report, indent=2) + "\n")
    console.print(f"written: {escape(str(out))}")


@contextlib.contextmanager
def _judging():
    """A progress bar per phase (pointwise, then pairwise judgements), fed from the judge's threads."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bars = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    )
    tasks: dict[str, Any] = {}

    def shown(phase: str, done: int, total: int) -> None:
        if phase not in tasks:
            tasks[phase] = bars.add_task(f"{phase} judgements", total=total)
        bars.update(tasks[phase], completed=done)

    with bars:
        yield shown


def _http_counts(judge) -> dict[str, int]:
    """HTTP requests and retries the judge's client made."""
    return {"http_requests": judge.client.counts.requests, "retries": judge.client.counts.retries}


def _env(name: str | None, options: list[str]):
    """The environment named by --env (for its rubric), or None."""
    if name is None:
        return None
    from consequence.envs.registry import load_environment

    return load_environment(name, 0, parse_env_options(options))


def _table(report: dict[str, Any]) -> Table:
    items, fails = report["items"], report["failures"]
    t = Table(title=f"judge-check: {items['labelled']} labelled episodes, {items['pairs_available']} pairs available")
    for col in ("measure", "value", "n", "what"):
        t.add_column(col, justify="right" if col in ("value", "n") else "left")
    for name, m in report["measures"].items():
        value = "—" if m["value"] is None else f"{m['value']:.3f}"
        t.add_row(name, value, str(m["n"]), escape(m["what"]))
    for kind in ("pointwise", "pairwise"):
        for reason, count in sorted(fails[kind].items()):
            t.add_row(f"failed ({kind})", escape(reason), str(count), "judgements excluded, never scored 0")
    return t

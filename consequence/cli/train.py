"""``consequence train`` (one option per TrainConfig field) and ``consequence reproduce``."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path

import typer
from rich.markup import escape

from consequence.cli.app import app
from consequence.cli.common import check_model_dir, check_run_dir, console, parse_env_options, quiet_libraries
from consequence.config import TrainConfig


def _train(config: Path | None = None, resume: Path | None = None, print_config: bool = False, **options) -> None:
    if _serves_as_update_rank(print_config):
        return
    given = {k: v for k, v in options.items() if v is not None and v != [] and v != ()}
    try:
        if "env_options" in given:
            given["env_options"] = parse_env_options(given["env_options"])
        if resume is not None:
            from consequence.loop.resume import resume_config

            cfg = resume_config(resume, given, config)
        else:
            from consequence.recipes import resolve_config

            cfg = resolve_config(config, given)
        if print_config:  # the resolved settings only: nothing is loaded, checked on disk or written
            import yaml

            console.print(
                yaml.safe_dump(cfg.nested_dump(), sort_keys=False, allow_unicode=True),
                markup=False,
                highlight=False,
                end="",
            )
            return
        check_before_work(cfg)
    except ValueError as e:
        _refuse(e)
    _run_train(cfg, resume=resume is not None)


def _serves_as_update_rank(print_config: bool = False) -> bool:
    """Under torchrun, ranks k >= 1 serve rank 0's data-parallel steps (docs/async.md §7)
    and do nothing else: the trainer is rank 0. With ``--print-config`` rank 0 trains nothing,
    so they return at once (else they would wait for a group rank 0 never joins)."""
    from consequence.update.data_parallel import serve_update_rank
    from consequence.update.launch import launched_by_torchrun

    try:
        launched = launched_by_torchrun()
    except ValueError as e:
        _refuse(e)
    if launched is None or launched[0] == 0:
        return False
    if not print_config:
        serve_update_rank()
    return True


def check_before_work(cfg: TrainConfig) -> None:
    """What can be checked before any model is loaded: the trackers' packages
    (``--report-to``), the devices (``--device``, ``--teacher-device``: this machine has
    them), the model folder, a task file, a cold start's demonstrator, the environment's potential
    (``--shaping potential``), the agent, the run folder.

    Raises:
        ValueError: names the option and the fix; nothing is left on disk.
    """
    from consequence.envs.registry import env_of
    from consequence.policy.device import resolve_device
    from consequence.report.trackers import check_trackers

    check_trackers(cfg.report_to)  # a tracker's package is installed (--report-to)
    resolve_device(cfg.device)
    if cfg.teacher_device is not None:
        resolve_device(cfg.teacher_device, "--teacher-device")
    check_model_dir(cfg.model)
    check_model_dir(cfg.teacher, "--teacher", chat_template=False)
    env = env_of(cfg)  # the environment and its task source load (a user's plug-in, a task file)
    if cfg.shaping == "potential":  # the environment defines Φ
        from consequence.reward.shaping import check_potential

        check_potential(env)
    if cfg.attempts > 1:  # the environment reopens an episode after a wrong answer
        from consequence.rollout.attempts import check_attempts

        check_attempts(env, cfg.attempts, cfg.attempt_discount, cfg.attempt_feedback)
    if cfg.cold_start_demos:  # its demonstrator plays the cold start's demonstrations
        from consequence.loop.start_model import check_cold_start

        check_cold_start(cfg, env)
    if cfg.agent:  # the agent imports and is an async function
        from consequence.serve.runner import load_agent

        load_agent(cfg.agent)
    check_run_dir(Path(cfg.run_dir), keep=False)


def _refuse(e: Exception) -> typing.NoReturn:
    console.print(f"[red]error:[/] {escape(str(e))}")
    raise typer.Exit(2)


def _run_train(cfg: TrainConfig, resume: bool, reproduces: Path | None = None) -> None:
    """Train; a run stopped by a numerics error or a full disk exits 1 with its message, Ctrl-C exits 130."""
    from consequence.loop.train import RunInterrupted, RunStopped, train

    quiet_libraries()
    try:
        train(cfg, console, resume=resume, **({"reproduces": reproduces} if reproduces is not None else {}))
    except RunStopped as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(1) from None
    except RunInterrupted as e:
        console.print(f"[yellow]{escape(str(e))}[/]")
        raise typer.Exit(130) from None
    except KeyboardInterrupt:
        console.print("[yellow]interrupted before the run started[/]")
        raise typer.Exit(130) from None
    except ValueError as e:  # bad input found while loading (model, resume state, settings vs model and tasks)
        _refuse(e)


def train_parameters() -> list[inspect.Parameter]:
    """One CLI option per TrainConfig field, with the field's description as help text;
    a boolean has ``--name/--no-name``, and every option left out is None (not given); and
    ``--config``, ``--resume``, ``--print-config``. Shared with ``consequence plan``."""
    params = [
        inspect.Parameter(
            "config",
            inspect.Parameter.KEYWORD_ONLY,
            annotation=Path | None,
            default=typer.Option(
                None,
                "--config",
                help=(
                    "YAML file with the same options (a `recipe:` key applies that recipe as the "
                    "base); command-line options override it."
                ),
            ),
        ),
        inspect.Parameter(
            "resume",
            inspect.Parameter.KEYWORD_ONLY,
            annotation=Path | None,
            default=typer.Option(
                None,
                "--resume",
                metavar="RUN_DIR",
                help=(
                    "Continue the run in RUN_DIR from its last resume state (checkpoints/state-NNNN), "
                    "with the config saved in RUN_DIR/config.yaml; other options must match it, except "
                    "--skip-checks, where rollouts run (--rollout-workers, --ray-address, "
                    "--rollout-timeout), where the models compute (--device, --teacher-device) and "
                    "which trackers get the metrics (--report-to)."
                ),
            ),
        ),
    ]
    params.append(
        inspect.Parameter(
            "print_config",
            inspect.Parameter.KEYWORD_ONLY,
            annotation=bool,
            default=typer.Option(
                False,
                "--print-config",
                show_default=False,
                help=(
                    "Print the resolved settings (recipe < --config file < these options) as YAML nested "
                    "by box, the form of a --config file and of the run's config.yaml, and exit without "
                    "loading or writing anything."
                ),
            ),
        )
    )
    params.append(
        inspect.Parameter(
            "tasks",
            inspect.Parameter.KEYWORD_ONLY,
            annotation=str | None,
            default=typer.Option(None, "--tasks", hidden=True),
        )
    )  # older name of --env
    for name, field in TrainConfig.model_fields.items():
        if name == "env_options":
            params.append(
                inspect.Parameter(
                    name,
                    inspect.Parameter.KEYWORD_ONLY,
                    annotation=list[str] | None,
                    default=typer.Option(
                        None, "--env-option", metavar="KEY=VALUE", help=escape(field.description or "")
                    ),
                )
            )
            continue
        ann, choices = _option_type(field.annotation)
        default_text = (
            {"model": "bundled tiny warm start"}.get(name, "none") if field.default is None else str(field.default)
        )
        if isinstance(field.default, list):
            default_text = ",".join(map(str, field.default))
        help_text = (field.description or "") + (f" One of: {', '.join(choices)}." if choices else "")
        flag = "--" + name.replace("_", "-")
        decls = [f"{flag}/--no-{flag[2:]}"] if ann is bool else [flag]
        params.append(
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                annotation=ann | None,
                default=typer.Option(
                    None, *decls, help=f"{escape(help_text)} \\[default: {escape(default_text)}]", show_default=False
                ),
            )
        )
    return params


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


_train.__signature__ = inspect.Signature(train_parameters())  # type: ignore[attr-defined]  # Typer reads the options from it


app.command(
    "train",
    help="Train the policy in an environment (--env; default: the code-repair task, with GRPO advantages with token-mean and no KL, "
    "as in DAPO / Dr.GRPO, into runs/repair-default; --recipe picks another algorithm, e.g. grpo "
    "for the paper's settings, into runs/repair-<recipe>). Runs end to end on CPU. Ctrl-C stops "
    "after saying how to continue (`--resume`), exit code 130.",
)(_train)


@app.command("reproduce")
def reproduce_cmd(
    run: Path = typer.Argument(..., help="Run folder with a manifest.json."),
    run_dir: Path | None = typer.Option(None, help="Folder of the new run (default: RUN-reproduce)."),
    iterations: int | None = typer.Option(
        None,
        min=1,
        help=(
            (TrainConfig.model_fields["iterations"].description or "")
            + " Default: the original's; a smaller N runs only the first N iterations (same seeds, so "
            "they are comparable) and only those are compared."
        ),
    ),
    final_eval_episodes: int | None = typer.Option(
        None,
        min=0,
        help=(
            (TrainConfig.model_fields["final_eval_episodes"].description or "")
            + " Default: the original's; 0 skips the final evaluation."
        ),
    ),
) -> None:
    """Run a training job again from its manifest and compare the metrics of the two runs.

    It takes about as long as the original run (the default run: ~12 min on 2 cores). To
    shorten it, run fewer iterations (--iterations N: only those N are compared) and fewer or
    no final evaluation episodes (--final-eval-episodes N, 0 = skip).
    """
    from rich.table import Table

    from consequence.report.manifest import read_manifest
    from consequence.reproduce import compare_metrics, drift, reproduce_config

    try:
        overrides = {
            k: v for k, v in (("iterations", iterations), ("final_eval_episodes", final_eval_episodes)) if v is not None
        }
        cfg = reproduce_config(run, run_dir, overrides)
        check_before_work(cfg)
        manifest = read_manifest(run)
        differences = drift(manifest)
    except ValueError as e:
        _refuse(e)
    for d in differences:
        console.print(f"[yellow]differs from the recorded run:[/] {escape(d)}")
    _run_train(cfg, resume=False, reproduces=run)
    rows = compare_metrics(run, Path(cfg.run_dir))
    table = Table(title=f"{run} vs {cfg.run_dir}")
    for col in ("iteration", "reward then", "reward now", "max |Δ| of compared metrics"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["iteration"]), f"{r['reward_then']:.4f}", f"{r['reward_now']:.4f}", f"{r['max_abs_diff']:.2e}"
        )
    console.print(table)
    original = manifest.get("config", {}).get("iterations")
    console.print(
        (f"compared iterations 0–{len(rows) - 1}" if rows else "no iteration to compare")
        + f": the reproduction ran {cfg.iterations} of the original's "
        f"{original} iterations"
        + (" (shortened with --iterations)" if iterations and original and iterations < original else "")
    )

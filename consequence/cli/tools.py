"""``consequence explain | envs | warmstart | merge | lab | view``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from consequence.cli.app import app
from consequence.cli.common import check_out_file, check_run_dir, console, quiet_libraries


@app.command("explain")
def explain(
    recipes: list[str] = typer.Argument(
        ...,
        help="One recipe (its boxes) or two (their difference): "
        "reinforce, rloo, ppo, grpo, dr_grpo, dapo, gspo, cispo, the path "
        "of a recipe YAML, or of a train config (`train --config` file; "
        "shown with its recipe applied, as train runs it).",
    ),
) -> None:
    """Show a recipe as the seven boxes of the loop, or the difference between two recipes."""
    from consequence.recipes import load_for_explain
    from consequence.report.explain import render_difference, render_recipe

    try:
        loaded = [load_for_explain(r) for r in recipes]
    except ValueError as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(2) from None
    if len(loaded) == 1:
        render_recipe(loaded[0], console)
    elif len(loaded) == 2:
        render_difference(loaded[0], loaded[1], console)
    else:
        console.print("[red]error:[/] give one recipe, or two to compare")
        raise typer.Exit(2)


@app.command("envs")
def envs_cmd() -> None:
    """List the environments `--env` accepts: built-ins, installed plug-ins (entry point group
    consequence.environments); any module:attr path works too (docs/environments.md)."""
    from rich.table import Table

    from consequence.envs.api import has_demonstrator
    from consequence.envs.registry import BUILTINS, available, resolve

    table = Table(title="environments (--env NAME)")
    columns = (
        "name",
        "from",
        "version",
        "tools",
        "reward components",
        "options (--env-option)",
        "demonstrator",
        "what",
    )
    for col in columns:
        table.add_column(col)
    for name, target in available().items():
        try:
            cls = resolve(name)
            doc = (cls.__doc__ or "").strip().splitlines()
            row = [
                str(getattr(cls, "version", "?")),
                ", ".join(t["function"]["name"] for t in getattr(cls, "tools", [])) or "none (answer in text)",
                ", ".join(getattr(cls, "reward_components", ())),
                _options_of(cls),
                "yes" if isinstance(cls, type) and has_demonstrator(cls) else "no",
                doc[0] if doc else "",
            ]
        except ValueError as e:
            row = ["?", "?", "?", "?", "?", f"[red]cannot load: {escape(str(e))}[/]"]
        table.add_row(name, "built-in" if name in BUILTINS else f"plug-in {escape(target)}", *row)
    console.print(table)
    console.print(
        "Also: --env module:attr (an Environment subclass importable from the Python path), or a .jsonl "
        "task file. Options: --env-option key=value, or env_options: in a --config YAML. Demonstrator: "
        "the environment solves its own tasks for `consequence sft` / `demos` (Environment.demonstration)."
    )


def _options_of(cls) -> str:
    """``name=default`` for each option an environment's constructor takes (``split_seed`` aside)."""
    import inspect

    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return "?"
    shown = [
        p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
        for p in params
        if p.name != "split_seed" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]
    return escape(", ".join(shown)) or "none"


@app.command("warmstart")
def warmstart(
    seed: int = typer.Option(0, help="Seed of the problem split (train split) and the teacher."),
    demos: int = typer.Option(4000, min=10, help="Teacher demonstrations to generate."),
    epochs: float = typer.Option(8.0, min=0.01, help="SFT epochs."),
    force: bool = typer.Option(False, help="Rebuild even if the cached checkpoint exists."),
    bundle: bool = typer.Option(False, help="Write into the package's bundled checkpoint (maintainers)."),
    env: str = typer.Option(
        "repair",
        help="Environment whose train split the scripted teacher solves: one with a "
        "demonstrator (`consequence envs` shows which).",
    ),
) -> None:
    """Build (or show) the tiny warm-start checkpoint: the environment demonstrator's verified demos, then SFT.

    Settings other than the defaults are built once (about 30 min on 2 cores) and cached
    in $CONSEQUENCE_CACHE (default ~/.cache/consequence).
    """
    from consequence.distill.warmstart import (
        BUNDLED,
        WarmstartConfig,
        build_warmstart,
        ensure_warmstart,
        warmstart_path,
    )

    quiet_libraries()
    cfg = WarmstartConfig(seed=seed, n_demos=demos, sft_epochs=epochs, env=env)
    try:
        _check_teacher_env(env, seed, command="consequence warmstart")
    except ValueError as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(2) from None
    if bundle or force:
        path = build_warmstart(cfg, BUNDLED if bundle else warmstart_path(cfg), console.print)
    else:
        path = ensure_warmstart(cfg, console.print)
    console.print(f"warm-start checkpoint: {path}")


def _check_teacher_env(
    env: str,
    seed: int,
    options: dict | None = None,
    demos_file: Path | None = None,
    option: str = "--demos-file",
    teacher_url: bool = False,
    command: str = "consequence sft",
) -> None:
    """Refuse, before any work, a source of demonstrations that cannot give any: an environment
    without a train split (every source plays or replays train tasks; ``command`` needs it), an
    environment that cannot demonstrate (when neither a file nor a teacher URL is given), or a
    demonstration file that is missing, a folder, or of an unknown format.

    Raises:
        ValueError: names the environment or the file, and the fix (or as ``load_environment``).
    """
    from consequence.distill.demonstrations import check_demonstration_path
    from consequence.distill.teacher import require_demonstrator
    from consequence.envs.registry import load_environment

    environment = load_environment(env, seed, dict(options or {}))
    environment.check_splits({"train": f"`{command}`"})
    if demos_file is not None:
        check_demonstration_path(demos_file, option)
    elif not teacher_url:
        require_demonstrator(environment)


# ---- a teacher behind an OpenAI-compatible URL (sft and demos share these options) ------------
def _teacher_url_option() -> Any:
    return typer.Option(
        None,
        "--teacher-url",
        help="Demonstrations from a teacher behind an OpenAI-compatible URL (a vLLM server with a larger model, "
        "or `consequence serve`): it plays the train episodes through /v1/chat/completions with the "
        "environment's tools; each transcript is replayed in the student's tokens and kept only when the "
        "environment verifies it. The server is probed first (GET /v1/models) (docs/distillation.md).",
    )


def _teacher_options() -> dict[str, Any]:
    return {
        "teacher_model": typer.Option(
            None, "--teacher-model", help="Model name sent to the teacher (default: the one GET /v1/models lists)."
        ),
        "teacher_api_key_env": typer.Option(
            None,
            "--teacher-api-key-env",
            help="Environment variable holding the teacher's API key (sent as a Bearer token; never recorded).",
        ),
        "teacher_temperature": typer.Option(
            None,
            "--teacher-temperature",
            min=0.0,
            max=2.0,
            help="Teacher's sampling temperature (default 1.0: its own distribution, filtered by the verifier).",
        ),
        "teacher_max_tokens": typer.Option(
            None, "--teacher-max-tokens", min=1, help="Tokens per teacher reply, its max_tokens (default 1024)."
        ),
        "teacher_max_turns": typer.Option(
            None, "--teacher-max-turns", min=1, help="Teacher calls per episode at most (default 8)."
        ),
        "teacher_timeout": typer.Option(
            None,
            "--teacher-timeout",
            min=0.001,
            help="Seconds a teacher call may wait to connect, and for each read of its reply (default 120).",
        ),
        "teacher_concurrency": typer.Option(
            None, "--teacher-concurrency", min=1, help="Teacher episodes in flight at once (default 4)."
        ),
    }


def _teacher_endpoint(url: str | None, **settings: Any) -> Any:
    """The teacher's endpoint (None without ``--teacher-url``), its server probed (GET /v1/models).

    Raises:
        ValueError: a ``--teacher-*`` setting without ``--teacher-url``; bad settings; the
            server cannot be reached or is not OpenAI-compatible (names the URL).
    """
    from consequence.distill.teacher_url import TeacherEndpoint, probe_teacher

    given = {k: v for k, v in settings.items() if v is not None}
    if url is None:
        if given:
            flags = ", ".join("--" + k.replace("_", "-") for k in sorted(given))
            raise ValueError(f"{flags}: settings of a teacher behind a URL; give --teacher-url URL too")
        return None
    names = {
        "teacher_model": "model",
        "teacher_api_key_env": "api_key_env",
        "teacher_temperature": "temperature",
        "teacher_max_tokens": "max_tokens",
        "teacher_max_turns": "max_turns",
        "teacher_timeout": "timeout_s",
        "teacher_concurrency": "concurrency",
    }
    return probe_teacher(TeacherEndpoint(url, **{names[k]: v for k, v in given.items()}))


def _teacher_cost_line(record: dict) -> str:
    """``; teacher cost: ...`` for a record of a URL teacher's demonstrations, else empty."""
    from consequence.distill.teacher_url import cost_line

    return f"; teacher cost: {cost_line(record['cost'])}" if record.get("kind") == "teacher_url" else ""


@app.command("merge")
def merge_cmd(
    adapter: Path = typer.Argument(
        ...,
        help="A LoRA checkpoint folder (adapter_config.json + "
        "adapter_model.safetensors), e.g. RUN/checkpoints/final of "
        "a run trained with --lora-rank.",
    ),
    out: Path = typer.Option(
        ...,
        "--out",
        help="Folder to write the merged model into (a plain Hugging "
        "Face checkpoint; replaced atomically if it exists).",
    ),
) -> None:
    """Fold a LoRA adapter into its base model: W0 + (alpha / r) B A, saved as a plain model folder
    that --model, eval and other tools load without PEFT."""
    from consequence.policy.lora import merge_adapter

    quiet_libraries()
    try:
        if not adapter.is_dir():
            raise ValueError(f"{adapter}: no such folder (give a LoRA checkpoint, e.g. RUN/checkpoints/final)")
        path = merge_adapter(adapter, out)
    except ValueError as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(2) from None
    except OSError as e:  # a folder that cannot be written (permissions, a full disk, /proc)
        console.print(
            f"[red]error:[/] cannot write --out {escape(str(out))}: {escape(e.strerror or str(e))}; "
            "nothing was written there"
        )
        raise typer.Exit(2) from None
    console.print(f"merged {escape(str(adapter))} into its base model: {escape(str(path))}")


@app.command("shrink")
def shrink_cmd(
    model: str = typer.Argument(..., help="The teacher: a model folder or a registered name (smollm2-135m-instruct)."),
    layers: int = typer.Option(
        ..., "--layers", help="Decoder layers to keep, evenly spaced, the first and the last included."
    ),
    out: Path = typer.Option(..., "--out", help="Folder to write the student into (replaced atomically if it exists)."),
) -> None:
    """Build a smaller student from a teacher: the same tokenizer and width, fewer decoder layers
    (the kept layers' weights copied), for distillation (docs/distillation.md)."""
    from consequence.policy.shrink import shrink_model

    quiet_libraries()
    try:
        path, keep = shrink_model(model, layers, out)
    except ValueError as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(2) from None
    except OSError as e:
        console.print(
            f"[red]error:[/] cannot write --out {escape(str(out))}: {escape(e.strerror or str(e))}; "
            "nothing was written there"
        )
        raise typer.Exit(2) from None
    console.print(f"student written to {escape(str(path))}: kept layers {keep} of {escape(model)}")


@app.command("lab")
def lab(
    name: str | None = typer.Argument(None, help="Lab to run (see docs/labs.md); without a name, list the labs."),
    out: Path = typer.Option(Path("runs/labs"), help="Folder for the lab's PNG."),
    seed: int = typer.Option(0, help="Random seed of the lab (a non-negative integer)."),
) -> None:
    """Run one lab: print its numbers and write its figure (docs/labs.md); without a name, list the labs."""
    from rich.table import Table

    from consequence.labs import LABS, describe

    if name is None:
        table = Table(title="labs (run one with `consequence lab NAME`; docs/labs.md)")
        table.add_column("lab")
        table.add_column("what it shows")
        for lab_name in LABS:
            table.add_row(lab_name, escape(describe(lab_name)))
        console.print(table)
        return
    try:
        if name not in LABS:
            raise ValueError(f"unknown lab {name!r}; labs: {', '.join(LABS)} (`consequence lab` lists them)")
        if seed < 0:
            raise ValueError(f"--seed {seed}: give a non-negative integer (numpy's generators take no negative seed)")
        check_run_dir(out, "--out", keep=False)
    except ValueError as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(2) from None
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
def view(
    run_dir: Path = typer.Argument(
        ...,
        help="Run directory of `consequence train`, or an experiment's folder (its report, figures and runs on one page).",
    ),
    out: Path | None = typer.Option(None, help="HTML file to write [default: RUN_DIR/viewer.html]."),
    iteration: int | None = typer.Option(
        None, help="Show only this iteration (numbered from 0, as in trajectories/iter_NNNN.parquet and the console)."
    ),
    with_current_logprobs: bool = typer.Option(
        False,
        help="Recompute each token's log-prob with the checkpoint saved "
        "after its iteration (else final): one forward pass per trajectory.",
    ),
    limit: int = typer.Option(200, min=1, help="Most trajectories on the page (whole groups, spread over iterations)."),
) -> None:
    """Write one static HTML page of a run's trajectories, tokens coloured by loss-mask role, or of an
    experiment folder's report (docs/viewer.md)."""
    from consequence.report.experiment_page import is_experiment_folder
    from consequence.report.viewer import ViewerError, build_page, find_run_files, write_page

    path = out or run_dir / "viewer.html"
    if is_experiment_folder(run_dir):
        _view_experiment(run_dir, path, "--out" if out else "RUN_DIR", iteration, with_current_logprobs)
        return
    try:
        if iteration is not None and iteration < 0:
            raise ValueError(
                f"--iteration {iteration}: iterations are numbered from 0 (trajectories/iter_0000.parquet)"
            )
        find_run_files(run_dir)
        check_out_file(path, "--out" if out else "RUN_DIR")
        html, summary = build_page(run_dir, iteration, with_current_logprobs, limit, log=console.print)
    except (ViewerError, ValueError) as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(2) from None
    path = write_page(html, path)
    left = f", {summary['n_left_out']} left out (page limit {limit})" if summary["n_left_out"] else ""
    console.print(f"{summary['n_shown']} trajectories{left}: {path} ({len(html.encode()) / 1e6:.2f} MB)")


def _view_experiment(folder: Path, path: Path, which: str, iteration: int | None, with_current_logprobs: bool) -> None:
    """`consequence view` of an experiment folder: its report page; the options of a run's page are refused."""
    from consequence.report.experiment_page import build_experiment_page
    from consequence.report.viewer import write_page

    given = [
        name
        for name, on in (("--iteration", iteration is not None), ("--with-current-logprobs", with_current_logprobs))
        if on
    ]
    try:
        if given:
            raise ValueError(
                f"{' and '.join(given)}: {folder} is an experiment folder; give one of its runs "
                f"({folder / 'runs'}/<arm>-seed<k>) to see its trajectories"
            )
        check_out_file(path, which)
        page = build_experiment_page(folder, path.parent)
    except (ValueError, OSError) as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(2) from None
    written = write_page(page, path)
    console.print(f"experiment report: {written} ({len(page.encode()) / 1e6:.2f} MB)")


@app.command("sft")
def sft_cmd(
    model: str = typer.Option(
        ..., help="The student: a registered name (smollm2-135m-instruct) or a local Hugging Face folder."
    ),
    out: Path = typer.Option(
        ...,
        "--out",
        help="Folder to write the fine-tuned model into (a plain model folder with sft.json; replaced atomically).",
    ),
    env: str = typer.Option(
        "repair",
        help="The environment: its demonstrator solves train tasks (`consequence envs` shows which "
        "environments have one), or --demos-file / --teacher-url gives the demonstrations.",
    ),
    env_option: list[str] = typer.Option([], "--env-option", help="Environment option KEY=VALUE (repeatable)."),
    demos: int | None = typer.Option(
        None,
        min=1,
        help="Demonstrator (or --teacher-url) episodes to run; the verified ones are kept (default 300).",
    ),
    demos_file: Path | None = typer.Option(
        None,
        "--demos-file",
        help="Demonstrations from a file instead of the demonstrator: our trajectories .parquet, or .jsonl "
        'with one {"task_id": ..., "messages": [...]} per line (OpenAI chat shape). Each is replayed on its '
        "train task and kept only when the environment verifies it (docs/distillation.md).",
    ),
    teacher_url: str | None = _teacher_url_option(),
    teacher_model: str | None = _teacher_options()["teacher_model"],
    teacher_api_key_env: str | None = _teacher_options()["teacher_api_key_env"],
    teacher_temperature: float | None = _teacher_options()["teacher_temperature"],
    teacher_max_tokens: int | None = _teacher_options()["teacher_max_tokens"],
    teacher_max_turns: int | None = _teacher_options()["teacher_max_turns"],
    teacher_timeout: float | None = _teacher_options()["teacher_timeout"],
    teacher_concurrency: int | None = _teacher_options()["teacher_concurrency"],
    seed: int = typer.Option(0, min=0, help="Split seed of the environment, the teacher's and SFT's seed."),
    epochs: float = typer.Option(2.0, min=0.01, help="SFT epochs over the demonstrations."),
    learning_rate: float = typer.Option(2e-4, min=1e-12, help="Peak AdamW learning rate."),
    rows_per_step: int = typer.Option(16, min=1, help="Demonstrations per optimizer step."),
    micro_batch_size: int = typer.Option(
        4, min=1, help="Rows per forward/backward (the step's loss is the token mean over all its rows)."
    ),
    lora_rank: int = typer.Option(
        16, min=0, help="LoRA rank (0 = full fine-tuning); the adapter is merged into the weights at the end."
    ),
    lora_alpha: float = typer.Option(32.0, min=1e-12, help="LoRA alpha (scale alpha / rank)."),
    lora_targets: str = typer.Option(
        ",".join(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
        help="Modules that get an adapter, comma-separated.",
    ),
    device: str = typer.Option(
        "cpu",
        help="Where the SFT computes (docs/devices.md): cpu, cuda (the current CUDA device), cuda:N, mps, or auto "
        "(cuda when available, else mps, else cpu); a device this machine does not have is refused before the "
        "student loads. In float32.",
    ),
) -> None:
    """Cold start: verified demonstrations (the environment's demonstrator, --demos-file, or a teacher
    at --teacher-url), played in the student's own chat format (Hermes tool calls where its
    template drops tools), then SFT with the loss on the assistant turns only. Train RL from the
    result with --model OUT."""
    from consequence.cli.common import parse_env_options, parse_list
    from consequence.distill.coldstart import ColdStartConfig, cold_start
    from consequence.distill.sft import SFTConfig
    from consequence.evaluate.progress import Phases
    from consequence.policy.device import resolve_device
    from consequence.policy.lora import check_lora_folder
    from consequence.policy.named import is_named, model_folder, source_record
    from consequence.policy.tiny import check_model_folder

    quiet_libraries()
    with _writing_out(out):
        options = parse_env_options(env_option)
        targets = tuple(parse_list(lora_targets, "--lora-targets", "q_proj,v_proj"))
        if demos_file is not None and demos is not None:
            raise ValueError(
                "--demos-file and --demos are two sources of demonstrations (a file, or that many "
                "demonstrator episodes); give one"
            )
        if demos_file is not None and teacher_url is not None:
            raise ValueError(
                "--demos-file and --teacher-url are two sources of demonstrations (a file, or a teacher's "
                "episodes); give one"
            )
        where = resolve_device(device)  # before anything loads
        _check_teacher_env(env, seed, options, demos_file, teacher_url=teacher_url is not None)
        check_run_dir(out.parent, "--out", keep=False)
        teacher = _teacher_endpoint(
            teacher_url,
            teacher_model=teacher_model,
            teacher_api_key_env=teacher_api_key_env,
            teacher_temperature=teacher_temperature,
            teacher_max_tokens=teacher_max_tokens,
            teacher_max_turns=teacher_max_turns,
            teacher_timeout=teacher_timeout,
            teacher_concurrency=teacher_concurrency,
        )
        path = model_folder(model, log=console.print)
        check_model_folder(path)
        if out.resolve() == Path(path).resolve() or out.resolve() in Path(path).resolve().parents:
            raise ValueError(
                f"--out {out}: is the student's folder (--model {model}) or holds it, and it is replaced "
                "while the student is read from it; write the fine-tuned model to another folder"
            )
        if out.exists() and not (out / "sft.json").is_file():
            raise ValueError(f"--out {out}: exists and is not an earlier `consequence sft` output; name a new folder")
        if lora_rank:  # before the demonstrations are collected: a bad --lora-targets loses no work
            check_lora_folder(path, lora_rank, lora_alpha, targets)
        cfg = ColdStartConfig(
            env=env,
            env_options=options,
            demos=300 if demos is None else demos,
            seed=seed,
            demos_file=None if demos_file is None else str(demos_file.resolve()),
            teacher=teacher,
            lora_rank=lora_rank,
            lora_alpha=lora_alpha,
            lora_targets=targets,
            sft=SFTConfig(
                learning_rate=learning_rate,
                epochs=epochs,
                rows_per_step=rows_per_step,
                micro_batch_size=micro_batch_size,
                seed=seed,
            ),
        )
        with Phases(console) as phases:
            record = cold_start(
                path,
                out,
                cfg,
                log=_log,
                phases=phases,
                source=source_record(model) if is_named(model) else None,
                device=where,
            )
    teacher_record = record["teacher"]
    console.print(
        f"cold-start model: {out}  ({teacher_record['verified']}/{teacher_record['episodes']} verified "
        f"demonstrations, acceptance rate {teacher_record['acceptance_rate']:.1%}, {record['rows']} rows, "
        f"SFT {record['seconds']['sft']:.0f} s)" + escape(_teacher_cost_line(teacher_record))
    )


@app.command("demos")
def demos_cmd(
    out: Path = typer.Option(
        ...,
        "--out",
        help="File to write (atomically; missing folders are created), its format by its suffix: .parquet, our "
        "trajectories (for --distill-data, --demos-file); .jsonl, one "
        '{"task_id": ..., "messages": [...]} per line in the OpenAI chat shape (for --demos-file and other SFT tools).',
    ),
    episodes: int | None = typer.Option(
        None,
        "-n",
        "--episodes",
        min=1,
        help="Demonstrator (or --teacher-url) episodes to run; the verified ones are written (default 1024).",
    ),
    model: str | None = typer.Option(
        None, help="The student whose tokenizer and chat template render them (default: the bundled tiny model)."
    ),
    env: str = typer.Option(
        "repair",
        help="The environment: its demonstrator solves train tasks (`consequence envs` shows which "
        "environments have one), or --from / --teacher-url gives the demonstrations.",
    ),
    env_option: list[str] = typer.Option([], "--env-option", help="Environment option KEY=VALUE (repeatable)."),
    split_seed: int = typer.Option(0, min=0, help="Split seed of the environment (the training run's --split-seed)."),
    draw_seed: int | None = typer.Option(
        None,
        min=0,
        help="Seed of the task instances and demonstration styles (and of a --teacher-url's calls); the bundled "
        "warm start was built from draw seed = split seed, so the default 1000 gives demonstrations it has not seen.",
    ),
    from_file: Path | None = typer.Option(
        None,
        "--from",
        help="Demonstrations from a file instead of the demonstrator: our trajectories .parquet, or .jsonl "
        'with one {"task_id": ..., "messages": [...]} per line (OpenAI chat shape). Each is replayed on its '
        "train task and written only when the environment verifies it (docs/distillation.md).",
    ),
    teacher_url: str | None = _teacher_url_option(),
    teacher_model: str | None = _teacher_options()["teacher_model"],
    teacher_api_key_env: str | None = _teacher_options()["teacher_api_key_env"],
    teacher_temperature: float | None = _teacher_options()["teacher_temperature"],
    teacher_max_tokens: int | None = _teacher_options()["teacher_max_tokens"],
    teacher_max_turns: int | None = _teacher_options()["teacher_max_turns"],
    teacher_timeout: float | None = _teacher_options()["teacher_timeout"],
    teacher_concurrency: int | None = _teacher_options()["teacher_concurrency"],
) -> None:
    """Verified demonstrations (the environment's demonstrator, --from FILE, or a teacher at
    --teacher-url) in the student's
    tokens, as a trajectories file: SFT on them is `consequence train --recipe rejection_sft
    --distill-lambda 0 --distill-data OUT` (docs/distillation.md); or, --out FILE.jsonl, as
    OpenAI chat messages."""
    from consequence.cli.common import parse_env_options
    from consequence.distill.demonstrations import check_demonstration_out
    from consequence.distill.demos import write_demonstrations
    from consequence.evaluate.run import resolve_model

    quiet_libraries()
    with _writing_out(out):
        check_demonstration_out(out, "--out")
        options = parse_env_options(env_option)
        if from_file is not None and (episodes is not None or draw_seed is not None):
            given = " and ".join(o for o, v in (("--episodes", episodes), ("--draw-seed", draw_seed)) if v is not None)
            raise ValueError(
                f"--from replays the demonstrations of a file; {given} set the demonstrator's episodes: give one source"
            )
        if from_file is not None and teacher_url is not None:
            raise ValueError(
                "--from and --teacher-url are two sources of demonstrations (a file, or a teacher's episodes); give one"
            )
        _check_teacher_env(
            env,
            split_seed,
            options,
            from_file,
            "--from",
            teacher_url=teacher_url is not None,
            command="consequence demos",
        )
        if from_file is not None and from_file.resolve() == out.resolve():
            raise ValueError(f"--out {out} is the --from file; write the verified demonstrations to another file")
        check_out_file(out, "--out")
        teacher = _teacher_endpoint(
            teacher_url,
            teacher_model=teacher_model,
            teacher_api_key_env=teacher_api_key_env,
            teacher_temperature=teacher_temperature,
            teacher_max_tokens=teacher_max_tokens,
            teacher_max_turns=teacher_max_turns,
            teacher_timeout=teacher_timeout,
            teacher_concurrency=teacher_concurrency,
        )
        record = write_demonstrations(
            resolve_model(model),
            out,
            None if from_file is not None else (1024 if episodes is None else episodes),
            split_seed=split_seed,
            draw_seed=draw_seed,
            env=env,
            env_options=options,
            demos_file=from_file,
            teacher=teacher,
            log=_log,
        )
    console.print(
        f"{record['verified']}/{record['episodes']} demonstrations verified "
        f"(acceptance rate {record['acceptance_rate']:.1%}): {escape(str(out))}" + escape(_teacher_cost_line(record))
    )


def _log(line: str) -> None:
    """One log line, shown as it is (a demonstration file's text is no console markup)."""
    console.print(escape(line))


@contextmanager
def _writing_out(out: Path) -> Iterator[None]:
    """A user's mistake (ValueError) or a failed write of ``--out`` (OSError) as one error line, exit 2."""
    try:
        yield
    except ValueError as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(2) from None
    except OSError as e:
        console.print(f"[red]error:[/] cannot write --out {escape(str(out))}: {escape(e.strerror or str(e))}")
        raise typer.Exit(2) from None

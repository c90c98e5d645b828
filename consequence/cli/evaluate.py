"""``consequence eval`` and ``consequence compare``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.markup import escape

from consequence.cli.app import app
from consequence.cli.common import (
    check_model_dir,
    check_run_dir,
    console,
    parse_env_options,
    parse_ks,
    parse_list,
    quiet_libraries,
)
from consequence.cli.eval_options import signature

if TYPE_CHECKING:
    import torch


def _fail(e: ValueError) -> None:
    console.print(f"[red]error:[/] {escape(str(e))}")
    raise typer.Exit(2)


def _say(text: str) -> None:
    console.print(text, markup=False, highlight=False)


def _env_options(
    env: str | None,
    tasks: str | None,
    tasks_file: str | None,
    env_option: list[str] | None,
    env_options: dict | None = None,
) -> dict:
    """The environment options as given (None = not given, so a run folder's value applies);
    ``env_options``, a mapping, is the Python API's form of ``env_option``."""
    if tasks is not None and env is not None and tasks != env:
        raise ValueError(f"--tasks {tasks} and --env {env} disagree; --tasks is an older name of --env: give one")
    env = env if env is not None else tasks
    if env is not None and env.endswith(".jsonl"):
        env, tasks_file = "jsonl", tasks_file or env
    if env_option and env_options:
        raise ValueError("give the environment options once: as KEY=VALUE strings or as a mapping")
    options = parse_env_options(env_option) if env_option else dict(env_options) if env_options else None
    if env is not None:  # another environment than the run's: none of the run's options or task file carry over
        options = options or {}
        tasks_file = tasks_file or ""
    if options and "tasks_file" in options:
        raise ValueError("--env-option tasks_file=...: give the task file as --tasks-file FILE")
    return {
        "env": env,
        "tasks_file": None if tasks_file is None else str(Path(tasks_file).resolve()) if tasks_file else "",
        "env_options": options,
    }


def _load_env(values: dict):
    """The environment of the settings, loaded before any model (ValueError names what is wrong)."""
    from consequence.envs.registry import environment_options, load_environment

    return load_environment(
        values["env"], values["split_seed"], environment_options(values["env_options"], values["tasks_file"] or None)
    )


def eval_cmd(**options) -> None:
    """Evaluate a policy: pass@k and final-selection success with bootstrap CIs over problems,
    the recovery diagnostic, outcomes, budgets, cost, env errors and the split touched."""
    try:
        run_eval(**options)
    except ValueError as e:
        _fail(e)


eval_cmd.__signature__ = signature("eval")  # type: ignore[attr-defined]  # Typer reads the options from it
app.command("eval")(eval_cmd)


def run_eval(
    model: str | None,
    env: str | None,
    tasks: str | None,
    tasks_file: str | None,
    env_option: list[str] | None,
    split: str,
    split_seed: int | None,
    max_turns: int | None,
    max_new_tokens: int | None,
    max_total_tokens: int | None,
    n: int | None,
    k: str,
    problems: int,
    temperature: float,
    seed: int,
    selection: str,
    recovery: bool,
    out: Path,
    env_options: dict | None = None,
    device: str = "cpu",
    attempts: int = 1,
) -> Path:
    """What ``consequence eval`` does with its options (``eval_cmd``'s help says each), printing
    to the console; ``consequence.evaluate`` calls it too. ``env_options`` (a mapping) may be
    given instead of ``env_option`` (``KEY=VALUE`` strings).

    Returns:
        The eval.json written.

    Raises:
        ValueError: a setting, the model or the environment is refused (before any work), or
            cannot work with this model (once it has loaded); nothing is written then.
    """
    from consequence.evaluate.run import check_problems, check_request, default_samples, resolve_model
    from consequence.evaluate.selection import check_rules
    from consequence.evaluate.settings import check_budgets, resolve_settings
    from consequence.policy.device import resolve_device

    where = resolve_device(device)  # a device this machine does not have: refused first
    options = {
        **_env_options(env, tasks, tasks_file, env_option, env_options),
        "split_seed": split_seed,
        "max_turns": max_turns,
        "max_new_tokens": max_new_tokens,
        "max_total_tokens": max_total_tokens,
    }
    ks = parse_ks(k)
    n = default_samples(n, temperature)
    st = resolve_settings([("", model)], options)
    environment = _load_env(st.values)
    completion = getattr(environment, "completion_protocol", False)
    if completion and (max_turns is not None or max_total_tokens is not None):
        raise ValueError(
            f"--max-turns / --max-total-tokens: {environment.name} is evaluated as single-turn "
            "completions; give --max-new-tokens (tokens per completion) instead"
        )
    check_budgets(st.values)
    check_request(
        split,
        n,
        ks,
        temperature,
        problems,
        splits=("train", "validation", "test", "all") if completion else ("train", "validation", "test"),
    )
    if completion:  # an evaluation over no problem is refused (its means would be NaN)
        if not environment.completion_tasks(split):
            raise ValueError(f"--split {split}: {environment.label} has no problem in it; give another split")
    else:
        check_problems(environment, split)
    rules = check_rules(parse_list(selection, "--selection", "first,majority"))
    retries = _check_eval_attempts(environment, attempts, n, completion)
    model_path = resolve_model(model)
    check_model_dir(str(model_path), chat_template=not completion)
    check_run_dir(out, "--out")
    quiet_libraries()
    if completion:
        return _eval_completions(
            model_path, environment, st, split, n, ks, problems, temperature, seed, max_new_tokens, out, where
        )
    from consequence.evaluate.progress import Phases
    from consequence.evaluate.run import evaluate_episodes, problem_count, write_outputs
    from consequence.evaluate.settings import describe

    record = st.record()
    count, total = problem_count(environment, split, problems), len(environment.split[split])
    which = (
        f"{count} of the {total} problems of the split (drawn with --seed)"
        if count < total
        else f"all {total} problems of the split"
        + (f" (--problems {problems} asks for more than it holds)" if problems > total else "")
    )
    _say(f"{environment.label} {split}: {which} × n = {n} episodes of {model_path}")
    _say(describe(record))
    # a ValueError here: settings that cannot work with this model (checked once it has loaded)
    with Phases(console) as phases:
        ev = evaluate_episodes(
            model_path,
            environment,
            split,
            n,
            ks,
            problems=problems,
            temperature=temperature,
            seed=seed,
            budgets=st.budgets(),
            selection=rules,
            recovery=recovery,
            provenance=record,
            phases=phases,
            device=where,
            attempts=retries,
        )
    written, removed = write_outputs(ev, out)
    _say((out / "report.md").read_text())
    for w in ev.result["warnings"]:
        console.print(f"[yellow]warning:[/] {escape(w)}")
    _written(out, written, removed)
    return out / "eval.json"


def _check_eval_attempts(environment, attempts: int, n: int, completion: bool):
    """The retry policy of ``eval --attempts`` (None for 1), refused before any work when it cannot run."""
    from consequence.rollout.attempts import check_attempts

    if attempts > 1 and completion:
        raise ValueError(
            f"--attempts {attempts}: {environment.name} is evaluated as single-turn completions; drop --attempts"
        )
    if attempts > n:
        raise ValueError(
            f"--attempts {attempts} needs -n >= {attempts}: success within j attempts is compared with pass@j of "
            "the n plain episodes (equal answers per task); raise -n or lower --attempts"
        )
    return check_attempts(environment, attempts)


def _written(out: Path, written: list[str], removed: list[str]) -> None:
    """The files this evaluation wrote into ``out``, and those of an earlier one it removed."""
    _say(f"written: {out}/{written[0]}" + "".join(f", {name}" for name in written[1:]))
    if removed:
        _say(f"removed from an earlier evaluation in {out}: {', '.join(removed)} (not written by this one)")


def _eval_completions(
    model_path: Path,
    environment,
    st,
    split: str,
    n: int,
    ks: list[int],
    problems: int,
    temperature: float,
    seed: int,
    max_new_tokens: int | None,
    out: Path,
    device: torch.device | str = "cpu",
) -> Path:
    """``eval --env humaneval``: single-turn completions, batched across problems (pass@k protocol)."""
    from consequence.evaluate.completions import evaluate_completions, save_eval
    from consequence.evaluate.progress import Phases
    from consequence.evaluate.report import remove_stale
    from consequence.evaluate.settings import describe
    from consequence.evaluate.splits import record_touch, reuse_warning

    split_seed = st.values["split_seed"]
    task_list = environment.completion_tasks(split)
    if problems:
        task_list = task_list[:problems]
    record = st.record()
    tokens = (
        max_new_tokens
        if max_new_tokens is not None
        else (st.values["max_new_tokens"] if st.origin["max_new_tokens"] == "run" else 384)
    )
    _say(
        f"HumanEval {split}: {len(task_list)} problems × n = {n} completions of {model_path}, at most {tokens} "
        "tokens each (single-turn: --selection and --recovery do not apply)"
    )
    _say(describe(record))
    warning = reuse_warning(environment.label, split_seed, [str(model_path)]) if split == "test" else None
    with Phases(console) as phases:
        res = evaluate_completions(
            model_path,
            task_list,
            n=n,
            ks=tuple(ks),
            temperature=temperature,
            seed=seed,
            max_new_tokens=tokens,
            phases=phases,
            device=device,
        )
    res.settings |= {
        "tasks": environment.label,
        "environment": environment.describe(),
        "split": split,
        "split_seed": split_seed,
        "provenance": record,
        "warnings": [warning] if warning else [],
        "splits_touched": [record_touch(environment.label, split_seed, split, "consequence eval", [str(model_path)])],
    }
    path = save_eval(res, out / "eval.json")
    removed = remove_stale(out, [path.name])
    if warning:
        console.print(f"[yellow]warning:[/] {escape(warning)}")
    _say(res.summary())
    _written(out, [path.name], removed)
    return Path(path)


def compare_cmd(**options) -> None:
    """Two policies on the same tasks, seeds, split and budgets: success of each, paired
    difference B − A with a 95 % bootstrap CI over problems, and how many problems each wins."""
    try:
        run_compare(**options)
    except ValueError as e:
        _fail(e)


compare_cmd.__signature__ = signature("compare")  # type: ignore[attr-defined]  # Typer reads the options from it
app.command("compare")(compare_cmd)


def run_compare(
    a: str,
    b: str,
    env: str | None,
    tasks: str | None,
    tasks_file: str | None,
    env_option: list[str] | None,
    split: str,
    split_seed: int | None,
    max_turns: int | None,
    max_new_tokens: int | None,
    max_total_tokens: int | None,
    n: int,
    k: str,
    problems: int,
    temperature: float,
    seed: int,
    recovery: bool,
    out: Path,
    env_options: dict | None = None,
    device: str = "cpu",
) -> Path:
    """What ``consequence compare`` does with its options (``compare_cmd``'s help says each),
    printing to the console; ``consequence.compare`` calls it too. ``env_options`` (a mapping)
    may be given instead of ``env_option`` (``KEY=VALUE`` strings).

    Returns:
        The compare.json written.

    Raises:
        ValueError: a setting, a model or the environment is refused (before any work), or
            cannot work with these models (once they have loaded); nothing is written then.
    """
    from consequence.evaluate.run import check_distinct, check_problems, check_request, resolve_model
    from consequence.evaluate.settings import check_budgets, resolve_settings
    from consequence.policy.device import resolve_device

    where = resolve_device(device)  # a device this machine does not have: refused first
    options = {
        **_env_options(env, tasks, tasks_file, env_option, env_options),
        "split_seed": split_seed,
        "max_turns": max_turns,
        "max_new_tokens": max_new_tokens,
        "max_total_tokens": max_total_tokens,
    }
    ks = parse_ks(k)
    st = resolve_settings([("A", a), ("B", b)], options)
    environment = _load_env(st.values)
    check_budgets(st.values)
    check_request(split, n, ks, temperature, problems)
    check_problems(environment, split, "the comparison")
    if problems == 1:
        raise ValueError("--problems 1: a paired CI over problems needs at least 2 problems")
    pa, pb = resolve_model(a, "A"), resolve_model(b, "B")
    for p, name in ((pa, "A"), (pb, "B")):
        check_model_dir(str(p), name)
    check_distinct(pa, pb)
    check_run_dir(out, "--out")
    quiet_libraries()
    return _compare(pa, pb, environment, st, split, n, ks, problems, temperature, seed, recovery, out, where)


def _compare(
    pa: Path,
    pb: Path,
    environment,
    st,
    split: str,
    n: int,
    ks: list[int],
    problems: int,
    temperature: float,
    seed: int,
    recovery: bool,
    out: Path,
    device: torch.device | str = "cpu",
) -> Path:
    from consequence.evaluate.progress import Phases
    from consequence.evaluate.run import compare_policies, write_compare
    from consequence.evaluate.settings import describe

    record = st.record()
    _say(describe(record))
    # a ValueError here: settings that cannot work with these models (checked once they have loaded)
    with Phases(console) as phases:
        res = compare_policies(
            pa,
            pb,
            environment,
            split,
            n,
            ks=ks,
            problems=problems,
            temperature=temperature,
            seed=seed,
            budgets=st.budgets(),
            recovery=recovery,
            provenance=record,
            phases=phases,
            device=device,
        )
    write_compare(res, out)
    for key, what in (("paired", "success"), ("paired_recovery", "recovery after the same wrong first patch")):
        if key not in res:
            continue
        c = res[key]
        console.print(
            f"[bold]{what}[/]\nA {escape(str(pa))}: {c['a_mean']:.3f}\nB {escape(str(pb))}: {c['b_mean']:.3f}\n"
            f"B − A = {c['diff']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}] (95 % CI, bootstrap over "
            f"{c['n_groups']} problems); problems won: B {c['b_wins']}, A {c['a_wins']}, tied {c['ties']}; "
            f"env-error pairs excluded: {c['env_errors_excluded']}"
        )
    for w in res["a"]["warnings"]:
        console.print(f"[yellow]warning:[/] {escape(w)}")
    console.print(f"written: {out}/compare.json, compare.md, cost-a.png, cost-b.png")
    return out / "compare.json"

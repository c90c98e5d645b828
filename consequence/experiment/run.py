"""Running an experiment: every (arm, training seed) an ordinary run folder, trained in its own
process by a Ray task; a killed experiment, started again, skips the runs that finished and
resumes the others from their newest resume state.

Budgets come first (:func:`arm_budgets`): before any work each trained arm's expected spend
(episodes or generated tokens, ``consequence.experiment.budget``) is computed from its
settings, and arms that differ are refused unless the file allows it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from consequence.experiment.spec import Arm, Experiment

QUEUED, RUNNING, FINISHED, FAILED, SKIPPED = "queued", "running", "finished", "failed", "finished before"


def run_config(exp: Experiment, arm: Arm, seed: int):
    """The TrainConfig of ``arm`` at training ``seed``: arm settings over ``base`` over the recipe.

    Raises:
        ValueError: the settings are refused (the message is prefixed with the arm).
    """
    from consequence.recipes import resolve_config

    given = {
        **exp.base,
        **arm.settings,
        "seed": seed,
        "eval_seed": exp.eval_seed,
        "run_dir": str(exp.run_dir(arm.name, seed).resolve()),
    }
    try:
        return resolve_config(None, given)
    except ValueError as e:
        raise ValueError(f"arm {arm.name}: {e}") from None


def arm_budgets(exp: Experiment) -> dict[str, tuple[float, str]]:
    """Each trained arm's planned spend of ``exp.equalise``: ``arm → (value, formula)``.

    Episodes are those the arm trains from, whoever generated them: the student's rollouts
    (K·B·G; under dynamic sampling its minimum, every group kept at once) and, under
    ``--distill-lambda`` λ < 1, the (1 − λ)·K·B·G episodes drawn from ``--distill-data`` (a
    teacher's), so SFT on demonstrations (λ = 0) and RL are compared at the same number of
    episodes. Generated tokens are the student's rollouts × L̄ (``budget.mean_tokens``, else the
    arm's L_max, an upper bound).
    """
    from consequence.config import generation_budget
    from consequence.experiment.budget import plan_lines

    out = {}
    for arm in exp.arms:
        if not arm.trains:
            continue
        cfg = run_config(exp, arm, exp.seeds[0])
        L = exp.mean_tokens or float(generation_budget(cfg.max_turns, cfg.max_new_tokens, cfg.max_total_tokens))
        lines = {x.quantity: x for x in plan_lines(cfg, L)}
        if exp.equalise == "generated_tokens":
            x = lines["generated tokens"]
            out[arm.name] = (float(x.value), x.formula)
        else:
            out[arm.name] = _episodes(cfg, lines)
    return out


def _episodes(cfg, lines: dict) -> tuple[float, str]:
    """The student's rollouts plus the fixed-data episodes of GKD's λ (see :func:`arm_budgets`)."""
    own = (
        lines.get("rollouts generated") or lines.get("trajectories of the student") or lines["trajectories trained on"]
    )
    if cfg.distill_lambda >= 1:
        return float(own.value), own.formula
    data = (1 - cfg.distill_lambda) * cfg.iterations * cfg.tasks_per_iteration * cfg.group_size
    return own.value + data, f"{own.formula} + (1−λ)·K·B·G data = {own.value:,.0f} + {data:,.0f}"


def check_budgets(exp: Experiment) -> dict[str, tuple[float, str]]:
    """:func:`arm_budgets`, refused when the arms differ by more than ``budget.tolerance``.

    Raises:
        ValueError: unequal budgets (each arm's spend listed) without ``allow_unequal``.
    """
    budgets = arm_budgets(exp)
    values = [v for v, _ in budgets.values()]
    top = max(values)
    if top > 0 and (top - min(values)) / top > exp.tolerance and not exp.allow_unequal:
        listed = "; ".join(f"{a} {v:,.0f} ({f})" for a, (v, f) in budgets.items())
        raise ValueError(
            f"the arms' {exp.equalise.replace('_', ' ')} differ: {listed}. Equalise them (e.g. iterations or "
            "tasks_per_iteration per arm), raise budget.tolerance, or set budget.allow_unequal: true"
        )
    return budgets


@dataclass
class RunState:
    """One run of the experiment as the progress view shows it."""

    arm: str
    seed: int
    folder: Path
    status: str = QUEUED
    started: float | None = None
    seconds: float | None = None
    log: Path | None = None
    reason: str | None = None  # why a failed run failed (also appended to its log)


def run_status(cfg, folder: Path) -> str:
    """``finished`` (manifest says so, with these settings), ``resume`` (a resume state to
    continue from) or ``new``.

    Raises:
        ValueError: the folder holds a run with other settings (the plan was edited).
    """
    import json

    import yaml

    from consequence.config import TrainConfig, saved_settings

    saved = folder / "config.yaml"
    if not saved.is_file():
        return "new"
    try:
        had = TrainConfig.checked(**saved_settings(yaml.safe_load(saved.read_text(encoding="utf-8")) or {}))
    except (ValueError, yaml.YAMLError):
        return "new"  # half-written or foreign: a new run replaces its outputs
    now, then = cfg.model_dump(), had.model_dump()
    if differ := sorted(k for k in now if now[k] != then.get(k)):
        raise ValueError(
            f"{folder} holds a run with other settings ({', '.join(differ)}); the experiment file changed "
            "since: restore it, or delete that folder to train it again"
        )
    try:
        finished = json.loads((folder / "manifest.json").read_text()).get("status") == "finished"
    except (OSError, ValueError):
        finished = False
    if finished and _iterations_done(folder) == cfg.iterations:
        return "finished"
    from consequence.loop.resume import latest_state

    try:
        return "resume" if latest_state(folder) is not None else "new"
    except ValueError:
        return "new"


def _iterations_done(folder: Path) -> int:
    """Lines of the run's metrics.jsonl (0 when it is missing): a finished run has one per iteration."""
    metrics = folder / "metrics.jsonl"
    return sum(1 for line in metrics.read_text().splitlines() if line.strip()) if metrics.is_file() else 0


def _command(exp: Experiment, arm: Arm, seed: int, cfg, how: str) -> list[str]:
    """The ``consequence train`` command line of one run (its config file written first)."""
    import yaml

    from consequence.fileio import write_text_atomic

    cli = [sys.executable, "-c", "from consequence.cli import app; app()", "train"]
    if how == "resume":
        return [*cli, "--resume", str(exp.run_dir(arm.name, seed))]
    path = exp.folder / "configs" / f"{arm.name}-seed{seed}.yaml"
    write_text_atomic(path, yaml.safe_dump(cfg.nested_dump(), sort_keys=False, allow_unicode=True))
    return [*cli, "--config", str(path)]


def _train_process(argv: list[str], log: str, threads: int) -> int:
    """Run one training process (a Ray task's body); its output goes to ``log``. The process
    dies with the task's worker (Linux: PR_SET_PDEATHSIG), so a killed experiment leaves no
    run writing behind it."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # a plug-in environment imports as here
    with open(log, "ab") as f:
        return subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent).returncode


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def execute(
    exp: Experiment,
    cpus_per_run: int = 1,
    ray_address: str | None = None,
    show: Callable[[list[RunState]], None] = lambda states: None,
) -> list[RunState]:
    """Train every (trained arm, seed) not finished yet, as Ray tasks of ``cpus_per_run`` CPUs
    each (a local Ray instance, or the cluster at ``ray_address``), and return every run's state.
    ``show`` is called with all states whenever one changes.

    Raises:
        ValueError: a run's settings are refused, or a folder holds a run with other settings.
        RuntimeError: Ray cannot start or reach the cluster.
    """
    todo = []
    states = []
    for arm, seed in exp.runs():
        cfg = run_config(exp, arm, seed)
        folder = exp.run_dir(arm.name, seed)
        st = RunState(arm.name, seed, folder, log=exp.folder / "logs" / f"{arm.name}-seed{seed}.log")
        states.append(st)
        how = run_status(cfg, folder)
        if how == "finished":
            st.status = SKIPPED
            continue
        todo.append((st, arm, seed, cfg, how))
    show(states)
    if not todo:
        return states
    own = _start_ray(ray_address, cpus_per_run)
    try:
        (exp.folder / "logs").mkdir(parents=True, exist_ok=True)  # written only once Ray runs
        jobs = [(st, _command(exp, arm, seed, cfg, how)) for st, arm, seed, cfg, how in todo]
        for st, _ in jobs:  # a log left by an earlier attempt would read as "started"
            if st.log is not None and st.log.exists():
                st.log.rename(st.log.with_suffix(f".{int(time.time())}.log"))
        _run_all(jobs, cpus_per_run, lambda: show(states))
    finally:
        if own:
            import ray

            ray.shutdown()
    return states


def _start_ray(ray_address: str | None, cpus_per_run: int) -> bool:
    """Join the cluster at ``ray_address`` (checked to accept connections first) or start a
    local instance with every CPU of this machine; True when this call started Ray.

    Raises:
        ValueError: an address that accepts no connection.
        RuntimeError: Ray cannot start or reach the cluster.
    """
    import ray

    if ray_address:
        from consequence.scale.preflight import check_ray_address

        check_ray_address(ray_address)
    if ray.is_initialized():
        return False
    kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
    kw |= (
        {"address": ray_address}
        if ray_address
        else {"address": "local", "num_cpus": max(os.cpu_count() or 1, cpus_per_run)}
    )
    try:
        ray.init(**kw)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise RuntimeError(f"could not start or reach Ray ({ray_address or 'a local instance'}): {e}") from e
    return True


def _run_all(jobs: list[tuple[RunState, list[str]]], cpus_per_run: int, changed: Callable[[], None]) -> None:
    """One Ray task per job; each state follows its task (queued, running once its log exists,
    finished or failed); ``changed`` is called every 2 s and after each end."""
    import ray

    task = ray.remote(num_cpus=cpus_per_run, max_retries=0)(_train_process)
    refs = {task.remote(argv, str(st.log), cpus_per_run): st for st, argv in jobs}
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=2.0)
        for st in refs.values():  # a task has started when its log file exists
            if st.status == QUEUED and st.log is not None and st.log.exists():
                st.status, st.started = RUNNING, time.time()
        for ref in done:
            st = refs[ref]
            err: Exception | None = None
            try:
                rc = ray.get(ref)
            except Exception as e:  # the worker died (e.g. Ray's out-of-memory killer): its folder resumes next time
                rc, err = None, e
            st.status = FINISHED if rc == 0 else FAILED
            st.seconds = time.time() - (st.started or time.time())
            if st.status == FAILED:
                st.reason = failure_reason(rc, err)
                if st.log is not None:
                    with open(st.log, "a") as f:
                        f.write(f"\n[consequence experiment] the run failed: {st.reason}\n")
        changed()


def failure_reason(rc: int | None, err: BaseException | None = None) -> str:
    """Why a run's task failed, in a line: the training process's exit code or signal, or
    what Ray raised when the task's worker died (``rc`` None)."""
    if err is not None:
        first = (str(err).strip().splitlines() or [""])[0]
        hint = " (memory: fewer runs at once, i.e. a larger --cpus-per-run)" if "memory" in str(err).lower() else ""
        return f"its Ray worker died: {type(err).__name__}: {first}{hint}"
    if rc is not None and rc < 0:
        name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
        oom = " (often the out-of-memory killer)" if -rc == signal.SIGKILL else ""
        return f"the training process was killed by signal {name}{oom}"
    return f"the training process exited with code {rc}: its error is at the end of the log"

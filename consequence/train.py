"""The training run: synchronous, in the order of the seeds' pseudo-code.

    for each iteration:
        tasks   = sample B train tasks                          (task box)
        trajs   = roll out G episodes per task with π_old       (rollout box: harness + env)
        rewards = verifier score, checked finite and in range   (reward box)
        A       = advantage estimator over each group           (credit box)
        θ      ← maximise the surrogate, reduced over the step  (update box)
        every k iterations: validate greedily                    (evaluation box)

The boxes' choices come from the config (a recipe in ``consequence/recipes``; see
``consequence explain``). The defaults are GRPO with two departures from the paper (Shao
et al. 2024, §4.1): token-mean reduction (DAPO) rather than seq-mean-token-mean, and no
KL-to-reference term (β = 0), as in DAPO and Dr.GRPO.
"""

from __future__ import annotations

import copy
import errno
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from consequence.config import TrainConfig
from consequence.credit.advantages import mixed_group_fraction
from consequence.envs.repair_env import SYSTEM_PROMPT, TOOLS
from consequence.envs.sandbox import isolation_report
from consequence.evaluate.compare import summarize
from consequence.harness.renderer import Renderer
from consequence.policy.sampler import SamplingParams
from consequence.policy.tiny import load_policy, save_policy
from consequence.checks import run_pre_step_checks
from consequence.diagnostics import iteration_extras, warnings_for
from consequence.evaluate.final import final_report, validate
from consequence.evaluate.splits import record_touch, reuse_warning
from consequence.report.manifest import build_manifest, sha256_of, write_manifest
from consequence.resume import ResumeState, latest_state, load_learner_state, rewind_run_dir, save_state
from consequence.iteration import Learner, collect, credit, logprob_fn, make_learner, update
from consequence.fileio import append_line, write_text_atomic
from consequence.seeding import seed_of
from consequence.records import Trajectory, write_trajectories
from consequence.rollout.episodes import Budgets
from consequence.envs.sources import load_task_source


# A write that fails with one of these stops the run cleanly (RunStopped); others propagate.
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO}


class RunStopped(RuntimeError):
    """The run stopped on a non-finite tensor in an update or a failed write (e.g. disk full).

    The message says what happened, which resume state is intact, and how to continue.
    """


@dataclass
class _Run:
    """Everything one training run carries from iteration to iteration."""

    cfg: TrainConfig
    dir: Path
    model_path: Path
    tokenizer: Any
    reference: torch.nn.Module
    learner: Learner
    renderer: Renderer
    split: Any
    budgets: Budgets
    sampling: SamplingParams
    manifest: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)
    start: int = 0  # first iteration to run (iterations completed by the resume state)


def train(cfg: TrainConfig, console=None, resume: bool = False) -> dict[str, Any]:
    """Run one training job end to end; returns the final report as a dict.

    Args:
        resume: continue ``cfg.run_dir`` from its newest resume state
            (``consequence.resume``; written every ``cfg.checkpoint_every`` iterations),
            dropping trajectory files and metric lines of later iterations; without a
            state the run starts again at iteration 0 in the same folder.

    Raises:
        RunStopped: a NaN / ±inf tensor in an update (named, with its trajectories) or an
            OSError while writing (disk full, ...); the newest resume state is intact.
        ValueError: bad input found before work starts (model, resume state).
    """
    from rich.console import Console

    console = console or Console()
    t_start = time.perf_counter()
    run_path = Path(cfg.run_dir)
    run_path.mkdir(parents=True, exist_ok=True)
    state = latest_state(run_path) if resume else None
    try:
        r = _start(cfg, console, run_path, resume, state)
        _loop(r, console)
        return _finish(r, console, t_start)
    except FloatingPointError as e:
        raise _stopped(e, run_path) from e
    except OSError as e:
        if e.errno not in WRITE_ERRNOS:
            raise
        raise _stopped(e, run_path) from e


def _start(cfg: TrainConfig, console, run: Path, resume: bool, state: ResumeState | None) -> _Run:
    """Load model, tasks and learner (from the resume state when there is one); write the run's files."""
    if not resume:
        write_text_atomic(run / "config.yaml", yaml.safe_dump(cfg.model_dump(), sort_keys=False))
    torch.manual_seed(cfg.seed)
    model_path = _resolve_model(cfg, console)
    model, tokenizer = load_policy(model_path)
    reference = copy.deepcopy(model).eval()  # the warm start, kept for the final paired comparison
    if state is not None:
        _check_same_start(state, model_path)
        model = load_policy(state.path / "policy")[0]
    split = load_task_source(cfg.tasks, cfg.split_seed)
    write_text_atomic(run / "split.json", json.dumps(split.problem_ids()))
    learner = make_learner(cfg, model, reference)
    r = _Run(cfg, run, model_path, tokenizer, reference, learner, Renderer(tokenizer, TOOLS), split,
             Budgets(cfg.max_turns, cfg.max_new_tokens, cfg.max_total_tokens),
             SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p, cfg.max_new_tokens), manifest={})
    if state is None:
        r.manifest = build_manifest(cfg, model_path, split.problem_ids(), tools=TOOLS, system_prompt=SYSTEM_PROMPT,
                                    chat_template=tokenizer.chat_template, isolation=isolation_report())
        policy = [str(run / "checkpoints")]
        r.manifest["splits_touched"] = [record_touch(cfg.tasks, cfg.split_seed, "train", "RL rollouts", policy)] + (
            [record_touch(cfg.tasks, cfg.split_seed, "validation", "greedy success of each checkpoint during "
                          "training (selects checkpoints)", policy)] if cfg.eval_every else [])
    else:
        load_learner_state(state, learner)
        r.manifest, r.history, r.start = state.manifest, state.history, state.iteration
        r.manifest.setdefault("resumed", []).append({"from_iteration": state.iteration, "state": state.path.name})
        r.manifest["status"] = "running"
    rewind_run_dir(run, r.start, r.history)
    write_manifest(r.manifest, run)
    console.print(f"[bold]consequence train[/]: {cfg.iterations} iterations × {cfg.tasks_per_iteration} tasks "
                  f"× {cfg.group_size} rollouts, model {model_path}, run dir {run}"
                  + (f"; resumed after iteration {r.start} from {state.path}" if state else
                     "; no resume state, starting at iteration 0" if resume else ""))
    return r


def _check_same_start(state: ResumeState, model_path: Path) -> None:
    """The reference is reloaded from the starting model: it must be the one the run began with."""
    want = state.manifest.get("model", {}).get("weights_sha256")
    have = sha256_of(model_path / "model.safetensors")
    if want and have != want:
        raise ValueError(f"cannot resume: the starting model {model_path} changed since the run began "
                         f"(weights sha256 {have} != {want} in the manifest); the reference policy would differ")


def _loop(r: _Run, console) -> None:
    """Iterations ``r.start`` … ``cfg.iterations − 1``, each followed by its metrics line and,
    every ``checkpoint_every`` iterations and after the last, a resume state."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    cfg = r.cfg
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), TimeRemainingColumn(),
                  TextColumn("{task.fields[status]}"), console=console) as bar:
        job = bar.add_task(cfg.recipe or "GRPO", total=cfg.iterations, completed=r.start, status="")
        for it in range(r.start, cfg.iterations):
            m = _run_iteration(r, it, bar.console)
            status = f"reward {m['reward_mean']:.2f}  mixed {m['mixed_group_fraction']:.2f}"
            if "val_success" in m:
                status += f"  val {m['val_success']:.2f}"
            bar.update(job, advance=1, status=status)
            if not console.is_terminal:  # logs and pipes get one line per iteration instead
                console.print(f"iteration {it + 1}/{cfg.iterations}  {status}")


def _run_iteration(r: _Run, it: int, console) -> dict[str, Any]:
    """One iteration with its validation, metrics line and resume state; returns its metrics."""
    cfg, model = r.cfg, r.learner.model
    try:
        m = iteration(it, cfg, r.learner, r.renderer, r.split, r.budgets, r.sampling, r.dir, first=it == 0,
                      console=console)
    except FloatingPointError as e:
        e.iteration = it  # for RunStopped's message: which trajectory file the indices point into
        raise
    if cfg.eval_every and ((it + 1) % cfg.eval_every == 0 or it + 1 == cfg.iterations):
        m["val_success"] = validate(model, r.renderer, r.split, r.budgets, cfg)["success"]
        save_policy(model, r.tokenizer, r.dir / "checkpoints" / f"iter_{it + 1:04d}")
    if "pre_step_checks" in m:
        r.manifest["checks"]["results"] = m.pop("pre_step_checks")
        write_manifest(r.manifest, r.dir)
    r.history.append(m)
    m["warnings"] = warnings_for(r.history)
    for w in m["warnings"]:
        console.print(f"[yellow]warning (iteration {it + 1}):[/] {w}")
    append_line(r.dir / "metrics.jsonl", json.dumps(m))
    if (it + 1) % cfg.checkpoint_every == 0 or it + 1 == cfg.iterations:
        save_state(r.dir, it + 1, r.learner, r.tokenizer, r.history, r.manifest, cfg.model_dump())
    return m


def _finish(r: _Run, console, t_start: float) -> dict[str, Any]:
    """Final policy checkpoint, warm start vs RL comparison, report, plots; the manifest is closed."""
    run = r.dir
    save_policy(r.learner.model, r.tokenizer, run / "checkpoints" / "final")
    policies = [str(r.model_path), str(run / "checkpoints" / "final")]
    warning = reuse_warning(r.cfg.tasks, r.cfg.split_seed, policies) if r.cfg.final_eval_episodes else None
    report = final_report(r.cfg, r.reference, r.learner.model, r.renderer, r.split, r.budgets, console, run)
    touches = [record_touch(r.cfg.tasks, r.cfg.split_seed, s, "final evaluation of consequence train", policies)
               for s in ("test", "train") if r.cfg.final_eval_episodes]
    r.manifest["splits_touched"] = r.manifest.get("splits_touched", []) + touches
    report["warnings"] = [warning] if warning else []
    report["splits_touched"] = r.manifest["splits_touched"]
    report["train_seconds"] = time.perf_counter() - t_start
    report["sandbox_isolation"] = isolation_report()
    write_text_atomic(run / "report.json", json.dumps(report, indent=2))
    r.manifest.update(status="finished", evaluation_files=report.pop("evaluation_files", []), report="report.json")
    write_manifest(r.manifest, run)
    from consequence.report.plots import plot_metrics, write_markdown_report

    plot_metrics(run / "metrics.jsonl", run / "curves.png")
    write_markdown_report(report, run / "report.md")
    console.print((run / "report.md").read_text())
    return report


def _stopped(e: BaseException, run: Path) -> RunStopped:
    """The RunStopped for a numerics error or a failed write, naming the state to resume from."""
    try:
        state = latest_state(run)
    except ValueError:
        state = None
    where = (f"the resume state {state.path} (after iteration {state.iteration}) is intact" if state
             else "no resume state was written yet")
    if isinstance(e, FloatingPointError):
        it = getattr(e, "iteration", None)
        at = "" if it is None else f" in iteration {it} (trajectory numbers index trajectories/iter_{it:04d}.parquet)"
        what = (f"stopped{at}: {e}. Nothing of this step was applied; {where}. Inspect those trajectories "
                f"(`consequence view {run}`). A resume with the same config repeats the same computation; to go "
                "on with other settings (e.g. a lower --learning-rate) start a new run from the state's policy "
                "folder (--model STATE/policy), or, once the cause is fixed in code, continue")
    else:
        fix = {errno.EFBIG: "Raise the file-size limit (ulimit -f)",
               errno.EROFS: "Make the run folder writable"}.get(e.errno, "Free disk space (a resume state takes about "
                                                                   "3 x the model's weights, 6 x with a value head)")
        what = (f"stopped: cannot write {getattr(e, 'filename', None) or run} ({e.strerror or e}); {where} and "
                f"no file was left half-written. {fix}, then continue")
    _mark_stopped(run, str(e))
    return RunStopped(f"{what} with `consequence train --resume {run}`.")


def _mark_stopped(run: Path, reason: str) -> None:
    """Record the stop in manifest.json when that is still possible (it may be the disk that failed)."""
    path = run / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
        manifest.update(status="stopped", stop_reason=reason)
        write_manifest(manifest, run)
    except (OSError, ValueError):
        pass


def iteration(it, cfg, learner: Learner, renderer, split, budgets, sampling, run, first: bool = False,
              console=None) -> dict[str, Any]:
    """One collect → score → credit → update step (``consequence.iteration``); returns its metrics."""
    t0 = time.perf_counter()
    trajs, ds = collect(it, cfg, learner.model, renderer, split, budgets, sampling)
    t_rollout = time.perf_counter() - t0
    pad_id = renderer.tokenizer.pad_token_id
    batch = credit(trajs, cfg, learner, pad_id)
    write_trajectories(run / "trajectories" / f"iter_{it:04d}.parquet", trajs)
    if first and not cfg.skip_checks:
        expected = {i for i, t in enumerate(trajs) if t.reward is not None and t.calls
                    and not (cfg.overlong_filter and t.outcome == "truncated")}
        checks = run_pre_step_checks(model=learner.model, trajs=trajs, rows=batch.rows, pad_id=pad_id,
                            stop_ids=renderer.stop_ids, logprob_fn=logprob_fn(cfg), cfg=cfg,
                            ucfg=learner.update_cfg, expected=expected, console=console)
    t1 = time.perf_counter()
    upd = update(batch, cfg, learner, pad_id, seed=seed_of(cfg.seed, it, "update"))
    t_update = time.perf_counter() - t1
    valid = [t for t in trajs if t.reward is not None]
    n_gen = sum(t.n_generated_tokens for t in trajs)
    metrics = {
        "iteration": it,
        "reward_mean": sum(t.reward for t in valid) / max(1, len(valid)),
        "success": summarize(trajs)["success"],
        "mixed_group_fraction": mixed_group_fraction([t.reward for t in trajs], [t.group_id for t in trajs]),
        "gen_tokens_mean": n_gen / max(1, len(trajs)),
        "tool_calls_mean": sum(t.n_tool_calls for t in trajs) / max(1, len(trajs)),
        "truncated_fraction": sum(t.outcome == "truncated" for t in trajs) / max(1, len(trajs)),
        "env_errors": sum(t.outcome == "env_error" for t in trajs),
        "env_retries": sum(t.env_retries for t in trajs),  # sandbox re-runs, whatever the outcome
        "diagnose_first": sum(_diagnoses_first(t) for t in trajs) / max(1, len(trajs)),
        "rollout_tokens_per_s": n_gen / max(t_rollout, 1e-9),
        "rollout_s": t_rollout,
        "update_s": t_update,
        **upd,
    }
    if first and not cfg.skip_checks:
        metrics["pre_step_checks"] = [vars(c) for c in checks]
    metrics["gen_tokens_total"] = ds["gen_tokens_total"]
    metrics |= iteration_extras(trajs)
    if cfg.dynamic_sampling:
        metrics |= {k: v for k, v in ds.items() if k.startswith("groups_")}
    return metrics


# ---- plumbing -----------------------------------------------------------------------
def _diagnoses_first(t: Trajectory) -> bool:
    first = t.calls[0].tool_calls if t.calls else []
    return bool(first) and first[0]["name"] in ("run_tests", "read_code")


def _resolve_model(cfg: TrainConfig, console) -> Path:
    if cfg.model:
        return Path(cfg.model)
    from consequence.warmstart import WarmstartConfig, ensure_warmstart

    ws = WarmstartConfig(seed=cfg.split_seed, n_demos=cfg.warmstart_demos, sft_epochs=cfg.warmstart_epochs)
    return ensure_warmstart(ws, log=console.print)

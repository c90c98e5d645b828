"""The training run: the loop of the seeds' pseudo-code, on one screen (:func:`run_loop`).

    for it in iterations:
        batch  = source.next_batch(it)      sample B train tasks, roll out G episodes each
                                            with π_old, score them           (tasks, rollout, reward)
        A      = credit(batch)              advantages over each group       (credit)
        θ     ← update(A)                  epochs × mini-batches of surrogate steps (update)
        every k iterations: validate greedily, checkpoint                    (evaluation)

Where a batch comes from is a batch source (``loop.sources``: this process's rollouts, the
agent-runner, rollout workers on Ray, ``--distill-data``); what the run writes is the run
recorder's (``loop.recorder``). The boxes' choices come from the config (a recipe in
``consequence/recipes``; see ``consequence explain``). The defaults are GRPO with two
departures from the paper (Shao et al. 2024, §4.1): token-mean reduction (DAPO) rather than
seq-mean-token-mean, and no KL-to-reference term (β = 0), as in DAPO and Dr.GRPO.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.markup import escape

from consequence.config import TrainConfig
from consequence.credit.advantages import mixed_group_fraction
from consequence.credit.batch import Batch, credit_rewards, training_rows
from consequence.distill.fixed_data import check_token_ids, first_student_iteration, load_fixed_data
from consequence.envs.registry import env_of
from consequence.evaluate.compare import summarize
from consequence.evaluate.episode_eval import parse_error_fraction, success_at_attempt
from consequence.evaluate.final import final_report, validate
from consequence.evaluate.shortcuts import shortcut_metrics
from consequence.evaluate.splits import record_touch, reuse_warning
from consequence.harness.context import context_metrics
from consequence.harness.renderer import Renderer
from consequence.loop.checks import PreStepCheckError, run_pre_step_checks
from consequence.loop.diagnostics import component_means, iteration_extras
from consequence.loop.learner import Learner, credit, logprob_fn, make_learner, refresh_due, refresh_reference, update
from consequence.loop.recorder import RunRecorder, Terminated, is_write_error, run_ending
from consequence.loop.resume import (
    ResumeState,
    interrupt_message,
    latest_state,
    load_learner_state,
    previous_ending,
    stop_message,
)
from consequence.loop.sources import BatchSource, Collected, FixedDataMix, Rollouts, WorkerRollouts
from consequence.policy.device import model_device, peak_memory_gib, resolve_device
from consequence.policy.lora import apply_lora, check_lora_folder, is_adapter_folder
from consequence.policy.sampler import SamplingParams
from consequence.policy.tiny import load_policy
from consequence.recipes import run_label
from consequence.records import Trajectory, credited
from consequence.report.manifest import build_manifest, sha256_of
from consequence.report.trackers import check_trackers
from consequence.reward.judge import judge_metrics
from consequence.reward.reward_model import learned_reward_mean
from consequence.reward.shaping import check_potential, shaping_return_mean
from consequence.rollout.attempts import check_attempts
from consequence.rollout.collect import harness_runner
from consequence.rollout.episodes import Budgets, opening_prompt_len
from consequence.sandbox.sandbox import isolation_report, start_mode
from consequence.scale.preflight import check_rollout_workers
from consequence.scale.scheduler import RolloutError
from consequence.seeding import seed_of
from consequence.update.data_parallel import check_rank_count

__all__ = ["RunInterrupted", "RunStopped", "Terminated", "preflight", "run_ending", "run_loop", "train"]


class RunStopped(RuntimeError):
    """The run stopped on a non-finite tensor in an update or a failed write (e.g. disk full).

    The message says what happened, which resume state is intact, and how to continue.
    """


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped the run; manifest.json says ``status: interrupted``.

    ``str()`` is the message for the user: the last iteration completed and the resume command.
    """

    def __init__(self, message: str, completed: int):
        super().__init__(message)
        self.message, self.completed = message, completed

    def __str__(self) -> str:
        return self.message


@dataclass
class _Run:
    """What the loop works with, made once by :func:`_start`."""

    cfg: TrainConfig
    model_path: Path
    tokenizer: Any
    reference: torch.nn.Module  # the starting policy, for the final paired comparison
    learner: Learner
    renderer: Renderer
    env: Any  # the environment (envs.api.Environment), with its splits
    budgets: Budgets
    sampling: SamplingParams
    label: str  # what the run is (recipes.run_label)
    start: int  # first iteration to run (iterations completed by the resume state)
    fixed_data: list[Trajectory]  # --distill-data, for --distill-lambda < 1
    first_student: int | None  # first iteration that rolls out the student (where the pre-step checks run)
    cold_start: dict[str, Any] | None = None  # --cold-start-demos: the cold start RL starts from (start_model)

    @property
    def pad_id(self) -> int:
        return self.renderer.tokenizer.pad_token_id


# ---- the algorithm --------------------------------------------------------------------------
def run_loop(r: _Run, source: BatchSource, rec: RunRecorder) -> None:
    """Iterations ``r.start`` … ``iterations − 1``: the seeds' loop, one step per line."""
    cfg, learner = r.cfg, r.learner
    with rec.progress(r.label, r.start, cfg.iterations) as done:
        for it in range(r.start, cfg.iterations):
            with _naming_iteration(it):
                t0 = time.perf_counter()
                reference_version = learner.reference_version  # before a refresh at this iteration's end
                got = source.next_batch(it, rec.show)  # B tasks × G episodes with π_old, scored
                t_rollout = time.perf_counter() - t0
                batch = credit(got.trajectories, cfg, learner, r.pad_id, got.from_data)  # advantages over each group
                t_credit = time.perf_counter() - t0 - t_rollout  # the reference's forward pass, when a KL term needs it
                rec.trajectories(it, got.trajectories)
                checks = _check_first_batch(r, it, got, batch, rec.console) if it == r.first_student else None
                t1 = time.perf_counter()
                seed = seed_of(cfg.seed, it, "update")
                divergence_only = got.from_data and cfg.distill_loss != "none"  # else SFT on the data's rows
                upd = update(batch, cfg, learner, r.pad_id, seed=seed, divergence_only=divergence_only)  # θ ← θ + ∇
                t_update = time.perf_counter() - t1
            t2 = time.perf_counter()
            source.publish(learner.model, it + 1)  # version it + 1: what batches started from now on sample with
            t_publish = time.perf_counter() - t2  # weights to the sampler (a copy, a LoRA merge, a worker sync)
            if refresh_due(cfg, it):  # π_ref ← π_θ (version it + 1), for the KL of the iterations after this one
                refresh_reference(learner, it + 1)
            m = iteration_metrics(it, r, got, batch, upd, t_rollout, t_update, checks)
            m |= {"credit_s": t_credit, "publish_s": t_publish} | peak_memory_gib(model_device(learner.model))
            if learner.reference is not None:  # which policy the KL of this iteration's update pulled toward
                m["reference_version"] = reference_version
            m["iteration_s"] = time.perf_counter() - t0  # wall time of the iteration, validation excluded
            if cfg.eval_every and ((it + 1) % cfg.eval_every == 0 or it + 1 == cfg.iterations):
                m["val_success"] = _validate(r, it, rec)  # greedy success on the validation split
                rec.checkpoint(learner.model, r.tokenizer, f"iter_{it + 1:04d}")
            rec.record(it, m)
            if (it + 1) % cfg.checkpoint_every == 0 or it + 1 == cfg.iterations:
                rec.resume_state(it + 1, learner, r.tokenizer, cfg.model_dump())
            done(it, _status_line(m))


@contextlib.contextmanager
def _naming_iteration(it: int) -> Iterator[None]:
    """A NaN / ±inf found in this iteration carries its number (RunStopped names the
    trajectory file its row indices point into)."""
    try:
        yield
    except FloatingPointError as e:
        e.iteration = it  # type: ignore[attr-defined]
        raise


def _validate(r: _Run, it: int, rec: RunRecorder) -> float | None:
    n = r.cfg.val_episodes
    progress = lambda d: rec.show(f"iteration {it}: validation {d}/{n} episodes")  # noqa: E731
    return validate(r.learner.model, r.renderer, r.env, r.budgets, r.cfg, progress=progress)["success"]


# ---- the run around it ----------------------------------------------------------------------
def train(cfg: TrainConfig, console=None, resume: bool = False, reproduces: str | Path | None = None) -> dict[str, Any]:
    """Run one training job end to end; returns the final report as a dict.

    Args:
        resume: continue ``cfg.run_dir`` from its newest resume state
            (``consequence.loop.resume``; written every ``cfg.checkpoint_every`` iterations),
            dropping trajectory files and metric lines of later iterations; without a
            state the run starts again at iteration 0 in the same folder.
        reproduces: the run folder this run reproduces (``consequence reproduce``); recorded
            in the manifest, and that run's evaluations of the test split do not count as
            another policy's in the split-reuse warning (same recipe, same seeds).

    A run without a resume state first deletes the outputs of an earlier run in
    ``cfg.run_dir`` (``consequence.loop.resume.clear_run_outputs``; other files are kept),
    after every check passed.

    Every exit path records how the run ended in ``manifest.json`` (``status`` and
    ``stop_reason``: :func:`~consequence.loop.recorder.run_ending`; docs/resume.md "How a run
    ends") once the run's manifest was written; an error before that leaves the folder as it was.

    Raises:
        RunStopped: a NaN / ±inf tensor in an update (named, with its trajectories) or an
            OSError while writing (disk full, ...); the newest resume state is intact.
        RunInterrupted: Ctrl-C; the message names the last iteration completed and how to resume.
        ValueError: bad input found before work starts (model, resume state, settings that
            cannot work with this model or these tasks: :func:`preflight`; nothing written), or
            after it started (e.g. a chat template that re-renders earlier turns: status ``refused``).
    """
    from rich.console import Console

    console = console or Console()
    t_start = time.perf_counter()
    run_path = Path(cfg.run_dir)
    state = latest_state(run_path) if resume else None
    rec = RunRecorder(run_path, console)
    try:
        with rec:  # records the status on every exit path; below, only the messages
            r = _start(cfg, rec, resume, state, reproduces)
            source = _batch_source(r, rec)
            try:
                run_loop(r, source, rec)
            finally:  # workers and a local Ray instance end with the loop, also on errors and Ctrl-C
                _close(source, rec)
                if r.learner.data_parallel is not None:  # the update ranks stop (torchrun's exit with ours)
                    r.learner.data_parallel.close()
            return _finish(r, rec, t_start)
    except KeyboardInterrupt as e:
        done = len(rec.history)
        raise RunInterrupted(interrupt_message(run_path, done, cfg.iterations), done) from e
    except PreStepCheckError as e:  # the table was printed; the message says what failed and how to skip
        raise RunStopped(f"stopped before the first optimizer step: {e}") from e
    except (FloatingPointError, RolloutError) as e:  # numerics; the rollout workers cannot go on: resumable
        raise RunStopped(stop_message(e, run_path)) from e
    except OSError as e:
        if not is_write_error(e):
            raise
        raise RunStopped(stop_message(e, run_path)) from e


def _start(
    cfg: TrainConfig, rec: RunRecorder, resume: bool, state: ResumeState | None, reproduces: str | Path | None
) -> _Run:
    """Load model, tasks and learner (from the resume state when there is one), check that the
    settings can work (:func:`preflight`); only then clear an earlier run's outputs and write
    the run's files (from then on the recorder records how the run ends)."""
    console = rec.console
    # a device this machine does not have is refused before anything loads (the CLI checked it too)
    device = resolve_device(cfg.device)
    check_trackers(cfg.report_to)  # so is a tracker whose package is not installed (--report-to)
    teacher_device = resolve_device(cfg.teacher_device, "--teacher-device") if cfg.teacher_device else device
    torch.manual_seed(cfg.seed)
    env = env_of(cfg)
    if cfg.shaping == "potential":  # the environment defines Φ, before any model loads
        check_potential(env)
    # --attempts: the environment supports retries, before any model loads
    check_attempts(env, cfg.attempts, cfg.attempt_discount, cfg.attempt_feedback)
    if cfg.judge_url is not None:  # the rubric and the judge's server, before any model loads
        from consequence.reward.judge import check_judge

        check_judge(cfg, env)
    # fixed data is checked against the splits before a model is resolved (a new --split-seed builds a warm start)
    fixed = load_fixed_data(cfg.distill_data, env.split) if cfg.distill_data else []
    model_path = _resolve_model(cfg, console)
    cold = None
    if cfg.cold_start_demos:  # RL starts from the cold start of that model (cached), also the reference
        from consequence.loop.start_model import cold_started

        def check_student() -> None:  # before the cold start is built: its tokenizer is the student's
            tok = load_policy(model_path)[1]
            preflight(cfg, tok, Renderer(tok, env.tools, tool_format=cfg.tool_format), env, model_path)
            if cfg.lora_rank:  # the cold start's adapter: a bad --lora-targets is refused before its demonstrations
                check_lora_folder(model_path, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)

        model_path, cold = cold_started(cfg, model_path, env, console, state is None, check_student)
    model, tokenizer = load_policy(model_path)
    model.to(device)  # the reference below is a copy of it, on the same device
    renderer = Renderer(tokenizer, env.tools, tool_format=cfg.tool_format)
    preflight(cfg, tokenizer, renderer, env, model_path)
    teacher = None
    if cfg.teacher is not None:  # loaded before anything is written: a tokenizer mismatch is refused here
        from consequence.distill.teacher_model import load_teacher

        teacher = load_teacher(cfg.teacher, tokenizer, log=lambda line: console.print(escape(line)), student=model)
        torch.nn.Module.to(teacher, teacher_device)  # mypy rejects the call through transformers' wrapped .to
    check_token_ids(fixed, len(tokenizer), "--distill-data")
    if state is not None:
        _check_same_start(state, model_path)
    reference = copy.deepcopy(model).eval()  # the warm start, kept for the final paired comparison
    if state is not None:
        model = load_policy(state.path / "policy")[0].to(device)  # a LoRA run's state holds its adapter
    elif cfg.lora_rank:  # before anything is written: a bad --lora-targets is refused here
        model = apply_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, model_path)
    rec.dir.mkdir(parents=True, exist_ok=True)
    if state is None:
        rec.clear_earlier_run()
        rec.write_config(cfg.nested_dump())
        if cold is not None:
            rec.write_cold_start(cold)
    rec.write_split(env.problem_ids())
    r = _Run(
        cfg,
        model_path,
        tokenizer,
        reference,
        make_learner(cfg, model, reference, teacher),
        renderer,
        env,
        Budgets(cfg.max_turns, cfg.max_new_tokens, cfg.max_total_tokens),
        SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p, cfg.max_new_tokens, dtype=cfg.dtype),
        label=run_label(cfg),
        start=0,
        fixed_data=fixed,
        first_student=first_student_iteration(cfg.distill_lambda, cfg.seed, cfg.iterations),
        cold_start=cold,
    )
    if state is None:
        rec.manifest = _new_manifest(r, model, reproduces)
    else:
        load_learner_state(state, r.learner)
        rec.manifest, rec.history, r.start = state.manifest, state.history, state.iteration
        rec.manifest.setdefault("resumed", []).append(
            {
                "from_iteration": state.iteration,
                "state": state.path.name,
                "devices": devices_record(r),  # a resumed run may compute elsewhere (docs/devices.md)
                **previous_ending(rec.dir),
            }
        )  # how the run before ended
        rec.manifest["status"] = "running"
    rec.open(r.start)
    rec.start_trackers(cfg.report_to, cfg.model_dump(), r.start)  # --report-to (a resumed run continues them)
    _say_what_runs(r, rec, resume, state)
    return r


def _new_manifest(r: _Run, model, reproduces: str | Path | None) -> dict[str, Any]:
    """The manifest of a new run: what it runs on, with which settings, which splits it touches."""
    cfg = r.cfg
    manifest = build_manifest(
        cfg,
        r.model_path,
        r.env,
        chat_template=r.tokenizer.chat_template,
        isolation=isolation_report(),
        tool_format=r.renderer.tool_format,
        tool_call_format=r.renderer.call_format,
    )
    manifest |= {"run_label": r.label, "cwd": os.getcwd(), "policy_training": policy_training(cfg, model)}
    manifest["devices"] = devices_record(r)
    if reproduces is not None:
        manifest["reproduces"] = os.path.abspath(reproduces)
    if r.cold_start is not None:  # manifest["model"] is the cold start; config.model what it was made from
        manifest["cold_start"] = {k: v for k, v in r.cold_start.items() if k != "sft"} | {"file": "cold_start.json"}
    if r.first_student is None:
        manifest["checks"]["not_run"] = (
            f"every iteration drew its batch from --distill-data (--distill-lambda "
            f"{cfg.distill_lambda:g}): no batch of the student's own samples to check"
        )
    policy = [str(Path(cfg.run_dir) / "checkpoints")]
    manifest["splits_touched"] = [
        record_touch(r.env.label, cfg.split_seed, "train", _train_use(cfg, r.first_student), policy)
    ] + (
        [
            record_touch(
                r.env.label,
                cfg.split_seed,
                "validation",
                "greedy success of each checkpoint during training (selects checkpoints)",
                policy,
            )
        ]
        if cfg.eval_every
        else []
    )
    return manifest


def _say_what_runs(r: _Run, rec: RunRecorder, resume: bool, state: ResumeState | None) -> None:
    cfg = r.cfg
    rec.console.print(
        f"[bold]consequence train[/] ({escape(r.label)}): {cfg.iterations} iterations (numbered 0–"
        f"{cfg.iterations - 1}) × {cfg.tasks_per_iteration} tasks × {cfg.group_size} rollouts, model "
        f"{escape(str(r.model_path))}"
        + (f" (cold start of {escape(r.cold_start['student'])})" if r.cold_start else "")
        + f", run dir {escape(str(rec.dir))}"
        + (
            f"; resuming at iteration {r.start} from {escape(str(state.path))}"
            if state
            else "; no resume state, starting at iteration 0"
            if resume
            else ""
        )
    )
    if cfg.lora_rank:
        pt = policy_training(cfg, r.learner.model)
        rec.console.print(
            f"LoRA r={cfg.lora_rank}, α={cfg.lora_alpha:g} on {','.join(cfg.lora_targets)}: "
            f"{pt['trainable_parameters']:,} of {pt['parameters']:,} parameters trained"
        )


def _batch_source(r: _Run, rec: RunRecorder) -> BatchSource:
    """The run's batch source (``loop.sources``): rollout workers, the agent-runner or this
    process's harness, wrapped in the ``--distill-data`` mix when λ < 1."""
    cfg = r.cfg
    source: BatchSource
    if cfg.rollout_workers:
        source = WorkerRollouts(_start_workers(r, rec))
    elif cfg.agent:
        from consequence.serve.runner import agent_runner

        runner = agent_runner(cfg.agent, r.learner.model, r.renderer, r.env, r.budgets, r.sampling, cfg.agent_timeout)
        source = Rollouts(cfg, runner, r.env, r.budgets, _learned_reward(cfg, r.env))
    else:
        runner = harness_runner(r.learner.model, r.renderer, r.env, r.budgets, r.sampling)
        source = Rollouts(cfg, runner, r.env, r.budgets, _learned_reward(cfg, r.env))
    return FixedDataMix(cfg, r.fixed_data, source) if cfg.distill_lambda < 1 else source


def _learned_reward(cfg: TrainConfig, env=None):
    """``--reward-model`` or ``--judge-url``: the function that adds the learned reward, or the
    judge's, to scored episodes, or None."""
    if cfg.judge_url is not None:
        from consequence.reward.judge import judge_reward

        return judge_reward(cfg, env)
    if cfg.reward_model is None:
        return None
    from consequence.reward.reward_model import RewardModel, apply_reward_model

    rm = RewardModel.load(cfg.reward_model)
    return lambda trajs: apply_reward_model(trajs, rm, cfg.reward_model_weight)


def _start_workers(r: _Run, rec: RunRecorder):
    """Rollout workers on Ray (docs/async.md), given version ``r.start`` of the weights; a
    resumed run rolls out the batches its kept iterations did not consume or drop first."""
    from consequence.scale.scheduler import AsyncRollouts, batches_done
    from consequence.scale.staleness import pipeline_warning

    cfg, console = r.cfg, rec.console
    console.print(
        f"starting {cfg.rollout_workers} rollout worker(s) on Ray"
        + (f" at {escape(cfg.ray_address)}" if cfg.ray_address else " (local instance)")
        + f", max staleness {cfg.max_staleness}"
    )
    if warning := pipeline_warning(cfg.rollout_workers, cfg.max_staleness):
        console.print(f"[yellow]warning:[/] {escape(warning)}")
    rollouts = AsyncRollouts(
        cfg, str(r.model_path), done=batches_done(rec.history), log=lambda line: console.print(escape(line))
    )
    rollouts.publish(r.learner.model, r.start)
    rec.manifest.setdefault("rollout_workers", []).append(
        {
            "from_iteration": r.start,
            "workers": cfg.rollout_workers,
            "max_staleness": cfg.max_staleness,
            "ray_address": cfg.ray_address,
            "where": [rollouts.where[i] for i in sorted(rollouts.where)],
        }
    )
    rec.save_manifest()
    return rollouts


def _close(source: BatchSource, rec: RunRecorder) -> None:
    """Stop the source; rollout workers' counts (batches no iteration trained on) go into the manifest."""
    closed = source.close()
    if closed:
        rec.manifest["rollout_workers"][-1] |= closed
        rec.save_manifest()


def _finish(r: _Run, rec: RunRecorder, t_start: float) -> dict[str, Any]:
    """Final policy checkpoint, warm start vs RL comparison, report, plots; the manifest is closed."""
    cfg, run = r.cfg, rec.dir
    rec.checkpoint(r.learner.model, r.tokenizer, "final")
    policies = [str(r.model_path), str(run / "checkpoints" / "final")]
    # a reproduction is the same recipe with the same seeds: the original's final checkpoint is not "another policy"
    same = [str(Path(rec.manifest["reproduces"]) / "checkpoints" / "final")] if rec.manifest.get("reproduces") else []
    tested = cfg.final_eval_episodes and "test" in cfg.final_eval_splits
    warning = reuse_warning(r.env.label, cfg.split_seed, policies + same) if tested else None
    skipped = "final evaluation skipped (--final-eval-episodes 0)" if not cfg.final_eval_episodes else None
    if skipped:
        rec.console.print(skipped)
    report = final_report(cfg, r.reference, r.learner.model, r.renderer, r.env, r.budgets, rec.console, run)
    touches = [
        record_touch(r.env.label, cfg.split_seed, s, "final evaluation of consequence train", policies)
        for s in cfg.final_eval_splits
        if cfg.final_eval_episodes
    ]
    rec.manifest["splits_touched"] = rec.manifest.get("splits_touched", []) + touches
    report["warnings"] = ([warning] if warning else []) + report.pop("answer_warnings", [])
    report["splits_touched"] = rec.manifest["splits_touched"]
    report["train_seconds"] = time.perf_counter() - t_start
    report["sandbox_isolation"] = isolation_report()
    report["run_label"] = r.label
    report["start_model"] = start_model_record(r)
    if skipped:
        report["final_evaluation"] = skipped
    rec.report(report, skipped)
    return report


def start_model_record(r: _Run) -> dict[str, Any]:
    """The policy RL started from (the warm-start side of the final comparison): its folder, and
    for a cold start what it was made from and on how many verified demonstrations."""
    out: dict[str, Any] = {"path": str(r.model_path)}
    if r.cold_start is not None:
        sft = r.cold_start["sft"]
        out["cold_start"] = {
            "model": r.cold_start["model"],
            "student": r.cold_start["student"],
            "environment": sft.get("environment"),
            "verified": sft.get("teacher", {}).get("verified"),
            "episodes": sft.get("teacher", {}).get("episodes"),
            "rows": sft.get("rows"),
            "built": r.cold_start["built"],
        }
    return out


# ---- the first batch's checks -----------------------------------------------------------------
def _check_first_batch(r: _Run, it: int, got: Collected, batch: Batch, console) -> list | None:
    """Before the first update on the student's own samples: refuse a batch that cannot
    train, then run the pre-step checks (``loop.checks``; off with ``--skip-checks``).

    Returns:
        the checks' results, or None when they did not run.
    """
    cfg, trajs = r.cfg, got.trajectories
    _refuse_an_untrainable_first_batch(trajs, cfg, it)
    if got.from_data or cfg.skip_checks:
        return None
    expected: set[int] | None = {
        i for i, t in enumerate(trajs) if credited(t) and not (cfg.overlong_filter and t.outcome == "truncated")
    }
    rows = batch.rows
    if cfg.advantage == "rejection":  # the bookkeeping is checked on every row, accepted or rejected
        rows, expected = training_rows(trajs)[0], None
    return run_pre_step_checks(
        model=r.learner.model,
        trajs=trajs,
        rows=rows,
        pad_id=r.pad_id,
        stop_ids=r.renderer.stop_ids,
        logprob_fn=logprob_fn(cfg),
        cfg=cfg,
        ucfg=r.learner.update_cfg,
        expected=expected,
        console=console,
    )


def _refuse_an_untrainable_first_batch(trajs: list[Trajectory], cfg: TrainConfig, it: int) -> None:
    """Stop before any update when the first batch cannot train: every episode an env_error
    (naming the agent when it was the agent that failed), or an agent that never called the model.

    Raises:
        PreStepCheckError: what went wrong and what to fix.
    """
    where = f"the episodes are in trajectories/iter_{it:04d}.parquet"
    if trajs and all(t.outcome == "env_error" for t in trajs):
        errors = list(dict.fromkeys(t.error or "" for t in trajs))
        # The agent-runner writes "the agent ..." for the agent's own failures (serve.runner).
        agent_failed = cfg.agent and any((e or "").startswith("the agent") for e in errors)
        said, fix = (
            ("", f"Fix the agent {cfg.agent} (docs/agents.md §4)")
            if agent_failed
            else ("the environment said: ", "Fix the environment (docs/environments.md §4)")
        )
        raise PreStepCheckError(
            f"every episode of the first batch is an env_error ({len(trajs)} of {len(trajs)}), "
            f"so nothing can be trained; {said}{'; '.join(errors[:3])}. {fix}; {where}"
        )
    if cfg.agent and trajs and not any(t.calls for t in trajs):
        raise PreStepCheckError(
            f"the agent made 0 model calls in {len(trajs)} episodes, so there is nothing to train "
            f"on: --agent {cfg.agent} must call client.chat.completions.create(model=task.model, "
            f"messages=task.messages, ...) (docs/agents.md §1); {where}"
        )


# ---- an iteration's metrics -------------------------------------------------------------------
def iteration_metrics(
    it: int,
    r: _Run,
    got: Collected,
    batch: Batch,
    upd: dict[str, float],
    t_rollout: float,
    t_update: float,
    checks: list | None,
) -> dict[str, Any]:
    """Iteration ``it``'s line of metrics.jsonl (docs/metrics.md), timings in seconds."""
    cfg, trajs, ds = r.cfg, got.trajectories, got.stats
    valid = [t for t in trajs if t.reward is not None]
    rewards = [t.reward for t in valid if t.reward is not None]  # (the same list, typed for mypy)
    n_gen = sum(t.n_generated_tokens for t in trajs)
    n = max(1, len(trajs))
    metrics = {
        "iteration": it,
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,  # none scored: not a 0
        "reward_components_mean": component_means(valid),
        "success": summarize(trajs)["success"],
        "mixed_group_fraction": mixed_group_fraction(credit_rewards(trajs), [t.group_id for t in trajs]),
        "gen_tokens_mean": n_gen / n,
        "tool_calls_mean": sum(t.n_tool_calls for t in trajs) / n,
        "parse_error_fraction": parse_error_fraction(trajs),
        **shortcut_metrics(trajs),  # tool_call_rate, invalid_call_*, answers (evaluate/shortcuts.py; None: undefined)
        "truncated_fraction": sum(t.outcome == "truncated" for t in trajs) / n,
        "env_errors": sum(t.outcome == "env_error" for t in trajs),
        "env_retries": sum(t.env_retries for t in trajs),  # sandbox re-runs, whatever the outcome
        **r.env.iteration_metrics(trajs),  # the environment's own (repair: diagnose_first)
        # every token generated in rollout_s, dropped groups included (dynamic sampling): the sampler's speed
        "rollout_tokens_per_s": ds["gen_tokens_total"] / max(t_rollout, 1e-9),
        "rollout_s": t_rollout,
        "update_s": t_update,
        **upd,
    }
    if cfg.reward_model is not None:  # the learned reward beside success (the verifier's): over-optimisation
        metrics["learned_reward_mean"] = learned_reward_mean(valid, cfg.reward_model_weight)
    if cfg.judge_url is not None:  # the judge's score beside success, and the episodes it failed to judge
        metrics |= judge_metrics(trajs, cfg.judge_weight)
    if cfg.shaping == "potential":  # mean Σ_t F_t per episode (−Φ(s_0) at γ = 1 for a finished one)
        metrics["shaping_return_mean"] = shaping_return_mean(valid)
    if cfg.context != "full":  # a rewritten context starts a new training row (harness.context)
        metrics |= context_metrics(trajs)
    if cfg.attempts > 1:  # share of episodes solved within j attempts, j = 1..k (rollout.attempts)
        metrics |= {f"success_at_attempt_{j}": v for j, v in success_at_attempt(trajs, cfg.attempts).items()}
    if checks is not None:
        metrics["pre_step_checks"] = [c.as_dict() for c in checks]
    metrics["gen_tokens_total"] = ds["gen_tokens_total"]
    if got.queue:  # the workers' own speed; rollout_s is the trainer's wait for the batch
        metrics |= got.queue | {
            "rollout_tokens_per_s": ds["gen_tokens_total"] / max(got.queue["worker_rollout_s"], 1e-9)
        }
    metrics |= {k: v for k, v in ds.items() if k.startswith("agent_")}  # --agent: prefix breaks, calls, batches
    metrics |= batch.metrics  # on-policy distillation: teacher_reverse_kl, teacher_forward_tokens, teacher_s
    metrics |= iteration_extras(trajs)
    if cfg.dynamic_sampling:
        metrics |= {k: v for k, v in ds.items() if k.startswith("groups_")}
    if cfg.distill_lambda < 1:
        metrics["fixed_data_batch"] = float(got.from_data)
    if got.from_data:  # the rows are the data's, not the student's: its success is not the policy's,
        # and a ratio against the data's stored log-probs (a teacher's, 0 for the scripted one) means nothing
        metrics = {k: v for k, v in metrics.items() if not k.startswith(_RATIO_METRICS)}
        metrics |= {"reward_mean": None, "success": None, "mixed_group_fraction": None, "rollout_tokens_per_s": None}
    return metrics


_RATIO_METRICS = ("ratio_", "first_step_ratio_", "clip_frac_")


def machine_dependent(key: str) -> bool:
    """Whether metrics.jsonl's ``key`` measures the machine rather than the run: timings
    (``*_s``), throughput (``*_per_s``), memory (``*_gib``). Two runs of the same settings and
    seeds differ only in these (docs/metrics.md §7)."""
    return key.endswith(("_s", "_per_s", "_gib"))


def _status_line(m: dict[str, Any]) -> str:
    """What the progress bar shows after an iteration: reward and mixed groups, or the fixed
    data's divergence; the validation success when it ran."""
    if m.get("fixed_data_batch"):
        what = (
            f"divergence {m['distill_divergence']:.3f}"
            if "distill_divergence" in m
            else f"SFT on {m.get('rejection_accepted', 0):.0f} verified episodes"
        )
        status = f"fixed-data batch (--distill-data): {what}"
    else:
        reward = "n/a (all env errors)" if m["reward_mean"] is None else f"{m['reward_mean']:.2f}"
        lag = (
            f"  lag {m['lag_max']}" + (f" (dropped {len(m['dropped_batches'])} stale)" if m["dropped_batches"] else "")
            if "lag_max" in m
            else ""
        )
        status = f"reward {reward}  mixed {m['mixed_group_fraction']:.2f}{lag}"
    if "val_success" in m:  # None: every validation episode was an env error
        status += "  val " + ("n/a (all env errors)" if m["val_success"] is None else f"{m['val_success']:.2f}")
    return status


# ---- what is checked before the run starts ---------------------------------------------------
def _train_use(cfg: TrainConfig, first_student: int | None) -> str:
    """How the run uses the train split (the ledger's purpose)."""
    if cfg.distill_lambda >= 1:
        return "RL rollouts"
    return (
        "RL rollouts and --distill-data batches" if first_student is not None else "--distill-data batches (no rollout)"
    )


def preflight(cfg: TrainConfig, tokenizer, renderer: Renderer, env, model_path: Path) -> None:
    """Settings that cannot work with this model and these tasks, refused before any rollout
    (whether or not the pre-step checks run).

    Raises:
        ValueError: ``CONSEQUENCE_SANDBOX_START`` unknown; ``--top-k`` or ``--distill-top-k``
            above the vocabulary size; a split the run needs is empty (a
            small task file); the longest prompt of the train tasks plus ``--max-new-tokens``
            does not fit in ``--max-total-tokens`` (every such episode would end truncated
            before the policy acts). Each message names the option and the fix.
    """
    if cfg.tool_format != "auto" and not env.tools:
        raise ValueError(
            f"--tool-format {cfg.tool_format}: the environment {cfg.env} offers the policy no tools, so no tool "
            "call is written or read; drop --tool-format"
        )
    if is_adapter_folder(model_path):
        raise ValueError(
            f"--model {model_path} is a LoRA adapter checkpoint: fold it into its base first "
            f"(consequence merge {model_path} --out MERGED), then train from --model MERGED"
        )
    start_mode()  # a bad CONSEQUENCE_SANDBOX_START is refused before the run folder is made
    check_rank_count(cfg.update_ranks)  # more --update-ranks than this machine runs
    if cfg.rollout_workers:
        check_rollout_workers(cfg)
    vocab = len(tokenizer)
    if cfg.distill_top_k > vocab:
        raise ValueError(
            f"--distill-top-k {cfg.distill_top_k} is larger than the vocabulary of {model_path} ({vocab} "
            f"tokens); use a value up to {vocab}, or 0 for the whole vocabulary"
        )
    if cfg.top_k > vocab:
        raise ValueError(
            f"--top-k {cfg.top_k} is larger than the vocabulary of {model_path} ({vocab} tokens), so it "
            f"would keep every token, the same as off; use --top-k 0 (off) or a value up to {vocab}"
        )
    env.check_splits(
        {
            "train": "training",
            "validation": "--eval-every" if cfg.eval_every and cfg.val_episodes else None,
            "test": "--final-eval-episodes" if cfg.final_eval_episodes and "test" in cfg.final_eval_splits else None,
        }
    )
    if cfg.final_eval_episodes and "test" in cfg.final_eval_splits and len(env.split["test"]) < 2:
        raise ValueError(
            f"--env {env.label}: the test split has {len(env.split['test'])} problem, and the final "
            "paired comparison's CI (a bootstrap over problems) needs at least 2; add problems or set "
            "--final-eval-episodes 0"
        )
    longest = env.longest_prompt(
        functools.partial(opening_prompt_len, renderer, env.system_prompt, examples=env.examples),
        seed=seed_of(cfg.seed, "prompt-check"),
    )
    if longest + cfg.max_new_tokens > cfg.max_total_tokens:
        raise ValueError(
            f"--max-total-tokens {cfg.max_total_tokens} is too small: the longest prompt of the train "
            f"tasks is {longest} tokens and a model call may add --max-new-tokens {cfg.max_new_tokens}, "
            "so such episodes would end truncated before the policy acts; raise --max-total-tokens "
            f"to at least {longest + cfg.max_new_tokens} (or lower --max-new-tokens)"
        )


def devices_record(r: _Run) -> dict[str, Any]:
    """Where the run computes (``--device`` / ``--teacher-device`` resolved) and in which precision."""
    out: dict[str, Any] = {"policy": str(model_device(r.learner.model)), "dtype": r.cfg.dtype}
    if r.learner.teacher is not None:
        out["teacher"] = str(model_device(r.learner.teacher))
    cuda = [d for d in out.values() if isinstance(d, str) and d.startswith("cuda")]
    if cuda:
        out["cuda"] = {d: torch.cuda.get_device_name(torch.device(d)) for d in dict.fromkeys(cuda)}
    return out


def policy_training(cfg: TrainConfig, model) -> dict[str, Any]:
    """What the optimizer trains: all weights, or a LoRA adapter (rank, alpha, targets), and how many."""
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    lora = (
        {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha, "targets": list(cfg.lora_targets)} if cfg.lora_rank else None
    )
    return {"lora": lora, "trainable_parameters": trained, "parameters": sum(p.numel() for p in model.parameters())}


def _check_same_start(state: ResumeState, model_path: Path) -> None:
    """The reference is reloaded from the starting model: it must be the one the run began with."""
    want = state.manifest.get("model", {}).get("weights_sha256")
    have = sha256_of(model_path / "model.safetensors")
    if want and have != want:
        raise ValueError(
            f"cannot resume: the starting model {model_path} changed since the run began "
            f"(weights sha256 {have} != {want} in the manifest); the reference policy would differ"
        )


def _resolve_model(cfg: TrainConfig, console) -> Path:
    if cfg.model:
        from consequence.policy.named import model_folder  # a registered name: converted on first use

        return model_folder(cfg.model, log=lambda line: console.print(escape(line)))
    from consequence.distill.warmstart import WarmstartConfig, ensure_warmstart

    ws = WarmstartConfig(seed=cfg.split_seed, n_demos=cfg.warmstart_demos, sft_epochs=cfg.warmstart_epochs)
    return ensure_warmstart(ws, log=console.print)

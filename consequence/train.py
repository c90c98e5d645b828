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
import functools
import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from rich.markup import escape

from consequence.checks import PreStepCheckError, run_pre_step_checks
from consequence.config import TrainConfig
from consequence.credit.advantages import mixed_group_fraction
from consequence.credit.batch import credit_rewards, credited, training_rows
from consequence.diagnostics import component_means, iteration_extras, warnings_for
from consequence.distill.fixed_data import (
    check_token_ids,
    draw_fixed_batch,
    first_student_iteration,
    load_fixed_data,
    uses_fixed_data,
)
from consequence.envs.registry import env_of
from consequence.envs.sandbox import isolation_report, start_mode
from consequence.evaluate.compare import summarize
from consequence.evaluate.episode_eval import parse_error_fraction
from consequence.evaluate.final import final_report, validate
from consequence.evaluate.splits import record_touch, reuse_warning
from consequence.fileio import append_line, write_text_atomic
from consequence.harness.renderer import Renderer
from consequence.iteration import Learner, collect, credit, logprob_fn, make_learner, update
from consequence.policy.lora import apply_lora, is_adapter_folder
from consequence.policy.sampler import SamplingParams
from consequence.policy.tiny import load_policy, save_policy
from consequence.recipes import run_label
from consequence.records import Trajectory, write_trajectories
from consequence.report.manifest import build_manifest, clear_run_outputs, sha256_of, write_manifest
from consequence.resume import (
    ResumeState,
    interrupt_message,
    latest_state,
    load_learner_state,
    mark_status,
    previous_ending,
    rewind_run_dir,
    save_state,
    stop_message,
)
from consequence.rollout.episodes import Budgets, opening_prompt_len
from consequence.scale.preflight import check_rollout_workers
from consequence.scale.scheduler import RolloutError
from consequence.seeding import seed_of
from consequence.update.data_parallel import check_supported

# A write that fails with one of these stops the run cleanly (RunStopped); others propagate.
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO}


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


def run_ending(e: BaseException | None) -> tuple[str, str | None]:
    """How a run that ended with ``e`` (None: it returned) is recorded in manifest.json:
    ``(status, stop_reason)``, one of

    - ``finished``: the run returned (final checkpoint, evaluation, report written); no reason;
    - ``interrupted``: Ctrl-C / SIGINT (KeyboardInterrupt), or SIGTERM (:class:`Terminated`);
    - ``stopped``: a clean stop the run foresees, resumable once the cause is gone: a failed
      pre-step check, a NaN / ±inf in an update, the rollout workers' error, a failed write
      (disk full, read-only, ...: :data:`WRITE_ERRNOS`);
    - ``refused``: bad input found only after the run started (a ValueError, the library's
      error for a user's input, e.g. a chat template that re-renders earlier turns,
      docs/cases.md, case 08); the reason is its message;
    - ``failed``: anything else (a crash: a bug, or a plug-in that raised); the reason is
      ``"ExceptionType: message"``.
    """
    if e is None:
        return "finished", None
    if isinstance(e, Terminated):
        return "interrupted", "terminated (SIGTERM)"
    if isinstance(e, KeyboardInterrupt):
        return "interrupted", "interrupted (Ctrl-C / SIGINT)"
    if isinstance(e, (PreStepCheckError, FloatingPointError, RolloutError)) or (
        isinstance(e, OSError) and e.errno in WRITE_ERRNOS
    ):
        return "stopped", str(e)
    if isinstance(e, ValueError):
        return "refused", str(e)
    return "failed", f"{type(e).__name__}: {e}"


class Terminated(KeyboardInterrupt):
    """SIGTERM (a job scheduler's stop, ``kill``, a container shutdown) during a run: handled
    like Ctrl-C, so the run ends ``interrupted`` and resumable instead of dying as ``running``."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


class _Ending:
    """The one place where a run's end is recorded: a context manager around the whole run
    that writes ``status`` and ``stop_reason`` (:func:`run_ending`) into manifest.json on
    every exit path (return, Ctrl-C, a foreseen stop, bad input found late, a crash), then
    lets the exception go on. It writes only once this run's manifest exists (``opened``,
    set by :func:`_start` when it first writes it): an error before that leaves the folder,
    and the manifest of an earlier run in it, as they were.
    """

    def __init__(self, run: Path):
        self.run, self.opened = run, False
        self._sigterm: Any = None  # the SIGTERM handler to put back (signal.signal returns any kind)

    def __enter__(self) -> _Ending:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            self._sigterm = signal.signal(signal.SIGTERM, _raise_terminated)
        return self

    def __exit__(self, kind, e, tb) -> Literal[False]:
        if self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)
        if self.opened:
            status, reason = run_ending(e)
            # "finished" must not be lost silently: a failed write there raises (and is a stopped run)
            mark_status(self.run, status, reason, strict=e is None)
        return False  # the exception, if any, goes on


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
    label: str = ""  # what the run is (recipes.run_label)
    history: list[dict[str, Any]] = field(default_factory=list)
    start: int = 0  # first iteration to run (iterations completed by the resume state)
    fixed_data: list[Trajectory] = field(default_factory=list)  # --distill-data, for --distill-lambda < 1
    first_student: int | None = 0  # first iteration that rolls out the student (where the pre-step checks run)
    rollouts: Any = None  # scale.scheduler.AsyncRollouts with --rollout-workers, else None (this process rolls out)


def train(cfg: TrainConfig, console=None, resume: bool = False, reproduces: str | Path | None = None) -> dict[str, Any]:
    """Run one training job end to end; returns the final report as a dict.

    Args:
        resume: continue ``cfg.run_dir`` from its newest resume state
            (``consequence.resume``; written every ``cfg.checkpoint_every`` iterations),
            dropping trajectory files and metric lines of later iterations; without a
            state the run starts again at iteration 0 in the same folder.
        reproduces: the run folder this run reproduces (``consequence reproduce``); recorded
            in the manifest, and that run's evaluations of the test split do not count as
            another policy's in the split-reuse warning (same recipe, same seeds).

    A run without a resume state first deletes the outputs of an earlier run in
    ``cfg.run_dir`` (``consequence.resume.clear_run_outputs``; other files are kept), after
    every check passed.

    Every exit path records how the run ended in ``manifest.json`` (``status`` and
    ``stop_reason``: :func:`run_ending`; docs/resume.md "How a run ends") once the run's
    manifest was written; an error before that leaves the folder as it was.

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
    r = None
    try:
        with _Ending(run_path) as ending:  # records the status on every exit path; below, only the messages
            r = _start(cfg, console, run_path, resume, state, reproduces, ending)
            try:
                _loop(r, console)
            finally:  # workers and a local Ray instance end with the loop, also on errors and Ctrl-C
                _close_rollouts(r)
            return _finish(r, console, t_start)
    except KeyboardInterrupt as e:
        done = len(r.history) if r is not None else 0
        raise RunInterrupted(interrupt_message(run_path, done, cfg.iterations), done) from e
    except PreStepCheckError as e:  # the table was printed; the message says what failed and how to skip
        raise RunStopped(f"stopped before the first optimizer step: {e}") from e
    except (FloatingPointError, RolloutError) as e:  # numerics; the rollout workers cannot go on: resumable
        raise RunStopped(stop_message(e, run_path)) from e
    except OSError as e:
        if e.errno not in WRITE_ERRNOS:
            raise
        raise RunStopped(stop_message(e, run_path)) from e


def _start(
    cfg: TrainConfig,
    console,
    run: Path,
    resume: bool,
    state: ResumeState | None,
    reproduces: str | Path | None = None,
    ending: _Ending | None = None,
) -> _Run:
    """Load model, tasks and learner (from the resume state when there is one), check that the
    settings can work (:func:`preflight`); only then clear an earlier run's outputs and write
    the run's files (``ending.opened`` is set once manifest.json says ``running``)."""
    torch.manual_seed(cfg.seed)
    split = env_of(cfg)
    # fixed data is checked against the splits before a model is resolved (a new --split-seed builds a warm start)
    fixed = load_fixed_data(cfg.distill_data, split.split) if cfg.distill_data else []
    model_path = _resolve_model(cfg, console)
    model, tokenizer = load_policy(model_path)
    renderer = Renderer(tokenizer, split.tools)
    preflight(cfg, tokenizer, renderer, split, model_path)
    teacher = None
    if cfg.teacher is not None:  # loaded before anything is written: a tokenizer mismatch is refused here
        from consequence.distill.teacher_model import load_teacher

        teacher = load_teacher(cfg.teacher, tokenizer, log=lambda line: console.print(escape(line)), student=model)
    check_token_ids(fixed, len(tokenizer), "--distill-data")
    if state is not None:
        _check_same_start(state, model_path)
    reference = copy.deepcopy(model).eval()  # the warm start, kept for the final paired comparison
    if state is not None:
        model = load_policy(state.path / "policy")[0]  # a LoRA run's state holds its adapter
    elif cfg.lora_rank:  # before anything is written: a bad --lora-targets is refused here
        model = apply_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, model_path)
    run.mkdir(parents=True, exist_ok=True)
    if state is None:
        cleared = clear_run_outputs(run)
        if cleared:
            console.print(f"{run} held an earlier run: deleted its {len(cleared)} outputs (other files kept)")
        write_text_atomic(run / "config.yaml", yaml.safe_dump(cfg.model_dump(), sort_keys=False))
    write_text_atomic(run / "split.json", json.dumps(split.problem_ids()))
    learner = make_learner(cfg, model, reference, teacher)
    r = _Run(
        cfg,
        run,
        model_path,
        tokenizer,
        reference,
        learner,
        renderer,
        split,
        Budgets(cfg.max_turns, cfg.max_new_tokens, cfg.max_total_tokens),
        SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p, cfg.max_new_tokens),
        manifest={},
        label=run_label(cfg),
        fixed_data=fixed,
        first_student=first_student_iteration(cfg.distill_lambda, cfg.seed, cfg.iterations),
    )
    if state is None:
        r.manifest = build_manifest(
            cfg,
            model_path,
            split,
            chat_template=tokenizer.chat_template,
            isolation=isolation_report(),
            tool_format=renderer.tool_format,
        )
        r.manifest |= {"run_label": r.label, "cwd": os.getcwd(), "policy_training": policy_training(cfg, model)}
        if reproduces is not None:
            r.manifest["reproduces"] = os.path.abspath(reproduces)
        if r.first_student is None:
            r.manifest["checks"]["not_run"] = (
                f"every iteration drew its batch from --distill-data (--distill-lambda "
                f"{cfg.distill_lambda:g}): no batch of the student's own samples to check"
            )
        policy = [str(run / "checkpoints")]
        r.manifest["splits_touched"] = [
            record_touch(split.label, cfg.split_seed, "train", _train_use(cfg, r.first_student), policy)
        ] + (
            [
                record_touch(
                    split.label,
                    cfg.split_seed,
                    "validation",
                    "greedy success of each checkpoint during training (selects checkpoints)",
                    policy,
                )
            ]
            if cfg.eval_every
            else []
        )
    else:
        load_learner_state(state, learner)
        r.manifest, r.history, r.start = state.manifest, state.history, state.iteration
        r.manifest.setdefault("resumed", []).append(
            {"from_iteration": state.iteration, "state": state.path.name, **previous_ending(run)}
        )  # how the run before ended
        r.manifest["status"] = "running"
    rewind_run_dir(run, r.start, r.history)
    write_manifest(r.manifest, run)
    if ending is not None:
        ending.opened = True
    console.print(
        f"[bold]consequence train[/] ({escape(r.label)}): {cfg.iterations} iterations (numbered 0–"
        f"{cfg.iterations - 1}) × {cfg.tasks_per_iteration} tasks × {cfg.group_size} rollouts, model "
        f"{escape(str(model_path))}, run dir {escape(str(run))}"
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
        console.print(
            f"LoRA r={cfg.lora_rank}, α={cfg.lora_alpha:g} on {','.join(cfg.lora_targets)}: "
            f"{pt['trainable_parameters']:,} of {pt['parameters']:,} parameters trained"
        )
    if cfg.rollout_workers:
        r.rollouts = _start_rollouts(r, console)
        write_manifest(r.manifest, run)
    return r


def _start_rollouts(r: _Run, console):
    """Rollout workers on Ray (docs/async.md), given version ``r.start`` of the weights; a
    resumed run rolls out the batches its kept iterations did not consume or drop first."""
    from consequence.scale.scheduler import AsyncRollouts, batches_done
    from consequence.scale.staleness import pipeline_warning

    cfg = r.cfg
    console.print(
        f"starting {cfg.rollout_workers} rollout worker(s) on Ray"
        + (f" at {escape(cfg.ray_address)}" if cfg.ray_address else " (local instance)")
        + f", max staleness {cfg.max_staleness}"
    )
    if warning := pipeline_warning(cfg.rollout_workers, cfg.max_staleness):
        console.print(f"[yellow]warning:[/] {escape(warning)}")
    rollouts = AsyncRollouts(
        cfg, str(r.model_path), done=batches_done(r.history), log=lambda line: console.print(escape(line))
    )
    rollouts.publish(r.learner.model, r.start)
    r.manifest.setdefault("rollout_workers", []).append(
        {
            "from_iteration": r.start,
            "workers": cfg.rollout_workers,
            "max_staleness": cfg.max_staleness,
            "ray_address": cfg.ray_address,
            "where": [rollouts.where[i] for i in sorted(rollouts.where)],
        }
    )
    return rollouts


def _close_rollouts(r: _Run | None) -> None:
    """Stop the rollout workers; the batches no iteration trained on are counted in the manifest."""
    if r is None or r.rollouts is None:
        return
    closed, r.rollouts = r.rollouts.close(), None
    r.manifest["rollout_workers"][-1] |= closed
    write_manifest(r.manifest, r.dir)


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


def _train_use(cfg: TrainConfig, first_student: int | None) -> str:
    """How the run uses the train split (the ledger's purpose)."""
    if cfg.distill_lambda >= 1:
        return "RL rollouts"
    return (
        "RL rollouts and --distill-data batches" if first_student is not None else "--distill-data batches (no rollout)"
    )


def preflight(cfg: TrainConfig, tokenizer, renderer: Renderer, split, model_path: Path) -> None:
    """Settings that cannot work with this model and these tasks, refused before any rollout
    (whether or not the pre-step checks run).

    Raises:
        ValueError: ``CONSEQUENCE_SANDBOX_START`` unknown; ``--top-k`` or ``--distill-top-k``
            above the vocabulary size; a split the run needs is empty (a
            small task file); the longest prompt of the train tasks plus ``--max-new-tokens``
            does not fit in ``--max-total-tokens`` (every such episode would end truncated
            before the policy acts). Each message names the option and the fix.
    """
    if is_adapter_folder(model_path):
        raise ValueError(
            f"--model {model_path} is a LoRA adapter checkpoint: fold it into its base first "
            f"(consequence merge {model_path} --out MERGED), then train from --model MERGED"
        )
    start_mode()  # a bad CONSEQUENCE_SANDBOX_START is refused before the run folder is made
    check_supported(cfg)  # --update-ranks combinations it cannot run
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
    split.check_splits(
        {
            "train": "training",
            "validation": "--eval-every" if cfg.eval_every and cfg.val_episodes else None,
            "test": "--final-eval-episodes" if cfg.final_eval_episodes and "test" in cfg.final_eval_splits else None,
        }
    )
    if cfg.final_eval_episodes and "test" in cfg.final_eval_splits and len(split.split["test"]) < 2:
        raise ValueError(
            f"--env {split.label}: the test split has {len(split.split['test'])} problem, and the final "
            "paired comparison's CI (a bootstrap over problems) needs at least 2; add problems or set "
            "--final-eval-episodes 0"
        )
    longest = split.longest_prompt(
        functools.partial(opening_prompt_len, renderer, split.system_prompt, examples=split.examples),
        seed=seed_of(cfg.seed, "prompt-check"),
    )
    if longest + cfg.max_new_tokens > cfg.max_total_tokens:
        raise ValueError(
            f"--max-total-tokens {cfg.max_total_tokens} is too small: the longest prompt of the train "
            f"tasks is {longest} tokens and a model call may add --max-new-tokens {cfg.max_new_tokens}, "
            "so such episodes would end truncated before the policy acts; raise --max-total-tokens "
            f"to at least {longest + cfg.max_new_tokens} (or lower --max-new-tokens)"
        )


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


def _loop(r: _Run, console) -> None:
    """Iterations ``r.start`` … ``cfg.iterations − 1``, each followed by its metrics line and,
    every ``checkpoint_every`` iterations and after the last, a resume state."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    cfg = r.cfg
    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[status]}"),
        console=console,
    ) as bar:
        job = bar.add_task(escape(r.label), total=cfg.iterations, completed=r.start, status="")
        for it in range(r.start, cfg.iterations):
            show = lambda text: bar.update(job, status=text)  # noqa: E731  (live phase within the iteration)
            m = _run_iteration(r, it, bar.console, show)
            status = _status_line(m)
            if "val_success" in m:
                status += f"  val {m['val_success']:.2f}"
            bar.update(job, advance=1, status=status)
            if not console.is_terminal:  # logs and pipes get one line per iteration instead
                console.print(f"iteration {it} ({it + 1}/{cfg.iterations} done)  {status}")


def _status_line(m: dict[str, Any]) -> str:
    """What the progress bar shows after an iteration: reward and mixed groups, or the fixed data's divergence."""
    if m.get("fixed_data_batch"):
        return f"fixed-data batch (--distill-data): divergence {m.get('distill_divergence', float('nan')):.3f}"
    reward = "n/a (all env errors)" if m["reward_mean"] is None else f"{m['reward_mean']:.2f}"
    lag = (
        f"  lag {m['lag_max']}" + (f" (dropped {len(m['dropped_batches'])} stale)" if m["dropped_batches"] else "")
        if "lag_max" in m
        else ""
    )
    return f"reward {reward}  mixed {m['mixed_group_fraction']:.2f}{lag}"


def _run_iteration(r: _Run, it: int, console, show=lambda text: None) -> dict[str, Any]:
    """One iteration with its validation, metrics line and resume state; returns its metrics.

    ``show(text)`` displays the phase in progress (rollout and validation episodes done).
    """
    cfg, model = r.cfg, r.learner.model
    n_roll = cfg.tasks_per_iteration * cfg.group_size
    t0 = time.perf_counter()
    try:
        m = iteration(
            it,
            cfg,
            r.learner,
            r.renderer,
            r.split,
            r.budgets,
            r.sampling,
            r.dir,
            first=it == r.first_student,
            console=console,
            fixed_data=r.fixed_data,
            progress=lambda d: show(f"iteration {it}: rollouts {d}/{n_roll} episodes"),
            rollouts=r.rollouts,
            show=show,
        )
    except FloatingPointError as e:
        e.iteration = it  # type: ignore[attr-defined]  # for RunStopped's message: which trajectory file the indices point into
        raise
    if r.rollouts is not None:  # version it + 1: what batches started from now on sample with
        r.rollouts.publish(model, it + 1)
    m["iteration_s"] = time.perf_counter() - t0  # wall time of the iteration, validation excluded
    if cfg.eval_every and ((it + 1) % cfg.eval_every == 0 or it + 1 == cfg.iterations):
        m["val_success"] = validate(
            model,
            r.renderer,
            r.split,
            r.budgets,
            cfg,
            progress=lambda d: show(f"iteration {it}: validation {d}/{cfg.val_episodes} episodes"),
        )["success"]
        save_policy(model, r.tokenizer, r.dir / "checkpoints" / f"iter_{it + 1:04d}")
    if "pre_step_checks" in m:
        r.manifest["checks"]["results"] = m.pop("pre_step_checks")
        write_manifest(r.manifest, r.dir)
    r.history.append(m)
    m["warnings"] = warnings_for(r.history)
    for w in m["warnings"]:
        console.print(f"[yellow]warning (iteration {it}):[/] {w}")
    append_line(r.dir / "metrics.jsonl", json.dumps(m, allow_nan=False))  # strict JSON: a NaN here is a bug
    if (it + 1) % cfg.checkpoint_every == 0 or it + 1 == cfg.iterations:
        save_state(r.dir, it + 1, r.learner, r.tokenizer, r.history, r.manifest, cfg.model_dump())
    return m


def _finish(r: _Run, console, t_start: float) -> dict[str, Any]:
    """Final policy checkpoint, warm start vs RL comparison, report, plots; the manifest is closed."""
    run = r.dir
    save_policy(r.learner.model, r.tokenizer, run / "checkpoints" / "final")
    policies = [str(r.model_path), str(run / "checkpoints" / "final")]
    # a reproduction is the same recipe with the same seeds: the original's final checkpoint is not "another policy"
    same = [str(Path(r.manifest["reproduces"]) / "checkpoints" / "final")] if r.manifest.get("reproduces") else []
    tested = r.cfg.final_eval_episodes and "test" in r.cfg.final_eval_splits
    warning = reuse_warning(r.split.label, r.cfg.split_seed, policies + same) if tested else None
    skipped = "final evaluation skipped (--final-eval-episodes 0)" if not r.cfg.final_eval_episodes else None
    if skipped:
        console.print(skipped)
    report = final_report(r.cfg, r.reference, r.learner.model, r.renderer, r.split, r.budgets, console, run)
    touches = [
        record_touch(r.split.label, r.cfg.split_seed, s, "final evaluation of consequence train", policies)
        for s in r.cfg.final_eval_splits
        if r.cfg.final_eval_episodes
    ]
    r.manifest["splits_touched"] = r.manifest.get("splits_touched", []) + touches
    report["warnings"] = ([warning] if warning else []) + report.pop("answer_warnings", [])
    report["splits_touched"] = r.manifest["splits_touched"]
    report["train_seconds"] = time.perf_counter() - t_start
    report["sandbox_isolation"] = isolation_report()
    report["run_label"] = r.label
    if skipped:
        report["final_evaluation"] = skipped
    write_text_atomic(run / "report.json", json.dumps(report, indent=2))
    # status "finished" is written by _Ending once everything below was written too
    r.manifest.update(evaluation_files=report.pop("evaluation_files", []), report="report.json")
    write_manifest(r.manifest, run)
    from consequence.report.plots import plot_metrics, write_markdown_report

    plot_metrics(run / "metrics.jsonl", run / "curves.png")
    write_markdown_report(report, run / "report.md")
    if skipped:  # say so at the top of report.md, not only as an empty table
        title, _, rest = (run / "report.md").read_text().partition("\n")
        write_text_atomic(
            run / "report.md",
            f"{title}\n\n**{skipped[0].upper() + skipped[1:]}**: the warm start "
            f"and the RL checkpoint were not compared.\n{rest}",
        )
    console.print((run / "report.md").read_text())
    return report


def iteration(
    it,
    cfg,
    learner: Learner,
    renderer,
    split,
    budgets,
    sampling,
    run,
    first: bool = False,
    console=None,
    progress=None,
    fixed_data=(),
    rollouts=None,
    show=None,
) -> dict[str, Any]:
    """One collect → score → credit → update step (``consequence.iteration``); returns its metrics.

    With ``--distill-lambda`` < 1 an iteration may draw its batch from ``fixed_data`` instead
    of rolling out (``distill.fixed_data``); ``first`` is the first iteration that rolls out
    (the pre-step checks run on the student's own samples). With ``rollouts``
    (``scale.scheduler.AsyncRollouts``) the batch comes from the rollout workers' queue, and
    ``show(text)`` tells what the trainer waits for.
    """
    t0 = time.perf_counter()
    from_data = uses_fixed_data(cfg.distill_lambda, cfg.seed, it)
    if from_data:
        trajs = draw_fixed_batch(fixed_data, cfg.tasks_per_iteration * cfg.group_size, cfg.seed, it)
        ds = {"gen_tokens_total": 0}  # the student generated nothing
    elif rollouts is not None:
        trajs, ds, queue = rollouts.next_batch(it, show or (lambda text: None))
    else:
        trajs, ds = collect(it, cfg, learner.model, renderer, split, budgets, sampling, progress)
    t_rollout = time.perf_counter() - t0
    pad_id = renderer.tokenizer.pad_token_id
    batch = credit(trajs, cfg, learner, pad_id)
    write_trajectories(run / "trajectories" / f"iter_{it:04d}.parquet", trajs)
    if first:
        _refuse_an_untrainable_first_batch(trajs, cfg, it)
    if first and not from_data and not cfg.skip_checks:
        expected: set[int] | None = {
            i for i, t in enumerate(trajs) if credited(t) and not (cfg.overlong_filter and t.outcome == "truncated")
        }
        rows = batch.rows
        if cfg.advantage == "rejection":  # the bookkeeping is checked on every row, accepted or rejected
            rows, expected = training_rows(trajs)[0], None
        checks = run_pre_step_checks(
            model=learner.model,
            trajs=trajs,
            rows=rows,
            pad_id=pad_id,
            stop_ids=renderer.stop_ids,
            logprob_fn=logprob_fn(cfg),
            cfg=cfg,
            ucfg=learner.update_cfg,
            expected=expected,
            console=console,
        )
    t1 = time.perf_counter()
    upd = update(batch, cfg, learner, pad_id, seed=seed_of(cfg.seed, it, "update"), divergence_only=from_data)
    t_update = time.perf_counter() - t1
    valid = [t for t in trajs if t.reward is not None]
    rewards = [t.reward for t in valid if t.reward is not None]  # (the same list, typed for mypy)
    n_gen = sum(t.n_generated_tokens for t in trajs)
    metrics = {
        "iteration": it,
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,  # none scored: not a 0
        "reward_components_mean": component_means(valid),
        "success": summarize(trajs)["success"],
        "mixed_group_fraction": mixed_group_fraction(credit_rewards(trajs), [t.group_id for t in trajs]),
        "gen_tokens_mean": n_gen / max(1, len(trajs)),
        "tool_calls_mean": sum(t.n_tool_calls for t in trajs) / max(1, len(trajs)),
        "parse_error_fraction": parse_error_fraction(trajs),
        "truncated_fraction": sum(t.outcome == "truncated" for t in trajs) / max(1, len(trajs)),
        "env_errors": sum(t.outcome == "env_error" for t in trajs),
        "env_retries": sum(t.env_retries for t in trajs),  # sandbox re-runs, whatever the outcome
        **split.iteration_metrics(trajs),  # the environment's own (repair: diagnose_first)
        "rollout_tokens_per_s": n_gen / max(t_rollout, 1e-9),
        "rollout_s": t_rollout,
        "update_s": t_update,
        **upd,
    }
    if first and not from_data and not cfg.skip_checks:
        metrics["pre_step_checks"] = [vars(c) for c in checks]
    metrics["gen_tokens_total"] = ds["gen_tokens_total"]
    if rollouts is not None:  # the workers' own speed; rollout_s is the trainer's wait for the batch
        metrics |= queue | {"rollout_tokens_per_s": n_gen / max(queue["worker_rollout_s"], 1e-9)}
    metrics |= {k: v for k, v in ds.items() if k.startswith("agent_")}  # --agent: prefix breaks, calls, batches
    metrics |= batch.metrics  # on-policy distillation: teacher_reverse_kl, teacher_forward_tokens, teacher_s
    metrics |= iteration_extras(trajs)
    if cfg.dynamic_sampling:
        metrics |= {k: v for k, v in ds.items() if k.startswith("groups_")}
    if cfg.distill_lambda < 1:
        metrics["fixed_data_batch"] = float(from_data)
    if from_data:  # the rows are the data's, not the student's: its success is not the policy's
        metrics |= {"reward_mean": None, "success": None, "mixed_group_fraction": None, "rollout_tokens_per_s": None}
    return metrics


# ---- plumbing -----------------------------------------------------------------------
def _resolve_model(cfg: TrainConfig, console) -> Path:
    if cfg.model:
        from consequence.policy.named import model_folder  # a registered name: converted on first use

        return model_folder(cfg.model, log=lambda line: console.print(escape(line)))
    from consequence.warmstart import WarmstartConfig, ensure_warmstart

    ws = WarmstartConfig(seed=cfg.split_seed, n_demos=cfg.warmstart_demos, sft_epochs=cfg.warmstart_epochs)
    return ensure_warmstart(ws, log=console.print)

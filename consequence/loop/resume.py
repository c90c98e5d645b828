"""Resumable runs: atomic checkpoints of the training state, and ``train --resume``.

A resume state is the folder ``RUN/checkpoints/state-NNNN`` (NNNN = iterations completed):

    policy/               the policy's weights (safetensors), config and tokenizer (save_policy)
    optimizer.pt          AdamW state of the policy (torch.save; read back with weights_only=True)
    critic.safetensors    value model (trunk + head), only with ``advantage: gae``
    critic_optimizer.pt   its AdamW state, only with a critic
    scheduler.pt          the policy's learning-rate schedule (LambdaLR state: optimizer steps taken),
                          only with --lr-schedule linear|cosine or --warmup-steps
    reference.safetensors the KL reference, only once --ref-refresh-every replaced it (metadata: its version)
    rng.json              python ``random``, numpy and torch (CPU, and CUDA when present) states
    state.json            iterations completed, the metrics history, the manifest, the config

Nothing else is needed: every random choice of iteration ``it`` (tasks, rollout sampling,
mini-batch order) is derived from ``seed_of(cfg.seed, it, ...)`` with a local generator,
so the data cursor *is* the iteration number; the RNG states are saved anyway, so that
code drawing from a global generator would resume correctly too. The frozen reference
(KL term, final comparison) is the starting model: it is loaded again from the path in
the manifest, whose weights hash must still match.

Atomicity: the state is written into a temporary sibling folder, every file and the
folder are fsynced, the folder is renamed to ``state-NNNN`` and the parent fsynced; only
then are older states removed. A crash at any moment leaves either the old state or the
new one complete (temporary folders are removed on resume). Trajectory files and metric
lines of iterations after the state are removed on resume, so an iteration is never
counted twice.
"""

from __future__ import annotations

import base64
import errno
import json
import os
import random
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from consequence.fileio import as_write_error, write_text_atomic

STATE_FORMAT = 1
# Options a resumed run may change: where and how patiently rollouts run, whether the
# pre-step checks run (a run they stopped is resumed with --skip-checks, as their message
# says; manifest.json records it), and on which device the models compute (the weights,
# optimizer state and RNG are read onto it; the numbers differ from the device's by float
# rounding only), and which trackers get a copy of the metrics (--report-to: a tracker added
# at resume starts its run there) -- not what is trained (--dtype stays).
RESUME_MAY_CHANGE = frozenset(
    {"rollout_timeout", "ray_address", "rollout_workers", "skip_checks", "device", "teacher_device", "report_to"}
)
STATE_RE = re.compile(r"^state-(\d{4,})$")


@dataclass
class ResumeState:
    """A complete resume state read from disk (see module doc)."""

    path: Path
    iteration: int  # iterations completed: the next one to run
    history: list[dict[str, Any]]
    manifest: dict[str, Any]
    config: dict[str, Any]


# ---- writing -------------------------------------------------------------------------
def save_state(
    run: Path, iteration: int, learner, tokenizer, history: list[dict], manifest: dict, config: dict
) -> Path:
    """Write the resume state after ``iteration`` completed iterations; returns its folder.

    Raises:
        OSError: writing failed (e.g. ENOSPC, disk full); the temporary folder is removed
            and the previous state is left as it was.
    """
    from consequence.policy.tiny import save_policy

    root = Path(run) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"state-{iteration:04d}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{final.name}.tmp-"))
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it owner-only; a checkpoint is shared
        save_policy(learner.model, tokenizer, tmp / "policy")
        _write_learner(tmp, learner)
        _write_text(tmp / "rng.json", json.dumps(capture_rng()))
        # state.json last: its presence marks a state whose other files were all written
        _write_text(
            tmp / "state.json",
            json.dumps(
                {
                    "format": STATE_FORMAT,
                    "iteration": iteration,
                    "history": history,
                    "manifest": manifest,
                    "config": config,
                }
            ),
        )
        _fsync_tree(tmp)
        if final.exists():  # only after a resume that re-ran past a state it had not seen
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        err = as_write_error(e, tmp)
        if err is not None and err is not e:
            raise err from e
        raise
    _remove_older_states(root, keep=final)
    return final


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_learner(folder: Path, learner) -> None:
    from safetensors.torch import save_file

    dp = getattr(learner, "data_parallel", None)  # --update-strategy fsdp: the ranks hold the state's shards
    optimizer_state = learner.optimizer.state_dict() if dp is None else dp.full_optimizer_state(learner.optimizer)
    _torch_save(optimizer_state, folder / "optimizer.pt")
    if learner.scheduler is not None:  # its step count; the lr itself is in the optimizer's groups
        _torch_save(learner.scheduler.state_dict(), folder / "scheduler.pt")
    if learner.critic is not None:
        save_file({k: v.contiguous() for k, v in learner.critic.state_dict().items()}, folder / "critic.safetensors")
        _torch_save(learner.critic_optimizer.state_dict(), folder / "critic_optimizer.pt")
    if learner.reference_version > 0:  # a refreshed π_ref (--ref-refresh-every) is no longer the starting policy
        from safetensors.torch import save_model  # tied embeddings: save_model stores a shared tensor once

        save_model(
            learner.reference, str(folder / "reference.safetensors"), {"version": str(learner.reference_version)}
        )


def _torch_save(obj: Any, path: Path) -> None:
    # Through a Python file object, so that a failed write keeps its OSError (as __context__).
    try:
        with open(path, "wb") as f:
            torch.save(obj, f)
    except Exception as e:
        err = as_write_error(e, path)
        if err is not None and err is not e:
            raise err from e  # named after this file rather than the state folder
        raise


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every folder (so the names are durable too)."""
    dirs = [root]
    for p in sorted(root.rglob("*")):
        if p.is_dir():
            dirs.append(p)
        else:
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    for d in dirs:
        _fsync_dir(d)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_older_states(root: Path, keep: Path) -> None:
    for p in root.iterdir():
        if p != keep and STATE_RE.match(p.name):
            shutil.rmtree(p, ignore_errors=True)


# ---- RNG -----------------------------------------------------------------------------
def capture_rng() -> dict[str, Any]:
    """The global generators' states as JSON-able data (torch states base64-encoded)."""
    state = np.random.get_state()  # legacy=True (the default): a tuple, not the dict form
    assert isinstance(state, tuple)
    kind, keys, pos, has_gauss, gauss = state
    out = {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def restore_rng(state: dict[str, Any]) -> None:
    """Set the global generators to a state from :func:`capture_rng`."""
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


# ---- reading -------------------------------------------------------------------------
def latest_state(run: Path) -> ResumeState | None:
    """The newest complete resume state of ``run``, or None when it has none.

    Raises:
        ValueError: the newest state is unreadable or of another format (the message
            names the folder; delete it to fall back to an older one, if any).
    """
    root = Path(run) / "checkpoints"
    found = sorted(
        (int(m.group(1)), p)
        for p in (root.iterdir() if root.is_dir() else [])
        if (m := STATE_RE.match(p.name)) and (p / "state.json").is_file()
    )
    if not found:
        return None
    path = found[-1][1]
    try:
        data = json.loads((path / "state.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"resume state {path} is unreadable ({e}); delete that folder to use an older one") from None
    if data.get("format") != STATE_FORMAT:
        raise ValueError(f"resume state {path} has format {data.get('format')!r}, this version reads {STATE_FORMAT}")
    return ResumeState(path, int(data["iteration"]), data["history"], data["manifest"], data["config"])


def _number(pattern: str, name: str, default: int) -> int:
    m = re.fullmatch(pattern.strip("^$"), name)
    return int(m.group(1)) if m else default


def load_learner_state(state: ResumeState, learner) -> None:
    """Load optimizer (learning-rate schedule, critic) state into ``learner``, whose model holds
    the state's weights.

    Raises:
        ValueError: the run has a learning-rate schedule and the state no scheduler.pt.
    """
    from safetensors.torch import load_file

    # read onto the CPU (a state saved on a GPU opens on any machine); load_state_dict then
    # moves each tensor to its parameter's device, which may differ from the one that saved it
    learner.optimizer.load_state_dict(torch.load(state.path / "optimizer.pt", weights_only=True, map_location="cpu"))
    if learner.scheduler is not None:  # after the optimizer: its groups hold the lr of the next step
        if not (state.path / "scheduler.pt").is_file():
            raise ValueError(
                f"resume state {state.path} has no scheduler.pt, but the run's config has a learning-rate "
                "schedule (--lr-schedule / --warmup-steps), so the state is incomplete; start the run again "
                "without --resume"
            )
        learner.scheduler.load_state_dict(torch.load(state.path / "scheduler.pt", weights_only=True))
    if learner.critic is not None:
        learner.critic.load_state_dict(load_file(state.path / "critic.safetensors"))
        learner.critic_optimizer.load_state_dict(
            torch.load(state.path / "critic_optimizer.pt", weights_only=True, map_location="cpu")
        )
    _load_reference(state.path / "reference.safetensors", learner)
    restore_rng(json.loads((state.path / "rng.json").read_text()))


def _load_reference(path: Path, learner) -> None:
    """A refreshed π_ref, into a copy of the learner's (the starting policy's object is shared
    with the final comparison and keeps the start's weights)."""
    from safetensors import safe_open
    from safetensors.torch import load_model

    from consequence.policy.lora import frozen_copy

    if not path.is_file():
        return
    with safe_open(str(path), "pt") as f:
        version = int((f.metadata() or {})["version"])
    ref = frozen_copy(learner.reference)
    load_model(ref, str(path), device=str(next(ref.parameters()).device))
    learner.reference, learner.reference_version = ref, version


def rewind_run_dir(run: Path, done: int, history: list[dict[str, Any]]) -> None:
    """Make ``run`` look as it did right after ``done`` iterations and their state.

    Removes trajectory files of iterations >= ``done``, periodic policy checkpoints saved
    after them, temporary files and folders of interrupted writes, and rewrites
    ``metrics.jsonl`` from ``history`` (one line per completed iteration).
    """
    run = Path(run)
    for p in (run / "trajectories").glob("*"):
        if p.name.startswith(".") or _number(r"iter_(\d+)\.parquet", p.name, default=-1) >= done:
            p.unlink()
    ckpt = run / "checkpoints"
    for p in ckpt.glob("*") if ckpt.is_dir() else []:
        after = _number(r"iter_(\d+)", p.name, default=-1) > done  # iter_N is saved after iteration N-1
        other_state = _number(STATE_RE.pattern, p.name, default=done) != done  # a fresh start (done 0) drops
        if p.name.startswith(".") or after or other_state:  # an older run's states too
            shutil.rmtree(p, ignore_errors=True)
    for p in run.glob(".*.tmp*"):
        p.unlink(missing_ok=True)
    text = "".join(json.dumps(m) + "\n" for m in history)
    tmp = run / ".metrics.jsonl.tmp"
    _write_text(tmp, text)
    os.replace(tmp, run / "metrics.jsonl")


# ---- how a stopped run continues -----------------------------------------------------------
def stop_message(e: BaseException, run: Path) -> str:
    """What stopped the run (a NaN / ±inf in an update, or a failed write), which resume state
    is intact, and how to continue."""
    try:
        state = latest_state(run)
    except ValueError:
        state = None
    where = (
        f"the resume state {state.path} (after iteration {state.iteration - 1}) is intact"
        if state
        else "no resume state was written yet"
    )
    if getattr(e, "rollouts", False):  # the rollout workers' error (scale.scheduler.RolloutError): said as is
        what = f"stopped: {e}; {where}. Fix the cause, then continue"
    elif isinstance(e, FloatingPointError):
        it = getattr(e, "iteration", None)
        at = "" if it is None else f" in iteration {it} (trajectory numbers index trajectories/iter_{it:04d}.parquet)"
        what = (
            f"stopped{at}: {e}. Nothing of this step was applied; {where}. Inspect those trajectories "
            f"(`consequence view {run}`). A resume with the same config repeats the same computation; to go "
            "on with other settings (e.g. a lower --learning-rate) start a new run from the state's policy "
            "folder (--model STATE/policy), or, once the cause is fixed in code, continue"
        )
    else:
        fixes: dict[int | None, str] = {
            errno.EFBIG: "Raise the file-size limit (ulimit -f)",
            errno.EROFS: "Make the run folder writable",
        }
        fix = fixes.get(
            getattr(e, "errno", None),
            "Free disk space (a resume state takes about 3 x the model's weights, 6 x with a value head)",
        )
        what = (
            f"stopped: cannot write {getattr(e, 'filename', None) or run} ({getattr(e, 'strerror', None) or e}); "
            f"{where} and no file was left half-written. {fix}, then continue"
        )
    return f"{what} with `consequence train --resume {run}`."


def interrupt_message(run: Path, done: int, iterations: int) -> str:
    """The message for Ctrl-C after ``done`` completed iterations (numbered from 0): the last one
    completed, what a resume repeats when the newest resume state is older, and the command."""
    try:
        state = latest_state(run)
    except ValueError:
        state = None
    if done >= iterations:
        what = f"interrupted during the final evaluation, after iteration {done - 1} (the last)"
    else:
        what = f"interrupted after iteration {done - 1}" if done else "interrupted during iteration 0 (none completed)"
    kept = state.iteration if state else 0
    if kept < done:
        what += (
            f" (the newest resume state covers iterations 0–{kept - 1}, so a resume repeats from iteration {kept})"
            if kept
            else " (no resume state was written yet, so a resume starts again at iteration 0)"
        )
    return f"{what}; continue with `consequence train --resume {run}`"


# How a run ended (manifest.json "status"; consequence.loop.recorder.run_ending says which exit gives which).
# Every status but "finished" may be resumed: "running" is a run killed without a word (SIGKILL,
# power loss), the others name their cause in "stop_reason"; a resume repeats a refusal or a
# crash unless its cause, outside the saved config, was fixed (a model folder's chat template, a
# plug-in's code).
STATUSES = ("running", "finished", "interrupted", "stopped", "refused", "failed")


def mark_status(run: Path, status: str, reason: str | None = None, strict: bool = False) -> None:
    """Set ``status`` and ``stop_reason`` (removed when ``reason`` is None) in manifest.json,
    atomically (``fileio.write_text_atomic``).

    Args:
        status: one of :data:`STATUSES`.
        strict: raise when the manifest cannot be read or written; otherwise (the default,
            for a run that is already failing: it may be the disk that failed) leave it as it is.

    Raises:
        OSError, ValueError: only with ``strict``.
    """
    if status not in STATUSES:
        raise ValueError(f"mark_status: unknown status {status!r}; one of {', '.join(STATUSES)}")
    path = Path(run) / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
        manifest["status"] = status
        if reason is None:
            manifest.pop("stop_reason", None)
        else:
            manifest["stop_reason"] = reason
        write_text_atomic(path, json.dumps(manifest, indent=1, default=str))
    except (OSError, ValueError):
        if strict:
            raise


def previous_ending(run: Path) -> dict[str, Any]:
    """``{"after": status, "stop_reason": ...}`` of the manifest.json a resumed run replaces
    (how the run ended before the resume), or ``{}`` when there is none readable."""
    try:
        manifest = json.loads((Path(run) / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(manifest, dict) or "status" not in manifest:
        return {}
    reason = {"stop_reason": manifest["stop_reason"]} if "stop_reason" in manifest else {}
    return {"after": manifest["status"], **reason}


# ---- the CLI's side ------------------------------------------------------------------
def resume_config(run: Path, given: dict[str, Any], config_file: Path | None):
    """The TrainConfig of ``train --resume RUN``: the run's saved config.

    Options given with ``--resume`` must equal the saved values (they are accepted then,
    and ignored); ``--run-dir`` may name the same folder by another path.

    Raises:
        ValueError: RUN is not a run folder, the run already finished, ``--config`` was
            given, or an option conflicts with the saved config (each is listed).
    """
    import yaml

    from consequence.config import TrainConfig, saved_settings

    run = Path(run)
    saved_path = run / "config.yaml"
    if not saved_path.is_file():
        raise ValueError(f"--resume {run}: no config.yaml there (give the run folder of a `consequence train` run)")
    if config_file is not None:
        raise ValueError(f"--resume takes the config saved in {saved_path}; drop --config {config_file}")
    saved = saved_settings(yaml.safe_load(saved_path.read_text(encoding="utf-8")))
    _check_not_finished(run)
    if "run_dir" in given and Path(given.pop("run_dir")).resolve() != run.resolve():
        raise ValueError(f"--run-dir conflicts with --resume {run}: a resumed run stays in its own folder")
    # where the rollouts run, not what is trained: a resumed run may move them (a new cluster, more patience)
    free = {k: given.pop(k) for k in list(given) if k in RESUME_MAY_CHANGE}
    asked = TrainConfig.checked(**{**saved, **given}).model_dump()  # validates and normalises the types
    had = TrainConfig.checked(**saved).model_dump()  # the same normal form (absolute paths, lists)
    clashes = [f"--{k.replace('_', '-')} {asked[k]!r} (the run has {had[k]!r})" for k in given if asked[k] != had[k]]
    if clashes:
        raise ValueError(
            f"--resume {run} continues the run with its saved config ({saved_path}); these options "
            "differ from it: " + "; ".join(clashes) + ". Drop them, or start a new run in another "
            "--run-dir"
        )
    cfg = TrainConfig.checked(**{**saved, **free, "run_dir": str(run)})
    if bool(cfg.rollout_workers) != bool(had["rollout_workers"]):
        raise ValueError(
            f"--resume {run}: --rollout-workers {cfg.rollout_workers} would switch the run between the "
            f"synchronous loop and rollout workers (it has {had['rollout_workers']}); give a number of "
            "workers of the same kind, or start a new run in another --run-dir"
        )
    return cfg


def _check_not_finished(run: Path) -> None:
    try:
        status = json.loads((run / "manifest.json").read_text()).get("status")
    except (OSError, json.JSONDecodeError):
        return  # killed before the manifest was written: resume starts from iteration 0
    if status == "finished":
        raise ValueError(
            f"--resume {run}: that run already finished (manifest.json status 'finished'); nothing to resume"
        )

"""Cold start of any model: verified demonstrations, then SFT.

The seeds' recipe for a model that cannot yet act in an environment (SmolLM2-135M-Instruct
never writes a tool call on the default task): (1) demonstrations, from the environment's
demonstrator (``Environment.demonstration``, played by the scripted teacher of
``distill/teacher.py``) on train-split tasks, from a file of demonstrations (our
trajectories Parquet or OpenAI-style messages JSONL, ``distill/demonstrations.py``), or from
a teacher behind an OpenAI-compatible URL playing train-split episodes
(``distill/teacher_url.py``: a vLLM server with a larger model, ``consequence serve``); each is
played through a fresh episode of its task, in the *student's* tokens (its chat template;
the Hermes tool format for a template that drops tools), and kept only when the
environment's reward verifies it, so the targets are exactly the tokens the student must
sample (loss on assistant turns only, observations are context); (2) supervised
fine-tuning (``distill/sft.py``), of all weights or of a LoRA adapter that is merged into
the weights at the end, so RL starts from a plain model folder. ``consequence sft`` runs it.

Output folder: the model (``save_pretrained``, atomically) and ``sft.json``: settings, the
demonstrations' source and counts (verified, rejected by reason, acceptance rate; a URL
teacher's cost: calls, tokens, attempts per accepted demonstration, seconds), rows,
tokens, the loss of every step, seconds per phase.

``consequence train --cold-start-demos N`` runs it before RL through :func:`cached_cold_start`:
the result is kept under ``$CONSEQUENCE_CACHE/cold-starts/KEY`` (KEY: the student's files and
every setting), built once under a file lock, so the training seeds of an experiment, started
at the same time, share one cold start.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from consequence.distill.demonstrations import collect_demonstrations
from consequence.distill.rejection import accepted_rows
from consequence.distill.sft import SFTConfig, sft_steps, train_sft
from consequence.distill.teacher_url import TeacherEndpoint
from consequence.envs.registry import load_environment
from consequence.evaluate.progress import SILENT, Phases
from consequence.fileio import cache_root
from consequence.harness.renderer import Renderer
from consequence.policy.lora import DEFAULT_TARGETS, apply_lora
from consequence.policy.tiny import load_policy, save_policy

__all__ = ["ColdStartConfig", "cached_cold_start", "cold_start", "cold_start_key", "model_fingerprint"]

COLD_START_VERSION = 1  # part of the cache key: a change of what a cold start is builds new ones


@dataclass(frozen=True)
class ColdStartConfig:
    """Settings of :func:`cold_start` (all recorded in ``sft.json``).

    Attributes:
        env: the environment (with a demonstrator, unless ``demos_file`` or ``teacher`` is given).
        env_options: its options.
        demos: demonstrator (or ``teacher``) episodes to run (train split); the verified
            ones are kept. Not read with ``demos_file``.
        seed: split seed of the environment (unless ``split_seed`` is given), and the
            demonstrator's (or teacher's) draw seed, the LoRA initialisation's and SFT's seeds.
        split_seed: the environment's split seed when it is not ``seed`` (``consequence train``
            keeps its ``--split-seed`` here and its ``--cold-start-seed`` in ``seed``); None:
            ``seed``.
        demos_file: a file of demonstrations instead of the demonstrator (our trajectories
            ``.parquet`` or OpenAI-style messages ``.jsonl``; ``distill/demonstrations.py``);
            each is replayed on its task and kept only when verified.
        teacher: a teacher behind an OpenAI-compatible URL instead of the demonstrator
            (``distill/teacher_url.py``); not with ``demos_file``.
        lora_rank: 0 = full fine-tuning; r ≥ 1 trains a LoRA adapter, merged at the end.
        lora_alpha, lora_targets: the adapter's α and modules.
        sft: :class:`~consequence.distill.sft.SFTConfig`.
        tool_format: the renderer's ``tool_format`` of the student (``consequence train
            --tool-format``): the demonstrations are written in the format RL then samples in.
    """

    env: str = "repair"
    env_options: dict[str, Any] = field(default_factory=dict)
    demos: int = 300
    seed: int = 0
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_targets: tuple[str, ...] = DEFAULT_TARGETS
    sft: SFTConfig = SFTConfig(learning_rate=2e-4, epochs=2.0, rows_per_step=16, micro_batch_size=4)
    demos_file: str | None = None
    teacher: TeacherEndpoint | None = None
    split_seed: int | None = None
    tool_format: str = "auto"


def cold_start(
    model_path: Path,
    out: Path,
    cfg: ColdStartConfig = ColdStartConfig(),
    log: Callable[[str], None] = print,
    phases: Phases = SILENT,
    source: dict[str, Any] | None = None,
    env: Any = None,
    device: Any = "cpu",
) -> dict[str, Any]:
    """Verified demonstrations in the student's tokens → SFT → ``out`` (a plain model folder).

    Args:
        model_path: the student (a local Hugging Face folder).
        out: the folder to write (replaced atomically).
        cfg: :class:`ColdStartConfig`.
        log: one line per phase.
        phases: progress of the SFT steps (steps done / total, steps/s).
        source: what to record of the model's origin (e.g. a registered model's file hash).
        env: the environment to play, already made (e.g. a training run's, its train split cut
            to ``--train-problems``); default: ``cfg.env`` with ``cfg.env_options`` at the
            split seed.
        device: where the SFT computes (a ``torch.device`` or its name, already checked:
            ``policy.device.resolve_device``); not part of what is built (float rounding only).

    Returns:
        the ``sft.json`` record.

    Raises:
        ValueError: neither ``demos_file`` nor ``teacher`` and the environment has no
            demonstrator (names the fix), a bad ``demos_file``, a ``teacher`` that cannot be
            reached at the start, no demonstration verified, or as
            :func:`consequence.distill.sft.train_sft`.
    """
    t0 = time.perf_counter()
    split_seed = cfg.seed if cfg.split_seed is None else cfg.split_seed
    env = env if env is not None else load_environment(cfg.env, split_seed, dict(cfg.env_options))
    model, tok = load_policy(model_path)
    renderer = Renderer(tok, env.tools, tool_format=cfg.tool_format)  # the student's format (Renderer: auto)
    demos = collect_demonstrations(
        env,
        renderer,
        demos_file=cfg.demos_file,
        episodes=None if cfg.demos_file else cfg.demos,
        seed=split_seed,
        draw_seed=None if cfg.demos_file or cfg.split_seed is None else cfg.seed,
        log=log,
        teacher=cfg.teacher,
    )
    rows = accepted_rows(demos.kept)  # the episodes were played in the student's tokens
    t_teacher = time.perf_counter() - t0
    n_tokens, n_targets = sum(len(r.input_ids) for r in rows), sum(sum(r.loss_mask[1:]) for r in rows)
    log(
        f"SFT rows: {len(rows)} ({n_tokens} tokens, {n_targets} targets: the assistant turns), "
        f"tool format {renderer.tool_format}"
    )
    torch.manual_seed(cfg.seed)
    model.to(device)
    if cfg.lora_rank:
        model = apply_lora(model, cfg.lora_rank, cfg.lora_alpha, list(cfg.lora_targets), model_path)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    t1 = time.perf_counter()
    with phases.phase("SFT steps", sft_steps(cfg.sft, len(rows)), "steps") as tick:
        losses = train_sft(model, rows, tok.pad_token_id, cfg.sft, log, progress=lambda step, _n, _loss: tick(step))
    t_sft = time.perf_counter() - t1
    if cfg.lora_rank:
        model = model.merge_and_unload()  # W0 + (alpha / r) B A: RL starts from a plain folder
    out = Path(out).resolve()
    model.config.name_or_path = str(out)
    record = {
        "student": str(Path(model_path).resolve()),
        "source": source,
        "environment": env.label,
        "settings": _settings(cfg),
        "tool_format": renderer.tool_format,
        "tool_call_format": renderer.call_format,
        "teacher": demos.record(),
        "rows": len(rows),
        "tokens": n_tokens,
        "targets": n_targets,
        "trainable_parameters": trainable,
        "device": str(device),
        "losses": losses,
        "seconds": {
            "teacher": round(t_teacher, 2),
            "sft": round(t_sft, 2),
            "total": round(time.perf_counter() - t0, 2),
        },
    }
    save_policy(model, tok, out, {"sft.json": json.dumps(record, indent=1)})
    log(
        f"cold start saved to {out} in {record['seconds']['total']:.0f} s (SFT loss {losses[0]:.3f} → {losses[-1]:.3f})"
    )
    return record


def _settings(cfg: ColdStartConfig) -> dict[str, Any]:
    return {
        "env": cfg.env,
        "env_options": cfg.env_options,
        "demos": None if cfg.demos_file else cfg.demos,
        "demos_file": None if cfg.demos_file is None else str(Path(cfg.demos_file).resolve()),
        "teacher_url": None if cfg.teacher is None else cfg.teacher.as_dict(),
        "seed": cfg.seed,
        **({} if cfg.split_seed is None else {"split_seed": cfg.split_seed}),
        "lora_rank": cfg.lora_rank,
        "lora_alpha": cfg.lora_alpha,
        "lora_targets": list(cfg.lora_targets),
        "sft": cfg.sft.as_dict(),
        # only when asked for: the default keeps the cache keys of cold starts built before the option
        **({} if cfg.tool_format == "auto" else {"tool_format": cfg.tool_format}),
    }


def model_fingerprint(path: Path) -> str:
    """What a model folder is, for a cache key: sha256 over the names and sha256s of its
    top-level files (weights, config, tokenizer, chat template, build records), so a folder
    trained again in place is another model, and a copy elsewhere the same one.

    Raises:
        ValueError: ``path`` is not a folder.
    """
    from consequence.policy.named import file_sha256  # remembered per process for the same size and mtime

    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"model folder {p}: not a folder")
    h = hashlib.sha256()
    for f in sorted(x for x in p.iterdir() if x.is_file() and not x.name.startswith(".")):
        h.update(f"{f.name}\0{file_sha256(f)}\n".encode())
    return h.hexdigest()


def cold_start_key(model_path: Path, cfg: ColdStartConfig, extra: dict[str, Any] | None = None) -> str:
    """The cache key of a cold start: the student's files (:func:`model_fingerprint`), every
    setting of ``cfg`` (environment, options, seeds, demonstrations, LoRA, SFT) and ``extra``
    (what else shapes the demonstrations, e.g. a run's ``--train-problems``); 16 hex digits.

    Raises:
        ValueError: as :func:`model_fingerprint`.
    """
    blob = json.dumps(
        {"v": COLD_START_VERSION, "student": model_fingerprint(model_path), "settings": _settings(cfg), "extra": extra},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cold_start_folder(key: str) -> Path:
    """``$CONSEQUENCE_CACHE/cold-starts/KEY``: where :func:`cached_cold_start` keeps a cold start."""
    return cache_root() / "cold-starts" / key


def built_on(folder: Path) -> str:
    """When the cold start in ``folder`` was written (its ``sft.json``'s time, local, to the minute)."""
    return datetime.fromtimestamp((Path(folder) / "sft.json").stat().st_mtime).strftime("%Y-%m-%d %H:%M")


def cached_cold_start(
    model_path: Path,
    cfg: ColdStartConfig,
    *,
    extra: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
    phases: Phases = SILENT,
    source: dict[str, Any] | None = None,
    env: Any = None,
    build: bool = True,
    before_build: Callable[[], None] | None = None,
    device: Any = "cpu",
) -> tuple[Path, dict[str, Any], bool]:
    """The cold start of ``model_path`` with ``cfg``, from the cache or built into it.

    The folder is :func:`cold_start_folder` of :func:`cold_start_key`; it counts as built when
    its ``sft.json`` exists (:func:`cold_start` writes the folder atomically, ``sft.json``
    inside it). Looking and building happen under an exclusive lock on ``KEY.lock`` beside it
    (``fcntl.flock``), so of several processes that want the same cold start at once (the
    seeds of an experiment) one builds it and the others wait, then reuse it; a lock is
    released when its process ends, however it ends.

    Args:
        model_path: the student (a local Hugging Face folder).
        cfg: :class:`ColdStartConfig`.
        extra: more of the key (:func:`cold_start_key`), also recorded as given.
        log: one line when it is reused, waited for, or (by :func:`cold_start`) built.
        phases: progress of the SFT steps.
        source: what to record of the model's origin (a registered model's file hash).
        env: the environment to play (:func:`cold_start`).
        build: False: only reuse (a resumed run must start from the very cold start it began
            with); a missing one is an error.
        before_build: called once before a build (e.g. checks that are cheaper than the
            cold start); not called when the cold start is reused.
        device: where a build computes (:func:`cold_start`); not part of the key.

    Returns:
        ``(folder, its sft.json record, reused)``.

    Raises:
        ValueError: not built and ``build`` is False (the message names the folder), or as
            :func:`cold_start` and ``before_build``.
    """
    key = cold_start_key(model_path, cfg, extra)
    out = cold_start_folder(key)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(out.parent / f"{key}.lock", log):
        if (out / "sft.json").is_file():
            log(f"cold start: reusing {out} (built {built_on(out)})")
            return out, json.loads((out / "sft.json").read_text(encoding="utf-8")), True
        if not build:
            raise ValueError(f"the cold start {out} is not in the cache (any more)")
        if before_build is not None:
            before_build()
        log(f"cold start: building {out} (key {key}: the student's files and every cold-start setting)")
        return out, cold_start(model_path, out, cfg, log, phases, source, env=env, device=device), False


@contextlib.contextmanager
def _exclusive(lock: Path, log: Callable[[str], None]) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock`` (created if missing; kept afterwards)."""
    with open(lock, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"cold start: another process is building it ({lock} is locked); waiting")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)

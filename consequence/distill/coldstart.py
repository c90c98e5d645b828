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
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from consequence.distill.demonstrations import collect_demonstrations
from consequence.distill.rejection import accepted_rows
from consequence.distill.sft import SFTConfig, sft_steps, train_sft
from consequence.distill.teacher_url import TeacherEndpoint
from consequence.envs.registry import load_environment
from consequence.evaluate.progress import SILENT, Phases
from consequence.harness.renderer import Renderer
from consequence.policy.lora import DEFAULT_TARGETS, apply_lora
from consequence.policy.tiny import load_policy, save_policy

__all__ = ["ColdStartConfig", "cold_start"]


@dataclass(frozen=True)
class ColdStartConfig:
    """Settings of :func:`cold_start` (all recorded in ``sft.json``).

    Attributes:
        env: the environment (with a demonstrator, unless ``demos_file`` or ``teacher`` is given).
        env_options: its options.
        demos: demonstrator (or ``teacher``) episodes to run (train split); the verified
            ones are kept. Not read with ``demos_file``.
        seed: split seed of the environment, and the demonstrator's and SFT's seeds.
        demos_file: a file of demonstrations instead of the demonstrator (our trajectories
            ``.parquet`` or OpenAI-style messages ``.jsonl``; ``distill/demonstrations.py``);
            each is replayed on its task and kept only when verified.
        teacher: a teacher behind an OpenAI-compatible URL instead of the demonstrator
            (``distill/teacher_url.py``); not with ``demos_file``.
        lora_rank: 0 = full fine-tuning; r ≥ 1 trains a LoRA adapter, merged at the end.
        lora_alpha, lora_targets: the adapter's α and modules.
        sft: :class:`~consequence.distill.sft.SFTConfig`.
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


def cold_start(
    model_path: Path,
    out: Path,
    cfg: ColdStartConfig = ColdStartConfig(),
    log: Callable[[str], None] = print,
    phases: Phases = SILENT,
    source: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Verified demonstrations in the student's tokens → SFT → ``out`` (a plain model folder).

    Args:
        model_path: the student (a local Hugging Face folder).
        out: the folder to write (replaced atomically).
        cfg: :class:`ColdStartConfig`.
        log: one line per phase.
        phases: progress of the SFT steps (steps done / total, steps/s).
        source: what to record of the model's origin (e.g. a registered model's file hash).

    Returns:
        the ``sft.json`` record.

    Raises:
        ValueError: neither ``demos_file`` nor ``teacher`` and the environment has no
            demonstrator (names the fix), a bad ``demos_file``, a ``teacher`` that cannot be
            reached at the start, no demonstration verified, or as
            :func:`consequence.distill.sft.train_sft`.
    """
    t0 = time.perf_counter()
    env = load_environment(cfg.env, cfg.seed, dict(cfg.env_options))
    model, tok = load_policy(model_path)
    renderer = Renderer(tok, env.tools)  # the student's format: native, or Hermes where the template drops tools
    demos = collect_demonstrations(
        env,
        renderer,
        demos_file=cfg.demos_file,
        episodes=None if cfg.demos_file else cfg.demos,
        seed=cfg.seed,
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
        "student": str(model_path),
        "source": source,
        "environment": env.label,
        "settings": _settings(cfg),
        "tool_format": renderer.tool_format,
        "teacher": demos.record(),
        "rows": len(rows),
        "tokens": n_tokens,
        "targets": n_targets,
        "trainable_parameters": trainable,
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
        "demos_file": cfg.demos_file,
        "teacher_url": None if cfg.teacher is None else cfg.teacher.as_dict(),
        "seed": cfg.seed,
        "lora_rank": cfg.lora_rank,
        "lora_alpha": cfg.lora_alpha,
        "lora_targets": list(cfg.lora_targets),
        "sft": cfg.sft.as_dict(),
    }

"""Warm start: build the bundled tiny model and fine-tune it on verified teacher demos.

Steps (each a box of its own; this module only wires them):
1. the environment's demonstrator (``Environment.demonstration``, played by the scripted
   teacher of ``distill/teacher.py``) solves train tasks through the real environment and
   harness; only demonstrations that the environment's reward verifies are kept;
2. a byte-level BPE tokenizer is trained on the rendered conversations, and a
   Llama-architecture model of ~2 M parameters is initialised (``policy/tiny.py``);
3. supervised fine-tuning with the loss on assistant tokens only (the same loss mask the
   RL update uses), then ``save_pretrained``.

The result is cached under ``$CONSEQUENCE_CACHE`` (default ``~/.cache/consequence``),
keyed by the settings, and built on first use.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from consequence.distill.sft import SFTConfig, train_sft
from consequence.distill.teacher import DemoSet, demonstration_plans, turn_text, verify_plans
from consequence.envs.registry import load_environment
from consequence.fileio import cache_root
from consequence.harness.renderer import Renderer, replay_conversation
from consequence.policy.tiny import BUNDLED, build_model, build_tokenizer, save_policy
from consequence.records import ModelCall, Trajectory, trajectory_to_rows
from consequence.rollout.episodes import opening_messages

WARMSTART_VERSION = 1


@dataclass(frozen=True)
class WarmstartConfig:
    """Settings of the warm-start build (all of them go into the cache key).

    ``p_*`` are the habits of the default environment's demonstrator (diagnose first, read
    only, a wrong patch first, verify before finishing); they reach any environment's
    demonstrator as ``habits=`` when they differ from the defaults (:meth:`demonstrator_habits`).
    """

    seed: int = 0
    n_demos: int = 4000
    vocab_size: int = 768
    hidden_size: int = 192
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 512
    sft_epochs: float = 8.0
    batch_size: int = 32
    learning_rate: float = 3e-3
    p_diagnose_first: float = 0.5
    p_read_only: float = 0.3
    p_wrong_patch_first: float = 0.25
    p_verify_before_finish: float = 0.5
    env: str = "repair"  # whose train split the teacher solves (an environment with a demonstrator)

    def settings(self) -> dict:
        """What the cache key and ``warmstart.json`` hold (``env`` only when not the default,
        so checkpoints built before environments were plug-ins keep their key)."""
        d = asdict(self)
        if d["env"] == "repair":
            del d["env"]
        return d

    def demonstrator_habits(self) -> dict[str, float] | None:
        """The ``p_*`` settings when any differs from its default, else None (the
        demonstrator's own defaults, which are these)."""
        habits = {k: v for k, v in asdict(self).items() if k.startswith("p_")}
        defaults = {k: v for k, v in asdict(WarmstartConfig()).items() if k.startswith("p_")}
        return habits if habits != defaults else None

    def key(self) -> str:
        blob = json.dumps({"v": WARMSTART_VERSION, **self.settings()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def warmstart_path(cfg: WarmstartConfig = WarmstartConfig()) -> Path:
    return cache_root() / "warmstart" / f"tiny-repair-{cfg.key()}"


def ensure_warmstart(cfg: WarmstartConfig = WarmstartConfig(), log: Callable[[str], None] = print) -> Path:
    """Return the warm-start checkpoint directory, building it first if it is missing.

    The package ships the checkpoint built with the default settings
    (``consequence/assets/tiny-repair``, made by ``consequence warmstart --bundle``);
    other settings are built on first use and cached.
    """
    if _built_with(BUNDLED, cfg):
        return BUNDLED
    path = warmstart_path(cfg)
    if (path / "warmstart.json").exists():
        return path
    log(f"building the warm-start checkpoint (first use; about 30 min on 2 cores, cached afterwards) into {path}")
    return build_warmstart(cfg, path, log)


def _built_with(path: Path, cfg: WarmstartConfig) -> bool:
    info = path / "warmstart.json"
    if not info.exists():
        return False
    meta = json.loads(info.read_text())
    return meta.get("config") == cfg.settings() and meta.get("version") == WARMSTART_VERSION


def teacher_conversations(cfg: WarmstartConfig, log: Callable[[str], None] = print, env=None) -> list[list[dict]]:
    """The messages of the verified demonstrations of :func:`teacher_demonstrations`.

    ``env``: the environment to solve (default: ``cfg.env`` with its default options).
    """
    return [t.messages for t in teacher_demonstrations(cfg, log, env)]


def teacher_demonstrations(
    cfg: WarmstartConfig,
    log: Callable[[str], None] = print,
    env=None,
    draw_seed: int | None = None,
    renderer: Renderer | None = None,
) -> list[Trajectory]:
    """The environment demonstrator's verified episodes on ``cfg.n_demos`` train-split tasks
    (:func:`teacher_demo_set`'s kept episodes)."""
    return teacher_demo_set(cfg, log, env, draw_seed, renderer).kept


def teacher_demo_set(
    cfg: WarmstartConfig,
    log: Callable[[str], None] = print,
    env=None,
    draw_seed: int | None = None,
    renderer: Renderer | None = None,
) -> DemoSet:
    """Play the environment's demonstrator on ``cfg.n_demos`` train-split tasks; keep the verified.

    The tasks are ``env.sample("train", n_demos, seed=d + 1)`` and each task's demonstration
    is ``env.demonstration(task, rng)`` with one ``rng = random.Random(d)`` for the tasks in
    order, d = ``draw_seed`` or, by default, ``cfg.seed`` (the warm start's own demonstrations;
    another d gives other instances and habits). Each is played through a fresh episode and
    kept when it finished and the environment's reward verified it (primary component 1).

    Args:
        cfg: the settings (``env``, ``n_demos``, ``seed``, the demonstrator's ``p_*`` habits).
        log: one line with the counts.
        env: the environment to solve (default: ``cfg.env`` with its default options).
        draw_seed: d (above).
        renderer: the renderer whose tokens the episodes are played in (the student's). By
            default a throw-away tokenizer's (trained on the system prompt and the
            demonstrations' texts): re-render the episodes for a student with
            :func:`demo_trajectories` (task ids, rewards and messages are kept).

    Returns:
        the :class:`~consequence.distill.teacher.DemoSet` (kept episodes, rejections by reason).

    Raises:
        ValueError: the environment has no demonstrator (the message names it and the fix:
            a file of demonstrations), ``p_*`` habits for one that takes none, or an empty
            train split.
    """
    env = env if env is not None else load_environment(cfg.env, cfg.seed)
    d = cfg.seed if draw_seed is None else draw_seed
    tasks = env.sample("train", cfg.n_demos, seed=d + 1)
    plans = demonstration_plans(env, tasks, random.Random(d), cfg.demonstrator_habits())
    if renderer is None:  # any tokenizer drives the episodes: they are re-rendered for the student
        texts = [turn_text(step) for plan in plans[:200] for step in plan]
        renderer = Renderer(build_tokenizer([env.system_prompt] + texts, vocab_size=300), env.tools)
    demos = verify_plans(env, tasks, plans, renderer, cfg.seed)
    demos.source = {"kind": "scripted", "environment": env.label, "draw_seed": d}
    log(f"teacher: {demos.summary()}")
    return demos


def demo_trajectories(renderer: Renderer, demos: list[Trajectory], opening: int | None = None) -> list[Trajectory]:
    """The demonstrations in the student's tokens: each assistant turn re-rendered by ``renderer``
    (its chat template and tool format), sampler log-probs 0 (the teacher is not a sampler);
    task, group and sample ids, outcome, rewards and messages as they were.

    ``opening``: messages before the first assistant turn of the episode (system prompt,
    worked examples, request); default: up to the first user message (no worked examples).
    """
    return [dataclasses.replace(t, calls=_replayed_calls(renderer, t.messages, opening)) for t in demos]


def _replayed_calls(renderer: Renderer, messages: list[dict], opening: int | None = None) -> list[ModelCall]:
    return [
        ModelCall(ctx, ids, [0.0] * len(ids), "stop", observation_ids=obs)
        for ctx, ids, obs in replay_conversation(renderer, messages, opening)
    ]


def demo_rows(renderer: Renderer, conversations: list[list[dict]], opening: int | None = None):
    """Token rows (loss mask on assistant tokens only) of the demonstrations (``opening``: as
    :func:`demo_trajectories`)."""
    rows = []
    for k, msgs in enumerate(conversations):
        calls = _replayed_calls(renderer, msgs, opening)
        traj = Trajectory(task_id=str(k), group_id=str(k), sample_id=0, seed=0, policy_version=0, calls=calls)
        rows += trajectory_to_rows(traj, k)
    return rows


def build_warmstart(cfg: WarmstartConfig, path: Path, log: Callable[[str], None] = print) -> Path:
    """Build tokenizer + model, run SFT, save atomically to ``path``."""
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    env = load_environment(cfg.env, cfg.seed)
    convs = teacher_conversations(cfg, log, env)
    boot = build_tokenizer(["x"], vocab_size=300)
    corpus = [Renderer(boot, env.tools).render_text(m, add_generation_prompt=False) for m in convs]
    tokenizer = build_tokenizer(corpus, vocab_size=cfg.vocab_size)
    renderer = Renderer(tokenizer, env.tools)
    rows = demo_rows(renderer, convs, len(opening_messages(env.system_prompt, "", env.examples)))
    model = build_model(
        tokenizer,
        seed=cfg.seed,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
    )
    n_tokens = sum(len(r.input_ids) for r in rows)
    log(f"SFT: {len(rows)} rows, {n_tokens} tokens, {sum(p.numel() for p in model.parameters())} parameters")
    losses = sft(model, rows, tokenizer.pad_token_id, cfg, log)
    info = {
        "config": cfg.settings(),
        "n_demos": len(convs),
        "n_rows": len(rows),
        "n_tokens": n_tokens,
        "final_loss": losses[-1] if losses else None,
        "seconds": time.perf_counter() - t0,
        "version": WARMSTART_VERSION,
    }
    save_policy(model, tokenizer, path, {"warmstart.json": json.dumps(info, indent=2)})
    log(f"warm start saved to {path} in {info['seconds']:.0f} s (final SFT loss {info['final_loss']:.3f})")
    return path


def sft(model, rows, pad_id: int, cfg: WarmstartConfig, log: Callable[[str], None] = print) -> list[float]:
    """Token-mean cross-entropy on target tokens (``distill.sft.train_sft``, one micro-batch
    per step); AdamW with warmup and cosine decay."""
    return train_sft(
        model,
        rows,
        pad_id,
        SFTConfig(
            learning_rate=cfg.learning_rate,
            epochs=cfg.sft_epochs,
            rows_per_step=cfg.batch_size,
            micro_batch_size=cfg.batch_size,
            seed=cfg.seed,
        ),
        log,
    )

"""Cold start: build the bundled tiny model and fine-tune it on verified teacher demos.

Steps (each a box of its own; this module only wires them):
1. the scripted teacher (``distill/teacher.py``) solves train problems through the real
   environment and harness; only demonstrations that pass the hidden tests are kept;
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
from consequence.distill.teacher import ScriptedTeacher, TeacherHabits, plan_episode
from consequence.envs.registry import load_environment
from consequence.envs.repair.problems import RepairTask
from consequence.fileio import cache_root
from consequence.harness.renderer import Renderer, replay_conversation
from consequence.policy.tiny import BUNDLED, build_model, build_tokenizer, save_policy
from consequence.records import ModelCall, Trajectory, trajectory_to_rows
from consequence.rollout.episodes import Budgets, EpisodeSpec, run_episodes

WARMSTART_VERSION = 1


@dataclass(frozen=True)
class WarmstartConfig:
    """Settings of the warm-start build (all of them go into the cache key)."""

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
    env: str = "repair"  # whose train split the teacher solves (a repair-type environment)

    def settings(self) -> dict:
        """What the cache key and ``warmstart.json`` hold (``env`` only when not the default,
        so checkpoints built before environments were plug-ins keep their key)."""
        d = asdict(self)
        if d["env"] == "repair":
            del d["env"]
        return d

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
    """Run the scripted teacher on train-split tasks; keep verified demonstrations.

    ``env``: the environment to solve (default: ``cfg.env`` with its default options).
    """
    return [t.messages for t in teacher_demonstrations(cfg, log, env)]


def teacher_demonstrations(
    cfg: WarmstartConfig, log: Callable[[str], None] = print, env=None, draw_seed: int | None = None
) -> list[Trajectory]:
    """The scripted teacher's verified episodes on ``cfg.n_demos`` train-split tasks.

    The tasks are ``env.sample("train", n_demos, seed=d + 1)`` and the teacher's habits are drawn
    from ``random.Random(d)``, with d = ``draw_seed`` or, by default, ``cfg.seed`` (the warm
    start's own demonstrations; another d gives other instances and habits). An episode is kept when
    it finished and the verifier scored it 1. Its token ids are a throw-away tokenizer's: re-render
    it for a student with :func:`demo_trajectories` (task ids, rewards and messages are kept).

    Raises:
        ValueError: the environment's tasks are not repair tasks (the teacher solves only those).
    """
    env = env if env is not None else load_environment(cfg.env, cfg.seed)
    d = cfg.seed if draw_seed is None else draw_seed
    tasks = env.sample("train", cfg.n_demos, seed=d + 1)
    if not all(isinstance(t, RepairTask) for t in tasks[:1]):
        raise ValueError(
            f"--env {cfg.env}: the scripted teacher solves repair tasks only (repair, humaneval-repair, "
            "jsonl); train in this environment from a model of your own (--model PATH)"
        )
    rng = random.Random(d)
    habits = TeacherHabits(cfg.p_diagnose_first, cfg.p_read_only, cfg.p_wrong_patch_first, cfg.p_verify_before_finish)
    plans = [plan_episode(t, rng, habits) for t in tasks]
    # Any tokenizer will do to drive the episodes: demonstrations are re-rendered for the student.
    boot = build_tokenizer([env.system_prompt] + [t.buggy_code for t in tasks[:200]], vocab_size=300)
    renderer = Renderer(boot, env.tools)
    specs = [EpisodeSpec(env.make_episode(t), t.task_id, t.task_id, 0, cfg.seed) for t in tasks]
    budgets = Budgets(max_turns=12, max_new_tokens=10_000, max_total_tokens=10**9, max_tool_calls=12)
    trajs = run_episodes(ScriptedTeacher(renderer, plans), renderer, specs, budgets, env.system_prompt)
    kept = [t for t in trajs if t.outcome == "finished" and t.verifier_score == 1.0]
    log(f"teacher: {len(kept)}/{len(trajs)} demonstrations verified")
    return kept


def demo_trajectories(renderer: Renderer, demos: list[Trajectory]) -> list[Trajectory]:
    """The demonstrations in the student's tokens: each assistant turn re-rendered by ``renderer``
    (its chat template and tool format), sampler log-probs 0 (the teacher is not a sampler);
    task, group and sample ids, outcome, rewards and messages as they were."""
    return [dataclasses.replace(t, calls=_replayed_calls(renderer, t.messages)) for t in demos]


def _replayed_calls(renderer: Renderer, messages: list[dict]) -> list[ModelCall]:
    return [
        ModelCall(ctx, ids, [0.0] * len(ids), "stop", observation_ids=obs)
        for ctx, ids, obs in replay_conversation(renderer, messages)
    ]


def demo_rows(renderer: Renderer, conversations: list[list[dict]]):
    """Token rows (loss mask on assistant tokens only) of the demonstrations."""
    rows = []
    for k, msgs in enumerate(conversations):
        calls = _replayed_calls(renderer, msgs)
        traj = Trajectory(task_id=str(k), group_id=str(k), sample_id=0, seed=0, policy_version=0, calls=calls)
        rows += trajectory_to_rows(traj, k)
    return rows


def build_warmstart(cfg: WarmstartConfig, path: Path, log: Callable[[str], None] = print) -> Path:
    """Build tokenizer + model, run SFT, save atomically to ``path``."""
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    convs = teacher_conversations(cfg, log)
    boot = build_tokenizer(["x"], vocab_size=300)
    tools = load_environment(cfg.env, cfg.seed).tools
    corpus = [Renderer(boot, tools).render_text(m, add_generation_prompt=False) for m in convs]
    tokenizer = build_tokenizer(corpus, vocab_size=cfg.vocab_size)
    renderer = Renderer(tokenizer, tools)
    rows = demo_rows(renderer, convs)
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

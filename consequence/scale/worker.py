"""A rollout worker: a policy snapshot with a version that rolls out whole batches (a Ray actor).

The worker runs exactly what the synchronous loop runs for a batch
(:func:`consequence.rollout.collect.collect`: generation, environment, sandbox, scoring, dynamic
sampling) with the seeds of the batch's index, so a batch is the same wherever it runs;
only the weights that sample it may be older than the trainer's.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from consequence.config import TrainConfig

__all__ = ["RolloutWorker", "trainable_state"]


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a worker needs to hold the trainer's weights: the parameters the optimizer
    changes (all of them, or a LoRA adapter's A and B), as detached CPU copies.

    Returns:
        {parameter name: tensor} (copies: a later update never changes a published version).
    """
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.requires_grad}


def _bind_vllm_threads(slot: int, threads: int) -> None:
    """vLLM's CPU engine binds its threads to cores given by environment variables: unless the
    user set them, worker ``slot`` takes its own ``threads`` cores of those this process may
    use (two engines must not share cores), and reserves none for vLLM's own bookkeeping."""
    cores = sorted(os.sched_getaffinity(0))
    mine = cores[slot * threads : (slot + 1) * threads] or cores[-threads:]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, mine)))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


class RolloutWorker:
    """One rollout worker. Constructed by Ray as an actor (``scale.scheduler``); usable in-process.

    Args:
        cfg: the run's config (the environment, budgets, sampling and LoRA settings are read).
        model_path: the starting policy's folder (the warm start); the worker loads it,
            applies LoRA like the trainer does, then receives versions by :meth:`run`.
        threads: torch threads for generation (the machine's cores shared among workers).
        worker_id: the worker's slot number (kept by its replacement after a failure).
        sys_path: the trainer's ``sys.path``; entries missing here are appended, so an
            environment given as ``module:attr`` imports in the worker as in the trainer.
    """

    def __init__(self, cfg: TrainConfig, model_path: str, threads: int, worker_id: int, sys_path: Sequence[str] = ()):
        sys.path.extend(p for p in sys_path if p not in sys.path)
        from consequence.envs.registry import env_of
        from consequence.harness.renderer import Renderer
        from consequence.policy.lora import apply_lora
        from consequence.policy.sampler import SamplingParams
        from consequence.policy.tiny import load_policy
        from consequence.rollout.episodes import Budgets

        if torch.get_num_threads() != threads:  # started by the scheduler with these threads already
            torch.set_num_threads(max(1, threads))  # (scheduler.worker_runtime_env: why not always)
        self.cfg, self.worker_id, self.version = cfg, worker_id, -1
        self.split = env_of(cfg)
        model, tokenizer = load_policy(Path(model_path))
        if cfg.lora_rank:
            model = apply_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, Path(model_path))
        self.model = model.eval()
        self.engine = None
        if cfg.rollout_engine == "vllm":  # samples instead of self.model, which then only checks versions' names
            from consequence.policy.vllm_engine import VllmEngine

            _bind_vllm_threads(worker_id, threads)

            self.engine = VllmEngine(
                model_path, max_model_len=cfg.max_total_tokens + cfg.max_new_tokens, seed=cfg.seed, version=-1
            )
        self.renderer = Renderer(tokenizer, self.split.tools, tool_format=cfg.tool_format)
        self.budgets = Budgets(cfg.max_turns, cfg.max_new_tokens, cfg.max_total_tokens)
        self.sampling = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p, cfg.max_new_tokens)

    def ready(self) -> dict[str, Any]:
        """Where the worker runs: ``pid``, ``host``, Ray ``node`` id (None in-process), torch ``threads``,
        ``engine`` and, for vLLM, its start time ``engine_start_s``."""
        try:
            import ray

            node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        except ImportError:
            node = None
        out = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "node": node,
            "threads": torch.get_num_threads(),
            "engine": self.cfg.rollout_engine,
        }
        if self.engine is not None:
            out["engine_start_s"] = self.engine.start_seconds
        return out

    def load(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Take version ``version`` of the weights; the worker samples nothing meanwhile (an
        actor runs one call at a time), so no batch sees a half-updated policy.

        Raises:
            ValueError: the state names a parameter the worker's model lacks, or misses one
                the worker trains (the trainer and worker built different models).
        """
        own = {n for n, p in self.model.named_parameters() if p.requires_grad}
        if set(state) != own:
            extra, missing = sorted(set(state) - own)[:3], sorted(own - set(state))[:3]
            raise ValueError(
                f"rollout worker {self.worker_id}: version {version} does not fit its model "
                f"(unknown parameters {extra}, missing {missing}); trainer and worker must load "
                "the same --model with the same --lora-* settings"
            )
        with torch.no_grad():
            params = dict(self.model.named_parameters())
            for name, tensor in state.items():
                params[name].copy_(tensor)
        if self.engine is not None:  # every weight, tied lm_head included (the engine's reload keeps what is missing)
            self.engine.load_weights(self.model.state_dict(), version)
        self.version = version

    def close(self) -> None:
        """Stop the vLLM engine's processes (its engine core and workers), if there is one."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def run(self, batch: int, version: int, state_ref: list) -> dict[str, Any]:
        """Roll out batch ``batch`` (its tasks and seeds) with weights of version ``version``.

        Args:
            state_ref: a one-element list holding the Ray object reference of that version's
                :func:`trainable_state` (in a list so Ray does not fetch it when the worker
                already holds the version); or the state itself, in-process.

        Returns:
            ``batch``, ``version``, ``trajectories`` (scored, each with ``policy_version =
            version``), ``stats`` (of ``collect``), ``worker``, ``rollout_s`` (the worker's own
            time for the batch, weight loading excluded), ``load_s``.
        """
        from consequence.rollout.collect import collect, harness_runner

        t0 = time.perf_counter()
        if version != self.version:
            state = state_ref[0]
            if not isinstance(state, dict):
                import ray

                state = ray.get(state)
            self.load(state, version)
        t1 = time.perf_counter()
        runner = harness_runner(self.model, self.renderer, self.split, self.budgets, self.sampling, self.engine)
        trajs, stats = collect(batch, self.cfg, runner, self.split, self.budgets, policy_version=version)
        return {
            "batch": batch,
            "version": version,
            "trajectories": trajs,
            "stats": stats,
            "worker": self.worker_id,
            "rollout_s": time.perf_counter() - t1,
            "load_s": t1 - t0,
        }

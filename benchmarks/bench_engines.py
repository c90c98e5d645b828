"""Rollout engines side by side: our sampler vs vLLM (consequence/policy/vllm_engine.py).

The same episodes of the default task (repair, test split; G episodes per task, the default
budgets: 8 calls, 48 tokens per call, 768 per episode; the bundled warm start) are run
with each engine through the same harness (``rollout.episodes.run_episodes``), one engine
after the other in one process. Per engine: wall time of the episodes, generated tokens
per second, and the sampler–trainer gap over every sampled token, the trainer being
``policy.logprobs.token_logprobs`` on the exact ids and stored supports:
mean and max |log μ − log π_trainer| and the k3 estimate of KL(μ ‖ π_trainer),
mean(r − 1 − log r) with r = π_trainer / μ. vLLM's engine start is reported separately.

Needs both engines, so it runs from the vLLM environment (``make vllm-env``):

    VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_OMP_THREADS_BIND=0-1 \\
        .venv-vllm/bin/python benchmarks/bench_engines.py [--tasks 8 --group 8] [--model FOLDER]

``--model`` runs another Hugging Face folder (e.g. SmolLM2-135M-Instruct as float32
safetensors) on the same task prompts, rendered by its own tokenizer. Writes
``benchmarks/results/bench_engines.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path

import torch

from consequence.distill.warmstart import ensure_warmstart
from consequence.envs.registry import load_environment
from consequence.harness.renderer import Renderer
from consequence.policy.logprobs import token_logprobs
from consequence.policy.sampler import SamplingParams
from consequence.policy.tiny import load_policy
from consequence.rollout.episodes import Budgets, EpisodeSpec, run_episodes
from consequence.rollout.groups import group_of
from consequence.rollout.sampling import policy_generate_fn
from consequence.seeding import seed_of


def _specs(env, tasks, group: int):
    return [
        EpisodeSpec(
            episode, t.task_id, t.task_id, j, seed_of(0, t.task_id, j), answer_ends_episode=env.answer_ends_episode
        )
        for t in tasks
        for j, episode in enumerate(group_of(env, t, group))
    ]


def _gap(model, trajs, params: SamplingParams, rows_per_batch: int = 16) -> dict:
    """Sampler–trainer log-prob gap over every sampled token of ``trajs``."""
    calls = [c for t in trajs for c in t.calls if c.output_ids]
    diffs = []
    for b in range(0, len(calls), rows_per_batch):
        part = calls[b : b + rows_per_batch]
        rows = [c.context_ids + c.output_ids for c in part]
        S = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), S, dtype=torch.long)
        am = torch.zeros(len(rows), S, dtype=torch.long)
        keep = []
        for i, (r, c) in enumerate(zip(rows, part)):
            ids[i, : len(r)] = torch.tensor(r)
            am[i, : len(r)] = 1
            for k, sup in enumerate(c.keep_ids or []):
                keep += [(i, len(c.context_ids) + k, t) for t in sup]
        ki = torch.tensor(keep, dtype=torch.long).view(-1, 3) if keep else None
        with torch.no_grad():
            lp, _ = token_logprobs(model, ids, am, params.temperature, params.top_k, params.top_p, keep_index=ki)
        for i, c in enumerate(part):
            n0 = len(c.context_ids) - 1
            pi = lp[i, n0 : n0 + len(c.output_ids)].double()
            mu = torch.tensor(c.sample_logprobs, dtype=torch.float64)
            diffs.append(pi - mu)
    d = torch.cat(diffs)
    k3 = (d.exp() - 1 - d).mean().item()
    return {
        "tokens": int(d.numel()),
        "mean_abs_logprob_gap": d.abs().mean().item(),
        "max_abs_logprob_gap": d.abs().max().item(),
        "k3_kl": k3,
    }


def _run(name: str, gen, renderer, env, specs, budgets, model, params) -> dict:
    in_gen = [0.0]

    def timed(prompts, max_new_tokens, idx):
        t = time.perf_counter()
        try:
            return gen(prompts, max_new_tokens, idx)
        finally:
            in_gen[0] += time.perf_counter() - t

    t0 = time.perf_counter()
    trajs = run_episodes(timed, renderer, specs, budgets, env.system_prompt, examples=env.examples)
    wall = time.perf_counter() - t0
    n_tok = sum(len(c.output_ids) for t in trajs for c in t.calls)
    n_calls = sum(len(t.calls) for t in trajs)
    row = {
        "engine": name,
        "episodes": len(trajs),
        "model_calls": n_calls,
        "generated_tokens": n_tok,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(n_tok / wall, 1),
        "generate_s": round(in_gen[0], 2),
        "generate_tokens_per_s": round(n_tok / in_gen[0], 1),
        **_gap(model, trajs, params),
    }
    print(
        f"{name}: {n_tok} tokens in {wall:.1f} s = {n_tok / wall:.1f} tok/s "
        f"({n_tok / in_gen[0]:.1f} tok/s inside generate); "
        f"gap mean {row['mean_abs_logprob_gap']:.2e} max {row['max_abs_logprob_gap']:.2e} k3 {row['k3_kl']:.2e}",
        flush=True,
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=None, help="a Hugging Face folder (default: the bundled warm start)")
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--only", choices=["ours", "vllm"], default=None, help="run one engine only")
    ap.add_argument("--compile", action="store_true", help="let vLLM torch.compile the model (slower start)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "bench_engines.json")
    args = ap.parse_args()
    args.load_before = os.getloadavg()

    from consequence.policy.vllm_engine import VllmEngine

    folder = args.model or ensure_warmstart()
    model, tok = load_policy(folder)
    model = model.float().eval()
    env = load_environment("repair")
    renderer = Renderer(tok, env.tools)
    tasks = env.sample("test", args.tasks, seed=seed_of(0, "test"))
    budgets = Budgets(8, 48, 768)
    params = SamplingParams(args.temperature, args.top_k, args.top_p, 48)
    specs = lambda: _specs(env, tasks, args.group)  # noqa: E731 (fresh episodes per engine)

    rows = []
    if args.only != "vllm":
        rows.append(
            _run(
                "consequence sampler",
                policy_generate_fn(model, params, renderer.stop_ids, seed=0),
                renderer,
                env,
                specs(),
                budgets,
                model,
                params,
            )
        )
    if args.only == "ours":
        _write(args, folder, rows)
        return

    t0 = time.perf_counter()
    engine = VllmEngine(folder, dtype="float32", enforce_eager=not args.compile, seed=0)
    start = time.perf_counter() - t0
    print(f"vLLM engine start: {start:.1f} s", flush=True)
    try:
        gen = engine.generate_fn(params, renderer.stop_ids, seed=0)
        gen([[1, 2, 3]], 4, [0])  # the first request pays one-time warm-ups; not timed
        row = _run(
            f"vLLM {'compiled' if args.compile else 'eager'}", gen, renderer, env, specs(), budgets, model, params
        )
        row["engine_start_s"] = round(start, 1)
        rows.append(row)
    finally:
        engine.close()
    _write(args, folder, rows)


def _write(args, folder, rows) -> None:
    try:
        import vllm

        v = vllm.__version__
    except ImportError:
        v = None
    out = {
        "model": str(folder),
        "task": "repair (test split)",
        "tasks": args.tasks,
        "group": args.group,
        "budgets": {"calls": 8, "tokens_per_call": 48, "episode_tokens": 768},
        "sampling": {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p},
        "versions": {"vllm": v, "torch": torch.__version__},
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads",
        "load_average_1min": {"before": round(args.load_before[0], 2), "after": round(os.getloadavg()[0], 2)},
        "rows": rows,
    }
    print(
        f"\n{'engine':<22}{'tokens':>8}{'wall s':>9}{'tok/s':>8}{'gen tok/s':>10}{'mean|Δ|':>11}{'max|Δ|':>11}{'k3 KL':>11}"
    )
    for r in rows:
        print(
            f"{r['engine']:<22}{r['generated_tokens']:>8}{r['wall_s']:>9}{r['tokens_per_s']:>8}{r['generate_tokens_per_s']:>10}"
            f"{r['mean_abs_logprob_gap']:>11.2e}{r['max_abs_logprob_gap']:>11.2e}{r['k3_kl']:>11.2e}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=2) + "\n")
    tmp.replace(args.out)
    print(f"wrote {args.out}")
    assert all(math.isfinite(r["max_abs_logprob_gap"]) for r in rows)


if __name__ == "__main__":
    main()

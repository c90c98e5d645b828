"""Multi-turn rollouts with and without prefix reuse across turns (policy.prefix_cache).

The same episodes (bundled warm start, repair test split, the default budgets: 8 calls,
48 tokens per call, 768 per episode) are run twice, side by side in one process: once
with every call prefilling its whole context (``sampler.generate``, the path before prefix
reuse) and once keeping each episode's K/V between calls (``generate_with_prefix``, what
rollouts and evaluations now use). Reports wall time, prompt tokens run through the model,
and whether the two produced the same episodes (output ids; log-probs to what tolerance).

Run: ``python benchmarks/bench_prefix_reuse.py [--episodes 100]``.
Writes ``benchmarks/results/prefix_reuse.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from consequence.envs.registry import load_environment
from consequence.envs.repair.env import SYSTEM_PROMPT, TOOLS, RepairEnv
from consequence.harness.renderer import Renderer
from consequence.policy.prefix_cache import PrefixCache, generate_with_prefix
from consequence.policy.sampler import SamplingParams, generate
from consequence.policy.tiny import load_policy
from consequence.rollout.episodes import Budgets, EpisodeSpec, run_episodes
from consequence.seeding import seed_of

BUNDLED = Path(__file__).resolve().parent.parent / "consequence" / "assets" / "tiny-repair"


def _run(model, renderer, tasks, temperature: float, reuse: bool):
    gen, cache = torch.Generator().manual_seed(0), PrefixCache()
    params = SamplingParams(temperature=temperature, max_new_tokens=48)
    full_prefill = [0]

    def fn(prompts, max_new_tokens, idx):
        if reuse:
            cache.keep_only(set(idx))
            return generate_with_prefix(model, prompts, idx, params, renderer.stop_ids, cache, gen)
        full_prefill[0] += sum(len(p) for p in prompts)
        return generate(model, prompts, params, renderer.stop_ids, gen)

    specs = [EpisodeSpec(RepairEnv(t), t.task_id, t.task_id, 0, seed_of(0, i)) for i, t in enumerate(tasks)]
    t0 = time.perf_counter()
    trajs = run_episodes(fn, renderer, specs, Budgets(8, 48, 768), SYSTEM_PROMPT)
    return trajs, time.perf_counter() - t0, cache.prefilled_tokens if reuse else full_prefill[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=100)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "prefix_reuse.json")
    args = ap.parse_args()
    model, tok = load_policy(BUNDLED)
    renderer = Renderer(tok, TOOLS)
    tasks = load_environment("repair", 0).sample("test", args.episodes, seed=seed_of(0, "test"))
    rows = []
    for name, temperature in (("greedy", 0.0), ("sampled T=1", 1.0)):
        full, t_full, tok_full = _run(model, renderer, tasks, temperature, reuse=False)
        reuse, t_reuse, tok_reuse = _run(model, renderer, tasks, temperature, reuse=True)
        same = sum([c.output_ids for c in a.calls] == [c.output_ids for c in b.calls] for a, b in zip(full, reuse))
        dlp = max(
            (
                abs(x - y)
                for a, b in zip(full, reuse)
                for ca, cb in zip(a.calls, b.calls)
                if ca.output_ids == cb.output_ids
                for x, y in zip(ca.sample_logprobs, cb.sample_logprobs)
            ),
            default=0.0,
        )
        rows.append(
            {
                "decoding": name,
                "episodes": len(tasks),
                "model_calls": sum(len(t.calls) for t in full),
                "full_prefill_s": t_full,
                "prefix_reuse_s": t_reuse,
                "speedup": t_full / t_reuse,
                "prompt_tokens_full": tok_full,
                "prompt_tokens_reuse": tok_reuse,
                "identical_episodes": same,
                "max_abs_logprob_diff": dlp,
            }
        )
    print(
        f"{'decoding':<12} {'episodes':>8} {'calls':>6} {'full s':>8} {'reuse s':>8} {'speedup':>8} "
        f"{'prompt tok full':>16} {'reuse':>8} {'identical':>10} {'max |Δlogp|':>12}"
    )
    for r in rows:
        print(
            f"{r['decoding']:<12} {r['episodes']:>8} {r['model_calls']:>6} {r['full_prefill_s']:>8.1f} "
            f"{r['prefix_reuse_s']:>8.1f} {r['speedup']:>7.2f}x {r['prompt_tokens_full']:>16} "
            f"{r['prompt_tokens_reuse']:>8} {r['identical_episodes']:>6}/{r['episodes']:<3} {r['max_abs_logprob_diff']:>12.1e}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"torch_threads": torch.get_num_threads(), "rows": rows}, indent=1))
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()

"""How far a small difference in the weights carries through a sampled evaluation arm, with
one random stream shared by the arm (the rule before issue 30) and one stream per episode (now).

A machine with other float32 kernels (another CPU's instruction set) trains the same run to
weights that differ in their last bits, and AdamW magnifies last-bit differences of
near-zero gradients (docs/async.md §7), so two machines' RL checkpoints can differ by more
than rounding. This benchmark imitates that: every parameter is multiplied by
(1 + δ·z), z ~ N(0, 1) with a fixed seed, for a few δ, and the same evaluation episodes
(the default run's final evaluation: ``--episodes`` train-problem instances, sampled at
T = 1) are run with the perturbed and the unperturbed weights, under both stream rules. It
counts the episodes whose sampled tokens differ and the change in success. With a shared
stream, the first token that lands otherwise changes how many draws every later episode
consumes, so the rest of the arm is redrawn; with one stream per episode only the episodes
where the perturbation moved a token change.

Run: ``.venv/bin/python benchmarks/bench_eval_streams.py --policy runs/repair-default/checkpoints/final``
(about 5 min on 2 cores; prints a table, writes ``benchmarks/results/bench_eval_streams.json``).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from consequence.config import TrainConfig
from consequence.envs.registry import env_of
from consequence.evaluate.episode_eval import solved
from consequence.fileio import write_text_atomic
from consequence.harness.renderer import Renderer
from consequence.policy.sampler import SamplingParams
from consequence.policy.tiny import load_policy
from consequence.reward.scoring import score_trajectories
from consequence.rollout.episodes import Budgets, EpisodeSpec, run_episodes
from consequence.rollout.groups import group_of
from consequence.rollout.sampling import policy_generate_fn
from consequence.seeding import seed_of


def arm(model, renderer, env, tasks, budgets: Budgets, seed: int, per_episode: bool) -> list:
    """One sampled episode per task (T = 1); streams shared by the arm or one per episode."""
    specs = [
        EpisodeSpec(
            group_of(env, t, 1)[0], t.task_id, t.task_id, 0, seed_of(seed, t.task_id, 0), (), env.answer_ends_episode
        )
        for t in tasks
    ]
    gen = policy_generate_fn(
        model,
        SamplingParams(1.0, max_new_tokens=budgets.max_new_tokens),
        renderer.stop_ids,
        seed,
        episode_seeds=[s.seed for s in specs] if per_episode else None,
    )
    trajs = run_episodes(gen, renderer, specs, budgets, env.system_prompt, examples=env.examples)
    score_trajectories(trajs, components=env.reward_components, reward_range=env.reward_range)
    return trajs


def perturb(model, delta: float, seed: int = 0) -> None:
    """Every parameter ← parameter · (1 + delta · z), z ~ N(0, 1) drawn with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + delta * torch.randn(p.shape, generator=g))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", required=True, help="checkpoint folder (e.g. runs/repair-default/checkpoints/final)")
    ap.add_argument("--episodes", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--deltas",
        type=lambda v: [float(x) for x in v.split(",")],
        default=[1e-7, 1e-6, 1e-5],
        help="relative perturbations δ, comma-separated",
    )
    ap.add_argument("--out", default="benchmarks/results/bench_eval_streams.json")
    args = ap.parse_args()
    cfg = TrainConfig()
    env = env_of(cfg)
    tasks = env.sample("train", args.episodes, seed=seed_of(args.seed, "fresh"))
    budgets = Budgets(cfg.max_turns, cfg.max_new_tokens, cfg.max_total_tokens)
    ap_deltas = args.deltas
    rows = []
    for per_episode in (False, True):
        rule = "one per episode" if per_episode else "one shared by the arm"
        runs = {}
        for delta in [0.0, *ap_deltas]:
            model, tok = load_policy(Path(args.policy))
            if delta:
                perturb(model, delta)
            t0 = time.perf_counter()
            runs[delta] = arm(model, Renderer(tok, env.tools), env, tasks, budgets, args.seed, per_episode)
            print(f"  {rule}, delta {delta:g}: {time.perf_counter() - t0:.0f} s", flush=True)
        a = runs[0.0]
        for delta in ap_deltas:
            b = runs[delta]
            changed = [
                i
                for i, (x, y) in enumerate(zip(a, b))
                if [c.output_ids for c in x.calls] != [c.output_ids for c in y.calls]
            ]
            rows.append(
                {
                    "streams": rule,
                    "delta": delta,
                    "episodes": len(a),
                    "episodes_changed": len(changed),
                    "first_changed": changed[0] if changed else None,
                    "success": sum(map(solved, a)) / len(a),
                    "success_perturbed": sum(map(solved, b)) / len(b),
                    "episodes_whose_success_changed": sum(solved(x) != solved(y) for x, y in zip(a, b)),
                }
            )
    print("\n| streams | δ | episodes changed | first changed | success | success, perturbed | success flips |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['streams']} | {r['delta']:g} | {r['episodes_changed']} / {r['episodes']} | {r['first_changed']} | "
            f"{100 * r['success']:.1f} % | {100 * r['success_perturbed']:.1f} % | {r['episodes_whose_success_changed']} |"
        )
    out = {
        "policy": str(args.policy),
        "seed": args.seed,
        "rows": rows,
        "machine": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
    }
    write_text_atomic(Path(args.out), json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

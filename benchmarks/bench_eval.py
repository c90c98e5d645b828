"""HumanEval completion evaluation: the unbatched path it replaced vs the batched one, in one run.

Both paths sample the same problems with the same model (the bundled tiny model by
default: it writes garbage code quickly, which is what is timed) and score every sample
with the same verifier (``verify_completion``: the two-process judge) on ``--workers``
threads:

- old: one ``generate`` call per problem (its n samples), scoring of a problem's samples
  starting when the next problem samples (the loop before batching, copied here), with
  torch's default thread count (what ``consequence eval`` used) and, for a like-for-like
  row, with 1 thread;
- new: ``consequence.evaluate.completions.evaluate_completions``: problems grouped by
  prompt length into batches of about ``--batch-rows`` rows, one ``generate`` per batch,
  scoring in the thread pool while the next batch samples, torch threads = CPUs − workers
  (at least 1).

A fourth row runs the new path with torch's default thread count, to separate the two
changes (batching across problems; leaving cores to the sandbox). The paths draw different
samples (old: one generator per problem; new: one stream per sample, docs/evaluation.md),
so the timing is per sample. Each
path first runs once untimed on 2 problems (sandbox probes, imports). Runs alternate old, old (1 thread), new (``--repeats`` times)
and the best of each is kept; the report caches are cleared before each run. Prints a table and
writes ``benchmarks/results/bench_eval.json``.

Run: ``.venv/bin/python benchmarks/bench_eval.py [--problems 20 -n 1]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from consequence.envs.humaneval.code_tasks import load_humaneval
from consequence.evaluate import completions as comp
from consequence.policy.sampler import SamplingParams, generate
from consequence.policy.tiny import BUNDLED
from consequence.sandbox import judge, sandbox


def old_sample(model, tok, tasks, n, temperature, seed, max_new_tokens, on_task):
    """The sampling loop before batching: one generate per task, seeded ``seed * 1_000_003 + i``."""
    mode = "chat" if getattr(tok, "chat_template", None) else "raw"
    ctx = getattr(model.config, "max_position_embeddings", None) or 10**9
    params = SamplingParams(temperature=temperature, top_p=1.0, max_new_tokens=max_new_tokens)
    stops = comp._stop_ids(model, tok)
    comps, flags = [], []
    for i, task in enumerate(tasks):
        ids = comp._prompt_ids(tok, task, mode)
        if len(ids) + max_new_tokens > ctx:
            cs, fl = [""] * n, ["too_long"] * n
        else:
            gen = torch.Generator(device=model.device).manual_seed(seed * 1_000_003 + i)
            samples = generate(model, [ids] * n, params, stops, gen)
            cs = [
                comp.extract_completion(
                    tok.decode([t for t in s.output_ids if t not in stops], skip_special_tokens=True), task, mode
                )
                for s in samples
            ]
            fl = [s.stop_reason for s in samples]
        comps.append(cs)
        flags.append(fl)
        on_task(i, cs, fl)
    return comps, flags


def old_evaluate(model_path, tasks, n, ks, temperature, seed, max_new_tokens, workers):
    """``evaluate_completions`` before batching (model load, sampling, overlapped scoring)."""
    model, tok = comp._load(model_path)
    ex = ThreadPoolExecutor(max(1, workers))
    futs = [[] for _ in tasks]

    def submit(i, cs, fl):
        futs[i] = [ex.submit(comp._score_one, tasks[i], c, None) for c in cs]

    try:
        comps, flags = old_sample(model, tok, tasks, n, temperature, seed, max_new_tokens, submit)
        reports = [[f.result() for f in fs] for fs in futs]
    finally:
        ex.shutdown(wait=True)
    return comp._aggregate(tasks, reports, ks, flags, seed), comps


def _timed(fn):
    judge.clear_cache()
    sandbox.clear_cache()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(BUNDLED))
    ap.add_argument("--problems", type=int, default=20)
    ap.add_argument("-n", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=384)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-rows", type=int, default=comp.BATCH_ROWS)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_eval.json"))
    args = ap.parse_args()
    default_threads = torch.get_num_threads()
    tasks = load_humaneval("all")[: args.problems]
    ks = (1,)
    samples = len(tasks) * args.n
    paths = {
        f"old (torch threads {default_threads}: as before)": default_threads,
        "old (torch threads 1)": 1,
        f"new, batched only (torch threads {default_threads})": -default_threads,
        "new": None,
    }
    runs = {k: [] for k in paths}
    results = {}

    def one(name, threads, tasks=tasks):
        if threads is None or threads < 0:  # the library path; its own thread policy, or -threads forced
            return comp.evaluate_completions(
                args.model,
                tasks,
                n=args.n,
                ks=ks,
                temperature=args.temperature,
                seed=args.seed,
                max_new_tokens=args.max_new_tokens,
                workers=args.workers,
                batch_rows=args.batch_rows,
                threads=None if threads is None else -threads,
            )
        torch.set_num_threads(threads)
        try:
            return old_evaluate(
                args.model, tasks, args.n, ks, args.temperature, args.seed, args.max_new_tokens, args.workers
            )[0]
        finally:
            torch.set_num_threads(default_threads)

    for name, threads in paths.items():  # warm-up, untimed: sandbox probes, imports, first calls
        one(name, threads, tasks[:2])
    for _ in range(args.repeats):
        for name, threads in paths.items():
            dt, results[name] = _timed(lambda name=name, threads=threads: one(name, threads))
            runs[name].append(dt)
    best = {k: min(v) for k, v in runs.items()}
    today, like, _batched, _new = list(paths)
    ratio, ratio_like = best[today] / best["new"], best[like] / best["new"]
    print(
        f"HumanEval completion, {len(tasks)} problems × n = {args.n} = {samples} samples, model {args.model}, "
        f"max_new_tokens {args.max_new_tokens}, T = {args.temperature}, seed {args.seed}, scoring workers "
        f"{args.workers}, batch rows {args.batch_rows}, new path's torch threads "
        f"{results['new'].settings['torch_threads']}; best of {args.repeats}, load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    print("\n| path | wall s | s / sample | samples / s | pass@1 | cut by max_new_tokens | prompt too long |")
    print("|---|---|---|---|---|---|---|")
    for name in paths:
        r = results[name]
        print(
            f"| {name} | {best[name]:.2f} | {best[name] / samples:.3f} | {samples / best[name]:.2f} | "
            f"{r.pass_at_k[1]:.3f} | {r.truncated} | {r.prompt_too_long} |"
        )
    print(
        f"\nnew path per sample: {ratio:.1f}× faster than before, {ratio_like:.1f}× faster than the old loop "
        "at 1 torch thread"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "meta": {
                    "platform": platform.platform(),
                    "cpus": os.cpu_count(),
                    "torch": torch.__version__,
                    "default_threads": default_threads,
                    "new_threads": results["new"].settings["torch_threads"],
                    "load_avg_1min": os.getloadavg()[0],
                    **{k: v for k, v in vars(args).items() if k != "out"},
                },
                "samples": samples,
                "wall_s": runs,
                "best_s": best,
                "s_per_sample": {k: v / samples for k, v in best.items()},
                "speedup_per_sample": ratio,
                "speedup_per_sample_vs_old_at_1_thread": ratio_like,
                "pass_at_1": {k: r.pass_at_k[1] for k, r in results.items()},
                "truncated": {k: r.truncated for k, r in results.items()},
            },
            indent=1,
        )
    )
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()

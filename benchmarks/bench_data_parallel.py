"""Wall time of one optimizer step with 1 vs 2 data-parallel update ranks (``--update-ranks``).

The step is ``ppo_step`` on the bundled tiny model with a batch shaped like the default
run's: 16 tasks × 8 rollouts = 128 rows, a 120-token prompt and 60–400 tokens in all
(uneven lengths, seed 0), micro-batch 32, token-mean reduction, AdamW. Rows:

* 1 rank, torch threads = all cores (what ``--update-ranks 1`` does);
* 1 rank, 1 thread (the per-rank share of 2 ranks, for reference);
* 2 ranks (``DataParallelUpdate``: this process + one spawned rank on loopback gloo, one
  thread each): the step's rows are sharded by tokens, gradients all-reduced.

The first data-parallel step also starts the rank process (spawn, imports, the policy
copy); that start is timed apart. Each timing is the median of ``--repeats`` steps after
one warm-up step. Also reported: the largest weight difference between the 1-rank and
2-rank replicas after the same steps from the same start (float rounding only).

``--model`` takes another policy (a folder, or a registered name such as
``smollm2-135m-instruct``) and ``--lora-rank`` trains a LoRA adapter on it, as
``--update-ranks`` does in a run; the rows keep their shape, token ids drawn from that
model's vocabulary.

Prints a table and writes ``benchmarks/results/data_parallel.json`` (``--out``).
Run: ``.venv/bin/python benchmarks/bench_data_parallel.py [--rows 128] [--repeats 3]``
SmolLM2 with LoRA: ``... --model smollm2-135m-instruct --lora-rank 16 --rows 32 --micro-batch 8
--out benchmarks/results/data_parallel_smollm2_lora.json``
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from consequence.distill.warmstart import BUNDLED
from consequence.evaluate.run import resolve_model
from consequence.policy.logprobs import token_logprobs
from consequence.policy.lora import DEFAULT_TARGETS, apply_lora
from consequence.policy.tiny import load_policy
from consequence.records import TrainingRow
from consequence.update.data_parallel import DataParallelUpdate, shard_rows
from consequence.update.step import UpdateConfig, ppo_step


def make_rows(n_rows: int, vocab: int, seed: int = 0) -> tuple[list[TrainingRow], list[float]]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n_rows):
        total = int(torch.randint(60 + 120, 400 + 1, (1,), generator=g))
        ids = torch.randint(10, vocab, (total,), generator=g).tolist()
        mask = [0] * 120 + [1] * (total - 120)
        rows.append(TrainingRow(ids, mask, [-1.0 if m else 0.0 for m in mask]))
    adv = [float(torch.randn(1, generator=g)) for _ in range(n_rows)]
    return rows, adv


def timed(fn, repeats: int) -> tuple[float, list[float]]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=128, help="rows per step (default 16 tasks × 8 rollouts)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--micro-batch", type=int, default=32)
    ap.add_argument("--model", default=None, help="a model folder or registered name (default: the bundled tiny model)")
    ap.add_argument("--lora-rank", type=int, default=0, help="train a LoRA adapter of this rank (0 = full fine-tuning)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "data_parallel.json")
    args = ap.parse_args()
    load = os.getloadavg()[0]  # other work on the machine slows every row; recorded with the result
    torch.manual_seed(0)
    path = resolve_model(args.model) if args.model else BUNDLED
    base, tok = load_policy(path)
    if args.lora_rank:
        base = apply_lora(base, args.lora_rank, 2.0 * args.lora_rank, DEFAULT_TARGETS, path)
    rows, adv = make_rows(args.rows, len(tok))
    cfg = UpdateConfig(micro_batch_size=args.micro_batch)
    pad = tok.pad_token_id
    cores = os.cpu_count() or 1
    results = []

    def trainable(model):
        return [p for p in model.parameters() if p.requires_grad]

    def single(threads: int):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(trainable(model), lr=1e-5)
        torch.set_num_threads(threads)
        med, times = timed(lambda: ppo_step(model, opt, rows, adv, cfg, pad, token_logprobs), args.repeats)
        return model, {"ranks": 1, "threads_per_rank": threads, "step_s": med, "times_s": times}

    one_model, r = single(cores)
    results.append(r)
    results.append(single(1)[1])
    torch.set_num_threads(cores)

    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(trainable(model), lr=1e-5)
    shards = shard_rows(rows, 2, adv, cfg)
    with DataParallelUpdate(2, threads_per_rank=max(1, cores // 2)) as dp:
        t0 = time.perf_counter()
        dp.start(model, opt)
        start_s = time.perf_counter() - t0
        med, times = timed(lambda: dp.ppo_step(model, opt, rows, adv, cfg, pad, token_logprobs), args.repeats)
    diff = max(float((p - q).detach().abs().max()) for p, q in zip(one_model.parameters(), model.parameters()))
    results.append(
        {
            "ranks": 2,
            "threads_per_rank": max(1, cores // 2),
            "step_s": med,
            "times_s": times,
            "start_s": start_s,
            "shard_tokens": [sum(len(rows[i].input_ids) for i in s) for s in shards],
            "max_weight_diff_vs_1_rank": diff,
        }
    )
    ref = results[0]["step_s"]
    print(
        f"{args.rows} rows, {sum(len(r.input_ids) for r in rows)} tokens ({sum(sum(r.loss_mask) for r in rows)} "
        f"targets), micro-batch {args.micro_batch}, {cores} cores, median of {args.repeats} steps, "
        f"load average {load:.1f} at start"
    )
    print(f"{'ranks':>5} {'threads/rank':>12} {'step s':>8} {'speed-up':>8}")
    for r in results:
        r["speedup_vs_1_rank_all_cores"] = ref / r["step_s"]
        print(
            f"{r['ranks']:>5} {r['threads_per_rank']:>12} {r['step_s']:>8.2f} {r['speedup_vs_1_rank_all_cores']:>7.2f}×"
        )
    print(
        f"2 ranks: start (spawn + imports + policy copy + group) {start_s:.1f} s once; shard tokens "
        f"{results[-1]['shard_tokens']}; max |Δw| vs 1 rank after {args.repeats + 1} steps: {diff:.1e}"
    )
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(
        json.dumps(
            {
                "rows": args.rows,
                "micro_batch": args.micro_batch,
                "cores": cores,
                "load_average_at_start": load,
                "command": "benchmarks/bench_data_parallel.py " + " ".join(sys.argv[1:]),
                "model": str(args.model or "tiny (bundled)"),
                "lora_rank": args.lora_rank,
                "torch": torch.__version__,
                "repeats": args.repeats,
                "results": results,
            },
            indent=2,
        )
    )
    os.replace(tmp, out)


if __name__ == "__main__":
    main()

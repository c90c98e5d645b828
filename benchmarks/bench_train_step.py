"""Achieved FLOP/s of the RL training step against a large matmul in the same process.

The training step is ``consequence.update.step.ppo_step`` (forward + backward + AdamW) on
the bundled tiny model, with rows shaped like the default run's (prompt + multi-turn
episode, ~400 tokens). FLOPs are counted analytically: 6 · N_matmul-params per token for
the linear layers and the output head (forward 2, backward 4), plus the attention
products QKᵀ and AV, 2 · 2 · S · d per token per layer forward and twice that backward
(counted over the full S × S square, as the fused kernel computes it).

Prints a table and writes ``benchmarks/results/train_step.json``.
Run: ``.venv/bin/python benchmarks/bench_train_step.py``
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from consequence.distill.warmstart import BUNDLED
from consequence.policy.logprobs import token_logprobs
from consequence.policy.tiny import load_policy
from consequence.records import TrainingRow
from consequence.update.step import UpdateConfig, ppo_step


def matmul_flops_per_s(n: int = 2048, repeats: int = 10) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n**3 * repeats / (time.perf_counter() - t0)


def step_flops(model, n_rows: int, seq_len: int) -> float:
    cfg = model.config
    d, L, V = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    linear = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n)
    linear += V * d  # the (tied) output head is a matmul too
    tokens = n_rows * (seq_len - 1)
    attn = 2 * 2 * seq_len * d * L  # QK^T and AV per token (forward)
    return tokens * (6 * linear + 3 * attn)


def main() -> None:
    torch.manual_seed(0)
    model, tok = load_policy(BUNDLED)
    n_rows, seq_len, reps = 64, 400, 3
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n_rows):
        ids = torch.randint(10, len(tok), (seq_len,), generator=g).tolist()
        mask = [0] * 120 + [1] * (seq_len - 120)
        rows.append(TrainingRow(ids, mask, [-1.0 if m else 0.0 for m in mask]))
    adv = [1.0 if i % 2 else -1.0 for i in range(n_rows)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    results = []
    for mb in (16, 32, 64):
        cfg = UpdateConfig(micro_batch_size=mb)
        ppo_step(model, opt, rows, adv, cfg, tok.pad_token_id, token_logprobs)  # warm-up
        t0 = time.perf_counter()
        for _ in range(reps):
            ppo_step(model, opt, rows, adv, cfg, tok.pad_token_id, token_logprobs)
        secs = (time.perf_counter() - t0) / reps
        results.append(
            {
                "micro_batch": mb,
                "rows": n_rows,
                "seq_len": seq_len,
                "step_s": round(secs, 3),
                "tokens_per_s": round(n_rows * seq_len / secs),
                "gflop_per_s": step_flops(model, n_rows, seq_len) / secs / 1e9,
            }
        )
    peak = matmul_flops_per_s() / 1e9
    print(f"{'micro-batch':>11} {'step s':>8} {'tokens/s':>9} {'GFLOP/s':>8} {'% of matmul':>11}")
    for r in results:
        r["fraction_of_matmul"] = r["gflop_per_s"] / peak
        print(
            f"{r['micro_batch']:>11} {r['step_s']:>8.2f} {r['tokens_per_s']:>9} {r['gflop_per_s']:>8.1f} {100 * r['fraction_of_matmul']:>10.1f}%"
        )
    print(f"large matmul (2048², fp32): {peak:.1f} GFLOP/s, threads {torch.get_num_threads()}")
    out = Path(__file__).parent / "results" / "train_step.json"
    out.parent.mkdir(exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(
        json.dumps(
            {
                "matmul_gflop_per_s": peak,
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "results": results,
            },
            indent=2,
        )
    )
    os.replace(tmp, out)


if __name__ == "__main__":
    main()

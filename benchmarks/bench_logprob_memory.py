"""Peak memory and time of one PPO-clip update at SmolLM2-135M's shapes: unchunked target
log-probs vs chunked (policy/logprobs.py) vs chunked + gradient checkpointing.

The model is a randomly initialised ``LlamaForCausalLM`` with SmolLM2-135M's shapes
(vocabulary 49,152, hidden 576, intermediate 1536, 30 layers, 9 heads / 3 KV heads, tied
embeddings; built from ``LlamaConfig``, nothing downloaded). One optimizer step is the
trainer's code path: ``update.step.ppo_step`` (PPO-clip, token mean, AdamW, grad-norm clip)
with the trainer's log-prob function (``token_logprobs`` with the entropy diagnostic, as
``iteration.logprob_fn``), over 32 rows × 200 tokens (40 context + 160 targets each),
advantages ±1, at micro-batch 32 and 8. Each setting runs in a fresh subprocess; its
peak resident memory is the process's ``VmHWM`` (/proc/self/status) at the end, which
counts everything: Python, torch, the model (0.54 GB fp32), its gradients and AdamW
state (1.6 GB together after the step). ``step s`` is the wall time of ``ppo_step`` and
``cpu s`` its process CPU time (all threads): on a shared machine the CPU time is the less
noisy of the two, so ratios are quoted for both.

``--sweep`` also times chunk sizes at micro-batch 32 (the default of ``DEFAULT_CHUNK_SIZE``
was chosen from it); it may use fewer layers (``--sweep-layers``), since the LM head and
its processing, which the chunk size changes, do not depend on the depth.

Prints a table and writes ``benchmarks/results/logprob_memory.json``.
Run: ``.venv/bin/python benchmarks/bench_logprob_memory.py [--layers 30] [--sweep]``
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {  # name: (chunk_size, gradient checkpointing, extra environment of the subprocess)
    "unchunked": (0, False, {}),
    "chunked": (None, False, {}),  # None = DEFAULT_CHUNK_SIZE
    "chunked+gc": (None, True, {}),
    # glibc's malloc keeps freed heap holes resident (its mmap threshold grows to 32 MB, so
    # the trunk's [6400, 576] tensors live on the heap between long-lived ones): a fixed
    # 1 MB threshold returns every larger tensor to the OS when freed
    "chunked+gc+mmap1MB": (None, True, {"MALLOC_MMAP_THRESHOLD_": "1048576"}),
}


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def one(setting: dict) -> dict:
    """Build the model, run one ppo_step, report peak memory and time (in this process)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from consequence.policy.logprobs import DEFAULT_CHUNK_SIZE, enable_gradient_checkpointing, token_logprobs
    from consequence.records import TrainingRow
    from consequence.update.step import UpdateConfig, ppo_step

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=setting["layers"],
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(cfg).float().eval()  # eval, as the trainer's policy (load_policy)
    if setting["gc"]:
        enable_gradient_checkpointing(model)
    g = torch.Generator().manual_seed(0)
    n_rows, seq_len, n_ctx = setting["rows"], setting["seq_len"], 40
    rows = []
    for _ in range(n_rows):
        ids = torch.randint(10, cfg.vocab_size, (seq_len,), generator=g).tolist()
        mask = [0] * n_ctx + [1] * (seq_len - n_ctx)
        rows.append(TrainingRow(ids, mask, [-10.8 if m else 0.0 for m in mask]))  # ≈ log(1/V): ratio ≈ 1
    adv = [1.0 if i % 2 else -1.0 for i in range(n_rows)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    ucfg = UpdateConfig(micro_batch_size=setting["micro_batch"])
    chunk = DEFAULT_CHUNK_SIZE if setting["chunk"] is None else setting["chunk"]
    lp_fn = functools.partial(token_logprobs, with_entropy=True, entropy_grad=False, chunk_size=chunk)
    rss_before = _status_kb("VmRSS")
    t0, c0 = time.perf_counter(), time.process_time()
    m = ppo_step(model, opt, rows, adv, ucfg, cfg.pad_token_id, lp_fn)
    secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        **setting,
        "chunk": chunk,
        "step_s": round(secs, 2),
        "step_cpu_s": round(cpu, 2),
        "peak_rss_gb": round(_status_kb("VmHWM") * 1024 / 1e9, 3),
        "rss_before_step_gb": round(rss_before * 1024 / 1e9, 3),
        "loss": m["loss"],
        "grad_norm": m["grad_norm"],
        "entropy": m["entropy"],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def _spawn(setting: dict, env: dict | None = None) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--one", json.dumps(setting)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})},
    )
    if out.returncode != 0:
        raise RuntimeError(f"setting {setting} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--micro-batches", default="32,8")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--sweep", action="store_true", help="also time chunk sizes at micro-batch 32")
    ap.add_argument("--sweep-layers", type=int, default=4)
    ap.add_argument("--sweep-chunks", default="0,256,512,1024,2048,4096")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "logprob_memory.json")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(json.loads(args.one))))
        return
    base = {"rows": 32, "seq_len": 200, "layers": args.layers}
    results = []
    print(
        f"{'micro-batch':>11} {'variant':>18} {'chunk':>6} {'peak GB':>8} {'× unch.':>8} {'step s':>7} "
        f"{'× unch.':>8} {'cpu s':>7} {'× unch.':>8} {'grad norm':>10}"
    )
    for mb in (int(x) for x in args.micro_batches.split(",") if x):
        ref = None
        for name in args.variants.split(","):
            chunk, gc, env = VARIANTS[name]
            r = _spawn({**base, "micro_batch": mb, "chunk": chunk, "gc": gc}, env) | {"variant": name, "env": env}
            ref = ref or r
            r["peak_vs_unchunked"] = round(r["peak_rss_gb"] / ref["peak_rss_gb"], 3)
            r["time_vs_unchunked"] = round(r["step_s"] / ref["step_s"], 3)
            r["cpu_vs_unchunked"] = round(r["step_cpu_s"] / ref["step_cpu_s"], 3)
            results.append(r)
            print(
                f"{mb:>11} {name:>18} {r['chunk']:>6} {r['peak_rss_gb']:>8.2f} {r['peak_vs_unchunked']:>8.2f} "
                f"{r['step_s']:>7.1f} {r['time_vs_unchunked']:>8.2f} {r['step_cpu_s']:>7.1f} "
                f"{r['cpu_vs_unchunked']:>8.2f} {r['grad_norm']:>10.6f}",
                flush=True,
            )
    sweep = []
    if args.sweep:
        print(f"\nchunk-size sweep, micro-batch 32, {args.sweep_layers} layers (no gradient checkpointing)")
        print(f"{'chunk':>6} {'peak GB':>8} {'step s':>7} {'× unch.':>8} {'cpu s':>7} {'× unch.':>8}")
        ref = None
        for c in (int(x) for x in args.sweep_chunks.split(",")):
            r = _spawn({**base, "layers": args.sweep_layers, "micro_batch": 32, "chunk": c, "gc": False})
            ref = ref or r
            r["time_vs_unchunked"] = round(r["step_s"] / ref["step_s"], 3)
            r["cpu_vs_unchunked"] = round(r["step_cpu_s"] / ref["step_cpu_s"], 3)
            sweep.append(r)
            print(
                f"{c:>6} {r['peak_rss_gb']:>8.2f} {r['step_s']:>7.1f} {r['time_vs_unchunked']:>8.2f} "
                f"{r['step_cpu_s']:>7.1f} {r['cpu_vs_unchunked']:>8.2f}",
                flush=True,
            )
    args.out.parent.mkdir(exist_ok=True)
    previous = []
    if args.out.exists():  # a partial run keeps the other table of the file; earlier runs are kept
        old = json.loads(args.out.read_text())
        previous = old.get("previous_runs", []) + ([old["results"]] if results and old.get("results") else [])
        results, sweep = results or old.get("results", []), sweep or old.get("chunk_sweep", [])
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(
        json.dumps(
            {
                "shapes": "SmolLM2-135M (random weights), 32 rows x 200 tokens, PPO-clip + AdamW",
                "memory": "VmHWM of a fresh process per setting (GB = 1e9 bytes)",
                "results": results,
                "chunk_sweep": sweep,
                "previous_runs": previous,
            },
            indent=2,
        )
    )
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()

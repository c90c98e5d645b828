"""Time of one update when the rows share a long prompt prefix: the trunk run once over the
shared prefix (policy/shared_prefix.py) against one full forward per row.

Rows shaped like the SmolLM2 R1-Zero run's (configs/smollm2-reasoning-gym.yaml, iteration 0,
measured from its trajectories): 32 rows, a 207-token prefix shared by all (system prompt and
two worked examples), 18 prompt tokens of each question, 26 sampled tokens (the loss
positions); the 8 rows of a group share their question. The model is a randomly initialised
``LlamaForCausalLM`` with SmolLM2-135M's shapes (built from ``LlamaConfig``, nothing
downloaded). One optimizer step is the trainer's code path: ``update.step.ppo_step``
(PPO-clip, token mean, AdamW, grad-norm clip, micro-batch 16 as in the config) with
``token_logprobs`` (entropy diagnostic, LM head on the loss positions), full fine-tuning
and LoRA r = 16 on the seven projections. Variants alternate (plain, shared, plain,
shared) so both see the same machine load; ``cpu s`` is the process CPU time.

Prints a table and writes ``benchmarks/results/shared_prefix.json``.
Run: ``.venv/bin/python benchmarks/bench_shared_prefix.py [--layers 30] [--repeats 2]``
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

SHAPES = {"rows": 32, "group": 8, "shared": 207, "question": 18, "sampled": 26}


def _model(layers: int, lora_rank: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from consequence.policy.lora import DEFAULT_TARGETS, apply_lora

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(cfg).float().eval()
    if lora_rank:
        model = apply_lora(model, lora_rank, 32.0, list(DEFAULT_TARGETS), Path("random-smollm2-shapes"))
    return model


def _rows():
    import torch

    from consequence.records import TrainingRow

    g = torch.Generator().manual_seed(0)
    shape = SHAPES
    shared = torch.randint(10, 49152, (shape["shared"],), generator=g).tolist()
    rows = []
    for _q in range(shape["rows"] // shape["group"]):
        question = torch.randint(10, 49152, (shape["question"],), generator=g).tolist()
        for _ in range(shape["group"]):
            sampled = torch.randint(10, 49152, (shape["sampled"],), generator=g).tolist()
            ids = shared + question + sampled
            mask = [0] * (len(ids) - len(sampled)) + [1] * len(sampled)
            rows.append(TrainingRow(ids, mask, [-10.8 if m else 0.0 for m in mask]))  # ≈ log(1/V): ratio ≈ 1
    return rows


def _step(model, rows, share: bool) -> dict:
    import torch

    from consequence.policy.logprobs import token_logprobs
    from consequence.update.step import UpdateConfig, ppo_step

    adv = [1.0 if i % 2 else -1.0 for i in range(len(rows))]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0)  # lr 0: same weights every run
    fn = functools.partial(token_logprobs, with_entropy=True, entropy_grad=False, share_prefix=share)
    t0, c0 = time.perf_counter(), time.process_time()
    m = ppo_step(model, opt, rows, adv, UpdateConfig(micro_batch_size=16), 2, fn)
    return {
        "step_s": time.perf_counter() - t0,
        "cpu_s": time.process_time() - c0,
        "loss": m["loss"],
        "grad_norm": m["grad_norm"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "shared_prefix.json")
    args = ap.parse_args()
    import torch

    rows = _rows()
    results = []
    print(f"{'training':>8} {'prefix':>7} {'step s':>7} {'cpu s':>7} {'× plain':>8} {'loss':>12} {'grad norm':>10}")
    for lora_rank in (0, 16):
        model = _model(args.layers, lora_rank)
        runs = {"plain": [], "shared": []}
        for _ in range(args.repeats):
            for name in runs:
                runs[name].append(_step(model, rows, share=name == "shared"))
        plain_s = min(r["step_s"] for r in runs["plain"])
        for name, rs in runs.items():
            best = min(rs, key=lambda r: r["step_s"])
            r = {
                "training": f"lora r{lora_rank}" if lora_rank else "full",
                "prefix": name,
                "layers": args.layers,
                "step_s": round(best["step_s"], 2),
                "cpu_s": round(best["cpu_s"], 2),
                "all_step_s": [round(x["step_s"], 2) for x in rs],
                "speedup_vs_plain": round(plain_s / best["step_s"], 2),
                "loss": best["loss"],
                "grad_norm": best["grad_norm"],
                "threads": torch.get_num_threads(),
            }
            results.append(r)
            print(
                f"{r['training']:>8} {name:>7} {r['step_s']:>7.1f} {r['cpu_s']:>7.1f} {r['speedup_vs_plain']:>8.2f} "
                f"{r['loss']:>12.3e} {r['grad_norm']:>10.6f}",
                flush=True,
            )
        del model
    args.out.parent.mkdir(exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(
        json.dumps(
            {
                "shapes": {
                    **SHAPES,
                    "model": "SmolLM2-135M shapes, random weights",
                    "micro_batch": 16,
                    "torch": torch.__version__,
                },
                "results": results,
            },
            indent=2,
        )
    )
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()

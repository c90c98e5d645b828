"""Rollout throughput: our ``generate`` vs ``transformers`` ``model.generate`` (sampling).

Same untrained tiny Llama, same batch of random prompts, fixed number of new tokens
(no stop ids for ours; ``min_new_tokens`` for HF so neither stops early).

Run: ``python benchmarks/bench_generation.py [--batch 64 --prompt-len 200 --new 64]``.
Writes ``benchmarks/results/generation.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from consequence.policy.sampler import SamplingParams, generate
from consequence.policy.tiny import build_model, build_tokenizer

CORPUS = [
    "<|im_start|>user\nWrite a function that adds two numbers.<|im_end|>\n",
    '<|im_start|>assistant\n<tool_call>\n{"name": "run", "arguments": {"cmd": "ls"}}\n</tool_call><|im_end|>\n',
    "def add(a, b):\n    return a + b\n",
] * 50


def _time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--group", type=int, default=8, help="samples per prompt in the grouped case")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "generation.json"))
    args = ap.parse_args()

    tok = build_tokenizer(CORPUS)
    model = build_model(tok, seed=0).eval()
    V = len(tok)
    g = torch.Generator().manual_seed(0)
    B, P, N = args.batch, args.prompt_len, args.new
    prompts = torch.randint(3, V, (B, P), generator=g).tolist()
    # GRPO-style batch: B // group distinct prompts, each repeated `group` times.
    grouped = [p for p in prompts[: max(1, B // args.group)] for _ in range(args.group)][:B]
    params = SamplingParams(temperature=1.0, max_new_tokens=N)

    def ours(ps):
        out = generate(model, ps, params, stop_ids=[], generator=torch.Generator().manual_seed(1))
        assert all(len(s.output_ids) == N for s in out)

    def hf(ps):
        ids = torch.tensor(ps)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=N,
                min_new_tokens=N,
                pad_token_id=tok.pad_token_id,
            )
        assert out.shape[1] == P + N

    ours(prompts[:2])  # warm-up
    hf(prompts[:2])
    rows = []
    for name, ps in [("distinct prompts", prompts), (f"groups of {args.group}", grouped)]:
        t_ours = _time(lambda ps=ps: ours(ps), args.repeats)
        t_hf = _time(lambda ps=ps: hf(ps), args.repeats)
        toks = B * N
        rows.append(
            {
                "case": name,
                "batch": B,
                "prompt_len": P,
                "new_tokens": N,
                "ours_s": round(t_ours, 4),
                "hf_s": round(t_hf, 4),
                "ours_tok_s": round(toks / t_ours, 1),
                "hf_tok_s": round(toks / t_hf, 1),
                "speedup": round(t_hf / t_ours, 2),
            }
        )
    hdr = f"{'case':<18} {'ours tok/s':>11} {'HF tok/s':>10} {'speedup':>8}"
    print(f"batch {B}, prompt {P}, new {N}, threads {torch.get_num_threads()}")
    print(hdr)
    for r in rows:
        print(f"{r['case']:<18} {r['ours_tok_s']:>11.1f} {r['hf_tok_s']:>10.1f} {r['speedup']:>7.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "params": sum(p.numel() for p in model.parameters()),
    }
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except Exception:  # pragma: no cover
        pass
    out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()

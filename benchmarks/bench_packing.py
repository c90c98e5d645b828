"""Time of the update's forward + backward with padding-free packing (``--packing``,
policy/packing.py) against the padded micro-batch, on SmolLM2-135M's shapes.

The model is a randomly initialised ``LlamaForCausalLM`` with SmolLM2-135M's shapes (built from
``LlamaConfig``, nothing downloaded; ``--layers`` of its 30). Each micro-batch runs
``token_logprobs`` (entropy diagnostic, LM head on the loss positions) and a backward of the sum
of its target log-probs, padded and packed, alternating so both see the same machine load;
``cpu s`` is the process CPU time of the median repeat. Three micro-batches of 8 rows:

- ``sorted``: lengths 280–320 (the update sorts a step's rows by length before cutting
  micro-batches, so a micro-batch holds rows of similar length: padding is small);
- ``uneven``: lengths 40–600 (what an unsorted micro-batch of multi-turn rows looks like);
- ``one long``: one row of 600 and seven of 60.

Prints a table and writes ``benchmarks/results/bench_packing.json``.
Run: ``.venv/bin/python benchmarks/bench_packing.py [--layers 4] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SCENARIOS = {
    "sorted": [280, 285, 290, 296, 301, 307, 313, 320],
    "uneven": [40, 600, 120, 410, 75, 260, 530, 190],
    "one long": [600] + [60] * 7,
}


def _model(layers: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

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
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).float()


def _batch(lengths: list[int]):
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 49152, (len(lengths), max(lengths)), generator=g)
    am = torch.ones_like(ids)
    for i, n in enumerate(lengths):
        ids[i, n:], am[i, n:] = 2, 0
    return ids, am


def _time(model, ids, am, packing: bool) -> tuple[float, float, object]:

    from consequence.policy.logprobs import token_logprobs

    model.zero_grad(set_to_none=True)
    target = am[:, 1:].bool()
    t0, c0 = time.perf_counter(), time.process_time()
    lp, _ = token_logprobs(model, ids, am, with_entropy=True, target_mask=target, packing=packing)
    lp[target].sum().backward()
    return time.perf_counter() - t0, time.process_time() - c0, lp.detach()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4, help="Transformer layers (SmolLM2-135M has 30).")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/bench_packing.json")
    args = ap.parse_args()
    model = _model(args.layers)
    rows = []
    for name, lengths in SCENARIOS.items():
        ids, am = _batch(lengths)
        wall: dict[bool, list[float]] = {False: [], True: []}
        cpu: dict[bool, list[float]] = {False: [], True: []}
        lps = {}
        for _ in range(args.repeats):
            for packing in (False, True):
                w, c, lp = _time(model, ids, am, packing)
                wall[packing].append(w)
                cpu[packing].append(c)
                lps[packing] = lp
        target = am[:, 1:].bool()
        rows.append(
            {
                "scenario": name,
                "rows": len(lengths),
                "real_tokens": int(am.sum()),
                "padded_tokens": int(am.numel()),
                "padded_wall_s": statistics.median(wall[False]),
                "packed_wall_s": statistics.median(wall[True]),
                "padded_cpu_s": statistics.median(cpu[False]),
                "packed_cpu_s": statistics.median(cpu[True]),
                "speedup_wall": statistics.median(wall[False]) / statistics.median(wall[True]),
                "max_abs_logprob_diff": float((lps[True] - lps[False])[target].abs().max()),
            }
        )
    print(f"SmolLM2-135M shapes, {args.layers} layers, float32 CPU, median of {args.repeats}; forward + backward")
    print(f"{'scenario':<10} {'real/padded':>13} {'padded s':>9} {'packed s':>9} {'speed-up':>9} {'max |Δ lp|':>11}")
    for r in rows:
        print(
            f"{r['scenario']:<10} {r['real_tokens']:>6}/{r['padded_tokens']:<6} {r['padded_wall_s']:>9.3f} "
            f"{r['packed_wall_s']:>9.3f} {r['speedup_wall']:>8.2f}× {r['max_abs_logprob_diff']:>11.2e}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"layers": args.layers, "repeats": args.repeats, "rows": rows}, indent=2) + "\n")
    tmp.replace(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

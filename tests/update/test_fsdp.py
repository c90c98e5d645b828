"""FSDP2 shards (``--update-strategy fsdp``, issue 34): 2 gloo ranks give the single-process step.

One 2-rank job (two spawned processes) runs every per-rank case and writes what it saw;
the tests compare it with the same step in this process. The policy is a tiny Llama with
TIED embeddings (the LM head is the embedding matrix, held by the root FSDP unit); one case
adds a LoRA adapter (PEFT), whose A and B are the only trained parameters. Each case's rows
are split unevenly (7 rows, 31 targets), and in one case a rank's rows all have advantage
0, so that rank runs no micro-batch at all, only the idle passes FSDP's collectives need.

Tolerance, from float32 summation order. Both runs add the same per-row contributions to
each gradient entry, in another order: the single process sums all rows inside one
micro-batch's matmuls; the ranks sum their own micro-batches, then the reduce-scatter sums
the two ranks, then the passes are added up; and a row's intermediate values (hidden
states, back-propagated errors: sums over the hidden dimension, ≤ 64 terms) may round
differently in a batch of another shape. Two orders of a float32 sum of n terms differ by
at most 2(n − 1)·u·Σ|terms| (u = 2⁻²⁴; Higham, *Accuracy and Stability of Numerical
Algorithms*, 2002, §4.2); the longest such sum here is over the step's positions,
n ≤ 7 rows × 11 positions = 77 (2 context tokens + at most 9 targets). The absolute terms of one parameter tensor's entries share
the magnitudes of those intermediate values, so Σ|terms| is taken as the tensor's largest
Σ_rows |g_row| (each row's gradient alone, computed here): the bound is
``TOL_FACTOR · u · max(Σ_rows|g_row|)`` per tensor, TOL_FACTOR = 2·(77 − 1) = 152. (Entry by
entry, Σ_rows|g_row| under-counts the cancellation inside a row, e.g. in a tied embedding's
softmax terms, and measured errors exceed 152·u times it by up to about 4×; against the
tensor's largest, they stay below 13·u.) The loss: float32 sums of the positions' terms,
the same bound with Σ_rows |loss_row|; token means (float64 sums of per-token float32
values that differ by kernel rounding, a few u): 1e-6 ≈ 17·u relative.

Then the trainer's side: ``DataParallelUpdate(2, strategy="fsdp")`` with spawned ranks, the
optimizer-state round trip of a resume, weights changed outside a step, and a torchrun
launch; and the settings that are refused.
"""

from __future__ import annotations

import copy
import datetime
import functools
import math
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from consequence.policy.logprobs import lm_head_split, token_logprobs
from consequence.records import TrainingRow
from consequence.update.data_parallel import DataParallelUpdate, shard_rows
from consequence.update.step import NonFiniteError, UpdateConfig, accumulate_gradients, ppo_step

V, PAD = 64, 0
TARGETS = [3, 9, 2, 6, 2, 5, 4]  # 7 rows, 31 targets
ADV = [1.0, -0.5, 0.3, -1.2, 0.0, 0.8, -0.4]  # row 4's advantage is 0: skipped unless KL / entropy run
IDLE_SHARDS = [[0, 1, 2, 3], [4, 5, 6]]
IDLE_ADV = [1.0, -0.5, 0.3, -1.2, 0.0, 0.0, 0.0]  # rank 1's rows: every advantage 0, so it trains no row
LP = functools.partial(token_logprobs, with_entropy=True, entropy_grad=True)
LR = 0.5
U = 2.0**-24
POSITIONS = len(TARGETS) * (2 + max(TARGETS))  # the longest float32 sum of the step: over its positions
TOL_FACTOR = 2 * (POSITIONS - 1)
# name: (UpdateConfig settings, LoRA adapter, explicit shards or None for shard_rows, advantages)
CASES = {
    "token_mean": (dict(reduction="token_mean", micro_batch_size=2), False, None, ADV),
    "seq_mean_token_sum_norm": (dict(reduction="seq_mean_token_sum_norm", micro_batch_size=3), False, None, ADV),
    "kl_entropy": (dict(reduction="token_mean", micro_batch_size=2, kl_coef=0.1, entropy_coef=0.01), False, None, ADV),
    "idle_rank": (dict(reduction="token_mean", micro_batch_size=2), False, IDLE_SHARDS, IDLE_ADV),
    "lora": (dict(reduction="token_mean", micro_batch_size=2), True, None, ADV),
}


def _model(lora: bool = False):
    """A tiny Llama whose LM head is tied to the embeddings; with ``lora`` a PEFT adapter on the
    attention projections, B random (not PEFT's 0) so that A's gradient is not 0 either."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=PAD,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).float()
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4.0, target_modules=["q_proj", "v_proj"]))
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "lora_B" in n:
                        p.normal_(0.0, 0.2)
    return model


def _rows(model, seed: int = 1):
    """Rows of 2 context tokens then targets; old log-probs are the model's + noise (ratios ≠ 1,
    some clipped); reference log-probs the model's + other noise."""
    g = torch.Generator().manual_seed(seed)
    rows, ref = [], []
    for i, L in enumerate(TARGETS):
        ids = torch.randint(1, V, (2 + L,), generator=g)
        with torch.no_grad():
            lp, _ = LP(model, ids[None], torch.ones(1, len(ids), dtype=torch.long))
        lp = torch.cat([torch.zeros(1), lp[0]])
        mask = [0, 0] + [1] * L
        old = [float(o) if m else 0.0 for o, m in zip(lp + 0.3 * torch.randn(len(ids), generator=g), mask)]
        ref.append([float(o) if m else 0.0 for o, m in zip(lp + 0.2 * torch.randn(len(ids), generator=g), mask)])
        rows.append(TrainingRow(ids.tolist(), mask, old, traj_index=i))
    return rows, ref


def _trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


# ---- the 2-rank job (runs in each spawned process) ------------------------------------------
def _rank_job(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from consequence.update.fsdp import fsdp_gradients, fsdp_step, optimizer_spec, shard_learner

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    seen: dict = {}
    for name, (settings, lora, shards, adv) in CASES.items():
        model = _model(lora)
        rows, ref = _rows(model)
        cfg = UpdateConfig(**settings)
        mine = (shards or shard_rows(rows, 2, adv, cfg))[rank]
        sub = lambda xs, mine=mine: [xs[i] for i in mine]  # noqa: E731
        kw = {"ref_logprobs": sub(ref)} if cfg.kl_coef else {}
        full = copy.deepcopy(model) if rank == 0 else None  # rank 0's whole policy
        spec = optimizer_spec(model, torch.optim.SGD(_trainable(model), lr=LR))
        shard, opt = shard_learner(model, spec)
        assert lm_head_split(shard) is None  # the root's forward runs, never the trunk alone
        m = fsdp_gradients(shard, sub(rows), sub(adv), cfg, PAD, LP, row_ids=mine, **kw)
        grads = {n: p.grad.full_tensor() for n, p in shard.named_parameters() if p.grad is not None}
        shard.zero_grad(set_to_none=True)
        ms = fsdp_step(shard, opt, sub(rows), sub(adv), cfg, PAD, LP, row_ids=mine, full_model=full, **kw)
        seen[name] = {"grads": grads, "metrics": m, "step_metrics": ms, "shard": mine}
        if full is not None:
            seen[name]["weights"] = {n: p.detach().clone() for n, p in full.named_parameters()}
            seen[name]["tied"] = full.get_output_embeddings().weight is full.get_input_embeddings().weight
    # one rank's NaN advantage, then one rank's non-finite loss: the same error on both ranks,
    # then a step that works (the FSDP collectives stayed in step)
    model = _model()
    rows, _ = _rows(model)
    cfg = UpdateConfig(micro_batch_size=2)
    shard, opt = shard_learner(model, optimizer_spec(model, torch.optim.SGD(model.parameters(), lr=LR)))
    shards = shard_rows(rows, 2, ADV, cfg)
    mine = shards[rank]
    bad = next(i for i in shards[1] if TARGETS[i] >= 2 and ADV[i] != 0.0)
    for case, value in (("nan", math.nan), ("inf_loss", 3e38)):  # finite, but ≥ 2 targets × 3e38 overflow: loss = ±inf
        adv = [value if i == bad else a for i, a in enumerate(ADV)]
        try:
            fsdp_step(shard, opt, [rows[i] for i in mine], [adv[i] for i in mine], cfg, PAD, LP, row_ids=mine)
            seen[case] = {"raised": None}
        except NonFiniteError as e:
            seen[case] = {"raised": str(e), "tensor": e.tensor, "rows": e.rows, "bad": bad}
        grads_left = [p.grad for p in shard.parameters() if p.grad is not None]
        after = fsdp_step(shard, opt, [rows[i] for i in mine], [ADV[i] for i in mine], cfg, PAD, LP, row_ids=mine)
        seen[case] |= {"grads_left": len(grads_left), "after_ok": after["optimizer_stepped"]}
    torch.save(seen, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The 2-rank job's results (each rank's ``seen``); a hang ends at the join's timeout."""
    import torch.distributed as dist

    out = tmp_path_factory.mktemp("fsdp-job")
    store = dist.TCPStore("127.0.0.1", 0, 3, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_job, args=(r, store.port, str(out)), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0, 0], f"rank processes exited with {codes} (None: still running at the timeout, a hang)"
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _single(name: str) -> dict:
    """The same step in one process: gradient, metrics, ppo_step metrics, weights after it, and
    the tolerances' scales: Σ_rows |g_row| and Σ_rows |loss_row| (each row alone, with the
    step's totals)."""
    settings, lora, _, adv = CASES[name]
    model = _model(lora)
    rows, ref = _rows(model)
    cfg = UpdateConfig(**{**settings, "micro_batch_size": 16})
    kw = {"ref_logprobs": ref} if cfg.kl_coef else {}
    model.zero_grad(set_to_none=True)
    m = accumulate_gradients(model, rows, adv, cfg, PAD, LP, **kw)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    scale, loss_scale = _scales(model, rows, adv, cfg, ref if cfg.kl_coef else None)
    ms = ppo_step(model, torch.optim.SGD(_trainable(model), lr=LR), rows, adv, cfg, PAD, LP, **kw)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"grads": grads, "m": m, "ms": ms, "weights": weights, "scale": scale, "loss_scale": loss_scale}


def _scales(model, rows, adv, cfg: UpdateConfig, ref) -> tuple[dict[str, torch.Tensor], float]:
    """Σ_rows |g_row| per gradient entry and Σ_rows |loss_row|: each row's step alone, divided by
    the whole step's totals (``accumulate_gradients(totals=...)``)."""
    totals = (float(sum(TARGETS)), float(len(TARGETS)), float(max(TARGETS)))
    scale: dict[str, torch.Tensor] = {n: torch.zeros_like(p) for n, p in model.named_parameters() if p.requires_grad}
    loss = 0.0
    for i in range(len(rows)):
        model.zero_grad(set_to_none=True)
        rkw = {"ref_logprobs": [ref[i]]} if ref is not None else {}
        loss += abs(accumulate_gradients(model, [rows[i]], [adv[i]], cfg, PAD, LP, totals=totals, **rkw)["loss"])
        for n, p in model.named_parameters():
            if p.grad is not None:
                scale[n] += p.grad.abs()
    model.zero_grad(set_to_none=True)
    return scale, loss


def _same_metrics(got: dict, want: dict, single: dict) -> None:
    """Counts exact; token means (float64 sums of per-token float32 values that differ by kernel
    rounding, a few u) to 1e-6 ≈ 17u relative; the loss and the grad norm to their bounds."""
    assert set(got) == set(want)
    for k in want:
        if k == "loss":  # float32 sums of the positions' terms in two orders (the module doc's bound)
            assert abs(got[k] - want[k]) <= TOL_FACTOR * U * single["loss_scale"], k
        elif k == "grad_norm":  # |Δ‖g‖| ≤ ‖Δg‖ + the norm's own sum of N squares in another order
            dg = math.sqrt(sum(s.numel() * float(TOL_FACTOR * U * s.max()) ** 2 for s in single["scale"].values()))
            n = sum(s.numel() for s in single["scale"].values())
            assert abs(got[k] - want[k]) <= dg + 2 * n * U * want[k], k
        else:
            assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-12), k


def _within(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor, what: str) -> None:
    """|got − want| ≤ TOL_FACTOR · u · max(scale) over the tensor (the module doc's bound)."""
    err, bound = float((got - want).abs().max()), TOL_FACTOR * U * float(scale.max())
    assert err <= bound, f"{what}: {err} > {bound}"


def _weights_within(got: dict[str, torch.Tensor], single: dict) -> None:
    """After one SGD step w − lr·c·g (c = min(1, max_norm / ‖g‖), the clip factor): the gradients'
    bound times lr, plus lr·|g|·δc with δc ≤ 2·N·u (the norm's N squares summed in another
    order), plus the subtraction's rounding (u·|w| on each side)."""
    n = sum(s.numel() for s in single["scale"].values())
    for name, w in single["weights"].items():
        g = single["grads"].get(name, torch.zeros_like(w))
        s = single["scale"].get(name, torch.zeros_like(w))
        bound = LR * (TOL_FACTOR * U * s.max() + 2 * n * U * g.abs()) + 2 * U * w.abs()
        assert float(((got[name] - w).abs() - bound).max()) <= 0.0, name


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_fsdp_gives_the_single_process_gradient_metrics_and_weights(two_ranks, name):
    single = _single(name)
    grads = single["grads"]
    r0, r1 = two_ranks[0][name], two_ranks[1][name]
    assert sorted(r0["shard"] + r1["shard"]) == list(range(len(TARGETS)))
    assert sum(TARGETS[i] for i in r0["shard"]) != sum(TARGETS[i] for i in r1["shard"])  # uneven
    assert any(float(g.abs().sum()) > 0 for g in grads.values())
    for r in (r0, r1):
        assert set(r["grads"]) == set(grads)  # LoRA: the adapter's A and B only
        for n in grads:
            _within(r["grads"][n], grads[n], single["scale"][n], n)
        _same_metrics(r["metrics"], single["m"], single)
        _same_metrics(r["step_metrics"], single["ms"], single)
    assert r0["tied"]  # the gathered head is still the embedding matrix
    _weights_within(r0["weights"], single)


@pytest.mark.slow  # shares the 2-rank job
def test_a_rank_with_no_trainable_row_runs_idle_passes_and_the_step_is_the_single_processs(two_ranks):
    r0, r1 = two_ranks[0]["idle_rank"], two_ranks[1]["idle_rank"]
    assert r1["shard"] == [4, 5, 6] and all(IDLE_ADV[i] == 0.0 for i in r1["shard"])
    assert r0["metrics"]["n_rows_trained"] == 4.0 and r0["metrics"]["rows_skipped_zero_advantage"] == 3.0


@pytest.mark.slow  # shares the 2-rank job
def test_lora_trains_the_adapter_only_and_rank_0_gets_it(two_ranks):
    r0 = two_ranks[0]["lora"]
    assert r0["grads"] and all("lora_A" in n or "lora_B" in n for n in r0["grads"])
    start = dict(_model(lora=True).named_parameters())
    moved = {n for n, w in r0["weights"].items() if not torch.equal(w, start[n])}
    assert moved == set(r0["grads"])


@pytest.mark.slow  # shares the 2-rank job
@pytest.mark.parametrize("case,tensor", [("nan", "advantage"), ("inf_loss", "loss")])
def test_one_ranks_non_finite_value_stops_both_ranks_with_the_same_error(two_ranks, case, tensor):
    a, b = two_ranks[0][case], two_ranks[1][case]
    assert a["raised"] is not None and a["raised"] == b["raised"]
    assert a["tensor"] == b["tensor"] == tensor
    assert a["bad"] in a["rows"] and a["rows"] == b["rows"]  # rows named by their index in the whole step
    assert "found by update rank 1 of 2" in a["raised"]
    assert a["grads_left"] == b["grads_left"] == 0  # zeroed, no optimizer step
    assert a["after_ok"] == b["after_ok"] == 1.0  # the collectives stayed in step: the next step runs


# ---- the trainer's side: DataParallelUpdate(strategy="fsdp") ----------------------------------------
def _state_equal(a: dict, b: dict) -> bool:
    if a.keys() != b.keys() or a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    return all(
        s.keys() == b["state"][i].keys() and all(torch.equal(v, b["state"][i][k]) for k, v in s.items())
        for i, s in a["state"].items()
    )


@pytest.mark.slow  # starts a rank process twice
def test_the_optimizer_state_round_trip_of_a_resume_continues_as_without_one():
    """Save the shards' state through ``full_optimizer_state`` (the resume's optimizer.pt), load it
    into a new learner's optimizer (as ``load_learner_state`` does), continue: the same weights
    as the run that never stopped, bit for bit; and the state is the one-process optimizer's."""
    model = _model()
    rows, _ = _rows(model)
    cfg = UpdateConfig(micro_batch_size=2)
    one = copy.deepcopy(model)
    one_opt = torch.optim.AdamW(one.parameters(), lr=1e-3, weight_decay=0.0)
    ppo_step(one, one_opt, rows, ADV, UpdateConfig(micro_batch_size=16), PAD, LP)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    dp = DataParallelUpdate(2, timeout_s=60, threads_per_rank=1, strategy="fsdp")
    try:
        dp.ppo_step(model, opt, rows, ADV, cfg, PAD, LP)
        assert not opt.state  # rank 0's optimizer keeps the groups, the shards the state
        saved = copy.deepcopy(dp.full_optimizer_state(opt))
        at_save = copy.deepcopy(model.state_dict())
        for g in opt.param_groups:
            g["lr"] = 5e-4  # the schedule writes rank 0's groups; the shards follow
        dp.ppo_step(model, opt, rows, ADV, cfg, PAD, LP)
        after_two = {n: p.detach().clone() for n, p in model.named_parameters()}
        again = dp.full_optimizer_state(opt)
    finally:
        dp.close()
    want = one_opt.state_dict()  # the same format: indices, step count, the moments' shapes
    assert saved["param_groups"] == want["param_groups"] and saved["state"].keys() == want["state"].keys()
    single = _single("token_mean")  # the same model, rows and advantages: the gradient's bound
    names = [n for n, _ in one.named_parameters()]
    n_entries = sum(s.numel() for s in single["scale"].values())
    for i, s in want["state"].items():
        assert torch.equal(saved["state"][i]["step"], s["step"])
        # AdamW's first moment after one step: (1 − β1)·c·g, c the clip factor (_weights_within's bound)
        g, scale = single["grads"][names[i]], single["scale"][names[i]]
        bound = 0.1 * (TOL_FACTOR * U * scale.max() + 2 * n_entries * U * g.abs()) + U * s["exp_avg"].abs()
        assert bool(((saved["state"][i]["exp_avg"] - s["exp_avg"]).abs() <= bound).all()), names[i]
    resumed = _model()
    resumed.load_state_dict(at_save)
    r_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-3, weight_decay=0.0)
    r_opt.load_state_dict(saved)
    for g in r_opt.param_groups:
        g["lr"] = 5e-4
    dp = DataParallelUpdate(2, timeout_s=60, threads_per_rank=1, strategy="fsdp")
    try:
        dp.ppo_step(resumed, r_opt, rows, ADV, cfg, PAD, LP)  # the loaded state reaches the shards first
        assert not r_opt.state
        assert _state_equal(dp.full_optimizer_state(r_opt), again)
        for n, p in resumed.named_parameters():
            assert torch.equal(p, after_two[n]), n
        with torch.no_grad():  # weights changed outside a step (a resume into a started update) reach the shards
            for p in resumed.parameters():
                p.mul_(0.5)
        probe = copy.deepcopy(resumed)
        m = dp.ppo_step(resumed, r_opt, rows, ADV, cfg, PAD, LP)
    finally:
        dp.close()
    want_loss = accumulate_gradients(probe, rows, ADV, UpdateConfig(micro_batch_size=16), PAD, LP)["loss"]
    _, loss_scale = _scales(probe, rows, ADV, UpdateConfig(micro_batch_size=1), None)
    assert abs(m["loss"] - want_loss) <= TOL_FACTOR * U * loss_scale  # the unhalved weights: far off


@pytest.mark.slow
def test_a_torchrun_launch_serves_the_fsdp_update(tmp_path):
    """``torchrun --nproc-per-node 2``: rank 0 steps ``DataParallelUpdate(2, strategy="fsdp")``,
    rank 1 runs ``serve_update_rank`` (the shards' side of a torchrun launch); rank 0's weights
    after the step are the single process's (case ``token_mean``)."""
    script = tmp_path / "launch.py"
    script.write_text(
        "import os, sys, torch\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_fsdp import ADV, LP, LR, PAD, _model, _rows\n"
        "from consequence.update.data_parallel import DataParallelUpdate, serve_update_rank\n"
        "from consequence.update.step import UpdateConfig\n"
        "torch.set_num_threads(1)\n"
        "if os.environ['RANK'] != '0':\n"
        "    serve_update_rank(timeout_s=60)\n"
        "    sys.exit(0)\n"
        "model = _model()\n"
        "rows, _ = _rows(model)\n"
        "dp = DataParallelUpdate(2, timeout_s=60, strategy='fsdp')\n"
        "opt = torch.optim.SGD(model.parameters(), lr=LR)\n"
        "m = dp.ppo_step(model, opt, rows, ADV, UpdateConfig(micro_batch_size=2), PAD, LP)\n"
        "dp.close()\n"
        f"torch.save((m, dict(model.named_parameters())), {str(tmp_path / 'out.pt')!r})\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)  # a hang: TimeoutExpired
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    m, weights = torch.load(tmp_path / "out.pt", weights_only=False)
    single = _single("token_mean")
    _same_metrics(m, single["ms"], single)
    _weights_within({n: w.detach() for n, w in weights.items()}, single)


@pytest.mark.slow
def test_a_training_run_with_fsdp_samples_from_the_trained_weights_and_saves_a_full_optimizer_state(tmp_path):
    """``train --update-ranks 2 --update-strategy fsdp`` (spawned rank): every iteration's first
    step sees ratio 1 within the float32 sampler/trainer tolerance (``loop.checks.RATIO_TOL``),
    so rank 0 sampled from the weights the shards trained, gathered after each step; the resume
    state's optimizer.pt is a whole AdamW state that loads into the final policy's optimizer,
    its step count the optimizer steps taken."""
    import json

    from consequence.config import TrainConfig
    from consequence.distill.warmstart import BUNDLED
    from consequence.loop.checks import RATIO_TOL
    from consequence.loop.train import train
    from consequence.policy.tiny import load_policy

    run = tmp_path / "run"
    settings = dict(
        model=str(BUNDLED),
        env="env_fixtures:ParityEnvironment",  # mixed groups from the warm start: steps train
        iterations=2,
        tasks_per_iteration=1,
        group_size=4,
        final_eval_episodes=0,
        eval_every=0,
        max_turns=1,
        max_new_tokens=24,
        micro_batch_size=1,
        learning_rate=3e-3,
        skip_checks=True,
        checkpoint_every=1,
    )
    train(TrainConfig(**settings, run_dir=str(run), update_ranks=2, update_strategy="fsdp"))
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    taken = sum(m["optimizer_steps_taken"] for m in lines)
    assert taken >= 1 and not mp.active_children()  # it trained; the rank process is gone with the run
    for m in lines:
        if m["optimizer_steps_taken"]:
            assert math.exp(-RATIO_TOL) <= m["first_step_ratio_min"] <= m["first_step_ratio_max"] <= math.exp(RATIO_TOL)
    final = load_policy(run / "checkpoints" / "final")[0]
    assert any(not torch.equal(p, q) for p, q in zip(final.parameters(), load_policy(BUNDLED)[0].parameters()))
    saved = torch.load(run / "checkpoints" / "state-0002" / "optimizer.pt", weights_only=True)
    opt = torch.optim.AdamW(final.parameters(), lr=3e-3, weight_decay=0.0)
    opt.load_state_dict(saved)
    params = list(final.parameters())
    assert saved["state"] and {float(s["step"]) for s in saved["state"].values()} == {taken}
    assert all(s["exp_avg"].shape == params[i].shape for i, s in saved["state"].items())


# ---- refusals ---------------------------------------------------------------------------------------
def test_settings_fsdp_cannot_run_are_refused_with_the_reason():
    from consequence.config import TrainConfig

    with pytest.raises(
        ValueError, match="--update-strategy has no effect with --update-ranks 1.*drop --update-strategy"
    ):
        TrainConfig(update_strategy="fsdp")
    with pytest.raises(ValueError, match="--update-ranks 2 with --advantage gae is not supported"):
        TrainConfig(update_ranks=2, update_strategy="fsdp", advantage="gae")
    with pytest.raises(ValueError, match="with a teacher .* is not supported"):
        TrainConfig(update_ranks=2, update_strategy="fsdp", distill_loss="jsd", teacher="/models/t")
    assert TrainConfig(update_ranks=2, update_strategy="fsdp").update_strategy == "fsdp"
    with pytest.raises(ValueError, match="unknown update strategy 'zero'; valid: ddp, fsdp"):
        DataParallelUpdate(2, strategy="zero")
    dp = DataParallelUpdate(2, strategy="fsdp")
    with pytest.raises(ValueError, match="holds no teacher"):
        dp.ppo_step(_model(), None, [], [], UpdateConfig(distill_loss="jsd"), PAD, LP)
    dp.close()

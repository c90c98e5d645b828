"""--dtype bfloat16 (docs/devices.md): mixed precision keeps float32 master weights, gradients
and AdamW state; an update step's loss stays within the derived tolerance of float32's;
gradient checkpointing gives the same step; the ratio check's tolerance and message follow
the dtype; the first-step warning too; and one iteration of `consequence train` runs in
bfloat16 on the CPU. The CUDA test is marked ``gpu`` and skips without CUDA."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from typer.testing import CliRunner

from cli_args import TINY_NO_EVAL
from consequence.config import TrainConfig
from consequence.distill.warmstart import BUNDLED
from consequence.loop.checks import RATIO_TOL, CheckResult, check_ratio, logit_scale
from consequence.loop.diagnostics import FIRST_STEP_RATIO_TOL, first_step_ratio_tol, warnings_for
from consequence.loop.learner import logprob_fn, needs_recompute, recompute_is_old
from consequence.policy.device import UNIT_ROUNDOFF, logprob_tolerance, resolve_device
from consequence.policy.logprobs import enable_gradient_checkpointing
from consequence.policy.tiny import load_policy
from consequence.records import TrainingRow
from consequence.update.step import UpdateConfig, accumulate_gradients, compute_logprobs, ppo_step
from tiny_lm import PAD, TinyLM, make_rows, ref_logprobs

U = UNIT_ROUNDOFF["bfloat16"]
CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device: torch.cuda.is_available() is False"
)


@pytest.fixture(scope="module")
def tiny():
    """The bundled policy (Llama layout, 768 ids) and 4 rows of its own token ids whose
    old log-probs are its float32 log-probs (on-policy: ρ = 1 in float32)."""
    model, tok = load_policy(BUNDLED)
    g = torch.Generator().manual_seed(0)
    rows = []
    for i, n in enumerate((14, 20, 9, 17)):
        ids = torch.randint(3, len(tok), (4 + n,), generator=g).tolist()
        rows.append(TrainingRow(ids, [0] * 4 + [1] * n, [0.0] * (4 + n), traj_index=i))
    fn = logprob_fn(TrainConfig())
    old = compute_logprobs(model, rows, tok.pad_token_id, fn)
    rows = [TrainingRow(r.input_ids, r.loss_mask, lp, traj_index=r.traj_index) for r, lp in zip(rows, old)]
    return model, tok.pad_token_id, rows, fn


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_bfloat16_step_stays_within_the_derived_tolerance_of_the_float32_step(tiny):
    """Against float32 log-probs as π_old the float32 step has ρ = 1; in bfloat16 each log-prob
    moves by at most 6uZ (policy.device.logprob_tolerance: half of it, one bfloat16
    computation), so every ρ lies in [e^(−6uZ), e^(6uZ)] and the token-mean loss −mean(A·ρ)
    (clipped or not) differs from the float32 loss by at most max|A|·(e^(6uZ) − 1)."""
    model, pad, rows, fn = tiny
    adv = [1.0, -1.0, 0.5, -0.5]
    out = {}
    for dtype in ("float32", "bfloat16"):
        m = copy.deepcopy(model)
        cfg = UpdateConfig(micro_batch_size=2, dtype=dtype)
        out[dtype] = (accumulate_gradients(m, rows, adv, cfg, pad, fn), _grads(m))
        assert all(g.dtype == torch.float32 for g in out[dtype][1].values())  # float32 gradients
    z = logit_scale(model, rows, pad, "bfloat16")
    bound = max(abs(a) for a in adv) * math.expm1(logprob_tolerance("bfloat16", z) / 2)
    f32, b16 = out["float32"][0], out["bfloat16"][0]
    assert f32["ratio_min"] == pytest.approx(1.0, abs=1e-5) and f32["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert 0.0 < abs(b16["loss"] - f32["loss"]) <= bound  # bfloat16 really ran, within the bound
    assert math.exp(-6 * U * z) <= b16["ratio_min"] < 1.0 < b16["ratio_max"] <= math.exp(6 * U * z)
    g16 = out["bfloat16"][1]
    assert g16.keys() == out["float32"][1].keys() and all(torch.isfinite(g).all() for g in g16.values())


def test_bfloat16_keeps_parameters_and_adamw_state_in_float32(tiny):
    model, pad, rows, fn = tiny
    m = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0)
    cfg = UpdateConfig(micro_batch_size=2, dtype="bfloat16")
    metrics = ppo_step(m, opt, rows, [1.0, -1.0, 0.5, -0.5], cfg, pad, fn)
    assert metrics["optimizer_stepped"] == 1.0
    assert all(p.dtype == torch.float32 for p in m.parameters())
    moved = [n for n, p in m.named_parameters() if not torch.equal(p, before[n])]
    assert moved  # the step was taken (on master weights in float32)
    state = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
    assert state and all(v.dtype == torch.float32 for v in state)  # exp_avg, exp_avg_sq
    assert not torch.is_autocast_enabled("cpu")  # the step leaves no autocast behind


def test_gradient_checkpointing_under_bfloat16_gives_the_same_step(tiny):
    """The recomputation in the backward pass runs under the same autocast state, so the
    loss and gradients are those of the run without checkpointing, bit for bit (on the CPU)."""
    model, pad, rows, fn = tiny
    cfg = UpdateConfig(micro_batch_size=2, dtype="bfloat16")
    plain, ckpt = copy.deepcopy(model), copy.deepcopy(model)
    enable_gradient_checkpointing(ckpt)
    plain.train()  # the same mode (no dropout in this model)
    a = accumulate_gradients(plain, rows, [1.0, -1.0, 0.5, -0.5], cfg, pad, fn)
    b = accumulate_gradients(ckpt, rows, [1.0, -1.0, 0.5, -0.5], cfg, pad, fn)
    assert a["loss"] == b["loss"]
    ga, gb = _grads(plain), _grads(ckpt)
    assert ga.keys() == gb.keys() and all(torch.equal(ga[n], gb[n]) for n in ga)


def _shifted(rows, by: float):
    """Rows whose recorded log-probs are ``by`` nats above the model's on every target."""
    return [
        TrainingRow(
            r.input_ids,
            r.loss_mask,
            [x + by if m else x for x, m in zip(r.old_logprobs, r.loss_mask)],
            traj_index=r.traj_index,
        )
        for r in rows
    ]


def test_the_ratio_checks_tolerance_and_message_follow_the_dtype():
    model = TinyLM()
    rows = make_rows(model, [3, 5, 2])
    z = logit_scale(model, rows, PAD, "bfloat16")
    tol = logprob_tolerance("bfloat16", z)
    assert tol == pytest.approx(12 * U * z) and tol > 10 * RATIO_TOL
    f32 = check_ratio(model, rows, PAD, ref_logprobs, 1.0)
    assert f32.passed and f32.tolerance == RATIO_TOL and "(tolerance 0.001, float32)" in f32.detail
    b16 = check_ratio(model, rows, PAD, ref_logprobs, 1.0, dtype="bfloat16")
    assert b16.passed and b16.tolerance == pytest.approx(tol)
    assert f"(tolerance {tol:.3g}, bfloat16: 12 × u 0.0039 × max|logit| {z:.3g})" in b16.detail
    # a gap of uZ: within bfloat16's 12uZ (its own rounding adds at most 6uZ), beyond float32's 1e-3
    near = _shifted(rows, U * z)
    assert check_ratio(model, near, PAD, ref_logprobs, 1.0, dtype="bfloat16").passed
    assert check_ratio(model, near, PAD, ref_logprobs, 1.0).passed is False
    # negative control: beyond 12uZ + 6uZ no rounding explains it, and bfloat16 fails too
    far = check_ratio(model, _shifted(rows, 19 * U * z), PAD, ref_logprobs, 1.0, dtype="bfloat16")
    assert far.passed is False and "bfloat16" in far.detail and "the trainer does not see" in far.detail
    # an explicit tolerance is used as given
    assert check_ratio(model, near, PAD, ref_logprobs, 1.0, tol=1e-6, dtype="bfloat16").passed is False
    # the manifest keeps the ratio check's tolerance (the first-step warning reads it), no other's
    assert f32.as_dict()["tolerance"] == RATIO_TOL
    assert "tolerance" not in CheckResult("groups", True, "2 groups").as_dict()


def test_the_bfloat16_ratio_check_still_catches_a_sampler_at_another_temperature(tiny):
    """12uZ is looser than float32's 1e-3 but not blind: rows recorded at T = 0.7 and checked
    at T = 1 (a sampler that does not match the config) fail in bfloat16 too."""
    model, pad, rows, fn = tiny
    hot = compute_logprobs(model, rows, pad, fn, temperature=0.7)
    hot_rows = [TrainingRow(r.input_ids, r.loss_mask, lp, traj_index=r.traj_index) for r, lp in zip(rows, hot)]
    assert check_ratio(model, rows, pad, fn, 1.0, dtype="bfloat16").passed
    assert check_ratio(model, hot_rows, pad, fn, 1.0, dtype="bfloat16").passed is False
    assert check_ratio(model, hot_rows, pad, fn, 0.7, dtype="bfloat16").passed


def test_the_first_step_warning_follows_the_dtype():
    f32 = {"config": {"dtype": "float32"}}
    b16 = {"config": {"dtype": "bfloat16"}, "checks": {"results": [{"name": "ratio", "tolerance": 0.3}]}}
    unchecked = {"config": {"dtype": "bfloat16"}, "checks": {"results": None}}
    assert first_step_ratio_tol({}) == first_step_ratio_tol(f32) == FIRST_STEP_RATIO_TOL  # runs before --dtype
    assert first_step_ratio_tol(b16) == pytest.approx(math.expm1(0.3))
    assert first_step_ratio_tol(unchecked) == math.inf
    history = [{"first_step_ratio_min": 0.96, "first_step_ratio_max": 1.05}]
    assert any("ratio far from 1" in w for w in warnings_for(history, first_step_ratio_tol(f32)))
    assert warnings_for(history, first_step_ratio_tol(b16)) == []
    wild = [{"first_step_ratio_min": 0.5, "first_step_ratio_max": 1.6}]  # beyond e^0.3 − 1: still warned
    assert any("ratio far from 1" in w for w in warnings_for(wild, first_step_ratio_tol(b16)))


def test_bfloat16_recomputes_pi_old_before_the_first_step():
    assert not needs_recompute(TrainConfig()) and not recompute_is_old(TrainConfig())
    cfg = TrainConfig(dtype="bfloat16")
    assert needs_recompute(cfg) and recompute_is_old(cfg)
    assert needs_recompute(TrainConfig(tis_cap=2.0)) and recompute_is_old(TrainConfig(tis_cap=2.0))


def _train_bfloat16(run, device: str, iterations: int):
    """``consequence train`` of the tiny model in bfloat16 on ``device``, ``iterations`` of them; its run folder."""
    from consequence.cli import app
    from reward_signal import ODD_SAMPLES_WIN

    args = [*TINY_NO_EVAL, "--max-turns", "1", "--max-new-tokens", "8", "--env", ODD_SAMPLES_WIN]
    args[args.index("--iterations") + 1] = str(iterations)
    res = CliRunner().invoke(
        app,
        ["train", *args, "--model", str(BUNDLED), "--run-dir", str(run), "--dtype", "bfloat16", "--device", device],
        env={"COLUMNS": "250"},
    )
    assert res.exit_code == 0, res.output
    return run


@pytest.mark.slow  # a real training run
def test_one_iteration_of_train_in_bfloat16_on_the_cpu(tmp_path):
    run = _train_bfloat16(tmp_path / "run", "auto", iterations=1)
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["devices"] == {"policy": str(resolve_device("auto")), "dtype": "bfloat16"}
    assert manifest["config"]["dtype"] == "bfloat16" and manifest["config"]["device"] == "auto"
    ratio = next(c for c in manifest["checks"]["results"] if c["name"] == "ratio")
    assert ratio["passed"] and "bfloat16: 12 × u" in ratio["detail"] and ratio["tolerance"] > RATIO_TOL
    [m] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert m["n_rows_trained"] > 0 and math.isfinite(m["loss"])  # the bfloat16 update trained
    assert m["sampler_trainer_kl"] >= 0  # π_old recomputed by the trainer, its gap to the sampler measured
    assert not any("ratio far from 1" in w for w in m["warnings"])


@pytest.mark.gpu
@CUDA
def test_one_iteration_on_cuda_in_bfloat16_then_resumed_on_the_cpu(tmp_path):
    """On CUDA: a bfloat16 iteration with its checks, a teacher on the CPU beside a CUDA policy
    is not needed here; the run's state (saved from CUDA tensors) resumes on the CPU."""
    run = _train_bfloat16(tmp_path / "run", "cuda", iterations=2)
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["devices"]["policy"] == "cuda:0" and "cuda:0" in manifest["devices"]["cuda"]
    assert all(c["passed"] is not False for c in manifest["checks"]["results"])
    # resume the finished run's last state on the CPU: a state from CUDA opens on any device
    from consequence.loop.learner import make_learner
    from consequence.loop.resume import latest_state, load_learner_state

    state = latest_state(run)
    model = load_policy(state.path / "policy")[0]
    learner = make_learner(TrainConfig(dtype="bfloat16"), model)
    load_learner_state(state, learner)
    assert all(v.device.type == "cpu" for s in learner.optimizer.state.values() for k, v in s.items() if k != "step")

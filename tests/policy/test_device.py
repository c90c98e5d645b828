"""--device / --teacher-device / --dtype (docs/devices.md): a device is resolved, or refused
before any model loads with a one-line message; the precision helper; the log-prob tolerance
derived from the precision's unit roundoff; the sampler under bfloat16. The CUDA tests are
marked ``gpu`` and skip (with the reason) where torch sees no CUDA device."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from consequence.cli import app
from consequence.config import TrainConfig
from consequence.distill.warmstart import BUNDLED
from consequence.policy.device import (
    FLOAT32_LOGPROB_TOL,
    TOLERANCE_UNITS,
    UNIT_ROUNDOFF,
    logprob_tolerance,
    precision,
    resolve_device,
)
from consequence.policy.sampler import SamplingParams, draw, generate

CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device: torch.cuda.is_available() is False"
)
ENV = {"COLUMNS": "250"}


# ---- resolution and refusal ---------------------------------------------------------------------
@pytest.fixture
def no_accelerator(monkeypatch):
    """A machine with neither CUDA nor MPS (whatever this one has), and a CPU-only torch build."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)


@pytest.fixture
def one_gpu(monkeypatch):
    """A machine whose torch sees one CUDA device (cuda:0, the current one)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_cpu_and_auto_without_an_accelerator_resolve_to_the_cpu(no_accelerator):
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" AUTO ") == torch.device("cpu")


def test_auto_takes_cuda_then_mps(monkeypatch, one_gpu):
    assert resolve_device("auto") == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("mps")


def test_cuda_is_refused_on_a_cpu_only_torch_build(no_accelerator):
    for spec in ("cuda", "cuda:0", "cuda:3"):
        with pytest.raises(ValueError) as e:
            resolve_device(spec)
        msg = str(e.value)
        assert msg.startswith(f"--device {spec}: torch.cuda.is_available() is False: this torch build")
        assert "is CPU-only" in msg and "use --device cpu" in msg and "\n" not in msg


def test_cuda_is_refused_where_a_cuda_build_sees_no_device(monkeypatch, no_accelerator):
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(
        ValueError, match=r"built for CUDA 12\.4, but it sees no CUDA device \(CUDA_VISIBLE_DEVICES=''\)"
    ):
        resolve_device("cuda", "--teacher-device")


def test_a_cuda_index_beyond_the_machines_devices_is_refused(one_gpu):
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ValueError) as e:
        resolve_device("cuda:3", "--teacher-device")
    assert str(e.value) == (
        "--teacher-device cuda:3: this machine has 1 CUDA device (cuda:0); give one of them, or "
        "--teacher-device cuda for the current one"
    )


def test_mps_is_refused_where_it_is_not_available(no_accelerator):
    with pytest.raises(
        ValueError, match=r"^--device mps: torch.backends.mps.is_available\(\) is False: this torch build"
    ):
        resolve_device("mps")


def test_a_malformed_device_is_refused_by_the_config_and_by_the_resolver():
    for bad in ("gpu", "cuda:", "cuda:01", "cuda:-1", "cuda0", "tpu", ""):
        with pytest.raises(ValueError, match=r"device \(--device\): not a device: give auto, cpu, cuda, cuda:N"):
            TrainConfig.checked(device=bad)
        with pytest.raises(ValueError, match="not a device"):
            resolve_device(bad)
    with pytest.raises(ValueError, match=r"teacher_device \(--teacher-device\): not a device"):
        TrainConfig.checked(teacher_device="gpu")
    cfg = TrainConfig(device="CUDA:1")  # spelling only: whether the machine has it is checked before loading
    assert cfg.device == "cuda:1" and cfg.dtype == "float32" and TrainConfig().device == "cpu"


def test_teacher_device_without_a_teacher_and_devices_with_update_ranks_are_refused():
    with pytest.raises(ValueError, match="--teacher-device is read only by distillation"):
        TrainConfig.checked(teacher_device="cpu")
    with pytest.raises(ValueError, match=r"--update-ranks 2 with --device cuda is not supported"):
        TrainConfig.checked(update_ranks=2, device="cuda")
    with pytest.raises(ValueError, match=r"--update-ranks 2 with --dtype bfloat16 is not supported"):
        TrainConfig.checked(update_ranks=2, dtype="bfloat16")
    with pytest.raises(ValueError, match=r"dtype \(--dtype\)"):
        TrainConfig.checked(dtype="float16")


def _one_line_error(res, start: str) -> None:
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert text.startswith(f"error: {start}"), text
    assert "Traceback" not in res.output and (res.exception is None or isinstance(res.exception, SystemExit))


@pytest.mark.slow  # the CLI's first invocations
def test_the_commands_refuse_a_missing_device_before_loading_anything(no_accelerator, tmp_path):
    run = tmp_path / "run"
    train = CliRunner().invoke(app, ["train", "--device", "cuda:0", "--run-dir", str(run)], env=ENV)
    _one_line_error(train, "--device cuda:0: torch.cuda.is_available() is False: this torch build")
    assert not run.exists()  # refused before the run folder was made
    teacher = ["--advantage", "reverse_kl", "--teacher", str(BUNDLED), "--teacher-device", "mps", "--group-size", "1"]
    res = CliRunner().invoke(app, ["train", *teacher, "--run-dir", str(run)], env=ENV)
    _one_line_error(res, "--teacher-device mps: torch.backends.mps.is_available() is False")
    out = tmp_path / "eval"
    res = CliRunner().invoke(app, ["eval", "--device", "cuda", "--out", str(out)], env=ENV)
    _one_line_error(res, "--device cuda: torch.cuda.is_available() is False")
    assert not out.exists()
    res = CliRunner().invoke(app, ["compare", str(BUNDLED), str(BUNDLED), "--device", "auto:1"], env=ENV)
    _one_line_error(res, "--device 'auto:1': not a device")
    res = CliRunner().invoke(app, ["sft", "--model", str(BUNDLED), "--out", str(tmp_path / "sft"), "--device", "cuda"])
    _one_line_error(res, "--device cuda: torch.cuda.is_available() is False")
    # the same settings on the CPU pass this check (print-config loads nothing)
    ok = CliRunner().invoke(app, ["train", "--device", "cpu", "--dtype", "bfloat16", "--print-config"], env=ENV)
    assert ok.exit_code == 0 and "device: cpu" in ok.output and "dtype: bfloat16" in ok.output


def test_resume_may_move_the_device_but_not_the_dtype(tmp_path):
    from consequence.loop.resume import resume_config

    run = tmp_path / "run"
    run.mkdir()
    saved = TrainConfig(run_dir=str(run), device="cuda:1", dtype="bfloat16")
    (run / "config.yaml").write_text(yaml.safe_dump(saved.nested_dump()))
    assert resume_config(run, {}, None).device == "cuda:1"  # a saved config is read on any machine
    assert resume_config(run, {"device": "cpu"}, None).device == "cpu"
    with pytest.raises(ValueError, match=r"--dtype 'float32' \(the run has 'bfloat16'\)"):
        resume_config(run, {"dtype": "float32"}, None)


# ---- precision and tolerance --------------------------------------------------------------------
def test_precision_is_autocast_for_bfloat16_and_nothing_for_float32():
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with precision("float32", "cpu"):
        assert (a @ b).dtype == torch.float32
    with precision("bfloat16", torch.device("cpu")):
        assert (a @ b).dtype == torch.bfloat16
        assert torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(ValueError, match="dtype 'float16'"):
        precision("float16", "cpu")


def test_logprob_tolerance_is_four_unit_roundoffs_times_the_logit_scale():
    assert UNIT_ROUNDOFF == {"float32": 2.0**-24, "bfloat16": 2.0**-8}
    # bfloat16: 12 u Z (policy.device.logprob_tolerance: 3 roundings at the head, 2 through the
    # log-softmax, 2 computations: the sampler's and the trainer's)
    assert TOLERANCE_UNITS == 12 and logprob_tolerance("bfloat16", 20.0) == pytest.approx(12 * 20.0 / 256)
    assert logprob_tolerance("bfloat16", 0.0) == FLOAT32_LOGPROB_TOL  # the floor
    # float32: 12 · 2^-24 · Z is below the 1e-3 floor for any Z below 1,300 (the check as before)
    assert logprob_tolerance("float32", 46.0) == FLOAT32_LOGPROB_TOL == 1e-3
    assert logprob_tolerance("float32", 5000.0) == pytest.approx(12 * 5000.0 * 2.0**-24)
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            logprob_tolerance("bfloat16", bad)
    with pytest.raises(ValueError):
        logprob_tolerance("float16", 1.0)


def test_one_bfloat16_log_softmax_stays_within_two_unit_roundoffs_of_the_logit_scale():
    """The derivation's log-softmax step for one rounding, on logits rounded to bfloat16 (the
    LM head's output): |δ log p_y| <= 2uZ for every token of a 768-token vocabulary; and the
    rounding is real (a bound that a no-op would meet trivially is no test)."""
    g = torch.Generator().manual_seed(0)
    z = 8.0 * torch.randn(64, 768, generator=g, dtype=torch.float64)
    exact = torch.log_softmax(z, -1)
    rounded = torch.log_softmax(z.to(torch.bfloat16).double(), -1)
    worst = float((rounded - exact).abs().max())
    Z = float(z.abs().max())
    assert 0 < worst <= 2 * UNIT_ROUNDOFF["bfloat16"] * Z
    assert worst <= logprob_tolerance("bfloat16", Z) / (2 * 3)  # one of the 3 roundings, one of 2 computations


# ---- the sampler under bfloat16 -----------------------------------------------------------------
@pytest.mark.slow  # bfloat16 autocast on a CPU runs its matrix products slowly
def test_the_sampler_under_bfloat16_samples_and_its_log_probs_are_the_trainers_within_tolerance():
    from consequence.loop.checks import logit_scale
    from consequence.loop.learner import logprob_fn
    from consequence.policy.tiny import load_policy
    from consequence.records import TrainingRow
    from consequence.update.step import compute_logprobs

    model, tok = load_policy(BUNDLED)
    prompts = [tok.encode("def find_max(xs):\n    best = 0")] * 3 + [tok.encode("2/5 passed")] * 3
    gens = [torch.Generator().manual_seed(s) for s in range(len(prompts))]
    params = SamplingParams(1.0, 0, 1.0, 12, dtype="bfloat16")
    samples = generate(model, prompts, params, [], gens)
    assert all(len(s.output_ids) == 12 and all(math.isfinite(x) for x in s.logprobs) for s in samples)
    rows = [
        TrainingRow(p + s.output_ids, [0] * len(p) + [1] * 12, [0.0] * len(p) + s.logprobs, traj_index=i)
        for i, (p, s) in enumerate(zip(prompts, samples))
    ]
    fn = logprob_fn(TrainConfig())
    tol = logprob_tolerance("bfloat16", logit_scale(model, rows, 0, "bfloat16"))
    for dtype, bound in (("bfloat16", tol), ("float32", tol)):  # the float32 trainer: one bf16 side only
        lp = compute_logprobs(model, rows, 0, fn, dtype=dtype)
        gaps = [abs(a - b) for r, row_lp in zip(rows, lp) for a, b, m in zip(row_lp, r.old_logprobs, r.loss_mask) if m]
        assert 0 < max(gaps) <= bound, (dtype, max(gaps), bound)
    # float32 sampling is the trainer's float32 computation to float32 rounding (the check's 1e-3)
    f32 = generate(
        model, prompts, SamplingParams(1.0, 0, 1.0, 12), [], [torch.Generator().manual_seed(s) for s in range(6)]
    )
    rows32 = [
        TrainingRow(p + s.output_ids, [0] * len(p) + [1] * 12, [0.0] * len(p) + s.logprobs, traj_index=i)
        for i, (p, s) in enumerate(zip(prompts, f32))
    ]
    lp32 = compute_logprobs(model, rows32, 0, fn)
    assert max(abs(a - b) for r, x in zip(rows32, lp32) for a, b, m in zip(x, r.old_logprobs, r.loss_mask) if m) < 1e-4


def test_draw_with_one_generator_is_unchanged_on_the_cpu():
    """A CPU generator for CPU probabilities keeps torch.multinomial's draws (the default runs'
    numbers); the inverse-CDF path is taken only for probabilities on another device."""
    p = torch.softmax(torch.randn(5, 40, generator=torch.Generator().manual_seed(1)), -1)
    a = draw(p, torch.Generator().manual_seed(3))
    b = torch.multinomial(p, 1, generator=torch.Generator().manual_seed(3)).squeeze(-1)
    assert torch.equal(a, b)


# ---- CUDA (skipped without it) ------------------------------------------------------------------
@pytest.mark.gpu
@CUDA
def test_cuda_sampling_with_cpu_generators_and_the_prefix_cache():
    """On CUDA: one CPU generator for the batch (the training rollouts' and the endpoint's) and
    one per row (evaluation) both drive the sampler; the prefix cache's turns run on the device;
    the log-probs are the trainer's on the same device to float32 rounding."""
    from consequence.loop.learner import logprob_fn
    from consequence.policy.prefix_cache import PrefixCache, generate_with_prefix
    from consequence.policy.tiny import load_policy
    from consequence.records import TrainingRow
    from consequence.update.step import compute_logprobs

    model, tok = load_policy(BUNDLED)
    model.to(resolve_device("cuda"))
    prompts = [tok.encode("def find_max(xs):")] * 2 + [tok.encode("2/5 passed")] * 2
    params = SamplingParams(1.0, 0, 1.0, 10)
    one = generate(model, prompts, params, [], torch.Generator().manual_seed(0))
    rows_gens = generate(model, prompts, params, [], [torch.Generator().manual_seed(s) for s in range(4)])
    cache = PrefixCache()
    first = generate_with_prefix(model, prompts, list(range(4)), params, [], cache, torch.Generator().manual_seed(1))
    again = [p + s.output_ids + tok.encode(" ok") for p, s in zip(prompts, first)]
    second = generate_with_prefix(model, again, list(range(4)), params, [], cache, torch.Generator().manual_seed(2))
    assert cache.reused_tokens > 0
    fn = logprob_fn(TrainConfig())
    for prompt_set, samples in ((prompts, one), (prompts, rows_gens), (again, second)):
        rows = [
            TrainingRow(
                p + s.output_ids, [0] * len(p) + [1] * len(s.output_ids), [0.0] * len(p) + s.logprobs, traj_index=i
            )
            for i, (p, s) in enumerate(zip(prompt_set, samples))
        ]
        lp = compute_logprobs(model, rows, 0, fn)
        gap = max(abs(a - b) for r, x in zip(rows, lp) for a, b, m in zip(x, r.old_logprobs, r.loss_mask) if m)
        assert gap < FLOAT32_LOGPROB_TOL, gap


@pytest.mark.gpu
@CUDA
def test_cuda_update_steps_match_the_cpu_and_a_teacher_may_sit_on_the_cpu():
    """An update step on CUDA in float32 gives the CPU's loss to float32 rounding (bounded via
    the check's 1e-3 nats per log-prob: |Δloss| <= max|A|·(e^0.001 − 1)); in bfloat16 the
    parameters and AdamW state stay float32 on the device; a GKD step with the teacher on the
    CPU and the policy on CUDA runs (rows go to the teacher, its logits come back)."""
    import copy

    from consequence.loop.learner import logprob_fn
    from consequence.policy.tiny import load_policy
    from consequence.records import TrainingRow
    from consequence.update.step import UpdateConfig, compute_logprobs, ppo_step

    cpu_model, tok = load_policy(BUNDLED)
    pad, fn = tok.pad_token_id, logprob_fn(TrainConfig())
    g = torch.Generator().manual_seed(0)
    rows = []
    for i, n in enumerate((12, 18, 7)):
        ids = torch.randint(3, len(tok), (4 + n,), generator=g).tolist()
        rows.append(TrainingRow(ids, [0] * 4 + [1] * n, [0.0] * (4 + n), traj_index=i))
    old = compute_logprobs(cpu_model, rows, pad, fn)
    rows = [TrainingRow(r.input_ids, r.loss_mask, lp, traj_index=r.traj_index) for r, lp in zip(rows, old)]
    adv = [1.0, -1.0, 0.5]
    dev = resolve_device("cuda")
    losses = {}
    for where in ("cpu", "cuda"):
        m = copy.deepcopy(cpu_model).to(dev if where == "cuda" else "cpu")
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        losses[where] = ppo_step(m, opt, rows, adv, UpdateConfig(micro_batch_size=2), pad, fn)["loss"]
    assert abs(losses["cuda"] - losses["cpu"]) <= max(map(abs, adv)) * math.expm1(FLOAT32_LOGPROB_TOL)
    m = copy.deepcopy(cpu_model).to(dev)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    bf16 = ppo_step(m, opt, rows, adv, UpdateConfig(micro_batch_size=2, dtype="bfloat16"), pad, fn)
    assert math.isfinite(bf16["loss"]) and bf16["optimizer_stepped"] == 1.0
    assert all(p.dtype == torch.float32 and p.device == dev for p in m.parameters())
    assert all(v.dtype == torch.float32 for s in opt.state.values() for k, v in s.items() if k != "step")
    teacher = copy.deepcopy(cpu_model).eval().requires_grad_(False)  # on the CPU
    gkd = UpdateConfig(micro_batch_size=2, dtype="bfloat16", distill_loss="forward", pg_coef=0.0)
    out = ppo_step(m, opt, rows, adv, gkd, pad, fn, teacher=teacher)
    assert math.isfinite(out["distill_divergence"]) and out["distill_divergence"] >= 0
    lists = compute_logprobs(teacher, rows, pad, fn, dtype="bfloat16")  # reverse_kl's teacher pass, on its device
    assert [len(x) for x in lists] == [len(r.input_ids) for r in rows]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux's /proc/self/status")
def test_peak_rss_is_the_processes_high_water_mark_in_gib():
    """``peak_rss_gib`` is the kernel's high-water mark in GiB, and it rises past a tensor
    this process holds: after touching 256 MiB, the peak is at least the resident set before
    plus 256 MiB (less 16 MiB for pages the kernel may have reclaimed meanwhile)."""
    from consequence.policy.device import peak_memory_gib

    def status_gib(field: str) -> float:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
        return int(line.split()[1]) / 2**20  # kB

    rss0 = status_gib("VmRSS")
    held = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MiB, every page written
    before = status_gib("VmHWM")
    got = peak_memory_gib("cpu")
    after = status_gib("VmHWM")
    assert set(got) == {"peak_rss_gib"}  # no device_peak_gib off CUDA
    assert before <= got["peak_rss_gib"] <= after
    assert got["peak_rss_gib"] >= rss0 + (256 - 16) / 1024
    del held

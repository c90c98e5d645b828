"""Learning-rate schedules (update box, ``update/schedule.py``): the factor by hand, one scheduler
step per optimizer step taken (epochs × mini-batches, skipped steps), the rank processes of
``--update-ranks`` on rank 0's learning rate, the metric ``lr``, resume mid-warm-up to the last
bit, and the settings refused."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch
from rich.console import Console

from consequence.config import TrainConfig
from consequence.loop.learner import Batch, make_learner, update
from consequence.update.schedule import lr_factor, make_scheduler
from reward_signal import ODD_SAMPLES_WIN
from tiny_lm import PAD, TinyLM, make_rows

# lr_factor takes at most 5 float operations on values in [0, 1]; each rounds by at most half
# an ulp of 1 (1.1e-16), so a hand value written in decimals is met to 1e-15.
ULPS = 1e-15


# ---- the factor -------------------------------------------------------------------------------
def test_cosine_with_warm_up_by_hand():
    f = functools.partial(lr_factor, total_steps=10, warmup_steps=2, schedule="cosine")
    assert f(0, min_ratio=0.0) == 0.0  # warm-up starts at 0 (Hugging Face's convention)
    assert f(1, min_ratio=0.0) == 0.5
    assert f(2, min_ratio=0.0) == 1.0  # the peak, at the end of the warm-up
    assert f(6, min_ratio=0.0) == pytest.approx(0.5, abs=ULPS)  # ½(1 + cos(π·4/8))
    assert f(4, min_ratio=0.0) == pytest.approx(0.5 * (1 + math.sqrt(0.5)), abs=ULPS)  # ½(1 + cos(π/4))
    assert f(10, min_ratio=0.0) == 0.0
    # with a floor m: m + (1 − m)·½(1 + cos(πp))
    assert f(6, min_ratio=0.1) == pytest.approx(0.1 + 0.9 * 0.5, abs=ULPS)
    assert f(10, min_ratio=0.1) == pytest.approx(0.1, abs=ULPS)
    assert f(13, min_ratio=0.1) == pytest.approx(0.1, abs=ULPS)  # past the end: the floor
    assert f(1, min_ratio=0.1) == 0.5  # the floor does not lift the warm-up


def test_linear_and_constant_by_hand():
    lin = functools.partial(lr_factor, total_steps=10, warmup_steps=2, schedule="linear", min_ratio=0.2)
    assert [lin(k) for k in (0, 1, 2)] == [0.0, 0.5, 1.0]
    assert lin(6) == pytest.approx(0.2 + 0.8 * 0.5, abs=ULPS)  # half-way through the decay
    assert lin(8) == pytest.approx(0.2 + 0.8 * 0.25, abs=ULPS)
    assert lin(10) == pytest.approx(0.2, abs=ULPS)
    assert lr_factor(0, 4, 0, "linear", 0.0) == 1.0  # no warm-up: the first step at the peak
    assert [lr_factor(k, 9, 4, "constant", 0.0) for k in (0, 1, 3, 4, 8, 20)] == [0.0, 0.25, 0.75, 1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "args,match",
    [
        ((0, 10, 2, "step", 0.0), "unknown learning-rate schedule 'step'"),
        ((-1, 10, 2, "cosine", 0.0), "step >= 0"),
        ((0, 10, 10, "cosine", 0.0), "warmup_steps < total_steps"),
        ((0, 10, -1, "cosine", 0.0), "0 <= warmup_steps"),
        ((0, 10, 2, "cosine", 1.5), "min_ratio must be in"),
    ],
)
def test_lr_factor_refuses_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        lr_factor(*args)


def test_the_default_makes_no_scheduler_and_leaves_the_optimizer_as_it_was():
    opt = torch.optim.AdamW(TinyLM().parameters(), lr=1e-3)
    assert make_scheduler(opt, 10, 0, "constant", 0.0) is None
    assert "initial_lr" not in opt.param_groups[0] and opt.param_groups[0]["lr"] == 1e-3
    assert make_learner(TrainConfig(), TinyLM()).scheduler is None
    with pytest.raises(ValueError, match="above the learning rate"):
        make_scheduler(opt, 10, 2, "cosine", 2e-3)


# ---- one scheduler step per optimizer step taken ------------------------------------------------
def _spy_lrs(monkeypatch) -> list[tuple[float, float]]:
    """(lr the step ran with, optimizer_stepped) of every ppo_step call of update()."""
    import consequence.loop.learner as learner_module

    seen: list[tuple[float, float]] = []
    real = learner_module.ppo_step

    def spy(model, opt, *a, **k):
        lr = opt.param_groups[0]["lr"]
        m = real(model, opt, *a, **k)
        seen.append((lr, m["optimizer_stepped"]))
        return m

    monkeypatch.setattr(learner_module, "ppo_step", spy)
    return seen


def test_update_steps_the_schedule_once_per_optimizer_step_taken(monkeypatch):
    """Three batches of epochs 2 × mini-batches 2: trained, all-zero advantages (4 steps skipped),
    trained. Each step runs at peak · lr_factor(steps taken before it); skipped ones leave it."""
    peak, schedule = 0.1, dict(lr_schedule="cosine", warmup_steps=3, min_lr=0.01)
    cfg = TrainConfig(iterations=3, epochs_per_batch=2, mini_batches=2, learning_rate=peak, **schedule)
    model = TinyLM()
    learner = make_learner(cfg, model)
    seen = _spy_lrs(monkeypatch)
    rows = make_rows(model, [3, 2, 4, 3])
    want = functools.partial(lr_factor, total_steps=12, warmup_steps=3, schedule="cosine", min_ratio=0.01 / peak)
    logged = []
    for adv in ([1.0, -1.0, 0.5, -0.5], [0.0] * 4, [1.0, -1.0, 0.5, -0.5]):
        m = update(Batch(rows, adv, [list(r.old_logprobs) for r in rows]), cfg, learner, PAD, seed=0)
        logged.append((m["lr"], m["optimizer_steps_taken"], m["optimizer_steps_skipped"]))
    assert [s for _, s in seen] == [1.0] * 4 + [0.0] * 4 + [1.0] * 4
    # steps taken 0–3 in the first batch, 4–7 in the last; LambdaLR's own product peak · factor: exact
    assert [lr for lr, s in seen if s] == [peak * want(k) for k in range(8)]
    assert [lr for lr, s in seen if not s] == [peak * want(4)] * 4  # the skipped ones did not advance it
    assert learner.scheduler.last_epoch == 8  # as many scheduler steps as optimizer steps taken
    # the metric: the lr of the batch's last step taken; with none taken, the next step's
    assert logged == [(peak * want(3), 4.0, 0.0), (peak * want(4), 0.0, 4.0), (peak * want(7), 4.0, 0.0)]
    assert learner.optimizer.param_groups[0]["lr"] == peak * want(8)  # what step 8 would run at


def test_an_empty_batch_reports_the_current_lr():
    cfg = TrainConfig(iterations=2, learning_rate=0.1, warmup_steps=1)
    learner = make_learner(cfg, TinyLM())
    assert update(Batch([], [], []), cfg, learner, PAD, seed=0)["lr"] == 0.0  # warm-up step 0
    assert learner.scheduler.last_epoch == 0


@pytest.mark.slow  # ~40 s on a busy 2-core machine: starts one rank process
def test_the_rank_processes_step_with_rank_0s_scheduled_lr(monkeypatch):
    """--update-ranks 2: the rank process's optimizer was copied from rank 0 at the first step,
    when the warm-up's lr was 0; it steps at the scheduled lr only because every step's job
    carries rank 0's param-group hyper-parameters (``hyper``), and the replica check after every
    step (``check_replicas_equal``) compares the two. The control: jobs whose ``hyper`` keeps
    lr 0 make the replicas differ, and the step fails."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from consequence.update.data_parallel import DataParallelError, DataParallelUpdate

    peak = 0.05
    cfg = TrainConfig(
        iterations=2,  # 8 steps: 2 of warm-up, then linear down to 0.01
        epochs_per_batch=2,
        mini_batches=2,
        learning_rate=peak,
        lr_schedule="linear",
        warmup_steps=2,
        min_lr=0.01,
    )
    llama = LlamaConfig(vocab_size=11, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama).float()
    rows = make_rows(model, [3, 2, 4, 3, 5, 2])
    batch = Batch(rows, [1.0, -1.0, 0.5, -0.5, 0.7, -0.7], [list(r.old_logprobs) for r in rows])
    start = [p.detach().clone() for p in model.parameters()]
    learner = make_learner(cfg, model)
    dp = learner.data_parallel = DataParallelUpdate(2, timeout_s=60, threads_per_rank=1)
    try:
        m = update(batch, cfg, learner, PAD, seed=0)  # the replicas are checked equal after each step
        assert m["optimizer_steps_taken"] == 4.0 and learner.scheduler.last_epoch == 4
        assert m["lr"] == peak * lr_factor(3, 8, 2, "linear", 0.01 / peak)
        assert any(not torch.equal(a, b) for a, b in zip(start, model.parameters()))  # rank 0 moved off lr 0
        real = DataParallelUpdate._send_jobs

        def stale(self, jobs):  # the rank process keeps lr 0 while rank 0 steps at the schedule's
            real(self, [j | {"hyper": [h | {"lr": 0.0} for h in j["hyper"]]} for j in jobs])

        monkeypatch.setattr(DataParallelUpdate, "_send_jobs", stale)
        with pytest.raises(DataParallelError, match="replicas differ"):
            update(batch, cfg, learner, PAD, seed=1)
    finally:
        dp.close()


# ---- the training loop: metric lr, step counts, resume mid-warm-up -----------------------------
def _tiny(run: Path, **kw) -> TrainConfig:
    """Four iterations of epochs 2 × mini-batches 2 (16 optimizer steps), the first 10 a warm-up:
    after two iterations 8 steps are taken, so the resume point is inside the warm-up."""
    from consequence.distill.warmstart import BUNDLED

    return TrainConfig(
        run_dir=str(run),
        model=str(BUNDLED),
        env=ODD_SAMPLES_WIN,  # every group mixed: every step trains
        iterations=4,
        tasks_per_iteration=1,
        group_size=2,
        epochs_per_batch=2,
        mini_batches=2,
        micro_batch_size=4,
        max_turns=1,
        max_new_tokens=24,
        eval_every=0,
        final_eval_episodes=0,
        skip_checks=True,
        learning_rate=3e-3,
        lr_schedule="cosine",
        warmup_steps=10,
        min_lr=3e-4,
        **kw,
    )


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # ~1-2 min: 8 iterations of the bundled model
def test_the_loop_logs_the_scheduled_lr_and_a_resume_mid_warm_up_continues_it_exactly(tmp_path, monkeypatch):
    from consequence.loop.resume import latest_state
    from consequence.loop.sources import Rollouts
    from consequence.loop.train import train

    train(_tiny(tmp_path / "a"), Console(quiet=True))
    ma = _metrics(tmp_path / "a")
    taken = [int(m["optimizer_steps_taken"]) for m in ma]
    assert taken == [4, 4, 4, 4]  # every step trains (odd samples win), on both sides of the resume point
    # the scheduler stepped exactly once per optimizer step taken (the last state holds its count)
    state = latest_state(tmp_path / "a")
    assert torch.load(state.path / "scheduler.pt", weights_only=True)["last_epoch"] == sum(taken)
    # lr of an iteration = peak · lr_factor(k) of its last step taken k (or the next step's, with none)
    want = functools.partial(lr_factor, total_steps=16, warmup_steps=10, schedule="cosine", min_ratio=3e-4 / 3e-3)
    done = 0
    for m, n in zip(ma, taken):
        done += n
        assert m["lr"] == 3e-3 * want(done - 1 if n else done), m["iteration"]
    # the state after iteration 1 is inside the warm-up (step 7 of 10); iteration 2 ends in the decay
    assert ma[1]["lr"] == pytest.approx(0.7 * 3e-3, rel=ULPS) and ma[2]["lr"] < 3e-3

    real = Rollouts.next_batch

    def crash_in_third(self, it, *args, **kwargs):
        if it == 2:
            raise KeyboardInterrupt  # stands in for a kill after state-0002
        return real(self, it, *args, **kwargs)

    with monkeypatch.context() as mp, pytest.raises(KeyboardInterrupt):
        mp.setattr(Rollouts, "next_batch", crash_in_third)
        train(_tiny(tmp_path / "b"), Console(quiet=True))
    assert latest_state(tmp_path / "b").iteration == 2
    train(_tiny(tmp_path / "b"), Console(quiet=True), resume=True)
    mb = _metrics(tmp_path / "b")
    assert [m["lr"] for m in mb] == [m["lr"] for m in ma]  # to the last digit
    assert [m["optimizer_steps_taken"] for m in mb] == [m["optimizer_steps_taken"] for m in ma]
    for x, y in zip(ma[2:], mb[2:]):  # the resumed iterations trained alike (JSON round trip: 1e-6)
        assert (x.get("loss") is None) == (y.get("loss") is None)
        if x.get("loss") is not None:
            assert abs(x["loss"] - y["loss"]) <= 1e-6 and abs(x["grad_norm"] - y["grad_norm"]) <= 1e-6


# ---- settings refused -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(iterations=3, mini_batches=2, warmup_steps=6), "--warmup-steps 6 is not shorter than the run's 6"),
        (dict(iterations=3, mini_batches=2, warmup_steps=9), "lower --warmup-steps to at most 5"),
        (dict(warmup_steps=-1), r"warmup_steps \(--warmup-steps\): Input should be greater than or equal to 0"),
        (dict(lr_schedule="cosine", min_lr=-1e-5), r"min_lr \(--min-lr\): Input should be greater than or equal"),
        (dict(lr_schedule="linear", learning_rate=1e-4, min_lr=2e-4), "--min-lr 0.0002 is above --learning-rate"),
        (dict(min_lr=1e-5), "--min-lr has no effect with --lr-schedule constant.*; drop --min-lr"),
        (dict(lr_schedule="step"), r"lr_schedule \(--lr-schedule\)"),
    ],
)
def test_bad_schedule_settings_are_refused_with_the_option_named(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig.checked(**kw)


def test_good_schedule_settings_are_accepted():
    cfg = TrainConfig(iterations=3, mini_batches=2, warmup_steps=4, lr_schedule="cosine", min_lr=2e-4)
    assert (cfg.warmup_steps, cfg.lr_schedule, cfg.min_lr) == (4, "cosine", 2e-4)  # min-lr = learning rate: allowed
    assert TrainConfig(warmup_steps=3).lr_schedule == "constant"  # warm-up alone, then constant
    assert TrainConfig(**cfg.nested_dump()) == cfg  # recorded in config.yaml (and the manifest's config)


def test_min_lr_that_no_step_would_reach_is_refused():
    """Break-test: with one step left after the warm-up, that step runs at the peak and the
    floor is never approached: --min-lr is refused as changing nothing."""
    from consequence.config import TrainConfig

    with pytest.raises(ValueError, match="--min-lr 5e-05 changes nothing"):
        TrainConfig(iterations=3, warmup_steps=2, lr_schedule="linear", min_lr=5e-5, learning_rate=2e-4)
    assert (
        TrainConfig(iterations=4, warmup_steps=2, lr_schedule="linear", min_lr=5e-5, learning_rate=2e-4).min_lr == 5e-5
    )

"""A KL reference that moves (``--ref-refresh-every N``) and the KL as a reward penalty
(``--kl-mode reward``), against hand computations.

The seeds (docs/design.md §5): the reference may stay the initial model or be updated every
stated number of steps, and the rule must be reported. ``reference_version`` in each
metrics line is the policy version π_ref held for that iteration's credit and update.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from rich.console import Console

from consequence.config import TrainConfig
from consequence.credit.batch import assign_credit, training_rows
from consequence.distill.warmstart import BUNDLED
from consequence.loop.learner import refresh_due
from consequence.records import ModelCall, Trajectory
from reward_signal import ODD_SAMPLES_WIN


def _cfg(run: Path, **kw) -> TrainConfig:
    return TrainConfig(
        run_dir=str(run),
        model=str(BUNDLED),
        env=ODD_SAMPLES_WIN,  # odd samples win: every update moves the policy
        iterations=4,
        tasks_per_iteration=2,
        group_size=2,
        eval_every=0,
        final_eval_episodes=0,
        skip_checks=True,
        max_turns=1,
        max_new_tokens=16,
        kl_coef=0.1,
        learning_rate=1e-2,
        **kw,
    )


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_refresh_schedule():
    cfg = TrainConfig(kl_coef=0.1, ref_refresh_every=2, iterations=5)
    assert [it for it in range(5) if refresh_due(cfg, it)] == [1, 3]  # versions 2 and 4; never after the last
    assert not any(refresh_due(TrainConfig(kl_coef=0.1, iterations=5), it) for it in range(5))


def test_ref_refresh_without_a_kl_term_or_past_the_last_iteration_is_refused():
    with pytest.raises(ValueError, match="ref_refresh_every"):
        TrainConfig(ref_refresh_every=2)
    with pytest.raises(ValueError, match="--ref-refresh-every 5 with --iterations 5 never refreshes"):
        TrainConfig(ref_refresh_every=5, kl_coef=0.1, iterations=5)
    assert TrainConfig(ref_refresh_every=4, kl_coef=0.1, iterations=5).ref_refresh_every == 4


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_a_refreshed_reference_is_the_policy_it_copied(tmp_path, lora_rank):
    """Synchronous GRPO, one optimizer step per iteration: at iterations 0 and 2 (π_ref just
    set to the sampling policy) the first step's KL is that of identical log-probs, k3 of
    log r = 0 up to float32 rounding of two forward passes (|log r| ≲ 1e-5, k3 ≈ ½ log r²
    ≲ 1e-10); at iterations 1 and 3 the policy moved one step away from π_ref."""
    from consequence.loop.train import train

    train(_cfg(tmp_path / "r", ref_refresh_every=2, lora_rank=lora_rank), Console(quiet=True))
    m = _metrics(tmp_path / "r")
    assert [x["reference_version"] for x in m] == [0, 0, 2, 2]
    assert m[0]["kl_ref"] < 1e-8 and m[2]["kl_ref"] < 1e-8
    assert m[1]["kl_ref"] > 1e-6 and m[3]["kl_ref"] > 1e-6
    # without a refresh, iteration 2 is two steps from the start: its KL is not ~0
    train(_cfg(tmp_path / "f", lora_rank=lora_rank), Console(quiet=True))
    fixed = _metrics(tmp_path / "f")
    assert [x["reference_version"] for x in fixed] == [0, 0, 0, 0]
    assert fixed[2]["kl_ref"] > 1e-6


def test_resume_keeps_the_refreshed_reference(tmp_path, monkeypatch):
    """A crash in iteration 3 (after the state of 3 iterations, whose π_ref is version 2)
    then --resume gives the uninterrupted run's metrics: the state holds π_ref."""
    from consequence.loop.sources import Rollouts
    from consequence.loop.train import train

    kw = dict(ref_refresh_every=2, checkpoint_every=1)
    train(_cfg(tmp_path / "a", **kw), Console(quiet=True))
    real = Rollouts.next_batch

    def crash_in_fourth(self, it, *args, **kwargs):
        if it == 3:
            raise KeyboardInterrupt  # stands in for a kill
        return real(self, it, *args, **kwargs)

    with monkeypatch.context() as mp, pytest.raises(KeyboardInterrupt):
        mp.setattr(Rollouts, "next_batch", crash_in_fourth)
        train(_cfg(tmp_path / "b", **kw), Console(quiet=True))
    assert (tmp_path / "b" / "checkpoints" / "state-0003" / "reference.safetensors").is_file()
    train(_cfg(tmp_path / "b", **kw), Console(quiet=True), resume=True)
    ma, mb = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    assert [x["reference_version"] for x in mb] == [0, 0, 2, 2]
    for x, y in zip(ma, mb, strict=True):
        for k in ("loss", "kl_ref", "grad_norm", "reward_mean"):
            assert abs(x[k] - y[k]) <= 1e-6, (x["iteration"], k, x[k], y[k])
    assert ma[3]["kl_ref"] > 1e-6  # the reference term is live in the resumed iteration


# ---- --kl-mode reward against a hand computation -------------------------------------------
def _traj(sample_id: int, reward: float) -> Trajectory:
    """One call: 2 prompt tokens, 2 sampled tokens with log μ = −0.1 each."""
    return Trajectory(
        task_id="p#0",
        group_id="p#0@0",
        sample_id=sample_id,
        seed=sample_id,
        policy_version=0,
        calls=[ModelCall([1, 2], [3, 4], [-0.1, -0.1], "stop")],
        outcome="finished",
        reward=reward,
        reward_components={"hidden_tests": reward},
    )


# log r = log μ − log π_ref on each row's 2 targets (by the ref log-probs below)
LOG_R = [(0.5, -0.3), (0.0, 0.0), (-1.0, 0.0)]
REWARDS = [1.0, 0.0, 1.0]


def _k3(x: float) -> float:
    return math.exp(-x) - 1.0 + x  # Schulman 2020's k3 of log r = x


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo"])
def test_kl_reward_penalty_by_hand(advantage):
    """β = 0.5, k3: penalties 0.5·(k3(0.5) + k3(−0.3)) = 0.0781947, 0, 0.5·k3(−1) = 0.3591409,
    taken off rewards 1, 0, 1; then the group baseline (GRPO: ÷ (std + 1e-6), population or
    sample std by --grpo-std)."""
    trajs = [_traj(i, r) for i, r in enumerate(REWARDS)]
    rows, owner = training_rows(trajs)
    ref = [
        [lp - x if m else 0.0 for lp, m, x in zip(r.old_logprobs, r.loss_mask, (0.0, 0.0, *lr))]
        for r, lr in zip(rows, LOG_R)
    ]
    cfg = TrainConfig(advantage=advantage, kl_mode="reward", kl_coef=0.5, kl_estimator="k3")
    batch = assign_credit(trajs, rows, owner, cfg, ref_logprobs=ref)
    penalties = [0.5 * (_k3(a) + _k3(b)) for a, b in LOG_R]
    assert penalties[0] == pytest.approx(0.0781947, abs=1e-7) and penalties[2] == pytest.approx(0.3591409, abs=1e-7)
    r = [x - p for x, p in zip(REWARDS, penalties)]
    mean = sum(r) / 3
    if advantage == "dr_grpo":
        want = [x - mean for x in r]
    else:
        dof = 3 - (1 if cfg.grpo_std == "sample" else 0)
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / dof)
        want = [(x - mean) / (std + 1e-6) for x in r]
    # float32 log-probs: log r is exact to ~1e-7 per token, k3' = 1 − e^{−x} ≤ 1.72: ≤ 1e-6 per advantage
    assert batch.advantages == pytest.approx(want, abs=1e-6)
    # the penalty reaches the advantages: without it, samples 0 and 2 (both reward 1) would tie
    assert batch.advantages[0] - batch.advantages[2] > 0.1


def test_kl_reward_mode_has_no_loss_term(tmp_path):
    """--kl-mode reward: β enters the reward only; the update's KL loss coefficient is 0."""
    from consequence.loop.learner import make_learner
    from consequence.policy.tiny import load_policy

    model = load_policy(BUNDLED)[0]
    learner = make_learner(TrainConfig(kl_coef=0.5, kl_mode="reward"), model)
    assert learner.update_cfg.kl_coef == 0.0 and learner.reference is not None
    learner = make_learner(TrainConfig(kl_coef=0.5, kl_mode="loss"), model)
    assert learner.update_cfg.kl_coef == 0.5
    assert isinstance(next(learner.reference.parameters()), torch.Tensor)

"""Checks before the first optimizer step: each passes on a good batch and fails on a broken one."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from consequence.credit.advantages import group_advantages
from consequence.loop.checks import (
    PreStepCheckError,
    check_clip_direction,
    check_groups,
    check_mask,
    check_ratio,
    check_zero_gradient,
    run_pre_step_checks,
)
from consequence.records import ModelCall, Trajectory, trajectory_to_rows
from consequence.update.step import UpdateConfig
from consequence.update.surrogates import surrogate_objective
from tiny_lm import PAD, TinyLM, make_rows, ref_logprobs

EOT = 9


def _traj(i, task="t1", group="g1", outputs=((5, 6, EOT), (7, EOT))):
    calls, ctx = [], [1, 2, 3]
    for out in outputs:
        obs = [3, 4]
        calls.append(ModelCall(list(ctx), list(out), [-0.5] * len(out), "stop", observation_ids=obs))
        ctx = ctx + list(out) + obs
    return Trajectory(
        task_id=task,
        group_id=group,
        sample_id=i,
        seed=i,
        policy_version=0,
        calls=calls,
        outcome="finished",
        reward=float(i % 2),
    )


def _rows(trajs):
    return [r for i, t in enumerate(trajs) for r in trajectory_to_rows(t, i)]


def test_ratio_passes_on_the_behaviour_snapshot_and_fails_when_perturbed():
    model = TinyLM()
    rows = make_rows(model, [3, 5, 2])
    good = check_ratio(model, rows, PAD, ref_logprobs, 1.0)
    assert good.passed and "tolerance" in good.detail
    bad_rows = make_rows(model, [3, 5, 2], perturb=0.05)
    bad = check_ratio(model, bad_rows, PAD, ref_logprobs, 1.0)
    assert bad.passed is False and "temperature" in bad.detail
    # a sampler at T = 0.7 checked against the T = 1 distribution is caught
    hot = make_rows(model, [4], temperature=0.7)
    assert check_ratio(model, hot, PAD, ref_logprobs, 1.0).passed is False
    assert check_ratio(model, hot, PAD, ref_logprobs, 0.7).passed


def test_mask_passes_on_real_rows_and_counts_end_of_turn():
    trajs = [_traj(0), _traj(1)]
    res = check_mask(trajs, _rows(trajs), {EOT})
    assert res.passed and res.detail.startswith("10 targets") and "4 end-of-turn" in res.detail


def test_mask_fails_when_an_observation_token_is_a_target():
    trajs = [_traj(0)]
    rows = _rows(trajs)
    mask = list(rows[0].loss_mask)
    obs_pos = mask.index(1) + 3  # first observation token after the first call
    assert mask[obs_pos] == 0
    mask[obs_pos] = 1
    broken = [dataclasses.replace(rows[0], loss_mask=mask)]
    res = check_mask(trajs, broken, {EOT})
    assert res.passed is False and "observation" in res.detail


def test_mask_fails_when_the_end_of_turn_is_not_sampled():
    trajs = [_traj(0, outputs=((5, 6),))]  # stopped, but no end-of-turn among the sampled ids
    res = check_mask(trajs, _rows(trajs), {EOT})
    assert res.passed is False and "end-of-turn" in res.detail


def test_mask_fails_on_a_trajectory_without_targets_and_on_length_mismatch():
    trajs = [_traj(0), _traj(1)]
    rows = _rows(trajs)
    res = check_mask(trajs, rows[:1], {EOT})  # trajectory 1 lost its row
    assert res.passed is False and "no target" in res.detail
    short = SimpleNamespace(input_ids=[1, 2, 3], loss_mask=[0, 1], old_logprobs=[0, 0, 0], traj_index=0)
    res = check_mask(trajs[:1], [short], {EOT})
    assert res.passed is False and "differ in length" in res.detail


def test_groups_fail_when_built_by_position():
    assert check_groups([_traj(0), _traj(1)]).passed
    res = check_groups([_traj(0, task="a"), _traj(1, task="b")])  # same group id, two tasks
    assert res.passed is False and "case 02" in res.detail
    res = check_groups([_traj(0), _traj(0)])
    assert res.passed is False and "repeats sample ids" in res.detail


def test_zero_gradient_passes_for_group_baselines_and_catches_a_broken_one():
    model = TinyLM()
    rows = make_rows(model, [3, 2, 4, 5], perturb=0.2)
    for est in ("grpo", "dr_grpo", "rloo"):
        assert check_zero_gradient(model, rows, est, UpdateConfig(), PAD, ref_logprobs).passed
    assert check_zero_gradient(model, rows, "reinforce", UpdateConfig(), PAD, ref_logprobs).passed is None

    def no_baseline(rewards, groups, estimator):  # a "GRPO" that forgot to subtract the mean
        return group_advantages(rewards, groups, "reinforce")

    res = check_zero_gradient(model, rows, "grpo", UpdateConfig(), PAD, ref_logprobs, advantage_fn=no_baseline)
    assert res.passed is False and "does not cancel" in res.detail


@pytest.mark.parametrize("surrogate", ["ppo_clip", "dual_clip", "gspo", "gspo_token", "cispo"])
def test_clip_direction_passes_for_every_clipped_surrogate(surrogate):
    eps = 4e-4 if surrogate.startswith("gspo") else 0.2
    res = check_clip_direction(UpdateConfig(surrogate=surrogate, clip_eps_low=eps, clip_eps_high=eps))
    assert res.passed, res.detail


def test_clip_direction_catches_max_instead_of_min():
    def wrong(name, lp, old, adv, mask, **kw):
        ratio = torch.exp(lp - old)
        a = adv.unsqueeze(-1)
        obj = torch.maximum(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a)  # max: clips the wrong side
        return obj, ratio.detach(), torch.zeros_like(obj, dtype=torch.bool)

    assert check_clip_direction(UpdateConfig(), surrogate_fn=surrogate_objective).passed
    res = check_clip_direction(UpdateConfig(), surrogate_fn=wrong)
    assert res.passed is False and "want 0" in res.detail


def test_run_pre_step_checks_raises_with_the_failures_listed():
    model = TinyLM()
    trajs = [_traj(0), _traj(1, task="other")]
    rows = make_rows(model, [3, 3], perturb=0.1)
    rows = [dataclasses.replace(r, traj_index=i) for i, r in enumerate(rows)]
    cfg = SimpleNamespace(temperature=1.0, advantage="grpo")
    with pytest.raises(PreStepCheckError, match=r"(?s)ratio:.*groups:.*--skip-checks"):
        run_pre_step_checks(
            model=model,
            trajs=trajs,
            rows=rows,
            pad_id=PAD,
            stop_ids={EOT},
            logprob_fn=ref_logprobs,
            cfg=cfg,
            ucfg=UpdateConfig(),
        )

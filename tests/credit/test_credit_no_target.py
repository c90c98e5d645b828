"""A trajectory with no target token leaves its group, for every estimator (docs/cases.md, case 15).

A budget or an error can end an episode before the policy sampled anything (its first
prompt did not fit ``max_total_tokens``: no model call; or its calls sampled no token).
Such a trajectory has nothing to credit: like an env_error it must stay out of every
group and batch statistic, get no advantage and no training row, and be counted.

Every expected value below is computed by hand from the rewards of the trajectories that
remain; the tolerances are float64 rounding of a handful of operations (1e-9), or the
estimator's own ε = 1e-6 where it divides by a std (written out in the expected value).
"""

import math
import warnings
from types import SimpleNamespace

import pytest
import torch

from consequence.config import TrainConfig
from consequence.credit.advantages import group_advantages
from consequence.credit.batch import assign_credit, training_rows
from consequence.loop.checks import check_mask
from consequence.loop.diagnostics import iteration_extras
from consequence.loop.learner import credit
from consequence.records import ModelCall, Trajectory
from consequence.rollout.collect import is_mixed

NO_CRITIC = SimpleNamespace(reference=None, critic=None, teacher=None)
EPS = 1e-6  # the std offset of grpo / reinforce_pp (credit.advantages.group_advantages)


def _traj(sample_id, reward, group="p#0@0", tokens=2, outcome="finished"):
    """One call with ``tokens`` sampled tokens after a 2-token prompt (tokens 0 = a call that sampled nothing)."""
    out = list(range(3, 3 + tokens))
    return Trajectory(
        task_id=group.split("@")[0],
        group_id=group,
        sample_id=sample_id,
        seed=sample_id,
        policy_version=0,
        calls=[ModelCall([1, 2], out, [-0.1] * tokens, "length")],
        outcome=outcome,
        reward=reward,
        reward_components={"hidden_tests": reward},
    )


def _no_call(sample_id, reward=0.0, group="p#0@0"):
    """The first prompt did not fit max_total_tokens: truncated before any model call, scored 0."""
    return Trajectory(
        task_id=group.split("@")[0],
        group_id=group,
        sample_id=sample_id,
        seed=sample_id,
        policy_version=0,
        calls=[],
        outcome="truncated",
        reward=reward,
    )


def _no_tokens(sample_id, reward=0.0, group="p#0@0"):
    """A model call that sampled no token (e.g. an engine that returned nothing)."""
    return _traj(sample_id, reward, group, tokens=0, outcome="truncated")


EMPTY = {"no model call": _no_call, "a call with no sampled token": _no_tokens}


def _run(trajs, **cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a group of one warns; asserted separately
        return credit(trajs, TrainConfig(**cfg), NO_CRITIC, pad_id=0)


# Group of three, rewards (1, 0) for the two that sampled and 0 for the empty one: the
# advantages must be those of the group of two (1, 0), i.e. mean 0.5, population std 0.5.
GROUP_OF_TWO = {
    "reinforce": [1.0, 0.0],  # A = R (no baseline)
    "batch_mean": [0.5, -0.5],  # R − mean{1, 0}
    "reinforce_pp": [0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS)],  # (R − 0.5) / (std 0.5 + ε)
    "rloo": [1.0, -1.0],  # R_i − R_other
    "grpo": [0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS)],
    "dr_grpo": [0.5, -0.5],  # R − mean, no std
}


@pytest.mark.parametrize("make_empty", EMPTY.values(), ids=EMPTY.keys())
@pytest.mark.parametrize("estimator", GROUP_OF_TWO)
def test_group_of_three_with_one_empty_is_a_group_of_two(estimator, make_empty):
    trajs = [_traj(0, 1.0), _traj(1, 0.0), make_empty(2)]
    batch = _run(trajs, advantage=estimator)
    assert [t.advantage for t in trajs[:2]] == pytest.approx(GROUP_OF_TWO[estimator], abs=1e-9)
    assert trajs[2].advantage is None  # no advantage
    assert [r.traj_index for r in batch.rows] == [0, 1]  # no row
    assert batch.advantages == pytest.approx(GROUP_OF_TWO[estimator], abs=1e-9)  # what reaches the rows
    assert batch.metrics["no_target_trajectories"] == 1.0  # counted
    # the same as if the empty one had never been sampled
    alone = [_traj(0, 1.0), _traj(1, 0.0)]
    assert _run(alone, advantage=estimator).advantages == pytest.approx(batch.advantages, abs=1e-12)


@pytest.mark.parametrize("make_empty", EMPTY.values(), ids=EMPTY.keys())
@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_group_of_two_with_one_empty_leaves_a_group_of_one_with_advantage_0(estimator, make_empty):
    # Dr. GRPO: today the empty member's 0 is the partner's baseline, A = 1 − 0.5 = 0.5; alone, A = 0
    trajs = [_traj(0, 1.0), make_empty(1)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch = credit(trajs, TrainConfig(advantage=estimator), NO_CRITIC, pad_id=0)
    assert trajs[0].advantage == 0.0 and trajs[1].advantage is None
    assert [r.traj_index for r in batch.rows] == [0] and batch.advantages == [0.0]
    assert any("single valid rollout" in str(w.message) for w in caught)  # as any group of one (case 12)


def test_batch_statistics_leave_out_the_empty_ones_across_groups():
    # groups a: (1, empty), b: (0, 1); batch-mean over {1, 0, 1} = 2/3, std √2/3
    trajs = [_traj(0, 1.0, "a@0"), _no_call(1, 0.0, "a@0"), _traj(0, 0.0, "b@0"), _traj(1, 1.0, "b@0")]
    m, s = 2 / 3, math.sqrt(2) / 3
    assert _run(trajs, advantage="batch_mean").advantages == pytest.approx([1 - m, -m, 1 - m], abs=1e-9)
    assert _run(trajs, advantage="reinforce_pp").advantages == pytest.approx(
        [(1 - m) / (s + EPS), -m / (s + EPS), (1 - m) / (s + EPS)], abs=1e-9
    )


def test_rloo_group_reduced_to_one_is_0_and_a_sampled_group_of_one_is_still_refused():
    with pytest.warns(UserWarning, match="single valid rollout"):
        assert group_advantages([1.0, None], ["g", "g"], "rloo") == [0.0, None]
    with pytest.raises(ValueError, match="RLOO needs at least 2"):  # G = 1 sampled: a setting, refused
        group_advantages([1.0], ["g"], "rloo")


def test_kl_reward_penalty_and_the_baseline_use_only_the_trajectories_that_sampled():
    # Dr. GRPO with the KL as a reward penalty, β = 0.5, k1 = log μ − log π_ref = 0.2 on each of
    # the 2 targets of a row: penalty 0.5 · 0.2 · 2 = 0.2. Penalised rewards 0.8, −0.2: mean 0.3.
    trajs = [_traj(0, 1.0), _traj(1, 0.0), _no_tokens(2)]
    rows, owner = training_rows(trajs)
    ref = [[lp + 0.2 if m else 0.0 for lp, m in zip(r.old_logprobs, r.loss_mask)] for r in rows]
    cfg = TrainConfig(advantage="dr_grpo", kl_mode="reward", kl_coef=0.5, kl_estimator="k1")
    batch = assign_credit(trajs, rows, owner, cfg, ref_logprobs=ref)
    assert [r.traj_index for r in batch.rows] == [0, 1]
    assert batch.advantages == pytest.approx([0.5, -0.5], abs=1e-6)  # float32 log-probs: 1e-7 per term
    assert trajs[2].advantage is None


class _ZeroCritic(torch.nn.Module):
    """V = 0 everywhere (a fresh ValueModel's zero head): GAE advantages are the returns."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, attention_mask):
        return torch.zeros(input_ids.shape) + self.w


@pytest.mark.parametrize("make_empty", EMPTY.values(), ids=EMPTY.keys())
def test_gae_whitening_leaves_out_a_trajectory_without_targets(make_empty):
    # γ = λ = 1, V = 0: every target's advantage is its trajectory's reward: tokens (1, 1, 0, 0),
    # whitened over the batch's targets: mean 0.5, population std 0.5 → ±0.5 / (0.5 + 1e-6)
    trajs = [_traj(0, 1.0), _traj(1, 0.0), make_empty(2)]
    rows, owner = training_rows(trajs)
    batch = assign_credit(
        trajs, rows, owner, TrainConfig(advantage="gae", gamma=1.0, gae_lambda=1.0), critic=_ZeroCritic()
    )
    a = 0.5 / (0.5 + 1e-6)
    assert [r.traj_index for r in batch.rows] == [0, 1]
    for got, want in zip(batch.advantages, [[0, 0, a, a], [0, 0, -a, -a]]):
        assert got == pytest.approx(want, abs=1e-6)  # whitened in float32: 1e-7 relative
    assert [t.advantage for t in trajs[:2]] == pytest.approx([a, -a], abs=1e-6) and trajs[2].advantage is None
    assert batch.metrics["no_target_trajectories"] == 1.0


def test_rejection_and_distillation_give_no_advantage_to_an_empty_trajectory():
    trajs = [_traj(0, 1.0), _no_call(1)]
    trajs[0].verifier_score = 1.0
    batch = _run(trajs, advantage="rejection", surrogate="pg")
    assert [t.advantage for t in trajs] == [1.0, None]
    assert batch.metrics["rejection_attempts"] == 1.0  # the student sampled nothing in the second episode
    assert batch.metrics["no_target_trajectories"] == 1.0


def test_group_metrics_and_dynamic_sampling_see_the_group_without_the_empty_one():
    from consequence.credit.batch import credit_rewards

    # two members that sampled, both reward 1, and one empty episode scored 0: not a mixed group
    group = [_traj(0, 1.0), _traj(1, 1.0), _no_call(2, 0.0)]
    assert credit_rewards(group) == [1.0, 1.0, None]
    assert not is_mixed(group, "hidden_tests")  # dynamic sampling drops it: no group-relative signal
    assert iteration_extras(group)["groups_all_equal"] == 1
    assert is_mixed([_traj(0, 1.0), _traj(1, 0.0), _no_call(2, 0.0)], "hidden_tests")  # negative control


def test_the_mask_check_does_not_expect_rows_of_an_empty_trajectory():
    trajs = [_traj(0, 1.0), _no_tokens(1)]
    res = check_mask(trajs, training_rows(trajs)[0], stop_ids=set())
    assert res.passed, res.detail


@pytest.mark.parametrize(
    "settings",
    [
        {"advantage": "reverse_kl", "teacher": "t"},  # the teacher's log-probs of no row
        {"advantage": "dr_grpo", "kl_mode": "reward", "kl_coef": 0.5},  # the reference's of no row
    ],
    ids=["reverse_kl", "kl_in_reward"],
)
def test_a_batch_with_no_row_is_credited_without_running_the_teacher_or_reference(settings, monkeypatch):
    # Every episode ended before sampling a token (or in env_error): nothing to run a model on, and
    # the iteration goes on with no row instead of stopping on "needs the teacher's log-probs".
    import consequence.loop.learner as learner_mod

    monkeypatch.setattr(learner_mod, "compute_logprobs", lambda *a, **k: pytest.fail("a forward pass on no row"))
    learner = SimpleNamespace(reference=object(), critic=None, teacher=object())
    cfg = TrainConfig.model_construct(**(TrainConfig().model_dump() | settings))  # no teacher to load here
    batch = credit([_no_call(0), _no_call(1)], cfg, learner, pad_id=0)
    assert batch.rows == [] and batch.metrics["no_target_trajectories"] == 2.0

"""Rejection-sampling SFT: which episodes are accepted, what it cost, and the rows' targets."""

from __future__ import annotations

import math

import pytest

from consequence.distill.rejection import accept, accepted_rows, rejection_sample
from consequence.records import ModelCall, Trajectory


def _traj(task: str, sid: int, score: float | None, out: list[int], outcome: str = "finished") -> Trajectory:
    call = ModelCall(
        context_ids=[1, 2, 3],
        output_ids=out,
        sample_logprobs=[-0.5] * len(out),
        stop_reason="stop",
        observation_ids=[9],
    )
    reward = None if outcome == "env_error" else (score or 0.0)
    return Trajectory(task, task, sid, 0, 0, calls=[call], outcome=outcome, verifier_score=score, reward=reward)


def test_accept_counts_attempts_duplicates_and_env_errors_by_hand():
    trajs = [
        _traj("a", 0, 1.0, [5, 6]),
        _traj("a", 1, 1.0, [5, 6]),  # the same tokens twice: one kept
        _traj("a", 2, 0.0, [7]),
        _traj("b", 0, None, [], outcome="env_error"),
        _traj("b", 1, 1.0, [8], outcome="truncated"),  # verified but cut by a budget: rejected
        _traj("c", 0, 1.0, [5, 6]),
        _traj("c", 1, 0.5, [4]),
    ]  # same tokens, another task: kept
    kept, st = accept(trajs)
    assert [(t.task_id, t.sample_id) for t in kept] == [("a", 0), ("c", 0)]
    assert (st.attempts, st.accepted, st.duplicates, st.env_errors, st.tasks, st.tasks_accepted) == (6, 2, 1, 1, 3, 2)
    assert st.acceptance_rate == pytest.approx(2 / 6) and st.attempts_per_accepted == pytest.approx(3.0)
    assert accept(trajs, unique=False)[1].accepted == 3
    none = accept([_traj("a", 0, 0.0, [1])])[1]
    assert none.attempts_per_accepted == math.inf and none.as_dict()["attempts_per_accepted"] is None
    unscored = _traj("a", 0, None, [1])
    unscored.reward = None
    with pytest.raises(ValueError, match="never scored"):
        accept([unscored])


def test_accepted_rows_train_only_on_the_sampled_tokens():
    kept, _ = accept([_traj("a", 0, 1.0, [5, 6]), _traj("b", 0, 1.0, [7])])
    rows = accepted_rows(kept)
    assert [r.input_ids for r in rows] == [[1, 2, 3, 5, 6], [1, 2, 3, 7]]  # the last observation is never a context
    assert [r.loss_mask for r in rows] == [[0, 0, 0, 1, 1], [0, 0, 0, 1]]
    assert [r.traj_index for r in rows] == [0, 1]


@pytest.mark.slow
def test_rejection_sample_on_the_tiny_policy_matches_a_direct_count():
    from consequence.envs.registry import load_environment
    from consequence.harness.renderer import Renderer
    from consequence.policy.tiny import BUNDLED, load_policy
    from consequence.rollout.episodes import Budgets

    model, tok = load_policy(BUNDLED)
    env = load_environment("repair")
    tasks = env.sample("train", 4, seed=0)
    trajs, kept, st = rejection_sample(model, Renderer(tok, env.tools), env, tasks, 3, Budgets(), seed=0)
    valid = [t for t in trajs if t.outcome != "env_error"]
    assert st.attempts == len(valid) == 12 - st.env_errors
    wins = [t for t in valid if t.outcome == "finished" and t.verifier_score == 1.0]
    assert st.accepted + st.duplicates == len(wins) and st.accepted == len(kept) > 0  # the warm start solves some
    for t, row in zip(kept, accepted_rows(kept)):  # one row per repair episode: its calls extend each other
        targets = [i for i, m in zip(row.input_ids, row.loss_mask) if m]
        assert targets == [tok_id for c in t.calls for tok_id in c.output_ids]
    with pytest.raises(ValueError, match="temperature > 0"):
        rejection_sample(model, Renderer(tok, env.tools), env, tasks, 3, Budgets(), seed=0, temperature=0.0)


def test_advantage_rejection_keeps_the_accepted_rows_with_advantage_one():
    from consequence.config import TrainConfig
    from consequence.credit.batch import assign_credit, training_rows

    trajs = [
        _traj("a", 0, 1.0, [5, 6]),
        _traj("a", 1, 1.0, [5, 6]),
        _traj("a", 2, 0.0, [7]),
        _traj("b", 0, 1.0, [8], outcome="truncated"),
        _traj("b", 1, 1.0, [4]),
    ]
    rows, owner = training_rows(trajs)
    batch = assign_credit(trajs, rows, owner, TrainConfig(advantage="rejection", surrogate="pg"))
    assert [t.advantage for t in trajs] == [1.0, 0.0, 0.0, 0.0, 1.0]  # a duplicate and a truncated one: 0
    assert [r.traj_index for r in batch.rows] == [0, 4] and batch.advantages == [1.0, 1.0]
    assert batch.metrics == {
        "rejection_attempts": 5.0,
        "rejection_accepted": 2.0,
        "rejection_duplicates": 1.0,
        "acceptance_rate": 0.4,
        "attempts_per_accepted": 2.5,
        "no_target_trajectories": 0.0,
    }

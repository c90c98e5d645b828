"""GKD's λ (--distill-lambda, --distill-data) and cross-stage distillation (a past checkpoint as
teacher, group size 1), on the tiny model."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from rich.console import Console

from consequence.config import TrainConfig
from consequence.distill.fixed_data import (
    check_token_ids,
    draw_fixed_batch,
    first_student_iteration,
    load_fixed_data,
    uses_fixed_data,
)
from consequence.policy.tiny import BUNDLED, load_policy
from consequence.records import ModelCall, Trajectory, read_trajectories, write_trajectories

BASE = dict(tasks_per_iteration=2, group_size=2, eval_every=0, final_eval_episodes=0, max_turns=2, max_new_tokens=16)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    """Train-split trajectories sampled by the bundled policy: a one-iteration GRPO run's batch."""
    from consequence.loop.train import train

    run = tmp_path_factory.mktemp("data") / "run"
    train(TrainConfig(run_dir=str(run), iterations=1, **BASE), Console(quiet=True))
    return run / "trajectories" / "iter_0000.parquet"


def test_lambda_is_the_fraction_of_student_iterations_and_is_seeded():
    for lam, lo, hi in ((0.3, 0.26, 0.34), (0.75, 0.71, 0.79)):
        student = sum(not uses_fixed_data(lam, 0, it) for it in range(2000)) / 2000
        assert lo < student < hi  # binomial sd ≈ 0.01
    assert not any(uses_fixed_data(1.0, 0, it) for it in range(100))
    assert all(uses_fixed_data(0.0, 0, it) for it in range(100))
    draws = [uses_fixed_data(0.5, 7, it) for it in range(50)]
    assert (
        draws == [uses_fixed_data(0.5, 7, it) for it in range(50)] != [uses_fixed_data(0.5, 8, it) for it in range(50)]
    )
    first = first_student_iteration(0.5, 7, 50)
    assert draws[first] is False and all(draws[:first])
    assert first_student_iteration(0.0, 7, 50) is None


def test_a_fixed_batch_is_a_seeded_draw_relabelled_as_not_the_students():
    pool = [
        Trajectory(
            task_id=f"p{k}#0-{k}",
            group_id=f"0/p{k}",
            sample_id=0,
            seed=k,
            policy_version=3,
            calls=[ModelCall([1, 2], [3], [-0.5], "stop")],
            reward=1.0,
        )
        for k in range(5)
    ]
    a, b = draw_fixed_batch(pool, 7, 0, 4), draw_fixed_batch(pool, 7, 0, 4)
    assert [t.task_id for t in a] == [t.task_id for t in b] != [t.task_id for t in draw_fixed_batch(pool, 7, 0, 5)]
    assert len({t.task_id for t in a[:5]}) == 5 and [t.task_id for t in a[5:]] == [t.task_id for t in a[:2]]
    assert {t.group_id for t in a} == {"4/fixed"} and {t.policy_version for t in a} == {-1}
    assert pool[0].group_id == "0/p0"  # the pool itself is not changed


@pytest.mark.slow
def test_load_refuses_other_splits_bad_ids_and_missing_files(tmp_path, data_file):
    from consequence.envs.registry import env_of

    env = env_of(TrainConfig(**BASE))
    trajs = read_trajectories(data_file)
    assert len(load_fixed_data(data_file, env.split)) == len([t for t in trajs if t.reward is not None])
    test_task = env.problem_ids()["test"][0]
    bad = [dataclasses.replace(trajs[0], task_id=f"{test_task}#0-0")] + trajs[1:]
    write_trajectories(tmp_path / "leak.parquet", bad)
    with pytest.raises(ValueError, match=f"task '{test_task}#0-0' is a test-split problem"):
        load_fixed_data(tmp_path / "leak.parquet", env.split)
    check_token_ids(trajs, 768, "--distill-data")
    with pytest.raises(ValueError, match="--distill-data: task .* outside the student's vocabulary of 100"):
        check_token_ids(trajs, 100, "--distill-data")
    with pytest.raises(ValueError, match="no such file"):
        load_fixed_data(tmp_path / "none.parquet", env.split)
    write_trajectories(tmp_path / "evalout" / "episodes.parquet", trajs)
    with pytest.raises(
        ValueError, match="is a folder: give a trajectories parquet file; did you mean .*episodes.parquet"
    ):
        load_fixed_data(tmp_path / "evalout", env.split)
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="not a trajectories parquet file"):
        load_fixed_data(tmp_path / "junk.parquet", env.split)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"distill_lambda": 0.5}, "give both, or neither"),
        ({"distill_data": "x.parquet"}, "give both, or neither"),
        ({"distill_lambda": 0.5, "distill_data": "x.parquet", "advantage": "reverse_kl"}, "give --distill-loss"),
        ({"group_size": 1}, "--group-size 1 gives a group-relative advantage nothing"),
        ({"group_size": 1, "advantage": "reverse_kl", "task_reward_weight": 0.5}, "--group-size 1"),
    ],
)
def test_settings_that_cannot_work_are_refused(kw, match, tmp_path):
    if kw.get("advantage") == "reverse_kl":
        kw = {**kw, "teacher": str(tmp_path)}
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kw)


@pytest.mark.slow
def test_lambda_zero_trains_the_divergence_on_the_data_only(tmp_path, teacher_dir, data_file):
    from consequence.loop.train import train

    cfg = TrainConfig(
        run_dir=str(tmp_path / "run"),
        iterations=2,
        distill_loss="reverse",
        teacher=str(teacher_dir),
        distill_lambda=0.0,  # a --task-reward-weight here is refused: nothing reads it (config.effects)
        distill_data=str(data_file),
        **BASE,
    )
    assert cfg.distill_data == str(data_file.resolve())
    train(cfg, Console(quiet=True))
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    data = read_trajectories(data_file)
    for it, m in enumerate(lines):
        assert m["fixed_data_batch"] == 1.0 and m["gen_tokens_total"] == 0 and m["success"] is None
        assert m["distill_divergence"] > 0 and "pre_step_checks" not in m
        drawn = read_trajectories(tmp_path / "run" / "trajectories" / f"iter_{it:04d}.parquet")
        assert [t.task_id for t in drawn] == [t.task_id for t in draw_fixed_batch(data, 4, 0, it)]
        assert m["distill_targets"] == sum(len(c.output_ids) for t in drawn for c in t.calls)
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["checks"]["results"] is None  # no student batch, so the pre-step checks never ran
    assert "no batch of the student's own samples" in manifest["checks"]["not_run"]
    assert manifest["splits_touched"][0]["purpose"] == "--distill-data batches (no rollout)"


@pytest.mark.slow
def test_a_fixed_batch_step_equals_the_divergence_alone(teacher_dir, data_file):
    """divergence_only: with --task-reward-weight 1 the step on data rows is the one of weight 0."""
    from consequence.credit.batch import assign_credit, training_rows
    from consequence.loop.learner import make_learner, update

    student, _ = load_policy(BUNDLED)
    teacher, _ = load_policy(teacher_dir)
    trajs = draw_fixed_batch(read_trajectories(data_file), 4, 0, 0)
    after = []
    for weight, only in ((1.0, True), (0.0, False), (1.0, False)):
        cfg = TrainConfig(distill_loss="reverse", teacher=str(teacher_dir), task_reward_weight=weight, **BASE)
        model = copy.deepcopy(student)
        learner = make_learner(cfg, model, teacher=teacher)
        rows, owner = training_rows(trajs)
        batch = assign_credit(trajs, rows, owner, cfg, pad_id=0)
        batch.advantages = [1.0 - 0.7 * j for j in range(len(rows))]  # a policy-gradient term would move weights
        update(batch, cfg, learner, 0, seed=0, divergence_only=only)
        after.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(after[0], after[1]) and not torch.equal(after[0], after[2])


@pytest.mark.slow
def test_cross_stage_a_past_checkpoint_teaches_with_groups_of_one(tmp_path):
    """GLM-5 §3.5: a later stage distils from an earlier checkpoint of the same run, G = 1."""
    from consequence.loop.train import train

    stage1 = tmp_path / "stage1"
    train(
        TrainConfig(
            run_dir=str(stage1),
            iterations=2,
            learning_rate=1e-3,
            **{
                **BASE,
                "eval_every": 1,
                "val_episodes": 2,
                "tasks_per_iteration": 4,
                "group_size": 4,
                "max_turns": 8,
                "max_new_tokens": 48,
            },
        ),  # budgets the warm start solves tasks in
        Console(quiet=True),
    )
    second = json.loads((stage1 / "metrics.jsonl").read_text().splitlines()[1])
    assert second["mixed_group_fraction"] > 0  # the second iteration moved the weights: final ≠ iter_0001
    past, last = stage1 / "checkpoints" / "iter_0001", stage1 / "checkpoints" / "final"
    assert past.is_dir() and last.is_dir()
    run = tmp_path / "stage2"
    cfg = TrainConfig(
        run_dir=str(run),
        iterations=1,
        model=str(last),
        teacher=str(past),
        advantage="reverse_kl",
        **{**BASE, "group_size": 1, "tasks_per_iteration": 4},
    )
    train(cfg, Console(quiet=True))
    (m,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert m["mixed_group_fraction"] == 0.0  # a group of one never differs from itself ...
    assert m["teacher_reverse_kl"] != 0.0 and m["rows_skipped_zero_advantage"] == 0.0  # ... the teacher does
    assert m["n_tokens"] == m["distill_targets"] > 0
    assert json.loads((run / "manifest.json").read_text())["checks"]["results"]  # the pre-step checks ran


@pytest.mark.slow
def test_data_of_another_split_seed_is_refused_before_a_warm_start_is_built(
    tmp_path, teacher_dir, data_file, monkeypatch
):
    """A new --split-seed builds a warm start (~30 min); the data is checked against that split first."""
    from consequence.loop.train import train

    monkeypatch.setenv("CONSEQUENCE_CACHE", str(tmp_path / "cache"))
    cfg = TrainConfig(
        run_dir=str(tmp_path / "run"),
        iterations=1,
        split_seed=7,
        distill_loss="jsd",
        teacher=str(teacher_dir),
        distill_lambda=0.5,
        distill_data=str(data_file),
        **BASE,
    )
    with pytest.raises(ValueError, match="--distill-data .* fixed data may hold train-split problems only"):
        train(cfg, Console(quiet=True))
    assert not (tmp_path / "run").exists() and not list((tmp_path / "cache").glob("**/warmstart.json"))


def test_pool_items_are_known_by_task_id_or_problem_id(tmp_path):
    """reasoning-gym's pool holds tasks (task_id 'letter_counting/2023'), repair's holds problems
    (problem_id): a trajectory's task id up to '#' is looked up in both."""
    from types import SimpleNamespace

    def traj(task_id):
        return Trajectory(
            task_id=task_id,
            group_id="g",
            sample_id=0,
            seed=0,
            policy_version=0,
            calls=[ModelCall([1, 2], [3], [-0.5], "stop")],
            reward=1.0,
        )

    splits = {
        "train": [SimpleNamespace(task_id="lc/1"), SimpleNamespace(problem_id="rep/a")],
        "test": [SimpleNamespace(task_id="lc/2")],
    }
    write_trajectories(tmp_path / "ok.parquet", [traj("lc/1#5-0"), traj("rep/a#7-3")])
    assert [t.task_id for t in load_fixed_data(tmp_path / "ok.parquet", splits)] == ["lc/1#5-0", "rep/a#7-3"]
    write_trajectories(tmp_path / "bad.parquet", [traj("lc/2#5-0")])
    with pytest.raises(ValueError, match="'lc/2#5-0' is a test-split problem"):
        load_fixed_data(tmp_path / "bad.parquet", splits)


def _pairable(data_file, out):
    """The data with, in every task, sample 0 verified and the others failed (a pair per task)."""
    trajs = [
        dataclasses.replace(
            t, reward=float(t.sample_id == 0), verifier_score=float(t.sample_id == 0), outcome="finished"
        )
        for t in read_trajectories(data_file)
    ]
    write_trajectories(out, trajs)
    return out


def test_dpo_draws_whole_tasks_that_hold_a_pair_and_refuses_data_without_one():
    from consequence.distill.fixed_data import draw_fixed_pairs

    def t(task, sample, score):
        call = ModelCall([1, 2], [3], [-0.5], "stop")
        return Trajectory(task, "old", sample, 0, 3, calls=[call], reward=score, verifier_score=score)

    pool = [t("a", 0, 1.0), t("a", 1, 0.0), t("b", 0, 1.0), t("b", 1, 1.0), t("c", 0, 0.0), t("c", 1, 1.0)]
    got = draw_fixed_pairs(pool, 3, 0, 7)  # b has no failure: only a and c can pair; 3 draws cycle them
    assert sorted({x.task_id for x in got}) == ["a", "c"] and len(got) == 6
    assert [x.group_id for x in got] == ["7/fixed/0"] * 2 + ["7/fixed/1"] * 2 + ["7/fixed/2"] * 2
    assert {x.policy_version for x in got} == {-1} and [x.task_id for x in got] == [
        x.task_id for x in draw_fixed_pairs(pool, 3, 0, 7)
    ]
    with pytest.raises(ValueError, match="no task with both a verified and a failed episode"):
        draw_fixed_pairs(pool[2:4], 1, 0, 0)


@pytest.mark.slow
def test_dpo_on_stored_pairs_trains_from_the_policys_own_log_probs(tmp_path, data_file):
    """Offline DPO: before the first step π_θ = π_ref, so every margin is 0 and the loss log 2,
    whatever sampler stored the data (its log-probs are not used); one pair per task drawn."""
    import math

    from consequence.loop.train import train
    from consequence.recipes import load_recipe

    data = _pairable(data_file, tmp_path / "pairs.parquet")
    cfg = load_recipe("dpo").train_config(
        run_dir=str(tmp_path / "run"), iterations=2, distill_lambda=0.0, distill_data=str(data), **BASE
    )
    train(cfg, Console(quiet=True))
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["dpo_pairs"] for m in lines] == [2.0, 2.0] and lines[0]["fixed_data_batch"] == 1.0
    assert lines[0]["dpo_loss"] == pytest.approx(math.log(2), abs=1e-6)  # the same weights, the same forward
    assert lines[0]["dpo_reward_margin"] == pytest.approx(0.0, abs=1e-6) and lines[0]["grad_norm"] > 0


def test_reference_log_probs_of_stored_rows_are_computed_once_per_reference_version():
    from consequence.loop.learner import credit, make_learner
    from consequence.recipes import load_recipe

    model, tok = load_policy(BUNDLED)
    cfg = load_recipe("dpo").train_config(distill_lambda=0.0, distill_data=str(BUNDLED / "config.json"), **BASE)
    learner = make_learner(cfg, model)
    calls = []

    class Counting(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask=None, **kw):
            calls.append(input_ids.shape[0])
            return self.inner(input_ids=input_ids, attention_mask=attention_mask)

    learner.reference = Counting(learner.reference)
    ids = [5, 6, 7, 8]
    trajs = [
        Trajectory(
            "a",
            "g",
            s,
            0,
            -1,
            calls=[ModelCall(ids[:2], ids[2:], [-1.0, -1.0], "stop")],
            reward=float(s == 0),
            verifier_score=float(s == 0),
        )
        for s in range(2)
    ]
    first = credit(trajs, cfg, learner, tok.pad_token_id, from_data=True)
    n = sum(calls)
    again = credit(copy.deepcopy(trajs), cfg, learner, tok.pad_token_id, from_data=True)
    assert n > 0 and sum(calls) == n and again.ref_logprobs == first.ref_logprobs  # served from the cache
    learner.reference_version = 1  # a refreshed reference (--ref-refresh-every): computed again
    credit(trajs, cfg, learner, tok.pad_token_id, from_data=True)
    assert sum(calls) == 2 * n

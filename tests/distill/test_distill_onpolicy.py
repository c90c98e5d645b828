"""On-policy distillation (--advantage reverse_kl): per-token advantages from a frozen teacher,
the teacher checks, and the cost metrics, on the tiny model."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from consequence.config import TrainConfig
from consequence.policy.tiny import BUNDLED, load_policy


def _cfg(run, teacher, **kw) -> TrainConfig:
    return TrainConfig(
        run_dir=str(run),
        iterations=2,
        tasks_per_iteration=2,
        group_size=2,
        eval_every=0,
        final_eval_episodes=0,
        max_turns=2,
        max_new_tokens=16,
        advantage="reverse_kl",
        teacher=str(teacher),
        **kw,
    )


@pytest.mark.slow
def test_advantages_are_teacher_minus_sampler_log_probs_per_token(tmp_path, teacher_dir, monkeypatch):
    import consequence.credit.batch as batch_module
    from consequence.loop.train import train

    seen = []
    real = batch_module.assign_credit

    def spy(trajs, rows, owner, cfg, **kw):
        b = real(trajs, rows, owner, cfg, **kw)
        seen.append((rows, kw["teacher_logprobs"], b))
        return b

    monkeypatch.setattr("consequence.loop.learner.assign_credit", spy)
    train(_cfg(tmp_path / "run", teacher_dir), Console(quiet=True))
    teacher, _ = load_policy(teacher_dir)
    from consequence.loop.learner import logprob_fn
    from consequence.update.step import compute_logprobs

    rows, t_lp, batch = seen[0]
    direct = compute_logprobs(teacher, rows, 0, logprob_fn(_cfg(tmp_path, teacher_dir)), 1.0)
    k1 = n = 0.0
    for r, lt, d, adv in zip(rows, t_lp, direct, batch.advantages):
        assert lt == pytest.approx(d, abs=1e-5)  # the teacher scored exactly these ids
        for j, m in enumerate(r.loss_mask):
            want = (lt[j] - r.old_logprobs[j]) if m else 0.0  # log π_T − log μ on targets, 0 elsewhere
            assert adv[j] == pytest.approx(want, abs=1e-5)  # float32 arithmetic
            k1 += (r.old_logprobs[j] - lt[j]) if m else 0.0
            n += m
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["teacher_reverse_kl"] == pytest.approx(k1 / n, abs=1e-6)
    assert metrics[0]["distill_targets"] == n and metrics[0]["teacher_s"] > 0
    assert metrics[0]["teacher_forward_tokens"] == sum(len(r.input_ids) for r in rows)
    assert abs(metrics[0]["teacher_reverse_kl"]) > 0.05  # the perturbed head really disagrees
    assert len(seen) == 2  # one credit assignment per iteration


def test_the_teacher_is_frozen_and_never_in_the_optimizer(teacher_dir):
    from consequence.distill.teacher_model import load_teacher
    from consequence.loop.learner import make_learner

    student, tok = load_policy(BUNDLED)
    teacher = load_teacher(teacher_dir, tok, log=lambda _: None)
    learner = make_learner(_cfg("/tmp/unused", teacher_dir), student, teacher=teacher)
    in_opt = {id(p) for g in learner.optimizer.param_groups for p in g["params"]}
    assert learner.teacher is teacher and not teacher.training
    assert all(not p.requires_grad and id(p) not in in_opt for p in teacher.parameters())
    with pytest.raises(ValueError, match="need a loaded teacher"):
        make_learner(_cfg("/tmp/unused", teacher_dir), student)


def test_task_reward_weight_adds_the_group_advantage():
    from consequence.credit.batch import assign_credit
    from consequence.records import ModelCall, TrainingRow, Trajectory

    cfg = TrainConfig(advantage="reverse_kl", teacher="/x", task_reward_weight=0.5)
    trajs = [
        Trajectory("a", "g", i, 0, 0, calls=[ModelCall([1], [2], [-1.0], "stop")], reward=float(i)) for i in range(2)
    ]
    rows = [TrainingRow([1, 2], [0, 1], [0.0, -1.0], traj_index=i) for i in range(2)]
    batch = assign_credit(trajs, rows, [0, 1], cfg, teacher_logprobs=[[0.0, -0.25], [0.0, -3.0]])
    # GRPO advantages of rewards (0, 1): −1, +1; per token: (log π_T − log μ) + 0.5 · A
    assert batch.advantages[0] == pytest.approx([0.0, 0.75 - 0.5], abs=1e-5)
    assert batch.advantages[1] == pytest.approx([0.0, -2.0 + 0.5], abs=1e-5)
    assert [t.advantage for t in trajs] == pytest.approx([0.25, -1.5], abs=1e-5)
    assert batch.metrics["teacher_reverse_kl"] == pytest.approx((-0.75 + 2.0) / 2)


def test_bad_teacher_settings_are_refused_before_any_work(tmp_path, teacher_dir):
    from consequence.distill.teacher_model import check_same_tokenizer

    with pytest.raises(ValueError, match="needs --teacher"):
        TrainConfig(advantage="reverse_kl")
    with pytest.raises(ValueError, match="--teacher is read only by distillation"):
        TrainConfig(teacher=str(teacher_dir))
    with pytest.raises(ValueError, match="--task-reward-weight is read only"):
        TrainConfig(task_reward_weight=0.5)
    with pytest.raises(ValueError, match="--top-k / --top-p"):
        TrainConfig(advantage="reverse_kl", teacher=str(teacher_dir), top_p=0.9)
    _, tok = load_policy(BUNDLED)
    _, other = load_policy(BUNDLED)
    other.add_tokens(["<extra-token>"])
    with pytest.raises(ValueError, match=rf"id {len(tok)} is '\(none\)' for the student and '<extra-token>'"):
        check_same_tokenizer(tok, other)
    from typer.testing import CliRunner

    from consequence.cli import app

    res = CliRunner().invoke(
        app,
        ["train", "--advantage", "reverse_kl", "--teacher", str(tmp_path / "nope"), "--run-dir", str(tmp_path / "r")],
        env={"COLUMNS": "200"},
    )
    assert res.exit_code == 2 and "--teacher" in res.output and not (tmp_path / "r").exists()

"""A Bradley-Terry reward model (reward/reward_model.py) on the bundled tiny model."""

import json
import math

import pytest
import torch

from consequence.policy.tiny import BUNDLED
from consequence.records import ModelCall, Trajectory
from consequence.reward.reward_model import (
    REWARD_MODEL_COMPONENT,
    RewardModel,
    apply_reward_model,
    bt_loss,
    episode_ids,
    split_pairs,
    train_reward_model,
)


def _episode(task, sample, answer_token, solved):
    call = ModelCall([3, 4, 5, 6], [8, 10, answer_token], [-1.0] * 3, "stop")
    return Trajectory(
        task, f"0/{task}", sample, 0, 0, calls=[call], reward=float(solved), verifier_score=float(solved),
        reward_components={"hidden_tests": float(solved)},
    )  # fmt: skip


def _data(n_tasks=10):
    """Per task: a verified episode ending in token 7 and a failed one ending in token 9."""
    return [e for k in range(n_tasks) for e in (_episode(f"t{k}", 0, 7, True), _episode(f"t{k}", 1, 9, False))]


def test_bt_loss_is_minus_the_mean_log_sigmoid_of_the_score_difference():
    # (2 − 0, 0 − 1): −(log σ(2) + log σ(−1)) / 2 = (log(1 + e^−2) + log(1 + e)) / 2 = 0.7200948…
    got = bt_loss(torch.tensor([2.0, 0.0]), torch.tensor([0.0, 1.0]))
    assert float(got) == pytest.approx((math.log1p(math.exp(-2)) + math.log1p(math.e)) / 2, rel=1e-6)


def test_a_padded_batch_scores_each_episode_at_its_last_real_token():
    torch.manual_seed(0)
    rm = RewardModel.from_causal_lm(BUNDLED)
    seqs = [[3, 4, 5], [3, 4, 5, 6, 8, 9], [rm.pad_id, 4]]  # the pad id inside an episode is content
    with torch.no_grad():
        batch = rm.scores(seqs)
        alone = torch.cat([rm.scores([s]) for s in seqs])
        hf = rm.model(input_ids=torch.tensor([seqs[1]])).logits[0, 0]  # transformers' own pooling, no padding
    # float32 attention over ≤ 6 positions; padding only adds masked terms: a few ulps of |r| ≤ 10
    assert torch.allclose(batch, alone, atol=1e-5) and float(batch[1]) == pytest.approx(float(hf), abs=1e-5)
    with pytest.raises(ValueError, match="cannot score an empty sequence"):
        rm.scores([[]])


def test_pairs_are_split_by_task_and_a_run_without_a_pair_is_refused():
    train, held = split_pairs(_data(10), 0.3, seed=0)
    assert len(train.chosen) == 7 and len(held.chosen) == 3 and not set(train.tasks) & set(held.tasks)
    assert episode_ids(_data(1)[0]) == [3, 4, 5, 6, 8, 10, 7]
    with pytest.raises(ValueError, match="no \\(verified, failed\\) pair among 2 episodes"):
        split_pairs(_data(1)[:1] * 2, 0.3, seed=0)
    with pytest.raises(ValueError, match="leaves no task on one side"):
        split_pairs(_data(1), 0.3, seed=0)


def test_training_learns_a_separable_preference_on_held_out_tasks(tmp_path):
    torch.manual_seed(0)
    rm = RewardModel.from_causal_lm(BUNDLED)
    train, held = split_pairs(_data(12), 0.25, seed=0)
    steps = []
    report = train_reward_model(
        rm, train, held, epochs=4, lr=3e-3, pairs_per_step=3, progress=lambda s, n: steps.append((s, n))
    )
    assert steps[-1] == (12, 12) and report["after"]["pairs"] == 3.0
    assert report["after"]["accuracy"] == 1.0  # the last token decides: 7 (verified) over 9 (failed)
    assert report["epochs"][-1]["train_loss"] < report["epochs"][0]["train_loss"] < math.log(2) + 0.5

    # saved and loaded: the same scores
    from consequence.policy.checkpoint import load_policy

    _, tok = load_policy(BUNDLED)
    out = rm.save(tmp_path / "rm", tok, {"heldout_accuracy": report["after"]["accuracy"]})
    again = RewardModel.load(out)
    with torch.no_grad():
        assert torch.equal(again.scores(held.chosen), rm.scores(held.chosen))
    with pytest.raises(FileExistsError, match="exists; give a new folder"):
        rm.save(out, tok, {})
    with pytest.raises(ValueError, match="not a reward model folder"):
        RewardModel.load(BUNDLED)


def test_the_learned_reward_is_a_weighted_component_and_the_verifier_is_kept():
    torch.manual_seed(0)
    rm = RewardModel.from_causal_lm(BUNDLED)
    trajs = _data(2)
    trajs[1].outcome, trajs[1].reward = "env_error", None
    with torch.no_grad():
        s = torch.sigmoid(rm.scores([episode_ids(trajs[0])]))[0].item()
    apply_reward_model(trajs, rm, 0.25)
    t = trajs[0]
    assert t.reward_components["hidden_tests"] == 0.75 and t.reward_components[REWARD_MODEL_COMPONENT] == pytest.approx(
        0.25 * s
    )
    assert t.reward == pytest.approx(0.75 + 0.25 * s) and t.verifier_score == 1.0
    assert trajs[1].reward is None and REWARD_MODEL_COMPONENT not in trajs[1].reward_components
    with pytest.raises(ValueError, match="must lie in \\[0, 1\\]"):
        apply_reward_model(trajs, rm, 1.5)


@pytest.mark.slow
def test_a_run_trains_on_the_learned_reward_and_keeps_the_verifier_apart(tmp_path):
    """A one-iteration run with --reward-model, weight ½: every scored episode's reward is
    ½ × the verifier's components + ½ σ(r), learned_reward_mean is the mean σ(r), and
    success stays the verifier's."""
    import json

    from rich.console import Console

    from consequence.config import TrainConfig
    from consequence.loop.train import train
    from consequence.policy.checkpoint import load_policy
    from consequence.records import read_trajectories

    torch.manual_seed(0)
    _, tok = load_policy(BUNDLED)
    rm_dir = RewardModel.from_causal_lm(BUNDLED).save(tmp_path / "rm", tok, {})
    cfg = TrainConfig(
        run_dir=str(tmp_path / "run"), reward_model=str(rm_dir), reward_model_weight=0.5, iterations=1,
        tasks_per_iteration=2, group_size=2, eval_every=0, final_eval_episodes=0, max_turns=2, max_new_tokens=16,
    )  # fmt: skip
    train(cfg, Console(quiet=True))
    m = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    trajs = [
        t for t in read_trajectories(tmp_path / "run" / "trajectories" / "iter_0000.parquet") if t.reward is not None
    ]
    rm = RewardModel.load(rm_dir)
    with torch.no_grad():
        sig = torch.sigmoid(rm.scores([episode_ids(t) for t in trajs])).tolist()
    for t, s in zip(trajs, sig):  # float32 scores of the same ids: equal up to rounding
        assert t.reward_components[REWARD_MODEL_COMPONENT] == pytest.approx(0.5 * s, abs=1e-6)
    assert m["learned_reward_mean"] == pytest.approx(sum(sig) / len(sig), abs=1e-6)
    assert m["success"] == sum(t.verifier_score == 1.0 and t.outcome == "finished" for t in trajs) / len(trajs)
    with pytest.raises(ValueError, match="not a reward model folder"):
        TrainConfig(reward_model=str(BUNDLED))


def test_the_cli_trains_reports_and_refuses_bad_input(tmp_path):
    from typer.testing import CliRunner

    from consequence.cli import app
    from consequence.records import write_trajectories

    write_trajectories(tmp_path / "eps.parquet", _data(10))
    run = lambda *a: CliRunner().invoke(app, ["reward-model", "train", *a])  # noqa: E731
    args = ["--data", str(tmp_path / "eps.parquet"), "--model", str(BUNDLED), "--epochs", "1", "--heldout", "0.3"]
    res = run(*args, "--out", str(tmp_path / "rm"))
    assert res.exit_code == 0, res.output
    meta = json.loads((tmp_path / "rm" / "reward_model.json").read_text())
    assert (meta["pairs_train"], meta["tasks_heldout"], meta["after"]["pairs"]) == (7, 3, 3.0)
    assert "held out, after" in res.output and f"{100 * meta['after']['accuracy']:.1f} %" in res.output
    res = run(*args, "--out", str(tmp_path / "rm"))
    assert res.exit_code == 2 and "exists; give a new folder" in res.output
    res = run("--data", str(tmp_path / "nope"), "--model", str(BUNDLED), "--out", str(tmp_path / "rm2"))
    assert res.exit_code == 2 and "no such file or folder" in res.output and not (tmp_path / "rm2").exists()

"""End-to-end smoke run of `consequence train` with tiny settings on the bundled warm start."""

import json

import pytest
import torch
from safetensors.torch import load_file

from consequence.config import TrainConfig
from consequence.distill.warmstart import BUNDLED
from consequence.evaluate.shortcuts import SHORTCUT_METRICS
from consequence.records import read_trajectories, trajectory_to_rows

pytestmark = pytest.mark.slow  # every test reads one module-scoped training run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from rich.console import Console

    from consequence.loop.train import train
    from reward_signal import ODD_SAMPLES_WIN

    run = tmp_path_factory.mktemp("run")
    cfg = TrainConfig(
        run_dir=str(run),
        model=str(BUNDLED),
        env=ODD_SAMPLES_WIN,  # mixed groups, so that the weights move
        iterations=2,
        tasks_per_iteration=2,
        group_size=4,
        eval_every=1,
        val_episodes=4,
        final_eval_episodes=6,
        learning_rate=1e-3,
    )
    train(cfg, Console(quiet=True))
    return run


def test_run_writes_every_artifact(run_dir):
    for name in [
        "config.yaml",
        "split.json",
        "metrics.jsonl",
        "curves.png",
        "report.md",
        "report.json",
        "trajectories/iter_0000.parquet",
        "trajectories/iter_0001.parquet",
        "checkpoints/final/model.safetensors",
    ]:
        assert (run_dir / name).exists(), name
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [0, 1]
    assert all(0.0 <= m["reward_mean"] <= 1.0 and "val_success" in m for m in metrics)
    assert all(type(m["env_retries"]) is int and m["env_retries"] >= 0 for m in metrics)
    shortcuts = [k for k, _ in SHORTCUT_METRICS]  # evaluate/shortcuts.py: per iteration, per final arm
    assert all(set(shortcuts) <= set(m) for m in metrics)
    report = json.loads((run_dir / "report.json").read_text())
    assert {(r["split"][:4], r["decoding"]) for r in report["results"]} == {
        ("test", "greedy"),
        ("test", "sampled"),
        ("trai", "greedy"),
        ("trai", "sampled"),
    }
    for r in report["results"]:
        assert set(shortcuts) <= set(r["warm_start"]) and set(shortcuts) <= set(r["rl"])
        c = r["comparison"]
        assert c["low"] <= c["diff"] <= c["high"] and c["episodes"] == 6
    manifest = json.loads((run_dir / "manifest.json").read_text())
    touched = [(t["split"], t["purpose"].split(" ")[0]) for t in manifest["splits_touched"]]
    assert touched == [("train", "RL"), ("validation", "greedy"), ("test", "final"), ("train", "final")]
    assert report["splits_touched"] == manifest["splits_touched"] and report["warnings"] == []
    assert "Splits touched:\n- train: RL rollouts\n- validation: greedy" in (run_dir / "report.md").read_text()


def test_loss_mask_covers_exactly_the_generated_tokens(run_dir):
    trajs = read_trajectories(run_dir / "trajectories" / "iter_0000.parquet")
    assert len(trajs) == 8 and {t.group_id for t in trajs} and all(t.calls for t in trajs)
    for i, t in enumerate(trajs):
        targets = []
        for row in trajectory_to_rows(t, i):
            assert len(row.loss_mask) == len(row.input_ids)
            targets += [tok for tok, m in zip(row.input_ids, row.loss_mask) if m]
        assert targets == [tok for c in t.calls for tok in c.output_ids]


def test_training_changes_the_weights(run_dir):
    before = load_file(BUNDLED / "model.safetensors")
    after = load_file(run_dir / "checkpoints" / "final" / "model.safetensors")
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)

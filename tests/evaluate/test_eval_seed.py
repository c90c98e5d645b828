"""The evaluation episodes of a training run are fixed by --eval-seed, not by --seed (issue 32):
two training seeds are evaluated on the same task instances and, for the same policy, the same
sampled tokens; another evaluation seed draws other episodes."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from rich.console import Console

from consequence.config import TrainConfig, saved_settings

SMALL = {"iterations": 1, "tasks_per_iteration": 2, "group_size": 2, "eval_every": 0, "final_eval_episodes": 6,
         "final_eval_splits": ["test"], "final_eval_decoding": ["sampled"]}  # fmt: skip


def _episodes(run, name: str):
    t = pq.read_table(run / "eval" / name).to_pylist()
    return [(e["task_id"], e["sample_id"]) for e in t], [[c["output_ids"] for c in e["calls"]] for e in t]


@pytest.mark.slow  # ~15 s: three one-iteration runs of the bundled model with a final evaluation
def test_two_training_seeds_are_evaluated_on_the_same_episodes(tmp_path):
    from consequence.loop.train import train

    runs = {}
    for name, kw in (("seed0", {"seed": 0}), ("seed1", {"seed": 1}), ("eval7", {"seed": 0, "eval_seed": 7})):
        runs[name] = tmp_path / name
        train(TrainConfig(run_dir=str(runs[name]), **SMALL, **kw), Console(quiet=True))
    ids0, tokens0 = _episodes(runs["seed0"], "test-sampled-warmstart.parquet")
    ids1, tokens1 = _episodes(runs["seed1"], "test-sampled-warmstart.parquet")
    assert len(ids0) == 6 and ids0 == ids1  # the same task instances
    assert tokens0 == tokens1  # the same policy sampled the same tokens: the same streams
    # the trained policies differ (another training seed), on the same tasks
    assert _episodes(runs["seed1"], "test-sampled-rl.parquet")[0] == ids0
    # another evaluation seed draws other episodes
    ids7, tokens7 = _episodes(runs["eval7"], "test-sampled-warmstart.parquet")
    assert ids7 != ids0 or tokens7 != tokens0


def test_a_run_saved_before_the_eval_seed_keeps_evaluating_with_its_training_seed():
    assert saved_settings({"seed": 3, "iterations": 2})["eval_seed"] == 3
    assert saved_settings({"run": {"seed": 3}, "evaluate": {"eval_seed": 0}})["eval_seed"] == 0
    assert "eval_seed" not in saved_settings({"iterations": 2})  # nothing to infer it from: the default

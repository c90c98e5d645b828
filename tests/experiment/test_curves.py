"""Learning curves over seeds and scale sweeps of an experiment (consequence.experiment.curves):
hand-made metrics.jsonl files and settings, every number by hand."""

from __future__ import annotations

import json
import math

import pytest

from consequence.experiment.curves import learning_curves, sweeps, t_band

T_975_2 = 4.302652729749464  # Student t, 97.5th percentile, 2 degrees of freedom (tables)


def test_t_band_by_hand():
    mean, low, high = t_band([0.2, 0.4, 0.6])  # mean 0.4, sample sd 0.2
    half = T_975_2 * 0.2 / math.sqrt(3)
    assert mean == pytest.approx(0.4, abs=1e-15)
    assert (low, high) == (pytest.approx(0.4 - half, rel=1e-12), pytest.approx(0.4 + half, rel=1e-12))
    assert t_band([0.7]) == (0.7, None, None)  # one seed: no spread to estimate
    with pytest.raises(ValueError, match="at least one"):
        t_band([])


def _metrics(run, lines):
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"iteration": i, **m}) + "\n" for i, m in enumerate(lines)))
    return run


def test_learning_curves_average_the_seeds_that_logged_each_point(tmp_path):
    s0 = _metrics(tmp_path / "a0", [{"success": 0.25}, {"success": 0.5, "val_success": 0.4}])
    s1 = _metrics(tmp_path / "a1", [{"success": 0.75}, {"success": None}])  # a fixed-data batch: no policy success
    sft = _metrics(tmp_path / "b0", [{"success": None}, {"success": None}])
    curves = learning_curves({"a": [s0, s1], "b": [sft]}, {"a": 16, "b": 8})
    a = curves["a"]["success"]
    assert a["episodes"] == [16, 32]  # (k + 1)·B·G
    assert a["mean"] == [0.5, 0.5] and a["n_seeds"] == [2, 1]
    half = 12.706204736174698 * math.sqrt(0.125) / math.sqrt(2)  # t(0.975, 1) · sd([0.25, 0.75]) / √2
    assert a["low"][0] == pytest.approx(0.5 - half, rel=1e-12) and a["high"][0] == pytest.approx(0.5 + half, rel=1e-12)
    assert (a["low"][1], a["high"][1]) == (None, None)
    assert curves["a"]["val_success"] == {
        "episodes": [32],
        "mean": [0.4],
        "low": [None],
        "high": [None],
        "n_seeds": [1],
    }
    assert curves["b"] == {}  # nothing the policy sampled was logged


def test_sweeps_find_settings_that_vary_among_arms_that_otherwise_agree():
    base = {"recipe": "grpo", "learning_rate": 1e-3, "train_problems": None, "group_size": 8, "tasks_per_iteration": 8}
    settings = {
        "n16": {**base, "train_problems": 16, "seed": 0, "run_dir": "x"},
        "n64": {**base, "train_problems": 64, "seed": 0, "run_dir": "y"},
        "all": {**base, "seed": 0, "run_dir": "z"},
        "dapo": {**base, "recipe": "dapo"},  # another recipe: not a point of the sweep
        "g4": {**base, "recipe": "rloo", "group_size": 4, "tasks_per_iteration": 16},
        "g8": {**base, "recipe": "rloo"},
    }
    whole_split = 625

    def value_of(arm, key):
        v = settings[arm].get(key)
        return whole_split if key == "train_problems" and v is None else v

    got = sweeps(settings, value_of)
    assert got["train_problems"]["arms"] == {"n16": 16, "n64": 64, "all": 625}
    assert got["group_size"]["arms"] == {"g4": 4, "g8": 8}  # G at a fixed budget moves B with it
    assert got["tasks_per_iteration"]["arms"] == {"g4": 16, "g8": 8}
    assert set(got) == {"train_problems", "group_size", "tasks_per_iteration"}
    assert sweeps({"a": base, "b": {**base, "recipe": "dapo"}}, value_of) == {}

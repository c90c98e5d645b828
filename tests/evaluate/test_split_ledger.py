"""The test-reuse warning fires only when another policy's earlier test result could have
chosen the one evaluated now (the rule in consequence/evaluate/splits.py)."""

import json
import os
import time

import pytest
import yaml
from typer.testing import CliRunner

from consequence.distill.warmstart import BUNDLED
from consequence.evaluate.splits import earlier_choosers, read_ledger, record_touch, reuse_warning, weights_sha256
from policy_copies import fake_run, other_policy

CFG = {"tasks": "repair", "split_seed": 0, "learning_rate": 2e-4, "iterations": 18}


def _age(folder, seconds=3600):
    """Make a checkpoint's weights look written ``seconds`` ago."""
    for w in folder.glob("*.safetensors"):
        st = w.stat()
        os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns - seconds * 10**9))


def test_re_evaluating_a_policy_after_others_were_tested_does_not_warn(tmp_path):
    path = tmp_path / "ledger.jsonl"
    p = other_policy(tmp_path / "p")
    _age(p)  # p existed before any test result below
    record_touch("repair", 0, "test", "consequence eval", [str(p)], path)
    q = other_policy(tmp_path / "q", 2e-6)
    record_touch("repair", 0, "test", "consequence eval", [str(q)], path)  # q tested after p was made
    assert reuse_warning("repair", 0, [str(p)], path) is None
    # q was made after p's test result existed: that result could have chosen q
    assert earlier_choosers("repair", 0, [str(q)], path) == [str(p.resolve())]


def test_a_result_recorded_before_the_weights_were_written_counts(tmp_path):
    path = tmp_path / "ledger.jsonl"
    record_touch("repair", 0, "test", "consequence eval", [str(BUNDLED)], path)
    time.sleep(0.02)
    new = other_policy(tmp_path / "new")
    w = reuse_warning("repair", 0, [str(new)], path)
    assert w is not None and f"1 other policy ({BUNDLED.resolve()};" in w and "before the weights" in w
    _age(new)  # the same weights, written before that result: it could not have chosen them
    assert reuse_warning("repair", 0, [str(new)], path) is None


def test_a_repeat_of_a_runs_settings_does_not_warn_and_a_change_does(tmp_path):
    path = tmp_path / "ledger.jsonl"
    first = fake_run(tmp_path / "first", 1e-6, **CFG)
    record_touch(
        "repair",
        0,
        "test",
        "final evaluation of consequence train",
        [str(BUNDLED), str(first / "checkpoints" / "final")],
        path,
    )
    time.sleep(0.02)
    # `consequence reproduce` (same config, new folder) and another seed: other weights, same settings
    again = fake_run(tmp_path / "first-reproduce", 2e-6, **CFG)
    seed = fake_run(tmp_path / "seed1", 3e-6, **{**CFG, "seed": 1})
    for run in (again, seed):
        assert reuse_warning("repair", 0, [str(BUNDLED), str(run / "checkpoints" / "final")], path) is None
    tuned = fake_run(tmp_path / "tuned", 4e-6, **{**CFG, "learning_rate": 1e-3})
    assert earlier_choosers("repair", 0, [str(BUNDLED), str(tuned / "checkpoints" / "final")], path) == [
        str((first / "checkpoints" / "final").resolve())
    ]
    cfg = yaml.safe_load((again / "config.yaml").read_text())
    assert cfg["run_dir"] != str(first)  # the repeat differs in its folder only


def test_reproducing_the_same_run_bit_for_bit_is_the_same_policy(tmp_path):
    path = tmp_path / "ledger.jsonl"
    a = other_policy(tmp_path / "a")
    record_touch("repair", 0, "test", "consequence eval", [str(a)], path)
    time.sleep(0.02)
    b = other_policy(tmp_path / "b")  # written later, identical bytes
    assert reuse_warning("repair", 0, [str(b)], path) is None
    assert read_ledger(path)[0]["weights_sha256"][0] == weights_sha256(b) == weights_sha256(a)


def test_old_ledger_lines_without_hashes_still_count_by_path(tmp_path):
    path = tmp_path / "ledger.jsonl"
    path.write_text(
        json.dumps(
            {
                "time": "2020-01-01T00:00:00",
                "tasks": "repair",
                "split_seed": 0,
                "split": "test",
                "policies": ["/nowhere/old"],
                "fingerprints": ["/nowhere/old|"],
            }
        )
        + "\n"
    )
    new = other_policy(tmp_path / "new")
    assert earlier_choosers("repair", 0, [str(new)], path) == ["/nowhere/old"]
    assert earlier_choosers("repair", 0, ["/nowhere/old"], path) == []


@pytest.mark.slow
def test_eval_twice_of_the_same_policy_with_another_in_between_warns_never(tmp_path):
    from consequence.cli import app

    ledger = tmp_path / "split-ledger.jsonl"
    p = other_policy(tmp_path / "p")
    _age(p)
    args = ["eval", "--split", "test", "--problems", "1", "-n", "1", "--no-recovery", "--selection", "first"]
    runner = CliRunner()
    for i, model in enumerate((p, BUNDLED, p)):
        res = runner.invoke(app, args + ["--model", str(model), "--out", str(tmp_path / f"e{i}")])
        assert res.exit_code == 0, res.output
        assert json.loads((tmp_path / f"e{i}" / "eval.json").read_text())["warnings"] == [], i
    assert [e["split"] for e in read_ledger(ledger)] == ["test"] * 3

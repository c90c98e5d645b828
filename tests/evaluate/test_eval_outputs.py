"""What `consequence eval` promises about its problems and its output folder: an evaluation
over no problem is refused before any work; the count said up front is the count run; the
"written" line lists exactly the files this run wrote, and an earlier run's files that this
one did not write do not survive in a reused folder."""

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from consequence.cli import app
from consequence.envs.registry import load_environment
from consequence.evaluate.run import check_problems, problem_count
from consequence.records import read_trajectories

WIDE = {"COLUMNS": "400"}  # one error line, not wrapped
# calculator with 20 problems: 2 in validation (split by problem, 80 / 10 / 10); short episodes
SMALL = [
    "--env",
    "calculator",
    "--env-option",
    "n_problems=20",
    "-n",
    "1",
    "--max-turns",
    "2",
    "--max-new-tokens",
    "16",
]


@pytest.mark.parametrize("command", [["eval"], ["compare", "A", "B"]])
def test_an_evaluation_of_an_empty_split_is_refused_before_any_work(tmp_path, command):
    ledger = Path(os.environ["CONSEQUENCE_LEDGER"])
    before = ledger.read_text() if ledger.exists() else None
    out = tmp_path / "e"
    args = [*command, "--env", "calculator", "--env-option", "shift=true", "--split", "train", "-n", "1"]
    res = CliRunner().invoke(app, [*args, "--out", str(out)], env=WIDE)
    assert res.exit_code == 2, res.output
    assert "error: --env calculator: option shift=true is the held-out shift, for evaluation only" in res.output
    assert "--split train needs one; evaluate on --split validation or --split test" in res.output
    assert "Traceback" not in res.output and not out.exists()  # nothing written, no model loaded
    assert (ledger.read_text() if ledger.exists() else None) == before  # no split touched
    # the same split on validation has problems: no refusal (negative control)
    shift = load_environment("calculator", 0, {"shift": True})
    check_problems(shift, "validation")
    assert len(shift.split["train"]) == 0 and len(shift.split["validation"]) > 0


def test_an_empty_split_of_any_environment_is_refused_naming_it():
    env = load_environment("calculator", 0)
    env.split["validation"] = []
    with pytest.raises(
        ValueError, match=r"the validation split is empty \(split by problem: train 480, validation 0, "
    ):
        check_problems(env, "validation")
    with pytest.raises(ValueError, match="--split validation needs it; give a split that holds problems"):
        check_problems(env, "validation")
    check_problems(env, "test")  # 60 problems: accepted


def test_the_problem_count_is_the_split_cut_to_problems():
    env = load_environment("calculator", 0)  # validation: 60 problems
    assert [problem_count(env, "validation", p) for p in (0, 3, 60, 300)] == [60, 3, 60, 60]


def test_a_reused_out_folder_lists_only_this_runs_files_and_drops_the_earlier_ones(tmp_path):
    out = tmp_path / "e"
    runner = CliRunner()
    first = runner.invoke(app, ["eval", *SMALL, "--problems", "1", "--out", str(out)], env=WIDE)
    assert first.exit_code == 0, first.output
    # 1 of the 2 validation problems, said up front as it is run
    assert "calculator validation: 1 of the 2 problems of the split (drawn with --seed) × n = 1" in first.output
    assert json.loads((out / "eval.json").read_text())["settings"]["problems"] == 1
    # the calculator has no wrong first patch: the recovery diagnostic ran nothing and wrote no file
    assert f"written: {out}/eval.json, episodes.parquet, report.md, cost.png\n" in first.output
    assert not (out / "recovery_episodes.parquet").exists()
    (out / "recovery_episodes.parquet").write_text("an earlier run's")  # as an earlier repair eval leaves it
    (out / "notes.txt").write_text("mine")
    second = runner.invoke(app, ["eval", *SMALL, "--problems", "5", "--no-recovery", "--out", str(out)], env=WIDE)
    assert second.exit_code == 0, second.output
    assert (
        "calculator validation: all 2 problems of the split (--problems 5 asks for more than it holds)" in second.output
    )
    assert f"written: {out}/eval.json, episodes.parquet, report.md, cost.png\n" in second.output
    assert f"removed from an earlier evaluation in {out}: recovery_episodes.parquet" in second.output
    assert sorted(p.name for p in out.iterdir()) == [
        "cost.png",
        "episodes.parquet",
        "eval.json",
        "notes.txt",
        "report.md",
    ]
    result = json.loads((out / "eval.json").read_text())
    assert result["settings"]["problems"] == 2 and "recovery_episodes_file" not in result
    assert len(read_trajectories(out / "episodes.parquet")) == 2  # this run's episodes, not the first run's one

"""eval / compare take split seed, task source and budgets from a run folder's config.yaml;
options override them; compare refuses runs that disagree, and A = B; every linked file exists."""

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from consequence.cli import app
from consequence.distill.warmstart import BUNDLED
from consequence.envs.repair.problems import load_split
from consequence.evaluate.settings import describe, resolve_settings
from policy_copies import fake_run

FAST = ["--problems", "2", "-n", "1", "--no-recovery"]
RUN_CFG = {"tasks": "repair", "split_seed": 1, "max_turns": 2, "max_new_tokens": 16, "max_total_tokens": 1024}


def _links_exist(md: Path) -> list[str]:
    """Local link targets of a Markdown file that do not exist beside it."""
    targets = re.findall(r"\]\(([^)#\s]+)\)", md.read_text())
    return [t for t in targets if "://" not in t and not (md.parent / t).exists()]


def test_settings_come_from_the_run_and_options_override():
    st = resolve_settings([("", None)], {"split_seed": None})
    assert st.values == {
        "env": "repair",
        "tasks_file": None,
        "env_options": {},
        "split_seed": 0,
        "max_turns": 8,
        "max_new_tokens": 48,
        "max_total_tokens": 768,
    } and set(st.origin.values()) == {"default"}


@pytest.mark.slow
def test_eval_of_a_run_uses_its_split_seed_and_budgets(tmp_path):
    run = fake_run(tmp_path / "run", **RUN_CFG)
    res = CliRunner().invoke(
        app, ["eval", "--model", str(run), *FAST, "--selection", "first", "--out", str(tmp_path / "e")]
    )
    assert res.exit_code == 0, res.output
    out = json.loads((tmp_path / "e" / "eval.json").read_text())
    s = out["settings"]
    assert s["split_seed"] == 1 and s["model"] == str(run / "checkpoints" / "final")
    assert s["budgets"] == {"max_turns": 2, "max_new_tokens": 16, "max_total_tokens": 1024, "max_tool_calls": 10}
    # the run's config.yaml is of the older format (tasks: repair): read as env: repair
    assert {k: v["from"] for k, v in s["provenance"]["keys"].items()} == {
        "env": "run",
        "tasks_file": "default",
        "env_options": "default",
        **dict.fromkeys(list(RUN_CFG)[1:], "run"),
    }
    # the problems are validation problems of the run's split (seed 1), not of seed 0
    ids = {t["problem_id"] for t in out["per_task"]}
    assert ids <= {p.problem_id for p in load_split(1)["validation"]}
    assert not ids & {p.problem_id for p in load_split(1)["train"]}
    line = "Settings from the run (`%s`): environment repair, split seed 1, max_turns 2" % (run / "config.yaml")
    assert line in res.output and line in (tmp_path / "e" / "report.md").read_text()
    assert _links_exist(tmp_path / "e" / "report.md") == []


def test_an_option_overrides_the_run_and_the_report_says_so(tmp_path):
    run = fake_run(tmp_path / "run", **RUN_CFG)
    res = CliRunner().invoke(
        app,
        [
            "eval",
            "--model",
            str(run),
            *FAST,
            "--selection",
            "first",
            "--max-total-tokens",
            "512",
            "--split-seed",
            "0",
            "--out",
            str(tmp_path / "e"),
        ],
    )
    assert res.exit_code == 0, res.output
    s = json.loads((tmp_path / "e" / "eval.json").read_text())["settings"]
    assert s["budgets"]["max_total_tokens"] == 512 and s["split_seed"] == 0 and s["budgets"]["max_turns"] == 2
    keys = s["provenance"]["keys"]
    assert keys["max_total_tokens"] == {"value": 512, "from": "option", "runs": {"": 1024}}
    assert keys["max_turns"]["from"] == "run"
    assert (
        "overridden on the command line: split seed 0 (--split-seed; run: 1), max_total_tokens 512 "
        "(--max-total-tokens; run: 1024)"
    ) in (tmp_path / "e" / "report.md").read_text()


@pytest.mark.slow
def test_humaneval_completion_takes_the_runs_split_seed(tmp_path):
    from consequence.envs.humaneval.code_tasks import humaneval_split

    run = fake_run(tmp_path / "run", **{**RUN_CFG, "tasks": "humaneval-repair"})
    res = CliRunner().invoke(
        app,
        [
            "eval",
            "--model",
            str(run),
            "--tasks",
            "humaneval",
            "--problems",
            "2",
            "-n",
            "1",
            "--max-new-tokens",
            "4",
            "--out",
            str(tmp_path / "h"),
        ],
    )
    assert res.exit_code == 0, res.output
    out = json.loads((tmp_path / "h" / "eval.json").read_text())
    assert out["settings"]["split_seed"] == 1 and out["settings"]["max_new_tokens"] == 4
    assert {r["task_id"] for r in out["per_task"]} <= humaneval_split(1)["validation"]
    assert out["settings"]["provenance"]["keys"]["split_seed"]["from"] == "run"
    bad = CliRunner().invoke(app, ["eval", "--tasks", "humaneval", "--max-turns", "3", "--out", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "error: --max-turns" in bad.output


@pytest.mark.parametrize(
    "key, a, b, option", [("split_seed", 0, 1, "--split-seed"), ("max_total_tokens", 768, 1024, "--max-total-tokens")]
)
def test_compare_refuses_runs_that_disagree_unless_overridden(tmp_path, key, a, b, option):
    ra = fake_run(tmp_path / "ra", 1e-6, **{**RUN_CFG, key: a})
    rb = fake_run(tmp_path / "rb", 2e-6, **{**RUN_CFG, key: b})
    res = CliRunner().invoke(app, ["compare", str(ra), str(rb), *FAST, "--out", str(tmp_path / "c")])
    assert res.exit_code == 2
    assert f"A was trained with {option} {a}, B was trained with {option} {b}" in res.output
    assert f"pass {option}" in res.output and not (tmp_path / "c" / "compare.json").exists()


@pytest.mark.slow
def test_compare_of_two_runs_shares_their_settings_and_links_only_written_files(tmp_path):
    ra = fake_run(tmp_path / "ra", 1e-6, **RUN_CFG)
    rb = fake_run(tmp_path / "rb", 2e-6, **{**RUN_CFG, "max_turns": 3})
    res = CliRunner().invoke(
        app, ["compare", str(ra), str(rb), *FAST, "--max-turns", "2", "--out", str(tmp_path / "c")]
    )
    assert res.exit_code == 0, res.output
    out = json.loads((tmp_path / "c" / "compare.json").read_text())
    for arm in ("a", "b"):
        assert out[arm]["settings"]["split_seed"] == 1 and out[arm]["settings"]["budgets"]["max_turns"] == 2
    keys = out["a"]["settings"]["provenance"]["keys"]
    assert keys["max_turns"] == {"value": 2, "from": "option", "runs": {"A": 2, "B": 3}}
    assert keys["split_seed"] == {"value": 1, "from": "run", "runs": {"A": 1, "B": 1}}
    md = tmp_path / "c" / "compare.md"
    assert "overridden on the command line: max_turns 2 (--max-turns; run: 2, 3)" in md.read_text()
    assert "cost-a.png" in md.read_text() and _links_exist(md) == []


def test_compare_refuses_the_same_policy_twice(tmp_path):
    copy = tmp_path / "copy"
    import shutil

    shutil.copytree(BUNDLED, copy)
    runner = CliRunner()
    same = runner.invoke(app, ["compare", str(BUNDLED), str(BUNDLED) + "/", "--out", str(tmp_path / "c")])
    assert same.exit_code == 2 and "A and B are the same checkpoint folder" in same.output
    twin = runner.invoke(app, ["compare", str(BUNDLED), str(copy), "--out", str(tmp_path / "c")])
    assert twin.exit_code == 2 and "have identical weights (sha256" in twin.output
    run = fake_run(tmp_path / "run")
    inside = runner.invoke(app, ["compare", str(run), str(run / "checkpoints" / "final"), "--out", str(tmp_path / "c")])
    assert inside.exit_code == 2 and "same checkpoint folder" in inside.output
    assert not Path(__import__("os").environ["CONSEQUENCE_LEDGER"]).exists()


def test_describe_without_a_run_names_options_and_defaults():
    st = resolve_settings([("", None)], {"split_seed": 3})
    assert describe(st.record()) == (
        "Settings not a run folder, so nothing is taken from a run; given on the command "
        "line: split seed 3; defaults: environment repair, max_turns 8, max_new_tokens 48, "
        "max_total_tokens 768."
    )


def test_a_missing_task_file_from_a_run_is_an_error_before_any_work(tmp_path):
    run = fake_run(tmp_path / "run", **{**RUN_CFG, "tasks": str(tmp_path / "mine.jsonl")})
    res = CliRunner().invoke(app, ["eval", "--model", str(run), "--out", str(tmp_path / "e")])
    assert res.exit_code == 2 and f"--tasks-file {tmp_path / 'mine.jsonl'}: no such file" in res.output

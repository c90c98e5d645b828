"""``consequence experiment``: the experiment file's checks, equal budgets, and a killed
experiment that resumes without re-running a finished run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from consequence.cli import app
from consequence.experiment.run import arm_budgets, check_budgets
from consequence.experiment.spec import load_experiment

TINY = {
    "iterations": 2,
    "tasks_per_iteration": 2,
    "group_size": 2,
    "eval_every": 0,
    "final_eval_episodes": 2,
    "final_eval_splits": ["test"],
    "final_eval_decoding": ["sampled"],
    "skip_checks": True,
}


def _write(tmp_path: Path, data: dict, name: str = "plan.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_equal_budgets_pass_and_unequal_ones_are_refused_with_each_arms_spend(tmp_path):
    plan = {"base": TINY, "seeds": [0, 1], "arms": {"base": "none", "grpo": {}, "rloo": {"advantage": "rloo"}}}
    exp = load_experiment(_write(tmp_path, plan), tmp_path / "out")
    assert check_budgets(exp) == {"grpo": (8.0, "K·B·G = 2·2·2"), "rloo": (8.0, "K·B·G = 2·2·2")}
    assert [(a.name, s) for a, s in exp.runs()] == [("grpo", 0), ("grpo", 1), ("rloo", 0), ("rloo", 1)]
    # G = 4 doubles rloo's episodes: refused, each arm's spend named
    plan["arms"]["rloo"]["group_size"] = 4
    exp = load_experiment(_write(tmp_path, plan), tmp_path / "out")
    with pytest.raises(ValueError, match=r"episodes differ: grpo 8 \(K·B·G = 2·2·2\); rloo 16 \(K·B·G = 2·2·4\)"):
        check_budgets(exp)
    # ... and equal again at half the iterations
    plan["arms"]["rloo"]["iterations"] = 1
    assert check_budgets(load_experiment(_write(tmp_path, plan), tmp_path / "out"))["rloo"][0] == 8.0
    # generated tokens: × each arm's L_max unless mean_tokens is given
    plan["arms"]["rloo"] = {"advantage": "rloo", "max_new_tokens": 24}
    plan["budget"] = {"equalise": "generated_tokens"}
    exp = load_experiment(_write(tmp_path, plan), tmp_path / "out")
    assert arm_budgets(exp) == {
        "grpo": (8 * min(8 * 48, 768), "K·B·G·L̄ = 8·384"),
        "rloo": (8 * min(8 * 24, 768), "K·B·G·L̄ = 8·192"),
    }
    with pytest.raises(ValueError, match="generated tokens differ"):
        check_budgets(exp)
    plan["budget"] = {"equalise": "generated_tokens", "mean_tokens": 100}
    assert check_budgets(load_experiment(_write(tmp_path, plan), tmp_path / "out"))["rloo"][0] == 800
    plan["budget"] = {"equalise": "generated_tokens", "allow_unequal": True}
    assert check_budgets(load_experiment(_write(tmp_path, plan), tmp_path / "out"))["rloo"][0] == 8 * 192


def test_an_sft_arm_counts_its_demonstrations_as_episodes(tmp_path):
    """λ = 0: every batch is drawn from --distill-data; its K·B·G episodes are the arm's budget."""
    (tmp_path / "demos.parquet").write_bytes(b"")  # read by the run, not by the plan
    sft = {"recipe": "rejection_sft", "distill_lambda": 0.0, "distill_data": str(tmp_path / "demos.parquet")}
    half = {**sft, "distill_lambda": 0.5}
    plan = {"base": TINY, "seeds": [0], "arms": {"grpo": {}, "sft": sft, "half": half}}
    assert check_budgets(load_experiment(_write(tmp_path, plan), tmp_path / "out")) == {
        "grpo": (8.0, "K·B·G = 2·2·2"),
        "sft": (8.0, "λ·K·B·G = 0·8 + (1−λ)·K·B·G data = 0 + 8"),
        "half": (8.0, "λ·K·B·G = 0.5·8 + (1−λ)·K·B·G data = 4 + 4"),
    }


@pytest.mark.parametrize(
    "change,said",
    [
        ({"seeds": []}, "seeds must be a non-empty list"),
        ({"seeds": [0, 0]}, "lists a seed twice"),
        ({"colour": 1}, "unknown key(s) colour"),
        ({"arms": {"a": "none"}}, "no arm trains"),
        ({"arms": {"a": None}}, "arms.a is empty: write {} to train with the base settings"),
        ({"arms": {"a": {"recipe": 5}}}, "arms.a.recipe must be a recipe name"),
        ({"seeds": [True]}, "seeds must be a non-empty list"),
        ({"name": "../../etc"}, "name '../../etc' must be letters"),
        ({"budget": {"allow_unequal": "no"}}, "budget.allow_unequal must be true or false"),
        ({"budget": {"tolerance": -1}}, "budget.tolerance must be a finite number >= 0"),
        ({"budget": {"tolerance": float("nan")}}, "budget.tolerance must be a finite number"),
        ({"budget": {"tolerence": 0.1}}, "budget: unknown key(s) tolerence"),
        ({"budget": {"mean_tokens": 100}}, "budget.mean_tokens is read only with equalise: generated_tokens"),
        ({"budget": {"equalise": "generated_tokens", "mean_tokens": "lots"}}, "budget.mean_tokens must be a finite"),
        ({"budget": {"equalise": "generated_tokens", "mean_tokens": 0}}, "budget.mean_tokens must be above 0"),
        ({"arms": {"a": {"seed": 3}}}, "arms.a.seed: the experiment sets it"),
        ({"base": {**TINY, "run_dir": "x"}}, "base.run_dir: the experiment sets it"),
        ({"budget": "cpu_seconds"}, "CPU seconds are known only after a run"),
        ({"budget": {"equalise": "episodes", "margin": 1}}, "budget: unknown key(s) margin"),
        ({"arms": {"bad name!": {}}}, "must be letters, digits"),
    ],
)
def test_a_bad_experiment_file_is_refused_naming_the_key(tmp_path, change, said):
    plan = {"base": TINY, "seeds": [0], "arms": {"grpo": {}}, **change}
    with pytest.raises(ValueError) as e:
        load_experiment(_write(tmp_path, plan))
    assert said in str(e.value) and "plan.yaml" in str(e.value)


def test_the_cli_shows_the_plan_and_refuses_before_any_work(tmp_path):
    runner = CliRunner()
    ok = _write(tmp_path, {"base": TINY, "seeds": [0, 1], "arms": {"none_arm": "none", "grpo": {}}})
    r = runner.invoke(app, ["experiment", str(ok), "--out", str(tmp_path / "out"), "--dry-run"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "2 training seeds" in r.output and "K·B·G = 2·2·2" in r.output and "no training" in r.output
    assert not (tmp_path / "out").exists()  # nothing written by a dry run
    bad = _write(tmp_path, {"base": TINY, "seeds": [0], "arms": {"a": {}, "b": {"group_size": 4}}}, "bad.yaml")
    r = runner.invoke(app, ["experiment", str(bad), "--out", str(tmp_path / "out")], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and "episodes differ" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["experiment", str(tmp_path / "missing.yaml")])
    assert r.exit_code == 2 and "no such experiment file" in r.output
    (tmp_path / "afile").write_text("")
    for args, said in (
        (["--out", str(tmp_path / "afile"), "--dry-run"], "--out"),
        (["--out", str(tmp_path / "x"), "--dry-run", "--pilot", "2"], "give one of them"),
        (["--out", str(tmp_path / "x"), "--pilot", "0"], "--pilot"),
    ):
        r = runner.invoke(app, ["experiment", str(ok), *args], env={"COLUMNS": "200"})
        assert r.exit_code == 2 and said in r.output and "Traceback" not in r.output, r.output
    nomodel = _write(tmp_path, {"base": {**TINY, "model": str(tmp_path / "nomodel")}, "seeds": [0], "arms": {"a": {}}})
    r = runner.invoke(
        app, ["experiment", str(nomodel), "--out", str(tmp_path / "y"), "--dry-run"], env={"COLUMNS": "200"}
    )
    assert r.exit_code == 2 and "arm a: --model" in r.output and not (tmp_path / "y").exists()
    bad = _write(tmp_path, {"base": TINY, "seeds": [0], "arms": {"a": {"advantage": "nope"}}}, "bad2.yaml")
    r = runner.invoke(app, ["experiment", str(bad)], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and "arm a:" in r.output and "advantage" in r.output


@pytest.mark.slow  # ~60 s: Ray twice, two tiny runs
def test_kill_minus_9_then_the_same_command_skips_the_finished_run(tmp_path):
    """The runs go one at a time (--cpus-per-run 2 on a 2-CPU local Ray); the experiment is
    killed with SIGKILL (its whole process group) once the first run has finished and the second
    has started. The same command then trains the second (from scratch or its resume state) and
    leaves the first exactly as it was."""
    plan = _write(tmp_path, {"base": TINY, "seeds": [0, 1], "arms": {"grpo": {}}})
    out = tmp_path / "out"
    argv = [sys.executable, "-c", "from consequence.cli import app; app()", "experiment", str(plan), "--out", str(out)]
    cpus = ["--cpus-per-run", str(max(os.cpu_count() or 1, 2))]
    proc = subprocess.Popen(
        [*argv, *cpus], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    first, second = out / "runs" / "grpo-seed0", out / "logs" / "grpo-seed1.log"
    deadline = time.time() + 480  # generous: CI machines are shared, the runs take ~60 s alone
    while time.time() < deadline and not (_finished(first) and second.exists()):
        assert proc.poll() is None, "the experiment ended before it could be killed"
        time.sleep(0.2)
    assert _finished(first) and second.exists()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = {p: p.stat().st_mtime_ns for p in first.rglob("*") if p.is_file()}
    r = subprocess.run([*argv, *cpus], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "grpo seed 0: finished before" in r.stdout
    assert {p: p.stat().st_mtime_ns for p in first.rglob("*") if p.is_file()} == before  # not re-run
    assert _finished(out / "runs" / "grpo-seed1")
    lines = (out / "runs" / "grpo-seed1" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["iteration"] for x in lines] == [0, 1]  # every iteration once


def _finished(run: Path) -> bool:
    try:
        return json.loads((run / "manifest.json").read_text()).get("status") == "finished"
    except (OSError, ValueError):
        return False


@pytest.mark.slow
def test_report_finished_aggregates_only_the_arms_whose_every_seed_finished(tmp_path):
    """Arm ``a`` has both seeds finished, arm ``b`` one of two: ``--report-finished`` trains
    nothing, names ``b`` as left out, and writes OUT/partial/experiment.json with the start
    and ``a`` only, equal to ``aggregate`` over those runs."""
    from consequence.experiment.aggregate import aggregate
    from consequence.experiment.run import run_config
    from consequence.loop.train import train

    plan = _write(
        tmp_path,
        {"base": TINY, "seeds": [0, 1], "arms": {"start": "none", "a": {}, "b": {"learning_rate": 2e-3}}},
    )
    out = tmp_path / "out"
    exp = load_experiment(plan, out)
    arms = {a.name: a for a in exp.arms}
    for name, seed in (("a", 0), ("a", 1), ("b", 0)):
        train(run_config(exp, arms[name], seed))
    r = CliRunner().invoke(
        app, ["experiment", str(plan), "--out", str(out), "--report-finished"], env={"COLUMNS": "200"}
    )
    assert r.exit_code == 0, r.output
    assert "left out: arm b (seeds 1 not finished)" in r.output
    assert not (out / "runs" / "b-seed1").exists()  # nothing was trained
    got = json.loads((out / "partial" / "experiment.json").read_text())
    runs = [exp.run_dir("a", s) for s in (0, 1)]
    want = aggregate({"start": runs, "a": runs}, no_training={"start"})
    assert set(got["arms"]) == {"start", "a"}
    for g, w in zip(got["results"], want["results"], strict=True):
        for name in ("start", "a"):
            assert g["arms"][name]["mean"] == w["arms"][name]["mean"]
            assert (g["arms"][name]["low"], g["arms"][name]["high"]) == (
                w["arms"][name]["low"],
                w["arms"][name]["high"],
            )
    success = [[json.loads(x)["success"] for x in (r / "metrics.jsonl").read_text().splitlines()] for r in runs]
    curve = got["curves"]["a"]["success"]
    assert curve["episodes"] == [4, 8] and curve["n_seeds"] == [2, 2]  # (k + 1)·B·G, B = G = 2
    assert curve["mean"] == [pytest.approx((x + y) / 2, abs=1e-15) for x, y in zip(*success)]
    assert got["sweeps"] == {}  # a and b differ by learning rate, not by a swept setting
    assert not (out / "experiment.json").exists()  # the final report is not written by a partial one
    r = CliRunner().invoke(app, ["experiment", str(plan), "--out", str(tmp_path / "empty"), "--report-finished"])
    assert r.exit_code == 2 and "no trained arm has finished all its training seeds yet" in r.output

"""Tiny real `consequence train` runs: a fresh run clears an earlier run's outputs in its
folder (and only those), settings that cannot work with the model or tasks are refused
before any rollout, one iteration numbering in the console, the final evaluation said to
be skipped, Ctrl-C, JSONL tasks, and `reproduce` from another folder (shortened, without
the split-reuse warning against its own original)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli_args import TINY_NO_EVAL
from consequence.cli import app
from consequence.distill.warmstart import BUNDLED

pytestmark = pytest.mark.slow  # every test is a real training run, some in a subprocess

TINY = TINY_NO_EVAL
ENV = {"COLUMNS": "250"}
ROOT = Path(__file__).resolve().parents[2]


def _train(*args: str):
    return CliRunner().invoke(app, ["train", *args], env=ENV)


def _text(res) -> str:
    return " ".join(res.output.split())


@pytest.fixture(scope="module")
def rerun(tmp_path_factory):
    """A folder holding an earlier run's outputs and the user's own files, then a fresh run into it."""
    run = tmp_path_factory.mktemp("rerun")
    stale = [
        "eval/test-greedy-rl.parquet",
        "eval/train-sampled-warmstart.parquet",
        "trajectories/iter_0007.parquet",
        "checkpoints/iter_0005/model.safetensors",
        "checkpoints/final/model.safetensors",
        "checkpoints/state-0009/state.json",
        "report.md",
        "report.json",
        "curves.png",
        "viewer.html",
        "metrics.jsonl",
        "split.json",
    ]
    mine = ["notes.txt", "eval/my-analysis.csv", "checkpoints/keep-me/weights.bin", "trajectories/README"]
    for name in stale + mine:
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("old")
    (run / "manifest.json").write_text(
        json.dumps({"format": 1, "config": {"run_dir": str(run)}, "status": "finished", "evaluation_files": stale[:2]})
    )
    res = _train(*TINY, "--model", str(BUNDLED), "--run-dir", str(run), "--advantage", "gae", "--skip-checks")
    assert res.exit_code == 0, res.output
    return run, res, stale, mine


# ---- 3. a fresh run into an old folder --------------------------------------------------------------
def test_a_fresh_run_deletes_the_earlier_runs_outputs_and_keeps_other_files(rerun):
    run, res, stale, mine = rerun
    assert f"{run} held an earlier run: deleted its 13 outputs (other files kept)" in _text(res)  # 12 + manifest.json
    for name in stale:  # gone, or written again by this run
        assert not (run / name).exists() or (run / name).read_bytes() != b"old", name
    for name in stale[:4] + stale[5:6] + stale[9:10]:
        assert not (run / name).exists(), name
    for name in mine:
        assert (run / name).read_text() == "old", name
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "finished" and manifest["evaluation_files"] == []
    assert sorted(p.name for p in (run / "eval").iterdir()) == ["my-analysis.csv"]  # nothing unlisted is left
    assert sorted(p.name for p in (run / "trajectories").iterdir()) == ["README", "iter_0000.parquet"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["final", "keep-me", "state-0001"]
    assert (run / "checkpoints" / "final" / "config.json").is_file()  # this run's, not the stale one
    assert [json.loads(x)["iteration"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [0]


def test_a_folder_that_is_not_a_run_is_refused_and_left_alone(tmp_path):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "config.yaml").write_text("database: prod\n")  # the user's own files with a run's file names
    (folder / "report.md").write_text("# my report\n")
    res = _train(*TINY, "--model", str(BUNDLED), "--run-dir", str(folder), "--skip-checks")
    out = _text(res)
    assert res.exit_code == 2 and f"--run-dir {folder}: holds config.yaml, report.md but is not the folder of a" in out
    assert "nothing there was deleted" in out
    assert sorted(p.name for p in folder.iterdir()) == ["config.yaml", "report.md"]
    assert (folder / "config.yaml").read_text() == "database: prod\n"


# ---- 7, 9. what the console says ----------------------------------------------------------------------
def test_console_names_the_run_numbers_from_0_and_says_the_final_evaluation_was_skipped(rerun):
    run, res, _, _ = rerun
    out = _text(res)
    assert "consequence train (gae advantages, ppo_clip, token_mean): 1 iterations (numbered 0–0)" in out
    assert "GRPO" not in out
    assert "iteration 0 (1/1 done)" in out and "iteration 1" not in out  # as in metrics.jsonl and iter_0000.parquet
    assert "final evaluation skipped (--final-eval-episodes 0)" in out
    report = (run / "report.md").read_text()
    assert report.startswith("# Final report") and "**Final evaluation skipped (--final-eval-episodes 0)**" in report
    assert (
        json.loads((run / "report.json").read_text())["final_evaluation"]
        == "final evaluation skipped (--final-eval-episodes 0)"
    )
    assert json.loads((run / "manifest.json").read_text())["run_label"] == "gae advantages, ppo_clip, token_mean"


def test_viewer_progress_says_what_it_recomputes_and_out_is_checked_first(rerun):
    from consequence.report.viewer import build_page

    run, _, _, _ = rerun
    lines: list[str] = []
    _, summary = build_page(run, with_current_logprobs=True, log=lines.append)
    n = summary["n_shown"]
    assert lines == [
        "recomputing current log-probs: trajectory 1 of 4",
        f"recomputing current log-probs: trajectory {n} of {n}",
    ]
    res = CliRunner().invoke(app, ["view", str(run), "--out", "/proc/x/v.html"], env=ENV)
    assert res.exit_code == 2 and "--out /proc/x/v.html: cannot write there" in _text(res)
    res = CliRunner().invoke(app, ["view", str(run), "--out", str(run)], env=ENV)
    assert res.exit_code == 2 and "is a folder; give the path of a file" in _text(res)


# ---- 4, 9. settings that cannot work with this model and these tasks ------------------------------------
@pytest.mark.parametrize("skip", [False, True])
def test_max_total_tokens_below_the_prompt_is_refused_before_any_rollout(tmp_path, monkeypatch, skip):
    import consequence.rollout.collect as collect_module

    monkeypatch.setattr(collect_module, "run_episodes", lambda *a, **k: pytest.fail("rolled out"))
    run = tmp_path / "run"
    res = _train(
        *TINY,
        "--model",
        str(BUNDLED),
        "--run-dir",
        str(run),
        "--max-total-tokens",
        "100",
        *(["--skip-checks"] if skip else []),
    )
    out = _text(res)
    assert res.exit_code == 2 and out.startswith(
        "error: --max-total-tokens 100 is too small: the longest prompt of the train tasks is "
    ), out
    longest = int(out.split("train tasks is ")[1].split(" ")[0])
    assert 100 < longest < 200 and f"raise --max-total-tokens to at least {longest + 24}" in out
    assert not run.exists()  # nothing half-written
    res = _train(*TINY, "--model", str(BUNDLED), "--run-dir", str(run), "--top-k", "769")
    assert (
        res.exit_code == 2
        and "--top-k 769 is larger than the vocabulary" in _text(res)
        and "(768 tokens)" in _text(res)
    )
    assert not run.exists()


# ---- 11. JSONL tasks train ---------------------------------------------------------------------------------
def test_a_run_on_a_jsonl_task_file(tmp_path):
    from task_files import write_tasks

    write_tasks(tmp_path / "tasks.jsonl")
    run = tmp_path / "run"
    res = _train(
        *TINY, "--model", str(BUNDLED), "--run-dir", str(run), "--tasks", str(tmp_path / "tasks.jsonl"), "--skip-checks"
    )
    assert res.exit_code == 0, res.output
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["tasks"]["source"] == str(tmp_path / "tasks.jsonl") and len(manifest["tasks"]["file_sha256"]) == 64
    from consequence.records import read_trajectories

    trajs = read_trajectories(run / "trajectories" / "iter_0000.parquet")
    assert len(trajs) == 4 and all(t.task_id.startswith("max-") for t in trajs)
    write_tasks(tmp_path / "three.jsonl", n=3)  # too few problems for a validation split
    res = _train(
        *TINY,
        "--model",
        str(BUNDLED),
        "--run-dir",
        str(tmp_path / "r3"),
        "--tasks",
        str(tmp_path / "three.jsonl"),
        "--eval-every",
        "2",
    )
    assert res.exit_code == 2 and "the validation split is empty" in _text(res) and "set --eval-every 0" in _text(res)
    assert not (tmp_path / "r3").exists()


# ---- 8. Ctrl-C --------------------------------------------------------------------------------------------
def test_ctrl_c_says_where_the_run_stopped_and_how_to_resume(tmp_path):
    from consequence.loop.resume import resume_config
    from reward_signal import ODD_SAMPLES_WIN

    run, marker = tmp_path / "run", tmp_path / "paused"
    args = [*TINY, "--iterations", "3", "--model", str(BUNDLED), "--run-dir", str(run), "--skip-checks"]
    args += ["--env", ODD_SAMPLES_WIN]  # as the other runs of resume_child.py: every update moves the weights
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "400"}
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "resume_child.py"), f"update:2:{marker}", "--", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    t0 = time.monotonic()
    while not marker.exists():  # paused in iteration 1, after iteration 0 and its resume state
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() - t0 < 300
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:]
    assert f"interrupted after iteration 0; continue with `consequence train --resume {run}`" in " ".join(out.split())
    assert "Traceback" not in out
    assert json.loads((run / "manifest.json").read_text())["status"] == "interrupted"
    assert resume_config(run, {}, None).iterations == 3  # an interrupted run can be resumed


# ---- 2, 12, 13. reproduce from another folder ------------------------------------------------------------
def test_reproduce_from_another_folder_shortened_without_warning_against_itself(tmp_path, monkeypatch):
    import shutil

    from consequence.evaluate.splits import read_ledger, reuse_warning
    from reward_signal import ODD_SAMPLES_WIN

    start, other = tmp_path / "start", tmp_path / "other"
    start.mkdir(), other.mkdir()
    shutil.copytree(BUNDLED, start / "model")
    monkeypatch.chdir(start)
    eval_opts = ["--final-eval-episodes", "2", "--final-eval-decoding", "greedy"]
    # odd samples win, so every update moves the weights: the shortened reproduction is another policy
    # (reproduce re-creates the environment from the original's config.yaml: tests/ is on sys.path)
    signal = ["--env", ODD_SAMPLES_WIN]
    res = _train(
        *TINY, *signal, "--iterations", "2", *eval_opts, "--model", "model", "--run-dir", "run", "--skip-checks"
    )
    assert res.exit_code == 0, res.output
    original = start / "run"
    manifest = json.loads((original / "manifest.json").read_text())
    assert manifest["config"]["model"] == str(start / "model") and manifest["config"]["run_dir"] == str(original)
    monkeypatch.chdir(other)
    res = CliRunner().invoke(app, ["reproduce", str(original), "--run-dir", "again", "--iterations", "1"], env=ENV)
    out = _text(res)
    assert res.exit_code == 0, res.output
    assert (
        "compared iterations 0–0: the reproduction ran 1 of the original's 2 iterations (shortened with --iterations)"
        in out
    )
    report = json.loads((other / "again" / "report.json").read_text())
    assert report["warnings"] == [] and "evaluated before" not in out
    assert json.loads((other / "again" / "manifest.json").read_text())["reproduces"] == str(original)
    # negative control: the ledger holds the original's earlier test evaluation of other weights, which would
    # count as another policy's if the run did not say that it reproduces the original
    assert any(e["split"] == "test" and str(original / "checkpoints" / "final") in e["policies"] for e in read_ledger())
    assert reuse_warning("repair", 0, [str(start / "model"), str(other / "again" / "checkpoints" / "final")])
    m0 = json.loads((original / "metrics.jsonl").read_text().splitlines()[0])
    m1 = json.loads((other / "again" / "metrics.jsonl").read_text().splitlines()[0])
    assert abs(m0["loss"] - m1["loss"]) <= 1e-6 and m0["reward_mean"] == m1["reward_mean"] and m0["grad_norm"] > 0


def test_the_final_sampled_comparison_samples_at_the_training_temperature(tmp_path):
    """final_eval_decoding sampled runs at --temperature (0.7 here), not at the sampler's default of 1:
    every recorded log-prob equals a teacher-forced recompute at 0.7 (it was sampled at 1 before)."""
    import torch
    from rich.console import Console

    from consequence.config import TrainConfig
    from consequence.loop.train import train
    from consequence.policy.logprobs import token_logprobs_unchunked
    from consequence.policy.tiny import BUNDLED, load_policy
    from consequence.records import read_trajectories, trajectory_to_rows

    run = tmp_path / "run"
    train(
        TrainConfig(
            run_dir=str(run),
            iterations=1,
            tasks_per_iteration=2,
            group_size=2,
            eval_every=0,
            max_turns=2,
            max_new_tokens=16,
            temperature=0.7,
            final_eval_episodes=4,
            final_eval_splits=["test"],
            final_eval_decoding=["sampled"],
        ),
        Console(quiet=True),
    )
    model, _ = load_policy(BUNDLED)
    gaps = {}
    for T in (0.7, 1.0):
        worst = 0.0
        for t in read_trajectories(run / "eval" / "test-sampled-warmstart.parquet"):
            for r in trajectory_to_rows(t):
                ids = torch.tensor([r.input_ids])
                with torch.no_grad():
                    lp, _ = token_logprobs_unchunked(model, ids, torch.ones_like(ids), T)
                mask = torch.tensor(r.loss_mask[1:], dtype=torch.bool)
                worst = max(worst, float((lp[0][mask] - torch.tensor(r.old_logprobs[1:])[mask]).abs().max()))
        gaps[T] = worst
    assert gaps[0.7] < 1e-4 < 0.05 < gaps[1.0]

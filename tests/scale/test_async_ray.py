"""Rollout workers on a real local Ray instance (docs/async.md): kept small (a few tokens,
2 × 2 rollouts per batch, loopback only).

    k = 0 with a worker reproduces the synchronous run's metrics and trajectories exactly;
    2 workers, k = 2, a worker that dies: the batch is re-run and the run ends with its report;
    kill -9 of the trainer, then --resume: every batch is trained on exactly once.
"""

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from consequence.config import TrainConfig
from consequence.distill.warmstart import BUNDLED
from consequence.loop.train import train
from consequence.records import read_trajectories

pytestmark = [
    pytest.mark.slow,  # Ray workers and training runs: minutes each
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None, reason="ray is not installed (pip install 'consequence[ray]')"
    ),
]

SMALL = dict(
    model=str(BUNDLED),
    iterations=2,
    tasks_per_iteration=2,
    group_size=2,
    eval_every=0,
    max_turns=2,
    max_new_tokens=16,
    final_eval_episodes=0,
)


def _run_keys(m: dict) -> set:
    """The keys two runs of the same seeds share values for (not timings, throughput, memory)."""
    from consequence.loop.train import machine_dependent

    return {k for k in m if not machine_dependent(k)}


ROOT = Path(__file__).resolve().parents[2]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _batch_of(traj) -> int:
    return int(traj.group_id.split("/")[0].split(".")[0])


def test_k0_with_one_worker_reproduces_the_synchronous_run(tmp_path):
    train(TrainConfig(run_dir=str(tmp_path / "sync"), **SMALL), Console(quiet=True))
    train(TrainConfig(run_dir=str(tmp_path / "async"), rollout_workers=1, **SMALL), Console(quiet=True))
    sync, asyn = _metrics(tmp_path / "sync"), _metrics(tmp_path / "async")
    for s, a in zip(sync, asyn, strict=True):
        assert {k: s[k] for k in _run_keys(s)} == {k: a[k] for k in _run_keys(s)}
        assert a["lag_histogram"] == {"0": 2} and a["batch"] == a["sampled_version"] == s["iteration"]
        assert a["sampler_trainer_kl"] < 1e-9  # same weights, same threads: the same log-probs
    for it in range(2):
        name = f"trajectories/iter_{it:04d}.parquet"
        ts, ta = read_trajectories(tmp_path / "sync" / name), read_trajectories(tmp_path / "async" / name)
        strip = lambda t: {k: v for k, v in t.to_dict().items() if k != "wall_time_s"}  # noqa: E731
        assert [strip(t) for t in ts] == [strip(t) for t in ta]
    manifest = json.loads((tmp_path / "async" / "manifest.json").read_text())
    assert manifest["rollout_workers"][0]["workers"] == 1 and manifest["rollout_workers"][0]["unconsumed_batches"] == 0


def test_k0_reproduces_the_synchronous_run_after_optimizer_steps_with_default_threads(tmp_path):
    """As above, but in fresh processes with torch's default threads (conftest pins this
    process to 1) and an optimizer step in every iteration: the scheduler must not touch
    the trainer's threads, and the worker must compute as the trainer (worker_runtime_env)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAY_ADDRESS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    args = [
        "train",
        "--model",
        str(BUNDLED),
        "--env",
        "env_fixtures:ParityEnvironment",
        "--iterations",
        "3",
        "--tasks-per-iteration",
        "2",
        "--group-size",
        "4",
        "--eval-every",
        "0",
        "--final-eval-episodes",
        "0",
        "--max-turns",
        "1",
        "--max-new-tokens",
        "24",
        "--skip-checks",
    ]
    for name, extra in (("sync", []), ("async", ["--rollout-workers", "1"])):
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                "from consequence.cli import app; app()",
                *args,
                *extra,
                "--run-dir",
                str(tmp_path / name),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    sync, asyn = _metrics(tmp_path / "sync"), _metrics(tmp_path / "async")
    assert [m["optimizer_steps_taken"] for m in sync] == [1.0, 1.0, 1.0]  # every iteration moved the weights
    for s, a in zip(sync, asyn, strict=True):
        assert {k: s[k] for k in _run_keys(s)} == {k: a[k] for k in _run_keys(s)}
    for it in range(3):
        name = f"trajectories/iter_{it:04d}.parquet"
        ts, ta = read_trajectories(tmp_path / "sync" / name), read_trajectories(tmp_path / "async" / name)
        strip = lambda t: {k: v for k, v in t.to_dict().items() if k != "wall_time_s"}  # noqa: E731
        assert [strip(t) for t in ts] == [strip(t) for t in ta]
    w = [load_file(tmp_path / run / "checkpoints" / "final" / "model.safetensors") for run in ("sync", "async")]
    assert w[0].keys() == w[1].keys() and all(torch.equal(w[0][k], w[1][k]) for k in w[0])
    manifest = json.loads((tmp_path / "async" / "manifest.json").read_text())
    trainer_threads = json.loads(
        subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
            env=env,
            capture_output=True,
            text=True,
        ).stdout
    )
    assert [w["threads"] for w in manifest["rollout_workers"][0]["where"]] == [trainer_threads]


def test_a_dying_worker_under_staleness_is_replaced_and_its_batch_rerun(tmp_path):
    """One worker, so that the trainer must wait for the batch its death interrupted: with two,
    the other could supply every iteration before Ray reports the death (seconds under load), and
    the dead batch would end unconsumed instead of re-run (the kill -9 test runs two workers)."""
    marker = tmp_path / "died"
    run = tmp_path / "run"
    cfg = TrainConfig(
        **{**SMALL, "iterations": 4, "final_eval_episodes": 2},
        run_dir=str(run),
        env="env_fixtures:ReverseEnvironment",
        env_options={"words": ["abc", "de", "fgh", "ij", "kl"], "boom": f"die-once:{marker}"},
        rollout_workers=1,
        max_staleness=2,
        final_eval_splits=["test"],
        final_eval_decoding=["greedy"],
    )
    report = train(cfg, Console(quiet=True))
    assert int(marker.read_text()) != os.getpid()  # it was a worker process that died
    ms = _metrics(run)
    assert sum(m["rerun_batches"] for m in ms) == 1
    assert all(m["lag_max"] <= 2 for m in ms)
    consumed = [m["batch"] for m in ms]
    assert len(set(consumed)) == 4
    for m in ms:  # each iteration's file holds exactly the batch it says it consumed
        trajs = read_trajectories(run / "trajectories" / f"iter_{m['iteration']:04d}.parquet")
        assert {_batch_of(t) for t in trajs} == {m["batch"]}
        assert {t.policy_version for t in trajs} == {m["sampled_version"]}
        assert m["iteration"] - m["sampled_version"] == m["lag_max"]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "finished" and (run / "report.md").exists() and "final_evaluation" not in report
    entry = manifest["rollout_workers"][0]
    assert entry["workers"] == 1 and entry["max_staleness"] == 2 and len(entry["where"]) == 1


def test_kill_minus_9_of_the_trainer_then_resume_trains_every_batch_once(tmp_path):
    run, marker = tmp_path / "run", tmp_path / "paused"
    args = [
        "--model",
        str(BUNDLED),
        "--iterations",
        "4",
        "--tasks-per-iteration",
        "2",
        "--group-size",
        "2",
        "--eval-every",
        "0",
        "--final-eval-episodes",
        "0",
        "--skip-checks",
        "--max-turns",
        "2",
        "--max-new-tokens",
        "16",
        "--rollout-workers",
        "2",
        "--max-staleness",
        "1",
        "--run-dir",
        str(run),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "400"}
    child = [sys.executable, str(ROOT / "tests" / "resume_child.py")]
    proc = subprocess.Popen(
        [*child, f"update:2:{marker}", "--", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        t0 = time.monotonic()
        while not marker.exists():  # paused after the second update, batches in flight on the workers
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() - t0 < 300, "the run did not reach its second update in 300 s"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:  # what the dead trainer's Ray instance left behind
        with contextlib.suppress(ProcessLookupError):  # nothing left to kill
            os.killpg(proc.pid, signal.SIGKILL)
    before = _metrics(run)
    assert len(before) == 1  # iteration 0's state was written; iteration 1 was cut before its state
    out = subprocess.run([*child, "--", "--resume", str(run)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ms = _metrics(run)
    assert [m["iteration"] for m in ms] == [0, 1, 2, 3]
    consumed = [m["batch"] for m in ms]
    dropped = [b for m in ms for b in m["dropped_batches"]]
    assert len(consumed) == len(set(consumed)) and not set(consumed) & set(dropped)
    # none lost: a gap is a batch still in flight when the last iteration ended (batches are
    # consumed in the order they finish, so under load a late one can be left over), counted so
    missing = set(range(max(consumed + dropped) + 1)) - set(consumed) - set(dropped)
    manifest = json.loads((run / "manifest.json").read_text())
    assert len(missing) <= manifest["rollout_workers"][-1]["unconsumed_batches"], (missing, manifest["rollout_workers"])
    files = sorted(p.name for p in (run / "trajectories").iterdir())
    assert files == [f"iter_{i:04d}.parquet" for i in range(4)]
    for m in ms:
        trajs = read_trajectories(run / "trajectories" / f"iter_{m['iteration']:04d}.parquet")
        assert {_batch_of(t) for t in trajs} == {m["batch"]} and len(trajs) == 4

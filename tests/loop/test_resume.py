"""Crashes and restarts (issue 6): atomic resume states and `consequence train --resume`.

The kill tests run real `consequence train` processes (tests/resume_child.py), SIGKILL
them mid-run, resume, and compare with an uninterrupted run of the same config: every
metric except wall-clock timings, every trajectory file and the final weights must match
(on CPU with a fixed seed the arithmetic is the same, so they match exactly; the
tolerance 1e-6 only covers JSON float round trips).
"""

from __future__ import annotations

import errno
import json
import math
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
from consequence.loop.resume import capture_rng, latest_state, restore_rng, save_state
from consequence.loop.train import machine_dependent
from consequence.records import read_trajectories
from reward_signal import ODD_SAMPLES_WIN

CHILD = Path(__file__).parents[1] / "resume_child.py"
ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "--env",
    ODD_SAMPLES_WIN,  # every update moves the weights; --resume re-creates it from config.yaml
    "--model",
    str(BUNDLED),
    "--iterations",
    "3",
    "--tasks-per-iteration",
    "2",
    "--group-size",
    "2",
    "--eval-every",
    "0",
    "--final-eval-episodes",
    "0",
    "--learning-rate",
    "1e-3",
    "--skip-checks",
    "--max-turns",
    "4",
    "--max-new-tokens",
    "32",
]


def _child(args: list[str], pause: str | None = None, max_file_bytes: int | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "400"}
    cmd = [sys.executable, str(CHILD), *([pause] if pause else []), "--", *args]

    def limit_file_size():  # a real write failure: EFBIG from the kernel, as a full disk gives ENOSPC
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of the process dying
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))

    return subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=limit_file_size if max_file_bytes else None,
    )


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    return out


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    t0 = time.monotonic()
    while not path.exists():
        assert proc.poll() is None, f"run ended before {path} appeared:\n{proc.communicate()[0][-3000:]}"
        assert time.monotonic() - t0 < timeout, f"{path} did not appear in {timeout} s"
        time.sleep(0.05)


def _kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _untimed(traj) -> dict:
    return {k: v for k, v in traj.to_dict().items() if k != "wall_time_s"}


def _assert_same_run(a: Path, b: Path) -> float:
    """Same metrics (1e-6), trajectories and final weights; returns the largest metric difference."""
    ma, mb = _metrics(a), _metrics(b)
    assert [m["iteration"] for m in mb] == [m["iteration"] for m in ma] == [0, 1, 2]
    worst = 0.0
    for x, y in zip(ma, mb):
        assert x.keys() == y.keys()
        for k in (k for k in x if not machine_dependent(k)):  # timings and memory differ between any two runs
            if isinstance(x[k], float) and isinstance(y[k], float):
                assert (math.isnan(x[k]) and math.isnan(y[k])) or abs(x[k] - y[k]) <= 1e-6, (x["iteration"], k)
                worst = max(worst, 0.0 if math.isnan(x[k]) else abs(x[k] - y[k]))
            else:
                assert x[k] == y[k], (x["iteration"], k)
    files = sorted(p.name for p in (b / "trajectories").iterdir())
    assert (
        files == sorted(p.name for p in (a / "trajectories").iterdir()) == [f"iter_{i:04d}.parquet" for i in range(3)]
    )
    for name in files:  # no lost and no duplicated trajectories, token for token
        ta, tb = read_trajectories(a / "trajectories" / name), read_trajectories(b / "trajectories" / name)
        assert [_untimed(t) for t in ta] == [_untimed(t) for t in tb]
    wa = load_file(a / "checkpoints" / "final" / "model.safetensors")
    wb = load_file(b / "checkpoints" / "final" / "model.safetensors")
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6, rtol=0) for k in wa)
    return worst


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("uninterrupted")
    _finish(_child([*TINY, "--run-dir", str(run)]))
    m = _metrics(run)
    assert len({x["loss"] for x in m}) == 3 and all(x["grad_norm"] > 0 for x in m)  # the weights do move
    return run


@pytest.mark.slow
def test_kill_during_second_iteration_then_resume_matches(uninterrupted, tmp_path):
    run = tmp_path / "run"
    proc = _child([*TINY, "--run-dir", str(run)])
    _wait_for(run / "checkpoints" / "state-0001" / "state.json", proc)
    time.sleep(0.2)  # iteration 1 is now rolling out
    _kill(proc)
    assert latest_state(run).iteration == 1
    out = _finish(_child(["--resume", str(run)]))
    assert "resuming at iteration 1" in out
    worst = _assert_same_run(uninterrupted, run)
    print(f"kill in iteration 1, resume: max |Δ metric| = {worst:.3g}")
    manifest = json.loads((run / "manifest.json").read_text())
    # kill -9 gave the killed run no chance to record its end: it was still "running"
    assert manifest["status"] == "finished"
    assert manifest["resumed"] == [
        {
            "from_iteration": 1,
            "state": "state-0001",
            "after": "running",
            "devices": {"policy": "cpu", "dtype": "float32"},
        }
    ]


@pytest.mark.slow
def test_kill_while_writing_a_state_then_resume_matches(uninterrupted, tmp_path):
    """Killed inside the second state's write: iteration 1's trajectories and metric line
    are on disk, its state is a temporary folder; resume goes back to state-0001."""
    run, marker = tmp_path / "run", tmp_path / "paused"
    proc = _child([*TINY, "--run-dir", str(run)], pause=f"state:2:{marker}")
    _wait_for(marker, proc)
    _kill(proc)
    ckpts = {p.name for p in (run / "checkpoints").iterdir()}
    assert "state-0001" in ckpts and any(n.startswith(".state-0002.tmp-") for n in ckpts), ckpts
    assert len(_metrics(run)) == 2 and (run / "trajectories" / "iter_0001.parquet").exists()
    _finish(_child(["--resume", str(run)]))
    worst = _assert_same_run(uninterrupted, run)
    print(f"kill while writing state 2, resume: max |Δ metric| = {worst:.3g}")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["final", "state-0003"]


# ---- in-process: the writer and the run directory --------------------------------------
def _learner():
    from consequence.loop.learner import make_learner
    from consequence.policy.tiny import load_policy

    model, tok = load_policy(BUNDLED)
    cfg = TrainConfig(model=str(BUNDLED))
    return make_learner(cfg, model), tok


def test_state_round_trip_and_a_failed_write_keeps_the_previous_state(tmp_path, monkeypatch):
    import consequence.loop.resume as resume_module

    learner, tok = _learner()
    p = next(learner.model.parameters())
    p.grad = torch.ones_like(p)
    learner.optimizer.step()  # some optimizer state to keep
    first = save_state(tmp_path, 1, learner, tok, [{"iteration": 0}], {"status": "running"}, {"seed": 0})
    before = {f.relative_to(first): f.read_bytes() for f in first.rglob("*") if f.is_file()}

    def full_disk(folder, learner):
        (folder / "optimizer.pt").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "optimizer.pt"))

    monkeypatch.setattr(resume_module, "_write_learner", full_disk)
    with pytest.raises(OSError, match="No space left"):
        save_state(tmp_path, 2, learner, tok, [{"iteration": 0}, {"iteration": 1}], {}, {})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["state-0001"]  # no temp folder left
    assert {f.relative_to(first): f.read_bytes() for f in first.rglob("*") if f.is_file()} == before
    state = latest_state(tmp_path)
    assert (state.iteration, state.history, state.manifest) == (1, [{"iteration": 0}], {"status": "running"})

    monkeypatch.undo()
    fresh, _ = _learner()
    resume_module.load_learner_state(state, fresh)
    a, b = learner.optimizer.state_dict()["state"], fresh.optimizer.state_dict()["state"]
    assert a.keys() == b.keys() and all(torch.equal(a[k]["exp_avg"], b[k]["exp_avg"]) for k in a)


def test_rng_states_round_trip():
    import random

    import numpy as np

    saved = capture_rng()
    x = (random.random(), np.random.rand(), torch.rand(1).item())
    restore_rng(json.loads(json.dumps(saved)))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == x


def _tiny_cfg(run: Path, **kw) -> TrainConfig:
    return TrainConfig(
        run_dir=str(run),
        model=str(BUNDLED),
        iterations=2,
        tasks_per_iteration=2,
        group_size=2,
        eval_every=0,
        final_eval_episodes=0,
        skip_checks=True,
        max_turns=3,
        max_new_tokens=24,
        **kw,
    )


def _no_temp_files(run: Path) -> None:
    left = [str(p.relative_to(run)) for p in run.rglob("*") if p.name.startswith(".")]
    assert not left, left


@pytest.mark.slow
def test_disk_full_while_writing_a_state_stops_cleanly_and_resumes(tmp_path, monkeypatch):
    import consequence.loop.resume as resume_module
    from consequence.loop.train import RunStopped, train

    real, calls = resume_module._write_learner, []

    def fill_on_second(folder, learner):
        calls.append(folder)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(folder / "optimizer.pt"))
        real(folder, learner)

    monkeypatch.setattr(resume_module, "_write_learner", fill_on_second)
    run = tmp_path / "run"
    with pytest.raises(RunStopped) as e:
        train(_tiny_cfg(run), Console(quiet=True))
    msg = str(e.value)
    assert "No space left on device" in msg and "state-0001" in msg and f"--resume {run}" in msg
    assert "no file was left half-written" in msg
    _no_temp_files(run)
    assert latest_state(run).iteration == 1
    assert json.loads((run / "manifest.json").read_text())["status"] == "stopped"
    monkeypatch.undo()
    train(_tiny_cfg(run), Console(quiet=True), resume=True)
    assert [m["iteration"] for m in _metrics(run)] == [0, 1]
    assert json.loads((run / "manifest.json").read_text())["status"] == "finished"


@pytest.mark.slow
def test_real_failed_write_of_a_state_stops_the_run_cleanly(tmp_path):
    """The kernel refuses the write (file-size limit 10 MB: the 7.7 MB weights fit, the
    15 MB optimizer state does not); torch.save's RuntimeError is reported as the OSError."""
    run = tmp_path / "run"
    proc = _child([*TINY, "--run-dir", str(run)], max_file_bytes=10 << 20)
    out = " ".join(proc.communicate(timeout=600)[0].split())
    assert proc.returncode == 1, out[-3000:]
    assert "optimizer.pt (File too large); no resume state was written yet and no file was left half-written" in out
    assert "Raise the file-size limit (ulimit -f)" in out and f"--resume {run}" in out
    _no_temp_files(run)
    assert list((run / "checkpoints").iterdir()) == []


@pytest.mark.slow
def test_disk_full_while_writing_trajectories_leaves_no_partial_file(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    from consequence.loop.train import RunStopped, train

    real = pq.write_table

    def half_then_full(table, where, *a, **kw):
        Path(where).write_bytes(b"PAR1 half a file")
        raise OSError(errno.ENOSPC, "No space left on device", str(where))

    monkeypatch.setattr(pq, "write_table", half_then_full)
    run = tmp_path / "run"
    with pytest.raises(RunStopped, match="No space left on device.*no resume state was written yet"):
        train(_tiny_cfg(run), Console(quiet=True))
    monkeypatch.setattr(pq, "write_table", real)
    _no_temp_files(run)
    assert not list((run / "trajectories").iterdir()) and _metrics(run) == []


def test_append_line_is_cut_back_when_the_disk_fills(tmp_path, monkeypatch):
    from consequence.fileio import append_line as _append_line

    path = tmp_path / "metrics.jsonl"
    _append_line(path, '{"iteration": 0}')
    real_write = os.write

    def partial(fd, data):
        real_write(fd, bytes(data[:5]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", partial)
    with pytest.raises(OSError):
        _append_line(path, '{"iteration": 1, "reward_mean": 0.5}')
    monkeypatch.undo()
    assert path.read_text() == '{"iteration": 0}\n'


def test_fresh_run_in_an_old_folder_drops_the_old_states(tmp_path):
    """Without --resume the folder starts over, so a later --resume cannot pick up an older run's state."""
    from consequence.loop.resume import rewind_run_dir

    run = tmp_path / "run"
    for name in ("checkpoints/state-0005", "checkpoints/.state-0006.tmp-x", "checkpoints/iter_0003"):
        (run / name).mkdir(parents=True)
    (run / "trajectories").mkdir()
    (run / "trajectories" / "iter_0004.parquet").write_text("old")
    (run / "metrics.jsonl").write_text('{"iteration": 0}\n')
    rewind_run_dir(run, 0, [])
    assert list((run / "checkpoints").iterdir()) == [] and list((run / "trajectories").iterdir()) == []
    assert (run / "metrics.jsonl").read_text() == ""


@pytest.mark.slow
def test_resume_restores_critic_and_reference(tmp_path, monkeypatch):
    """PPO (value head + its optimizer) with a KL term (reference reloaded from the starting
    model): a crash after the first state, then resume, gives the uninterrupted metrics."""
    from consequence.loop.sources import Rollouts
    from consequence.loop.train import train

    # odd samples win, so that iteration 0 moves the policy off the reference
    kw = dict(env=ODD_SAMPLES_WIN, advantage="gae", kl_coef=0.05, learning_rate=1e-3)
    train(_tiny_cfg(tmp_path / "a", **kw), Console(quiet=True))
    real = Rollouts.next_batch

    def crash_in_second(self, it, *args, **kwargs):
        if it == 1:
            raise KeyboardInterrupt  # stands in for a kill: nothing after this point runs
        return real(self, it, *args, **kwargs)

    with monkeypatch.context() as mp, pytest.raises(KeyboardInterrupt):
        mp.setattr(Rollouts, "next_batch", crash_in_second)
        train(_tiny_cfg(tmp_path / "b", **kw), Console(quiet=True))
    assert (tmp_path / "b" / "checkpoints" / "state-0001" / "critic.safetensors").is_file()
    train(_tiny_cfg(tmp_path / "b", **kw), Console(quiet=True), resume=True)
    ma, mb = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    for x, y in zip(ma, mb, strict=True):
        for k in ("loss", "value_loss", "kl_ref", "grad_norm", "reward_mean", "entropy"):
            assert abs(x[k] - y[k]) <= 1e-6, (x["iteration"], k, x[k], y[k])
    assert ma[1]["kl_ref"] != 0.0  # the reference term is live in the resumed iteration


def test_write_errors_of_torch_and_safetensors_become_oserrors(tmp_path):
    from consequence.fileio import as_write_error

    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            # torch.save raises this way, the OSError only as the implicit context: what this test reproduces
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # noqa: B904
    except RuntimeError as e:  # torch.save: the OSError is the context
        err = as_write_error(e, tmp_path / "optimizer.pt")
    assert (err.errno, err.filename) == (errno.ENOSPC, str(tmp_path / "optimizer.pt"))
    err = as_write_error(
        Exception("Error while serializing: I/O error: No space left on device (os error 28)"), tmp_path
    )
    assert err.errno == errno.ENOSPC and err.strerror == os.strerror(errno.ENOSPC)
    assert as_write_error(TypeError("not an I/O failure"), tmp_path) is None


def test_rewind_keeps_what_the_state_covers(tmp_path):
    from consequence.loop.resume import rewind_run_dir

    run = tmp_path / "run"
    for name in ("state-0001", "state-0002", "iter_0002", "iter_0003", "final", ".iter_0003.tmp-x"):
        (run / "checkpoints" / name).mkdir(parents=True)
    (run / "trajectories").mkdir()
    for name in ("iter_0000.parquet", "iter_0001.parquet", "iter_0002.parquet", ".iter_0002.parquet.tmp-9"):
        (run / "trajectories" / name).write_text("x")
    (run / ".manifest.json.tmp").write_text("{")
    rewind_run_dir(run, 2, [{"iteration": 0}, {"iteration": 1}])
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["final", "iter_0002", "state-0002"]
    assert sorted(p.name for p in (run / "trajectories").iterdir()) == ["iter_0000.parquet", "iter_0001.parquet"]
    assert [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] == [
        {"iteration": 0},
        {"iteration": 1},
    ]
    assert not (run / ".manifest.json.tmp").exists()

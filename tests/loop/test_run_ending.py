"""How a run ended is recorded in manifest.json on every exit path (loop.recorder.run_ending, the
one place: loop.recorder.RunRecorder): a run refused after it started (a chat template that re-renders
earlier turns, found in the first rollouts) ends ``refused`` with the reason, a crash (an
environment plug-in that raises) ends ``failed`` with the exception; both can be resumed,
and the resumed manifest keeps how the run before ended."""

from __future__ import annotations

import json
import shutil

import pytest
from rich.console import Console
from typer.testing import CliRunner

from consequence.config import TrainConfig
from consequence.distill.warmstart import BUNDLED
from env_fixtures import ReverseEnvironment

# no sandbox, short episodes; the bundled repair model calls its repair tools (run_tests, read_code),
# unknown here, so every episode gets an error observation after its first call: a turn boundary
# where the chat template renders the conversation again
TINY = [
    "--env",
    "env_fixtures:ReverseEnvironment",
    "--iterations",
    "1",
    "--tasks-per-iteration",
    "1",
    "--group-size",
    "2",
    "--eval-every",
    "0",
    "--final-eval-episodes",
    "0",
    "--max-turns",
    "2",
    "--max-new-tokens",
    "24",
    "--skip-checks",
]


class MetricsCrashEnvironment(ReverseEnvironment):
    """An environment plug-in whose own iteration metrics raise once, in its second iteration
    (a bug of the plug-in: not an env_error of an episode, a crash of the run)."""

    def iteration_metrics(self, trajectories):
        self.iterations_seen = getattr(self, "iterations_seen", 0) + 1
        if self.iterations_seen == 2:
            raise RuntimeError("metrics broke")
        return {}


def _manifest(run):
    return json.loads((run / "manifest.json").read_text())


@pytest.mark.slow
def test_a_run_refused_after_it_started_records_refused_and_can_be_resumed_once_fixed(tmp_path):
    from consequence.cli import app
    from consequence.loop.resume import resume_config
    from consequence.reproduce import reproduce_config

    model, run = tmp_path / "model", tmp_path / "run"
    shutil.copytree(BUNDLED, model)
    template = (model / "chat_template.jinja").read_text()
    # the number of messages first: every new turn changes the text before it (docs/cases.md, case 08)
    (model / "chat_template.jinja").write_text("{{ messages|length }}" + template)
    res = CliRunner().invoke(
        app, ["train", *TINY, "--model", str(model), "--run-dir", str(run)], env={"COLUMNS": "2000"}
    )
    reason = "chat template re-renders earlier turns differently: the next prompt does not extend the previous one"
    assert res.exit_code == 2, res.output
    assert [line for line in res.output.splitlines() if line.startswith("error:")] == [f"error: {reason}"]
    assert "Traceback" not in res.output
    assert not (run / "trajectories").exists()  # found in the first rollouts: no iteration completed
    m = _manifest(run)
    assert (m["status"], m.get("stop_reason")) == ("refused", reason)  # was "running" before
    # a refused run may be resumed (its cause lies outside the saved config) and reproduced
    assert resume_config(run, {}, None).model == str(model)
    assert reproduce_config(run).run_dir == f"{run}-reproduce"
    (model / "chat_template.jinja").write_text(template)  # the user fixes the template, then resumes
    res = CliRunner().invoke(app, ["train", "--resume", str(run)], env={"COLUMNS": "2000"})
    assert res.exit_code == 0, res.output
    m = _manifest(run)
    assert m["status"] == "finished" and "stop_reason" not in m


@pytest.mark.slow
def test_a_crash_records_failed_with_the_exception_and_a_resume_keeps_how_it_ended(tmp_path):
    from consequence.loop.train import train

    run = tmp_path / "run"
    cfg = TrainConfig(
        run_dir=str(run),
        model=str(BUNDLED),
        env=f"{__name__}:MetricsCrashEnvironment",
        iterations=2,
        tasks_per_iteration=1,
        group_size=2,
        eval_every=0,
        final_eval_episodes=0,
        max_turns=2,
        max_new_tokens=24,
        skip_checks=True,
    )
    with pytest.raises(RuntimeError, match="metrics broke"):  # a crash is not turned into a user error
        train(cfg, Console(quiet=True))
    m = _manifest(run)
    assert (m["status"], m.get("stop_reason")) == ("failed", "RuntimeError: metrics broke")
    assert (run / "checkpoints" / "state-0001").is_dir()  # iteration 0 completed before the crash
    # the resumed run's environment is a new instance: its first iteration (iteration 1) does not raise
    report = train(cfg, Console(quiet=True), resume=True)
    m = _manifest(run)
    assert m["status"] == "finished" and "stop_reason" not in m and report["run_label"]
    assert m["resumed"] == [
        {
            "from_iteration": 1,
            "state": "state-0001",
            "after": "failed",
            "stop_reason": "RuntimeError: metrics broke",
            "devices": {"policy": "cpu", "dtype": "float32"},
        }
    ]
    assert [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1]


@pytest.mark.parametrize(
    "error,status,reason",
    [
        (None, "finished", None),
        (KeyboardInterrupt(), "interrupted", "interrupted (Ctrl-C / SIGINT)"),
        (FloatingPointError("non-finite loss"), "stopped", "non-finite loss"),
        (OSError(28, "No space left on device"), "stopped", "[Errno 28] No space left on device"),
        (ValueError("bad template"), "refused", "bad template"),
        (OSError(2, "No such file or directory"), "failed", "FileNotFoundError: [Errno 2] No such file or directory"),
        (KeyError("x"), "failed", "KeyError: 'x'"),
    ],
)
def test_run_ending_maps_each_exit_to_its_status(error, status, reason):
    from consequence.loop.checks import PreStepCheckError
    from consequence.loop.resume import STATUSES
    from consequence.loop.train import run_ending

    assert run_ending(error) == (status, reason) and status in STATUSES
    assert run_ending(PreStepCheckError("mask check failed")) == ("stopped", "mask check failed")


def test_an_error_before_the_manifest_is_written_leaves_an_earlier_runs_manifest(tmp_path):
    from consequence.loop.recorder import RunRecorder

    (tmp_path / "manifest.json").write_text(json.dumps({"status": "finished", "config": {}}))
    with (
        pytest.raises(ValueError),
        RunRecorder(tmp_path, Console(quiet=True)),
    ):  # not opened: this run wrote nothing yet
        raise ValueError("bad --teacher")
    assert _manifest(tmp_path) == {"status": "finished", "config": {}}
    with pytest.raises(ValueError), RunRecorder(tmp_path, Console(quiet=True)) as ending:
        ending.opened = True
        raise ValueError("bad template")
    assert _manifest(tmp_path) == {"status": "refused", "config": {}, "stop_reason": "bad template"}


def test_sigterm_ends_a_run_interrupted_not_running(tmp_path):
    """Break-test: SIGTERM (a scheduler's stop) left manifest.json at ``running``. It is
    handled like Ctrl-C: the run ends ``interrupted`` (resumable), and the handler before the
    run is back afterwards."""
    import os
    import signal

    from consequence.loop.recorder import RunRecorder, Terminated, run_ending

    assert run_ending(Terminated()) == ("interrupted", "terminated (SIGTERM)")
    before = signal.getsignal(signal.SIGTERM)
    (tmp_path / "manifest.json").write_text(json.dumps({"status": "running", "config": {}}))
    with pytest.raises(Terminated), RunRecorder(tmp_path, Console(quiet=True)) as ending:
        ending.opened = True
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pthread_sigmask(signal.SIG_BLOCK, [])  # a pending signal is handled at the next bytecode
        raise AssertionError("SIGTERM did not stop the run")
    assert _manifest(tmp_path) == {"status": "interrupted", "config": {}, "stop_reason": "terminated (SIGTERM)"}
    assert signal.getsignal(signal.SIGTERM) == before

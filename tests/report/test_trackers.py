"""``--report-to``: the trackers get each metrics.jsonl line under the same names with the
iteration as the step, the config as parameters and the report at the end; a resumed run
continues the same tracker runs; a tracker that is not installed is refused before any work.

TensorBoard and MLflow (file store) are read back with their own readers; W&B and Trackio are
checked through a stand-in module that records the calls made to it.
"""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console
from typer.testing import CliRunner

from consequence.config import TrainConfig
from consequence.report.trackers import (
    STATE_FILE,
    TensorBoardTracker,
    Trackers,
    check_trackers,
    flatten,
    open_trackers,
    param_text,
    scalars,
    texts,
)

LINE = {
    "iteration": 3,
    "reward_mean": None,  # undefined this iteration: left out, not a crash
    "reward_components_mean": {"parity": 0.25, "format": {"ok": 1}},
    "grad_norm": float("nan"),
    "clip_frac_high": float("inf"),
    "fixed_data_batch": True,
    "warnings": ["w one", "w two"],
    "dropped_batches": [4, 5],
    "note": "text",
    "empty": [],
}


# ---- what is sent ---------------------------------------------------------------------------
def test_numbers_are_flattened_with_a_slash_and_none_nan_inf_text_and_lists_are_left_out():
    assert flatten({"a": {"b": {"c": 1}}, "d": 2}) == {"a/b/c": 1, "d": 2}
    assert scalars(LINE) == {
        "iteration": 3,
        "reward_components_mean/parity": 0.25,
        "reward_components_mean/format/ok": 1,
        "fixed_data_batch": 1,
    }
    assert texts(LINE) == {"warnings": "w one\nw two", "note": "text"}
    assert [param_text(v) for v in ("x", 2e-4, True, None, ["test", "train"])] == [
        "x",
        "0.0002",
        "true",
        "null",
        '["test", "train"]',
    ]


def test_the_config_takes_a_comma_list_and_refuses_an_unknown_tracker_or_none_beside_one():
    assert TrainConfig().report_to == ["none"]  # the default run has no tracker
    assert TrainConfig(report_to="tensorboard, mlflow").report_to == ["tensorboard", "mlflow"]
    assert TrainConfig(report_to=["wandb,trackio"]).report_to == ["wandb", "trackio"]
    with pytest.raises(ValueError, match=r"report_to \(--report-to\): Input should be 'none', 'tensorboard'"):
        TrainConfig.checked(report_to="tensorboard,neptune")
    with pytest.raises(ValueError, match="none means no tracker"):
        TrainConfig.checked(report_to="none,mlflow")


# ---- not installed ----------------------------------------------------------------------------
def test_a_tracker_that_is_not_installed_is_refused_naming_its_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` sees where it is not installed
    check_trackers(["none"])
    check_trackers(["tensorboard", "mlflow"])  # installed for the tests (the test extra)
    with pytest.raises(
        ValueError, match=r"--report-to wandb: the wandb package is not installed; pip install 'consequence\[wandb\]'"
    ):
        check_trackers(["tensorboard", "wandb"])


def test_the_cli_refuses_a_missing_tracker_before_any_work(tmp_path, monkeypatch):
    from consequence.cli import app

    monkeypatch.setitem(sys.modules, "trackio", None)
    run = tmp_path / "run"
    r = CliRunner().invoke(
        app, ["train", "--report-to", "tensorboard,trackio", "--run-dir", str(run)], env={"COLUMNS": "200"}
    )
    assert r.exit_code == 2, r.output
    assert "pip install 'consequence[trackio]'" in r.output and "Traceback" not in r.output
    assert not run.exists()  # nothing written


def test_train_itself_refuses_a_missing_tracker_before_loading_anything(tmp_path, monkeypatch):
    from consequence.loop.train import train

    monkeypatch.setitem(sys.modules, "wandb", None)
    run = tmp_path / "run"
    with pytest.raises(ValueError, match=r"consequence\[wandb\]"):
        train(TrainConfig(run_dir=str(run), report_to="wandb"), Console(quiet=True))
    assert not run.exists()


# ---- a tracker's failure while the run goes on --------------------------------------------------
class _Recording:
    def __init__(self, name: str, fail_on: str | None = None):
        self.name, self.new, self.fail_on, self.calls = name, True, fail_on, []

    def _call(self, what, *args):
        self.calls.append((what, *args))
        if what == self.fail_on:
            raise OSError("disk full")

    def log(self, step, metrics):
        self._call("log", step)

    def log_artifact(self, path):
        self._call("artifact", path.name)

    def close(self, status):
        self._call("close", status)


def test_a_tracker_that_fails_is_dropped_with_a_warning_and_the_others_go_on(tmp_path):
    warned = []
    good, bad = _Recording("good"), _Recording("bad", fail_on="log")
    trackers = Trackers([bad, good], warned.append)
    trackers.log(0, LINE)
    trackers.log(1, LINE)
    (tmp_path / "report.md").write_text("# r")
    trackers.log_artifacts([tmp_path / "report.md", tmp_path / "missing.png"])
    trackers.close("finished")
    assert good.calls == [("log", 0), ("log", 1), ("artifact", "report.md"), ("close", "finished")]
    assert bad.calls == [("log", 0), ("close", "failed")]  # dropped after its first error
    assert len(warned) == 1 and "--report-to bad: logging the metrics failed (OSError: disk full)" in warned[0]


# ---- TensorBoard: a resumed run hides what the interrupted one logged past its state -------------
def _scalars_of(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_resume_purges_the_steps_logged_after_the_resume_state(tmp_path):
    first = TensorBoardTracker(tmp_path, {}, 0, {})
    for step in range(3):  # steps 0, 1, 2 logged; say the resume state holds 1 iteration only
        first.log(step, {"x": 10.0 + step})
    first.close("interrupted")
    again = TensorBoardTracker(tmp_path, {}, 1, {"log_dir": str(tmp_path / "tensorboard")})
    for step in (1, 2, 3):
        again.log(step, {"x": 20.0 + step})
    again.close("finished")
    assert len(list((tmp_path / "tensorboard").iterdir())) == 2  # one folder, one event file per process
    assert _scalars_of(tmp_path / "tensorboard") == {"x": [(0, 10.0), (1, 21.0), (2, 22.0), (3, 23.0)]}


# ---- W&B and Trackio through stand-ins ----------------------------------------------------------
class _FakeRun:
    def __init__(self, calls: list):
        self.calls = calls
        self.config = types.SimpleNamespace(update=lambda d, allow_val_change=False: calls.append(("config", d)))

    def log(self, metrics, step=None):
        self.calls.append(("log", step, metrics))

    def log_artifact(self, artifact, **kw):
        self.calls.append(("artifact", getattr(artifact, "files", artifact), kw))

    def finish(self, **kw):
        self.calls.append(("finish", kw))


def _fake_wandb(calls: list) -> types.ModuleType:
    mod = types.ModuleType("wandb")

    class Artifact:
        def __init__(self, name, type):
            self.name, self.type, self.files = name, type, []

        def add_file(self, path):
            self.files.append(Path(path).name)

    def init(**kw):
        calls.append(("init", kw))
        return _FakeRun(calls)

    mod.Artifact, mod.init = Artifact, init
    return mod


def _fake_trackio(calls: list) -> types.ModuleType:
    mod = types.ModuleType("trackio")

    def init(**kw):
        calls.append(("init", kw))
        return _FakeRun(calls)

    mod.init = init
    return mod


CONFIG = {"learning_rate": 3e-3, "env_options": {"n": 2}, "report_to": ["wandb"]}


def test_wandb_is_offline_in_the_run_folder_and_a_resume_continues_its_id(tmp_path, monkeypatch):
    for var in ("WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT"):
        monkeypatch.delenv(var, raising=False)
    calls: list = []
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(calls))
    trackers = open_trackers(["wandb"], tmp_path, CONFIG, 0)
    trackers.log(0, LINE)
    (tmp_path / "curves.png").write_bytes(b"png")
    trackers.log_artifacts([tmp_path / "curves.png"])
    trackers.close("interrupted")
    run_id = json.loads((tmp_path / STATE_FILE).read_text())["wandb"]["id"]
    assert calls[0] == (
        "init",
        {
            "project": "consequence",
            "name": tmp_path.name,
            "id": run_id,
            "resume": "allow",
            "dir": str(tmp_path),
            "mode": "offline",
        },
    )
    assert calls[1] == ("config", {"learning_rate": 3e-3, "env_options/n": 2, "report_to": ["wandb"]})
    assert calls[2] == ("log", 0, scalars(LINE))
    assert calls[3] == ("artifact", ["curves.png"], {})
    assert calls[4] == ("finish", {"exit_code": 1})  # not finished: W&B marks it failed
    calls.clear()
    monkeypatch.setenv("WANDB_MODE", "online")  # the user's own setting: W&B decides, no mode passed
    trackers = open_trackers(["wandb"], tmp_path, CONFIG, 2)
    trackers.log(2, {"x": 1.5})
    trackers.close("finished")
    assert calls[0][1]["id"] == run_id and calls[0][1]["resume"] == "allow" and "mode" not in calls[0][1]
    assert [c[0] for c in calls] == ["init", "log", "finish"]  # a continued run gets no config again
    assert calls[1] == ("log", 2, {"x": 1.5}) and calls[2] == ("finish", {"exit_code": 0})


def test_trackio_gets_the_config_at_init_and_a_resume_reopens_the_run_by_name(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setitem(sys.modules, "trackio", _fake_trackio(calls))
    trackers = open_trackers(["trackio"], tmp_path, CONFIG, 0)
    trackers.log(0, LINE)
    trackers.close("finished")
    name = json.loads((tmp_path / STATE_FILE).read_text())["trackio"]["name"]
    assert name.startswith(tmp_path.name + "-")
    assert calls[0] == (
        "init",
        {"project": "consequence", "name": name, "config": flatten(CONFIG), "resume": "never", "embed": False},
    )
    assert calls[1:] == [("log", 0, scalars(LINE)), ("finish", {})]
    calls.clear()
    open_trackers(["trackio"], tmp_path, CONFIG, 1).close("finished")
    assert calls[0][1]["name"] == name and calls[0][1]["resume"] == "allow"


# ---- a fresh run in the same folder starts its tracker files anew --------------------------------
def test_a_fresh_run_deletes_the_earlier_runs_event_files_and_tracker_ids_only(tmp_path):
    from consequence.report.manifest import clear_run_outputs

    (tmp_path / "manifest.json").write_text('{"status": "stopped"}')
    (tmp_path / STATE_FILE).write_text("{}")
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events.out.tfevents.1.host.1.0").write_text("")
    (tmp_path / "tensorboard" / "mine.txt").write_text("kept")
    removed = clear_run_outputs(tmp_path)
    assert sorted(removed) == ["manifest.json", "tensorboard/events.out.tfevents.1.host.1.0", STATE_FILE]
    assert [p.name for p in (tmp_path / "tensorboard").iterdir()] == ["mine.txt"]


# ---- a real run: TensorBoard and MLflow read back -------------------------------------------------
def _tiny(run: Path, **kw) -> TrainConfig:
    from consequence.distill.warmstart import BUNDLED

    return TrainConfig(
        run_dir=str(run),
        model=str(BUNDLED),
        env="env_fixtures:ParityEnvironment",
        iterations=4,
        tasks_per_iteration=1,
        group_size=4,
        max_turns=1,
        max_new_tokens=24,  # the warm start completes its first tool call: mixed groups, real steps
        micro_batch_size=4,
        eval_every=0,
        final_eval_episodes=0,
        skip_checks=True,
        report_to="tensorboard,mlflow",
        **kw,
    )


@pytest.mark.slow
def test_tensorboard_and_mlflow_hold_every_metric_of_a_run_interrupted_and_resumed(tmp_path, monkeypatch):
    """Four iterations, stopped (Ctrl-C) in iteration 2 after the state of 2, then resumed: one
    TensorBoard folder and one MLflow run hold steps 0..3, each scalar equal to its
    metrics.jsonl value (TensorBoard stores float32: compared with the float32 rounding of it;
    MLflow stores float64: exact)."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from consequence.loop.sources import Rollouts
    from consequence.loop.train import train

    run = tmp_path / "run"
    real = Rollouts.next_batch

    def stop_in_third(self, it, *args, **kwargs):
        if it == 2:
            raise KeyboardInterrupt
        return real(self, it, *args, **kwargs)

    with monkeypatch.context() as mp, pytest.raises(KeyboardInterrupt):
        mp.setattr(Rollouts, "next_batch", stop_in_third)
        train(_tiny(run), Console(quiet=True))
    first = json.loads((run / STATE_FILE).read_text())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads a file store only with it
    client = MlflowClient(tracking_uri=first["mlflow"]["tracking_uri"])
    assert client.get_run(first["mlflow"]["run_id"]).info.status == "KILLED"  # the interrupted run's status
    train(_tiny(run), Console(quiet=True), resume=True)
    assert json.loads((run / STATE_FILE).read_text()) == first  # the same tracker runs continued

    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in lines] == [0, 1, 2, 3]
    flat = [flatten(m) for m in lines]
    assert any(v is None for m in flat for v in m.values())  # undefined metrics were in the run: skipped
    keys = set().union(*(scalars(m) for m in lines))
    assert {"loss", "reward_mean", "reward_components_mean/parity", "iteration_s"} <= keys

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == keys
    for key in keys:
        want = [(m["iteration"], float(np.float32(scalars(m)[key]))) for m in lines if key in scalars(m)]
        assert [(e.step, e.value) for e in acc.Scalars(key)] == want, key
    report = acc.Tensors("report/text_summary")[0].tensor_proto.string_val[0].decode()
    assert report == (run / "report.md").read_text()
    image = acc.Images("curves")[0]
    assert image.encoded_image_string[:8] == b"\x89PNG\r\n\x1a\n" and image.width > 100

    runs = client.search_runs([first["mlflow"]["experiment_id"]])
    assert [r.info.run_id for r in runs] == [first["mlflow"]["run_id"]]  # one MLflow run for the two processes
    got = runs[0]
    assert got.info.status == "FINISHED" and got.info.run_name == "run"
    assert set(got.data.metrics) == keys
    for key in keys:
        want = [(m["iteration"], float(scalars(m)[key])) for m in lines if key in scalars(m)]
        history = sorted((x.step, x.value) for x in client.get_metric_history(got.info.run_id, key))
        assert history == want, key
    params = got.data.params
    assert params == {k: param_text(v) for k, v in flatten(_tiny(run).model_dump()).items()}
    assert params["learning_rate"] == "0.0002" and params["env"] == "env_fixtures:ParityEnvironment"
    assert params["report_to"] == '["tensorboard", "mlflow"]' and params["iterations"] == "4"
    artifacts = {a.path for a in client.list_artifacts(got.info.run_id)}
    assert artifacts == {"report.md", "report.json", "curves.png"}
    assert not any(math.isnan(x.value) for x in client.get_metric_history(got.info.run_id, "loss"))


# ---- an experiment's runs ---------------------------------------------------------------------
def test_an_experiment_gives_report_to_to_each_run(tmp_path):
    import yaml

    from consequence.experiment.run import _command, run_config
    from consequence.experiment.spec import load_experiment

    plan = tmp_path / "plan.yaml"
    plan.write_text(
        yaml.safe_dump(
            {
                "base": {"iterations": 2, "eval_every": 0, "report_to": "tensorboard"},
                "seeds": [0, 1],
                "arms": {"grpo": {}, "rloo": {"recipe": "rloo", "report_to": "tensorboard,mlflow"}},
            }
        )
    )
    exp = load_experiment(plan, tmp_path / "out")
    got = {(arm.name, seed): run_config(exp, arm, seed).report_to for arm, seed in exp.runs()}
    assert got == {
        ("grpo", 0): ["tensorboard"],
        ("grpo", 1): ["tensorboard"],
        ("rloo", 0): ["tensorboard", "mlflow"],
        ("rloo", 1): ["tensorboard", "mlflow"],
    }
    arm = exp.arms[1]
    argv = _command(exp, arm, 1, run_config(exp, arm, 1), "new")  # the run's config file, as the run reads it
    saved = TrainConfig.checked(**TrainConfig.read_yaml(argv[argv.index("--config") + 1]))
    assert saved.report_to == ["tensorboard", "mlflow"]

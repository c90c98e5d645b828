"""Bad input (issue 6) not covered in test_config_cli.py: a tokenizer without a chat
template, and `train --resume` misuse; each is reported before work starts."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from typer.testing import CliRunner

from consequence.cli import app
from consequence.config import TrainConfig
from consequence.distill.warmstart import BUNDLED
from consequence.loop.resume import resume_config


def _invoke(*args: str):
    return CliRunner().invoke(app, ["train", *args], env={"COLUMNS": "250"})


def test_tokenizer_without_chat_template_is_rejected_before_work(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(BUNDLED, model)
    (model / "chat_template.jinja").unlink()  # tokenizer_config.json has no chat_template key either
    run = tmp_path / "run"
    res = _invoke("--model", str(model), "--run-dir", str(run))
    out = " ".join(res.output.split())
    assert res.exit_code == 2 and "the tokenizer has no chat template" in out and "set tokenizer.chat_template" in out
    assert not (run / "config.yaml").exists()  # nothing started
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": "{{ messages }}"}))
    from consequence.cli import _check_model_dir

    _check_model_dir(str(model))  # a template inside tokenizer_config.json is found too


@pytest.fixture()
def old_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    cfg = TrainConfig(run_dir="somewhere/else", iterations=3, learning_rate=1e-3)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump()))
    return run


def test_resume_takes_the_saved_config(old_run):
    cfg = resume_config(old_run, {"iterations": 3, "run_dir": str(old_run)}, None)  # equal values are fine
    assert (cfg.iterations, cfg.learning_rate, cfg.run_dir) == (3, 1e-3, str(old_run))


@pytest.mark.parametrize(
    "args,needle",
    [
        (
            ["--learning-rate", "0.5", "--iterations", "3"],
            "these options differ from it: --learning-rate 0.5 (the run has 0.001)",
        ),
        (["--run-dir", "/tmp/elsewhere"], "--run-dir conflicts with --resume"),
        (["--config", "x.yaml"], "drop --config x.yaml"),
        (["--group-size", "0"], "group_size (--group-size): Input should be greater than or equal to 1"),
    ],
)
def test_resume_rejects_conflicting_options(old_run, args, needle):
    res = _invoke("--resume", str(old_run), *args)
    assert res.exit_code == 2 and needle in " ".join(res.output.split()), res.output


def test_resume_of_a_non_run_or_finished_run(tmp_path, old_run):
    res = _invoke("--resume", str(tmp_path / "nope"))
    assert res.exit_code == 2 and "no config.yaml there" in res.output
    (old_run / "manifest.json").write_text(json.dumps({"status": "finished"}))
    res = _invoke("--resume", str(old_run))
    assert res.exit_code == 2 and "already finished" in res.output


def test_stopped_run_exits_1_with_its_message(tmp_path, monkeypatch):
    import consequence.loop.train as train_module

    def stop(cfg, console, resume=False):
        raise train_module.RunStopped("stopped: cannot write x (No space left on device)")

    monkeypatch.setattr(train_module, "train", stop)
    res = _invoke("--model", str(BUNDLED), "--run-dir", str(tmp_path / "run"))
    assert res.exit_code == 1 and "No space left on device" in res.output

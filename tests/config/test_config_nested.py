"""Settings YAML nested by box (config.nested): read, written, refused when misplaced, and
`consequence train --print-config`."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from consequence.cli import app
from consequence.config import TrainConfig, box_of, flat_settings
from consequence.config.nested import ORDER


def _cli(*args: str):
    r = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    return r.exit_code, r.output


def test_nested_and_flat_settings_are_the_same_config():
    flat = {"learning_rate": 1e-5, "group_size": 4, "env": "calculator", "iterations": 3}
    nested = {"update": {"learning_rate": 1e-5}, "rollout": {"group_size": 4}, "tasks": {"env": "calculator"}}
    nested["run"] = {"iterations": 3}
    assert TrainConfig(**nested) == TrainConfig(**flat)
    cfg = TrainConfig(**flat)
    dumped = cfg.nested_dump()
    assert list(dumped) == [b for b in ORDER if b in dumped] and set(dumped) == set(ORDER)
    assert all(box_of(k) == box for box, fields in dumped.items() for k in fields)
    assert sum(len(f) for f in dumped.values()) == len(TrainConfig.model_fields)
    assert TrainConfig(**dumped) == cfg and flat_settings(dumped) == cfg.model_dump()
    assert TrainConfig(tasks="calculator").env == "calculator"  # a string under `tasks` is the older name of env


def test_each_box_is_a_typed_frozen_view_of_the_same_settings():
    from pydantic import ValidationError

    cfg = TrainConfig(learning_rate=1e-5, group_size=4, advantage="rloo", tasks="calculator")
    assert (cfg.update.learning_rate, cfg.rollout.group_size, cfg.credit.advantage) == (1e-5, 4, "rloo")
    assert type(cfg.update).__name__ == "UpdateSettings" and cfg.tasks.env == "calculator" == cfg.env
    views = {box: getattr(cfg, box).model_dump() for box in ORDER}
    assert views == cfg.nested_dump()  # every setting in exactly one box, the same value as the flat field
    with pytest.raises(ValidationError):
        cfg.update.learning_rate = 1.0  # a view: change the config, not the box


def test_a_setting_under_the_wrong_box_or_given_twice_is_refused():
    with pytest.raises(
        ValueError, match="update.group_size: group_size is a setting of the rollout box, not of update"
    ):
        TrainConfig(update={"group_size": 4})
    with pytest.raises(ValueError, match="learning_rate: given twice"):
        TrainConfig(update={"learning_rate": 1e-5}, learning_rate=1e-4)
    with pytest.raises(ValueError, match="update: a box section holds the box's settings as a mapping"):
        TrainConfig(update=3)
    with pytest.raises(ValueError, match="did you mean learning_rate"):
        TrainConfig.checked(update={"learning_rat": 1e-5})


def test_print_config_shows_the_resolved_nested_settings_and_reads_back(tmp_path):
    run = tmp_path / "r"
    code, out = _cli("train", "--recipe", "rloo", "--learning-rate", "1e-5", "--run-dir", str(run), "--print-config")
    assert code == 0, out
    printed = yaml.safe_load(out)
    assert list(printed) == list(ORDER)
    assert printed["credit"]["advantage"] == "rloo" and printed["update"]["learning_rate"] == 1e-5
    assert printed["run"]["recipe"] == "rloo"
    f = tmp_path / "c.yaml"
    f.write_text(out)
    code, again = _cli("train", "--config", str(f), "--print-config")
    assert code == 0 and again == out
    assert printed["run"]["run_dir"] == str(run) and not run.exists()  # nothing written


def test_a_nested_config_file_with_a_misplaced_key_is_refused_by_the_cli(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("update:\n  group_size: 4\n")
    code, out = _cli("train", "--config", str(f), "--print-config")
    out = " ".join(out.split())
    assert code == 2 and "Traceback" not in out
    assert f"config file {f}: update.group_size: group_size is a setting of the rollout box" in out


def test_an_earlier_runs_flat_config_yaml_still_resumes_to_the_same_settings(tmp_path):
    """Runs before the nesting wrote config.yaml flat (model_dump); --resume reads it as it is,
    and the nested form of the same settings reads to the same config."""
    from consequence.loop.resume import resume_config

    for form in ("flat", "nested"):
        run = tmp_path / form
        run.mkdir()
        cfg = TrainConfig(run_dir=str(run), advantage="rloo", surrogate="pg", iterations=3)
        data = cfg.model_dump() if form == "flat" else cfg.nested_dump()
        (run / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
        assert ("advantage" in data) == (form == "flat")
        assert resume_config(run, {}, None) == cfg

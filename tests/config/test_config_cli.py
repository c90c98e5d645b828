import pytest
from typer.testing import CliRunner

from consequence.cli import app
from consequence.config import TrainConfig


def test_defaults_are_valid_and_yaml_overrides(tmp_path):
    cfg = TrainConfig()
    assert cfg.group_size == 8 and cfg.clip_eps == 0.2 and cfg.advantage == "grpo"
    p = tmp_path / "c.yaml"
    p.write_text("iterations: 3\ngroup_size: 4\n")
    cfg = TrainConfig.from_yaml(p, group_size=6)
    assert (cfg.iterations, cfg.group_size) == (3, 6)


@pytest.mark.parametrize(
    "text,needle",
    [
        ("iteratons: 3\n", "iteratons (--iteratons): unknown option; did you mean iterations?"),
        ("group_size: 0\n", "group_size (--group-size): Input should be greater than or equal to 1"),
        ("group_size: 1\n", "--group-size 1 gives a group-relative advantage nothing to compare with"),
        ("reduction: mean\n", "reduction (--reduction): Input should be"),
        ("- 1\n- 2\n", "must hold a mapping"),
        ("iterations: [1,\n", "is not valid YAML"),
        ("learning_rate: .inf\n", "learning_rate (--learning-rate)"),
    ],
)
def test_bad_config_is_reported_with_the_key(tmp_path, text, needle):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ValueError) as e:
        TrainConfig.from_yaml(p)
    assert needle in str(e.value)


@pytest.mark.slow
def test_cli_help_lists_every_option_and_rejects_bad_input(tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0
    flags = {"env_options": "--env-option"}  # a mapping, given one key=value at a time
    for name in TrainConfig.model_fields:
        assert flags.get(name, "--" + name.replace("_", "-")) in res.output
    res = runner.invoke(app, ["train", "--group-size", "1", "--run-dir", str(tmp_path / "r")])
    assert res.exit_code == 2 and "--group-size 1 gives" in res.output
    res = runner.invoke(app, ["train", "--model", str(tmp_path / "nope"), "--run-dir", str(tmp_path / "r")])
    assert res.exit_code == 2 and "no such directory" in res.output
    res = runner.invoke(app, ["train", "--config", str(tmp_path / "missing.yaml")])
    assert res.exit_code == 2 and "does not exist" in res.output
    (tmp_path / "empty").mkdir()
    res = runner.invoke(app, ["train", "--model", str(tmp_path / "empty"), "--run-dir", str(tmp_path / "r")])
    assert res.exit_code == 2 and "missing config.json, tokenizer.json" in res.output
    (tmp_path / "afile").write_text("x")
    res = runner.invoke(app, ["train", "--run-dir", str(tmp_path / "afile")])
    assert res.exit_code == 2 and "cannot write there" in res.output
    res = runner.invoke(app, ["train", "--reduction", "[bold]x", "--run-dir", str(tmp_path / "r")])
    assert res.exit_code == 2 and "[bold]x" in res.output  # user input is not eaten as markup


def test_help_shows_defaults_and_choices():
    res = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "250"})
    text = " ".join(res.output.split())
    assert "[default: 18]" in text and "[default: bundled tiny warm start]" in text
    assert "One of: token_mean, seq_mean_token_mean, seq_mean_token_sum_norm." in text


def test_every_shipped_config_is_a_valid_train_config():
    """configs/*.yaml are the README's commands: each must load (keys, values, recipe)."""
    from pathlib import Path

    from consequence.recipes import resolve_config

    files = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))
    assert len(files) >= 2
    for f in files:
        cfg = resolve_config(f)
        # a model is a registered name, or the folder a command in the file's own header makes
        assert (
            cfg.model == "smollm2-135m-instruct" or f"--out {Path(cfg.model).relative_to(Path.cwd())}" in f.read_text()
        ), f
        assert cfg.env in ("reasoning-gym", "repair", "calculator"), f

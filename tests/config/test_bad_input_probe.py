"""Bad input found by a probe of the CLI: each is one `error:` line with exit 2, before work."""

from typer.testing import CliRunner

from consequence.cli import app

ENV = {"COLUMNS": "250"}


def _run(*args):
    res = CliRunner().invoke(app, list(args), env=ENV)
    return res.exit_code, " ".join(res.output.split()), res.output


def test_eval_refuses_a_budget_in_which_no_episode_can_act(tmp_path):
    code, out, _ = _run(
        "eval", "--problems", "2", "-n", "1", "--no-recovery", "--max-total-tokens", "20", "--out", str(tmp_path / "e")
    )
    assert code == 2 and "--max-total-tokens 20 is too small" in out and "at least" in out
    assert not (tmp_path / "e" / "eval.json").exists()


def test_a_bad_value_in_the_config_file_is_refused_even_when_the_command_line_overrides_it(tmp_path):
    (tmp_path / "c.yaml").write_text('iterations: "abc"\n')
    code, out, _ = _run(
        "train", "--config", str(tmp_path / "c.yaml"), "--iterations", "1", "--run-dir", str(tmp_path / "run")
    )
    assert code == 2 and "iterations (--iterations): Input should be a valid integer" in out


def test_a_yaml_syntax_error_is_one_line_with_its_position(tmp_path):
    (tmp_path / "c.yaml").write_text("a: [\n")
    code, _, raw = _run("train", "--config", str(tmp_path / "c.yaml"))
    lines = [ln for ln in raw.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "is not valid YAML (line 2, column 1:" in lines[0]


def test_negative_seeds_are_refused_with_a_message():
    code, out, raw = _run("lab", "baseline", "--seed", "-1")
    assert code == 2 and raw.startswith("error: --seed -1: give a non-negative integer")
    code, out, _ = _run("train", "--split-seed", "-1")
    assert code == 2 and "split_seed (--split-seed): Input should be greater than or equal to 0" in out


def test_paths_of_the_wrong_kind_are_named(tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("x")
    code, out, _ = _run("view", str(f))
    assert code == 2 and "is a file, not a folder" in out
    code, out, _ = _run("view", str(tmp_path), "--iteration", "-1")
    assert code == 2 and "--iteration -1: iterations are numbered from 0" in out
    code, out, _ = _run("explain", str(tmp_path))
    assert code == 2 and "is a directory, not a recipe name" in out


def test_a_broken_task_file_is_named_once(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"a": "x\ty"}\n')
    code, out, _ = _run("eval", "--tasks", str(p), "--problems", "2", "-n", "1", "--out", str(tmp_path / "e"))
    assert code == 2 and out.count(str(p)) == 1 and "at at" not in out and f"{p}:1: not valid JSON" in out

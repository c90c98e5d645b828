"""`consequence train` options without a training run: recipe layers (YAML = --recipe =
explain), absolute paths, --name/--no-name booleans, one list syntax, run labels and
folders, batch checks, JSONL task files, model-folder checks, and the lab / reproduce
commands' input checks. Each bad input exits 2 with one message, before any work."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from typer.testing import CliRunner

import consequence.cli.train as cli_train
from consequence.cli import app
from consequence.config import TrainConfig
from consequence.distill.warmstart import BUNDLED
from consequence.recipes import load_recipe
from task_files import repair_record, write_tasks

ENV = {"COLUMNS": "250"}


def run_label(cfg) -> str:
    from consequence.recipes import run_label as label  # imported here: each test fails on its own without it

    return label(cfg)


def _text(res) -> str:
    return " ".join(res.output.split())


@pytest.fixture()
def captured(monkeypatch):
    """`consequence train` up to the run: the config it would train with, nothing started."""
    seen: dict = {}
    monkeypatch.setattr(cli_train, "_run_train", lambda cfg, resume, reproduces=None: seen.setdefault("cfg", cfg))

    def invoke(*args: str):
        seen.clear()
        res = CliRunner().invoke(app, ["train", *args], env=ENV)
        return res, seen.get("cfg")

    return invoke


# ---- 1. a recipe means the same from YAML, --recipe and explain ---------------------------------
@pytest.mark.slow
def test_recipe_in_yaml_is_applied_as_with_the_recipe_option(tmp_path, captured):
    (tmp_path / "dapo.yaml").write_text("recipe: dapo\n")
    res, from_yaml = captured("--config", str(tmp_path / "dapo.yaml"))
    assert res.exit_code == 0, res.output
    _, from_option = captured("--recipe", "dapo")
    assert from_yaml == from_option  # every field, the run folder included
    assert (from_yaml.dynamic_sampling, from_yaml.clip_eps_high, from_yaml.overlong_buffer) == (True, 0.28, 128)
    assert from_yaml.run_dir == os.path.abspath("runs/repair-dapo") and run_label(from_yaml) == "dapo"
    # layers: recipe < YAML < command line; the command line's recipe supplies the base
    (tmp_path / "mine.yaml").write_text("recipe: dapo\nclip_eps_high: 0.3\ngroup_size: 4\n")
    _, cfg = captured("--config", str(tmp_path / "mine.yaml"), "--group-size", "3")
    assert (cfg.dynamic_sampling, cfg.clip_eps_high, cfg.group_size) == (True, 0.3, 3)
    assert run_label(cfg) == "dapo (modified: clip_eps_high=0.3)"
    _, cfg = captured("--config", str(tmp_path / "mine.yaml"), "--recipe", "ppo")
    assert (cfg.recipe, cfg.advantage, cfg.dynamic_sampling, cfg.clip_eps_high) == ("ppo", "gae", False, 0.3)
    (tmp_path / "typo.yaml").write_text("recipe: dapoo\n")
    res, cfg = captured("--config", str(tmp_path / "typo.yaml"))
    assert (
        res.exit_code == 2
        and cfg is None
        and f"recipe: in {tmp_path / 'typo.yaml'}: unknown recipe 'dapoo'" in _text(res)
    )
    with pytest.raises(ValueError, match="resolve_config"):  # the library never labels a run with an unapplied recipe
        TrainConfig.from_yaml(tmp_path / "dapo.yaml")


def test_explain_shows_a_train_config_with_its_recipe_applied(tmp_path, monkeypatch):
    from consequence.cli.common import console

    monkeypatch.setattr(console, "width", 250)  # the shared console's width is fixed when first used
    p = tmp_path / "my.yaml"
    p.write_text("recipe: dapo\nrun_dir: somewhere\niterations: 3\nmax_turns: 3\ndynamic_sampling: false\n")
    res = CliRunner().invoke(app, ["explain", str(p)], env=ENV)
    out = _text(res)
    assert res.exit_code == 0, res.output
    assert "dapo (modified: dynamic_sampling=False) (my.yaml)" in out and f"consequence train --config {p}" in out
    assert "overlong_buffer │ 128" in out and "max_turns │ 3 │ 8" in out  # recipe setting; file setting vs REINFORCE's
    res = CliRunner().invoke(app, ["explain", str(p), "dapo"], env=ENV)
    assert res.exit_code == 0 and "dynamic_sampling │ False │ True" in _text(res)
    p.write_text("rundir: 3\n")
    res = CliRunner().invoke(app, ["explain", str(p)], env=ENV)
    assert res.exit_code == 2 and "rundir (--rundir): unknown option; did you mean run_dir?" in _text(res)
    p.write_text("run: 3\n")  # run is a box: its section is a mapping
    res = CliRunner().invoke(app, ["explain", str(p)], env=ENV)
    assert res.exit_code == 2 and "run: a box section holds the box's settings as a mapping" in _text(res)
    p.write_text("name: x\ntitle: X\nsummary: s\npaper: p\nconfig: {advantage: rloo, iterations: 2}\n")
    res = CliRunner().invoke(app, ["explain", str(p)], env=ENV)
    assert res.exit_code == 2 and "config sets iterations, which belong to a run" in _text(res)


# ---- 2. paths are stored absolute ----------------------------------------------------------------
def test_path_options_are_stored_absolute(tmp_path, monkeypatch, captured):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(BUNDLED, tmp_path / "model")
    write_tasks(tmp_path / "tasks.jsonl")
    (tmp_path / "rec.yaml").write_text("name: mine\ntitle: Mine\nsummary: s\npaper: p\nconfig: {advantage: rloo}\n")
    res, cfg = captured("--model", "model", "--tasks", "tasks.jsonl", "--run-dir", "out/run", "--recipe", "rec.yaml")
    assert res.exit_code == 0, res.output
    assert (cfg.model, cfg.tasks_file, cfg.run_dir, cfg.recipe) == tuple(
        str(tmp_path / n) for n in ("model", "tasks.jsonl", "out/run", "rec.yaml")
    )
    assert cfg.env == "jsonl"  # --tasks FILE.jsonl (its older name) = --env jsonl --tasks-file FILE
    assert not (tmp_path / "out").exists()  # the write check leaves nothing behind


# ---- 5. booleans switch off -----------------------------------------------------------------------
@pytest.mark.slow
def test_every_boolean_option_has_a_no_form_that_overrides_the_recipe(captured):
    res = CliRunner().invoke(app, ["train", "--help"], env=ENV)
    bools = [n for n, f in TrainConfig.model_fields.items() if f.annotation is bool]
    assert set(bools) >= {"skip_checks", "dynamic_sampling", "overlong_filter"}
    for n in bools:
        assert "--no-" + n.replace("_", "-") in res.output
    _, cfg = captured("--recipe", "dapo", "--no-dynamic-sampling")
    assert cfg.dynamic_sampling is False and run_label(cfg) == "dapo (modified: dynamic_sampling=False)"
    _, cfg = captured("--recipe", "dapo")
    assert cfg.dynamic_sampling is True  # not given: the recipe's value
    _, cfg = captured("--overlong-filter", "--no-skip-checks")
    assert (cfg.overlong_filter, cfg.skip_checks) == (True, False)


# ---- 6. one list syntax ---------------------------------------------------------------------------
@pytest.mark.slow
def test_list_options_are_comma_separated_or_repeated_without_duplicates(tmp_path, captured):
    res, cfg = captured("--final-eval-decoding", "greedy,sampled")
    assert res.exit_code == 0 and cfg.final_eval_decoding == ["greedy", "sampled"]
    _, cfg = captured("--final-eval-decoding", "sampled, greedy,sampled", "--final-eval-decoding", "greedy")
    assert cfg.final_eval_decoding == ["sampled", "greedy"]  # order kept, each once
    for text in ("final_eval_decoding: [sampled, sampled]\n", "final_eval_decoding: sampled,sampled\n"):
        (tmp_path / "c.yaml").write_text(text)
        _, cfg = captured("--config", str(tmp_path / "c.yaml"))
        assert cfg.final_eval_decoding == ["sampled"]
    _, cfg = captured("--final-eval-splits", "test")
    assert cfg.final_eval_splits == ["test"]
    res, _ = captured("--final-eval-splits", "validation")
    assert res.exit_code == 2 and "Input should be 'test' or 'train'" in _text(res)
    res, cfg = captured("--final-eval-decoding", ",")
    assert (
        res.exit_code == 2
        and "--final-eval-decoding): empty list" in _text(res)
        and "--final-eval-episodes 0" in _text(res)
    )
    res, _ = captured("--final-eval-decoding", "greedy,beam")
    assert res.exit_code == 2 and "Input should be 'greedy' or 'sampled' (got 'beam')" in _text(res)
    from consequence.cli.common import parse_ks

    assert parse_ks("4,1,4, 16") == [4, 1, 16]


# ---- 7. names and folders of runs -------------------------------------------------------------------
@pytest.mark.slow
def test_a_run_is_named_by_what_it_is_and_a_recipe_has_its_own_folder(captured):
    _, default = captured()
    _, grpo = captured("--recipe", "grpo")
    assert (
        default.run_dir == os.path.abspath("runs/repair-default") != grpo.run_dir == os.path.abspath("runs/repair-grpo")
    )
    assert run_label(default) == "grpo advantages, ppo_clip, token_mean" and run_label(grpo) == "grpo"
    _, gae = captured("--advantage", "gae")
    assert run_label(gae) == "gae advantages, ppo_clip, token_mean"
    _, rloo = captured("--advantage", "rloo", "--surrogate", "pg")
    assert run_label(rloo) == "rloo"  # exactly the rloo recipe's settings
    _, grpo_kl = captured("--recipe", "grpo", "--kl-coef", "0.1")
    assert run_label(grpo_kl) == "grpo (modified: kl_coef=0.1)"
    assert run_label(load_recipe("gspo").train_config()) == "gspo"


# ---- 10. mini-batches fit the batch ------------------------------------------------------------------
def test_mini_batches_larger_than_the_batch_are_refused(captured):
    res, cfg = captured("--mini-batches", "5", "--tasks-per-iteration", "2", "--group-size", "2")
    assert res.exit_code == 2 and cfg is None
    assert (
        "--mini-batches 5 is more than the 4 trajectories of a batch (--tasks-per-iteration 2 × --group-size 2)"
        in _text(res)
    )
    _, cfg = captured("--mini-batches", "4", "--tasks-per-iteration", "2", "--group-size", "2")
    assert cfg.mini_batches == 4


# ---- 11. JSONL task files -----------------------------------------------------------------------------
@pytest.mark.slow
def test_a_jsonl_task_file_is_accepted_and_checked_before_work(tmp_path, captured):
    from consequence.envs.registry import env_of

    write_tasks(tmp_path / "tasks.jsonl")
    for args in (
        ["--tasks", str(tmp_path / "tasks.jsonl")],
        ["--env", "jsonl", "--tasks-file", str(tmp_path / "tasks.jsonl")],
    ):
        res, cfg = captured(*args, "--run-dir", str(tmp_path / "run"))
        assert res.exit_code == 0 and (cfg.env, cfg.tasks_file) == ("jsonl", str(tmp_path / "tasks.jsonl"))
    src = env_of(cfg)
    assert sum(len(v) for v in src.split.values()) == 12 and len(src.split["train"]) >= 8
    assert src.sample("train", 3, seed=1)[0].func_name == "f" and src.label == str(tmp_path / "tasks.jsonl")
    cases = [
        (repair_record(2, hidden_test=[]), ":3: unknown field(s) ['hidden_test']"),
        (repair_record(2, kind="completion"), ":3: task 'max-2' has kind 'completion'"),
    ]
    for bad, needle in cases:
        write_tasks(tmp_path / "bad.jsonl", bad_line=bad)
        res, cfg = captured("--tasks", str(tmp_path / "bad.jsonl"), "--run-dir", str(tmp_path / "run"))
        assert res.exit_code == 2 and cfg is None and f"--tasks-file {tmp_path / 'bad.jsonl'}{needle}" in _text(res), (
            res.output
        )
    res, _ = captured("--tasks", str(tmp_path / "none.jsonl"))
    assert res.exit_code == 2 and "none.jsonl: no such file" in _text(res)
    res, _ = captured("--env", "jsonl")
    assert res.exit_code == 2 and "--env jsonl needs a task file: --tasks-file FILE.jsonl" in _text(res)
    res, _ = captured("--tasks", "mbpp")
    assert res.exit_code == 2 and "--env 'mbpp': unknown environment; valid: repair, humaneval-repair, jsonl" in _text(
        res
    )
    assert not (tmp_path / "run").exists()


# ---- 4. model folders --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "damage,needle",
    [
        ("weights", "no weights (model.safetensors, pytorch_model.bin, model.safetensors.index.json"),
        ("json", "config.json is not valid JSON"),
        ("model_type", "config.json has no model_type"),
    ],
)
def test_a_broken_model_folder_is_refused_before_work(tmp_path, damage, needle):
    model = tmp_path / "model"
    shutil.copytree(BUNDLED, model)
    if damage == "weights":
        (model / "model.safetensors").unlink()
    elif damage == "json":
        (model / "config.json").write_text('{"model_type": "llama",')
    else:
        (model / "config.json").write_text('{"vocab_size": 768}')
    run = tmp_path / "run"
    res = CliRunner().invoke(app, ["train", "--model", str(model), "--run-dir", str(run)], env=ENV)
    assert res.exit_code == 2 and f"error: --model {model}: {needle}" in _text(res)
    assert not run.exists()
    from consequence.policy.tiny import load_policy

    with pytest.raises(ValueError, match=needle.split(" (")[0]):  # the library says the same
        load_policy(model)


# ---- 4, 9. labs ---------------------------------------------------------------------------------------
def test_lab_without_a_name_lists_the_labs_and_bad_options_are_refused_first(tmp_path):
    from consequence.labs import LABS

    res = CliRunner().invoke(app, ["lab"], env=ENV)
    assert res.exit_code == 0
    for name in LABS:
        assert name in res.output
    assert "where the clipped surrogate stops giving a gradient" in _text(res)
    res = CliRunner().invoke(app, ["lab", "clip", "--out", "/proc/x"], env=ENV)
    assert res.exit_code == 2 and "--out /proc/x: cannot write there" in _text(res)
    res = CliRunner().invoke(app, ["lab", "baseline", "--seed", "-5", "--out", str(tmp_path / "o")], env=ENV)
    assert res.exit_code == 2 and "--seed" in _text(res) and not (tmp_path / "o").exists()
    res = CliRunner().invoke(app, ["lab", "nope"], env=ENV)
    assert res.exit_code == 2 and "unknown lab 'nope'" in _text(res)


# ---- 12. reproduce says how long it takes and can be shortened -------------------------------------------
def test_reproduce_help_gives_its_duration_and_how_to_shorten_it():
    res = CliRunner().invoke(app, ["reproduce", "--help"], env=ENV)
    out = _text(res)
    assert "about as long as the original run (the default run: ~12 min on 2 cores)" in out
    assert "--iterations" in out and "--final-eval-episodes" in out


def test_reproduce_checks_everything_before_making_its_folder(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    cfg = TrainConfig(run_dir=str(run)).model_dump()
    manifest = {"config": {**cfg, "model": "relative/model"}, "cwd": str(tmp_path / "elsewhere")}
    (run / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["reproduce", str(run), "--run-dir", str(tmp_path / "new")], env=ENV)
    assert res.exit_code == 2 and "the run's model folder relative/model (--model) does not exist from here" in _text(
        res
    )
    manifest["config"]["model"] = str(tmp_path / "gone")
    (run / "manifest.json").write_text(json.dumps(manifest))
    res = CliRunner().invoke(app, ["reproduce", str(run), "--run-dir", str(tmp_path / "new")], env=ENV)
    assert res.exit_code == 2 and "does not exist; nothing was started" in _text(res)
    res = CliRunner().invoke(
        app, ["reproduce", str(run), "--run-dir", str(tmp_path / "new"), "--iterations", "0"], env=ENV
    )
    assert res.exit_code == 2 and "--iterations" in _text(res)
    assert not (tmp_path / "new").exists()


def test_a_config_file_with_a_distillation_recipe_and_teacher_on_the_command_line(tmp_path, captured):
    """--config FILE --recipe gkd --teacher T: the file's values are checked with the command line's teacher."""
    (tmp_path / "c.yaml").write_text("iterations: 2\nlearning_rate: 0.5\n")
    from consequence.policy.tiny import BUNDLED

    res, cfg = captured("--config", str(tmp_path / "c.yaml"), "--recipe", "gkd", "--teacher", str(BUNDLED))
    assert res.exit_code == 0, res.output
    assert (cfg.distill_loss, cfg.teacher, cfg.iterations) == ("jsd", str(BUNDLED), 2)
    res, _ = captured("--config", str(tmp_path / "c.yaml"), "--recipe", "gkd")
    assert res.exit_code == 2 and "needs --teacher" in res.output


def test_a_yes_no_for_a_number_is_refused_not_read_as_one(tmp_path):
    """Break-test: `overlong_buffer: true` in a config file was accepted as a buffer of 1 token."""
    p = tmp_path / "c.yaml"
    p.write_text("recipe: dapo\noverlong_buffer: true\n")
    res = CliRunner().invoke(app, ["train", "--config", str(p), "--run-dir", str(tmp_path / "r")])
    assert res.exit_code == 2
    assert "overlong_buffer: true is a yes/no, but overlong_buffer takes a whole number (default 0)" in res.output
    with pytest.raises(ValueError, match="clip_eps: false is a yes/no, but clip_eps takes a number"):
        TrainConfig(clip_eps=False)
    assert TrainConfig(overlong_buffer=128, dynamic_sampling=True).overlong_buffer == 128
    assert not (tmp_path / "r").exists()

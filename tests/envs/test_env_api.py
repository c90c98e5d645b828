"""The environment API: registry, options, per-turn rewards, answers, env errors, group hooks."""

import json
import re
from types import SimpleNamespace

import pytest

from consequence.config import TrainConfig
from consequence.credit.returns import discounted_returns
from consequence.envs.registry import BUILTINS, available, load_environment
from consequence.harness.renderer import Renderer
from consequence.records import trajectory_to_rows
from consequence.reward.scoring import score_trajectories
from consequence.rollout.episodes import Budgets, EpisodeSpec, run_episodes


def test_builtins_resolve_with_their_splits():
    assert {"repair", "humaneval-repair", "jsonl", "humaneval", "reasoning-gym", "calculator"} <= set(BUILTINS)
    env = load_environment("repair")
    assert (env.name, {k: len(v) for k, v in env.split.items()}) == (
        "repair",
        {"train": 625, "validation": 78, "test": 78},
    )
    assert env.reward_components == ("hidden_tests",) and env.answer_ends_episode is False
    d = env.describe()
    assert (
        d["name"] == "repair"
        and len(d["source_sha256"]) == 64
        and d["tools"] == ["run_tests", "read_code", "replace_line", "finish"]
    )


def test_unknown_names_and_options_are_refused_with_what_is_valid():
    with pytest.raises(ValueError, match="unknown environment; valid: repair, humaneval-repair"):
        load_environment("nope")
    with pytest.raises(ValueError, match="cannot import module 'no_such_mod'"):
        load_environment("no_such_mod:Env")
    with pytest.raises(ValueError, match="has no attribute 'Missing'"):
        load_environment("env_fixtures:Missing")
    with pytest.raises(ValueError, match="unknown option 'colour'; it takes words, boom"):
        load_environment("env_fixtures:ReverseEnvironment", 0, {"colour": "red"})
    with pytest.raises(ValueError, match="unknown option 'x'; it takes none"):
        load_environment("env_fixtures:NoOptions", 0, {"x": 1})
    with pytest.raises(ValueError, match="takes no task file"):
        load_environment("repair", 0, {"tasks_file": "/tmp/t.jsonl"})
    with pytest.raises(ValueError, match="not a consequence.envs.api.Environment"):
        load_environment("env_fixtures:not_an_environment")
    with pytest.raises(ValueError, match="needs a task file: --tasks-file"):
        load_environment("jsonl")


def test_module_attr_with_options_is_applied_and_recorded():
    env = load_environment("env_fixtures:ReverseEnvironment", 3, {"words": ["ab", "cd", "ef", "gh"]})
    assert [t.word for t in env.split["train"]] == ["ab", "cd"] and env.split_seed == 3
    d = env.describe()
    assert (d["name"], d["version"], d["options"], d["class"]) == (
        "reverse",
        "3",
        {"words": ["ab", "cd", "ef", "gh"]},
        "env_fixtures:ReverseEnvironment",
    )
    assert "reverse" not in available()  # a module:attr environment needs no registration
    assert len(env.sample("train", 5, seed=1)) == 5


def _scripted(renderer, turns):
    """A generate function that plays ``turns`` (text per call) for a single episode."""
    outputs = iter([renderer.encode(t) + [renderer.eot_id] for t in turns])

    def generate(prompts, max_new_tokens, idx):
        ids = next(outputs)
        return [SimpleNamespace(output_ids=ids, logprobs=[-0.25] * len(ids), stop_reason="stop")]

    return generate


def _run(env, turns, tokenizer):
    renderer = Renderer(tokenizer, env.tools)
    task = env.split["train"][0]
    [t] = run_episodes(
        _scripted(renderer, turns),
        renderer,
        [EpisodeSpec(env.make_episode(task), task.task_id, "g", 0, 0)],
        Budgets(max_turns=4, max_new_tokens=64, max_total_tokens=4000),
        env.system_prompt,
    )
    score_trajectories([t], components=env.reward_components, reward_range=env.reward_range)
    return t, renderer


def test_per_turn_rewards_are_kept_on_their_calls_and_summed(tiny_tokenizer):
    env = load_environment("env_fixtures:ReverseEnvironment", 0, {"words": ["ab", "cd", "ef", "gh"]})
    hint = '<tool_call>\n{"name": "hint", "arguments": {}}\n</tool_call>'
    t, renderer = _run(env, [hint, hint, "ba"], tiny_tokenizer)
    assert [c.reward for c in t.calls] == [-0.1, -0.1, 1.0]
    assert t.env_rewards == pytest.approx({"hints": -0.2, "accuracy": 1.0})
    assert (t.outcome, t.verifier_score) == ("finished", 1.0)  # primary component = accuracy
    assert t.reward == pytest.approx(0.8) and t.reward_components == pytest.approx({"accuracy": 1.0, "hints": -0.2})
    assert t.n_tool_calls == 2 and t.messages[-1] == {"role": "user", "content": ""}
    [row] = trajectory_to_rows(t)
    ends = [j for j, r in enumerate(row.token_rewards) if r]
    assert [row.token_rewards[j] for j in ends] == [-0.1, -0.1, 1.0]
    assert all(row.loss_mask[j] for j in ends)  # each turn's reward sits on a sampled token
    # returns-to-go of each call's tokens: what that turn and the later ones earned
    g = discounted_returns(row.token_rewards, row.loss_mask, 1.0)
    first = row.loss_mask.index(1)
    assert g[first] == pytest.approx(0.8) and g[ends[1]] == pytest.approx(0.9) and g[ends[2]] == pytest.approx(1.0)


def test_a_wrong_answer_ends_the_episode_with_zero_accuracy(tiny_tokenizer):
    env = load_environment("env_fixtures:ReverseEnvironment", 0, {"words": ["ab", "cd", "ef", "gh"]})
    t, _ = _run(env, ["ab"], tiny_tokenizer)
    assert (t.outcome, t.reward, len(t.calls), t.n_tool_calls) == ("finished", 0.0, 1, 0)


@pytest.mark.parametrize("where", ["reset", "step"])
def test_an_environment_that_raises_is_an_env_error_not_a_zero(tiny_tokenizer, where):
    env = load_environment("env_fixtures:ReverseEnvironment", 0, {"boom": where})
    t, _ = _run(env, ["cba"], tiny_tokenizer)
    assert (t.outcome, t.reward) == ("env_error", None)
    assert t.error == f"environment {where} raised RuntimeError: {where} broke"


def test_a_reward_outside_the_declared_range_is_an_env_error(tiny_tokenizer):
    env = load_environment("env_fixtures:ReverseEnvironment", 0, {"words": ["ab", "cd", "ef", "gh"]})
    hint = '<tool_call>\n{"name": "hint", "arguments": {}}\n</tool_call>'
    renderer = Renderer(tiny_tokenizer, env.tools)
    task = env.split["train"][0]
    [t] = run_episodes(
        _scripted(renderer, [hint] * 3 + ["ba"]),
        renderer,
        [EpisodeSpec(env.make_episode(task), task.task_id, "g", 0, 0)],
        Budgets(max_turns=4, max_new_tokens=64, max_total_tokens=4000),
        env.system_prompt,
    )
    score_trajectories([t], components=env.reward_components, reward_range=(0.0, 0.5))  # total 0.7
    assert (t.outcome, t.reward) == ("env_error", None) and "outside the declared range [0.0, 0.5]" in t.error


def test_collect_builds_groups_with_the_group_builder_and_calls_score_group(monkeypatch):
    from consequence.records import Trajectory
    from consequence.rollout.collect import roll_out_round

    env = load_environment("env_fixtures:ReverseEnvironment", 0, {"words": ["ab", "cd", "ef", "gh"]})
    made = []
    real = env.make_group
    monkeypatch.setattr(env, "make_group", lambda task, size: made.append((task.word, size)) or real(task, size))

    def runner(specs, seed, version, progress):  # an EpisodeRunner that plays nothing
        return [Trajectory(s.task_id, s.group_id, s.sample_id, s.seed, 0) for s in specs], {}

    cfg = TrainConfig(tasks_per_iteration=2, group_size=3)
    groups, _ = roll_out_round(0, 0, cfg, runner, env, Budgets())
    assert [len(g) for g in groups] == [3, 3] and [s for _, s in made] == [3, 3]
    assert [n for _, n in env.scored] == [3, 3]


def test_config_env_shorthands(tmp_path):
    f = tmp_path / "t.jsonl"
    assert TrainConfig(tasks="humaneval-repair").env == "humaneval-repair"
    c = TrainConfig(env=str(f))
    assert (c.env, c.tasks_file) == ("jsonl", str(f))
    with pytest.raises(ValueError, match="--tasks repair and --env calculator disagree"):
        TrainConfig(tasks="repair", env="calculator")
    from consequence.recipes import resolve_config

    assert resolve_config(None, {"env": "calculator"}).run_dir.endswith("runs/calculator-default")
    assert resolve_config(None, {"env": "calculator", "recipe": "dapo"}).run_dir.endswith("runs/calculator-dapo")
    assert resolve_config(None, {}).run_dir.endswith("runs/repair-default")


def test_declarations_are_checked_when_the_environment_loads():
    with pytest.raises(ValueError, match="problem 'p0' is in both the train and the test split"):
        load_environment("env_fixtures:LeakyEnvironment")
    env = load_environment("env_fixtures:PlainTasks")  # tasks need not be dataclasses
    drawn = env.sample("train", 3, seed=2)
    assert [t.task_id.split("#")[1] for t in drawn] == ["2-0", "2-1", "2-2"] and env.split["train"][0].task_id == "t0"


def test_a_group_builder_must_make_isolated_episodes():
    from consequence.rollout.groups import group_of

    env = load_environment("env_fixtures:ShortGroups")
    with pytest.raises(ValueError, match="returned the same episode object more than once"):
        group_of(env, env.split["train"][0], 3)


def test_components_that_do_not_add_up_to_the_reward_are_an_env_error(tiny_tokenizer):
    env = load_environment("env_fixtures:BadSums")
    t, _ = _run(env, ["ba"], tiny_tokenizer)
    assert (t.outcome, t.reward) == ("env_error", None)
    assert "returned reward 1.0 but its reward_components {'accuracy': 0.5} sum to 0.5" in t.error


def test_a_rescored_group_is_checked_again():
    from consequence.records import Trajectory
    from consequence.reward.scoring import rescore_group

    env = load_environment("env_fixtures:ReverseEnvironment")
    group = [Trajectory("w0", "g", k, 0, 0, reward=0.0) for k in range(2)]
    env.score_group = lambda task, ts: [setattr(t, "reward", r) for t, r in zip(ts, (1.0, 7.0))]
    rescore_group(env, env.split["train"][0], group)
    assert (group[0].outcome, group[0].reward) == ("finished", 1.0)
    assert (group[1].outcome, group[1].reward) == ("env_error", None) and "score_group:" in group[1].error


def test_envs_command_lists_every_environment(monkeypatch):
    from typer.testing import CliRunner

    from consequence.cli import app
    from consequence.cli.common import console

    monkeypatch.setattr(console, "_width", 400)  # one line per row, whatever the worker's terminal
    res = CliRunner().invoke(app, ["envs"])
    assert res.exit_code == 0
    for name in BUILTINS:
        assert name in res.output
    assert "tasks_file=None" in res.output and "accuracy, tool_cost" in res.output


def test_broken_declarations_and_modules_are_messages_not_tracebacks(tmp_path, monkeypatch):
    (tmp_path / "brokenmod.py").write_text("raise RuntimeError('half-written module')\n")
    (tmp_path / "decl.py").write_text(
        "from env_fixtures import ReverseEnvironment\n"
        "class NoRange(ReverseEnvironment):\n    reward_range = None\n"
        "class NoSplits(ReverseEnvironment):\n    def load_splits(self, s):\n        return None\n"
        "class BadTool(ReverseEnvironment):\n    tools = [{'type': 'function'}]\n"
        "class ResetRaises(ReverseEnvironment):\n    def make_episode(self, task):\n        raise KeyError('nope')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name, needle in [
        ("brokenmod:X", "importing module 'brokenmod' raised RuntimeError: half-written module"),
        (":X", "give module:attr"),
        ("decl:NoRange", "reward_range must be (low, high) numbers"),
        ("decl:NoSplits", "load_splits() returned a NoneType"),
        ("decl:BadTool", "tools[0] must look like"),
    ]:
        with pytest.raises(ValueError, match=re.escape(needle)):
            load_environment(name)
    env = load_environment("decl:ResetRaises")
    with pytest.raises(ValueError, match="making or resetting an episode of task 'w0' raised KeyError"):
        env.request(env.split["train"][0])


def test_env_options_merge_key_by_key_and_a_task_file_is_not_an_option(tmp_path):
    from consequence.recipes import resolve_config

    y = tmp_path / "c.yaml"
    y.write_text("env: reasoning-gym\nenv_options: {dataset: leg_counting, size: 60}\n")
    cfg = resolve_config(y, {"env_options": {"size": 3}})
    assert cfg.env_options == {"dataset": "leg_counting", "size": 3}
    with pytest.raises(ValueError, match="give the task file as --tasks-file FILE"):
        TrainConfig.checked(env="jsonl", env_options={"tasks_file": "x.jsonl"})


def test_a_first_batch_of_env_errors_stops_the_run_with_the_environments_message(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from consequence.cli import app

    monkeypatch.setenv("CONSEQUENCE_LEDGER", str(tmp_path / "ledger.jsonl"))
    run = tmp_path / "run"
    res = CliRunner().invoke(
        app,
        [
            "train",
            "--env",
            "env_fixtures:ReverseEnvironment",
            "--env-option",
            "boom=rollout-reset",
            "--iterations",
            "1",
            "--tasks-per-iteration",
            "2",
            "--group-size",
            "2",
            "--eval-every",
            "0",
            "--final-eval-episodes",
            "0",
            "--max-turns",
            "1",
            "--max-new-tokens",
            "8",
            "--run-dir",
            str(run),
        ],
    )
    assert res.exit_code == 1, res.output
    text = " ".join(res.output.split())
    assert "every episode of the first batch is an env_error (4 of 4)" in text
    assert "environment reset raised RuntimeError: reset broke" in text
    assert json.loads((run / "manifest.json").read_text())["status"] == "stopped"
    early = CliRunner().invoke(
        app,
        [
            "train",
            "--env",
            "env_fixtures:ReverseEnvironment",
            "--env-option",
            "boom=reset",
            "--final-eval-episodes",
            "0",
            "--eval-every",
            "0",
            "--run-dir",
            str(tmp_path / "early"),
        ],
    )
    assert early.exit_code == 2 and "raised RuntimeError: reset broke" in " ".join(early.output.split())
    assert not (tmp_path / "early").exists()  # refused before any work


def test_source_hash_covers_the_episode_module_and_reproduce_names_a_changed_environment(monkeypatch):
    from consequence.envs import api
    from consequence.reproduce import _environment_drift

    env = load_environment("repair")
    d = env.describe()
    assert _environment_drift(d) == []
    real = api.Path.read_bytes
    monkeypatch.setattr(
        api.Path, "read_bytes", lambda p: real(p) + (b"#" if p.parts[-2:] == ("repair", "env.py") else b"")
    )
    assert api.source_sha256(type(env)) != d["source_sha256"]  # RepairEnv's file is part of the hash
    assert _environment_drift(d) == ["environment repair: its source changed since the run (sha256 differs)"]

"""``humaneval`` as an environment: single-turn completion, trainable and evaluable.

The episode's request is the completion protocol's chat prompt, its answer is scored by
the same function as the pass@k evaluation (``code_tasks.verify_completion``), and a run
trained on it is evaluated with that protocol by ``consequence eval``.
"""

import json
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from consequence.cli import app
from consequence.envs.humaneval.code_tasks import chat_request
from consequence.envs.registry import load_environment
from consequence.harness.renderer import Renderer
from consequence.records import read_trajectories
from consequence.reward.scoring import score_trajectories
from consequence.rollout.episodes import Budgets, EpisodeSpec, run_episodes

pytestmark = pytest.mark.slow  # every test scores HumanEval problems in the sandbox or trains on them


def _answer(env, task, text, tokenizer):
    renderer = Renderer(tokenizer, env.tools)
    ids = renderer.encode(text) + [renderer.eot_id]
    gen = lambda prompts, n, idx: [SimpleNamespace(output_ids=ids, logprobs=[-1.0] * len(ids), stop_reason="stop")]  # noqa: E731
    [t] = run_episodes(
        gen,
        renderer,
        [EpisodeSpec(env.make_episode(task), task.task_id, "g", 0, 0)],
        Budgets(max_turns=3, max_new_tokens=4000, max_total_tokens=10**6),
        env.system_prompt,
    )
    score_trajectories([t], components=env.reward_components, reward_range=env.reward_range)
    return t


def test_one_step_scored_by_the_completion_verifier(tiny_tokenizer):
    from consequence.envs.humaneval.problems import records

    env = load_environment("humaneval")
    assert {k: len(v) for k, v in env.split.items()} == {"train": 131, "validation": 16, "test": 17}
    assert env.tools == [] and env.system_prompt == "" and env.answer_ends_episode
    task = env.split["train"][0]
    canonical = {r["task_id"]: r for r in records()}[task.task_id]
    right = f"```python\n{canonical['prompt']}{canonical['canonical_solution']}```"
    t = _answer(env, task, right, tiny_tokenizer)
    assert (t.outcome, t.reward, len(t.calls), t.calls[0].reward) == ("finished", 1.0, 1, 1.0)
    assert t.messages[0] == {"role": "user", "content": chat_request(task)}  # no system turn: the protocol's prompt
    wrong = _answer(env, task, "```python\n    return None\n```", tiny_tokenizer)
    assert (wrong.outcome, wrong.reward, wrong.reward_components) == ("finished", 0.0, {"hidden_tests": 0.0})
    assert wrong.final_code.endswith("    return None\n")


def _train_one_iteration(tmp_path, monkeypatch, env: str, turns: int, total: int):
    """``consequence train --env ENV`` for one tiny iteration into ``tmp_path/run``; returns the run folder."""
    monkeypatch.setenv("CONSEQUENCE_LEDGER", str(tmp_path / "ledger.jsonl"))
    run = tmp_path / "run"
    res = CliRunner().invoke(
        app,
        [
            "train",
            "--env",
            env,
            "--max-turns",
            str(turns),
            "--max-new-tokens",
            "16",
            "--max-total-tokens",
            str(total),
            "--iterations",
            "1",
            "--tasks-per-iteration",
            "2",
            "--group-size",
            "2",
            "--eval-every",
            "0",
            "--final-eval-episodes",
            "2",
            "--final-eval-decoding",
            "greedy",
            "--run-dir",
            str(run),
        ],
    )
    assert res.exit_code == 0, res.output
    return run


def test_train_one_iteration_then_evaluate(tmp_path, monkeypatch):
    run = _train_one_iteration(tmp_path, monkeypatch, "humaneval", 1, 1500)
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["environment"]["name"] == "humaneval" and manifest["tasks"]["sizes"]["train"] == 131
    trajs = read_trajectories(run / "trajectories" / "iter_0000.parquet")
    assert len(trajs) == 4 and all(len(t.calls) == 1 for t in trajs)  # single-turn: one model call
    assert all(set(t.reward_components) == {"hidden_tests"} for t in trajs if t.reward is not None)
    ev = CliRunner().invoke(
        app,
        [
            "eval",
            "--model",
            str(run),
            "--problems",
            "2",
            "-n",
            "1",
            "--max-new-tokens",
            "8",
            "--out",
            str(tmp_path / "e"),
        ],
    )
    assert ev.exit_code == 0, ev.output
    out = json.loads((tmp_path / "e" / "eval.json").read_text())
    assert out["settings"]["tasks"] == "humaneval" and out["tasks"] == 2  # the pass@k completion protocol
    assert out["settings"]["provenance"]["keys"]["env"]["from"] == "run"


def test_humaneval_repair_trains_one_iteration_and_evaluates(tmp_path, monkeypatch):
    run = _train_one_iteration(tmp_path, monkeypatch, "humaneval-repair", 2, 2048)
    manifest = json.loads((run / "manifest.json").read_text())
    env = load_environment("humaneval-repair")
    assert manifest["environment"]["name"] == "humaneval-repair"
    assert manifest["tasks"]["sizes"] == {k: len(v) for k, v in env.split.items()}
    trajs = read_trajectories(run / "trajectories" / "iter_0000.parquet")
    train_ids = {t.task_id for t in env.split["train"]}  # instances are train tasks under new ids
    assert len(trajs) == 4 and {t.task_id.split("#")[0] for t in trajs} <= train_ids
    ev = CliRunner().invoke(
        app, ["eval", "--model", str(run), "--problems", "2", "-n", "1", "--no-recovery", "--out", str(tmp_path / "e")]
    )
    assert ev.exit_code == 0, ev.output
    out = json.loads((tmp_path / "e" / "eval.json").read_text())
    assert out["settings"]["environment"]["name"] == "humaneval-repair" and len(out["per_task"]) == 2

"""``consequence env-check`` (experiment/env_check.py, experiment/env_pilot.py, cli/env_check.py).

Every shipped environment passes every check on a few instances; a deliberately broken
environment (made here: a reference the verifier rejects, a reward out of range, a
non-reproducible reset, an invalid tool schema, a bad answer that crashes or is rewarded)
fails the right check with a message that names the fix. The CLI: exit status, table, JSON.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from consequence.cli import app
from consequence.envs.api import Environment
from consequence.envs.registry import load_environment
from consequence.experiment.env_check import (
    WRONG_ANSWER,
    failed,
    load_tokenizer,
    malformed_call,
    run_checks,
    time_summary,
    wrong_plan,
)
from consequence.experiment.env_pilot import invalid_call_rates, nearest_rank, suggest_budgets
from consequence.policy.tiny import BUNDLED
from consequence.records import ModelCall, Trajectory
from consequence.rollout.episodes import Budgets
from task_files import write_tasks

ROOT = Path(__file__).resolve().parents[2]
NAMES = ["tool_schemas", "reset_reproducible", "reference_max", "empty_min", "malformed_min", "wrong_min",
         "reward_range", "step_time", "episode_time"]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()  # the bundled tiny model's: local files only


def _rows(env, tokenizer, **kw):
    rows = run_checks(env, tokenizer, **kw)
    assert [r.name for r in rows] == NAMES
    return {r.name: r for r in rows}


# ---- every shipped environment passes -------------------------------------------------
DEMONSTRATOR = {"repair", "humaneval-repair", "jsonl", "calculator"}


@pytest.mark.parametrize(
    "name, options",
    [
        ("repair", {}),
        ("humaneval-repair", {}),
        ("jsonl", None),  # a task file made below
        ("humaneval", {}),
        ("reasoning-gym", {"size": 60}),
        ("calculator", {}),
    ],
)
def test_every_shipped_environment_passes(name, options, tokenizer, tmp_path):
    if options is None:
        write_tasks(tmp_path / "tasks.jsonl")
        options = {"tasks_file": str(tmp_path / "tasks.jsonl")}
    env = load_environment(name, 0, options)
    rows = _rows(env, tokenizer, tasks=3, seed=0)
    assert not failed(rows.values()), [r.message for r in failed(rows.values())]
    if name in DEMONSTRATOR:
        assert rows["reference_max"].passed and rows["reference_max"].value == "3/3 verified"
    else:  # no demonstrator: reported as not available, never as passed
        assert rows["reference_max"].passed is None and "has no demonstrator" in rows["reference_max"].message
    for kind in ("empty", "malformed", "wrong"):
        assert rows[f"{kind}_min"].passed and rows[f"{kind}_min"].data == {
            "episodes": 3,
            "env_errors": 0,
            "above_min": 0,
        }
    plays = 4 if name in DEMONSTRATOR else 3
    assert rows["reward_range"].data["episodes"] == 3 * plays == rows["episode_time"].data["n"]
    assert rows["reset_reproducible"].value == "3/3 reproducible"


def test_calculator_with_a_tool_cost_counts_steps_and_totals_by_hand(tokenizer):
    # per task: reference = 1 calculator call + the answer (2 steps, total 1 - 0.05); empty reply
    # and the wrong answer = 1 answer step each (total 0); the malformed call never reaches step()
    env = load_environment("calculator", 0, {"tool_cost": 0.05})
    rows = _rows(env, tokenizer, tasks=3, seed=1)
    assert not failed(rows.values())
    assert rows["step_time"].data["n"] == 3 * (2 + 1 + 0 + 1)
    assert rows["episode_time"].data["n"] == 3 * 4
    r = rows["reward_range"].data
    assert (r["min_total"], r["max_total"]) == (0.0, math.fsum([1.0, -0.05]))
    assert r["low"] == -0.05 * 4 * (1 + 1e-9) and r["high"] == 1.0
    assert "digits shifted" in rows["wrong_min"].message


def test_the_held_out_shift_is_checked_on_its_validation_split(tokenizer):
    env = load_environment("calculator", 0, {"shift": True})
    with pytest.raises(ValueError, match="no train split"):
        run_checks(env, tokenizer, tasks=2, split="train")
    assert not failed(run_checks(env, tokenizer, tasks=2, split="validation"))


def test_the_vowel_count_plugin_example_passes(tokenizer, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "custom_env" / "src"))
    env = load_environment("consequence_vowels.env:VowelCountEnvironment", 0, {})
    rows = _rows(env, tokenizer, tasks=3)
    assert not failed(rows.values()) and rows["reference_max"].passed is None


def test_openenv_served_environments_pass(tokenizer):
    pytest.importorskip("uvicorn")
    pytest.importorskip("openenv.core.env_server")
    import test_env_openenv as served  # the OpenEnv servers of the adapter's own tests (same folder)

    apps = {
        "word": served.create_app(served.WordEnv, served.WordAction, served.WordObservation, max_concurrent_envs=16),
        "guess": served.create_app(
            served.GuessEnv, served.GuessAction, served.GuessObservation, max_concurrent_envs=16
        ),
    }
    servers = {k: served.Served(a) for k, a in apps.items()}
    try:
        target = "consequence.envs.openenv.env:OpenEnvEnvironment"
        word = load_environment(target, 0, {"base_url": servers["word"].url, "n_problems": 16})
        rows = _rows(word, tokenizer, tasks=3)
        assert not failed(rows.values()) and rows["reference_max"].passed is None
        guess = load_environment(
            target, 0, {"base_url": servers["guess"].url, "action": "tool", "reward_range": [-1, 1], "n_problems": 20}
        )
        rows = _rows(guess, tokenizer, tasks=3)
        assert not failed(rows.values())
        # tool mode: a reply does not end the episode and there is no demonstrator: no wrong final answer
        assert rows["wrong_min"].passed is None and "does not end its episodes" in rows["wrong_min"].message
    finally:
        for s in servers.values():
            s.stop()


# ---- deliberately broken environments ---------------------------------------------------
@dataclass(frozen=True)
class Word:
    task_id: str
    problem_id: str
    word: str


TOOL = {"type": "function", "function": {"name": "hint", "description": "The last letter.",
                                         "parameters": {"type": "object", "properties": {}}}}  # fmt: skip
BAD_TOOL = {"type": "function", "function": {"name": "hint", "description": "The last letter.",
                                             "parameters": {"type": "object", "properties": {"n": {"type": "nope"}}}}}  # fmt: skip
_nonces = itertools.count()


class EchoEpisode:
    """Answer the word reversed: accuracy 1 (or the ``bug``'s reward), else 0; ``hint`` shows the last letter."""

    def __init__(self, task, bug):
        self.task, self.bug, self.nonce = task, bug, 0

    def reset(self, seed=None, options=None):
        self.nonce = next(_nonces) if self.bug == "hidden_state" else 0
        extra = f" ({next(_nonces)})" if self.bug == "reset" else ""
        return f"Reverse {self.task.word}.{extra}", {"task_id": self.task.task_id}

    def step(self, action):
        if "answer" not in action:
            return self.task.word[-1], 0.0, False, False, {}
        text = action["answer"].strip()
        if self.bug == "crash_on_empty" and not text:
            raise RuntimeError("the grader cannot read an empty answer")
        ok = text == self.task.word[::-1] or (self.bug == "accepts_empty" and not text)
        reward = (2.0 if self.bug == "range" else 1.0) if ok else 0.0
        return "", reward, True, False, {"reward_components": {"accuracy": reward}}


class EchoEnvironment(Environment):
    """Reverse a word; ``bug`` breaks one thing (see the tests)."""

    name = "echo"
    system_prompt = "Reverse the word."
    reward_components = ("accuracy",)

    def __init__(self, split_seed=0, bug=None):
        self.bug = bug
        self.tools = [BAD_TOOL if bug == "schema" else TOOL]
        super().__init__(split_seed)

    def load_splits(self, split_seed):
        ws = [Word(f"w{i}", f"p{i}", w) for i, w in enumerate(["stone", "river", "maple", "cloud", "tiger", "ocean"])]
        return {"train": ws[:4], "validation": ws[4:5], "test": ws[5:]}

    def make_episode(self, task):
        return EchoEpisode(task, self.bug)

    def demonstration(self, task, rng):
        if self.bug == "demo_raises":
            raise KeyError("solution")
        return [{"answer": task.word if self.bug == "reference" else task.word[::-1]}]


def _echo(tokenizer, bug=None, tasks=3):
    return _rows(load_environment("test_env_check:EchoEnvironment", 0, {"bug": bug}), tokenizer, tasks=tasks)


def test_the_echo_environment_passes_when_nothing_is_broken(tokenizer):
    rows = _echo(tokenizer)
    assert not failed(rows.values())
    assert rows["reference_max"].value == "3/3 verified"
    # the wrong answer: the demonstrated answer has no digit, so it is the fixed wrong reply
    plan, how = wrong_plan(EchoEnvironment(), [{"answer": "enots"}])
    assert plan == [{"answer": WRONG_ANSWER}] and "has no digit" in how
    assert wrong_plan(EchoEnvironment(), [{"answer": "<answer>-1909</answer>"}])[0] == [
        {"answer": "<answer>-2010</answer>"}
    ]
    finish = {"name": "finish", "arguments": {}}
    assert wrong_plan(EchoEnvironment(), [{"name": "hint", "arguments": {}}, finish])[0] == [finish]


def test_a_reference_the_verifier_rejects_fails(tokenizer):
    rows = _echo(tokenizer, "reference")
    r = rows["reference_max"]
    assert (r.passed, r.value, r.data) == (False, "0/3 verified", {"episodes": 3, "not_max": 3})
    assert "ended finished, accuracy=0" in r.message and "(and 2 more)" in r.message
    assert "fix Environment.demonstration" in r.message
    assert [x.name for x in failed(rows.values())] == ["reference_max"]


def test_a_reward_out_of_range_fails(tokenizer):
    rows = _echo(tokenizer, "range")
    r = rows["reward_range"]
    assert r.passed is False and r.value == "9/12 in [0, 1]"  # the 3 references total 2.0; the 9 bad plays 0
    assert "totals 2.0, outside the declared reward_range [0.0, 1.0]" in r.message and "declare the range" in r.message
    assert (r.data["max_total"], r.data["out_of_range"]) == (2.0, 3)
    # the reward box makes such an episode an env_error, so the reference check fails too
    assert rows["reference_max"].passed is False and "outside" in rows["reference_max"].message


def test_a_reset_that_is_not_reproducible_fails(tokenizer):
    r = _echo(tokenizer, "reset")["reset_reproducible"]
    assert r.passed is False and r.value == "0/3 reproducible"
    assert "two fresh episodes differ at reset.observation" in r.message and "no global random state" in r.message


def test_hidden_state_that_is_not_reproducible_fails(tokenizer):
    r = _echo(tokenizer, "hidden_state")["reset_reproducible"]
    assert r.passed is False and "differ at reset.state.nonce" in r.message


def test_an_invalid_tool_schema_fails_and_nothing_is_played(tokenizer):
    rows = _echo(tokenizer, "schema")
    r = rows["tool_schemas"]
    assert r.passed is False and r.value == "1 problem(s) in 1 tool(s)"
    assert "tool 'hint': parameters are not a valid JSON Schema at properties/n/type" in r.message
    assert all(rows[n].passed is None and "tool schemas are invalid" in rows[n].message for n in NAMES[2:])
    assert [x.name for x in failed(rows.values())] == ["tool_schemas"]


def test_a_bad_answer_that_crashes_or_is_rewarded_fails(tokenizer):
    crash = _echo(tokenizer, "crash_on_empty")["empty_min"]
    assert crash.passed is False and crash.data == {"episodes": 3, "env_errors": 3, "above_min": 0}
    assert "ended env_error: environment step raised RuntimeError: the grader cannot read" in crash.message
    rewarded = _echo(tokenizer, "accepts_empty")["empty_min"]
    assert rewarded.passed is False and rewarded.value == "0/3 at the minimum"
    assert "earned accuracy=1 > 0" in rewarded.message and "make it score 0" in rewarded.message


def test_a_demonstrator_that_raises_fails_the_reference_and_plays_nothing(tokenizer):
    rows = _echo(tokenizer, "demo_raises")
    r = rows["reference_max"]
    assert r.passed is False and r.message == "the demonstrator failed: KeyError: 'solution'"
    assert all(rows[n].passed is None and "not run: the demonstrator failed" in rows[n].message for n in NAMES[3:])


def test_the_malformed_call_does_not_parse_in_the_renderers_format(tokenizer):
    from consequence.harness.renderer import Renderer

    renderer = Renderer(tokenizer, [TOOL])
    text = malformed_call(renderer, [TOOL])
    assert text == '<tool_call>\n{"name": "hint", "arguments": {}\n</tool_call>'  # Hermes, its last "}" removed
    assert renderer.format.split(text, [TOOL])[2].startswith("tool call is not valid JSON")


def test_time_summary():
    assert time_summary([0.3, 0.1, 0.2, 0.4]) == {"n": 4, "median_s": (0.2 + 0.3) / 2, "max_s": 0.4}
    assert time_summary([])["n"] == 0


# ---- the pilot's arithmetic ------------------------------------------------------------
def _traj(turns, out_tokens=5, context=100, reason=None, errors=()):
    calls = [ModelCall([0] * (context + 10 * k), [1] * out_tokens, [0.0] * out_tokens, "stop") for k in range(turns)]
    for k, e in enumerate(errors):
        if e == "unparsable":
            calls[k].parse_error = "not valid JSON"
        else:
            calls[k].invalid_calls.append(e)
    return Trajectory("t", "t", 0, 0, 0, calls=calls, outcome="truncated" if reason else "finished",
                      truncation_reason=reason)  # fmt: skip


def test_nearest_rank():
    assert nearest_rank(list(range(1, 21))) == 19  # ⌈0.95 · 20⌉ = 19th smallest
    assert nearest_rank([7]) == 7 and nearest_rank([3, 1, 2], 0.5) == 2
    with pytest.raises(ValueError):
        nearest_rank([])


def test_invalid_call_rates_by_kind():
    trajs = [_traj(4, errors=("unparsable", "unknown_tool")), _traj(4, errors=("bad_arguments", "bad_arguments"))]
    rates = invalid_call_rates(trajs)
    assert rates == {
        "model_calls": 8.0,
        "unparsable": 1 / 8,
        "unknown_tool": 1 / 8,
        "bad_arguments": 2 / 8,
        "invalid": 4 / 8,
    }


def test_suggested_budgets_are_the_95th_percentile_unless_the_budget_was_binding():
    budgets = Budgets(max_turns=20, max_new_tokens=48, max_total_tokens=768)
    # 20 episodes of 1..20 turns; only the 20-turn one was cut by max_turns: 1/20 = 5 %, not binding
    trajs = [_traj(k, out_tokens=k, reason="max_turns" if k == 20 else None) for k in range(1, 21)]
    turns, new, total = suggest_budgets(trajs, budgets)
    assert (turns["option"], turns["p95"], turns["max"], turns["suggested"]) == ("--max-turns", 19, 20, 19)
    # tokens per call: episode k has k calls of k tokens; 210 calls, the ⌈0.95·210⌉ = 200th smallest is 20
    assert (new["p95"], new["suggested"]) == (20, 20)
    # last context of episode k: 100 + 10·(k-1); p95 over episodes = 100 + 10·18, plus the suggested 20 new tokens
    assert total["p95"] == 100 + 10 * 18 + 20 and total["cut_share"] == 0.0
    trajs[0] = _traj(1, reason="max_turns")  # 2/20 = 10 % cut: binding, so twice the budget
    assert suggest_budgets(trajs, budgets)[0]["suggested"] == 40


# ---- the command line --------------------------------------------------------------------
def test_cli_passes_prints_the_table_and_writes_json(tmp_path):
    out = tmp_path / "report" / "check.json"
    res = CliRunner().invoke(
        app, ["env-check", "calculator", "--tasks", "2", "--out", str(out)], env={"COLUMNS": "200"}
    )
    assert res.exit_code == 0, res.output
    assert "reference_max" in res.output and "2/2 verified" in res.output and "every check passed" in res.output
    report = json.loads(out.read_text())
    assert report["passed"] is True and [c["name"] for c in report["checks"]] == NAMES
    assert report["settings"]["tasks"] == 2 and report["environment"]["name"] == "calculator"
    assert "pilot" not in report


def test_cli_exits_1_on_a_broken_environment(tmp_path):
    out = tmp_path / "check.json"
    args = [
        "env-check",
        "test_env_check:EchoEnvironment",
        "--env-option",
        "bug=reference",
        "--tasks",
        "2",
        "--out",
        str(out),
    ]
    res = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
    assert res.exit_code == 1, res.output
    assert "✗" in res.output and "1 check(s) failed: reference_max" in res.output
    report = json.loads(out.read_text())
    # the fix is in the file whole (a table cell may wrap it at any console width)
    assert any("fix Environment.demonstration" in json.dumps(c) for c in report["checks"] if c["passed"] is False)
    assert report["passed"] is False
    assert [c["name"] for c in report["checks"] if c["passed"] is False] == ["reference_max"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["calculator", "--group", "4"], "--group: options of the pilot, which runs only with --policy"),
        (["calculator", "--split", "dev"], "--split 'dev': give train, validation or test"),
        (["nope"], "unknown environment"),
        (["calculator", "--env-option", "shift=true"], "no train split"),
        (["calculator", "--policy", "/no/such/model"], "--policy /no/such/model: no such folder"),
        (["repair", "--policy", str(BUNDLED), "--max-total-tokens", "16"], "--max-total-tokens 16 is too small"),
    ],
)
def test_cli_refuses_mistakes_before_any_work(args, message, tmp_path):
    res = CliRunner().invoke(app, ["env-check", *args, "--out", str(tmp_path / "x.json")], env={"COLUMNS": "300"})
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split()) and not (tmp_path / "x.json").exists()
    assert "reset_reproducible" not in res.output  # refused before any check ran


@pytest.mark.slow
def test_cli_policy_pilot_reports_its_measures(tmp_path):
    out = tmp_path / "check.json"
    args = ["env-check", "repair", "--tasks", "1", "--policy", str(BUNDLED), "--pilot-tasks", "2", "--group", "2",
            "--max-turns", "3", "--max-new-tokens", "24", "--out", str(out)]  # fmt: skip
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "success α" in res.output and "suggested budgets" in res.output
    pilot = json.loads(out.read_text())["pilot"]
    assert (pilot["tasks"], pilot["group"]) == (2, 2)
    assert pilot["success_alpha"] == pilot["measured"]["verified_share"]
    assert pilot["mixed_group_fraction"] in (0.0, 0.5, 1.0)  # 2 tasks: 0, 1 or 2 mixed groups
    inv = pilot["invalid_calls"]
    assert math.isclose(inv["invalid"], inv["unparsable"] + inv["unknown_tool"] + inv["bad_arguments"])
    assert [b["option"] for b in pilot["suggested_budgets"]] == [
        "--max-turns",
        "--max-new-tokens",
        "--max-total-tokens",
    ]
    assert all(b["pilot"] in (3, 24, 768) for b in pilot["suggested_budgets"])

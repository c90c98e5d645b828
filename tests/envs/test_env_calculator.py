"""The ``calculator`` environment: the sandboxed tool and its refusals, the answer rule,
per-step rewards (accuracy at the answer, tool_cost at each call) through the real runner
and scorer, env errors, the generated tasks and their split, and the CLI (train, eval)."""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from cli_args import ONE_TINY_ITERATION
from consequence.envs.calculator import env as calc
from consequence.envs.calculator.env import (
    ArithmeticTask,
    CalculatorEnvironment,
    CalculatorEpisode,
    calculate,
    check_expression,
    extract_answer,
    is_correct,
)
from consequence.envs.registry import load_environment
from consequence.harness.renderer import Renderer
from consequence.reward.scoring import score_trajectories
from consequence.rollout.episodes import Budgets, EpisodeSpec, run_episodes
from consequence.sandbox import sandbox
from consequence.sandbox.sandbox import TestReport

TASK = ArithmeticTask("hand-1", "hand-1", "What is 4837 * 29 - 1204?", 139069, "expression", "4837 * 29 - 1204")
COST = 0.125  # a binary fraction: sums of it are exact


@pytest.fixture()
def sandbox_runs(monkeypatch):
    """Count the sandbox runs the calculator makes (the real sandbox still runs)."""
    runs: list[str] = []
    real = calc.run_tests

    def spy(code, tests, limits):
        runs.append(code)
        return real(code, tests, limits, cache=False)

    monkeypatch.setattr(calc, "run_tests", spy)
    return runs


# ---- the tool -----------------------------------------------------------------------
def test_calculator_evaluates_in_the_sandbox(sandbox_runs):
    obs, rep = calculate("12*(3+4)")
    assert (obs, rep.status, rep.attempts) == ("84", "ok", 1)
    assert sandbox_runs == ["_r = repr(12*(3+4))\n"]  # a fresh interpreter ran it, not this process
    assert calculate("7 / 2")[0] == "3.5"
    assert calculate("-(17 // 5) + 17 % 5")[0] == "-1"  # -3 + 2
    assert (
        calculate("2 ** 300")[0] == "2037035976334486086268445688409378161051468393665936250636140449"
        "354381299763336706183397376"
    )  # 91 digits: read back in two chunks
    assert calculate("1 / 0")[0] == "error: ZeroDivisionError: division by zero"
    assert len(sandbox_runs) == 5


@pytest.mark.parametrize(
    "expr, why",
    [
        ("__import__('os')", "not function calls"),
        ("__import__('os').system('touch /tmp/pwned')", "not "),
        ("x + 1", "not names"),
        ("abs(-3)", "not function calls"),
        ("(1).__class__", "not attributes"),
        ("[1, 2][0]", "not subscripts"),
        ("'a' * 3", "only numbers are allowed, not 'a'"),
        ("True + 1", "only numbers are allowed, not True"),
        ("2j * 3", "only numbers are allowed, not 2j"),
        ("1 if 2 else 3", "not IfExp"),
        ("1 << 4", "operator LShift is not allowed"),
        ("~5", "operator Invert is not allowed"),
        ("9**9**9", "an exponent must be a number literal"),
        ("2 ** 5000", "exponent 5000 is too large"),
        ("(10**50)**3", "could exceed 10**100"),
        ("10**100 + 1", "could exceed 10**100"),
        ("1 +", "not an arithmetic expression"),
        ("", "empty expression"),
        ("1+" * 100 + "1", "expression too long (201 characters"),
    ],
)
def test_refused_expressions_are_error_observations_and_run_nothing(sandbox_runs, expr, why):
    refused = check_expression(expr)
    assert refused is not None and why in refused
    obs, rep = calculate(expr)
    assert obs == f"error: {refused}" and rep is None
    assert sandbox_runs == []


def test_the_bounds_let_large_but_safe_values_through():
    assert check_expression("10**100") is None and check_expression("-(2**332)") is None
    assert check_expression("(2**50)**2") is None and check_expression("2.0 ** 999") is None
    assert check_expression("(2**50)**6") is None  # 2**300 < 10**91
    assert "could exceed 10**100" in check_expression("(2**50)**7")  # 2**350 > 10**105
    assert "could exceed 10**100" in check_expression("(10**60) * (10**41)")


# ---- the answer ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "reply, answer",
    [
        ("4837 * 29 = 140273, and 140273 - 1204 = 139069.", "139069"),
        ("The result is -536", "-536"),
        ("x=-5", "-5"),
        ("3-4", "4"),  # a minus between digits is subtraction, not a sign
        ("about 1,234 items", "1234"),
        ("1,2345", "2345"),  # not a thousands separator
        ("84.0 is it", "84.0"),
        ("<answer>139069</answer> (not 7)", "139069"),  # the tag wins over the last number
        ("<answer>1</answer> no, <answer> +2,000 </answer>", "2000"),  # the last tag
        ("<answer>about 5</answer> 7", None),  # a tag that is not one number: no answer
        ("I do not know", None),
        ("", None),
    ],
)
def test_answer_extraction_rule(reply, answer):
    assert extract_answer(reply) == answer


def test_correct_means_the_exact_value():
    assert is_correct("139069", 139069) and is_correct("139069.00", 139069) and is_correct("-536", -536)
    assert not is_correct("139068", 139069) and not is_correct("139069.5", 139069)
    assert not is_correct(None, 0) and not is_correct("1e3", 1000)


# ---- episode steps -----------------------------------------------------------------
def _call(expr: str) -> dict:
    return {"name": "calculator", "arguments": {"expression": expr}}


def test_accuracy_and_tool_cost_at_their_steps(sandbox_runs):
    ep = CalculatorEpisode(TASK, tool_cost=COST, max_calls=2)
    assert ep.reset() == (
        "What is 4837 * 29 - 1204?",
        {"task_id": "hand-1", "problem_id": "hand-1", "calculator_calls": 0},
    )
    obs, r, term, trunc, info = ep.step(_call("4837 * 29"))
    assert (obs, r, term, trunc, info["reward_components"]) == ("140273", -COST, False, False, {"tool_cost": -COST})
    obs, r, term, _, info = ep.step(_call("abs(1)"))  # refused, but a call: charged
    assert obs.startswith("error: ") and (r, term, info["reward_components"]) == (-COST, False, {"tool_cost": -COST})
    obs, r, term, _, info = ep.step(_call("140273 - 1204"))  # beyond max_calls=2: refused, free, nothing runs
    assert obs == "error: calculator limit reached (2 calls); reply with your answer"
    assert (r, term, info["reward_components"], len(sandbox_runs)) == (0.0, False, {"tool_cost": 0.0}, 1)
    assert ep.code is None
    obs, r, term, _, info = ep.step({"answer": "so it is <answer>139069</answer>"})
    assert (obs, r, term, info["reward_components"], ep.code) == ("correct", 1.0, True, {"accuracy": 1.0}, "139069")
    with pytest.raises(RuntimeError):
        ep.step({"answer": "1"})
    ep.reset()
    assert ep.step({"answer": "139070"})[1:3] == (0.0, True) and ep.code == "139070"
    ep.reset()
    _, r, _, _, info = ep.step({"answer": "no idea"})
    assert (r, info["reward_components"], ep.code) == (0.0, {"accuracy": 0.0}, "")
    ep.reset()
    with pytest.raises(ValueError, match="unknown tool 'run_tests'"):
        ep.step({"name": "run_tests", "arguments": {}})


def test_zero_cost_calls_give_zero_reward(sandbox_runs):
    ep = CalculatorEpisode(TASK)  # defaults: tool_cost 0.0, max_calls 4
    ep.reset()
    _, r, _, _, info = ep.step(_call("1 + 1"))
    assert (r, info["reward_components"]) == (0.0, {"tool_cost": 0.0}) and math.copysign(1, r) == 1


# ---- through the runner and the scorer ---------------------------------------------
def _env(**options) -> CalculatorEnvironment:
    return load_environment("calculator", 0, options)


def _script(renderer: Renderer, turns_by_episode: list[list[str]]):
    """A generate_fn replaying each episode's turns (a tool call or plain text), in order."""
    queues = [[renderer.encode(t) + [renderer.eot_id] for t in turns] for turns in turns_by_episode]

    def generate(prompts, max_new_tokens, idx):
        outs = [queues[i].pop(0) for i in idx]
        return [SimpleNamespace(output_ids=o, logprobs=[-0.5] * len(o), stop_reason="stop") for o in outs]

    return generate


def test_two_calls_then_a_correct_answer_through_the_runner(tiny_tokenizer):
    env = _env(tool_cost=COST)
    renderer = Renderer(tiny_tokenizer, env.tools)
    call = renderer.format_call
    script = _script(
        renderer,
        [
            [
                call("calculator", {"expression": "4837 * 29"}),
                call("calculator", {"expression": "140273 - 1204"}),
                "The answer is <answer>139069</answer>.",
            ],
            ["It is 139070"],  # one wrong answer, no call
        ],
    )
    specs = [EpisodeSpec(env.make_episode(TASK), "hand-1", "g", j, j) for j in range(2)]
    trajs = run_episodes(script, renderer, specs, Budgets(max_turns=4), env.system_prompt)
    t, wrong = trajs
    assert [c.reward for c in t.calls] == [-COST, -COST, 1.0]
    assert t.env_rewards == {"tool_cost": -2 * COST, "accuracy": 1.0}
    assert [m["content"] for m in t.messages if m["role"] == "tool"] == ["140273", "139069"]
    assert (t.outcome, t.final_code, t.n_tool_calls) == ("finished", "139069", 2)
    assert env.reward_range == (-COST * 4 * (1 + 1e-9), 1.0)
    score_trajectories(trajs, components=env.reward_components, reward_range=env.reward_range)
    assert (t.reward, t.verifier_score, t.outcome) == (1 - 2 * COST, 1.0, "finished")
    assert t.reward_components == {"accuracy": 1.0, "tool_cost": -2 * COST}
    assert (wrong.reward, wrong.reward_components, wrong.final_code) == (
        0.0,
        {"accuracy": 0.0, "tool_cost": 0.0},
        "139070",
    )


class _Raising(CalculatorEpisode):
    def step(self, action):
        raise KeyError("boom")


def test_a_raising_step_and_a_dead_sandbox_are_env_errors(tiny_tokenizer, monkeypatch):
    env = _env(tool_cost=COST)
    renderer = Renderer(tiny_tokenizer, env.tools)
    turn = renderer.format_call("calculator", {"expression": "1 + 2"})
    sandbox.clear_cache()
    monkeypatch.setattr(
        sandbox,
        "_run",
        lambda code, tests, lim: TestReport("sandbox_error", 0, len(tests), [], "cannot spawn: injected"),
    )
    specs = [EpisodeSpec(_Raising(TASK), "hand-1", "g", 0, 0), EpisodeSpec(env.make_episode(TASK), "hand-1", "g", 1, 1)]
    trajs = run_episodes(_script(renderer, [[turn], [turn]]), renderer, specs, Budgets(max_turns=2), env.system_prompt)
    score_trajectories(trajs, components=env.reward_components, reward_range=env.reward_range)
    raised, dead = trajs
    assert (raised.outcome, raised.reward) == ("env_error", None)
    assert raised.error == "environment step raised KeyError: 'boom'"
    assert (dead.outcome, dead.reward, dead.env_retries) == ("env_error", None, 2)
    assert dead.error == "sandbox: cannot spawn: injected; gave up after 3 attempts"


# ---- options, tasks and splits -----------------------------------------------------
@pytest.mark.parametrize(
    "option, value",
    [
        ("digits", 0),
        ("digits", 13),
        ("digits", "3"),
        ("terms", 1),
        ("terms", 9),
        ("n_problems", 9),
        ("max_calls", -1),
        ("max_calls", True),
        ("max_calls", 2.0),
        ("tool_cost", -0.1),
        ("tool_cost", float("nan")),
        ("tool_cost", "0.1"),
    ],
)
def test_bad_options_are_refused_before_any_work(monkeypatch, option, value):
    monkeypatch.setattr(calc, "make_problems", lambda *a: pytest.fail("problems made before the options were checked"))
    with pytest.raises(ValueError, match=rf"option {option}=.* must be .*--env-option {option}="):
        _env(**{option: value})


def test_unknown_option_lists_the_ones_it_takes():
    with pytest.raises(
        ValueError, match="unknown option 'cost'; it takes n_problems, digits, terms, tool_cost, max_calls"
    ):
        _env(cost=0.1)


_WORD_OPS = [
    (r"starts the week with (\d+)", None),
    (r"brings (\d+) more", "+"),
    (r"receives (\d+)", "+"),
    (r"(\d+) \w+ are returned", "+"),
    (r"sends away (\d+)", "-"),
    (r"(\d+) \w+ are (?:sold|given away)", "-"),
    (r"multiplied by (\d+)", "*"),
    (r"with (\d+) times as many", "*"),
]


def _solve_word(question: str) -> int:
    """A word problem solved from its text alone (each sentence one step, in order)."""
    value = None
    for sentence in question.split(". "):
        for pattern, op in _WORD_OPS:
            m = re.search(pattern, sentence)
            if m:
                n = int(m.group(1))
                value = n if op is None else value + n if op == "+" else value - n if op == "-" else value * n
                break
    return value


def test_generated_tasks_answers_and_split():
    env = _env()
    tasks = {s: env.split[s] for s in ("train", "validation", "test")}
    assert {s: len(v) for s, v in tasks.items()} == {"train": 480, "validation": 60, "test": 60}
    every = [t for v in tasks.values() for t in v]
    questions = [t.question for t in every]
    assert len(set(questions)) == 600 and len({t.problem_id for t in every}) == 600
    kinds = {k: [t for t in every if t.kind == k] for k in ("expression", "word")}
    assert 150 < len(kinds["word"]) < 250
    for t in kinds["expression"]:  # "What is A op B op C?" with 3-digit operands
        assert re.fullmatch(r"What is \(?\d{3} [-+*] \(?\d{3}\)? [-+*] \d{3}\)?\?", t.question), t.question
        assert t.answer == eval(t.question[len("What is ") : -1])
    for t in kinds["word"]:
        assert t.answer == _solve_word(t.question) >= 0, t.question
    again = _env()
    assert again.problem_ids() == env.problem_ids() and again.split["test"] == env.split["test"]
    other = load_environment("calculator", 1)
    assert other.problem_ids() != env.problem_ids()  # the seed splits ...
    by_id = {t.problem_id: t for v in other.split.values() for t in v}
    assert all(by_id[t.problem_id] == t for t in every)  # ... the same problems
    hard = _env(digits=4, terms=5, n_problems=20)
    t = next(t for t in hard.split["train"] if t.kind == "expression")
    assert t.problem_id.startswith("calc-d4t5-") and len(re.findall(r"\d{4}", t.question)) == 5
    sampled = env.sample("train", 3, seed=7)
    assert [s.task_id.split("#")[1] for s in sampled] == ["7-0", "7-1", "7-2"]
    assert env.request(TASK) == TASK.question


def test_declarations_for_the_manifest():
    env = _env(tool_cost=0.05, max_calls=3)
    d = env.describe()
    assert (d["name"], d["tools"], d["reward_components"]) == ("calculator", ["calculator"], ["accuracy", "tool_cost"])
    assert d["reward_range"] == [-0.05 * 3 * (1 + 1e-9), 1.0] and d["options"] == {"tool_cost": 0.05, "max_calls": 3}
    assert "at most 3 calculator calls, each costing 0.05 reward" in d["system_prompt"]
    assert "<answer></answer>" in d["system_prompt"] and "last number" in d["system_prompt"]
    assert _env().reward_range == (0.0, 1.0)


# ---- the command line -------------------------------------------------------------
@pytest.mark.slow
def test_cli_train_then_eval(tmp_path):
    from consequence.cli import app
    from consequence.records import read_trajectories

    run, out = tmp_path / "run", tmp_path / "eval"
    res = CliRunner().invoke(
        app,
        [
            "train",
            "--env",
            "calculator",
            *ONE_TINY_ITERATION,
            "--max-turns",
            "3",
            "--max-new-tokens",
            "24",
            "--run-dir",
            str(run),
        ],
        env={"COLUMNS": "250"},
    )
    assert res.exit_code == 0, res.output
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["environment"]["name"] == "calculator"
    assert manifest["environment"]["reward_components"] == ["accuracy", "tool_cost"]
    trajs = read_trajectories(run / "trajectories" / "iter_0000.parquet")
    assert len(trajs) == 4 and all(t.task_id.startswith("calc-d3t3-") for t in trajs)
    assert all("accuracy" in t.reward_components for t in trajs if t.outcome != "env_error")
    assert any(t.outcome != "env_error" for t in trajs)
    res = CliRunner().invoke(
        app,
        ["eval", "--model", str(run), "-n", "1", "-k", "1", "--problems", "2", "--out", str(out)],
        env={"COLUMNS": "250"},
    )
    assert res.exit_code == 0, res.output

    def no_nan(name):
        raise AssertionError(f"eval.json holds {name}: not strict JSON")

    result = json.loads((out / "eval.json").read_text(), parse_constant=no_nan)
    # no calculator task has a wrong first patch: the recovery diagnostic says so, no NaN table
    assert result["recovery"] == {"tasks": 0, "tasks_without_wrong_patch": 2, "not_run": True}
    report = (out / "report.md").read_text()
    assert "Not run: none of the 2 tasks has a wrong first patch" in report and "nan" not in report
    assert "inf generated tokens" not in report and "% of model calls did not parse" in report
    assert result["settings"]["environment"]["name"] == "calculator" and result["settings"]["problems"] == 2

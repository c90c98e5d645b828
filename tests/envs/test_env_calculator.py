"""The ``calculator`` environment: the sandboxed tool and its refusals, the answer rule,
per-step rewards (accuracy at the answer, tool_cost at each call) through the real runner
and scorer, env errors, the generated tasks and their split, and the CLI (train, eval)."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from cli_args import ONE_TINY_ITERATION, TINY_NO_EVAL
from consequence.distill.warmstart import BUNDLED
from consequence.envs.api import answer_in_text
from consequence.envs.calculator import env as calc
from consequence.envs.calculator.env import (
    ArithmeticTask,
    CalculatorEnvironment,
    CalculatorEpisode,
    calculate,
    check_expression,
    extract_answer,
    is_correct,
    make_problems,
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
        ("shift", "yes"),
        ("shift", 1),
    ],
)
def test_bad_options_are_refused_before_any_work(monkeypatch, option, value):
    monkeypatch.setattr(calc, "make_problems", lambda *a: pytest.fail("problems made before the options were checked"))
    with pytest.raises(ValueError, match=rf"option {option}=.* must be .*--env-option {option}="):
        _env(**{option: value})


def test_unknown_option_lists_the_ones_it_takes():
    with pytest.raises(
        ValueError, match="unknown option 'cost'; it takes n_problems, digits, terms, shift, tool_cost, max_calls"
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
    # the held-out shift's wording
    (r"the [\w ]+ holds (\d+)", None),
    (r"drops off (\d+)", "+"),
    (r"Another (\d+) \w+ arrive", "+"),
    (r"It loses (\d+)", "-"),
    (r"Customers take (\d+)", "-"),
    (r"grows (\d+)-fold", "*"),
    (r"by a factor of (\d+)", "*"),
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
        assert t.answer == _solve_word(t.question) >= 2, t.question
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


def test_hand_checked_problems():
    base, shift = make_problems(6, 3, 3), make_problems(6, 3, 3, shift=True)
    # by hand: 803 + 606 = 1409; 1409 * 72 = 98630 + 2818 = 101448
    assert base[2] == ArithmeticTask(
        "calc-d3t3-0002",
        "calc-d3t3-0002",
        "A bakery starts the week with 803 rolls. A delivery brings 606 more rolls. Then it ends up with 72 "
        "times as many rolls. How many rolls does it have now?",
        101448,
        "word",
        "(803 + 606) * 72",
    )
    # by hand: 3102 * 507 = 1551000 + 21714 = 1572714; - 7374 = 1565340; - 2803 = 1562537
    assert shift[4] == ArithmeticTask(
        "calc-d4t4s-0004",
        "calc-d4t4s-0004",
        "On Monday, the dairy holds 3102 bottles. Its stock of bottles is then scaled by a factor of 507. "
        "Customers take 7374 bottles. It loses 2803 bottles. How many bottles are there at the end?",
        1562537,
        "word",
        "((3102 * 507) - 7374) - 2803",
    )
    # by hand: 110 * 378 = 41580; + 541 = 42121
    assert (base[1].question, base[1].answer) == ("What is 541 + (110 * 378)?", 42121)


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("digits, terms", [(3, 3), (3, 5), (4, 4), (5, 3), (5, 5)])
def test_a_constant_answer_scores_at_most_one_percent_on_every_split(digits, terms, shift):
    env = _env(n_problems=1000, digits=digits, terms=terms, shift=shift)  # splits of >= 100 problems
    for split, tasks in env.split.items():
        if tasks:
            count = Counter(t.answer for t in tasks).most_common(1)[0][1]
            assert count / len(tasks) <= 0.01, (split, count, len(tasks))
    every = [t for v in env.split.values() for t in v]
    assert len({t.answer for t in every}) == len(every) == 1000  # distinct: right on at most one problem
    word = sum(t.kind == "word" for t in every)
    assert 250 < word < 420  # about a third are word problems
    answers = sorted(t.answer for t in every)
    assert answers[-1] - answers[0] > 10 ** (2 * digits)  # spread wide, not clustered


def test_the_default_options_give_distinct_answers():
    every = [t for v in _env().split.values() for t in v]
    assert Counter(t.answer for t in every).most_common(1)[0][1] == 1  # at most 1 / 60 of validation or test


@pytest.mark.parametrize(
    "digits, terms, shift",
    [(3, 3, False), (3, 3, True), (2, 2, False), (2, 3, False), (1, 8, False), (5, 5, True), (12, 8, True)],
)
def test_no_answer_can_be_copied_from_its_question(digits, terms, shift):
    for t in make_problems(600, digits, terms, shift):
        written = re.findall(r"\d+", t.question)
        assert abs(t.answer) >= 2 and str(abs(t.answer)) not in written, t
        assert not answer_in_text(str(t.answer), t.question) and not answer_in_text(str(abs(t.answer)), t.question)
        # the task's expression is its answer's computation, and the calculator takes it whole
        assert eval(t.expression) == t.answer and check_expression(t.expression) is None, t


def test_options_too_small_for_distinct_answers_are_refused():
    refusal = (
        r"only \d+ problems with distinct questions and distinct answers .* digits=1 and terms=2; lower n_problems"
    )
    with pytest.raises(ValueError, match=refusal):
        _env(digits=1, terms=2)
    assert len(_env(digits=1, terms=2, n_problems=20).split["train"]) == 16


def _template(text: str) -> re.Pattern:
    pattern = re.escape(text)
    for slot, fill in (("{n}", r"\d+"), ("{u}", r"\w+"), ("{place}", r"[\w ]+")):
        pattern = pattern.replace(re.escape(slot), fill)
    return re.compile(pattern)


def _templates(wording) -> list[re.Pattern]:
    texts = [wording.start, wording.end, *(s for op in "+-*" for s in wording.steps[op])]
    return [_template(x) for x in texts]


def _sentences(question: str) -> list[str]:
    return re.split(r"(?<=[.?]) ", question)


def test_the_shift_has_more_digits_and_terms_and_a_held_out_wording():
    shift = _env(shift=True)  # the shift of the defaults, digits=3 terms=3
    assert {s: len(v) for s, v in shift.split.items()} == {"train": 0, "validation": 300, "test": 300}
    every = [t for v in shift.split.values() for t in v]
    assert all(re.fullmatch(r"calc-d4t4s-\d{4}", t.problem_id) for t in every)
    kinds = {k: [t for t in every if t.kind == k] for k in ("expression", "word")}
    assert 150 < len(kinds["word"]) < 250
    for t in kinds["expression"]:  # 4 operands of 4 digits (the base: 3 of 3)
        assert [len(n) for n in re.findall(r"\d+", t.question)] == [4, 4, 4, 4], t.question
        assert t.answer == eval(t.question[len("What is ") : -1])
    for t in kinds["word"]:  # 4 numbers: counts of 4 digits, multipliers of 3
        numbers = [len(n) for n in re.findall(r"\d+", t.question)]
        assert len(numbers) == 4 and numbers[0] == 4 and set(numbers) <= {3, 4}, t.question
        assert t.answer == _solve_word(t.question) >= 2, t.question

    train_words, shift_words = _templates(calc._WORDING), _templates(calc._SHIFT_WORDING)
    held_out_words = {w for place, unit in calc._SHIFT_WORDING.themes for w in (*place.split(), unit)}
    assert not held_out_words & {w for place, unit in calc._WORDING.themes for w in (*place.split(), unit)}
    for t in kinds["word"]:  # every sentence of a shift problem is in the held-out wording only
        for s in _sentences(t.question):
            assert any(p.fullmatch(s) for p in shift_words) and not any(p.fullmatch(s) for p in train_words), s
    bases = [_env(), _env(digits=4, terms=4), _env(digits=2, terms=3), _env(digits=5, terms=5, n_problems=1000)]
    base_tasks = [t for env in bases for v in env.split.values() for t in v]
    assert sum(t.kind == "word" for t in base_tasks) > 900
    for t in base_tasks:  # ... and no base problem (what training sees) holds any of it
        for s in _sentences(t.question) if t.kind == "word" else [t.question]:
            assert not any(p.fullmatch(s) for p in shift_words), s
            assert t.kind == "expression" or any(p.fullmatch(s) for p in train_words), s
        assert not held_out_words & set(re.findall(r"\w+", t.question)), t.question

    base = bases[:2]  # neither the base of the shift (d3t3) nor the problems of its size (d4t4)
    base_ids = {p for env in base for ids in env.problem_ids().values() for p in ids}
    base_questions = {t.question for env in base for v in env.split.values() for t in v}
    assert not base_ids & {t.problem_id for t in every} and not base_questions & {t.question for t in every}
    # deterministic: problem i is the same for every n_problems and split seed
    again = {t.problem_id: t for v in _env(shift=True, n_problems=50).split.values() for t in v}
    other_seed = load_environment("calculator", 3, {"shift": True})
    assert all(again[p] == t for t in every if (p := t.problem_id) in again) and len(again) == 50
    assert {t.problem_id: t for v in other_seed.split.values() for t in v} == {t.problem_id: t for t in every}


def test_the_shift_has_no_train_split_and_refuses_training():
    shift = _env(shift=True)
    with pytest.raises(
        ValueError, match="shift=true is the held-out shift, for evaluation only: it has no train split"
    ):
        shift.check_splits({"train": "training", "validation": None, "test": None})
    shift.check_splits({"train": None, "validation": "--eval-every", "test": "--final-eval-episodes"})
    with pytest.raises(ValueError, match="the train split has no task to draw from"):
        shift.sample("train", 1, seed=0)


@pytest.mark.slow
def test_cli_train_on_the_shift_is_refused_before_the_run_folder(tmp_path):
    from consequence.cli import app

    run = tmp_path / "run"
    res = CliRunner().invoke(
        app,
        ["train", "--env", "calculator", "--env-option", "shift=true", "--model", str(BUNDLED), *TINY_NO_EVAL]
        + ["--run-dir", str(run)],
        env={"COLUMNS": "250"},
    )
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "held-out shift, for evaluation only" in text and not run.exists(), text


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
    assert (
        "inf generated tokens" not in report
        and "% of all model calls did not parse, those cut at the token limit" in report
    )
    assert result["settings"]["environment"]["name"] == "calculator" and result["settings"]["problems"] == 2

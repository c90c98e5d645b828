"""HumanEval task sources, the JSONL format, splits, and repair episodes in RepairEnv."""

import json

import pytest

from consequence.envs.humaneval import code_tasks
from consequence.envs.humaneval import problems as he
from consequence.envs.repair.env import RepairEnv
from consequence.envs.repair.jsonl import (
    CodeTask,
    TaskFormatError,
    as_repair_task,
    cycle_tasks,
    dump_jsonl,
    load_jsonl,
    parse_record,
    split_by_problem,
    to_record,
)
from consequence.envs.repair.problems import TestCase, TestProgram

GOOD = {
    "task_id": "t1",
    "kind": "repair",
    "prompt": "Return the largest element.",
    "starting_code": "def f(xs):\n    return min(xs)",
    "entry_point": "f",
    "visible_tests": [{"call": "f([1, 2])", "expected": "2"}],
    "hidden_tests": [{"call": "f([3, 1, 2])", "expected": "3"}],
    "reference_code": "def f(xs):\n    return max(xs)",
    "patch": [2, "    return max(xs)"],
}


# ---- JSONL format -----------------------------------------------------------------------


def test_record_round_trip_and_defaults(tmp_path):
    t = parse_record(GOOD, "x")
    assert t.problem_id == "t1" and t.patch == (2, "    return max(xs)")
    assert t.hidden_tests == (TestCase("f([3, 1, 2])", "3"),)
    prog = dict(GOOD, task_id="t2", hidden_tests={"check": "def check(candidate):\n    pass"})
    path = dump_jsonl([t, parse_record(prog)], tmp_path / "a" / "tasks.jsonl")
    back = load_jsonl(path)
    assert back[0] == t and back[1].hidden_tests == TestProgram("def check(candidate):\n    pass", "f", "")
    assert [to_record(b) for b in back] == [json.loads(line) for line in path.read_text().splitlines()]
    assert not list(path.parent.glob(".*.tmp"))  # atomic write left nothing behind


@pytest.mark.parametrize(
    "change, message",
    [
        ({"prompt": None}, "missing field 'prompt'"),
        ({"hidden_test": []}, "unknown field(s) ['hidden_test']"),
        ({"kind": "chat"}, "field 'kind' must be one of ('completion', 'repair'), got 'chat'"),
        ({"entry_point": "f x"}, "field 'entry_point' must be a Python name"),
        ({"visible_tests": [{"call": "f()"}]}, 'visible_tests[0] must be {"call": str, "expected": str}'),
        ({"hidden_tests": []}, "field 'hidden_tests' is empty"),
        ({"hidden_tests": {"check": "assert 1"}}, "hidden_tests.check must define check(candidate)"),
        ({"patch": [0, "x"]}, "field 'patch' must be [line >= 1, code], got [0, 'x']"),
    ],
)
def test_errors_name_the_line_and_field(tmp_path, change, message):
    bad = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(dict(GOOD, task_id="ok")) + "\n\n" + json.dumps(bad) + "\n")
    with pytest.raises(TaskFormatError) as e:
        load_jsonl(path)
    assert str(e.value).startswith(f"{path}:3: ") and message in str(e.value)


def test_invalid_json_and_duplicate_ids(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD) + "\n{oops\n")
    with pytest.raises(TaskFormatError, match=r"t.jsonl:2: not valid JSON"):
        load_jsonl(path)
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\n")
    with pytest.raises(TaskFormatError, match=r"t.jsonl:2: task_id 't1' already used on line 1"):
        load_jsonl(path)


def test_user_repair_task_runs_in_repair_env():
    task = as_repair_task(parse_record(GOOD))
    env = RepairEnv(task)
    obs, _ = env.reset()
    assert obs == "Fix f in solution.py so all tests pass.\nf: Return the largest element."
    assert env.step({"name": "run_tests", "arguments": {}})[0].startswith("0/1 passed")
    env.step({"name": "replace_line", "arguments": {"line": 2, "code": "    return max(xs)"}})
    assert env.step({"name": "finish", "arguments": {}})[1] == 1.0
    with pytest.raises(ValueError, match="kind 'completion', not 'repair'"):
        as_repair_task(parse_record(dict(GOOD, kind="completion")))


# ---- HumanEval completion tasks ----------------------------------------------------------


def test_humaneval_completion_tasks():
    tasks = he.completion_tasks()
    assert len(tasks) == 164 and len({t.task_id for t in tasks}) == 164
    t0 = tasks[0]
    assert (t0.task_id, t0.entry_point, t0.kind) == ("HumanEval/0", "has_close_elements", "completion")
    assert t0.prompt == t0.starting_code and t0.prompt.startswith("from typing import List")
    assert t0.hidden_tests.setup == t0.prompt and "def check(candidate)" in t0.hidden_tests.check
    assert t0.visible_tests == (
        TestCase("has_close_elements([1.0, 2.0, 3.0], 0.5)", "False"),
        TestCase("has_close_elements([1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3)", "True"),
    )
    assert sum(1 for t in tasks if t.visible_tests) == 128  # docstrings with parseable examples
    assert sum(len(t.visible_tests) for t in tasks) == 359


def test_docstring_examples_that_disagree_with_the_solution_are_dropped():
    prompt = (
        'def f(x):\n    """Double.\n    >>> f(2)\n    4\n    >>> f(3)\n    7\n'
        '    f(5) ==> 10\n    f(1) -> 2 - 0 = 2\n    >>> f(\n    """\n'
    )
    tests = he.docstring_tests(prompt, "f", prompt + "    return 2 * x\n")
    assert tests == (TestCase("f(2)", "4"), TestCase("f(5)", "10"), TestCase("f(1)", "2"))


def test_split_by_humaneval_task_id_is_disjoint_and_seeded():
    s0 = code_tasks.humaneval_split(0)
    assert [len(s0[k]) for k in ("train", "validation", "test")] == [131, 16, 17]
    assert not (s0["train"] & s0["test"]) and not (s0["train"] & s0["validation"])
    assert s0 == code_tasks.humaneval_split(0) and s0 != code_tasks.humaneval_split(1)
    test = code_tasks.load_humaneval("test", seed=0)
    assert {t.task_id for t in test} == s0["test"]
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        code_tasks.load_humaneval("dev")
    assert split_by_problem(["a", "a", "b"], 0, (0.5, 0.5, 0.0))["test"] == frozenset()


# ---- HumanEval repair --------------------------------------------------------------------


@pytest.mark.slow
def test_repair_candidates_change_exactly_one_solution_line():
    cands = he.repair_candidates(0)
    assert len(cands) == 164 and sum(1 for v in cands.values() if v) == 146
    assert sum(len(v) for v in cands.values()) > 1000
    for tid in ("HumanEval/0", "HumanEval/13", "HumanEval/120"):
        for t in cands[tid]:
            ref, bug = t.reference_code.split("\n"), t.starting_code.split("\n")
            diff = [i for i, (a, b) in enumerate(zip(ref, bug)) if a != b]
            assert len(ref) == len(bug) and diff == [t.patch[0] - 1], t.task_id
            assert ref[diff[0]] == t.patch[1] and diff[0] >= t.hidden_tests.setup.count("\n")
    assert [t.task_id for t in cands["HumanEval/0"]] == [t.task_id for t in he.repair_candidates(0)["HumanEval/0"]]
    assert [t.task_id for t in cands["HumanEval/0"]] != [t.task_id for t in he.repair_candidates(1)["HumanEval/0"]]


@pytest.mark.slow
def test_build_keeps_only_bugs_the_official_tests_catch():
    ids = ["HumanEval/0", "HumanEval/2", "HumanEval/13", "HumanEval/23", "HumanEval/55"]
    tasks, stats = code_tasks.build_humaneval_repair(0, task_ids=ids, workers=2)
    assert stats["problems"] == 5 and stats["with_candidates"] == 4  # /23 is `return len(s)`
    assert stats["tasks"] == len(tasks) == stats["killed"] >= 3
    for t in tasks:
        assert code_tasks.run_hidden(t.reference_code, t.hidden_tests).all_passed
        bad = code_tasks.run_hidden(t.starting_code, t.hidden_tests)
        assert bad.status == "ok" and bad.passed == 0


@pytest.mark.slow
def test_humaneval_repair_episode_with_the_teacher_patch():
    t = next(
        c
        for c in he.repair_candidates(0)["HumanEval/0"]
        if not code_tasks.run_hidden(c.starting_code, c.hidden_tests).all_passed
    )
    task = as_repair_task(t)
    assert task.func_name == "has_close_elements" and task.patch == t.patch
    env = RepairEnv(task)
    obs, info = env.reset()
    assert obs.startswith(
        "Fix has_close_elements in solution.py so all tests pass.\n"
        "has_close_elements: Check if in given list of numbers"
    )
    assert info["problem_id"] == "HumanEval/0"
    assert env.step({"name": "finish", "arguments": {}})[1] == 0.0
    env.reset()
    line, code = task.patch
    assert env.step({"name": "replace_line", "arguments": {"line": line, "code": code}})[0] == "ok"
    assert env.code == t.reference_code
    n = len(task.visible_tests)
    assert env.step({"name": "run_tests", "arguments": {}})[0] == f"{n}/{n} passed"
    obs, r, term, _, info = env.step({"name": "finish", "arguments": {}})
    assert (r, term) == (1.0, True) and info["verifier"].total == 1


def test_cycle_tasks_ids_and_problem_ids():
    pool = [parse_record(dict(GOOD, task_id=f"t{i}", problem_id=f"p{i}")) for i in range(3)]
    drawn = cycle_tasks(pool, 5, seed=7)
    assert [d.task_id.split("#")[1] for d in drawn] == [f"7-{k}" for k in range(5)]
    assert {d.problem_id for d in drawn[:3]} == {"p0", "p1", "p2"}
    assert drawn[3].problem_id == drawn[0].problem_id
    with pytest.raises(ValueError):
        cycle_tasks([], 1, 0)


def test_disk_cache_round_trip(tmp_path, monkeypatch):
    calls = []

    def fake_build(seed, bugs, tries):
        calls.append(seed)
        t = CodeTask(
            "HumanEval/0/x",
            "HumanEval/0",
            "repair",
            "p",
            "code",
            "f",
            (),
            TestProgram("def check(candidate):\n    pass", "f"),
        )
        return [t], {"tasks": 1}

    monkeypatch.setattr(code_tasks, "build_humaneval_repair", fake_build)
    code_tasks._cached.cache_clear()
    a = code_tasks.humaneval_repair_tasks(5, cache_dir=tmp_path)
    code_tasks._cached.cache_clear()
    b = code_tasks.humaneval_repair_tasks(5, cache_dir=tmp_path)
    code_tasks._cached.cache_clear()
    assert a == b and calls == [5]  # the second call read the JSONL cache
    files = sorted(p.name for p in (tmp_path / "humaneval").iterdir())
    assert len(files) == 2 and files[0].endswith(".jsonl") and files[1].endswith(".stats.json")


@pytest.mark.slow
def test_full_humaneval_repair_build():
    tasks, stats = code_tasks.build_humaneval_repair(0, workers=2)
    assert stats["with_bug"] >= 140 and stats["timeout_or_crash"] <= 5
    split = code_tasks.humaneval_split(0)
    assert all(t.problem_id in split["train"] | split["validation"] | split["test"] for t in tasks)

"""Tests for consequence.envs.repair.env."""

import pytest

from consequence.envs.repair.env import SYSTEM_PROMPT, TOOLS, RepairEnv, format_report, verify
from consequence.envs.repair.problems import build_problems, make_instance
from consequence.sandbox.sandbox import TestReport


@pytest.fixture(scope="module")
def task():
    ps = [
        p for p in build_problems(0) if p.family == "find_max" and p.bug_kind == "init" and p.bug_text.endswith("= 0")
    ]
    return make_instance(ps[0], "env")


def test_tools_schema():
    names = [t["function"]["name"] for t in TOOLS]
    assert names == ["run_tests", "read_code", "replace_line", "finish"]
    rl = TOOLS[2]["function"]["parameters"]
    assert rl["required"] == ["line", "code"] and rl["properties"]["line"]["type"] == "integer"
    assert all(t["type"] == "function" for t in TOOLS) and SYSTEM_PROMPT


def test_scripted_episode_reward_one(task):
    env = RepairEnv(task)
    obs, info = env.reset()
    assert obs.startswith("Fix find_max in solution.py so all tests pass.\nfind_max: ")
    assert "def " not in obs and info == {"task_id": task.task_id, "problem_id": task.problem_id}
    obs, r, term, trunc, _ = env.step({"name": "run_tests", "arguments": {}})
    n = len(task.visible_tests)
    assert obs.split("\n")[0].endswith(f"/{n} passed") and not obs.startswith(f"{n}/")
    assert " expected " in obs and len(obs.split("\n")) <= 3 and (r, term, trunc) == (0.0, False, False)
    obs, *_ = env.step({"name": "read_code", "arguments": {}})
    assert obs.split("\n")[0] == "1| " + task.buggy_code.split("\n")[0]
    line, text = task.patch
    assert env.step({"name": "replace_line", "arguments": {"line": line, "code": text}})[0] == "ok"
    assert env.code == task.reference_code
    assert env.step({"name": "run_tests", "arguments": {}})[0] == f"{n}/{n} passed"
    obs, r, term, trunc, info = env.step({"name": "finish", "arguments": {}})
    assert (obs, r, term, trunc) == ("done", 1.0, True, False)
    assert info["verifier"].all_passed and "env_error" not in info
    with pytest.raises(RuntimeError):
        env.step({"name": "finish", "arguments": {}})


def test_finish_without_fix_scores_zero(task):
    env = RepairEnv(task)
    env.reset()
    obs, r, term, _, info = env.step({"name": "finish", "arguments": {}})
    assert (r, term) == (0.0, True) and not info["verifier"].all_passed
    env.reset()  # reset restores the buggy code
    assert env.code == task.buggy_code


def test_decoy_patch_scores_zero(task):
    env = RepairEnv(task)
    env.reset()
    line, text = task.decoy_patches[0]
    env.step({"name": "replace_line", "arguments": {"line": line, "code": text}})
    assert env.step({"name": "finish", "arguments": {}})[1] == 0.0


def test_replace_line_errors_are_observations(task):
    env = RepairEnv(task)
    env.reset()
    n = len(task.buggy_code.split("\n"))
    for bad in (0, n + 1, -1):
        obs, r, term, *_ = env.step({"name": "replace_line", "arguments": {"line": bad, "code": "x"}})
        assert obs == f"error: line must be 1..{n}" and not term
    obs = env.step({"name": "replace_line", "arguments": {"line": 1, "code": "a\nb"}})[0]
    assert obs == "error: code must be one line"
    assert env.code == task.buggy_code
    with pytest.raises(ValueError):
        env.step({"name": "rm_rf", "arguments": {}})


def test_verify_uses_hidden_tests(task):
    rep = verify(task, task.reference_code)
    assert rep.all_passed and rep.total == len(task.hidden_tests)


def test_format_report_short():
    rep = TestReport("ok", 2, 5, ["a returned 0, expected 1", "b", "c"])
    assert format_report(rep) == "2/5 passed\na returned 0, expected 1\nb"
    assert format_report(TestReport("timeout", 0, 5)) == "0/5 passed\ntimeout: the code ran too long"

"""Retries of a failed environment: a sandbox that cannot start is re-run up to
``ENV_RETRIES`` times (same code, same tests), then the episode is an env_error.

The failure is injected in front of the real sandbox (``sandbox._run`` for the visible
tests, ``judge._run`` for the reward): the first ``m`` runs report ``sandbox_error``, later
ones run the real check.
"""

import dataclasses
from types import SimpleNamespace

import pytest

from consequence.envs.repair.env import RepairEnv
from consequence.envs.repair.problems import build_problems, make_instance
from consequence.reward.scoring import score_trajectories
from consequence.rollout.episodes import Budgets, EpisodeSpec, run_episodes
from consequence.sandbox import judge, sandbox
from consequence.sandbox.sandbox import ENV_RETRIES, TestReport, with_retries


@pytest.fixture(scope="module")
def task():
    ps = [
        p for p in build_problems(0) if p.family == "find_max" and p.bug_kind == "init" and p.bug_text.endswith("= 0")
    ]
    return make_instance(ps[0], "retry")


def _fail_first(monkeypatch, module, m: int) -> list[int]:
    """Make ``module._run`` report sandbox_error on its first ``m`` calls; returns a list
    whose length is the number of calls made."""
    real, calls = module._run, []
    sandbox.clear_cache()
    judge.clear_cache()

    def flaky(code, tests, *rest):
        calls.append(1)
        if len(calls) <= m:
            return TestReport(
                "sandbox_error", 0, len(tests) if isinstance(tests, list) else 1, [], "cannot spawn: injected"
            )
        return real(code, tests, *rest)

    monkeypatch.setattr(module, "_run", flaky)
    return calls


def test_stated_limit():
    from consequence.report.manifest import RULES

    assert ENV_RETRIES == 2  # README and the tests below state 3 attempts
    assert "up to 2 more times (3 attempts" in RULES["retries"]


def test_with_retries_counts_and_names_the_attempts():
    seq = iter([TestReport("sandbox_error", 0, 2, [], "x")] * 5)
    r = with_retries(lambda: next(seq), 3)
    assert (r.status, r.attempts, r.error) == ("sandbox_error", 4, "x; gave up after 4 attempts")
    ok = with_retries(lambda: TestReport("timeout", 0, 2), 3)  # not retried: the candidate's result
    assert (ok.status, ok.attempts) == ("timeout", 1)
    with pytest.raises(ValueError):
        with_retries(lambda: ok, -1)


@pytest.mark.parametrize("m", [0, 1, 2])
def test_finish_within_the_limit_is_scored_normally(task, monkeypatch, m):
    for code, want in ((task.reference_code, 1.0), (task.buggy_code, 0.0)):
        calls = _fail_first(monkeypatch, judge, m)
        env = RepairEnv(dataclasses.replace(task, buggy_code=code))
        env.reset()
        _, r, term, _, info = env.step({"name": "finish", "arguments": {}})
        assert (r, term, info["env_retries"], len(calls)) == (want, True, m, m + 1)
        assert "env_error" not in info and info["verifier"].status == "ok"
        assert info["verifier"].attempts == m + 1


def test_finish_beyond_the_limit_is_an_env_error(task, monkeypatch):
    calls = _fail_first(monkeypatch, judge, ENV_RETRIES + 1)
    env = RepairEnv(dataclasses.replace(task, buggy_code=task.reference_code))
    env.reset()
    _, r, term, _, info = env.step({"name": "finish", "arguments": {}})
    assert len(calls) == ENV_RETRIES + 1 and term
    assert info["env_retries"] == ENV_RETRIES
    assert info["env_error"] == "sandbox: cannot spawn: injected; gave up after 3 attempts"


def test_run_tests_tool_is_retried_too(task, monkeypatch):
    calls = _fail_first(monkeypatch, sandbox, 2)
    env = RepairEnv(task)
    env.reset()
    obs, _, term, _, info = env.step({"name": "run_tests", "arguments": {}})
    n = len(task.visible_tests)
    assert len(calls) == 3 and info["env_retries"] == 2 and not term
    assert obs.split("\n")[0].endswith(f"/{n} passed")
    calls = _fail_first(monkeypatch, sandbox, 5)
    env = RepairEnv(task, env_retries=0)  # the limit is a parameter of the environment
    env.reset()
    obs, _, term, _, info = env.step({"name": "run_tests", "arguments": {}})
    assert (obs, term, len(calls), info["env_retries"]) == ("sandbox error", True, 1, 0)
    assert info["env_error"].endswith("gave up after 1 attempt")


def _episode(renderer, task, monkeypatch, fail_visible: int, fail_reward: int):
    """One scripted episode (run_tests, then finish) of a task whose code is already right."""
    ok = task.reference_code
    run = renderer.encode(renderer.format_call("run_tests", {})) + [renderer.eot_id]
    fin = renderer.encode(renderer.format_call("finish", {})) + [renderer.eot_id]
    v = _fail_first(monkeypatch, sandbox, fail_visible)
    j = _fail_first(monkeypatch, judge, fail_reward)
    env = RepairEnv(dataclasses.replace(task, buggy_code=ok))
    outputs = iter([run, fin])

    def generate(prompts, max_new_tokens, idx):  # one episode: the policy's turns, in order
        ids = next(outputs)
        return [SimpleNamespace(output_ids=ids, logprobs=[-0.5] * len(ids), stop_reason="stop")]

    [t] = run_episodes(generate, renderer, [EpisodeSpec(env, task.task_id, "g", 0, 0)], Budgets(), "sys")
    score_trajectories([t])
    return t, len(v), len(j)


def test_episode_counts_retries_and_is_scored(renderer, task, monkeypatch):
    t, nv, nj = _episode(renderer, task, monkeypatch, 1, 2)
    assert (nv, nj) == (2, 3)  # each check re-run, the policy sampled once per turn
    assert (t.outcome, t.reward, t.env_retries, t.error) == ("finished", 1.0, 3, None)
    assert len(t.calls) == 2


def test_episode_beyond_the_limit_is_excluded(renderer, task, monkeypatch):
    t, nv, nj = _episode(renderer, task, monkeypatch, 0, ENV_RETRIES + 1)
    assert (nv, nj) == (1, ENV_RETRIES + 1)
    assert (t.outcome, t.reward, t.env_retries) == ("env_error", None, ENV_RETRIES)
    assert "gave up after 3 attempts" in t.error and len(t.calls) == 2

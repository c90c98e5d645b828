"""The recovery diagnostic: the same wrong first patch for every policy, as context only."""

import pytest

from consequence.envs.repair.env import SYSTEM_PROMPT, TOOLS, RepairEnv, verify
from consequence.envs.repair.problems import load_split, make_tasks
from consequence.evaluate.recovery import recovery_openings, wrong_first_patch
from consequence.records import trajectory_to_rows
from consequence.rollout.episodes import Budgets, EpisodeSpec, run_episodes


@pytest.fixture(scope="module")
def tasks():
    return make_tasks(load_split(0)["validation"], 24, seed=3)


def _patched(task, opening):
    (_, args), _ = opening
    lines = task.buggy_code.split("\n")
    lines[args["line"] - 1] = args["code"]
    return "\n".join(lines)


@pytest.mark.slow
def test_every_wrong_first_patch_fails_the_hidden_tests_and_sits_on_the_bug_line(tasks):
    kept, openings = recovery_openings(tasks)
    assert len(kept) == len(tasks)  # every generated task has a decoy
    on_line = 0
    for task, opening in zip(kept, openings):
        assert opening[1] == ("run_tests", {})
        assert not verify(task, _patched(task, opening)).all_passed, task.task_id
        assert verify(task, task.reference_code).all_passed
        on_line += opening[0][1]["line"] == task.patch[0]
    assert on_line == sum(any(d[0] == t.patch[0] for d in t.decoy_patches) for t in tasks)


def test_tasks_without_decoys_are_left_out(tasks):
    from dataclasses import replace

    bare = replace(tasks[0], decoy_patches=())
    assert wrong_first_patch(bare) is None
    kept, openings = recovery_openings([bare, tasks[1]])
    assert kept == [tasks[1]] and len(openings) == 1


def _teacher(renderer, plans):
    from consequence.distill.teacher import ScriptedTeacher

    return ScriptedTeacher(renderer, plans)


@pytest.fixture(scope="module")
def real_renderer():
    from consequence.distill.warmstart import BUNDLED
    from consequence.harness.renderer import Renderer
    from consequence.policy.tiny import load_policy

    return Renderer(load_policy(BUNDLED)[1], TOOLS)


def test_opening_is_context_the_policy_continues_from(tasks, real_renderer):
    task = tasks[0]
    opening = wrong_first_patch(task)
    line, code = task.patch
    gen = _teacher(real_renderer, [[("replace_line", {"line": line, "code": code}), ("finish", {})]])
    spec = EpisodeSpec(RepairEnv(task), task.task_id, task.task_id, 0, 0, opening)
    [t] = run_episodes(gen, real_renderer, [spec], Budgets(), SYSTEM_PROMPT)
    assert t.outcome == "finished" and t.verifier_score == 1.0  # recovered
    assert t.n_tool_calls == 2  # the policy's own calls only
    # The policy's first context is the conversation with the opening as earlier assistant
    # turns, each rendered exactly as the template renders that tool call.
    first = real_renderer.tokenizer.decode(t.calls[0].context_ids)
    assert real_renderer.format_call(*opening[0]) in first and real_renderer.format_call(*opening[1]) in first
    assert t.messages[3]["content"] == "ok" and "passed" in t.messages[5]["content"]  # what the policy saw
    # Targets are exactly the policy's sampled tokens: none of the opening's.
    rows = trajectory_to_rows(t)
    assert sum(sum(r.loss_mask) for r in rows) == t.n_generated_tokens


def test_an_opening_that_ends_the_episode_is_refused(tasks, real_renderer):
    task = tasks[0]
    spec = EpisodeSpec(RepairEnv(task), task.task_id, task.task_id, 0, 0, (("finish", {}),))
    with pytest.raises(ValueError, match="opening call 'finish' ended the episode"):
        run_episodes(_teacher(real_renderer, [[("finish", {})]]), real_renderer, [spec], Budgets(), SYSTEM_PROMPT)


def test_an_environment_failure_in_the_opening_is_an_env_error(tasks, real_renderer, monkeypatch):
    import consequence.envs.repair.env as repair_env
    from consequence.sandbox.sandbox import TestReport

    monkeypatch.setattr(repair_env, "run_tests", lambda *a, **k: TestReport("sandbox_error", 0, 1, [], "cannot spawn"))
    task = tasks[0]
    spec = EpisodeSpec(RepairEnv(task), task.task_id, task.task_id, 0, 0, wrong_first_patch(task))
    [t] = run_episodes(_teacher(real_renderer, [[("finish", {})]]), real_renderer, [spec], Budgets(), SYSTEM_PROMPT)
    assert t.outcome == "env_error" and "cannot spawn" in t.error and t.calls == []

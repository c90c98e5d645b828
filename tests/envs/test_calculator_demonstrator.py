"""The calculator's demonstrator (``Environment.demonstration``): one calculator call on the
task's expression, then the answer; verified by the environment's own reward, never trusted."""

import random

import pytest

from consequence.distill.teacher import demonstration_plans, verify_plans
from consequence.envs.api import has_demonstrator
from consequence.envs.registry import load_environment
from consequence.harness.renderer import Renderer
from consequence.policy.tiny import BUNDLED, load_policy


@pytest.fixture(scope="module")
def env():
    return load_environment("calculator", 0)


@pytest.fixture(scope="module")
def renderer(env):
    return Renderer(load_policy(BUNDLED)[1], env.tools)


def test_the_demonstration_is_one_call_then_the_answer(env):
    task = env.split["train"][0]
    assert has_demonstrator(env)
    assert env.demonstration(task, random.Random(0)) == [
        {"name": "calculator", "arguments": {"expression": task.expression}},
        {"answer": f"<answer>{task.answer}</answer>"},
    ]


def test_the_demonstrator_solves_every_sampled_train_task(env, renderer):
    """60 train instances, played in the tiny student's tokens: all verified by the reward, each
    with exactly one tool call whose observation is the environment's value of the expression."""
    tasks = env.sample("train", 60, seed=1)
    demos = verify_plans(env, tasks, demonstration_plans(env, tasks, random.Random(0)), renderer)
    assert (len(demos.kept), demos.total, dict(demos.rejected)) == (60, 60, {})
    for t, task in zip(demos.kept, tasks):
        assert t.task_id == task.task_id and t.outcome == "finished" and t.verifier_score == 1.0
        assert t.reward_components["accuracy"] == 1.0 and t.n_tool_calls == 1 and len(t.calls) == 2
        assert t.messages[3] == {"role": "tool", "name": "calculator", "content": str(task.answer)}


def test_a_tool_cost_does_not_hide_a_right_answer(renderer):
    """Verification reads the primary component (accuracy), not the total less the tool's cost."""
    env = load_environment("calculator", 0, {"tool_cost": 0.05})
    tasks = env.sample("train", 4, seed=2)
    demos = verify_plans(env, tasks, demonstration_plans(env, tasks, random.Random(0)), renderer)
    assert len(demos.kept) == 4 and all(t.reward == pytest.approx(0.95) for t in demos.kept)


def test_a_demonstrator_is_checked_not_trusted(env):
    """Habits for a demonstrator that takes none, and a plan that is no list of actions, are refused."""
    from consequence.envs.calculator.env import CalculatorEnvironment

    tasks = env.sample("train", 2, seed=3)
    with pytest.raises(ValueError, match="takes no habits; leave p_read_only at their defaults"):
        demonstration_plans(env, tasks, random.Random(0), {"p_read_only": 0.1})

    class Sloppy(CalculatorEnvironment):
        def demonstration(self, task, rng):
            return [{"name": "calculator", "arguments": "1 + 1"}]

    with pytest.raises(ValueError, match=r"demonstration\(\) of task .*must be a JSON object"):
        demonstration_plans(Sloppy(0, n_problems=20), tasks, random.Random(0))


def test_no_demonstration_when_no_calculator_call_is_allowed(env):
    """max_calls=0: the demonstrator would call the calculator, so it produces nothing and says
    why (the documented NotImplementedError), refused before any work with the other sources."""
    from consequence.distill.teacher import require_demonstrator
    from consequence.envs.api import cannot_demonstrate

    none = load_environment("calculator", 0, {"max_calls": 0})
    task = none.sample("train", 1, seed=0)[0]
    with pytest.raises(NotImplementedError, match="option max_calls=0 allows no calculator call"):
        none.demonstration(task, random.Random(0))
    assert has_demonstrator(none) and "max_calls=0 allows no calculator call" in (cannot_demonstrate(none) or "")
    with pytest.raises(ValueError, match=r"--env calculator: its demonstrator cannot demonstrate here .*--demos-file FILE.*--teacher-url URL"):  # fmt: skip
        require_demonstrator(none)
    with pytest.raises(ValueError, match="cannot demonstrate"):
        demonstration_plans(none, [task], random.Random(0))
    # one call allowed: the demonstration is the call and the answer (negative control)
    one = load_environment("calculator", 0, {"max_calls": 1})
    assert cannot_demonstrate(one) is None and cannot_demonstrate(env) is None
    assert [a.get("name", "answer") for a in one.demonstration(task, random.Random(0))] == ["calculator", "answer"]

"""Potential-based shaping (``--shaping potential``, reward/shaping.py; Ng, Harada & Russell 1999,
Theorem 1): F_t = γΦ(s_{t+1}) − Φ(s_t) by hand, the telescoping sum, a truncated episode keeping
Φ(s_T), the harness recording Φ, GRPO's advantages unchanged at γ = 1 (and changed by a bonus that
is not a potential difference), the refusal of an environment without a potential, and the
repair / calculator potentials on hand-made states."""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from consequence.cli import app
from consequence.config import TrainConfig
from consequence.credit.advantages import group_advantages
from consequence.credit.batch import credit_rewards
from consequence.envs.api import Environment, has_potential
from consequence.envs.calculator.env import ArithmeticTask, CalculatorEnvironment, CalculatorEpisode
from consequence.envs.repair.env import RepairEnv
from consequence.envs.repair.hostile import TASK, VISIBLE
from consequence.envs.repair.problems import RepairTask
from consequence.envs.repair.tasks import RepairEnvironment
from consequence.records import ModelCall, Trajectory
from consequence.reward.shaping import (
    SHAPING_COMPONENT,
    apply_potential_shaping,
    check_potential,
    shaping_return_mean,
    shaping_terms,
)
from consequence.rollout.collect import roll_out_round
from consequence.rollout.episodes import Budgets, EpisodeSpec, run_episodes
from consequence.sandbox.cases import TestCase
from env_fixtures import ReverseEnvironment
from replies import replay

# Float sums of a few terms of magnitude < 1: exact to a few ulps of 1.
TOL = 1e-12

PHI = [0.1, 0.3, 0.2, 0.4]  # Φ(s_0..s_3) of a hand-made 3-turn episode
GAMMA = 0.9


# ---- the terms and their sum --------------------------------------------------------------------
def test_three_turn_episode_terms_by_hand():
    # F_t = 0.9·Φ(s_{t+1}) − Φ(s_t): 0.9·0.3 − 0.1 = 0.17, 0.9·0.2 − 0.3 = −0.12, then the last turn
    finished = shaping_terms(PHI, "finished", GAMMA)  # Φ(s_3) := 0 at a true end: 0 − 0.2
    truncated = shaping_terms(PHI, "truncated", GAMMA)  # Φ(s_3) kept: 0.9·0.4 − 0.2 = 0.16
    assert finished == pytest.approx([0.17, -0.12, -0.2], abs=TOL)
    assert truncated == pytest.approx([0.17, -0.12, 0.16], abs=TOL)


@pytest.mark.parametrize("outcome", ["finished", "truncated"])
@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.5, 0.0])
def test_the_discounted_sum_telescopes(outcome, gamma):
    rng = random.Random(7)
    for n in range(1, 7):
        phi = [rng.uniform(-1, 1) for _ in range(n + 1)]
        terms = shaping_terms(phi, outcome, gamma)
        last = 0.0 if outcome == "finished" else phi[-1]
        assert len(terms) == n
        assert math.fsum(gamma**t * f for t, f in enumerate(terms)) == pytest.approx(gamma**n * last - phi[0], abs=TOL)
        if gamma == 1.0 and outcome == "finished":  # −Φ(s_0), whatever the path
            assert math.fsum(terms) == pytest.approx(-phi[0], abs=TOL)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="no potential was recorded"):
        shaping_terms([], "finished", 1.0)
    with pytest.raises(ValueError, match="not scored"):
        shaping_terms([0.1, 0.2], "env_error", 1.0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        shaping_terms([0.1, 0.2], "finished", 1.5)
    assert shaping_terms([0.3], "finished", 1.0) == []  # no turn: no transition


def _traj(rewards, potentials, outcome="finished", sample_id=0) -> Trajectory:
    calls = [ModelCall([1], [2, 3], [-0.5, -0.5], "stop", reward=r) for r in rewards]
    t = Trajectory("t", "g", sample_id, 0, 0, calls=calls, outcome=outcome, potentials=list(potentials))
    t.reward = math.fsum(rewards)
    t.reward_components = {"accuracy": t.reward}
    return t


def test_shaping_goes_on_each_call_and_into_the_reward():
    t = _traj([0.0, 0.0, 1.0], PHI)
    broken = _traj([0.0], [0.1, 0.2], outcome="env_error")
    broken.reward = None
    apply_potential_shaping([t, broken], GAMMA)
    assert [c.reward for c in t.calls] == pytest.approx([0.17, -0.12, 1.0 - 0.2], abs=TOL)
    assert t.reward_components[SHAPING_COMPONENT] == pytest.approx(0.17 - 0.12 - 0.2, abs=TOL)
    assert t.reward == pytest.approx(1.0 - 0.15, abs=TOL)
    # what GAE puts after the calls (reward − Σ call rewards) is unchanged: 0
    assert t.reward - math.fsum(c.reward for c in t.calls) == pytest.approx(0.0, abs=TOL)
    assert broken.reward is None and broken.calls[0].reward == 0.0  # an env_error is left alone
    assert shaping_return_mean([t, broken]) == pytest.approx(-0.15, abs=TOL)
    with pytest.raises(ValueError, match="holds 2 potentials for 3 model calls"):
        apply_potential_shaping([_traj([0.0, 0.0, 1.0], [0.1, 0.2])], 1.0)


def test_the_iteration_line_carries_the_mean_shaping_return():
    from consequence.loop.train import iteration_metrics

    def line(trajs, shaping):
        cfg = SimpleNamespace(
            dynamic_sampling=False, distill_lambda=1.0, reward_model=None, judge_url=None, shaping=shaping
        )
        cfg.attempts, cfg.context = 1, "full"  # one answer per episode, the full history
        r = SimpleNamespace(cfg=cfg, env=SimpleNamespace(iteration_metrics=lambda ts: {}))
        got = SimpleNamespace(trajectories=trajs, stats={"gen_tokens_total": 8}, queue=None, from_data=False)
        return iteration_metrics(0, r, got, SimpleNamespace(metrics={}), {}, 1.0, 1.0, None)

    finished, cut = _traj([0.0, 0.0, 1.0], PHI), _traj([0.0, 0.0, 0.0], PHI, outcome="truncated", sample_id=1)
    assert "shaping_return_mean" not in line([finished, cut], "none")
    apply_potential_shaping([finished, cut], 1.0)
    # −Φ(s_0) = −0.1 finished; Φ(s_3) − Φ(s_0) = 0.3 truncated
    assert line([finished, cut], "potential")["shaping_return_mean"] == pytest.approx((-0.1 + 0.3) / 2, abs=TOL)


# ---- through the harness and the batch -----------------------------------------------------------
@dataclass(frozen=True)
class _Task:
    task_id: str
    problem_id: str


class _TestsEpisode:
    """Each ``run_tests`` call raises the count; an answer ends it, 1.0 when it is ``right``."""

    answer_ends_episode = True

    def __init__(self):
        self.runs = 0

    def reset(self, seed=None, options=None):
        self.runs = 0
        return "answer right", {}

    def step(self, action):
        if "answer" in action:
            ok = action["answer"].strip() == "right"
            return "", float(ok), True, False, {"reward_components": {"accuracy": float(ok)}}
        self.runs += 1
        return "ran", 0.0, False, False, {}


class _TestsEnvironment(Environment):
    name = "tests-count"
    reward_components = ("accuracy",)

    def load_splits(self, split_seed):
        return {"train": [_Task("a", "a")], "validation": [], "test": []}

    def make_episode(self, task):
        return _TestsEpisode()

    def potential(self, episode):
        return 0.1 + 0.2 * min(episode.runs, 2)  # Φ(s_0) = 0.1


def _round(renderer, shaping, turns, max_turns=4, **cfg):
    cfg = TrainConfig(tasks_per_iteration=1, group_size=len(turns), shaping=shaping, **cfg)
    budgets = Budgets(max_turns=max_turns)

    def runner(specs, seed, version, progress):
        return run_episodes(replay(renderer, turns), renderer, specs, budgets, "sys"), {}

    groups, _ = roll_out_round(0, 0, cfg, runner, _TestsEnvironment(), budgets)
    return groups[0]


def _turns(renderer, *plays):
    call = renderer.format_call("run_tests", {})
    return [[call] * n + ([answer] if answer else []) for n, answer in plays]


def test_the_harness_records_phi_and_the_round_shapes_each_turn(renderer):
    # 2 runs then right; wrong at once; 1 run then right; 3 runs, cut by max_turns 3
    turns = _turns(renderer, (2, "right"), (0, "wrong"), (1, "right"), (3, None))
    group = _round(renderer, "potential", turns, max_turns=3)
    assert [t.outcome for t in group] == ["finished", "finished", "finished", "truncated"]
    want = [[0.1, 0.3, 0.5, 0.5], [0.1, 0.1], [0.1, 0.3, 0.3], [0.1, 0.3, 0.5, 0.5]]  # calls + 1 values each
    assert [len(t.potentials) for t in group] == [len(w) for w in want]
    assert [p for t in group for p in t.potentials] == pytest.approx([p for w in want for p in w], abs=TOL)
    calls = [[c.reward for c in t.calls] for t in group]
    # γ = 1 (--gamma's default): F_t = Φ(s_{t+1}) − Φ(s_t), Φ = 0 after a finished episode's last turn
    assert calls[0] == pytest.approx([0.2, 0.2, 1.0 - 0.5], abs=TOL)
    assert calls[1] == pytest.approx([0.0 - 0.1], abs=TOL)
    assert calls[2] == pytest.approx([0.2, 1.0 - 0.3], abs=TOL)
    assert calls[3] == pytest.approx([0.2, 0.2, 0.0], abs=TOL)  # truncated: Φ(s_3) = 0.5 kept
    shaping = [t.reward_components[SHAPING_COMPONENT] for t in group]
    assert shaping == pytest.approx([-0.1, -0.1, -0.1, 0.5 - 0.1], abs=TOL)  # −Φ(s_0); Φ(s_T) − Φ(s_0)
    assert [t.reward for t in group] == pytest.approx([0.9, -0.1, 0.9, 0.4], abs=TOL)


def test_the_shaping_gamma_is_read(renderer):
    group = _round(renderer, "potential", _turns(renderer, (1, "right"), (2, None)), max_turns=2, shaping_gamma=0.5)
    # Φ = (0.1, 0.3 → 0 at the end): F = (0.5·0.3 − 0.1, 0.5·0 − 0.3)
    assert [c.reward for c in group[0].calls] == pytest.approx([0.05, 1.0 - 0.3], abs=TOL)
    # truncated, Φ = (0.1, 0.3, 0.5): F = (0.05, 0.5·0.5 − 0.3); Σ γ^t F_t = 0.5²·0.5 − 0.1
    assert [c.reward for c in group[1].calls] == pytest.approx([0.05, -0.05], abs=TOL)


def test_without_shaping_nothing_is_recorded_or_added(renderer):
    group = _round(renderer, "none", _turns(renderer, (2, "right"), (0, "wrong")))
    assert [t.potentials for t in group] == [[], []]
    assert [t.reward for t in group] == [1.0, 0.0]
    assert all(SHAPING_COMPONENT not in t.reward_components for t in group)


def test_grpo_advantages_are_unchanged_at_gamma_1_and_a_bonus_changes_them(renderer):
    # every member starts from s_0 (Φ = 0.1) and finishes, along different paths
    turns = _turns(renderer, (2, "right"), (0, "wrong"), (1, "right"), (3, "wrong"))
    plain = _round(renderer, "none", turns)
    shaped = _round(renderer, "potential", _turns(renderer, (2, "right"), (0, "wrong"), (1, "right"), (3, "wrong")))
    ids = [t.group_id for t in plain]
    a_plain = group_advantages(credit_rewards(plain), ids, "grpo")
    a_shaped = group_advantages(credit_rewards(shaped), ids, "grpo")
    assert a_plain == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-5)  # (R − 0.5) / (0.5 + 1e-6)
    assert a_shaped == pytest.approx(a_plain, abs=TOL)
    assert [t.reward for t in shaped] != [t.reward for t in plain]  # the rewards did move, by −0.1 each
    # a bonus of 0.1 per run_tests is no potential difference: it rewards the stalling member
    bonus = [t.reward + 0.1 * t.n_tool_calls for t in plain]
    a_bonus = group_advantages(bonus, ids, "grpo")
    assert max(abs(x - y) for x, y in zip(a_bonus, a_plain)) > 0.1
    assert a_bonus[3] > a_bonus[1]  # the 3-run failure now beats the quick failure


def test_a_potential_that_fails_makes_an_env_error(renderer):
    class Broken(_TestsEnvironment):
        def potential(self, episode):
            if episode.runs:
                raise RuntimeError("no state")
            return 0.1

    class NotFinite(_TestsEnvironment):
        def potential(self, episode):
            return float("nan") if episode.runs else 0.1

    call = renderer.format_call("run_tests", {})
    for env, said in ((Broken(), "environment potential raised RuntimeError: no state"), (NotFinite(), "nan")):
        specs = [EpisodeSpec(env.make_episode(None), "a", "g", 0, 0, potential=env.potential)]
        (t,) = run_episodes(replay(renderer, [[call, "right"]]), renderer, specs, Budgets(max_turns=4), "sys")
        assert t.outcome == "env_error" and said in t.error and t.potentials == [0.1]


# ---- what is refused --------------------------------------------------------------------------
def test_an_environment_without_a_potential_is_refused():
    env = ReverseEnvironment()
    assert not has_potential(env) and has_potential(_TestsEnvironment) and has_potential(RepairEnvironment)
    with pytest.raises(ValueError, match=r"--shaping potential: environment 'reverse' defines no potential"):
        check_potential(env)
    with pytest.raises(NotImplementedError, match="'reverse' defines no potential"):
        env.potential(env.make_episode(env.split["train"][0]))
    check_potential(_TestsEnvironment())  # one that defines it passes


def test_the_cli_refuses_it_before_any_work(tmp_path):
    res = CliRunner().invoke(
        app,
        [
            "train",
            "--env",
            "env_fixtures:ReverseEnvironment",
            "--shaping",
            "potential",
            "--run-dir",
            str(tmp_path / "r"),
        ],
    )
    assert res.exit_code == 2, res.output
    assert "environment 'reverse' defines no potential" in " ".join(res.output.split())
    assert not (tmp_path / "r").exists()


def test_shaping_with_an_agent_is_refused():
    with pytest.raises(ValueError, match="--shaping potential with --agent is not supported"):
        TrainConfig(shaping="potential", agent="my_agent:agent")


# ---- the built-in potentials on hand-made states --------------------------------------------------
def _repair_task() -> RepairTask:
    """hostile.TASK (``add`` written as ``a - b``) with two visible tests it passes (b = 0) beside its two failing ones."""
    return dataclasses.replace(TASK, visible_tests=VISIBLE + (TestCase("add(5, 0)", "5"), TestCase("add(7, 0)", "7")))


def test_repair_potential_is_half_the_share_of_visible_tests_on_the_current_code():
    env = RepairEnvironment.__new__(RepairEnvironment)  # the potential reads the episode only: no split needed
    ep = RepairEnv(_repair_task())
    ep.reset()
    assert env.potential(ep) == 0.0  # untested code
    assert ep.step({"name": "run_tests", "arguments": {}})[0].startswith("2/4 passed")
    assert env.potential(ep) == 0.5 * 2 / 4
    ep.step({"name": "replace_line", "arguments": {"line": 2, "code": "    return a + b"}})
    assert env.potential(ep) == 0.0  # an edit since the last run: the new code is untested
    ep.step({"name": "run_tests", "arguments": {}})
    assert env.potential(ep) == 0.5
    ep.reset()
    assert env.potential(ep) == 0.0


def test_calculator_potential_is_half_once_the_answer_was_computed():
    env = CalculatorEnvironment.__new__(CalculatorEnvironment)
    ep = CalculatorEpisode(ArithmeticTask("c#0", "c", "What is 12 * 34 + 5?", 413, "expression", "12 * 34 + 5"))
    ep.reset()
    assert env.potential(ep) == 0.0
    assert ep.step({"name": "calculator", "arguments": {"expression": "12 * 34"}})[0] == "408"
    assert env.potential(ep) == 0.0  # a value, not the answer
    assert ep.step({"name": "calculator", "arguments": {"expression": "12 * 34 + 5"}})[0] == "413"
    assert env.potential(ep) == 0.5
    ep.step({"name": "calculator", "arguments": {"expression": "1 +"}})  # an error later keeps it
    assert env.potential(ep) == 0.5
    ep.reset()
    assert env.potential(ep) == 0.0

"""DAPO's overlong shaping measures the response: the tokens the policy generated (Yu et al. 2025, §3.4, eq. 13).

|y| is the policy's target tokens over all calls of the episode, never the prompt or the
observations; L_max is the episode's generation budget min(max_turns × max_new_tokens,
max_total_tokens) (config.generation_budget), 8 × 48 = 384 by default. With L_cache = 128 the
penalty is 0 up to 256 generated tokens and (256 − |y|) / 128 on the ramp. Every ramp value
below is a multiple of 1/128, exact in binary floating point, so the comparisons are exact
up to the one addition to the task reward (1e-12).
"""

from types import SimpleNamespace

import pytest

import consequence.rollout.collect as collect_module
from consequence.config import TrainConfig
from consequence.records import ModelCall, Trajectory
from consequence.reward.overlong import overlong_penalty
from consequence.reward.scoring import score_trajectories
from consequence.rollout.episodes import Budgets

L_MAX, BUFFER = 8 * 48, 128  # the default budgets' generation budget; DAPO recipe's buffer


def _episode(prompt: int, outputs: list[int], observation: int, group="0/t", sample_id=0, verified=1.0):
    """A multi-turn episode: a ``prompt``-token opening, then calls sampling ``outputs[k]`` tokens each,
    every call but the last followed by an ``observation``-token tool result; the context of each
    call is the whole history (append-only), as the harness builds it."""
    calls, context = [], list(range(prompt))
    for k, n in enumerate(outputs):
        obs = [7] * observation if k < len(outputs) - 1 else []
        calls.append(ModelCall(list(context), [5] * n, [-0.1] * n, "stop", observation_ids=obs))
        context = context + [5] * n + obs
    return Trajectory(
        task_id="t",
        group_id=group,
        sample_id=sample_id,
        seed=sample_id,
        policy_version=0,
        calls=calls,
        outcome="finished",
        env_rewards={"hidden_tests": verified},
    )


def test_the_ramp_by_hand_on_generated_tokens():
    # one call after a 500-token prompt: the prompt does not count, only the n sampled tokens
    for n, want in [(0, 0.0), (256, 0.0), (257, -1 / 128), (320, -0.5), (383, -127 / 128), (384, -1.0)]:
        t = _episode(500, [n], 0, verified=0.0)
        score_trajectories([t], BUFFER, L_MAX)
        assert t.reward_components["overlong"] == want, n
        assert t.reward == want
    # the function itself, past L_max (a longer response than the budget: −1)
    assert overlong_penalty(385, L_MAX, BUFFER) == -1.0


def test_a_multi_turn_episode_with_few_generated_tokens_and_a_long_context_is_not_penalised():
    # 3 calls of 10 tokens after a 600-token prompt and two 35-token tool results: the last call's
    # context is 600 + 2 · (10 + 35) = 690 tokens, context + output 700, but the policy wrote 30 tokens.
    t = _episode(600, [10, 10, 10], 35)
    assert len(t.calls[-1].context_ids) + len(t.calls[-1].output_ids) == 700 and t.n_generated_tokens == 30
    score_trajectories([t], BUFFER, L_MAX)
    assert t.reward_components == {"hidden_tests": 1.0, "overlong": 0.0} and t.reward == 1.0
    # seven calls of 48 tokens after a short prompt: 336 generated, on the ramp: (256 − 336) / 128
    long = _episode(20, [48] * 7, 0)
    score_trajectories([long], BUFFER, L_MAX)
    assert long.reward_components["overlong"] == -0.625 and long.reward == pytest.approx(0.375, abs=1e-12)


class _Env:
    """The least an environment shows ``rollout.collect.roll_out_round``: one train task, no rescoring."""

    answer_ends_episode, system_prompt, examples = True, "", ()
    reward_components, reward_range = ("hidden_tests",), (0.0, 1.0)

    def sample(self, split, n, seed):
        return [SimpleNamespace(task_id="t")]

    def score_group(self, task, group):
        pass


def test_the_training_loop_scores_generated_tokens_against_the_generation_budget(monkeypatch):
    # the loop's own wiring (rollout box → reward box) with the episodes of the test above
    episodes = [_episode(600, [10, 10, 10], 35, sample_id=0), _episode(20, [48] * 7, 0, sample_id=1)]
    monkeypatch.setattr(collect_module, "group_of", lambda env, task, size: [object()] * size)
    cfg = TrainConfig(group_size=2, tasks_per_iteration=1, overlong_buffer=BUFFER)
    runner = lambda specs, seed, version, progress: (episodes, {})  # noqa: E731  (an EpisodeRunner)
    [group], _ = collect_module.roll_out_round(
        0, 0, cfg, runner, _Env(), Budgets(cfg.max_turns, cfg.max_new_tokens, cfg.max_total_tokens)
    )
    assert [t.reward_components["overlong"] for t in group] == [0.0, -0.625]


def test_a_buffer_longer_than_the_generation_budget_is_refused_at_config_time():
    from consequence.config import generation_budget

    assert generation_budget(8, 48, 768) == 384 and generation_budget(1, 48, 768) == 48
    assert generation_budget(8, 48, 200) == 200  # the episode's context holds every generated token
    assert TrainConfig(overlong_buffer=384).overlong_buffer == 384  # L_cache = L_max: the ramp starts at 0
    with pytest.raises(ValueError, match=r"--overlong-buffer 385 is longer than L_max = 384.*at most 384"):
        TrainConfig.checked(overlong_buffer=385)
    with pytest.raises(ValueError, match=r"--overlong-buffer 128 is longer than L_max = 48, .*--max-turns 1 "):
        TrainConfig.checked(overlong_buffer=128, max_turns=1)  # single-turn: L_max = max_new_tokens
    with pytest.raises(ValueError, match=r"L_max = 100, .*--max-total-tokens 100\)"):
        TrainConfig.checked(overlong_buffer=128, max_total_tokens=100)


def test_the_manifest_says_what_the_overlong_penalty_measures(tmp_path):
    from consequence.envs.registry import env_of
    from consequence.report.manifest import build_manifest

    cfg = TrainConfig(env="calculator", run_dir=str(tmp_path / "run"), overlong_buffer=BUFFER, max_turns=4)
    m = build_manifest(cfg, tmp_path, env_of(cfg), chat_template="", isolation={})["reward"]
    assert m["components"][-1] == "overlong" and m["range"][0] == env_of(cfg).reward_range[0] - 1.0
    assert m["overlong"]["max_length"] == 4 * 48 and m["overlong"]["buffer"] == BUFFER
    assert "generated" in m["overlong"]["length"] and "observation tokens not counted" in m["overlong"]["length"]
    plain = build_manifest(
        TrainConfig(env="calculator", run_dir=str(tmp_path / "run")),
        tmp_path,
        env_of(cfg),
        chat_template="",
        isolation={},
    )["reward"]
    assert "overlong" not in plain and "overlong" not in plain["components"]  # negative control: off

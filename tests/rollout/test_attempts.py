"""Recovery with feedback (``--attempts k``, ``rollout.attempts``): a scripted policy that answers
wrong then right on the calculator, the reward's discount, success@attempt vs pass@k, refusals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from consequence.cli import app
from consequence.config import TrainConfig
from consequence.envs.api import SingleTurnEnvironment, has_retries
from consequence.envs.calculator.env import ArithmeticTask
from consequence.envs.registry import load_environment
from consequence.envs.repair.env import RepairEnv
from consequence.envs.repair.problems import build_problems, make_instance
from consequence.evaluate.episode_eval import attempts_vs_samples, solved, success_at_attempt
from consequence.evaluate.report import attempts_lines
from consequence.harness.renderer import Renderer
from consequence.records import Trajectory, read_trajectories, trajectory_to_rows, write_trajectories
from consequence.reward.scoring import score_trajectories
from consequence.rollout.attempts import SELF_REFINE_PROMPT, Attempts, check_attempts
from consequence.rollout.episodes import Budgets, EpisodeSpec, run_episodes

TASK = ArithmeticTask("hand-1", "hand-1", "What is 4837 * 29 - 1204?", 139069, "expression", "4837 * 29 - 1204")
WRONG, RIGHT = "It is <answer>139070</answer>", "It is <answer>139069</answer>"
FEEDBACK = "incorrect: 139070 is not the exact value; try again and put the final number in <answer></answer>"


def _run(tiny_tokenizer, turns, attempts, discount=1.0, max_turns=4):
    env = load_environment("calculator", 0, {})
    renderer = Renderer(tiny_tokenizer, env.tools)
    outputs = [renderer.encode(t) + [renderer.eot_id] for t in turns]
    queue = list(outputs)

    def generate(prompts, max_new_tokens, idx):
        out = queue.pop(0)
        return [SimpleNamespace(output_ids=out, logprobs=[-0.5] * len(out), stop_reason="stop")]

    policy = check_attempts(env, attempts, discount)
    spec = EpisodeSpec(env.make_episode(TASK), "hand-1", "hand-1", 0, 0, attempts=policy)
    (traj,) = run_episodes(generate, renderer, [spec], Budgets(max_turns=max_turns, max_total_tokens=4000), "sys")
    return traj, outputs


@pytest.mark.parametrize("discount", [1.0, 0.5, 0.9])
def test_wrong_then_right_is_solved_at_attempt_two_with_reward_d(tiny_tokenizer, discount):
    traj, outputs = _run(tiny_tokenizer, [WRONG, RIGHT], attempts=2, discount=discount)
    assert (traj.outcome, traj.attempts, len(traj.calls)) == ("finished", 2, 2)  # two answer calls
    # attempt 1 failed: its result is the verifier's feedback (the model's value, never the reference) ...
    feedback = traj.messages[-3]
    assert feedback == {"role": "user", "content": FEEDBACK}
    assert traj.messages[-1]["content"] == "correct"
    # ... and the second call sampled against a context that holds it
    assert traj.calls[1].context_ids == traj.calls[0].context_ids + outputs[0] + traj.calls[0].observation_ids
    assert traj.calls[1].context_ids == renderer_of(tiny_tokenizer).prompt_ids(traj.messages[:-2])
    # reward: the wrong attempt's step counts 0, the right one d**(2-1) = d exactly; the verifier's score is 1
    assert [c.reward for c in traj.calls] == [0.0, discount]
    assert traj.env_rewards == {"accuracy": discount}
    score_trajectories([traj], components=("accuracy", "tool_cost"), reward_range=(0.0, 1.0))
    assert (traj.reward, traj.verifier_score) == (discount, 1.0) and solved(traj)
    assert success_at_attempt([traj], 2) == {"1": 0.0, "2": 1.0}
    # one row whose targets are exactly the sampled ids of the two calls
    (row,) = trajectory_to_rows(traj)
    assert [t for t, m in zip(row.input_ids, row.loss_mask) if m] == outputs[0] + outputs[1]


def renderer_of(tiny_tokenizer):
    return Renderer(tiny_tokenizer, load_environment("calculator", 0, {}).tools)


def test_without_attempts_a_wrong_answer_ends_the_episode(tiny_tokenizer):
    traj, _ = _run(tiny_tokenizer, [WRONG, RIGHT], attempts=1)
    assert (traj.outcome, traj.attempts, len(traj.calls), traj.verifier_score) == ("finished", 1, 1, 0.0)
    assert traj.messages[-1]["content"] == "incorrect"


def test_the_last_attempt_ends_the_episode_wrong(tiny_tokenizer):
    traj, _ = _run(tiny_tokenizer, [WRONG, WRONG, RIGHT], attempts=2, discount=0.5)
    assert (traj.outcome, traj.attempts, len(traj.calls), traj.verifier_score) == ("finished", 2, 2, 0.0)
    assert traj.messages[-1]["content"] == "incorrect" and success_at_attempt([traj], 2) == {"1": 0.0, "2": 0.0}


class _Partial:
    """Every answer is wrong and worth 0.3 (partial credit); every wrong answer may be retried."""

    answer_ends_episode = True

    def reset(self, seed=None):
        return "q", {}

    def step(self, action):
        return "", 0.3, True, False, {"reward_components": {"reward": 0.3}}


def test_wrong_attempts_never_add_up(tiny_tokenizer):
    env = load_environment("calculator", 0, {})
    renderer = Renderer(tiny_tokenizer, env.tools)
    out = renderer.encode("no") + [renderer.eot_id]

    def generate(prompts, max_new_tokens, idx):
        return [SimpleNamespace(output_ids=out, logprobs=[-0.5] * len(out), stop_reason="stop")]

    policy = Attempts(3, 0.5, lambda episode, info: "wrong")
    spec = EpisodeSpec(_Partial(), "t", "t", 0, 0, attempts=policy)
    (traj,) = run_episodes(generate, renderer, [spec], Budgets(max_turns=5, max_total_tokens=4000), "sys")
    # three answers of 0.3: only the last counts, at 0.5**2 (not 0.9, not above the range's 1)
    assert (traj.attempts, [c.reward for c in traj.calls]) == (3, [0.0, 0.0, 0.3 * 0.25])
    assert traj.env_rewards == {"reward": 0.3 * 0.25} and traj.verifier_score == 0.3


def test_attempts_refused_before_any_work():
    calc = load_environment("calculator", 0, {})
    with pytest.raises(ValueError, match=r"--attempts 0: give a number of attempts >= 1"):
        check_attempts(calc, 0)
    with pytest.raises(ValueError, match=r"--attempt-discount 0.0: give a discount in \(0, 1\]"):
        check_attempts(calc, 2, 0.0)
    plain = SingleTurnEnvironment([{"prompt": "q"}], lambda prompt, completion: 1.0)
    with pytest.raises(ValueError, match=r"--attempts 2: environment 'single-turn.*' does not support retries"):
        check_attempts(plain, 2)
    assert check_attempts(plain, 1) is None and check_attempts(calc, 1) is None
    assert not has_retries(plain) and has_retries(calc) and has_retries(load_environment("repair", 0, {}))


def test_repair_reopens_after_a_failed_finish_without_showing_the_hidden_tests():
    problem = next(p for p in build_problems(0) if p.family == "find_max" and p.bug_kind == "init")
    task = make_instance(problem, "env")
    env = RepairEnv(task)
    env.reset()
    _obs, reward, terminated, _, info = env.step({"name": "finish", "arguments": {}})
    assert (reward, terminated) == (0.0, True)
    rep = info["verifier"]
    text = env.retry_feedback(info)
    assert (
        text
        == f"finish: {rep.passed}/{rep.total} hidden tests passed; the code is as you left it: fix it and call finish again"
    )
    assert all(m not in text for m in rep.messages)  # no hidden test's failure message
    line, code = task.patch
    assert env.step({"name": "replace_line", "arguments": {"line": line, "code": code}})[0] == "ok"  # open again
    _obs, reward, terminated, _, info = env.step({"name": "finish", "arguments": {}})
    assert (reward, terminated) == (1.0, True) and env.retry_feedback(info) is None


def _t(task, attempts=1, ok=True, sample=0):
    return Trajectory(task, task, sample, 0, 0, verifier_score=1.0 if ok else 0.0, attempts=attempts)


def test_success_at_attempt_beside_pass_at_k_at_equal_samples(tmp_path):
    # one episode per task with --attempts 2: A solved at 1, B at 2, C never (2 attempts); an env error dropped
    episodes = [_t("A"), _t("B", 2), _t("C", 2, ok=False), Trajectory("D", "D", 0, 0, 0, outcome="env_error")]
    # two independent samples per task: A 2/2, B 1/2, C 0/2
    samples = [
        _t("A"),
        _t("A", sample=1),
        _t("B", ok=False),
        _t("B", sample=1),
        _t("C", ok=False),
        _t("C", ok=False, sample=1),
    ]
    # success@1 = 1/3, success@2 = 2/3; pass@1 = mean(1, 1/2, 0) = 1/2, pass@2 = mean(1, 1, 0) = 2/3
    assert attempts_vs_samples(episodes, samples, 2) == {
        "1": {"success_at_attempt": 1 / 3, "pass_at_k": 0.5},
        "2": {"success_at_attempt": 2 / 3, "pass_at_k": 2 / 3},
    }
    write_trajectories(tmp_path / "t.parquet", episodes)  # the field survives the record
    assert [t.attempts for t in read_trajectories(tmp_path / "t.parquet")] == [1, 2, 2, 1]


def test_settings_refuse_zero_attempts_and_attempts_with_an_agent():
    with pytest.raises(ValueError, match="attempts"):
        TrainConfig(attempts=0)
    with pytest.raises(ValueError, match="--attempts 2 with --agent is not supported"):
        TrainConfig(attempts=2, agent="my_agent:run")
    assert (TrainConfig().attempts, TrainConfig().attempt_discount) == (1, 1.0)  # the default: one answer


def test_the_eval_report_puts_success_at_attempt_beside_pass_at_k():
    episodes = [_t("A"), _t("B", 2), _t("C", 2, ok=False)]
    samples = [_t("A"), _t("A", sample=1), _t("B", ok=False), _t("B", sample=1), _t("C", ok=False)]
    samples.append(_t("C", ok=False, sample=1))
    att = {"k": 2, "discount": 1.0, "episodes": 3, "by_j": attempts_vs_samples(episodes, samples, 2)}
    lines = attempts_lines(att)
    assert lines[-2:] == ["| 1 | 0.333 | 0.500 |", "| 2 | 0.667 | 0.667 |"]  # the hand-computed case above
    assert "## Recovery with feedback (--attempts 2)" in lines and attempts_lines(None) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--attempts", "3", "-n", "2"], "--attempts 3 needs -n >= 3"),
        (["--attempts", "0", "-n", "2"], "--attempts 0: give a number of attempts >= 1"),
        (["--env", "humaneval", "--attempts", "2", "-n", "2"], "--attempts 2: humaneval is evaluated as single-turn"),
    ],
)
def test_eval_refuses_attempts_it_cannot_run_before_any_work(args, message, tmp_path):
    argv = ["eval", "--model", str(tmp_path / "none"), "--out", str(tmp_path / "out"), *args]
    result = CliRunner().invoke(app, argv if "--env" in args else [*argv, "--env", "calculator"])
    assert result.exit_code != 0 and message in " ".join(result.output.split()), result.output
    assert not (tmp_path / "out").exists()


def test_self_refine_shows_the_critique_request_not_the_verifier(tiny_tokenizer):
    env = load_environment("calculator", 0, {})
    renderer = Renderer(tiny_tokenizer, env.tools)
    outputs = [renderer.encode(t) + [renderer.eot_id] for t in (WRONG, RIGHT)]
    queue = list(outputs)

    def generate(prompts, max_new_tokens, idx):
        out = queue.pop(0)
        return [SimpleNamespace(output_ids=out, logprobs=[-0.5] * len(out), stop_reason="stop")]

    policy = check_attempts(env, 2, 0.5, "self-refine")
    spec = EpisodeSpec(env.make_episode(TASK), "hand-1", "hand-1", 0, 0, attempts=policy)
    (traj,) = run_episodes(generate, renderer, [spec], Budgets(max_turns=4, max_total_tokens=4000), "sys")
    assert traj.messages[-3] == {"role": "user", "content": SELF_REFINE_PROMPT}
    assert all(FEEDBACK not in str(m.get("content")) for m in traj.messages)  # the verifier's text never shown
    assert (traj.attempts, [c.reward for c in traj.calls], traj.verifier_score) == (2, [0.0, 0.5], 1.0)
    with pytest.raises(ValueError, match="--attempt-feedback critic: give one of verifier, self-refine"):
        check_attempts(env, 2, 1.0, "critic")

import random

import pytest
import torch

from consequence.distill.sft import bucketed_batches as _bucketed_batches
from consequence.distill.teacher import PLAN_ENDED, ScriptedTeacher, check_action, play_plans, turn_text, verified
from consequence.envs.registry import load_environment
from consequence.harness.renderer import Renderer
from consequence.policy.tiny import BUNDLED, load_policy


@pytest.fixture(scope="module")
def calculator():
    return load_environment("calculator", 0)


@pytest.fixture(scope="module")
def renderer(calculator):
    return Renderer(load_policy(BUNDLED)[1], calculator.tools)


def test_the_scripted_teacher_writes_calls_and_answers_as_the_student_would(renderer):
    """A tool call is the template's call text, an answer its text, each + end-of-turn; log-probs 0."""
    call = {"name": "calculator", "arguments": {"expression": "2 + 3"}}
    teacher = ScriptedTeacher(renderer, [[call, ("calculator", {"expression": "7"}), {"answer": "<answer>5</answer>"}]])
    got = [teacher([[]], 10, [0])[0] for _ in range(3)]
    assert got[0].output_ids == renderer.encode(renderer.format_call("calculator", {"expression": "2 + 3"})) + [
        renderer.eot_id
    ]
    assert renderer.tokenizer.decode(got[1].output_ids[:-1]) == renderer.format_call("calculator", {"expression": "7"})
    assert got[2].output_ids == renderer.encode("<answer>5</answer>") + [renderer.eot_id]
    assert all(s.logprobs == [0.0] * len(s.output_ids) and s.stop_reason == "stop" for s in got)
    # a spent plan is an empty turn cut at the limit, never a made-up action
    spent = teacher([[]], 10, [0])[0]
    assert (spent.output_ids, spent.stop_reason, teacher.ran_out) == ([], "length", {0})
    # a turn of several actions: its text first, then its calls, one per line
    assert turn_text([{"answer": "Let me compute."}, call]) == "Let me compute.\n" + renderer.format_call(
        "calculator", {"expression": "2 + 3"}
    )


@pytest.mark.parametrize(
    "action,problem",
    [
        ({"name": "calculator", "arguments": {}}, None),
        (("calculator", {}), None),
        ({"answer": "42"}, None),
        ({"answer": 42}, "an answer must be"),
        ({"arguments": {}}, 'needs a string "name"'),
        ({"name": "calculator", "arguments": "2+3"}, "must be a JSON object"),
        ("finish", "must be a dict"),
    ],
)
def test_check_action(action, problem):
    got = check_action(action)
    assert got is None if problem is None else problem in got


def test_a_plan_that_ends_early_or_answers_wrong_is_not_verified(calculator, renderer):
    tasks = calculator.sample("train", 3, seed=1)
    right = calculator.demonstration(tasks[0], random.Random(0))
    wrong = [right[0], {"answer": f"<answer>{tasks[1].answer + 1}</answer>"}]
    short = [{"name": "calculator", "arguments": {"expression": tasks[2].expression}}]
    t_right, t_wrong, t_short = play_plans(calculator, tasks, [right, wrong, short], renderer)
    assert verified(t_right) and t_right.reward_components["accuracy"] == 1.0
    assert t_wrong.outcome == "finished" and t_wrong.verifier_score == 0.0 and not verified(t_wrong)
    assert t_short.outcome == "truncated" and t_short.truncation_reason == PLAN_ENDED and not verified(t_short)


def test_bucketed_batches_cover_each_row_once_per_epoch_with_similar_lengths():
    lengths = [random.Random(i).randint(50, 500) for i in range(1000)]
    batches = _bucketed_batches(lengths, 32, torch.Generator().manual_seed(0))
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(1000))
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches) / len(batches)
    assert spread < 100  # random batches would spread ~420 tokens


def test_bundled_checkpoint_is_the_default_warm_start():
    # `consequence train` with defaults must use the shipped checkpoint, never rebuild it.
    from consequence.config import TrainConfig
    from consequence.distill.warmstart import BUNDLED, WarmstartConfig, _built_with

    d = TrainConfig()
    cfg = WarmstartConfig(seed=d.split_seed, n_demos=d.warmstart_demos, sft_epochs=d.warmstart_epochs)
    assert cfg == WarmstartConfig()
    assert _built_with(BUNDLED, cfg), "rebuild the bundle: consequence warmstart --bundle"

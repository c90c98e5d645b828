"""`--env reasoning-gym`: R1-Zero answer extraction and format, rewards equal to the
generator's own scorer (hand-computed for the exact-match scorer), the problem-level split
(repeated questions never straddle splits), option checks before any work, episodes
through the real runner and reward box, and `consequence train` / `consequence eval` on it."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import reasoning_gym

from cli_args import ONE_TINY_ITERATION
from consequence.envs.reasoning_gym.env import SYSTEM_PROMPT, ReasoningGymEnvironment, extract_answer, follows_format
from consequence.envs.registry import load_environment


def _env(**options) -> ReasoningGymEnvironment:
    return load_environment("reasoning-gym", options.pop("split_seed", 0), options)


@pytest.fixture(scope="module")
def weighted():
    """basic_arithmetic (the base class's scorer: exact match 1, partial credit len(ref)/len(answer))."""
    return load_environment("reasoning-gym", 0, {"size": 40, "format_weight": 0.5})


def _step(env, task, reply):
    ep = env.make_episode(task)
    obs, info = ep.reset(seed=0)
    assert (obs, info["problem_id"]) == (task.question, task.problem_id)
    _, reward, terminated, truncated, info = ep.step({"answer": reply})
    assert (terminated, truncated) == (True, False)
    assert reward == pytest.approx(sum(info["reward_components"].values()))
    return reward, info["reward_components"], ep.code


def test_extraction_and_format_by_hand():
    assert extract_answer("<think>5-3=2</think>\n<answer> -4 </answer>") == "-4"
    assert extract_answer("<answer>1</answer> wait <answer>2</answer>") == "2"  # the last one wins
    assert extract_answer("<answer>1<answer>2</answer>") == "2"  # innermost when a tag is reopened
    assert extract_answer("-4") is None and extract_answer("<answer>-4") is None
    assert extract_answer("<answer>  \n</answer>") is None
    assert follows_format("  <think>\nx\n</think>\n\n<answer>\n7\n</answer>\n")
    assert not follows_format("<answer>7</answer>")  # no thought
    assert not follows_format("<think>x</think><answer>7</answer> and more")  # text after the answer
    assert not follows_format("<think>x</think><answer>6</answer><answer>7</answer>")  # two answers
    assert not follows_format("<think>x<answer>6</answer></think><answer>7</answer>")  # tag inside the thought
    assert not follows_format("<think>x</think><answer> </answer>")  # blank answer


def test_declarations_follow_format_weight(weighted):
    plain = _env(size=10)
    assert (plain.reward_components, plain.reward_range) == (("accuracy",), (0.0, 1.0))
    assert (weighted.reward_components, weighted.reward_range) == (("accuracy", "format"), (0.0, 1.5))
    assert (weighted.tools, weighted.answer_ends_episode, weighted.system_prompt) == ([], True, SYSTEM_PROMPT)
    assert "<think>" in SYSTEM_PROMPT and "<answer>" in SYSTEM_PROMPT
    assert plain.label == "reasoning-gym:basic_arithmetic{} size=10 reasoning_gym==0.1.25"
    assert (
        _env(size=10, config={"max_terms": 3, "min_terms": 2}).label
        == 'reasoning-gym:basic_arithmetic{"max_terms":3,"min_terms":2} size=10 reasoning_gym==0.1.25'
    )


def test_rewards_by_hand(weighted):
    task = weighted.split["train"][0]
    ref = task.answer
    assert ref == task.entry["answer"] and re.fullmatch(r"-?\d+(\.\d+)?", ref)
    assert _step(weighted, task, f"<think>work</think>\n<answer>{ref}</answer>") == (
        1.5,
        {"accuracy": 1.0, "format": 0.5},
        ref,
    )
    assert _step(weighted, task, "<think>work</think><answer>no idea</answer>") == (
        0.5,
        {"accuracy": 0.0, "format": 0.5},
        "no idea",
    )
    # the base scorer's partial credit, passed through: len(ref) / len(answer)
    r, parts, _ = _step(weighted, task, f"<think>w</think><answer>{ref} apples</answer>")
    assert parts == {"accuracy": pytest.approx(len(ref) / (len(ref) + 7)), "format": 0.5}
    # no <answer> tag: 0 although the bare text is the reference
    assert _step(weighted, task, ref) == (0.0, {"accuracy": 0.0, "format": 0.0}, None)
    assert _step(weighted, task, f"<think>{ref}</think>") == (0.0, {"accuracy": 0.0, "format": 0.0}, None)
    # the last <answer> wins (two answers: not the format)
    assert _step(weighted, task, f"<answer>no</answer><answer>{ref}</answer>") == (
        1.0,
        {"accuracy": 1.0, "format": 0.0},
        ref,
    )
    assert _step(weighted, task, f"<answer>{ref}</answer><answer>no</answer>") == (
        0.0,
        {"accuracy": 0.0, "format": 0.0},
        "no",
    )
    with pytest.raises(ValueError, match="not a tool call"):
        weighted.make_episode(task).step({"name": "finish", "arguments": {}})


def test_missing_answer_is_zero_even_where_the_scorer_gives_credit():
    env = _env(dataset="countdown", size=10)
    task = env.split["train"][0]
    assert env.generator.score_answer(None, task.entry) == 0.01  # the premise: countdown pays for nothing
    assert _step(env, task, "I give up") == (0.0, {"accuracy": 0.0}, None)
    good = task.entry["answer"]
    assert env.generator.score_answer(good, task.entry) == 1.0
    assert _step(env, task, f"<think>t</think><answer>{good}</answer>") == (1.0, {"accuracy": 1.0}, good)


def test_split_by_problem_and_seed():
    env = _env()
    sizes = {k: len(v) for k, v in env.split.items()}
    assert sizes == {"train": 400, "validation": 50, "test": 50}  # 500 distinct questions, 80 / 10 / 10
    ids = env.problem_ids()
    assert (
        not set(ids["train"]) & set(ids["validation"])
        and not set(ids["train"]) & set(ids["test"])
        and not set(ids["validation"]) & set(ids["test"])
    )
    again, other = _env(), _env(split_seed=1)
    assert again.problem_ids() == ids
    assert other.problem_ids() != ids
    assert sorted(sum(other.problem_ids().values(), [])) == sorted(sum(ids.values(), []))  # same problems
    # the items are the generator's own
    ds = reasoning_gym.create_dataset("basic_arithmetic", size=500, seed=0)
    t = env.split["test"][0]
    assert (t.question, t.answer) == (ds[t.index]["question"], ds[t.index]["answer"])


def test_repeated_questions_are_one_problem_in_one_split():
    ds = reasoning_gym.create_dataset("tower_of_hanoi", size=500, seed=0)
    questions = [ds[i]["question"] for i in range(500)]
    distinct = set(questions)
    assert len(distinct) == 89  # the premise: the default settings repeat questions
    env = _env(dataset="tower_of_hanoi")
    tasks = [t for v in env.split.values() for t in v]
    assert sorted(t.question for t in tasks) == sorted(distinct)  # each question once
    assert [t.index for t in tasks if t.question == questions[0]] == [0]  # its first index
    assert len({t.task_id for t in tasks}) == len({t.problem_id for t in tasks}) == 89
    in_split = {s: {t.question for t in v} for s, v in env.split.items()}
    assert not in_split["train"] & in_split["test"] and not in_split["train"] & in_split["validation"]
    drawn = env.sample("train", 150, seed=3)  # cycles the 71 train problems, unique task ids
    assert len({t.task_id for t in drawn}) == 150 and {t.problem_id for t in drawn} == set(env.problem_ids()["train"])


def test_problems_whose_answer_is_in_the_question_can_be_left_out():
    """word_sorting with 3 words: an input already in order holds its own answer, so a policy
    that repeats the words wins there (the SmolLM2 run did). The option drops exactly those."""
    cfg = {"min_words": 3, "max_words": 3, "min_word_length": 3, "max_word_length": 6}
    ds = reasoning_gym.create_dataset("word_sorting", size=300, seed=0, **cfg)
    sorted_in = {ds[i]["question"] for i in range(300) if ds[i]["answer"] in ds[i]["question"]}
    plain = _env(dataset="word_sorting", config=cfg, size=300)
    kept = _env(dataset="word_sorting", config=cfg, size=300, drop_answer_in_question=True)
    n = lambda env: sum(len(v) for v in env.split.values()) + len(env.examples)  # noqa: E731
    assert 30 < len(sorted_in) < 80  # about 1 in 6 orders of 3 words is the sorted one (either way)
    assert n(plain) - n(kept) == len(sorted_in) == kept.describe()["dropped_answer_in_question"]
    assert not any(t.question in sorted_in for v in kept.split.values() for t in v)
    assert "drop_answer_in_question" in kept.label and "drop_answer_in_question" not in plain.label


@pytest.mark.parametrize(
    "options, option, fix",
    [
        ({"dataset": "basic_arithmetc"}, "dataset 'basic_arithmetc'", "valid: ab, acre"),
        ({"config": {"max_term": 3}}, "no setting 'max_term'", "its settings are min_terms, max_terms"),
        ({"config": {"min_terms": 5, "max_terms": 2}}, "option config", "max_terms must be >= min_terms"),
        ({"config": {"size": 10}}, "key 'size'", "size=N"),
        ({"config": {"seed": 1}}, "key 'seed'", "fixed"),
        ({"config": [1, 2]}, "option config must be a mapping", "config={"),
        ({"format_weight": -0.5}, "option format_weight", ">= 0"),
        ({"format_weight": float("nan")}, "option format_weight", ">= 0"),
        ({"size": 0}, "option size", "positive integer"),
        ({"size": 2.5}, "option size", "positive integer"),
        ({"shots": -1}, "option shots", "integer >= 0"),
        ({"shots": True}, "option shots", "integer >= 0"),
        ({"difficulty": 3}, "unknown option 'difficulty'", "dataset, config, size, format_weight"),
        ({"drop_answer_in_question": "yes"}, "option drop_answer_in_question", "true or false"),
    ],
)
def test_bad_options_are_refused_before_any_work(options, option, fix, monkeypatch):
    monkeypatch.setattr(
        ReasoningGymEnvironment,
        "load_splits",
        lambda self, seed: pytest.fail("generated problems before checking the options"),
    )
    with pytest.raises(ValueError) as err:
        load_environment("reasoning-gym", 0, options)
    assert option in str(err.value) and fix in str(err.value)


def test_episodes_through_the_runner_and_reward_box(tiny_tokenizer):
    from consequence.harness.renderer import Renderer
    from consequence.reward.scoring import score_trajectories
    from consequence.rollout.episodes import Budgets, EpisodeSpec, run_episodes

    env = load_environment("reasoning-gym", 0, {"size": 40, "format_weight": 0.25})  # the base scorer
    renderer = Renderer(tiny_tokenizer, env.tools)
    tasks = env.sample("test", 4, seed=0)
    replies = [
        f"<think>add</think>\n<answer>{tasks[0].answer}</answer>",  # right, formatted
        "<answer>none</answer>",  # wrong, no thought
        f"{tasks[2].answer}",  # no tag
        f"<think>a</think><answer>x {tasks[3].answer}</answer>",
    ]  # partial credit
    ids = [renderer.encode(r) + [renderer.eot_id] for r in replies]
    seen = []

    def generate(prompts, max_new_tokens, idx):
        seen.extend(prompts)
        return [SimpleNamespace(output_ids=ids[i], logprobs=[-0.5] * len(ids[i]), stop_reason="stop") for i in idx]

    specs = [EpisodeSpec(env.make_episode(t), t.task_id, f"g{i}", 0, i) for i, t in enumerate(tasks)]
    trajs = run_episodes(generate, renderer, specs, Budgets(max_turns=1, max_new_tokens=64), env.system_prompt)
    score_trajectories(trajs, components=env.reward_components, reward_range=env.reward_range)
    assert len(seen) == 4 and renderer.tokenizer.decode(seen[0]).count(tasks[0].question) == 1
    ds = env.generator
    for t, task, reply in zip(trajs, tasks, replies):
        extracted = extract_answer(reply)
        accuracy = 0.0 if extracted is None else ds.score_answer(extracted, task.entry)
        fmt = 0.25 * follows_format(reply)
        assert (t.outcome, t.error) == ("finished", None)
        assert t.reward_components == {"accuracy": pytest.approx(accuracy), "format": fmt}
        assert t.reward == pytest.approx(accuracy + fmt) and t.verifier_score == pytest.approx(accuracy)
        assert t.final_code == extracted and t.messages[0] == {"role": "system", "content": SYSTEM_PROMPT}
    assert [t.reward_components["accuracy"] for t in trajs[:3]] == [1.0, 0.0, 0.0]
    assert [t.reward_components["format"] for t in trajs] == [0.25, 0.0, 0.0, 0.25]
    ref = tasks[3].answer  # partial credit of the base scorer: len(ref) / len(answer)
    assert trajs[3].reward_components["accuracy"] == pytest.approx(len(ref) / (len(ref) + 2))


def test_worked_examples_are_train_problems_shown_as_earlier_turns(tiny_tokenizer):
    """shots=2: the first two train problems, answered in the R1-Zero format, open every
    episode after the system prompt; they leave the train split; context only."""
    from consequence.harness.renderer import Renderer
    from consequence.rollout.episodes import Budgets, EpisodeSpec, run_episodes

    plain, shot = _env(size=40), _env(size=40, shots=2)
    first = plain.split["train"][:2]
    assert shot.examples == tuple(
        (t.question, f"<think>I work it out, then give only the final answer.</think> <answer>{t.answer}</answer>")
        for t in first
    )
    assert [t.problem_id for t in shot.split["train"]] == [t.problem_id for t in plain.split["train"][2:]]
    assert shot.problem_ids()["test"] == plain.problem_ids()["test"]
    assert shot.problem_ids()["validation"] == plain.problem_ids()["validation"]
    assert shot.describe()["examples"] == [list(x) for x in shot.examples] and plain.examples == ()
    renderer = Renderer(tiny_tokenizer, shot.tools)
    task = shot.sample("test", 1, seed=0)[0]
    reply = renderer.encode(f"<answer>{task.answer}</answer>") + [renderer.eot_id]

    def generate(prompts, max_new_tokens, idx):
        return [SimpleNamespace(output_ids=reply, logprobs=[-0.5] * len(reply), stop_reason="stop") for _ in idx]

    spec = EpisodeSpec(shot.make_episode(task), task.task_id, "g", 0, 0)
    (traj,) = run_episodes(
        generate, renderer, [spec], Budgets(max_turns=1, max_new_tokens=64), shot.system_prompt, examples=shot.examples
    )
    assert [(m["role"], m["content"]) for m in traj.messages[:6]] == [
        ("system", SYSTEM_PROMPT),
        ("user", first[0].question),
        ("assistant", shot.examples[0][1]),
        ("user", first[1].question),
        ("assistant", shot.examples[1][1]),
        ("user", task.question),
    ]
    call = traj.calls[0]
    assert call.context_ids == renderer.prompt_ids(traj.messages[:6]) and call.output_ids == reply
    with pytest.raises(ValueError, match="shots=3 would take every one of the 3 train problems"):
        _env(size=4, shots=3)


@pytest.mark.slow
def test_train_and_eval_cli(tmp_path):
    from typer.testing import CliRunner

    from consequence.cli import app
    from consequence.records import read_trajectories

    run, out = tmp_path / "run", tmp_path / "eval"
    res = CliRunner().invoke(
        app,
        [
            "train",
            "--env",
            "reasoning-gym",
            "--env-option",
            "dataset=basic_arithmetic",
            *ONE_TINY_ITERATION,
            "--max-turns",
            "1",
            "--max-new-tokens",
            "16",
            "--run-dir",
            str(run),
        ],
        env={"COLUMNS": "250"},
    )
    assert res.exit_code == 0, res.output + repr(res.exception)
    env = json.loads((run / "manifest.json").read_text())["environment"]
    assert (env["name"], env["version"], env["options"]) == ("reasoning-gym", "1", {"dataset": "basic_arithmetic"})
    assert re.fullmatch(r"[0-9a-f]{64}", env["source_sha256"])
    assert env["reward_components"] == ["accuracy"] and env["label"].startswith("reasoning-gym:basic_arithmetic{}")
    trajs = read_trajectories(run / "trajectories" / "iter_0000.parquet")
    assert len(trajs) == 4 and all(set(t.reward_components) == {"accuracy"} for t in trajs)
    assert all(t.task_id.startswith("basic_arithmetic/") for t in trajs)
    res = CliRunner().invoke(
        app,
        ["eval", "--model", str(run), "-n", "1", "-k", "1", "--problems", "2", "--no-recovery", "--out", str(out)],
        env={"COLUMNS": "250"},
    )
    assert res.exit_code == 0, res.output + repr(res.exception)
    settings = json.loads((out / "eval.json").read_text())["settings"]
    assert settings["environment"]["name"] == "reasoning-gym"
    assert settings["environment"]["options"] == {"dataset": "basic_arithmetic"}
    assert settings["tasks"] == env["label"]

"""Cold start from any demonstrations (issue 33): a file of demonstrations (our trajectories
Parquet, or OpenAI-style messages JSONL) is replayed through fresh episodes of its tasks in the
student's tokens, and only what the environment's reward verifies is kept; rejections are
counted by reason. The environment demonstrators' side is in tests/envs/test_*_demonstrator.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from consequence.cli import app
from consequence.distill.demonstrations import (
    collect_demonstrations,
    file_demo_set,
    plan_from_messages,
    read_demonstration_file,
)
from consequence.distill.warmstart import WarmstartConfig, teacher_demo_set
from consequence.envs.registry import load_environment
from consequence.harness.renderer import Renderer
from consequence.policy.tiny import BUNDLED
from consequence.records import read_trajectories, write_trajectories

QUIET = {"log": lambda _: None}


@pytest.fixture(scope="module")
def repair():
    return load_environment("repair", 0)


def _openai(question: str, expression: str, answer: str, observation: str = "999", text: str = "") -> list[dict]:
    """A calculator conversation in the OpenAI chat shape (arguments as a JSON string)."""
    call = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}  # fmt: skip
    return [
        {"role": "system", "content": "You are a careful calculator user."},
        {"role": "user", "content": question},
        {"role": "assistant", "content": text or None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": observation},  # never read: the env makes its own
        {"role": "assistant", "content": f"<answer>{answer}</answer>"},
    ]


@pytest.fixture(scope="module")
def calc_file(tmp_path_factory, calc):
    train, held_out = calc.split["train"], calc.split["validation"]
    a, b, c = train[0], train[1], train[2]
    bad_args = _openai(c.question, c.expression, str(c.answer))
    bad_args[2]["tool_calls"][0]["function"]["arguments"] = '{"expression": 2 +'
    lines = [
        {"task_id": a.task_id, "messages": _openai(a.question, a.expression, str(a.answer))},  # right
        {"task_id": b.task_id, "messages": _openai(b.question, b.expression, str(b.answer + 1))},  # wrong answer
        {"task_id": "calc-nope-0001", "messages": _openai(a.question, a.expression, str(a.answer))},  # unknown task
        {"task_id": c.task_id, "messages": bad_args},  # unparsable arguments
        {"task_id": held_out[0].task_id, "messages": _openai("?", held_out[0].expression, str(held_out[0].answer))},
        "{not json",
        {"messages": _openai(a.question, a.expression, str(a.answer))},  # no task_id
        # an instance id (ID#seed-k) and text before the call: right
        {"task_id": f"{c.task_id}#7-0", "messages": _openai(c.question, c.expression, str(c.answer), text="Compute.")},
        {"task_id": b.task_id, "messages": _openai(b.question, b.expression, str(b.answer))[:4]},  # no answer
        {"task_id": b.task_id, "messages": [{"role": "user", "content": b.question}]},  # no assistant turn
    ]
    path = tmp_path_factory.mktemp("demos") / "calc.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n\n")
    return path


def test_a_jsonl_file_keeps_the_verified_and_counts_the_rest_by_reason(calc_file, calc, tokenizer):
    demos = file_demo_set(calc_file, calc, Renderer(tokenizer, calc.tools), **QUIET)
    assert [t.task_id for t in demos.kept] == [calc.split["train"][0].task_id, f"{calc.split['train'][2].task_id}#7-0"]
    assert dict(demos.rejected) == {
        "not_verified": 1,
        "unknown_task": 1,
        "unparsable_tool_call": 1,
        "not_train_split": 1,
        "unparsable_row": 2,
        "unfinished": 1,
        "no_actions": 1,
    }
    record = demos.record()
    assert (record["kind"], record["episodes"], record["verified"], record["acceptance_rate"]) == ("file", 10, 2, 0.2)
    assert record["first_rejection"]["unknown_task"].endswith("calc.jsonl:3: task 'calc-nope-0001' is no task of --env calculator")  # fmt: skip
    for t in demos.kept:
        assert t.outcome == "finished" and t.verifier_score == 1.0 and t.sample_id == 0
        # the file's observation (999) and system prompt are not trusted: the environment's are used
        task = calc.find_task(t.task_id)[1]
        assert t.messages[0]["content"] == calc.system_prompt and t.messages[1]["content"] == task.question
        assert t.messages[3]["content"] == str(task.answer)
    assert demos.kept[1].messages[2]["content"] == "Compute."  # the turn's text before its call is kept


def test_the_replayed_tokens_are_the_students_rendering_of_the_messages(calc_file, calc, tokenizer):
    """Re-rendering equality: the episode's token stream is the student's chat template's own
    rendering of the conversation (up to the last end-of-turn), the first context its prompt."""
    renderer = Renderer(tokenizer, calc.tools)
    for t in file_demo_set(calc_file, calc, renderer, **QUIET).kept:
        last = max(i for i, m in enumerate(t.messages) if m["role"] == "assistant")
        text = renderer.render_text(t.messages[: last + 1], add_generation_prompt=False)
        text = text[: text.rindex(renderer.end_of_turn) + len(renderer.end_of_turn)]
        assert t.calls[-1].context_ids + t.calls[-1].output_ids == renderer.encode(text)
        assert t.calls[0].context_ids == renderer.prompt_ids(t.messages[:2])
        assert all(c.sample_logprobs == [0.0] * len(c.output_ids) for c in t.calls)


def test_a_parquet_file_is_replayed_and_verified_too(tmp_path, repair, tokenizer):
    """Our own trajectories (here the repair demonstrator's, in the student's tokens) replay to the
    same tokens; a wrong one, one of no task and one of the validation split are refused."""
    renderer = Renderer(tokenizer, repair.tools)
    own = teacher_demo_set(WarmstartConfig(n_demos=3), QUIET["log"], repair, draw_seed=1000, renderer=renderer).kept
    assert len(own) == 3
    fix = max(i for i, m in enumerate(own[0].messages) if m["role"] == "assistant" and m["tool_calls"][0]["function"]["name"] == "replace_line")  # fmt: skip
    unfixed = dataclasses.replace(own[0], messages=own[0].messages[:fix] + own[0].messages[fix + 2 :])
    nowhere = dataclasses.replace(own[1], task_id="no-such-problem#1-0")
    held_out = dataclasses.replace(own[2], task_id=repair.sample("validation", 1, seed=5)[0].task_id)
    path = tmp_path / "demos.parquet"
    write_trajectories(path, own + [unfixed, nowhere, held_out])
    demos = file_demo_set(path, repair, renderer, **QUIET)
    assert dict(demos.rejected) == {"not_verified": 1, "unknown_task": 1, "not_train_split": 1}
    assert [t.task_id for t in demos.kept] == [t.task_id for t in own]
    for a, b in zip(own, demos.kept):
        assert [(c.context_ids, c.output_ids, c.observation_ids) for c in a.calls] == [
            (c.context_ids, c.output_ids, c.observation_ids) for c in b.calls
        ]
        assert b.reward_components == {"hidden_tests": 1.0}


def test_plan_from_messages_reads_the_assistant_turns_only():
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q0"},
        {"role": "assistant", "content": "a0"},  # a worked example of the environment: opening
        {"role": "user", "content": "request"},
        {"role": "assistant", "content": [{"type": "text", "text": "thinking"}], "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}},
            {"type": "function", "function": {"name": "g", "arguments": {}}},
        ]},
        {"role": "tool", "content": "r1"},
        {"role": "tool", "content": "r2"},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "correct"},
    ]  # fmt: skip
    plan, problem = plan_from_messages(msgs, examples=(("q0", "a0"),))
    assert problem is None
    assert plan == [
        [{"answer": "thinking"}, {"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}],
        {"answer": "done"},
    ]
    # without the examples the first user message is the request and "a0" a turn of the plan
    assert plan_from_messages(msgs)[0][0] == {"answer": "a0"}
    assert plan_from_messages([{"role": "assistant", "content": "x"}])[1][0] == "unparsable_row"
    assert plan_from_messages(msgs[:4] + [{"role": "function", "content": "x"}])[1][0] == "unparsable_row"


@pytest.mark.parametrize(
    "name,text,match",
    [
        ("missing.jsonl", None, "no such file"),
        ("demos.txt", "{}", "unknown format '.txt'"),
        ("empty.jsonl", "\n\n", "holds no demonstration"),
        ("bad.parquet", "not parquet", "not a trajectories parquet file"),
    ],
)
def test_a_bad_file_is_one_clear_error(tmp_path, name, text, match):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match=match):
        read_demonstration_file(path)
    with pytest.raises(ValueError, match="is a folder"):
        read_demonstration_file(tmp_path)


def test_the_sources_are_exclusive_and_nothing_verified_is_an_error(tmp_path, calc, tokenizer):
    renderer = Renderer(tokenizer, calc.tools)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"task_id": "calc-nope", "messages": []}) + "\n")
    with pytest.raises(ValueError, match="give one source"):
        collect_demonstrations(calc, renderer, demos_file=bad, episodes=4, **QUIET)
    with pytest.raises(ValueError, match=r"none of the 1 demonstrations .* unparsable_row 1"):
        collect_demonstrations(calc, renderer, demos_file=bad, **QUIET)
    humaneval = load_environment("humaneval", 0)
    with pytest.raises(ValueError, match=r"--env humaneval: this environment has no demonstrator .* --demos-file"):
        collect_demonstrations(humaneval, Renderer(tokenizer, humaneval.tools), episodes=2, **QUIET)


def test_demos_cli_from_a_file(tmp_path, calc_file):
    out = tmp_path / "out" / "demos.parquet"
    res = CliRunner().invoke(
        app, ["demos", "--from", str(calc_file), "--env", "calculator", "--out", str(out)], env={"COLUMNS": "200"}
    )
    assert res.exit_code == 0, res.output
    assert "2/10 demonstrations verified (acceptance rate 20.0%)" in res.output and "unknown_task" in res.output
    assert [t.verifier_score for t in read_trajectories(out)] == [1.0, 1.0]


@pytest.mark.parametrize(
    "args,match",
    [
        (["--from", "missing.jsonl", "--env", "calculator"], "--from missing.jsonl: no such file"),
        (["--from", "FILE", "--env", "calculator", "-n", "4"], "--from replays the demonstrations of a file"),
        (["--from", "FILE", "--env", "repair"], "none of the 10 demonstrations"),
        (["--env", "humaneval"], "no demonstrator"),
    ],
)
def test_demos_cli_refuses_with_one_error_line_and_writes_nothing(tmp_path, calc_file, args, match):
    out = tmp_path / "d.parquet"
    args = [str(calc_file) if a == "FILE" else a for a in args]
    res = CliRunner().invoke(app, ["demos", "--out", str(out), *args], env={"COLUMNS": "400"})
    assert res.exit_code == 2, res.output
    assert "error:" in res.output and match in " ".join(res.output.split()) and "Traceback" not in res.output
    assert not out.exists()


def test_sft_cli_refuses_a_bad_demos_file_before_any_work(tmp_path, calc_file):
    out = tmp_path / "sft"
    for args, match in (
        (["--demos-file", str(tmp_path / "none.jsonl")], "no such file"),
        (["--demos-file", str(calc_file), "--demos", "3"], "give one"),
    ):
        res = CliRunner().invoke(
            app,
            ["sft", "--model", str(BUNDLED), "--env", "calculator", "--out", str(out), *args],
            env={"COLUMNS": "400"},
        )
        assert res.exit_code == 2 and "error:" in res.output and match in res.output, res.output
        assert not out.exists()


def test_sft_from_a_jsonl_file_records_the_acceptance_rate(tmp_path, calc_file):
    out = tmp_path / "sft"
    res = CliRunner().invoke(
        app,
        ["sft", "--model", str(BUNDLED), "--env", "calculator", "--demos-file", str(calc_file), "--epochs", "1",
         "--rows-per-step", "2", "--micro-batch-size", "2", "--lora-rank", "4", "--out", str(out)],
        env={"COLUMNS": "200"},
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    rec = json.loads((out / "sft.json").read_text())
    assert (rec["teacher"]["kind"], rec["teacher"]["verified"], rec["teacher"]["episodes"]) == ("file", 2, 10)
    assert rec["teacher"]["acceptance_rate"] == 0.2 and rec["teacher"]["rejected"]["unknown_task"] == 1
    assert rec["rows"] == 2 and rec["settings"]["demos_file"] == str(calc_file) and rec["settings"]["demos"] is None


def test_a_throw_away_tokenizers_episodes_re_render_as_the_students_own(calc, tokenizer):
    """The warm start plays the demonstrator with a throw-away tokenizer, then re-renders the
    messages for the student (replay_conversation: a reply ended by the environment's answer
    to it included): the same tokens as playing them in the student's tokens directly."""
    from consequence.distill.warmstart import demo_trajectories
    from consequence.rollout.episodes import opening_messages

    renderer = Renderer(tokenizer, calc.tools)
    cfg = WarmstartConfig(n_demos=5)
    boot = teacher_demo_set(cfg, QUIET["log"], calc).kept
    direct = teacher_demo_set(cfg, QUIET["log"], calc, renderer=renderer).kept
    opening = len(opening_messages(calc.system_prompt, "", calc.examples))
    replayed = demo_trajectories(renderer, boot, opening)
    assert len(replayed) == len(direct) == 5
    for a, b in zip(replayed, direct):
        assert a.messages == b.messages
        assert [(c.context_ids, c.output_ids, c.observation_ids) for c in a.calls] == [
            (c.context_ids, c.output_ids, c.observation_ids) for c in b.calls
        ]


def test_a_solved_episode_with_a_refused_tool_call_is_not_kept(tmp_path, calc, tokenizer):
    d = calc.split["train"][3]
    messages = _openai(d.question, d.expression, str(d.answer))
    rm = {"id": "c0", "type": "function", "function": {"name": "rm_rf", "arguments": "{}"}}
    messages[2:2] = [{"role": "assistant", "content": None, "tool_calls": [rm]}, {"role": "tool", "content": "x"}]
    right = {"task_id": d.task_id, "messages": _openai(d.question, d.expression, str(d.answer))}
    path = tmp_path / "refused.jsonl"
    path.write_text(json.dumps({"task_id": d.task_id, "messages": messages}) + "\n" + json.dumps(right) + "\n")
    demos = file_demo_set(path, calc, Renderer(tokenizer, calc.tools), **QUIET)
    # the first is solved (right answer) but taught a call to an unknown tool: SFT must not copy it
    assert (len(demos.kept), dict(demos.rejected)) == (1, {"invalid_tool_call": 1})
    assert demos.kept[0].calls[0].tool_calls[0]["name"] == "calculator"


def test_a_jsonl_file_with_a_byte_order_mark_and_a_developer_message_is_read(tmp_path, calc, tokenizer):
    """A UTF-8 BOM before the first line, and "developer" (the OpenAI chat format's newer name
    of "system") before the request: read as a plain file with a system message."""
    a = calc.split["train"][0]
    messages = _openai(a.question, a.expression, str(a.answer))
    messages[0]["role"] = "developer"
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (json.dumps({"task_id": a.task_id, "messages": messages}) + "\n").encode())
    assert [(r.task_id, r.problem) for r in read_demonstration_file(path)] == [(a.task_id, None)]
    assert plan_from_messages(messages) == (
        [{"name": "calculator", "arguments": {"expression": a.expression}}, {"answer": f"<answer>{a.answer}</answer>"}],
        None,
    )
    demos = file_demo_set(path, calc, Renderer(tokenizer, calc.tools), **QUIET)
    assert (len(demos.kept), demos.total, dict(demos.rejected)) == (1, 1, {})
    messages[0]["role"] = "narrator"  # another role before the request is still refused (negative control)
    assert plan_from_messages(messages)[1] == (
        "unparsable_row",
        "no user message (the request) before the assistant turns",
    )


def test_sft_refuses_to_write_over_its_student_and_records_absolute_paths(tmp_path, monkeypatch, calc_file):
    """--out the student's own folder (or one holding it) would replace it while SFT reads it:
    refused before any work. sft.json records the student and the demonstration file absolute."""
    import os
    import shutil

    student = tmp_path / "student"
    shutil.copytree(BUNDLED, student)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in student.iterdir())
    monkeypatch.chdir(tmp_path)
    demos = os.path.relpath(calc_file, tmp_path)
    base = ["sft", "--model", "student", "--env", "calculator", "--demos-file", demos, "--lora-rank", "4"]
    for out in ("student", "student/", "."):  # the student itself, or a folder that holds it
        res = CliRunner().invoke(app, [*base, "--out", out], env={"COLUMNS": "400"})
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
        assert (
            f"error: --out {out.rstrip('/') or out}: is the student's folder (--model student) or holds it"
            in res.output
        )
    assert sorted((p.name, p.stat().st_mtime_ns) for p in student.iterdir()) == before  # untouched
    res = CliRunner().invoke(
        app, [*base, "--epochs", "1", "--rows-per-step", "2", "--micro-batch-size", "2", "--out", "sft"]
    )
    assert res.exit_code == 0, res.output
    rec = json.loads((tmp_path / "sft" / "sft.json").read_text())
    assert rec["student"] == str(student.resolve()) and rec["settings"]["demos_file"] == str(calc_file.resolve())

"""Demonstrations from a teacher behind an OpenAI-compatible URL (issue 33, the third source):
a tiny fake OpenAI server on 127.0.0.1 plays the calculator demonstrator's answers for some
tasks and fails in every other way for the rest; the transcripts are verified as a file's rows
are, the failures counted by reason, the cost summed from the replies' usage. Loopback only."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from typer.testing import CliRunner

from consequence.cli import app
from consequence.distill.demonstrations import REASONS, collect_demonstrations
from consequence.distill.teacher_url import (
    TeacherEndpoint,
    probe_teacher,
    teacher_base_url,
    teacher_url_demo_set,
)
from consequence.envs.registry import load_environment
from consequence.harness.renderer import Renderer
from consequence.policy.tiny import BUNDLED, load_policy
from consequence.records import read_trajectories

QUIET = {"log": lambda _: None}
DRAW = 5
WIDE = {"COLUMNS": "400"}


class FakeTeacher:
    """An OpenAI-compatible server (GET /v1/models, POST /v1/chat/completions) on a free
    loopback port that plays the calculator demonstrator: a tool call on the task's
    expression, then ``<answer>VALUE</answer>``, or fails as ``modes[question]`` says.

    Modes: ``right``; ``wrong`` (answers value + 1); ``bad_args`` (tool-call arguments that
    are not JSON); ``http500``; ``garbage`` (a 200 whose body is not JSON); ``slow`` (right,
    after ``slow_s`` seconds); ``cut`` (finish_reason length); ``no_usage`` (right, no usage);
    ``empty`` (a message with neither content nor tool calls); ``unauthorized`` (a 401).
    Usage of turn k (from 0): 100·(k + 1) prompt tokens, 10 completion tokens. With ``key``,
    GET /v1/models answers 401 unless the request carries ``Bearer KEY``.
    """

    def __init__(
        self, env, modes: dict[str, str] | None = None, usage: bool = True, slow_s: float = 2.5, key: str | None = None
    ):
        self.tasks = {t.question: t for t in env.split["train"]}
        self.modes, self.usage, self.slow_s, self.key = modes or {}, usage, slow_s, key
        self.requests: list[dict[str, Any]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, status: int, body: Any, raw: bytes | None = None) -> None:
                data = raw if raw is not None else json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
                    pass

            def do_GET(self):
                if fake.key is not None and self.headers.get("Authorization") != f"Bearer {fake.key}":
                    self._send(401, {"error": {"message": "Incorrect API key provided"}})
                elif self.path.rstrip("/") == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": "fake-teacher", "object": "model"}]})
                else:
                    self._send(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append({"headers": dict(self.headers), "body": body})
                msgs = body["messages"]
                question = next(m["content"] for m in msgs if m["role"] == "user")
                task, mode = fake.tasks[question], fake.modes.get(question, "right")
                turn = sum(m["role"] == "assistant" for m in msgs)
                if mode == "http500":
                    return self._send(500, {"error": {"message": "the teacher fell over"}})
                if mode == "garbage":
                    return self._send(200, None, b"<html>gateway error</html>")
                if mode == "unauthorized":
                    return self._send(401, {"error": {"message": "Incorrect API key provided"}})
                if mode == "empty":
                    return self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant"}}]})
                if mode == "slow":
                    time.sleep(fake.slow_s)
                finish = "stop"
                if msgs[-1]["role"] != "tool":
                    args = '{"expression": 2 +' if mode == "bad_args" else json.dumps({"expression": task.expression})
                    call = {"id": f"call_{turn}", "type": "function", "function": {"name": "calculator", "arguments": args}}  # fmt: skip
                    message = {"role": "assistant", "content": None, "tool_calls": [call]}
                    finish = "tool_calls"
                else:
                    value = task.answer + 1 if mode == "wrong" else task.answer
                    message = {"role": "assistant", "content": f"<answer>{value}</answer>"}
                if mode == "cut":
                    message, finish = {"role": "assistant", "content": "<answer>1"}, "length"
                reply: dict[str, Any] = {
                    "id": "chatcmpl-fake",
                    "object": "chat.completion",
                    "model": body["model"],
                    "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                }
                if fake.usage and mode != "no_usage":
                    reply["usage"] = {"prompt_tokens": 100 * (turn + 1), "completion_tokens": 10, "total_tokens": 0}
                self._send(200, reply)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.block_on_close = False  # a sleeping "slow" handler must not hold the test
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeTeacher:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def _dead_url() -> str:
    """A loopback URL where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


MODES = ["right", "right", "wrong", "bad_args", "http500", "garbage", "slow", "cut", "no_usage"]


def test_a_url_teacher_s_episodes_are_verified_and_the_rest_counted_by_reason(calc, tokenizer):
    tasks = calc.sample("train", len(MODES), seed=DRAW + 1)  # the instances the source draws
    assert len({t.question for t in tasks}) == len(MODES)
    lines: list[str] = []
    with FakeTeacher(calc, {t.question: m for t, m in zip(tasks, MODES)}) as fake:
        teacher = TeacherEndpoint(fake.url, timeout_s=1.0, concurrency=3)
        demos = teacher_url_demo_set(
            calc, Renderer(tokenizer, calc.tools), teacher, len(MODES), seed=0, draw_seed=DRAW, log=lines.append
        )
    assert [t.task_id for t in demos.kept] == [tasks[i].task_id for i in (0, 1, 8)]
    assert dict(demos.rejected) == {
        "not_verified": 1,
        "unparsable_tool_call": 1,
        "teacher_http_error": 1,
        "teacher_unparsable_reply": 1,
        "teacher_timeout": 1,
        "teacher_max_tokens": 1,
    }
    assert "HTTP 500: the teacher fell over" in demos.first["teacher_http_error"]
    assert demos.first["teacher_timeout"].startswith(f"teacher episode 6 (task {tasks[6].task_id})")
    record = demos.record()
    assert (record["kind"], record["model"], record["url"], record["episodes"], record["verified"]) == (
        "teacher_url", "fake-teacher", fake.url + "/v1", 9, 3,
    )  # fmt: skip
    assert (record["temperature"], record["max_tokens"], record["draw_seed"], record["api_key_env"]) == (1.0, 1024, DRAW, None)  # fmt: skip
    cost = record["cost"]
    # calls: right 2+2, wrong 2, bad_args 1, http500 1, garbage 1, slow 1, cut 1, no_usage 2
    # usage reported by right ×2, wrong, bad_args, cut: 8 replies (turn 0: 100 prompt tokens, turn 1: 200)
    assert {k: v for k, v in cost.items() if not k.endswith("seconds")} == {
        "attempts": 9,
        "http_calls": 13,
        "replies": 11,  # the 500 and the timed-out call are not replies
        "prompt_tokens": 3 * 300 + 100 + 100,
        "completion_tokens": 8 * 10,
        "calls_without_usage": 3,  # the garbage reply and no_usage's two
        "attempts_per_accepted": 3.0,  # = 1 / acceptance rate
        "completion_tokens_per_accepted": round(80 / 3, 3),
    }
    assert cost["wall_seconds"] >= 1.0 and cost["replay_seconds"] > 0
    assert any("teacher cost: 9 episodes, 13 HTTP calls, 1100 prompt + 80 completion tokens" in x for x in lines)
    # the requests: the environment's opening, its tools, the settings, tool results by call id
    first = next(r["body"] for r in fake.requests if r["body"]["messages"][-1]["content"] == tasks[0].question)
    assert first["messages"] == [{"role": "system", "content": calc.system_prompt}, {"role": "user", "content": tasks[0].question}]  # fmt: skip
    assert (first["model"], first["tools"], first["temperature"], first["max_tokens"]) == ("fake-teacher", calc.tools, 1.0, 1024)  # fmt: skip
    second = next(r["body"] for r in fake.requests if r["body"]["messages"][1]["content"] == tasks[0].question and len(r["body"]["messages"]) > 2)  # fmt: skip
    assert second["messages"][-1] == {"role": "tool", "tool_call_id": "call_0", "content": str(tasks[0].answer)}
    assert second["seed"] != first["seed"]
    for t in demos.kept:  # replayed in the student's tokens by the environment, as a file's rows are
        assert t.outcome == "finished" and t.verifier_score == 1.0
        assert all(c.sample_logprobs == [0.0] * len(c.output_ids) for c in t.calls)


def test_the_url_teacher_is_a_third_source_exclusive_with_a_file(tmp_path, calc, tokenizer):
    renderer = Renderer(tokenizer, calc.tools)
    teacher = TeacherEndpoint("http://127.0.0.1:9")
    with pytest.raises(ValueError, match="two sources"):
        collect_demonstrations(calc, renderer, demos_file=tmp_path / "x.jsonl", teacher=teacher, **QUIET)
    with (
        FakeTeacher(calc, {t.question: "wrong" for t in calc.split["train"]}) as fake,
        pytest.raises(ValueError, match=r"none of the 2 episodes of the teacher .* not_verified 2"),
    ):
        collect_demonstrations(calc, renderer, episodes=2, teacher=TeacherEndpoint(fake.url), **QUIET)


@pytest.mark.parametrize(
    "url,base",
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000/v1"),
        ("http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000/v1"),
        ("https://host/s/abc/v1", "https://host/s/abc/v1"),
        # an endpoint's URL pasted whole: its base
        ("http://127.0.0.1:8000/v1/chat/completions", "http://127.0.0.1:8000/v1"),
        ("http://127.0.0.1:8000/v1/chat/completions/", "http://127.0.0.1:8000/v1"),
        ("https://host/s/abc/v1/models", "https://host/s/abc/v1"),
        ("http://127.0.0.1:8000/chat/completions", "http://127.0.0.1:8000/v1"),
    ],
)
def test_the_base_url_gets_its_v1(url, base):
    assert teacher_base_url(url) == base


def test_probe_names_the_model_and_refuses_what_is_not_a_teacher(calc, monkeypatch):
    with FakeTeacher(calc) as fake:
        assert probe_teacher(TeacherEndpoint(fake.url)).model == "fake-teacher"
        with pytest.raises(ValueError, match=r"--teacher-model big: .* serves 'fake-teacher'"):
            probe_teacher(TeacherEndpoint(fake.url, model="big"))
        with pytest.raises(ValueError, match=r"GET .*/nope/v1/models failed \(HTTP 404"):
            probe_teacher(TeacherEndpoint(fake.url + "/nope"))
        monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
        with pytest.raises(ValueError, match="NO_SUCH_KEY_VAR is not set"):
            probe_teacher(TeacherEndpoint(fake.url, api_key_env="NO_SUCH_KEY_VAR"))
    with pytest.raises(ValueError, match="give an http:// or https:// URL"):
        probe_teacher(TeacherEndpoint("ftp://x"))


def test_a_malformed_reply_and_a_refused_key_are_teacher_failures_not_unfinished(calc, tokenizer):
    """A message with neither content nor tool calls is teacher_unparsable_reply (it used to be
    played as an empty answer: not_verified, or unfinished where answers do not end the
    episode); a 401 names the option that sets the key. The full endpoint URL works."""
    tasks = calc.sample("train", 3, seed=DRAW + 1)
    modes = {tasks[0].question: "empty", tasks[1].question: "unauthorized"}
    with FakeTeacher(calc, modes) as fake:
        teacher = TeacherEndpoint(fake.url + "/v1/chat/completions", concurrency=1)
        demos = teacher_url_demo_set(calc, Renderer(tokenizer, calc.tools), teacher, 3, draw_seed=DRAW, **QUIET)
        assert {r["body"]["model"] for r in fake.requests} == {"fake-teacher"}  # probed at the base
    assert dict(demos.rejected) == {"teacher_unparsable_reply": 1, "teacher_http_error": 1}
    assert [t.task_id for t in demos.kept] == [tasks[2].task_id]  # the right one (negative control)
    assert "the message has neither content nor tool_calls" in demos.first["teacher_unparsable_reply"]
    refused = demos.first["teacher_http_error"]
    assert "HTTP 401: Incorrect API key provided: the server refused the request without an API key" in refused
    assert "--teacher-api-key-env VAR" in refused
    assert demos.record()["url"] == fake.url + "/v1"
    assert (
        "teacher_unparsable_reply" in REASONS
        and "neither content nor tool calls" in REASONS["teacher_unparsable_reply"]
    )


def test_a_refused_api_key_says_so_and_names_the_variable(tmp_path, calc, monkeypatch):
    with FakeTeacher(calc, key="right") as fake:
        with pytest.raises(ValueError, match=r"failed \(HTTP 401: Incorrect API key provided\): the server refused the request without an API key; .*--teacher-api-key-env VAR"):  # fmt: skip
            probe_teacher(TeacherEndpoint(fake.url))
        monkeypatch.setenv("TEACHER_KEY", "wrong")
        with pytest.raises(ValueError, match=r"refused the API key in the environment variable TEACHER_KEY \(--teacher-api-key-env TEACHER_KEY\)"):  # fmt: skip
            probe_teacher(TeacherEndpoint(fake.url, api_key_env="TEACHER_KEY"))
        res = CliRunner().invoke(
            app,
            ["demos", "--env", "calculator", "--teacher-url", fake.url, "--teacher-api-key-env", "TEACHER_KEY",
             "--out", str(tmp_path / "d.parquet")],
            env=WIDE,
        )  # fmt: skip
        assert res.exit_code == 2 and "Traceback" not in res.output and not (tmp_path / "d.parquet").exists()
        assert "the server refused the API key in the environment variable TEACHER_KEY" in " ".join(res.output.split())
        monkeypatch.setenv("TEACHER_KEY", "right")  # the right key: accepted (negative control)
        assert probe_teacher(TeacherEndpoint(fake.url, api_key_env="TEACHER_KEY")).model == "fake-teacher"


def test_demos_cli_with_a_teacher_url_sends_the_key_and_logs_the_cost(tmp_path, calc):
    out = tmp_path / "demos.parquet"
    with FakeTeacher(calc, usage=False) as fake:
        res = CliRunner().invoke(
            app,
            ["demos", "--env", "calculator", "--teacher-url", fake.url, "-n", "3", "--teacher-api-key-env",
             "FAKE_TEACHER_KEY", "--teacher-temperature", "0", "--out", str(out)],
            env=WIDE | {"FAKE_TEACHER_KEY": "sekret"},
        )  # fmt: skip
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "3/3 demonstrations verified (acceptance rate 100.0%)" in text
    assert "tokens not reported (no reply carried usage)" in text and "1 attempts per accepted" in text
    assert "sekret" not in res.output
    assert {r["headers"]["Authorization"] for r in fake.requests} == {"Bearer sekret"}
    assert {r["body"]["temperature"] for r in fake.requests} == {0.0}
    assert [t.verifier_score for t in read_trajectories(out)] == [1.0, 1.0, 1.0]
    drawn = calc.sample("train", 3, seed=1000 + 1)  # consequence demos' default draw seed
    assert sorted(t.task_id for t in read_trajectories(out)) == sorted(t.task_id for t in drawn)


def test_sft_with_a_teacher_url_records_the_teacher_and_its_cost(tmp_path, calc):
    out = tmp_path / "sft"
    tasks = calc.sample("train", 4, seed=0 + 1)  # sft's draw seed is its seed
    with FakeTeacher(calc, {tasks[3].question: "wrong"}) as fake:
        res = CliRunner().invoke(
            app,
            ["sft", "--model", str(BUNDLED), "--env", "calculator", "--teacher-url", fake.url, "--demos", "4",
             "--teacher-concurrency", "2", "--epochs", "1", "--rows-per-step", "2", "--micro-batch-size", "2",
             "--lora-rank", "4", "--out", str(out)],
            env=WIDE,
        )  # fmt: skip
    assert res.exit_code == 0, res.output
    rec = json.loads((out / "sft.json").read_text())
    teacher = rec["teacher"]
    assert (teacher["kind"], teacher["verified"], teacher["episodes"], teacher["rejected"]) == (
        "teacher_url", 3, 4, {"not_verified": 1},
    )  # fmt: skip
    assert teacher["cost"]["http_calls"] == 8 and teacher["cost"]["prompt_tokens"] == 4 * 300
    assert teacher["cost"]["attempts_per_accepted"] == round(4 / 3, 6)
    assert rec["settings"]["teacher_url"]["url"] == fake.url + "/v1"
    assert (
        rec["settings"]["teacher_url"]["concurrency"] == 2 and rec["settings"]["teacher_url"]["model"] == "fake-teacher"
    )
    assert rec["rows"] == 3 and "teacher cost: 4 episodes, 8 HTTP calls" in " ".join(res.output.split())


@pytest.mark.parametrize("command", ["demos", "sft"])
def test_an_unreachable_teacher_is_one_error_line_exit_2_and_nothing_written(tmp_path, command):
    url = _dead_url()
    out = tmp_path / ("d.parquet" if command == "demos" else "sft")
    args = ["--model", str(BUNDLED)] if command == "sft" else []
    res = CliRunner().invoke(
        app, [command, *args, "--env", "calculator", "--teacher-url", url, "--out", str(out)], env=WIDE
    )
    assert res.exit_code == 2, res.output
    errors = [line for line in res.output.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"--teacher-url {url}: GET {url}/v1/models: the server cannot be reached" in errors[0]
    assert "Traceback" not in res.output and not out.exists()


@pytest.mark.parametrize(
    "args,match",
    [
        (["--from", "FILE", "--teacher-url", "URL"], "--from and --teacher-url are two sources"),
        (["--teacher-model", "m"], "--teacher-model: settings of a teacher behind a URL; give --teacher-url"),
        (["--teacher-url", "URL", "--teacher-model", "big"], "--teacher-model big:"),
    ],
)
def test_demos_cli_refuses_a_bad_teacher_setting_before_any_work(tmp_path, calc, args, match):
    out = tmp_path / "d.parquet"
    jsonl = tmp_path / "f.jsonl"
    jsonl.write_text("{}\n")
    with FakeTeacher(calc) as fake:
        args = [{"FILE": str(jsonl), "URL": fake.url}.get(a, a) for a in args]
        res = CliRunner().invoke(app, ["demos", "--env", "calculator", "--out", str(out), *args], env=WIDE)
    assert res.exit_code == 2 and "error:" in res.output and match in " ".join(res.output.split()), res.output
    assert not out.exists() and not fake.requests


@pytest.mark.slow
def test_a_real_consequence_serve_teacher_on_repair_gives_consistent_counts(tokenizer):
    """The bundled tiny model behind `consequence serve`'s app on loopback plays 2 repair episodes;
    whatever the verifier decides, every attempt is accounted for once."""
    from consequence.serve.app import BackgroundServer, ServeSettings, create_app, model_context_length

    model, tok = load_policy(BUNDLED)
    repair = load_environment("repair", 0)
    app_ = create_app(model, Renderer(tok, []), ServeSettings("tiny", model_context_length(model), max_tokens=48))
    with BackgroundServer(app_) as server:
        demos = teacher_url_demo_set(
            repair,
            Renderer(tok, repair.tools),
            TeacherEndpoint(server.url, max_tokens=48, max_turns=4, concurrency=2),
            2,
            **QUIET,
        )
    cost = demos.record()["cost"]
    assert demos.total == 2 and len(demos.kept) + sum(demos.rejected.values()) == 2
    assert 2 <= cost["http_calls"] <= 8 and cost["replies"] <= cost["http_calls"]
    assert cost["calls_without_usage"] == 0 and cost["prompt_tokens"] > 0  # consequence serve reports usage
    assert cost["completion_tokens"] <= 48 * cost["replies"]
    assert cost["attempts_per_accepted"] == (2 / len(demos.kept) if demos.kept else None)

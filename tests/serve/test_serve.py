"""The OpenAI-compatible endpoint (consequence.serve), driven by the real `openai` client on 127.0.0.1.

Identity with the in-process harness, the prefix rule, concurrency, bad requests,
disconnects and SIGTERM (docs/agents.md)."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch

from consequence.envs.registry import load_environment
from consequence.harness.renderer import Renderer
from consequence.policy.logprobs import token_logprobs
from consequence.policy.sampler import SamplingParams
from consequence.policy.tiny import load_policy
from consequence.records import trajectory_to_rows
from consequence.rollout.episodes import Budgets, EpisodeSpec, run_episodes
from consequence.rollout.sampling import policy_generate_fn
from consequence.serve.app import BackgroundServer, ServeSettings, create_app, model_context_length
from consequence.serve.runner import load_agent, run_agent_episodes
from consequence.update.step import compute_logprobs

BUNDLED = "consequence/assets/tiny-repair"
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=32)
BUDGETS = Budgets(max_turns=6, max_new_tokens=32, max_total_tokens=768)


@pytest.fixture(scope="module")
def policy():
    model, tok = load_policy(BUNDLED)
    env = load_environment("repair", 0)
    return model, Renderer(tok, env.tools), env


@pytest.fixture(scope="module")
def server(policy):
    model, renderer, _env = policy
    app = create_app(
        model,
        Renderer(renderer.tokenizer, []),
        ServeSettings("tiny", model_context_length(model), temperature=0.0, max_tokens=32),
    )
    with BackgroundServer(app) as s:
        yield s


def _client(server, session: str | None = None) -> openai.OpenAI:
    base = f"{server.url}/s/{session}/v1" if session else f"{server.url}/v1"
    return openai.OpenAI(base_url=base, api_key="x", max_retries=0)


def _get(server, path: str) -> dict:
    return _get_url(server.url + path)


def _get_url(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


async def harness_like_agent(client, task):
    """An agent that keeps the conversation as the harness does: the reply as returned, each tool result."""
    messages = list(task.messages)
    while not task.done:
        reply = await client.chat.completions.create(model=task.model, messages=messages, tools=task.tools)
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return msg.content
        for call in msg.tool_calls:
            out = await task.call_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": out})


def _specs(env, n=5):
    tasks = env.sample("validation", n, seed=3)
    return [
        EpisodeSpec(
            env.make_episode(t), t.task_id, f"g/{t.task_id}", 0, 100 + i, answer_ends_episode=env.answer_ends_episode
        )
        for i, t in enumerate(tasks)
    ]


# ---- 1. the agent-runner path records what the in-process harness records ------------------------
@pytest.mark.slow
def test_agent_runner_and_harness_record_identical_ids_masks_and_logprobs(policy):
    model, renderer, env = policy
    gen = policy_generate_fn(model, GREEDY, renderer.stop_ids, seed=0)
    ref = run_episodes(gen, renderer, _specs(env), BUDGETS, env.system_prompt, examples=env.examples)
    got, stats = run_agent_episodes(
        harness_like_agent,
        model,
        renderer,
        _specs(env),
        BUDGETS,
        GREEDY,
        env.system_prompt,
        seed=0,
        examples=env.examples,
    )
    assert sum(len(t.calls) for t in ref) > len(ref) >= 5  # multi-turn episodes
    assert {t.outcome for t in ref} >= {"finished", "truncated"}  # both ends are exercised
    assert stats["agent_prefix_breaks"] == 0 and stats["agent_calls"] == sum(len(t.calls) for t in ref)
    for a, b in zip(ref, got):
        assert (a.outcome, a.truncation_reason, a.env_rewards, a.verifier_score, a.n_tool_calls) == (
            b.outcome,
            b.truncation_reason,
            b.env_rewards,
            b.verifier_score,
            b.n_tool_calls,
        )
        assert [c.context_ids for c in a.calls] == [c.context_ids for c in b.calls]
        assert [c.output_ids for c in a.calls] == [c.output_ids for c in b.calls]
        assert [c.observation_ids for c in a.calls[:-1]] == [c.observation_ids for c in b.calls[:-1]]
        assert [c.reward for c in a.calls] == [c.reward for c in b.calls]
        ra, rb = trajectory_to_rows(a), trajectory_to_rows(b)
        assert len(ra) == len(rb) == 1
        assert ra[0].input_ids == rb[0].input_ids and ra[0].loss_mask == rb[0].loss_mask
        ratio = torch.tensor(rb[0].old_logprobs) - torch.tensor(ra[0].old_logprobs)
        assert ratio.exp().sub(1).abs().max().item() < 1e-4  # ratio = 1 to 1e-4


@pytest.mark.slow
def test_recorded_logprobs_equal_a_teacher_forced_recompute(policy):
    model, renderer, env = policy
    got, _ = run_agent_episodes(
        harness_like_agent,
        model,
        renderer,
        _specs(env, 3),
        BUDGETS,
        GREEDY,
        env.system_prompt,
        seed=0,
        examples=env.examples,
    )
    rows = [r for t in got for r in trajectory_to_rows(t)]
    fresh = compute_logprobs(model, rows, renderer.tokenizer.pad_token_id, token_logprobs)  # greedy: μ at T = 1
    for row, lp in zip(rows, fresh):
        on = [j for j, m in enumerate(row.loss_mask) if m]
        assert len(on) > 0
        assert max(abs(row.old_logprobs[j] - lp[j]) for j in on) < 1e-4


# ---- 2. a rewritten turn breaks the row; nothing re-tokenised becomes a target -------------------
async def rewriting_agent(client, task):
    """Two turns, then sends the history back with the first reply's content edited."""
    messages = list(task.messages)
    for turn in range(3):
        reply = await client.chat.completions.create(model=task.model, messages=messages, tools=task.tools)
        msg = reply.choices[0].message.model_dump(exclude_none=True)
        if turn == 1:
            messages[len(task.messages)]["content"] = "I will look at the code first."  # the agent edits turn 1
        messages.append(msg)
        for call in reply.choices[0].message.tool_calls or []:
            out = await task.call_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": out})
        if task.done or not reply.choices[0].message.tool_calls:
            return None


@pytest.mark.slow
def test_a_rewritten_assistant_turn_is_a_counted_prefix_break_with_a_new_row(policy):
    model, renderer, env = policy
    specs = _specs(env, 6)
    got, stats = run_agent_episodes(
        rewriting_agent, model, renderer, specs, BUDGETS, GREEDY, env.system_prompt, seed=0, examples=env.examples
    )
    three = [t for t in got if len(t.calls) == 3]
    assert three, "some episodes must reach the third call"
    assert stats["agent_prefix_breaks"] == len(three)
    for t in three:
        rows = trajectory_to_rows(t)
        assert len(rows) == 2  # calls 1-2 in one row, call 3 (after the edit) in its own
        targets = [[i for i, m in zip(r.input_ids, r.loss_mask) if m] for r in rows]
        assert targets == [t.calls[0].output_ids + t.calls[1].output_ids, t.calls[2].output_ids]
        edited = renderer.encode("I will look at the code first.")
        ctx = t.calls[2].context_ids
        assert any(ctx[k : k + len(edited)] == edited for k in range(len(ctx)))  # the edit is context only
        assert rows[1].input_ids == ctx + t.calls[2].output_ids


@pytest.mark.slow
def test_reserialised_arguments_do_not_break_the_row(server):
    """The same call with its arguments re-serialised (spacing, key order) continues the sampled ids."""
    c = _client(server, "reserialise")
    tools = [
        {
            "type": "function",
            "function": {
                "name": "replace_line",
                "parameters": {
                    "type": "object",
                    "properties": {"line": {"type": "integer"}, "code": {"type": "string"}},
                },
            },
        }
    ]
    first = [{"role": "user", "content": "fix add"}]
    r1 = c.chat.completions.create(model="tiny", messages=first, tools=tools)
    msg = r1.choices[0].message.model_dump(exclude_none=True)
    for call in msg.get("tool_calls", []):
        call["function"]["arguments"] = json.dumps(json.loads(call["function"]["arguments"]), indent=2)
    history = (
        first
        + [msg]
        + [{"role": "tool", "tool_call_id": tc["id"], "content": "ok"} for tc in msg.get("tool_calls", [])]
        + ([] if msg.get("tool_calls") else [{"role": "user", "content": "go on"}])
    )
    r2 = c.chat.completions.create(model="tiny", messages=history, tools=tools)
    record = _get(server, "/s/reserialise/record")
    assert record["prefix_breaks"] == 0
    c1, c2 = record["calls"]
    assert c2["context_ids"][: len(c1["context_ids"]) + len(c1["output_ids"])] == c1["context_ids"] + c1["output_ids"]
    assert r2.model_extra["prompt_token_ids"] == c2["context_ids"]


def test_a_closed_session_is_forgotten(server):
    _client(server, "closing").chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    req = urllib.request.Request(server.url + "/s/closing", method="DELETE")
    with urllib.request.urlopen(req, timeout=10) as r:
        assert len(json.loads(r.read())["calls"]) == 1
    with pytest.raises(urllib.error.HTTPError) as e:
        _get(server, "/s/closing/record")
    assert e.value.code == 404 and json.loads(e.value.read())["error"]["code"] == "session_not_found"


# ---- 3. concurrency ------------------------------------------------------------------------------
@pytest.mark.slow
def test_32_simultaneous_sessions_are_batched_and_each_recorded(server):
    before = _get(server, "/health")

    async def one(k: int):
        c = openai.AsyncOpenAI(base_url=f"{server.url}/s/many-{k}/v1", api_key="x", max_retries=0)
        try:
            r = await c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"task {k}"}], max_tokens=8
            )
            return r.choices[0].model_extra["token_ids"]
        finally:
            await c.close()

    async def main():
        return await asyncio.gather(*(one(k) for k in range(32)))

    outs = asyncio.run(main())
    after = _get(server, "/health")
    assert after["requests"] - before["requests"] == 32
    assert after["batches"] - before["batches"] < 32  # batched, not one generate call each
    for k, ids in enumerate(outs):
        assert 1 <= len(ids) <= 8
        assert _get(server, f"/s/many-{k}/record")["calls"][0]["output_ids"] == ids


@pytest.mark.slow
def test_n_choices_stop_strings_logprobs_and_streaming(server):
    c = _client(server)
    r = c.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "fix add"}],
        n=3,
        temperature=1.0,
        seed=5,
        logprobs=True,
        max_tokens=12,
    )
    assert len(r.choices) == 3
    for ch in r.choices:
        assert [t.logprob for t in ch.logprobs.content] == ch.model_extra["token_logprobs"]
        assert len(ch.model_extra["token_ids"]) == len(ch.logprobs.content) <= 12
    again = c.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "fix add"}],
        n=3,
        temperature=1.0,
        seed=5,
        logprobs=True,
        max_tokens=12,
    )
    assert [ch.model_extra["token_ids"] for ch in again.choices] == [ch.model_extra["token_ids"] for ch in r.choices]
    full = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "fix add"}], max_tokens=20)
    text = full.choices[0].message.content or ""
    stop = text[2:5] if len(text) > 5 else None
    if stop:
        cut = c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "fix add"}], max_tokens=20, stop=[stop]
        )
        assert cut.choices[0].finish_reason == "stop" and stop not in (cut.choices[0].message.content or "")[:2]
        assert len(cut.choices[0].model_extra["token_ids"]) < len(full.choices[0].model_extra["token_ids"])
    chunks = list(
        c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "fix add"}],
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == (full.choices[0].message.content or "")  # greedy: the same reply
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


# ---- 4. bad requests, disconnects, SIGTERM --------------------------------------------------------
@pytest.mark.parametrize(
    "change,status,code",
    [
        ({"model": "gpt-4o"}, 404, "model_not_found"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            400,
            "invalid_tools",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}
                ]
            },
            400,
            "invalid_tools",
        ),
        ({"max_tokens": -1}, 400, "invalid_value"),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": "a " * 1100}]}, 400, "context_length_exceeded"),
        ({"tool_choice": "required"}, 400, "invalid_value"),  # no tools to call
        ({"frequency_penalty": 0.5}, 400, "unsupported_parameter"),
    ],
)
def test_bad_requests_get_openai_style_errors(server, change, status, code):
    kwargs = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]} | change
    with pytest.raises(openai.APIStatusError) as e:
        _client(server).chat.completions.create(**kwargs)
    assert e.value.status_code == status
    assert e.value.body["code"] == code and e.value.body["type"] == "invalid_request_error"
    assert e.value.body["message"]


@pytest.mark.slow
def test_a_client_that_disconnects_mid_generation_leaves_no_stuck_batch(server):
    before = _get(server, "/health")
    body = json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "x " * 50}], "max_tokens": 900, "temperature": 1.0}
    )
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("POST", "/s/gone/v1/chat/completions", body, {"Content-Type": "application/json"})
    time.sleep(0.05)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.monotonic() + 20
    while (h := _get(server, "/health"))["in_flight"] or h["queued"]:
        assert time.monotonic() < deadline, f"batch stuck: {h}"
        time.sleep(0.05)
    r = _client(server, "after").chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].model_extra["token_ids"]
    if _get(server, "/health")["dropped"] > before["dropped"]:
        # it left before its batch began: nothing was sampled, and no empty session is left behind
        with pytest.raises(urllib.error.HTTPError) as e:
            _get(server, "/s/gone/record")
        assert e.value.code == 404
    else:  # it left during sampling: the reply was sampled to its end and is recorded (docs/agents.md §5)
        calls = _get(server, "/s/gone/record")["calls"]
        assert len(calls) == 1 and len(calls[0]["output_ids"]) == len(calls[0]["sample_logprobs"]) >= 1


CLIENT_TIMEOUT_S = 0.5


@pytest.mark.slow
def test_a_reply_the_client_timed_out_on_is_recorded_and_the_next_call_is_a_counted_break(server, policy):
    """The stock openai client gives up mid-generation (its `timeout`); the agent then sends
    the conversation without that reply (a new user turn), then retries the request. The
    record: rows = 1 + breaks, each break with its reason, the unseen reply in its row with
    nothing after it, and every row's targets the sampled ids with their log-probs (ratio = 1)."""
    model, renderer, _env = policy
    sid, tools = "timed-out", renderer.tools  # the repair environment's tools
    c = _client(server, sid)
    first = [{"role": "user", "content": "fix add"}]
    t0 = time.monotonic()
    r1 = c.chat.completions.create(model="tiny", messages=first, tools=tools)
    per_token = (time.monotonic() - t0) / len(r1.choices[0].model_extra["token_ids"])  # HTTP and prefill included
    msg = r1.choices[0].message.model_dump(exclude_none=True)
    assert msg.get("tool_calls"), msg  # greedy: the bundled model calls run_tests
    # After this tool result the greedy reply repeats itself up to max_tokens: a slow generation,
    # sized to take 10 client timeouts at the time per token just measured. That time includes
    # the HTTP round trip and the prefill, so it may overstate decoding (measured on the loaded
    # 2-core machine: 0.65-1.25x the slow reply's own time per token), leaving several timeouts
    # of margin. 48 to 600 tokens (the context is 1024).
    history = (
        first + [msg] + [{"role": "tool", "tool_call_id": tc["id"], "content": "a" * 200} for tc in msg["tool_calls"]]
    )
    n_slow = min(600, max(48, int(10 * CLIENT_TIMEOUT_S / per_token)))
    before = _get(server, "/health")
    slow = openai.OpenAI(base_url=f"{server.url}/s/{sid}/v1", api_key="x", max_retries=0, timeout=CLIENT_TIMEOUT_S)
    with pytest.raises(openai.APITimeoutError):
        slow.chat.completions.create(model="tiny", messages=history, tools=tools, max_tokens=n_slow)
    slow.close()
    # The next request lacks the reply it never got (it waits for the session's lock, so the
    # abandoned call is recorded first); then the timed-out request is retried.
    r3 = c.chat.completions.create(
        model="tiny", messages=history + [{"role": "user", "content": "you timed out"}], tools=tools, max_tokens=8
    )
    r4 = c.chat.completions.create(model="tiny", messages=history, tools=tools, max_tokens=4)

    session = server.app.state.serve.sessions.get(sid, create=False)
    rows = trajectory_to_rows(session.trajectory)
    assert len(rows) == 1 + session.prefix_breaks
    assert _get(server, "/health")["dropped"] == before["dropped"], "the timed-out request left before sampling"
    record = _get(server, f"/s/{sid}/record")
    unused = "the client did not use the reply of calls[1] (timed out or abandoned)"
    assert record["breaks"] == [
        {"call": 2, "reason": f"calls[2] continues calls[0], not the last call: {unused}"},
        {"call": 3, "reason": f"calls[3] repeats the messages of calls[1] (a retry): {unused}"},
    ]
    c0, c1, c2, c3 = session.trajectory.calls
    assert len(rows) == 3 and record["prefix_breaks"] == 2
    # The abandoned reply: sampled after the tool result to its end (the batch finished), nothing after it.
    assert c1.context_ids == c0.context_ids + c0.output_ids + c0.observation_ids
    assert c1.observation_ids == [] and len(c1.output_ids) > 8
    # The next call continues calls[0] (its reply was seen), not the unseen calls[1].
    assert r3.model_extra["prompt_token_ids"] == c2.context_ids
    assert r3.choices[0].model_extra["token_ids"] == c2.output_ids
    seen = session.candidates[0]  # calls[0]'s messages and reply, normalised
    later = [{"role": "tool", "name": tc["function"]["name"], "content": "a" * 200} for tc in msg["tool_calls"]]
    later.append({"role": "user", "content": "you timed out"})
    obs = renderer.observation_ids(seen.history, seen.message, later)
    assert c2.context_ids == c0.context_ids + c0.output_ids + obs
    # The retry: the timed-out call's context; greedy, so the same first tokens.
    assert c3.context_ids == c1.context_ids
    assert c3.output_ids == c1.output_ids[:4] == r4.choices[0].model_extra["token_ids"]
    targets = [[(i, lp) for i, lp, m in zip(r.input_ids, r.old_logprobs, r.loss_mask) if m] for r in rows]
    assert targets == [
        list(zip(c0.output_ids + c1.output_ids, c0.sample_logprobs + c1.sample_logprobs)),
        list(zip(c2.output_ids, c2.sample_logprobs)),
        list(zip(c3.output_ids, c3.sample_logprobs)),
    ]
    assert [r.input_ids for r in rows] == [
        c1.context_ids + c1.output_ids,
        c2.context_ids + c2.output_ids,
        c3.context_ids + c3.output_ids,
    ]
    # ratio = 1: the stored log-probs are the model's log-probs of the stored ids (greedy: μ at T = 1),
    # recomputed teacher-forced; 1e-4 as in the harness identity test (float32, batch shapes differ).
    fresh = compute_logprobs(model, rows, renderer.tokenizer.pad_token_id, token_logprobs)
    for row, lp in zip(rows, fresh):
        assert max(abs(row.old_logprobs[j] - lp[j]) for j, m in enumerate(row.loss_mask) if m) < 1e-4


@pytest.mark.slow
def test_sigterm_stops_the_server_cleanly(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = os.path.join(os.path.dirname(sys.executable), "consequence")
    proc = subprocess.Popen(
        [exe, "serve", "--port", str(port), "--name", "tiny"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=os.environ | {"COLUMNS": "250"},
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                models = _get_url(f"http://127.0.0.1:{port}/v1/models")
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
                time.sleep(0.2)
        assert [m["id"] for m in models["data"]] == ["tiny"]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "endpoint stopped" in out


# ---- the agent's own checks ------------------------------------------------------------------------
def test_load_agent_refuses_what_cannot_be_an_agent(tmp_path):
    f = tmp_path / "a.py"
    f.write_text("def sync_agent(client, task):\n    return 1\n\nasync def agent(client, task):\n    return 2\n")
    assert load_agent(f"{f}:agent").__name__ == "agent"
    with pytest.raises(ValueError, match="must be an async function"):
        load_agent(f"{f}:sync_agent")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        load_agent(f"{f}:nope")
    with pytest.raises(ValueError, match="give module:function"):
        load_agent("no_colon_here")
    with pytest.raises(ValueError, match="importing 'no_such_module_xyz' failed"):
        load_agent("no_such_module_xyz:agent")


@pytest.mark.slow
def test_an_episode_refuses_other_sampling_settings_and_ends_on_its_budget(policy):
    model, renderer, env = policy

    async def greedy_asker(client, task):
        with pytest.raises(openai.BadRequestError, match="differs from the training run"):
            await client.chat.completions.create(model=task.model, messages=task.messages, temperature=0.7)
        with pytest.raises(openai.BadRequestError, match="exceeds the episode's budget"):
            await client.chat.completions.create(model=task.model, messages=task.messages, max_tokens=999)
        return await harness_like_agent(client, task)

    budgets = Budgets(max_turns=2, max_new_tokens=32, max_total_tokens=768)
    got, _ = run_agent_episodes(
        greedy_asker, model, renderer, _specs(env, 2), budgets, GREEDY, env.system_prompt, seed=0, examples=env.examples
    )
    assert all(len(t.calls) <= 2 for t in got)
    assert all(t.outcome != "env_error" for t in got), [t.error for t in got]
    assert any(t.truncation_reason == "max_turns" for t in got)


# ---- consequence train --agent ----------------------------------------------------------------------
def test_train_refuses_an_agent_that_cannot_run_before_any_work(tmp_path):
    from typer.testing import CliRunner

    from consequence.cli import app

    f = tmp_path / "sync_agent.py"
    f.write_text("def agent(client, task):\n    return None\n")
    run_dir = tmp_path / "run"
    res = CliRunner().invoke(app, ["train", "--agent", f"{f}:agent", "--run-dir", str(run_dir)], env={"COLUMNS": "250"})
    assert res.exit_code == 2
    assert "must be an async function" in " ".join(res.output.split())
    assert not run_dir.exists()


@pytest.mark.slow
def test_train_with_the_example_agent_end_to_end(tmp_path, monkeypatch):
    """`consequence train --agent` with the example: the pre-step checks pass on the agent's
    trajectories, and the metrics count exactly the calls stored in the iteration's file."""
    from typer.testing import CliRunner

    from consequence.cli import app
    from consequence.records import read_trajectories

    monkeypatch.setenv("CONSEQUENCE_LEDGER", str(tmp_path / "ledger.jsonl"))
    run = tmp_path / "run"
    res = CliRunner().invoke(
        app,
        [
            "train",
            "--agent",
            "examples/openai_agent/agent.py:agent",
            "--iterations",
            "1",
            "--tasks-per-iteration",
            "2",
            "--group-size",
            "2",
            "--eval-every",
            "0",
            "--final-eval-episodes",
            "0",
            "--max-turns",
            "3",
            "--max-new-tokens",
            "32",
            "--run-dir",
            str(run),
        ],
        env={"COLUMNS": "250"},
    )
    assert res.exit_code == 0, res.output
    m = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    trajs = read_trajectories(run / "trajectories" / "iter_0000.parquet")
    assert len(trajs) == 4 and m["agent_calls"] == sum(len(t.calls) for t in trajs) > 0
    assert m["agent_prefix_breaks"] == 0 and m["agent_batches"] >= 1
    checks = json.loads((run / "manifest.json").read_text())["checks"]
    assert checks["skipped"] is False and {c["name"] for c in checks["results"]} >= {"ratio", "mask", "groups"}
    assert all(c["passed"] for c in checks["results"]), checks
    ratio = next(c["detail"] for c in checks["results"] if c["name"] == "ratio")
    assert float(re.search(r"= ([0-9.e+-]+) nats", ratio).group(1)) < 1e-4  # the trainer's π_old = the recorded μ


# ---- wrong types never reach a 500 ------------------------------------------------------------------
_TOOL = {
    "type": "function",
    "function": {
        "name": "run",
        "description": "run it",
        "strict": False,
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
    },
}
_FULL_BODY = {
    "model": "tiny",
    "max_tokens": 2,
    "temperature": 1.0,
    "top_p": 1.0,
    "n": 1,
    "stop": ["zz"],
    "seed": 1,
    "logprobs": False,
    "stream": False,
    "stream_options": {"include_usage": False},
    "user": "u",
    "metadata": {},
    "store": False,
    "parallel_tool_calls": True,
    "service_tier": "auto",
    "tool_choice": "auto",
    "tools": [_TOOL],
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "fix add"}], "name": "me"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "run", "arguments": '{"x": "1"}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ],
}
_WRONG = [5, 2.5, "s", [1], {"a": 1}, True]


def _paths(obj, path=()):
    """Every field path of a JSON value (dict keys and list indices), leaves and containers."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield path + (k,)
        yield from _paths(v, path + (k,))


def _post(server, body) -> tuple[int, dict]:
    req = urllib.request.Request(
        server.url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read().decode()
            return r.status, {"stream": text} if text.startswith("data:") else json.loads(text)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.slow
def test_a_wrong_type_anywhere_in_a_request_is_a_400_naming_the_field(server):
    status, _ = _post(server, _FULL_BODY)
    assert status == 200  # the unchanged body is valid: each failure below is the changed field's
    for path in _paths(_FULL_BODY):
        if path[-1] == "parameters" or "parameters" in path[:-1]:
            continue  # a JSON schema: checked by jsonschema (tests above)
        for wrong in _WRONG:
            body = json.loads(json.dumps(_FULL_BODY))
            target = body
            for k in path[:-1]:
                target = target[k]
            target[path[-1]] = wrong
            status, out = _post(server, body)
            assert status < 500, (path, wrong, out)
            if status >= 400:
                err = out["error"]
                name = str(path[-1]) if isinstance(path[-1], str) else str(path[-2])
                assert name in (err["param"] or "") or name in err["message"], (path, wrong, err)
                assert "object has no attribute" not in err["message"] and "unhashable" not in err["message"]


@pytest.mark.parametrize(
    "change,param,code,message",
    [
        ({"stream_options": 5}, "stream_options", "invalid_type", "stream_options must be an object, got integer 5"),
        ({"stream": "yes"}, "stream", "invalid_type", "stream must be a boolean, got string"),
        ({"logprobs": "yes"}, "logprobs", "invalid_type", "logprobs must be a boolean, got string"),
        ({"tools": ["abc"]}, "tools[0]", "invalid_type", "tools[0] must be a JSON object, got string"),
        (
            {"tools": [{"type": "function", "function": {"name": 5}}]},
            "tools[0].function.name",
            "invalid_type",
            "tools[0].function.name must be a string, got integer 5",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "description": [1]}}]},
            "tools[0].function.description",
            "invalid_type",
            "must be a string, got array [1]",
        ),
        (
            {"messages": [{"role": "user", "content": None}]},
            "messages[0].content",
            "invalid_value",
            "a user message needs content",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": True}]},
            "messages[0].tool_calls",
            "invalid_type",
            "must be an array, got boolean true",
        ),
        (
            {"messages": [{"role": "tool", "tool_call_id": [1], "content": "x"}]},
            "messages[0].tool_call_id",
            "invalid_type",
            "must be a string, got array [1]",
        ),
        ({"model": None}, "model", "missing_required_parameter", "missing required parameter: 'model'"),
    ],
)
def test_the_tester_s_bad_requests_name_their_field(server, change, param, code, message):
    status, out = _post(server, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]} | change)
    assert status == 400 and out["error"]["param"] == param and out["error"]["code"] == code
    assert message in out["error"]["message"]


def test_an_unknown_field_is_accepted_and_named_in_a_header(server):
    """vLLM ignores fields it does not know, and clients add some with every release: accepted,
    named in x-consequence-ignored-fields (serve.compat; tests/serve/test_serve_compat.py)."""
    req = urllib.request.Request(
        server.url + "/v1/chat/completions",
        json.dumps(
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "foo": 1, "user": "u"}
        ).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200 and r.headers["x-consequence-ignored-fields"] == "foo, user"


@pytest.mark.slow
def test_n_seeded_choices_differ_and_repeat_as_a_set(server):
    def ids():
        r = _client(server).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "fix add"}], n=4, seed=5, temperature=2.0, max_tokens=12
        )
        return [tuple(ch.model_extra["token_ids"]) for ch in r.choices]

    first = ids()
    assert len(set(first)) == 4
    assert ids() == first
    one = _client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "fix add"}], seed=5, temperature=2.0, max_tokens=12
    )
    assert tuple(one.choices[0].model_extra["token_ids"]) == first[0]  # n = 1 keeps the seed's own sample


def test_stop_text_is_cut_from_content_but_kept_in_token_ids(server, policy):
    tok = policy[1].tokenizer
    c = _client(server, "stopper")
    msgs = [{"role": "user", "content": "fix add"}]
    full = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=20).choices[0].message.content
    stop = full[4:7]
    assert len(stop) == 3 and full.find(stop) == 4
    cut = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, stop=stop).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == full[:4]
    assert stop in tok.decode(cut.model_extra["token_ids"])  # the sampled ids, as recorded
    rec = _get(server, "/s/stopper/record")["calls"][-1]
    assert rec["output_ids"] == cut.model_extra["token_ids"]
    nxt = msgs + [{"role": "assistant", "content": cut.message.content}, {"role": "user", "content": "go on"}]
    c.chat.completions.create(model="tiny", messages=nxt, max_tokens=4)
    # The cut request repeats the first one's messages (a retry: its own row, a counted break);
    # the cut reply sent back continues that row (no break at calls[2]).
    assert [b["call"] for b in _get(server, "/s/stopper/record")["breaks"]] == [1]


@pytest.mark.parametrize("sid", ["..", "../../etc", "a b", "x" * 129, "-lead"])
def test_unsafe_session_ids_are_refused(server, sid):
    before = _get(server, "/health")["sessions"]
    status, out = _post_session(server, sid)
    assert status == 400 and out["error"]["code"] == "invalid_session_id" and out["error"]["param"] == "session"
    assert _get(server, "/health")["sessions"] == before  # no session was made


def test_a_safe_session_id_in_the_header_is_recorded(server):
    status, _ = _post_session(server, "Agent_1.run-2")
    assert status == 200 and len(_get(server, "/s/Agent_1.run-2/record")["calls"]) == 1


def _post_session(server, sid: str) -> tuple[int, dict]:
    req = urllib.request.Request(
        server.url + "/v1/chat/completions",
        json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode(),
        {"Content-Type": "application/json", "X-Session-Id": sid},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ---- the agent's failures are the agent's ---------------------------------------------------------
@pytest.mark.slow
def test_an_agent_that_never_returns_is_cancelled_at_its_time_limit(policy):
    from consequence.serve.runner import SECONDS_PER_TURN, episode_time_limit

    model, renderer, env = policy

    async def hang(client, task):
        await client.models.list()
        await asyncio.sleep(10**6)

    t0 = time.monotonic()
    got, stats = run_agent_episodes(
        hang,
        model,
        renderer,
        _specs(env, 2),
        BUDGETS,
        GREEDY,
        env.system_prompt,
        seed=0,
        examples=env.examples,
        agent_timeout=0.5,
    )
    assert time.monotonic() - t0 < 30
    assert [t.outcome for t in got] == ["env_error", "env_error"] and stats["agent_calls"] == 0
    assert got[0].error == (
        "the agent did not return within 0.5 s (--agent-timeout; the default is 120 s × --max-turns) and was cancelled"
    )
    assert episode_time_limit(BUDGETS) == SECONDS_PER_TURN * BUDGETS.max_turns == 720
    assert episode_time_limit(BUDGETS, 30) == 30


def test_agent_timeout_without_an_agent_is_refused():
    from consequence.config import TrainConfig

    with pytest.raises(ValueError, match="--agent-timeout limits the episodes of --agent, which is not given"):
        TrainConfig(agent_timeout=10)
    assert TrainConfig(agent="m:f", agent_timeout=10).agent_timeout == 10


def test_load_agent_checks_the_signature_paths_and_finds_modules_in_the_current_folder(tmp_path, monkeypatch):
    f = tmp_path / "shapes.py"
    f.write_text("async def noargs():\n    return 1\n\nasync def ok(client, task, extra=1):\n    return 2\n")
    with pytest.raises(ValueError, match=r"noargs\(\) cannot be called as noargs\(client, task\)"):
        load_agent(f"{f}:noargs")
    assert load_agent(f"{f}:ok").__name__ == "ok"
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match="'/etc/hostname' is a .*, not a .py file"):
        load_agent("/etc/hostname:agent")
    with pytest.raises(ValueError, match=f"'{tmp_path / 'folder'}' is a folder, not a .py file"):
        load_agent(f"{tmp_path / 'folder'}:agent")
    (tmp_path / "here_agent_mod.py").write_text("async def agent(client, task):\n    return 3\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert load_agent("here_agent_mod:agent").__name__ == "agent"


def _train_with_agent(tmp_path, body: str):
    from typer.testing import CliRunner

    from consequence.cli import app

    f = tmp_path / "bad_agent.py"
    f.write_text(body)
    res = CliRunner().invoke(
        app,
        [
            "train",
            "--agent",
            f"{f}:agent",
            "--iterations",
            "1",
            "--tasks-per-iteration",
            "1",
            "--group-size",
            "2",
            "--eval-every",
            "0",
            "--final-eval-episodes",
            "0",
            "--run-dir",
            str(tmp_path / "run"),
        ],
        env={"COLUMNS": "250"},
    )
    return res.exit_code, " ".join(res.output.split())


@pytest.mark.parametrize(
    "body,says",
    [
        (
            "async def agent(client, task):\n    raise RuntimeError('boom from agent')\n",
            "the agent raised RuntimeError: boom from agent. Fix the agent",
        ),
        ("async def agent(client, task):\n    return 'done'\n", "the agent made 0 model calls in 2 episodes"),
    ],
)
def test_train_names_the_agent_when_the_agent_fails(tmp_path, monkeypatch, body, says):
    monkeypatch.setenv("CONSEQUENCE_LEDGER", str(tmp_path / "ledger.jsonl"))
    code, out = _train_with_agent(tmp_path, body)
    assert code != 0 and says in out, out
    assert "docs/agents.md" in out and "environments.md" not in out and "--skip-checks" not in out


def test_a_refused_tool_call_of_an_agent_is_recorded_by_kind():
    """A call the session refuses (unknown tool, bad arguments) is kept on the model call it
    follows (ModelCall.invalid_calls), as the harness does; the environment never sees it."""
    from consequence.harness.tools import check_tool_specs
    from consequence.records import ModelCall, Trajectory
    from consequence.serve.episode import BoundEpisode
    from tool_specs import TOOLS

    class Env:
        def step(self, action):
            return "2/5 passed", 0.0, False, False, {}

    t = Trajectory("t", "g", 0, 0, 0, calls=[ModelCall([1], [2], [0.0], "stop")])
    ep = BoundEpisode(Env(), t, BUDGETS, GREEDY, check_tool_specs(TOOLS), answers=False)
    assert ep.call_tool("rm", {}).startswith("error: unknown tool 'rm'")
    assert ep.call_tool("replace_line", '{"line": "2", "code": "x"}').startswith("error: bad arguments")
    assert ep.call_tool("run_tests", {}) == "2/5 passed"
    assert t.calls[0].invalid_calls == ["unknown_tool", "bad_arguments"] and t.n_tool_calls == 3

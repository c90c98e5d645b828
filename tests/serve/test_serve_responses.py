"""``POST /v1/responses`` (consequence.serve.responses), driven by the real `openai` client on 127.0.0.1:
the same sampling and token-exact session record as chat completions, ``previous_response_id``,
the compatibility policy and the streamed events (docs/agents.md §5)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from consequence.envs.registry import load_environment
from consequence.harness.renderer import Renderer
from consequence.policy.sampler import SamplingParams
from consequence.policy.tiny import load_policy
from consequence.records import trajectory_to_rows
from consequence.rollout.episodes import Budgets, EpisodeSpec, run_episodes
from consequence.rollout.sampling import policy_generate_fn
from consequence.serve import compat
from consequence.serve.app import BackgroundServer, ServeSettings, create_app, model_context_length
from consequence.serve.responses import input_messages
from consequence.serve.runner import run_agent_episodes

BUNDLED = "consequence/assets/tiny-repair"
USER = [{"role": "user", "content": "fix add"}]
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def setup():
    model, tok = load_policy(BUNDLED)
    chat_tools = load_environment("repair", 0).tools
    app = create_app(
        model, Renderer(tok, []), ServeSettings("tiny", model_context_length(model), temperature=0.0, max_tokens=32)
    )
    with BackgroundServer(app) as server:
        yield server, tok, chat_tools


def _flat(chat_tools: list[dict]) -> list[dict]:
    """The chat-completions tool specs in the Responses shape (flat, same key order)."""
    return [{"type": "function", **t["function"]} for t in chat_tools]


def _client(server, session: str | None = None) -> openai.OpenAI:
    base = f"{server.url}/s/{session}/v1" if session else f"{server.url}/v1"
    return openai.OpenAI(base_url=base, api_key="x", max_retries=0)


def _post(server, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict, dict]:
    req = urllib.request.Request(
        server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"} | (headers or {})
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def _record(server, sid: str) -> dict:
    with urllib.request.urlopen(f"{server.url}/s/{sid}/record", timeout=10) as r:
        return json.loads(r.read())


def _events(server, body: dict) -> list[dict]:
    """The data of each server-sent event of a streamed call, as sent (event name checked against its type)."""
    req = urllib.request.Request(
        server.url + "/v1/responses", json.dumps(body | {"stream": True}).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        blocks = r.read().decode().strip().split("\n\n")
    out = []
    for block in blocks:
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == "event: " + event["type"]
        out.append(event)
    return out


# ---- the items: Responses input as chat messages ----------------------------------------------
def test_input_items_become_the_chat_messages_of_the_same_conversation():
    items = [
        {
            "role": "developer",
            "content": [{"type": "input_text", "text": "be "}, {"type": "input_text", "text": "brief"}],
        },
        {"type": "message", "role": "user", "content": "fix add"},
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Looking.", "annotations": []}],
        },
        {"type": "function_call", "call_id": "c1", "name": "read_code", "arguments": "{}", "id": "fc_1"},
        {"type": "function_call", "call_id": "c2", "name": "run_tests", "arguments": ""},
        {"type": "function_call_output", "call_id": "c2", "output": "0/3 passed"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "1| def"}]},
        {"type": "function_call", "call_id": "c3", "name": "run_tests", "arguments": "{}"},
    ]
    call = lambda cid, name, args: {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}  # noqa: E731
    assert input_messages(items) == [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "fix add"},
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [call("c1", "read_code", "{}"), call("c2", "run_tests", "")],
        },
        {"role": "tool", "tool_call_id": "c2", "content": "0/3 passed"},
        {"role": "tool", "tool_call_id": "c1", "content": "1| def"},
        {"role": "assistant", "content": None, "tool_calls": [call("c3", "run_tests", "{}")]},
    ]
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]
    # an output may answer a call of the previous response's conversation
    before = [{"role": "assistant", "content": None, "tool_calls": [call("c0", "run_tests", "{}")]}]
    assert input_messages([{"type": "function_call_output", "call_id": "c0", "output": "ok"}], before) == [
        {"role": "tool", "tool_call_id": "c0", "content": "ok"}
    ]


# ---- the record: a Responses conversation is recorded as the same chat conversation is --------------
def test_a_function_call_exchange_is_one_row_of_the_sampled_ids_as_in_chat_completions(setup):
    server, _tok, chat_tools = setup
    tools = _flat(chat_tools)
    r = _client(server, "resp-rec")
    raw = r.responses.with_raw_response.create(model="tiny", input=USER, tools=tools)
    Response.model_validate(raw.http_response.json())  # the body as sent, validated (not only constructed)
    r1 = raw.parse()
    calls = [o for o in r1.output if o.type == "function_call"]
    assert calls and r1.status == "completed", r1.output  # greedy: the bundled model calls a tool
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "2 passed"} for c in calls]
    history = USER + [o.model_dump(exclude_none=True) for o in r1.output] + outputs
    r2 = r.responses.create(model="tiny", input=history, tools=tools)

    # the same conversation through chat completions, in another session
    c = _client(server, "chat-rec")
    c1 = c.chat.completions.create(model="tiny", messages=USER, tools=chat_tools)
    msg = c1.choices[0].message
    answers = [{"role": "tool", "tool_call_id": tc.id, "content": "2 passed"} for tc in msg.tool_calls or []]
    c2 = c.chat.completions.create(
        model="tiny", messages=USER + [msg.model_dump(exclude_none=True)] + answers, tools=chat_tools
    )

    got, ref = _record(server, "resp-rec"), _record(server, "chat-rec")
    assert got["prefix_breaks"] == ref["prefix_breaks"] == 0
    for key in ("context_ids", "output_ids", "observation_ids", "sample_logprobs"):
        assert [k[key] for k in got["calls"]] == [k[key] for k in ref["calls"]], key
    assert r1.model_extra["token_ids"] == c1.choices[0].model_extra["token_ids"] == got["calls"][0]["output_ids"]
    assert r2.model_extra["token_ids"] == c2.choices[0].model_extra["token_ids"] == got["calls"][1]["output_ids"]
    assert r2.model_extra["prompt_token_ids"] == got["calls"][1]["context_ids"]
    rows = trajectory_to_rows(server.app.state.serve.sessions.get("resp-rec", create=False).trajectory)
    assert len(rows) == 1
    targets = [i for i, m in zip(rows[0].input_ids, rows[0].loss_mask) if m]
    assert targets == got["calls"][0]["output_ids"] + got["calls"][1]["output_ids"]
    assert [n.function.name for n in msg.tool_calls or []] == [o.name for o in calls]
    assert [json.loads(t.function.arguments) for t in msg.tool_calls or []] == [json.loads(o.arguments) for o in calls]
    assert r2.usage.input_tokens == len(got["calls"][1]["context_ids"])
    assert r2.usage.output_tokens == len(got["calls"][1]["output_ids"])
    assert r2.usage.total_tokens == r2.usage.input_tokens + r2.usage.output_tokens


def test_previous_response_id_continues_the_kept_conversation_with_the_same_ids(setup):
    server, tok, chat_tools = setup
    tools = _flat(chat_tools)
    c = _client(server, "resp-prev")
    system = "You repair code."
    r1 = c.responses.create(model="tiny", input="fix add", instructions=system, tools=tools)
    calls = [o for o in r1.output if o.type == "function_call"]
    assert calls
    outputs = [{"type": "function_call_output", "call_id": x.call_id, "output": "ok"} for x in calls]
    r2 = c.responses.create(model="tiny", previous_response_id=r1.id, input=outputs, instructions=system, tools=tools)
    assert r2.previous_response_id == r1.id
    # the whole history sent instead of the id, in another session: the same record
    history = [{"role": "user", "content": "fix add"}] + [o.model_dump(exclude_none=True) for o in r1.output] + outputs
    w = _client(server, "resp-whole")
    w.responses.create(model="tiny", input="fix add", instructions=system, tools=tools)
    w.responses.create(model="tiny", input=history, instructions=system, tools=tools)
    got, ref = _record(server, "resp-prev"), _record(server, "resp-whole")
    assert got["prefix_breaks"] == 0
    assert [k["context_ids"] for k in got["calls"]] == [k["context_ids"] for k in ref["calls"]]
    assert [k["output_ids"] for k in got["calls"]] == [k["output_ids"] for k in ref["calls"]]
    # the instructions are the system message first, the string input a user message
    renderer = Renderer(tok, chat_tools)
    assert got["calls"][0]["context_ids"] == renderer.prompt_ids(
        [{"role": "system", "content": system}, {"role": "user", "content": "fix add"}]
    )
    # the kept response belongs to its session
    status, out, _ = _post(
        server, "/s/other/v1/responses", {"model": "tiny", "previous_response_id": r1.id, "input": "hi"}
    )
    assert status == 400 and out["error"]["param"] == "previous_response_id"
    # the X-Session-Id header reaches the same session as the URL prefix
    status, out, _ = _post(
        server,
        "/v1/responses",
        {"model": "tiny", "previous_response_id": r2.id, "input": "go on", "max_output_tokens": 2},
        {"X-Session-Id": "resp-prev"},
    )
    assert status == 200 and out["previous_response_id"] == r2.id
    assert len(_record(server, "resp-prev")["calls"]) == 3


def test_an_unknown_previous_response_id_is_a_400_naming_the_field(setup):
    server, _tok, _tools = setup
    with pytest.raises(openai.BadRequestError) as e:
        _client(server, "resp-unknown").responses.create(model="tiny", previous_response_id="resp_nope", input="hi")
    assert e.value.body["param"] == "previous_response_id"
    assert e.value.body["code"] == "previous_response_not_found"
    with pytest.raises(urllib.error.HTTPError) as gone:  # a refused first call leaves no session behind
        _record(server, "resp-unknown")
    assert gone.value.code == 404


def responses_agent(use_previous: bool):
    """An agent on the Responses API, as openai-agents drives it: the system prompt as
    ``instructions``, the output items and each call's output appended to the input (or,
    ``use_previous``, only the new items sent with ``previous_response_id``)."""

    async def agent(client, task):
        system = task.messages[0]["content"]
        tools = _flat(task.tools)
        items, new, previous = list(task.messages[1:]), list(task.messages[1:]), None
        while not task.done:
            r = await client.responses.create(
                model=task.model,
                instructions=system,
                input=new if use_previous else items,
                previous_response_id=previous,
                tools=tools,
            )
            outputs = []
            for call in [o for o in r.output if o.type == "function_call"]:
                out = await task.call_tool(call.name, call.arguments)
                outputs.append({"type": "function_call_output", "call_id": call.call_id, "output": out})
            if not outputs:
                return r.output_text
            items += [o.model_dump(exclude_none=True) for o in r.output] + outputs
            new, previous = outputs, (r.id if use_previous else None)

    return agent


@pytest.mark.slow
@pytest.mark.parametrize("use_previous", [False, True])
def test_an_agent_on_the_responses_api_records_what_the_in_process_harness_records(use_previous):
    model, tok = load_policy(BUNDLED)
    env = load_environment("repair", 0)
    renderer = Renderer(tok, env.tools)
    greedy, budgets = SamplingParams(temperature=0.0, max_new_tokens=32), Budgets(6, 32, 768)

    def specs():
        tasks = env.sample("validation", 3, seed=3)
        return [
            EpisodeSpec(
                env.make_episode(t),
                t.task_id,
                f"g/{t.task_id}",
                0,
                100 + i,
                answer_ends_episode=env.answer_ends_episode,
            )
            for i, t in enumerate(tasks)
        ]

    gen = policy_generate_fn(model, greedy, renderer.stop_ids, seed=0)
    ref = run_episodes(gen, renderer, specs(), budgets, env.system_prompt, examples=env.examples)
    got, stats = run_agent_episodes(
        responses_agent(use_previous), model, renderer, specs(), budgets, greedy, env.system_prompt, seed=0
    )
    assert sum(len(t.calls) for t in ref) > len(ref)  # multi-turn episodes with tool calls
    assert stats["agent_prefix_breaks"] == 0
    for a, b in zip(ref, got):
        assert (a.outcome, a.truncation_reason, a.n_tool_calls) == (b.outcome, b.truncation_reason, b.n_tool_calls)
        assert [c.context_ids for c in a.calls] == [c.context_ids for c in b.calls]
        assert [c.output_ids for c in a.calls] == [c.output_ids for c in b.calls]
        assert [c.observation_ids for c in a.calls[:-1]] == [c.observation_ids for c in b.calls[:-1]]
        ra, rb = trajectory_to_rows(a), trajectory_to_rows(b)
        assert len(rb) == 1 and ra[0].input_ids == rb[0].input_ids and ra[0].loss_mask == rb[0].loss_mask


# ---- the compatibility policy ------------------------------------------------------------------
def test_ignored_and_unknown_fields_are_named_neutral_values_accepted(setup):
    server, _tok, _tools = setup
    body = {
        "model": "tiny",
        "input": "hi",
        "max_output_tokens": 3,
        "store": False,
        "metadata": {"run": "1"},
        "truncation": "disabled",
        "text": {"format": {"type": "text"}},
        "n": 3,  # a chat-completions field: unknown here, so named and never applied
        "foo": 1,
    }
    status, out, headers = _post(server, "/v1/responses", body)
    assert status == 200
    assert headers["x-consequence-ignored-fields"] == "store, metadata, n, foo"
    Response.model_validate(out)
    assert len(out["output"]) == 1 and len(out["token_ids"]) == 3  # one reply of max_output_tokens ids
    assert out["status"] == "incomplete" and out["incomplete_details"] == {"reason": "max_output_tokens"}


@pytest.mark.parametrize(
    "change,param,code",
    [
        ({"truncation": "auto"}, "truncation", "unsupported_parameter"),
        ({"conversation": "conv_1"}, "conversation", "unsupported_parameter"),
        ({"tool_choice": "required"}, "tool_choice", "invalid_value"),  # no tools to call
        ({"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "invalid_value"),
        ({"text": {"format": {"type": "xml"}}}, "text.format", "invalid_value"),
        ({"text": {"format": {"type": "json_schema", "name": "a", "schema": 3}}}, "text.format", "invalid_value"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "invalid_tools"),
        ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]}, "input[0].call_id", None),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0].type", None),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", None),
        ({"max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
        ({"temperature": "hot"}, "temperature", "invalid_type"),
        ({"input": None}, "input", "missing_required_parameter"),
    ],
)
def test_refused_fields_and_values_are_400s_naming_them(setup, change, param, code):
    server, _tok, _tools = setup
    status, out, _ = _post(server, "/v1/responses", {"model": "tiny", "input": "hi"} | change)
    assert status == 400, out
    assert out["error"]["param"] == param and out["error"]["type"] == "invalid_request_error"
    assert out["error"]["code"] == (code or "invalid_value")


def test_every_refused_field_of_the_responses_endpoint_is_a_400_naming_it(setup):
    server, _tok, _tools = setup
    refused = [f for f in compat.FIELDS if compat.RESPONSES in f.endpoints and f.rule == compat.REFUSED]
    assert {f.name for f in refused} >= {"conversation", "prompt"}
    for f in refused:
        value = {"string": "x", "object": {"a": 1}, "array": [1], "integer": 1}[f.types[0]]
        status, out, _ = _post(server, "/v1/responses", {"model": "tiny", "input": "hi", f.name: value})
        assert status == 400 and out["error"]["param"] == f.name, f.name
        assert f.why in out["error"]["message"], f.name


# ---- streaming -----------------------------------------------------------------------------------
def _order(events: list[dict]) -> list[str]:
    """The event types with runs of deltas folded into one."""
    out: list[str] = []
    for e in events:
        if not (out and out[-1] == e["type"] and e["type"].endswith(".delta")):
            out.append(e["type"])
    return out


def test_a_streamed_text_reply_comes_token_by_token_in_the_responses_event_order(setup):
    server, _tok, _tools = setup
    body = {"model": "tiny", "input": "fix add", "max_output_tokens": 12}
    whole = _client(server).responses.create(**body)
    events = _events(server, body)
    for e in events:
        EVENTS.validate_python(e)  # each event parses as the openai package's model of its type
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    last = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert _order(events) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        last,
    ]
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    # how many deltas depends on the machine's load (tokens that arrived together are decoded
    # together: serve.calls._deltas); that they come while sampling runs is
    # test_serve_compat.test_the_first_delta_comes_while_the_reply_is_still_being_sampled
    assert deltas
    assert "".join(deltas) == whole.output_text  # greedy: the same reply
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == whole.output_text
    assert events[-1]["response"]["token_ids"] == whole.model_extra["token_ids"]


def test_a_streamed_function_call_and_the_openai_stream_parser(setup):
    server, _tok, chat_tools = setup
    body = {"model": "tiny", "input": "fix add", "tools": _flat(chat_tools)}
    whole = _client(server).responses.create(**body)
    calls = [o for o in whole.output if o.type == "function_call"]
    assert calls and whole.status == "completed"
    events = _events(server, body)
    for e in events:
        EVENTS.validate_python(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    order = _order(events)
    assert order[:2] == ["response.created", "response.in_progress"] and order[-1] == "response.completed"
    added = [
        j for j, e in enumerate(events) if e["type"] == "response.output_item.added" and e["item"]["type"] != "message"
    ]
    assert len(added) == len(calls)
    for at, call in zip(added, calls):
        assert events[at]["item"]["name"] == call.name and events[at]["item"]["arguments"] == ""
        types = [e["type"] for e in events[at : at + 4]]
        assert types == [
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
        ]
        assert events[at + 1]["delta"] == events[at + 2]["arguments"] == call.arguments
    # the openai package's own stream accumulator rebuilds the same response
    with _client(server).responses.stream(**body) as stream:
        final = stream.get_final_response()
    assert [(o.name, o.arguments) for o in final.output if o.type == "function_call"] == [
        (o.name, o.arguments) for o in calls
    ]
    streamed = list(_client(server).responses.create(**body, stream=True))
    assert [e.type for e in streamed] == [e["type"] for e in events]


# a bounded reply (a boolean): a random model cannot spend its tokens on digits
ANSWER = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


def test_a_named_tool_choice_and_a_json_schema_format_constrain_as_on_chat(setup):
    """The Responses shapes of constrained decoding (flat ``{type, name}``, ``text.format``) sample
    the same ids as their chat-completions shapes at T = 0, and the reply follows them."""
    import jsonschema

    server, _tok, chat_tools = setup
    name = chat_tools[-1]["function"]["name"]
    body = {"model": "tiny", "input": USER, "tools": _flat(chat_tools), "max_output_tokens": 64}
    status, out, _ = _post(server, "/v1/responses", body | {"tool_choice": {"type": "function", "name": name}})
    assert status == 200, out
    Response.model_validate(out)
    assert out["tool_choice"] == {"type": "function", "name": name}  # echoed as given
    calls = [o for o in out["output"] if o["type"] == "function_call"]
    assert [c["name"] for c in calls] == [name]
    spec = chat_tools[-1]["function"]["parameters"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), spec)
    chat = {"model": "tiny", "messages": USER, "tools": chat_tools, "max_tokens": 64}
    status, ref, _ = _post(
        server, "/v1/chat/completions", chat | {"tool_choice": {"type": "function", "function": {"name": name}}}
    )
    assert status == 200 and out["token_ids"] == ref["choices"][0]["token_ids"]

    fmt = {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}
    status, out, _ = _post(
        server, "/v1/responses", {"model": "tiny", "input": "2 + 2?", "max_output_tokens": 32, "text": {"format": fmt}}
    )
    assert status == 200, out
    assert out["text"] == {"format": fmt}
    text = out["output"][0]["content"][0]["text"]
    jsonschema.validate(json.loads(text), ANSWER)
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "2 + 2?"}],
        "max_tokens": 32,
        "response_format": rf,
    }
    status, ref, _ = _post(server, "/v1/chat/completions", chat)
    assert status == 200 and ref["choices"][0]["message"]["content"] == text

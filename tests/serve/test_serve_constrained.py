"""Structured output on /v1/chat/completions (consequence.serve.structured): ``tool_choice``
required / named and ``response_format`` json_object / json_schema constrain the bundled tiny
model's reply, through the real ``openai`` client; the session's record of a constrained reply
passes the trainer's ratio check (docs/agents.md, "Constrained decoding")."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from consequence.config import TrainConfig
from consequence.harness.renderer import Renderer
from consequence.loop.checks import check_ratio
from consequence.loop.learner import logprob_fn
from consequence.policy.tiny import load_policy
from consequence.records import trajectory_to_rows
from consequence.serve.app import BackgroundServer, ServeSettings, create_app, model_context_length
from consequence.serve.protocol import ChatRequest, ServeError
from consequence.serve.structured import grammar_for

BUNDLED = "consequence/assets/tiny-repair"
HI = [{"role": "user", "content": "fix add"}]
ARGS = {
    "type": "object",
    "properties": {"path": {"type": "string", "maxLength": 8}, "verbose": {"type": "boolean"}},
    "required": ["path", "verbose"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "run_tests", "description": "run the tests", "parameters": ARGS}},
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "read a file",
            "parameters": {
                "type": "object",
                "properties": {"line": {"type": "integer", "minimum": 1, "maximum": 500}},
                "required": ["line"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "kind": {"enum": ["add", "sub"]}},
    "required": ["n", "kind"],
    "additionalProperties": False,
}


class Verdict(BaseModel):
    passed: bool
    failures: int = Field(ge=0, le=9)


@pytest.fixture(scope="module")
def policy():
    return load_policy(BUNDLED)


@pytest.fixture(scope="module")
def server(policy):
    model, tok = policy
    settings = ServeSettings("tiny", model_context_length(model), temperature=1.0, max_tokens=64)
    with BackgroundServer(create_app(model, Renderer(tok, []), settings)) as s:
        yield s


def _client(server, session: str = "") -> openai.OpenAI:
    """The stock client, in session ``session`` when one is given."""
    path = f"/s/{session}/v1" if session else "/v1"
    return openai.OpenAI(base_url=server.url + path, api_key="x", max_retries=0)


def _post(server, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        server.url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["T1", "T0"])
def test_json_schema_reply_validates(server, temperature):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    for seed in (1, 2):
        out = _client(server).chat.completions.create(
            model="tiny",
            messages=HI,
            response_format=fmt,
            temperature=temperature,
            seed=seed,  # type: ignore[arg-type]
        )
        choice = out.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)
    # negative control: the same request as text is no JSON
    status, text = _post(server, {"model": "tiny", "messages": HI, "temperature": temperature, "seed": 1})
    assert status == 200
    with pytest.raises(json.JSONDecodeError):
        json.loads(text["choices"][0]["message"]["content"])


def test_openai_parse_with_a_pydantic_model(server):
    out = _client(server).chat.completions.parse(model="tiny", messages=HI, response_format=Verdict, seed=3)
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, Verdict) and 0 <= parsed.failures <= 9


def test_json_object_reply_is_an_object(server):
    out = _client(server).chat.completions.create(
        model="tiny", messages=HI, response_format={"type": "json_object"}, temperature=0.0, max_tokens=200
    )
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content or ""), dict)
    assert (
        _post(server, {"model": "tiny", "messages": HI, "max_tokens": 2, "response_format": {"type": "text"}})[0] == 200
    )


@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["T1", "T0"])
def test_tool_choice_required_gives_a_schema_valid_call(server, temperature):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in (4, 5):
        out = _client(server).chat.completions.create(
            model="tiny",
            messages=HI,
            tools=TOOLS,
            tool_choice="required",
            temperature=temperature,
            seed=seed,  # type: ignore[arg-type]
        )
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        (call,) = choice.message.tool_calls
        assert call.function.name in schemas  # type: ignore[union-attr]
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])  # type: ignore[union-attr]


def test_a_named_function_is_the_one_called(server):
    for name in ("run_tests", "read_file"):
        choice = {"type": "function", "function": {"name": name}}
        out = _client(server).chat.completions.create(
            model="tiny", messages=HI, tools=TOOLS, tool_choice=choice, seed=6
        )  # type: ignore[arg-type]
        (call,) = out.choices[0].message.tool_calls or []
        assert call.function.name == name  # type: ignore[union-attr]


def test_a_constrained_session_record_passes_the_ratio_check(server, policy):
    model, tok = policy
    c = _client(server, "constrained")
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    first = c.chat.completions.create(model="tiny", messages=HI, tools=TOOLS, tool_choice="required", top_p=0.9)
    msg = first.choices[0].message
    history = HI + [
        msg.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "ok"},
    ]  # type: ignore[index]
    c.chat.completions.create(model="tiny", messages=history, response_format=fmt, top_p=0.9)  # type: ignore[arg-type]
    session = server.app.state.serve.sessions.get("constrained", create=False)
    calls = session.trajectory.calls
    assert [k.constrained for k in calls] == [True, True] and all(k.keep_ids for k in calls)
    rows = trajectory_to_rows(session.trajectory)
    assert len(rows) == 1 and rows[0].constrained
    fn = logprob_fn(TrainConfig(top_p=0.9))
    assert check_ratio(model, rows, tok.pad_token_id or 0, fn, 1.0).passed


@pytest.mark.parametrize(
    "change,param,says",
    [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools"}}, "tool_choice", "not supported"),
        ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
            "response_format",
            "llguidance",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"type": "object", "properties": {"b": {"type": "bar"}}}},
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
            "bar",
        ),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(server, change, param, says):
    status, out = _post(server, {"model": "tiny", "messages": HI, "max_tokens": 2} | change)
    assert status == 400 and out["error"]["param"] == param and says in out["error"]["message"], out


def test_tool_calls_are_constrained_in_the_hermes_format_only(policy):
    _model, tok = policy
    req = ChatRequest(model="tiny", tools=TOOLS, required_tool="")
    assert grammar_for(req, Renderer(tok, TOOLS, tool_format="hermes")) is not None
    with pytest.raises(ServeError, match="Hermes format only") as e:
        grammar_for(req, Renderer(tok, TOOLS, tool_format="llama3_json"))
    assert e.value.status == 400 and e.value.param == "tool_choice"
    assert grammar_for(ChatRequest(model="tiny", tools=TOOLS), Renderer(tok, TOOLS)) is None  # auto, text: no grammar

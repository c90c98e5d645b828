"""The agent frameworks, unmodified, against ``consequence serve`` on 127.0.0.1 (docs/agents.md §5, "Agent frameworks").

Each framework runs its default agent loop with one function tool (and its structured output where it
has one) against one loopback server with the bundled tiny model at T = 0. The tiny model's words are
noise; what is checked is the plumbing: every request of the framework's defaults succeeds, the
session's record is token-exactly what went over the wire (each call's ``context_ids`` and
``output_ids`` are the ``prompt_token_ids`` and ``token_ids`` of the response that carried it, in
order), and structured output parses into its schema (constrained decoding makes that hold even for
noise). A framework that is not installed is skipped with the reason (``pip install -e '.[clients]'``).
"""

from __future__ import annotations

import contextlib
import importlib.resources
import json
import urllib.request
from typing import Any, Literal

import pytest
from pydantic import BaseModel, ConfigDict

from consequence.harness.renderer import Renderer
from consequence.policy.tiny import load_policy
from consequence.records import trajectory_to_rows
from consequence.serve.app import BackgroundServer, ServeSettings, create_app, model_context_length

BUNDLED = "consequence/assets/tiny-repair"
MAX_TOKENS = 48  # enough for a constrained Verdict to close, inside a <tool_call> wrapper too
TASK = "fix add: the tests fail"
INSTALL = "not installed: pip install -e '.[clients]'"


class Verdict(BaseModel):
    """The structured-output schema of every framework's test."""

    # closed: no extra keys, no open-ended number (noise fills an integer's digits until the token budget)
    model_config = ConfigDict(extra="forbid")
    passed: bool
    bug: Literal["comparison", "off_by_one", "other"]


def run_tests() -> str:
    """Run the tests on the current code."""
    return "2 passed"


RUN_TESTS = {  # run_tests as a chat-completions tool spec
    "type": "function",
    "function": {
        "name": "run_tests",
        "description": run_tests.__doc__,
        "parameters": {"type": "object", "properties": {}},
    },
}


class WireLog:
    """Pure ASGI middleware keeping, per session, each generation response's body as sent (JSON only),
    with the request's body under ``"request"``.

    Generation paths: ``.../chat/completions`` and ``.../responses``; the session is the ``/s/{id}/`` prefix.
    """

    def __init__(self, app: Any, bodies: dict[str, list[dict]]):
        self.app, self.bodies = app, bodies

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if (
            scope["type"] != "http"
            or not path.startswith("/s/")
            or not path.endswith(("/chat/completions", "/responses"))
        ):
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []
        asked: list[bytes] = []
        status = [0]

        async def read():
            message = await receive()
            asked.append(message.get("body", b""))
            return message

        async def keep(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    # logged before the last byte goes out: once the client has its reply, the test may
                    # read the log (logging after `send` raced the client's next step)
                    self._log(path, status[0], b"".join(chunks), b"".join(asked))
            await send(message)

        await self.app(scope, read, keep)

    def _log(self, path: str, status: int, body: bytes, request: bytes) -> None:
        assert status == 200, (path, status, body[:500])  # every request of the defaults succeeds
        self.bodies.setdefault(path.split("/")[2], []).append(json.loads(body) | {"request": json.loads(request)})


@pytest.fixture(scope="module")
def server():
    model, tok = load_policy(BUNDLED)
    app = create_app(
        model,
        Renderer(tok, []),
        ServeSettings("tiny", model_context_length(model), temperature=0.0, max_tokens=MAX_TOKENS),
    )
    bodies: dict[str, list[dict]] = {}
    app.add_middleware(WireLog, bodies=bodies)  # inside the error handlers: a refusal arrives as its 4xx
    with BackgroundServer(app) as s:
        s.wire = bodies
        yield s


def _base(server, session: str) -> str:
    return f"{server.url}/s/{session}/v1"


def _record(server, session: str) -> dict:
    with urllib.request.urlopen(f"{server.url}/s/{session}/record", timeout=10) as r:
        return json.loads(r.read())


def check_wire(server, session: str, min_calls: int) -> list[dict]:
    """The session's record equals what went over the wire, call by call; returns the record's calls."""
    sent = server.wire.get(session, [])
    calls = _record(server, session)["calls"]
    assert len(calls) == len(sent) >= min_calls, (len(calls), len(sent))
    for body, call in zip(sent, calls):
        ids = body["token_ids"] if body.get("object") == "response" else body["choices"][0]["token_ids"]
        assert ids == call["output_ids"]
        assert body["prompt_token_ids"] == call["context_ids"]
    return calls


# ---- the openai SDK: a tool loop on chat completions, and .parse -----------------------------------------
def test_openai_sdk_tool_loop_and_parse(server):
    openai = pytest.importorskip("openai", reason=f"openai {INSTALL}")
    client = openai.OpenAI(base_url=_base(server, "openai"), api_key="any", max_retries=0)
    tools = [RUN_TESTS]
    messages: list[dict] = [{"role": "user", "content": TASK}]
    first = client.chat.completions.create(model="tiny", messages=messages, tools=tools, tool_choice="required")
    msg = first.choices[0].message
    assert msg.tool_calls and all(c.function.name == "run_tests" for c in msg.tool_calls)  # constrained
    messages.append(msg.model_dump(exclude_none=True))
    messages += [{"role": "tool", "tool_call_id": c.id, "content": run_tests()} for c in msg.tool_calls]
    client.chat.completions.create(model="tiny", messages=messages, tools=tools)
    calls = check_wire(server, "openai", 2)
    assert _record(server, "openai")["prefix_breaks"] == 0  # the SDK sends the reply back as returned

    parsed = openai.OpenAI(base_url=_base(server, "openai-parse"), api_key="any", max_retries=0).chat.completions.parse(
        model="tiny", messages=[{"role": "user", "content": TASK}], response_format=Verdict
    )
    assert isinstance(parsed.choices[0].message.parsed, Verdict)
    check_wire(server, "openai-parse", 1)
    assert len(calls) == 2


# ---- openai-agents: its default model is the Responses API --------------------------------------------
def test_openai_agents_default_runner_on_the_responses_api(server):
    agents = pytest.importorskip("agents", reason=f"openai-agents {INSTALL}")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=_base(server, "openai-agents"), api_key="any", max_retries=0)
    agent = agents.Agent(
        name="repair",
        instructions="Fix the code.",
        tools=[agents.function_tool(run_tests)],
        # a named tool_choice, kept on every turn: the tiny model, left free, calls its training tools
        # (`finish`), which this agent does not have; constrained, each turn is a call of run_tests
        model_settings=agents.ModelSettings(tool_choice="run_tests", max_tokens=MAX_TOKENS),
        reset_tool_choice=False,
    )
    config = agents.RunConfig(model_provider=agents.OpenAIProvider(openai_client=client), model="tiny")
    with pytest.raises(agents.MaxTurnsExceeded) as ended:  # two turns, each a tool call and its output
        agents.Runner.run_sync(agent, TASK, run_config=config, max_turns=2)
    items = ended.value.run_data.new_items
    assert [i.output for i in items if isinstance(i, agents.ToolCallOutputItem)][:2] == ["2 passed", "2 passed"]
    check_wire(server, "openai-agents", 2)
    assert all(b["object"] == "response" for b in server.wire["openai-agents"])  # POST /v1/responses
    assert _record(server, "openai-agents")["prefix_breaks"] == 0

    structured = agents.Agent(
        name="judge", output_type=Verdict, model_settings=agents.ModelSettings(max_tokens=MAX_TOKENS)
    )
    client2 = AsyncOpenAI(base_url=_base(server, "openai-agents-out"), api_key="any", max_retries=0)
    config2 = agents.RunConfig(model_provider=agents.OpenAIProvider(openai_client=client2), model="tiny")
    out = agents.Runner.run_sync(structured, TASK, run_config=config2, max_turns=1)
    assert isinstance(out.final_output, Verdict)
    check_wire(server, "openai-agents-out", 1)
    assert server.wire["openai-agents-out"][0]["request"]["text"]["format"]["type"] == "json_schema"


# ---- smolagents: tool_choice "required", tool results sent back as text turns --------------------------
def test_smolagents_tool_calling_agent(server):
    smolagents = pytest.importorskip("smolagents", reason=f"smolagents {INSTALL}")

    model = smolagents.OpenAIServerModel(
        model_id="tiny", api_base=_base(server, "smolagents"), api_key="any", max_tokens=MAX_TOKENS
    )
    # smolagents' own system prompt is ~1,900 tokens, beyond the tiny model's 1,024: a short one, the rest as shipped
    import yaml  # smolagents' own dependency

    templates = yaml.safe_load(
        importlib.resources.files("smolagents.prompts").joinpath("toolcalling_agent.yaml").read_text()
    )
    templates["system_prompt"] = "Fix the code with the tools."
    agent = smolagents.ToolCallingAgent(
        tools=[smolagents.tool(run_tests)], model=model, max_steps=2, verbosity_level=0, prompt_templates=templates
    )
    agent.run(TASK)
    sent = server.wire["smolagents"]
    calls = check_wire(server, "smolagents", 2)
    assert [b["request"]["tool_choice"] for b in sent[:2]] == ["required", "required"]
    assert all(b["choices"][0]["message"]["tool_calls"] for b in sent[:2])  # constrained: a call every step
    # each step re-sends the earlier calls and their results as text turns ("Calling tools: ...",
    # "Observation: ..."), not the tokens sampled: every later call is a prefix break, a new training row
    assert "Calling tools:" in sent[1]["request"]["messages"][2]["content"][0]["text"]
    assert _record(server, "smolagents")["prefix_breaks"] == len(calls) - 1
    session = server.app.state.serve.sessions.get("smolagents", create=False)
    assert len(trajectory_to_rows(session.trajectory)) == len(calls)


# ---- langchain-openai: bind_tools loop, use_responses_api, with_structured_output (three methods) ----
def test_langchain_openai_tools_responses_and_structured_output(server):
    lc = pytest.importorskip("langchain_openai", reason=f"langchain-openai {INSTALL}")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    lc_tool = tool(run_tests)
    for session, responses in (("langchain", False), ("langchain-responses", True)):
        llm = lc.ChatOpenAI(
            model="tiny",
            base_url=_base(server, session),
            api_key="any",
            max_tokens=MAX_TOKENS,
            temperature=0,
            max_retries=0,
            use_responses_api=responses,
        )
        bound = llm.bind_tools([lc_tool], tool_choice="any")
        messages: list[Any] = [HumanMessage(TASK)]
        ai = bound.invoke(messages)
        assert ai.tool_calls and ai.tool_calls[0]["name"] == "run_tests"
        messages += [ai] + [ToolMessage(lc_tool.invoke(c["args"]), tool_call_id=c["id"]) for c in ai.tool_calls]
        llm.bind_tools([lc_tool]).invoke(messages)
        check_wire(server, session, 2)
        assert all((b["object"] == "response") == responses for b in server.wire[session])

    for method in ("function_calling", "json_mode", "json_schema"):
        session = f"langchain-{method}"
        llm = lc.ChatOpenAI(
            model="tiny", base_url=_base(server, session), api_key="any", max_tokens=MAX_TOKENS, max_retries=0
        )
        got = llm.with_structured_output(Verdict, method=method, include_raw=True).invoke(TASK)
        if method == "json_mode":  # {"type": "json_object"}: any object (the schema would go in the prompt)
            assert isinstance(json.loads(got["raw"].content), dict)
        else:  # the schema itself is sent (a named tool, or json_schema): constrained into it
            assert isinstance(got["parsed"], Verdict), (method, got)
        check_wire(server, session, 1)


# ---- pydantic-ai: Agent("openai:...") with a tool and output_type -------------------------------------
def test_pydantic_ai_agent_with_a_tool_and_an_output_type(server, monkeypatch):
    pydantic_ai = pytest.importorskip("pydantic_ai", reason=f"pydantic-ai-slim[openai] {INSTALL}")
    monkeypatch.setenv("OPENAI_BASE_URL", _base(server, "pydantic-ai"))
    monkeypatch.setenv("OPENAI_API_KEY", "any")
    settings = {"max_tokens": MAX_TOKENS}
    # a tool and text output: the loop runs the tool call and sends its result back (or ends on text)
    agent = pydantic_ai.Agent("openai:tiny", tools=[run_tests], model_settings=settings)
    # the tiny model keeps calling tools, or calls its training tools (a retry prompt, then this): ended
    with contextlib.suppress(pydantic_ai.UsageLimitExceeded, pydantic_ai.UnexpectedModelBehavior):
        agent.run_sync(TASK, usage_limits=pydantic_ai.UsageLimits(request_limit=2))
    check_wire(server, "pydantic-ai", 2)
    # output_type: a required tool call of final_result, constrained to the schema
    monkeypatch.setenv("OPENAI_BASE_URL", _base(server, "pydantic-ai-out"))
    judge = pydantic_ai.Agent("openai:tiny", output_type=Verdict, model_settings=settings)
    assert isinstance(judge.run_sync(TASK, usage_limits=pydantic_ai.UsageLimits(request_limit=1)).output, Verdict)
    check_wire(server, "pydantic-ai-out", 1)
    # "openai:" is the Responses API; output_type without text output makes the final_result call required
    assert {b["object"] for b in server.wire["pydantic-ai"] + server.wire["pydantic-ai-out"]} == {"response"}
    assert server.wire["pydantic-ai-out"][0]["request"]["tool_choice"] == "required"


# ---- litellm: completion with tools, and response_format ----------------------------------------------
def test_litellm_tool_loop_and_response_format(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list at import
    litellm = pytest.importorskip("litellm", reason=f"litellm {INSTALL}")
    kw = {"model": "openai/tiny", "api_base": _base(server, "litellm"), "api_key": "any", "max_tokens": MAX_TOKENS}
    tools = [RUN_TESTS]
    messages: list[Any] = [{"role": "user", "content": TASK}]
    first = litellm.completion(messages=messages, tools=tools, tool_choice="required", **kw)
    msg = first.choices[0].message
    assert msg.tool_calls
    messages.append(msg.model_dump(exclude_none=True))
    messages += [{"role": "tool", "tool_call_id": c.id, "content": run_tests()} for c in msg.tool_calls]
    litellm.completion(messages=messages, tools=tools, **kw)
    check_wire(server, "litellm", 2)

    kw["api_base"] = _base(server, "litellm-format")
    out = litellm.completion(messages=[{"role": "user", "content": TASK}], response_format=Verdict, **kw)
    Verdict.model_validate_json(out.choices[0].message.content)
    check_wire(server, "litellm-format", 1)
    assert server.wire["litellm-format"][0]["request"]["response_format"]["type"] == "json_schema"


# ---- train --agent with the openai-agents example ------------------------------------------------------
def test_train_with_the_openai_agents_example(tmp_path, monkeypatch):
    """`consequence train --agent` with examples/openai_agents_sdk: one iteration, the pre-step checks
    pass on trajectories recorded through the Responses API, and the metrics count the stored calls."""
    pytest.importorskip("agents", reason=f"openai-agents {INSTALL}")
    from typer.testing import CliRunner

    from consequence.cli import app
    from consequence.records import read_trajectories

    monkeypatch.setenv("CONSEQUENCE_LEDGER", str(tmp_path / "ledger.jsonl"))
    run = tmp_path / "run"
    args = "--iterations 1 --tasks-per-iteration 2 --group-size 2 --eval-every 0 --final-eval-episodes 0"
    args += " --max-turns 3 --max-new-tokens 32"
    res = CliRunner().invoke(
        app,
        ["train", "--agent", "examples/openai_agents_sdk/agent.py:agent", *args.split(), "--run-dir", str(run)],
        env={"COLUMNS": "250"},
    )
    assert res.exit_code == 0, res.output
    m = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    trajs = read_trajectories(run / "trajectories" / "iter_0000.parquet")
    assert len(trajs) == 4 and m["agent_calls"] == sum(len(t.calls) for t in trajs) > 0
    assert m["agent_prefix_breaks"] == 0  # the SDK sends each reply back as its output items, unchanged
    checks = json.loads((run / "manifest.json").read_text())["checks"]
    assert checks["skipped"] is False and all(c["passed"] for c in checks["results"]), checks
    assert {c["name"] for c in checks["results"]} >= {"ratio", "mask", "groups"}

"""The OpenAI chat-completions wire format: requests checked, messages normalised, responses built.

A request is checked completely before anything is sampled: every field is applied,
refused with an OpenAI-style JSON error (``{"error": {"message", "type", "param",
"code"}}``) and a 4xx status, or, when it cannot change what is sampled, accepted and
named as ignored (the rules: ``serve.compat``). Messages are normalised to the
harness's own shape (the one :class:`~consequence.harness.renderer.Renderer` renders and
``rollout.episodes`` builds), so that a history the agent sends back compares equal to
what the harness would hold: tool-call arguments as dicts, a tool result named by the
call it answers, text parts joined.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from consequence.harness.tools import check_tool_specs
from consequence.serve import compat

MAX_N = 16
MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
# chat_template_kwargs may not set what the renderer itself passes to the template
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "conversation", "tools", "tokenize", "add_generation_prompt", "continue_final_message", "return_dict"}
)


class ServeError(Exception):
    """A request the server refuses: an HTTP status and an OpenAI-style error body.

    Args:
        status: HTTP status (4xx for a bad request, 503 while shutting down).
        message: what was wrong and how to fix it.
        param: the request field at fault, if one.
        code: a short machine-readable code (``model_not_found``, ``context_length_exceeded``, …).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        """The JSON error body: ``invalid_request_error`` below 500, else ``server_error``."""
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ServeError:
    """A 400 ``invalid_request_error``."""
    return ServeError(400, message, param, code)


@dataclass
class SamplingRequest:
    """What a checked request of either endpoint asks of the sampler and of the response.

    Attributes:
        model: the served name the request gave (the response carries it).
        temperature, top_p, top_k: ``None`` when not given (the server's setting applies);
            ``top_k`` 0 is off (vLLM's -1 is read as 0).
        max_tokens: ``max_tokens`` / ``max_completion_tokens``; ``None`` when not given.
        n: choices to sample (1 to 16).
        stop: stop strings (at most 4).
        seed: sample alone with this seed (``None``: the shared generator).
        top_logprobs: alternatives per sampled token to return (0 to 20).
        stream, include_usage: stream server-sent events; add a usage chunk.
        ignored: the fields given that cannot change what is sampled (``serve.compat``).
    """

    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False
    ignored: list[str] = field(default_factory=list)


@dataclass
class ChatRequest(SamplingRequest):
    """A checked ``/v1/chat/completions`` request.

    Attributes:
        messages: normalised messages (:func:`normalise_messages`).
        tools: the tool specs (checked by ``harness.tools.check_tool_specs``), ``[]`` for none.
        parse_tools: ``tool_choice`` is ``"auto"``, ``"required"`` or a named function (tool
            calls are parsed out of the reply), ``False`` for ``"none"`` (the reply is text).
        required_tool: the reply must be a tool call (constrained decoding,
            ``serve.structured``): ``""`` a call of any declared tool (``tool_choice``
            ``"required"``), a name a call of that tool (a named function); ``None``: not required.
        response_schema: the JSON schema the reply must follow (``response_format``
            ``json_schema``; ``json_object``: ``{"type": "object"}``), ``None`` for text.
        logprobs: return the sampled tokens' log-probs in ``choices[].logprobs``.
        template_kwargs: extra chat-template variables (``chat_template_kwargs`` and the
            ``template`` fields the template reads, ``serve.compat``).
    """

    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict] = field(default_factory=list)
    parse_tools: bool = True
    required_tool: str | None = None
    response_schema: dict[str, Any] | None = None
    logprobs: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)


def parse_request(body: Any, served: str | Sequence[str], template_reads: Collection[str] = ()) -> ChatRequest:
    """Check a request body and return it as a :class:`ChatRequest`.

    Args:
        body: the decoded JSON body.
        served: the served model name(s).
        template_reads: the ``template`` fields of ``serve.compat`` the chat template reads.

    Raises:
        ServeError: 404 for a model not served; 400 for a refused field or value, a value
            out of range, malformed messages or tool specs.
    """
    check_body_types(body)
    req = ChatRequest(model="")
    template = read_sampling(body, req, compat.CHAT, served, template_reads)
    req.messages = normalise_messages(body.get("messages"))
    req.tools = _tools(body.get("tools"))
    req.parse_tools, req.required_tool = chat_tool_choice(body.get("tool_choice"), req.tools)
    req.response_schema = response_schema(body.get("response_format"))
    req.logprobs = body.get("logprobs") is True
    if req.top_logprobs and not req.logprobs:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
    req.template_kwargs = _template_kwargs(body.get("chat_template_kwargs")) | {k: body[k] for k in template}
    return req


def read_sampling(
    body: dict[str, Any], req: SamplingRequest, endpoint: str, served: str | Sequence[str], template_reads=()
) -> list[str]:
    """Fill ``req``'s sampling fields from ``body`` (types already checked) and sort the
    other fields by ``serve.compat``; the ``template`` fields given that go to the template.
    Only the fields the table honours on ``endpoint`` are read (``n`` sent to
    ``/v1/responses`` is an unknown field there: named as ignored, and so never applied).

    Raises:
        ServeError: 404 for a model not served; 400 for a refused field or value, or a
            value out of range.
    """
    names = [served] if isinstance(served, str) else list(served)
    try:
        req.ignored, template = compat.apply(body, endpoint, set(template_reads))
    except compat.Refused as e:
        raise bad(str(e), e.field, "unsupported_parameter") from None
    if body.get("model") not in names:
        raise ServeError(
            404,
            f"the model {body.get('model')!r} does not exist; this server serves "
            f"{', '.join(map(repr, names))} (GET /v1/models)",
            "model",
            "model_not_found",
        )
    req.model = body["model"]
    table = compat.fields(endpoint)
    body = {k: v for k, v in body.items() if k in table and table[k].rule == compat.HONOURED}
    req.temperature = _number(body, "temperature", 0.0, 2.0)
    req.top_p = _number(body, "top_p", 0.0, 1.0, low_open=True)
    top_k = _int(body, "top_k", -1, 2**31 - 1)
    req.top_k = None if top_k is None else max(top_k, 0)  # vLLM's -1 (and 0) = off
    if endpoint == compat.RESPONSES:
        req.max_tokens = _int(body, "max_output_tokens", 1, 2**31 - 1)
    else:
        req.max_tokens = _max_tokens(body)
    req.n = _int(body, "n", 1, MAX_N) or 1
    req.stop = _stop(body.get("stop"))
    req.seed = _int(body, "seed", -(2**63), 2**63 - 1)
    key = "top_logprobs" if endpoint == compat.CHAT else "logprobs"
    req.top_logprobs = _int(body, key, 0, MAX_TOP_LOGPROBS) or 0
    req.stream = body.get("stream") is True
    req.include_usage = (body.get("stream_options") or {}).get("include_usage") is True
    return template


def _template_kwargs(kwargs: Any) -> dict[str, Any]:
    """``chat_template_kwargs`` (an object, types checked): its variables, reserved names refused."""
    taken = sorted(set(kwargs or {}) & RESERVED_TEMPLATE_KWARGS)
    if taken:
        raise bad(
            f"chat_template_kwargs may not set {', '.join(taken)}: the server renders the messages and tools itself",
            "chat_template_kwargs",
            "invalid_value",
        )
    return dict(kwargs or {})


def _tools(tools: Any) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad("tools must be a list of function specs", "tools", "invalid_tools")
    try:
        check_tool_specs(tools)
    except (ValueError, AttributeError) as e:
        raise bad(f"bad tool schema: {e}", "tools", "invalid_tools") from None
    return tools


def _tool_choice(choice: Any) -> bool:
    if choice in (None, "auto"):
        return True
    if choice == "none":
        return False
    raise bad(
        f"tool_choice {choice!r} is not supported: the sampler does not constrain decoding; use "
        "'auto' (tool calls are parsed from the reply) or 'none'",
        "tool_choice",
        "unsupported_parameter",
    )


def chat_tool_choice(choice: Any, tools: list[dict]) -> tuple[bool, str | None]:
    """``(parse_tools, required_tool)`` of a chat ``tool_choice`` (see :class:`ChatRequest`):
    ``auto`` / ``none``, ``required``, or ``{"type": "function", "function": {"name": ...}}``.

    Raises:
        ServeError: 400 for another value, a required call without tools, or a name that is
            not one of ``tools``.
    """
    if choice in (None, "auto", "none"):
        return _tool_choice(choice), None
    if choice == "required":
        name = ""
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not isinstance(name, str) or not name:
            raise bad("tool_choice.function.name must be a tool's name", "tool_choice", "invalid_value")
    else:
        raise bad(
            f"tool_choice {json.dumps(choice)[:80]} is not supported: give 'auto', 'none', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
            "invalid_value",
        )
    declared = [t.get("function", t).get("name") for t in tools]
    if not declared:
        raise bad(
            f"tool_choice {json.dumps(choice)[:80]} needs tools: declare the tools the reply must call",
            "tool_choice",
            "invalid_value",
        )
    if name and name not in declared:
        raise bad(
            f"tool_choice names {name!r}, which is not a declared tool ({', '.join(map(repr, declared))})",
            "tool_choice",
            "invalid_value",
        )
    return True, name


def response_schema(fmt: Any) -> dict[str, Any] | None:
    """The JSON schema a ``response_format`` asks the reply to follow (``None``: text).

    ``{"type": "text"}`` → ``None``; ``{"type": "json_object"}`` → ``{"type": "object"}``;
    ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` → its ``schema``
    (``strict`` is read as true: the grammar enforces every keyword the engine supports and
    refuses a schema with others).

    Raises:
        ServeError: 400 for another type, or a ``json_schema`` without a ``schema`` object.
    """
    if fmt is None or fmt == {} or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "object"}
    if fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad(
                "response_format.json_schema.schema must be a JSON schema (an object)",
                "response_format",
                "invalid_value",
            )
        return schema
    raise bad(
        f"response_format.type {fmt.get('type')!r} is not supported: give text, json_object or json_schema",
        "response_format",
        "invalid_value",
    )


def _number(body: dict, key: str, low: float, high: float, low_open: bool = False) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (low < v if low_open else low <= v) or v > high:
        raise bad(
            f"{key} must be a number in {'(' if low_open else '['}{low}, {high}], got {v!r}", key, "invalid_value"
        )
    return float(v)


def _int(body: dict, key: str, low: int, high: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise bad(f"{key} must be an integer in [{low}, {high}], got {v!r}", key, "invalid_value")
    return v


def _max_tokens(body: dict) -> int | None:
    a, b = body.get("max_tokens"), body.get("max_completion_tokens")
    for key, v in (("max_tokens", a), ("max_completion_tokens", b)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise bad(f"{key} must be a positive integer, got {v!r}", key, "invalid_value")
    if a is not None and b is not None and a != b:
        raise bad(
            f"max_tokens ({a}) and max_completion_tokens ({b}) differ; give one of them",
            "max_completion_tokens",
            "invalid_value",
        )
    return a if a is not None else b


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise bad(f"stop must be a non-empty string or a list of at most {MAX_STOP} of them", "stop", "invalid_value")
    return list(stops)


# ---- types -------------------------------------------------------------------------
# The JSON type every field may have (``None`` is always allowed: the field is then left
# out). The whole body is checked against these tables before any value is read, so a
# wrong type is a 400 naming its field, never an exception deeper in the server. The
# body's own fields are typed in ``serve.compat``'s table.
_NUM, _INT, _STR, _BOOL, _OBJ, _LIST = "number", "integer", "string", "boolean", "object", "array"
_FieldTypes = dict[str, tuple[str, ...]]  # field name -> the JSON types it may have
_STREAM_OPTIONS_TYPES: _FieldTypes = {"include_usage": (_BOOL,)}
_MESSAGE_TYPES: _FieldTypes = {
    "role": (_STR,),
    "content": (_STR, _LIST),
    "name": (_STR,),
    "tool_call_id": (_STR,),
    "tool_calls": (_LIST,),
    "refusal": (_STR,),
}
_PART_TYPES: _FieldTypes = {"type": (_STR,), "text": (_STR,)}
_CALL_TYPES: _FieldTypes = {"id": (_STR,), "type": (_STR,), "function": (_OBJ,)}
_CALL_FUNCTION_TYPES: _FieldTypes = {"name": (_STR,), "arguments": (_STR, _OBJ)}
_TOOL_TYPES: _FieldTypes = {"type": (_STR,), "function": (_OBJ,)}
_TOOL_FUNCTION_TYPES: _FieldTypes = {"name": (_STR,), "description": (_STR,), "parameters": (_OBJ,), "strict": (_BOOL,)}
_REQUIRED = {
    compat.CHAT: ("model", "messages"),
    compat.COMPLETIONS: ("model", "prompt"),
    compat.RESPONSES: ("model", "input"),
}


def _is(value: Any, kind: str) -> bool:
    """``value`` has the JSON type ``kind`` (``true`` is no number, ``1.0`` no integer)."""
    if kind == _NUM:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == _INT:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, {_STR: str, _BOOL: bool, _OBJ: dict, _LIST: list}[kind])


def _check_types(obj: Any, types: _FieldTypes, where: str) -> None:
    """``obj`` is a JSON object whose listed fields have their types (others are not looked at here).

    Raises:
        ServeError: 400 ``invalid_type``, ``param`` the field's path (``messages[2].tool_call_id``).
    """
    if not isinstance(obj, dict):
        raise bad(f"{where} must be a JSON object, got {_json_type(obj)}", where, "invalid_type")
    for key, kinds in types.items():
        v = obj.get(key)
        if v is not None and not any(_is(v, k) for k in kinds):
            path = f"{where}.{key}" if where else key
            raise bad(
                f"{path} must be {' or '.join('an ' + k if k[0] in 'aeiou' else 'a ' + k for k in kinds)}, "
                f"got {_json_type(v)} {json.dumps(v)[:60]}",
                path,
                "invalid_type",
            )


def _json_type(v: Any) -> str:
    """The JSON name of a decoded value's type (for error messages)."""
    for kind in (_BOOL, _INT, _NUM, _STR, _OBJ, _LIST):
        if _is(v, kind):
            return kind
    return "null" if v is None else type(v).__name__


def check_body_types(body: Any, endpoint: str = compat.CHAT) -> None:
    """Check the type of every field the server reads, down to tool specs, messages,
    content parts and tool calls; and that ``model`` and ``messages`` (chat) or ``prompt``
    (completions) are given.

    Raises:
        ServeError: 400 ``invalid_type`` or ``missing_required_parameter`` naming the field.
    """
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    for key in _REQUIRED[endpoint]:
        if body.get(key) is None:
            raise bad(f"missing required parameter: {key!r}", key, "missing_required_parameter")
    _check_types(body, compat.types(endpoint), "")
    if body.get("stream_options") is not None:
        _check_types(body["stream_options"], _STREAM_OPTIONS_TYPES, "stream_options")
    if endpoint != compat.CHAT:
        return
    for i, spec in enumerate(body.get("tools") or []):
        _check_types(spec, _TOOL_TYPES, f"tools[{i}]")
        if spec.get("function") is not None:
            _check_types(spec["function"], _TOOL_FUNCTION_TYPES, f"tools[{i}].function")
    for i, m in enumerate(body["messages"]):
        _check_message_types(m, f"messages[{i}]")


def _check_message_types(m: Any, where: str) -> None:
    _check_types(m, _MESSAGE_TYPES, where)
    if isinstance(m.get("content"), list):
        for j, part in enumerate(m["content"]):
            _check_types(part, _PART_TYPES, f"{where}.content[{j}]")
    for j, call in enumerate(m.get("tool_calls") or []):
        _check_types(call, _CALL_TYPES, f"{where}.tool_calls[{j}]")
        if call.get("function") is not None:
            _check_types(call["function"], _CALL_FUNCTION_TYPES, f"{where}.tool_calls[{j}].function")


# ---- messages ----------------------------------------------------------------------
def _text(content: Any, where: str, kinds: tuple[str, ...] = ("text",)) -> str:
    """Message content as text: a string, ``None`` (empty) or a list of parts whose ``type``
    is one of ``kinds`` (chat: ``text``; responses: ``input_text``, ``output_text``)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    for j, p in enumerate(content):  # a list of objects (check_body_types)
        if p.get("type") not in kinds:
            raise bad(
                f"{where}.content[{j}].type is {p.get('type')!r}: content must be a string or a list of "
                f"{' / '.join(kinds)} parts (images and audio are not supported)",
                f"{where}.content[{j}].type",
                "invalid_value",
            )
    return "".join(p.get("text") or "" for p in content)


def _arguments(raw: Any) -> Any:
    """Tool-call arguments as the harness holds them: a dict (the OpenAI wire sends a JSON string)."""
    if isinstance(raw, str):
        try:
            return json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            return raw  # kept as sent: it can never equal a parsed call, so such a history breaks the row
    return raw if raw is not None else {}


def normalise_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI messages → the harness's messages (pure).

    system / developer → ``{"role": "system", "content"}``; user → ``{"role": "user",
    "content"}``; assistant → ``{"role": "assistant", "content"}`` plus ``tool_calls`` as
    ``[{"type": "function", "function": {"name", "arguments": dict}}]`` when it has any;
    tool → ``{"role": "tool", "name", "content"}``, the name taken from the message or
    from the earlier assistant call whose ``id`` its ``tool_call_id`` gives.

    Raises:
        ServeError: 400 for an empty list, an unknown role, non-text content, or a tool
            message whose call cannot be found.
    """
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages", "invalid_value")
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", "messages", "invalid_value")
        role = m.get("role")
        if m.get("content") is None and role in ("system", "developer", "user", "tool"):
            raise bad(
                f"messages[{i}]: a {role} message needs content (a string or a list of text parts)",
                f"messages[{i}].content",
                "invalid_value",
            )
        content = _text(m.get("content"), f"messages[{i}]")
        if role in ("system", "developer", "user"):
            out.append({"role": "user" if role == "user" else "system", "content": content})
        elif role == "assistant":
            out.append(_assistant(m, content, names, i))
        elif role == "tool":
            name = m.get("name") or names.get(m.get("tool_call_id") or "")
            if not name:
                raise bad(
                    f"messages[{i}]: a tool message needs the tool_call_id of an earlier assistant tool call "
                    f"(got {m.get('tool_call_id')!r})",
                    f"messages[{i}].tool_call_id",
                    "invalid_value",
                )
            out.append({"role": "tool", "name": name, "content": content})
        else:
            raise bad(
                f"messages[{i}].role: unknown role {role!r}; use system, developer, user, assistant or tool",
                f"messages[{i}].role",
                "invalid_value",
            )
    return out


def _assistant(m: dict, content: str, names: dict[str, str], i: int) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    calls = []
    for j, c in enumerate(m.get("tool_calls") or []):  # objects with typed fields (check_body_types)
        fn = c.get("function") or {}
        if not fn.get("name"):
            raise bad(
                f"messages[{i}].tool_calls[{j}]: each tool call needs function.name",
                f"messages[{i}].tool_calls[{j}].function.name",
                "invalid_value",
            )
        if c.get("id"):
            names[c["id"]] = fn["name"]
        calls.append(
            {"type": "function", "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments"))}}
        )
    if calls:
        msg["tool_calls"] = calls
    return msg


# ---- responses ---------------------------------------------------------------------
@dataclass
class Choice:
    """One sampled choice as the server returns it.

    Attributes:
        message: the assistant message (harness shape, from ``Renderer.parse``).
        finish_reason: ``stop``, ``length`` or ``tool_calls``.
        token_ids: the sampled ids (end-of-turn included when sampled).
        token_logprobs: the sampler's log μ of each sampled id.
        tokens: each sampled id decoded alone (for the ``logprobs`` field).
        top: per sampled id, the most probable ``(token text, log-prob)`` under the
            distribution it was sampled from (``top_logprobs``); ``[]`` when not asked.
    """

    message: dict[str, Any]
    finish_reason: str
    token_ids: list[int]
    token_logprobs: list[float]
    tokens: list[str]
    top: list[list[tuple[str, float]]] = field(default_factory=list)


def wire_message(message: dict[str, Any], call_ids: list[str]) -> dict[str, Any]:
    """The harness's assistant message in the OpenAI shape (arguments as JSON strings, call ids)."""
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content") or None}
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [
            {
                "id": cid,
                "type": "function",
                "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])},
            }
            for cid, c in zip(call_ids, calls)
        ]
    return out


def _logprobs(ch: Choice) -> dict[str, Any]:
    tops = ch.top or [[] for _ in ch.tokens]
    return {
        "content": [
            {
                "token": t,
                "logprob": lp,
                "bytes": list(t.encode()),
                "top_logprobs": [{"token": a, "logprob": alp, "bytes": list(a.encode())} for a, alp in top],
            }
            for t, lp, top in zip(ch.tokens, ch.token_logprobs, tops)
        ]
    }


def completion(
    req: ChatRequest, choices: list[Choice], call_ids: list[list[str]], prompt_ids: list[int]
) -> dict[str, Any]:
    """The ``chat.completion`` object, plus vLLM-style ``prompt_token_ids`` and, per choice,
    ``token_ids`` and ``token_logprobs``."""
    out_choices = []
    for k, (ch, ids) in enumerate(zip(choices, call_ids)):
        out_choices.append(
            {
                "index": k,
                "message": wire_message(ch.message, ids),
                "finish_reason": ch.finish_reason,
                "logprobs": _logprobs(ch) if req.logprobs else None,
                "token_ids": ch.token_ids,
                "token_logprobs": ch.token_logprobs,
            }
        )
    return {
        "id": "chatcmpl-" + uuid.uuid4().hex,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": out_choices,
        "usage": usage(prompt_ids, choices),
        "prompt_token_ids": prompt_ids,
    }


def usage(prompt_ids: list[int], choices: list[Choice]) -> dict[str, int]:
    """The ``usage`` object: prompt tokens, sampled tokens over all choices, their sum."""
    done = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": done, "total_tokens": len(prompt_ids) + done}

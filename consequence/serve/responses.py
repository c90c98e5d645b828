"""The OpenAI Responses wire format (``POST /v1/responses``): items in, a ``response`` object out.

The subset agent frameworks use (openai-agents' default model, pydantic-ai's
``openai:`` models, LangChain's ``use_responses_api``), mapped onto the chat-completions
path so that sampling and the session record are the same code (``serve.calls``):

* ``input`` (a string: one user message; or a list of items) and ``instructions`` become
  the chat messages ``serve.protocol`` normalises: ``instructions`` a system message
  first; a message item ``{role, content}`` (content a string or ``input_text`` /
  ``output_text`` parts) that message; a ``function_call`` item ``{call_id, name,
  arguments}`` a tool call of the assistant message before it (or of a new one); a
  ``function_call_output`` item ``{call_id, output}`` a tool message answering that call.
  So a history that sends the response's output items back continues the sampled ids
  exactly as a chat history does (docs/agents.md §3);
* ``tools``: function tools in the flat Responses shape ``{type, name, description,
  parameters, strict}``; any other tool type is refused;
* ``previous_response_id``: the server keeps, per session (and, for calls outside a
  session, server-wide), the conversation of the last :data:`MAX_KEPT` responses it
  returned (input items and output items, without the instructions: OpenAI does not carry
  those over); a request naming one continues it with its own ``input``. An id the server
  does not hold is a 400 naming the field;
* every other field is sorted by ``serve.compat`` (endpoint ``responses``).

The response is OpenAI's ``response`` object (``output``: a ``message`` item with one
``output_text`` part when the reply has text or no tool call, then one ``function_call``
item per tool call; ``status`` ``incomplete`` with ``incomplete_details.reason``
``max_output_tokens`` when the reply was cut), plus vLLM-style ``prompt_token_ids``,
``token_ids`` and ``token_logprobs``. Streamed, it is the Responses event sequence
(:class:`Events`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from consequence.serve import compat, streaming
from consequence.serve.protocol import (
    _BOOL,
    _LIST,
    _OBJ,
    _STR,
    ChatRequest,
    Choice,
    ServeError,
    _check_types,
    _FieldTypes,
    _text,
    _tools,
    bad,
    chat_tool_choice,
    check_body_types,
    normalise_messages,
    read_sampling,
    response_schema,
    wire_message,
)

MAX_KEPT = 1024  # responses kept per session for previous_response_id (older ones are forgotten)
_ITEM_TYPES: _FieldTypes = {
    "type": (_STR,),
    "role": (_STR,),
    "content": (_STR, _LIST),
    "call_id": (_STR,),
    "name": (_STR,),
    "arguments": (_STR,),
    "output": (_STR, _LIST),
}
_PART_TYPES: _FieldTypes = {"type": (_STR,), "text": (_STR,)}
_TOOL_TYPES: _FieldTypes = {
    "type": (_STR,),
    "name": (_STR,),
    "description": (_STR,),
    "parameters": (_OBJ,),
    "strict": (_BOOL,),
}
_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass
class ResponsesRequest(ChatRequest):
    """A checked ``/v1/responses`` request: a chat request (``messages``, ``tools``, the
    sampling fields, ``max_tokens`` from ``max_output_tokens``) plus what the response echoes.

    Attributes:
        response_id: the id its response will carry (``resp_`` + 32 hex digits).
        created_at: when it arrived (Unix seconds; the response's ``created_at``).
        conversation: the previous response's conversation, then this input, as
            chat-completions wire messages (without the instructions): what a later
            ``previous_response_id`` naming this response continues.
        instructions: the system text given, else ``None``.
        previous_response_id: the response continued, else ``None``.
        response_tools: the tools as given (flat Responses shape).
        tool_choice: as given (``auto`` when absent): ``auto``, ``none``, ``required`` or
            ``{"type": "function", "name": ...}``; echoed in the response.
        text_format: ``text.format`` as given (``{"type": "text"}`` when absent); echoed.
        parallel_tool_calls: as given (default ``True``); echoed only.
        metadata: as given; echoed only.
    """

    response_id: str = ""
    created_at: int = 0
    conversation: list[dict[str, Any]] = field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = None
    response_tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = "auto"
    text_format: dict[str, Any] = field(default_factory=lambda: {"type": "text"})
    parallel_tool_calls: bool = True
    metadata: dict[str, Any] | None = None


def _chat_tool_choice(choice: Any) -> Any:
    """A Responses ``tool_choice`` in the chat shape (``{"type": "function", "name": N}`` →
    ``{"type": "function", "function": {"name": N}}``); the strings are the same in both."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _text_format(text: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``(format, schema)`` of a Responses ``text`` field: ``text.format`` as given, and the JSON
    schema the reply must follow (``None``: free text): ``{"type": "text"}``, ``{"type":
    "json_object"}``, or ``{"type": "json_schema", "name", "schema", "strict"}`` (the flat shape
    of chat's ``response_format.json_schema``; constrained by the same grammar).

    Raises:
        ServeError: 400 naming ``text.format`` for another type or a schema that is not an object.
    """
    fmt = (text or {}).get("format") or {"type": "text"}
    if not isinstance(fmt, dict):
        raise bad("text.format must be an object with a type", "text.format", "invalid_type")
    as_chat = (
        {"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}}
        if fmt.get("type") == "json_schema"
        else fmt
    )
    try:
        return fmt, response_schema(as_chat)
    except ServeError as e:
        said = e.message.replace("response_format.json_schema.", "text.format.").replace(
            "response_format.", "text.format."
        )
        raise bad(said, "text.format", "invalid_value") from None


def parse_responses_request(
    body: Any,
    served: str | Sequence[str],
    previous: Callable[[str], list[dict[str, Any]] | None],
    template_reads: Sequence[str] | set[str] | frozenset[str] = (),
) -> ResponsesRequest:
    """Check a ``/v1/responses`` body and return it as a :class:`ResponsesRequest`.

    Args:
        body: the decoded JSON body.
        served: the served model name(s).
        previous: the conversation kept for a response id (``None`` for an id not held).
        template_reads: the ``template`` fields of ``serve.compat`` the chat template reads.

    Raises:
        ServeError: 404 for a model not served; 400 for a refused field or value, a field of
            the wrong type, an item or tool the endpoint does not take, a
            ``function_call_output`` whose ``call_id`` names no earlier call, or a
            ``previous_response_id`` the server does not hold.
    """
    check_body_types(body, compat.RESPONSES)
    req = ResponsesRequest(model="", response_id="resp_" + uuid.uuid4().hex, created_at=int(time.time()))
    read_sampling(body, req, compat.RESPONSES, served, template_reads)
    req.response_tools = _response_tools(body.get("tools"))
    req.tools = _tools(
        [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in req.response_tools]
    )
    req.parse_tools, req.required_tool = chat_tool_choice(_chat_tool_choice(body.get("tool_choice")), req.tools)
    req.tool_choice = body.get("tool_choice") or "auto"
    req.text_format, req.response_schema = _text_format(body.get("text"))
    req.parallel_tool_calls = body.get("parallel_tool_calls") is not False
    req.metadata = body.get("metadata")
    req.instructions = body.get("instructions")
    req.previous_response_id = body.get("previous_response_id")
    before: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        kept = previous(req.previous_response_id)
        if kept is None:
            raise bad(
                f"previous_response_id {req.previous_response_id[:60]!r} is not a response this server holds for "
                f"this session (responses are kept per session, the last {MAX_KEPT}, until the session expires): "
                "send the whole conversation as input instead",
                "previous_response_id",
                "previous_response_not_found",
            )
        before = kept
    req.conversation = before + input_messages(body["input"], before)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    req.messages = normalise_messages(system + req.conversation)
    return req


def _response_tools(tools: Any) -> list[dict[str, Any]]:
    """The function tools of a Responses body (types checked, flat shape), without ``None`` fields.

    Raises:
        ServeError: 400 for a tool of another type (``web_search``, ``file_search``, ...) or without a name.
    """
    out = []
    for i, spec in enumerate(tools or []):
        _check_types(spec, _TOOL_TYPES, f"tools[{i}]")
        if spec.get("type") != "function":
            raise bad(
                f"tools[{i}].type is {spec.get('type')!r}: only function tools are supported (no built-in tool "
                'runs here); give {"type": "function", "name", "parameters"}',
                f"tools[{i}].type",
                "invalid_tools",
            )
        if not spec.get("name"):
            raise bad(f"tools[{i}] needs a name", f"tools[{i}].name", "invalid_tools")
        keep = ("type", "name", "description", "parameters", "strict")
        out.append({k: spec[k] for k in keep if spec.get(k) is not None})
    return out


def input_messages(items: Any, before: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Responses ``input`` → chat-completions wire messages (pure; module doc).

    Args:
        items: a string (one user message) or a list of items.
        before: the wire messages that come first (a previous response's conversation):
            their tool calls may be answered by ``function_call_output`` items.

    Raises:
        ServeError: 400 naming ``input[i]`` (or its part) for an item type other than
            ``message``, ``function_call``, ``function_call_output``, an unknown role,
            non-text content, a call without ``call_id`` or ``name``, or an output whose
            ``call_id`` answers no earlier call.
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise bad("input must be a non-empty string or a non-empty list of items", "input", "invalid_value")
    out: list[dict[str, Any]] = []
    calls = {c.get("id") for m in before for c in m.get("tool_calls") or []}
    for i, item in enumerate(items):
        where = f"input[{i}]"
        _check_types(item, _ITEM_TYPES, where)
        kind = item.get("type") or "message"
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            for key in ("call_id", "name"):
                if not item.get(key):
                    raise bad(f"{where}: a function_call item needs {key}", f"{where}.{key}", "invalid_value")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments") or ""},
            }
            if out and out[-1]["role"] == "assistant":  # the reply's text item, or its earlier calls
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            calls.add(item["call_id"])
        elif kind == "function_call_output":
            if item.get("call_id") not in calls:
                raise bad(
                    f"{where}.call_id {item.get('call_id')!r} answers no function_call before it (in this input or "
                    "the previous response)",
                    f"{where}.call_id",
                    "invalid_value",
                )
            if item.get("output") is None:
                raise bad(f"{where}: a function_call_output item needs output", f"{where}.output", "invalid_value")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _item_text(item["output"], where)})
        else:
            raise bad(
                f"{where}.type {kind!r} is not supported: use message, function_call or function_call_output "
                "items (no reasoning, built-in tool or reference items)",
                f"{where}.type",
                "invalid_value",
            )
    return out


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise bad(
            f"{where}.role: unknown role {role!r}; use user, system, developer or assistant",
            f"{where}.role",
            "invalid_value",
        )
    if item.get("content") is None:
        raise bad(f"{where}: a message item needs content", f"{where}.content", "invalid_value")
    return {"role": role, "content": _item_text(item["content"], where)}


def _item_text(content: Any, where: str) -> str:
    """A string, or a list of text parts (``input_text``, ``output_text``) joined."""
    for j, part in enumerate(content if isinstance(content, list) else []):
        _check_types(part, _PART_TYPES, f"{where}.content[{j}]")
    return _text(content, where, _TEXT_PARTS)


# ---- the response object -----------------------------------------------------------------
def call_ids(req: ResponsesRequest, choice: Choice) -> list[str]:
    """The ``call_id`` of each tool call of the reply (``call_`` + the response's hex + its index)."""
    return [f"call_{req.response_id[5:29]}_{j}" for j in range(len(choice.message.get("tool_calls") or []))]


def message_id(req: ResponsesRequest) -> str:
    """The id of the response's ``message`` item (known before sampling, for the stream)."""
    return "msg_" + req.response_id[5:]


def output_items(req: ResponsesRequest, choice: Choice) -> list[dict[str, Any]]:
    """The ``output`` items of one reply: a ``message`` (when it has text or no tool call),
    then one ``function_call`` per tool call (arguments as a JSON string)."""
    wire = wire_message(choice.message, call_ids(req, choice))
    calls = wire.get("tool_calls") or []
    cut = choice.finish_reason == "length"
    items: list[dict[str, Any]] = []
    if wire["content"] or not calls:
        part: dict[str, Any] = {"type": "output_text", "text": wire["content"] or "", "annotations": [], "logprobs": []}
        status = "incomplete" if cut else "completed"
        items.append(
            {"type": "message", "id": message_id(req), "role": "assistant", "status": status, "content": [part]}
        )
    for j, c in enumerate(calls):
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{req.response_id[5:29]}_{j}",
                "call_id": c["id"],
                "name": c["function"]["name"],
                "arguments": c["function"]["arguments"],
                "status": "completed",
            }
        )
    return items


def response_object(req: ResponsesRequest, choice: Choice | None, prompt_ids: list[int]) -> dict[str, Any]:
    """The ``response`` object of a sampled reply; ``choice`` ``None``: the response in
    progress (no output, no usage; the stream's first events).

    ``usage``: ``input_tokens`` the context ids, ``output_tokens`` the sampled ids
    (end-of-turn included when sampled), ``total_tokens`` their sum.
    """
    cut = choice is not None and choice.finish_reason == "length"
    status = "in_progress" if choice is None else ("incomplete" if cut else "completed")
    out = {
        "id": req.response_id,
        "object": "response",
        "created_at": req.created_at,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_tokens,
        "metadata": req.metadata,
        "model": req.model,
        "output": [] if choice is None else output_items(req, choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": None,
        "store": True,
        "temperature": req.temperature,
        "text": {"format": req.text_format},
        "tool_choice": req.tool_choice,
        "tools": req.response_tools,
        "top_p": req.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": None,
    }
    if choice is not None:
        n_in, n_out = len(prompt_ids), len(choice.token_ids)
        out["usage"] = {
            "input_tokens": n_in,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": n_out,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": n_in + n_out,
        }
        out |= {"prompt_token_ids": prompt_ids, "token_ids": choice.token_ids, "token_logprobs": choice.token_logprobs}
    return out


def keep(kept: dict[str, list[dict[str, Any]]], req: ResponsesRequest, choice: Choice) -> None:
    """Remember the conversation of a returned response (its input, then its reply) under
    its id, for a later ``previous_response_id``; the oldest is forgotten past :data:`MAX_KEPT`.
    The lists share their message dicts, so a long chain costs a pointer per message."""
    kept[req.response_id] = req.conversation + [wire_message(choice.message, call_ids(req, choice))]
    while len(kept) > MAX_KEPT:
        del kept[next(iter(kept))]


# ---- streaming ---------------------------------------------------------------------------
class Events:
    """The server-sent events of one streamed response, numbered (``sequence_number``) in order:
    ``response.created``, ``response.in_progress``; per output item ``response.output_item.added``,
    then for a message ``response.content_part.added``, ``response.output_text.delta`` (token by
    token when the reply is plain text), ``response.output_text.done``,
    ``response.content_part.done``, for a call ``response.function_call_arguments.delta`` /
    ``.done``; ``response.output_item.done``; finally ``response.completed`` (``response.incomplete``
    when the reply was cut at ``max_output_tokens``).
    """

    def __init__(self, req: ResponsesRequest):
        self.req, self.seq = req, 0
        self.opened = False  # the message item and its text part were announced (text streamed)

    def _event(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self.seq} | fields
        self.seq += 1
        return streaming.named_sse(kind, event)

    def start(self) -> list[str]:
        """``response.created`` and ``response.in_progress``."""
        skeleton = response_object(self.req, None, [])
        return [
            self._event("response.created", response=skeleton),
            self._event("response.in_progress", response=skeleton),
        ]

    def open_text(self) -> list[str]:
        """Announce the message item and its text part (before the first text delta)."""
        self.opened = True
        item = {
            "type": "message",
            "id": message_id(self.req),
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        return [
            self._event("response.output_item.added", output_index=0, item=item),
            self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=0,
                content_index=0,
                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
            ),
        ]

    def text(self, delta: str) -> str:
        """One ``response.output_text.delta`` of the message item."""
        return self._event(
            "response.output_text.delta",
            item_id=message_id(self.req),
            output_index=0,
            content_index=0,
            delta=delta,
            logprobs=[],
        )

    def end(self, full: dict[str, Any], sent: str) -> list[str]:
        """The rest of every output item of ``full`` (the response object) after the text
        ``sent`` so far, then ``response.completed`` (or ``response.incomplete``)."""
        out = []
        for k, item in enumerate(full["output"]):
            opened = self.opened and k == 0
            if item["type"] == "message":
                if not opened:
                    out += self.open_text()
                text = item["content"][0]["text"]
                rest = text[len(sent) :] if opened and text.startswith(sent) else text
                if rest:
                    out.append(self.text(rest))
                where = {"item_id": item["id"], "output_index": k, "content_index": 0}
                out.append(self._event("response.output_text.done", **where, text=text, logprobs=[]))
                out.append(self._event("response.content_part.done", **where, part=item["content"][0]))
            else:
                added = item | {"arguments": "", "status": "in_progress"}
                out.append(self._event("response.output_item.added", output_index=k, item=added))
                where = {"item_id": item["id"], "output_index": k}
                out.append(self._event("response.function_call_arguments.delta", **where, delta=item["arguments"]))
                out.append(self._event("response.function_call_arguments.done", **where, arguments=item["arguments"]))
            out.append(self._event("response.output_item.done", output_index=k, item=item))
        kind = "response.incomplete" if full["status"] == "incomplete" else "response.completed"
        out.append(self._event(kind, response=full))
        return out

    def error(self, body: dict[str, Any]) -> str:
        """An ``error`` event from an OpenAI-shaped error body (the call failed mid-stream)."""
        e = body["error"]
        return self._event("error", code=e.get("code"), message=e["message"], param=e.get("param"))

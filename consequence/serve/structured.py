"""Structured output on the chat path: ``tool_choice`` required / named and ``response_format``
JSON, as the grammar each choice is sampled under (``policy.constrained``, llguidance).

* ``tool_choice: "required"``: the reply is one tool call of a declared tool, written in the
  Hermes format the harness reads (``harness.tool_formats``): ``<tool_call>``, a newline, the
  call object ``{"name": NAME, "arguments": ARGS}`` whose arguments follow that tool's
  ``parameters`` schema, a newline, ``</tool_call>``, then the end-of-turn. A named function
  (``{"type": "function", "function": {"name": ...}}``) allows that tool only.
* ``response_format`` ``json_object`` / ``json_schema``: the reply is one JSON value valid under
  the schema (``json_object``: any object), then the end-of-turn. With tools and
  ``tool_choice`` ``auto`` the reply may instead be a tool call as above (an agent that has
  tools and a structured final answer calls tools first).

A marker the tokenizer holds as one id (``<tool_call>`` of Qwen2.5 and of the bundled model)
is required as that id, the way the chat template encodes it; otherwise as its text.
"""

from __future__ import annotations

import json
from typing import Any

from consequence.harness.renderer import Renderer
from consequence.harness.tool_formats import HERMES_CLOSE, HERMES_OPEN
from consequence.policy.constrained import (
    Grammar,
    GrammarError,
    engine_tokenizer,
    json_schema_grammar,
    lark_grammar,
    lark_json,
)
from consequence.serve.protocol import ChatRequest, bad


def grammar_for(req: ChatRequest, renderer: Renderer) -> Grammar | None:
    """The grammar the request's choices are sampled under, or ``None`` (free text).

    Args:
        req: a checked chat request (``required_tool``, ``response_schema``, ``tools``).
        renderer: the request's renderer (its tokenizer, stop ids and tool-call format).

    Raises:
        ServeError: 400 naming ``tools`` / ``tool_choice`` / ``response_format`` when the
            tools' calls cannot be written in the Hermes format, or the engine cannot
            compile a schema (its reason in the message).
    """
    if req.required_tool is None and req.response_schema is None:
        return None
    param = "response_format" if req.required_tool is None else "tools"
    try:
        tok = engine_tokenizer(renderer.tokenizer, renderer.stop_ids)
        if req.required_tool is not None:
            spec = lark_grammar("start: call\n" + _call_rules(req, renderer))
        elif req.tools and req.parse_tools:  # tool_choice auto: the JSON answer, or a call
            answer = lark_json(req.response_schema or {})
            spec = lark_grammar(f"start: answer | call\nanswer: {answer}\n" + _call_rules(req, renderer))
        else:
            spec = json_schema_grammar(req.response_schema or {})
        return Grammar(spec, tok)
    except GrammarError as e:
        raise bad(f"{param}: the grammar engine (llguidance) cannot compile it: {e}", param, "invalid_value") from None


def _call_rules(req: ChatRequest, renderer: Renderer) -> str:
    """The Lark rules ``call`` (one Hermes block) and ``body`` (the call objects allowed)."""
    fmt = renderer.call_format
    if fmt != "hermes":
        raise bad(
            f"tool_choice / response_format with tools: constrained tool calls are written in the Hermes format "
            f"only, and this model's tools use {fmt!r}; use tool_choice 'auto'",
            "tool_choice",
            "invalid_value",
        )
    tok = renderer.tokenizer
    bodies = [
        lark_json(_call_schema(t.get("function", t)))
        for t in req.tools
        if req.required_tool in (None, "", t.get("function", t).get("name"))
    ]
    open_, close = _literal(tok, HERMES_OPEN), _literal(tok, HERMES_CLOSE)
    return f'call: {open_} "\\n" body "\\n" {close}\nbody: ' + "\n    | ".join(bodies) + "\n"


def _call_schema(fn: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of one call object of tool ``fn``: its name, then arguments under its ``parameters``."""
    parameters = fn.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _literal(tokenizer, text: str) -> str:
    """A Lark item matching ``text``: its one token id (``<[id]>``) when the tokenizer encodes it
    as one token, else the text as a string literal."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) == 1:
        return f"<[{ids[0]}]>"
    return json.dumps(text)

"""Tool-call formats of real model families: how calls are written, read back, and declared.

A format is the text convention of one model family for tool use. Each one knows

- ``tools_text(tools)``: the tool specs as system-message text, worded as the family's
  published chat template words them (used where the template itself does not render
  ``tools=``: the renderer then writes them into the messages, :func:`declare`);
- ``write(calls)``: the assistant text of one turn's calls (demonstrations, scripted
  teachers, and the calls of a conversation the renderer writes into the messages);
- ``result_messages(contents)``: one turn's tool results as messages (role and wrapping);
- ``split(text, tools)`` / ``parse(text, tools)``: a sampled reply read back into calls.
  A malformed reply is ``([], "what was wrong")``, never an exception: the harness shows
  the message to the model as an observation (docs/design.md §3).

The registry :data:`FORMATS` holds ``hermes`` (Hermes / Qwen2.5), ``qwen3_coder``,
``llama3_json`` (Llama 3.1–3.3), ``mistral`` (Mistral 7B Instruct v0.3 style) and
``pythonic`` (Llama 3.2 / 4 pythonic, ToolACE). The call shapes follow vLLM's parsers of
the same names (``vllm/entrypoints/openai/tool_parsers/``) and the published templates;
where those parsers give up on a case (a closing marker inside a string argument, a ``;``
inside a string), these read it: every JSON value is read with a JSON decoder rather than
cut at the next marker, XML parameter values end only where the rest of the call still
reads, and pythonic calls go through :mod:`ast` with only literals allowed.
"""

from __future__ import annotations

import ast
import contextlib
import json
import keyword
import re
from typing import Any

_DECODER = json.JSONDecoder()
_WS = re.compile(r"\s*")

Call = dict[str, Any]  # {"name": str, "arguments": dict}
Split = tuple[str, list[Call], str | None]  # (content outside the calls, calls, error)


class _Bad(Exception):
    """A malformed call; its message is the parse error shown to the model."""


def _skip_ws(text: str, pos: int) -> int:
    m = _WS.match(text, pos)
    assert m is not None  # \s* matches the empty string anywhere
    return m.end()


def _decode_arguments(arguments: Any) -> Any:
    """``arguments`` given as a JSON string (the OpenAI wire shape) decoded; other text kept."""
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):
            return json.loads(arguments)
    return arguments


def _object_arguments(name: str, arguments: Any) -> dict:
    """The arguments of a call as a dict, for formats that write each argument separately.

    Raises:
        ValueError: they are not a JSON object (or a JSON string of one).
    """
    arguments = _decode_arguments(arguments)
    if not isinstance(arguments, dict):
        raise ValueError(f"the arguments of {name!r} must be a JSON object, got {arguments!r:.80}")
    return arguments


def _call(obj: Any, args_keys: tuple[str, ...], what: str) -> Call:
    """A JSON call object as ``{"name", "arguments"}``; its arguments under one of ``args_keys``.

    Raises:
        _Bad: no string name, two argument keys, or arguments that are not an object.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise _Bad(f'{what} must be an object with a string "name"')
    present = [k for k in args_keys if k in obj]
    if len(present) > 1:
        raise _Bad(f"{what} has both {' and '.join(map(repr, present))}; give one")
    args = obj[present[0]] if present else {}
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise _Bad(f"{what} arguments are not a JSON object") from None
    if not isinstance(args, dict):
        raise _Bad(f"{what} arguments must be a JSON object")
    return {"name": obj["name"], "arguments": args}


def _json_at(text: str, pos: int, what: str) -> tuple[Any, int]:
    """The JSON value starting at ``pos`` and where it ends.

    Raises:
        _Bad: not valid JSON there (the decoder's message and the offset from ``pos``).
    """
    try:
        return _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError as e:
        raise _Bad(f"{what} is not valid JSON ({e.msg} at char {e.pos - pos})") from None


def _properties(tools: list[dict] | None, name: str) -> dict:
    """The JSON-schema ``properties`` of tool ``name`` ({} when unknown)."""
    for t in tools or ():
        fn = t.get("function", t)
        if fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties")
            return props if isinstance(props, dict) else {}
    return {}


class ToolFormat:
    """One family's tool-call text convention (see the module doc); subclasses fill it in.

    Attributes:
        name: the registry name (``--tool-format NAME``).
        title: how messages name it ("Hermes").
        hint: one line showing a call, for the "no tool call" error.
    """

    name = ""
    title = ""
    hint = ""

    def tools_text(self, tools: list[dict]) -> str:
        """The system-message text that declares ``tools``."""
        raise NotImplementedError

    def write(self, calls: list[tuple[str, Any]]) -> str:
        """The assistant text of one turn's ``(name, arguments)`` calls, in order."""
        raise NotImplementedError

    def result_messages(self, contents: list[str]) -> list[dict]:
        """One turn's tool results (in call order) as the messages that carry them."""
        raise NotImplementedError

    def split(self, text: str, tools: list[dict] | None = None) -> Split:
        """``(content, calls, error)`` of a reply: the text outside the calls (stripped), the
        calls as ``{"name": str, "arguments": dict}``, and why they cannot be read (then
        ``calls`` is ``[]``); no call at all is ``(text.strip(), [], None)``. ``tools`` (the
        specs) type the values of formats whose arguments are untyped text."""
        try:
            return self._split(text, tools)
        except _Bad as e:
            return text.strip(), [], str(e)

    def _split(self, text: str, tools: list[dict] | None) -> tuple[str, list[Call], None]:
        raise NotImplementedError

    def parse(self, text: str, tools: list[dict] | None = None) -> tuple[list[Call], str | None]:
        """``(calls, error)`` of a reply (:meth:`split` without the content)."""
        _, calls, error = self.split(text, tools)
        return calls, error

    def check_tools(self, tools: list[dict]) -> list[str]:
        """Why some of ``tools`` cannot be written in this format (names it cannot spell)."""
        return []


# ---- hermes ------------------------------------------------------------------------------
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
# The Hermes function-calling system text, worded as the Qwen2.5 chat template writes it;
# the tool specs go between the two parts, one JSON object per line.
HERMES_TOOLS_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
HERMES_TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def format_call(name: str, arguments: dict | str) -> str:
    """One tool call in the Hermes format: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

    ``arguments`` given as a JSON string (the OpenAI wire shape) is decoded first.
    """
    body = json.dumps({"name": name, "arguments": _decode_arguments(arguments)})
    return HERMES_OPEN + "\n" + body + "\n" + HERMES_CLOSE


class Hermes(ToolFormat):
    """Hermes / Qwen2.5: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` per
    call, one per line; results are ``<tool_response>`` blocks of one user turn.

    A block runs from ``<tool_call>`` to the ``</tool_call>`` after its JSON object, so one
    inside a string argument is part of the argument; a block whose JSON does not read is
    cut at the first ``</tool_call>`` (as a regular expression would) and reported; an
    opening tag with no closing tag after it is text.
    """

    name, title = "hermes", "Hermes"
    hint = '<tool_call>{"name": ..., "arguments": {...}}</tool_call>'

    def tools_text(self, tools: list[dict]) -> str:
        return HERMES_TOOLS_HEAD + "".join("\n" + json.dumps(t) for t in tools) + HERMES_TOOLS_TAIL

    def write(self, calls: list[tuple[str, Any]]) -> str:
        return "\n".join(format_call(n, a) for n, a in calls)

    def result_messages(self, contents: list[str]) -> list[dict]:
        blocks = "\n".join("<tool_response>\n" + c + "\n</tool_response>" for c in contents)
        return [{"role": "user", "content": blocks}]

    def _split(self, text: str, tools: list[dict] | None) -> tuple[str, list[Call], None]:
        calls: list[Call] = []
        kept, pos = [], 0
        while (start := text.find(HERMES_OPEN, pos)) >= 0:
            body = start + len(HERMES_OPEN)
            if text.find(HERMES_CLOSE, body) < 0:
                break  # no closing tag: the rest is text
            end, call = _hermes_block(text, body)
            kept.append(text[pos:start])
            calls.append(call)
            pos = end + len(HERMES_CLOSE)
        return ("".join(kept) + text[pos:]).strip(), calls, None


def _hermes_block(text: str, body: int) -> tuple[int, Call]:
    """(where the block's ``</tool_call>`` starts, its call) of the block whose body starts at ``body``.

    Raises:
        _Bad: its JSON does not read, or is not a call (the messages of the reader before
            the registry, for the same replies).
    """
    with contextlib.suppress(json.JSONDecodeError):
        obj, after = _DECODER.raw_decode(text, _skip_ws(text, body))
        close = _skip_ws(text, after)
        if text.startswith(HERMES_CLOSE, close):
            return close, _call(obj, ("arguments",), "tool call")
    close = text.find(HERMES_CLOSE, body)  # the JSON does not end the block: read up to the first tag
    try:
        obj = json.loads(text[body:close].strip())
    except json.JSONDecodeError as e:
        raise _Bad(f"tool call is not valid JSON ({e.msg} at char {e.pos})") from None
    return close, _call(obj, ("arguments",), "tool call")


# ---- qwen3_coder -------------------------------------------------------------------------
QWEN3_CODER_TAIL = (
    "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
    "</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\n"
    "that can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\n"
    "Reminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> "
    "block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be "
    "specified\n- You may provide optional reasoning for your function call in natural language "
    "BEFORE the function call, but NOT after\n- If there is no function call available, answer "
    "the question like normal with your current knowledge and do not tell the user about "
    "function calls\n</IMPORTANT>"
)
_FN, _FN_END, _PARAM, _PARAM_END = "<function=", "</function>", "<parameter=", "</parameter>"
_MAX_SPLITS = 256  # readings tried per call when values hold </parameter> (bounds the backtracking)


def _xml_value(value: Any) -> str:
    """A value as the Qwen3-Coder template writes it: JSON for objects and lists, else its text."""
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict | list) else str(value)


def _xml_extra(d: Any, handled: tuple[str, ...]) -> str:
    if not isinstance(d, dict):
        return ""
    return "".join(f"\n<{k}>{_xml_value(v)}</{k}>" for k, v in d.items() if k not in handled)


def _xml_tool(tool: dict) -> str:
    """One tool in the Qwen3-Coder system prompt's XML layout."""
    fn = tool.get("function", tool)
    params = fn.get("parameters") or {}
    out = f"\n<function>\n<name>{fn['name']}</name>"
    if "description" in fn:
        out += f"\n<description>{str(fn['description']).strip()}</description>"
    out += "\n<parameters>"
    for pname, spec in (params.get("properties") or {}).items():
        out += f"\n<parameter>\n<name>{pname}</name>"
        if isinstance(spec, dict) and "type" in spec:
            out += f"\n<type>{spec['type']}</type>"
        if isinstance(spec, dict) and "description" in spec:
            out += f"\n<description>{str(spec['description']).strip()}</description>"
        out += _xml_extra(spec, ("name", "type", "description")) + "\n</parameter>"
    out += _xml_extra(params, ("type", "properties")) + "\n</parameters>"
    return out + _xml_extra(fn, ("type", "name", "description", "parameters")) + "\n</function>"


_PYTHON_WORDS = {"True": True, "False": False, "None": None}  # the Qwen3-Coder template's `| string` of them


def _typed(value: str, schema: Any) -> Any:
    """An XML parameter's text as a JSON value, by its JSON-schema type (as vLLM's
    ``qwen3_coder`` parser converts it): a string stays text; otherwise ``null`` (or
    ``None``) is None; an integer, number or boolean (``true`` / ``True``) is converted;
    anything else, or an untyped parameter, is decoded as JSON when it reads as JSON (or is
    ``True`` / ``False`` / ``None``, as the template writes them), else kept as text. A value
    that does not convert stays text, so the schema check names it (``bad_arguments``)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string":
        return value
    word = value.strip()
    if word.lower() in ("null", "none"):
        return None
    if kind in ("integer", "number"):
        for read in (int, float) if kind == "number" else (int,):
            with contextlib.suppress(ValueError):
                return read(word)
        return value
    if kind == "boolean":
        return {"true": True, "false": False}.get(word.lower(), value)
    with contextlib.suppress(json.JSONDecodeError):
        return json.loads(value)
    return _PYTHON_WORDS.get(word, value)


class Qwen3Coder(ToolFormat):
    """Qwen3-Coder XML calls: ``<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n
    </function>\\n</tool_call>``; a string value is written as it is, any other as JSON.
    Results are ``<tool_response>\\n...\\n</tool_response>\\n`` blocks of one user turn.

    A value ends at the first ``</parameter>`` after which the rest of the call still reads
    (another ``<parameter=``, or ``</function>`` then ``</tool_call>``), so code holding
    ``</parameter>``, ``</function>`` or ``</tool_call>`` reads whole. Values are typed by the
    tool's JSON schema (:func:`_typed`).
    """

    name, title = "qwen3_coder", "Qwen3-Coder"
    hint = "<tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n</function>\n</tool_call>"

    def tools_text(self, tools: list[dict]) -> str:
        head = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
        return head + "".join(_xml_tool(t) for t in tools) + "\n</tools>" + QWEN3_CODER_TAIL

    def write(self, calls: list[tuple[str, Any]]) -> str:
        return "\n".join(self._write_one(n, _object_arguments(n, a)) for n, a in calls)

    @staticmethod
    def _write_one(name: str, arguments: dict) -> str:
        params = "".join(
            f"{_PARAM}{k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n{_PARAM_END}\n"
            for k, v in arguments.items()
        )
        return f"{HERMES_OPEN}\n{_FN}{name}>\n{params}{_FN_END}\n{HERMES_CLOSE}"

    def result_messages(self, contents: list[str]) -> list[dict]:
        # the Qwen3-Coder template ends each block with a newline (Hermes joins them with one)
        return [{"role": "user", "content": "".join(f"<tool_response>\n{c}\n</tool_response>\n" for c in contents)}]

    def check_tools(self, tools: list[dict]) -> list[str]:
        bad = [n for n in _names_and_parameters(tools) if not n or any(c in n for c in "<>\n")]
        return [
            f"{n!r} cannot be written inside <function=...> / <parameter=...> (it holds <, > or a newline)" for n in bad
        ]

    def _split(self, text: str, tools: list[dict] | None) -> tuple[str, list[Call], None]:
        calls: list[Call] = []
        kept, pos = [], 0
        while (start := text.find(HERMES_OPEN, pos)) >= 0:
            name, raw, pos_after = _qwen_call(text, start + len(HERMES_OPEN), len(calls) + 1)
            props = _properties(tools, name)
            calls.append({"name": name, "arguments": {k: _typed(v, props.get(k)) for k, v in raw.items()}})
            kept.append(text[pos:start])
            pos = pos_after
        content = "".join(kept) + text[pos:]
        if _FN in content:
            raise _Bad(f"a {_FN}...> block outside <tool_call>...</tool_call>; wrap each call in <tool_call> tags")
        return content.strip(), calls, None


def _qwen_call(text: str, pos: int, k: int) -> tuple[str, dict[str, str], int]:
    """(name, raw argument texts, where the block ends) of the call whose body starts at ``pos``.

    Raises:
        _Bad: naming the call (``k``-th of the reply) and what is missing.
    """
    p = _skip_ws(text, pos)
    if not text.startswith(_FN, p):
        raise _Bad(f"tool call {k}: expected {_FN}NAME> after <tool_call>, got {text[p : p + 30]!r}")
    name, close = _tag_name(text, p, _FN, f"tool call {k}: the function name")
    budget = [_MAX_SPLITS]
    args, end = _qwen_params(text, close + 1, f"tool call {k} ({name})", budget)
    return name, args, end


def _tag_name(text: str, p: int, tag: str, label: str) -> tuple[str, int]:
    """(NAME, index of its '>') of ``<tag=NAME>`` at ``p`` (the caller checked the tag).

    Raises:
        _Bad: ``label`` is not closed with '>' on its line, or is empty.
    """
    close = text.find(">", p)
    name = text[p + len(tag) : close] if close >= 0 else ""
    if close < 0 or not name.strip() or "\n" in name:
        raise _Bad(f"{label} after {tag} is not closed with '>' on its line")
    return name, close


def _qwen_params(text: str, pos: int, what: str, budget: list[int]) -> tuple[dict[str, str], int]:
    """The parameters from ``pos`` to ``</function></tool_call>``: (raw values, end of the block)."""
    p = _skip_ws(text, pos)
    if text.startswith(_FN_END, p):
        q = _skip_ws(text, p + len(_FN_END))
        if not text.startswith(HERMES_CLOSE, q):
            raise _Bad(f"{what}: expected </tool_call> after </function>, got {text[q : q + 30]!r}")
        return {}, q + len(HERMES_CLOSE)
    if not text.startswith(_PARAM, p):
        raise _Bad(f"{what}: expected {_PARAM}ARG> or {_FN_END}, got {text[p : p + 30]!r}")
    pname, close = _tag_name(text, p, _PARAM, f"{what}: a parameter name")
    return _qwen_value(text, close + 1, pname, what, budget)


def _qwen_value(text: str, start: int, pname: str, what: str, budget: list[int]) -> tuple[dict[str, str], int]:
    """Parameter ``pname``'s value from ``start``: the first ``</parameter>`` after which the rest reads."""
    first_error = None
    end = text.find(_PARAM_END, start)
    while end >= 0 and budget[0] > 0:
        budget[0] -= 1
        try:
            rest, block_end = _qwen_params(text, end + len(_PARAM_END), what, budget)
        except _Bad as e:
            first_error = first_error or e
            end = text.find(_PARAM_END, end + 1)
            continue
        if pname in rest:
            raise _Bad(f"{what}: parameter {pname!r} is given twice")
        value = text[start:end]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        return {pname: value, **rest}, block_end
    if first_error is not None:
        raise first_error
    raise _Bad(f"{what}: parameter {pname!r} is not closed with {_PARAM_END}")


# ---- llama3_json -------------------------------------------------------------------------
PYTHON_TAG = "<|python_tag|>"
LLAMA_TOOLS_HEAD = (
    "You have access to the following functions. To call a function, please respond with JSON for "
    'a function call. Respond in the format {"name": function name, "parameters": dictionary of '
    "argument name and its value}. Do not use variables.\n\n"
)


class Llama3Json(ToolFormat):
    """Llama 3.x JSON calls: the reply is ``{"name": ..., "parameters": {...}}`` (``"arguments"``
    is read too), optionally after ``<|python_tag|>``; several calls are separated by ``;``
    (as vLLM's ``llama3_json`` parser reads them). Results are ``ipython`` messages, one per
    result, as the Llama 3.1 template renders tool outputs.

    A reply is read as calls when it starts with ``{`` or holds ``<|python_tag|>`` before its
    first ``{`` (the text before the tag is the content); text then a bare JSON object is
    text. Each object is read by a JSON decoder, so a ``;``, ``}`` or tag inside a string is
    part of it.
    """

    name, title = "llama3_json", "Llama 3 JSON"
    hint = '{"name": ..., "parameters": {...}}'

    def tools_text(self, tools: list[dict]) -> str:
        return LLAMA_TOOLS_HEAD + "\n\n".join(json.dumps(t, ensure_ascii=False, indent=4) for t in tools)

    def write(self, calls: list[tuple[str, Any]]) -> str:
        objs = ({"name": n, "parameters": _decode_arguments(a)} for n, a in calls)
        return "; ".join(json.dumps(o, ensure_ascii=False) for o in objs)

    def result_messages(self, contents: list[str]) -> list[dict]:
        return [{"role": "ipython", "content": c} for c in contents]

    def _split(self, text: str, tools: list[dict] | None) -> tuple[str, list[Call], None]:
        tag, brace = text.find(PYTHON_TAG), text.find("{")
        if tag >= 0 and (brace < 0 or tag < brace):  # a tag after the first '{' is inside an argument
            content, body = text[:tag].strip(), text[tag + len(PYTHON_TAG) :]
        elif text.lstrip().startswith("{"):
            content, body = "", text
        else:
            return text.strip(), [], None
        calls: list[Call] = []
        p = _skip_ws(body, 0)
        if p == len(body):
            raise _Bad(f"nothing after {PYTHON_TAG}: expected a JSON tool call {self.hint}")
        while p < len(body):
            what = f"tool call {len(calls) + 1}"
            obj, p = _json_at(body, p, what)
            calls.append(_call(obj, ("parameters", "arguments"), what))
            p = _skip_ws(body, p)
            if p == len(body):
                break
            if body[p] != ";":
                raise _Bad(f"unexpected text after {what}: {body[p : p + 30]!r} (separate calls with ';')")
            p = _skip_ws(body, p + 1)  # a trailing ';' ends the list
        return content, calls, None


# ---- mistral -----------------------------------------------------------------------------
MISTRAL_CALLS = "[TOOL_CALLS]"


class Mistral(ToolFormat):
    """Mistral (7B Instruct v0.3, Nemo): ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``,
    one JSON list for the turn's calls (an ``"id"`` in an item is ignored); the text before
    ``[TOOL_CALLS]`` is the content. Tools are declared as ``[AVAILABLE_TOOLS] [...][/AVAILABLE_TOOLS]``
    and results are ``[TOOL_RESULTS] {"content": ...}[/TOOL_RESULTS]`` blocks of one user turn.
    """

    name, title = "mistral", "Mistral"
    hint = '[TOOL_CALLS] [{"name": ..., "arguments": {...}}]'

    def tools_text(self, tools: list[dict]) -> str:
        return "[AVAILABLE_TOOLS] " + json.dumps(tools, ensure_ascii=False) + "[/AVAILABLE_TOOLS]"

    def write(self, calls: list[tuple[str, Any]]) -> str:
        items = [{"name": n, "arguments": _decode_arguments(a)} for n, a in calls]
        return MISTRAL_CALLS + " " + json.dumps(items, ensure_ascii=False)

    def result_messages(self, contents: list[str]) -> list[dict]:
        blocks = "".join('[TOOL_RESULTS] {"content": ' + json.dumps(c) + "}[/TOOL_RESULTS]" for c in contents)
        return [{"role": "user", "content": blocks}]

    def _split(self, text: str, tools: list[dict] | None) -> tuple[str, list[Call], None]:
        start = text.find(MISTRAL_CALLS)
        if start < 0:
            return text.strip(), [], None
        calls: list[Call] = []
        p = start
        while p < len(text):
            if not text.startswith(MISTRAL_CALLS, p):
                raise _Bad(f"unexpected text after the tool call list: {text[p : p + 30]!r}")
            p = _skip_ws(text, p + len(MISTRAL_CALLS))
            if not text.startswith("[", p):
                raise _Bad(f"expected a JSON list after {MISTRAL_CALLS}, got {text[p : p + 30]!r}; write {self.hint}")
            items, p = _json_at(text, p, f"the tool call list after {MISTRAL_CALLS}")
            if not items:
                raise _Bad(f"the tool call list after {MISTRAL_CALLS} is empty")
            calls += [_call(o, ("arguments",), f"tool call {len(calls) + i + 1}") for i, o in enumerate(items)]
            p = _skip_ws(text, p)
        return text[:start].strip(), calls, None


# ---- pythonic ----------------------------------------------------------------------------
PYTHONIC_TOOLS_HEAD = (
    "You have access to the following functions. To call functions, please respond with a python "
    "list of the calls. Respond in the format [func_name1(params_name1=params_value1, "
    "params_name2=params_value2...), func_name2(params)] Do not use variables.\n\n"
)
_PYTHONIC_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")  # [NAME( or [a.b(: a call list
_JSON_NAMES = {"true": True, "false": False, "null": None}  # JSON spellings some models write


def _py_literal(value: Any) -> str:
    """``value`` (JSON data) as a Python literal: strings in JSON quoting (valid Python), True/False/None."""
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if value is None or isinstance(value, bool | int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_py_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_py_literal(str(k))}: {_py_literal(v)}" for k, v in value.items()) + "}"
    raise ValueError(f"{value!r:.80} is not JSON data and has no Python literal here")


def _literal(node: ast.expr, where: str) -> Any:
    """The JSON value of a literal expression node.

    Raises:
        _Bad: anything but a string, number, True/False/None (or true/false/null), list,
            tuple, or dict with string keys.
    """
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, str | bool | int | float)):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        inner = _literal(node.operand, where)
        if isinstance(inner, int | float) and not isinstance(inner, bool):
            return -inner if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e, where) for e in node.elts]
    if isinstance(node, ast.Dict):
        keys = [k.value if isinstance(k, ast.Constant) and isinstance(k.value, str) else None for k in node.keys]
        if None not in keys:
            return {k: _literal(v, where) for k, v in zip(keys, node.values, strict=True)}
    raise _Bad(
        f"{where}: only literals are allowed (strings, numbers, True/False/None, lists, dicts with "
        f"string keys), got {ast.unparse(node)!r:.60}"
    )


def _pythonic_call(node: ast.expr, k: int) -> Call:
    if not isinstance(node, ast.Call):
        raise _Bad(f"item {k} of the list is not a function call: {ast.unparse(node)!r:.60}")
    if not isinstance(node.func, ast.Name):
        raise _Bad(f"call {k}: the function must be a plain name, got {ast.unparse(node.func)!r:.60}")
    name = node.func.id
    if node.args:
        raise _Bad(f"call {k} ({name}): positional arguments are not allowed; name each one (arg=value)")
    if any(kw.arg is None for kw in node.keywords):
        raise _Bad(f"call {k} ({name}): **arguments are not allowed; name each one (arg=value)")
    return {"name": name, "arguments": {kw.arg: _literal(kw.value, f"{name}({kw.arg}=...)") for kw in node.keywords}}


class Pythonic(ToolFormat):
    """Pythonic calls (Llama 3.2 / 4, ToolACE; vLLM's ``pythonic`` parser): the reply is one
    Python list of calls ``[fn(a=1, b="x"), g()]``, keyword arguments only, each a literal
    (read with :mod:`ast`, never evaluated). A reply is read as calls when it starts with
    ``[NAME(``. Results are ``ipython`` messages, one per result.
    """

    name, title = "pythonic", "pythonic"
    hint = "[name(arg=value, ...), ...]"

    def tools_text(self, tools: list[dict]) -> str:
        return PYTHONIC_TOOLS_HEAD + "\n\n".join(json.dumps(t, ensure_ascii=False, indent=4) for t in tools)

    def write(self, calls: list[tuple[str, Any]]) -> str:
        parts = []
        for name, arguments in calls:
            arguments = _object_arguments(name, arguments)
            bad = [n for n in (name, *arguments) if not _is_identifier(n)]
            if bad:
                raise ValueError(f"{bad[0]!r} is not a Python identifier: it cannot be written as a pythonic call")
            parts.append(f"{name}(" + ", ".join(f"{k}={_py_literal(v)}" for k, v in arguments.items()) + ")")
        return "[" + ", ".join(parts) + "]"

    def result_messages(self, contents: list[str]) -> list[dict]:
        return [{"role": "ipython", "content": c} for c in contents]

    def check_tools(self, tools: list[dict]) -> list[str]:
        return [f"{n!r} is not a Python identifier" for n in _names_and_parameters(tools) if not _is_identifier(n)]

    def _split(self, text: str, tools: list[dict] | None) -> tuple[str, list[Call], None]:
        code = text.strip()
        if not _PYTHONIC_START.match(code):
            return code, [], None
        try:
            tree = ast.parse(code, mode="eval")
        except SyntaxError as e:
            raise _Bad(f"the tool call list is not valid Python ({e.msg}, line {e.lineno} column {e.offset})") from None
        if not isinstance(tree.body, ast.List):
            raise _Bad(f"expected one Python list of calls and nothing else, e.g. {self.hint}")
        return "", [_pythonic_call(e, k + 1) for k, e in enumerate(tree.body.elts)], None


def _is_identifier(name: str) -> bool:
    return name.isidentifier() and not keyword.iskeyword(name) and name not in _JSON_NAMES


def _names_and_parameters(tools: list[dict]) -> list[str]:
    """Every tool name and parameter name of ``tools``."""
    out = []
    for t in tools:
        fn = t.get("function", t)
        out.append(fn["name"])
        out += list(((fn.get("parameters") or {}).get("properties") or {}).keys())
    return out


# ---- the registry and the rewrite --------------------------------------------------------
HERMES = Hermes()
FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HERMES, Qwen3Coder(), Llama3Json(), Mistral(), Pythonic())}


def get_format(name: str) -> ToolFormat:
    """The format registered as ``name``.

    Raises:
        ValueError: no such format (names the registered ones).
    """
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}; registered: {', '.join(FORMATS)}")
    return FORMATS[name]


def declare(fmt: ToolFormat, messages: list[dict], tools: list[dict]) -> list[dict]:
    """``messages`` with the tools written into their content in ``fmt`` (pure; the input is not changed).

    - The tool specs (``fmt.tools_text``) are appended to the first message's content when
      it is a system message (after a blank line), else a system message holding only them
      is put first (so a template's default system prompt is not added on top of them).
    - An assistant message's ``tool_calls`` become its content: the original content (if
      any) and a newline, then the calls as ``fmt.write`` writes them; the ``tool_calls``
      key is dropped.
    - Each run of consecutive ``tool`` messages becomes ``fmt.result_messages`` of their
      contents, so parallel results share one turn where the format merges them (case 13).
    """
    spec = fmt.tools_text(tools)
    if messages and messages[0].get("role") == "system":
        first = messages[0].get("content") or ""
        out = [{**messages[0], "content": (first + "\n\n" if first else "") + spec}]
        rest = messages[1:]
    else:
        out, rest = [{"role": "system", "content": spec}], messages
    results: list[str] = []
    for m in rest:
        if m.get("role") == "tool":
            results.append(str(m.get("content") or ""))
            continue
        if results:
            out += fmt.result_messages(results)
            results = []
        out.append(_declared_turn(fmt, m))
    return out + (fmt.result_messages(results) if results else [])


def _declared_turn(fmt: ToolFormat, m: dict) -> dict:
    if m.get("role") != "assistant" or not m.get("tool_calls"):
        return dict(m)
    calls = fmt.write([_name_and_arguments(c) for c in m["tool_calls"]])
    content = m.get("content") or ""
    return {**{k: v for k, v in m.items() if k != "tool_calls"}, "content": (content + "\n" if content else "") + calls}


def _name_and_arguments(call: dict) -> tuple[str, Any]:
    fn = call.get("function", call)
    return fn["name"], fn.get("arguments", {})

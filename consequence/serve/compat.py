"""The endpoint's compatibility policy: one table of request fields, what each does here.

Every field of a ``/v1/chat/completions``, ``/v1/completions`` or ``/v1/responses`` body falls
under one rule:

* ``honoured``: applied (the request modules read and check its value);
* ``neutral``: accepted only at the value that changes nothing (a penalty of 0, a
  repetition penalty of 1, ``text`` ``{"format": {"type": "text"}}``); any other value would
  change what is sampled in a way the sampler cannot, so it is refused (400 naming the
  field and why);
* ``refused``: any value but ``null`` is refused, for the same reason;
* ``template``: passed to the chat template when the model's template reads a variable of
  that name (then it can change the prompt, so it is applied); otherwise ignored;
* ``ignored``: accepted, cannot change what is sampled (a cache key, a user id, a storage
  flag); named in the ``x-consequence-ignored-fields`` response header and the server log.

A field the table does not list is ignored as well (clients add fields with every
release; vLLM ignores them too), and named the same way. The documentation's table
(docs/agents.md §5) is :func:`markdown_table` of this one (``tests/serve`` checks it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

HONOURED, NEUTRAL, REFUSED, TEMPLATE, IGNORED = "honoured", "neutral", "refused", "template", "ignored"
CHAT, COMPLETIONS, RESPONSES = "chat", "completions", "responses"
BOTH = (CHAT, COMPLETIONS)
ALL = (CHAT, COMPLETIONS, RESPONSES)
IGNORED_HEADER = "x-consequence-ignored-fields"

# JSON types (the names the type errors use)
NUM, INT, STR, BOOL, OBJ, LIST = "number", "integer", "string", "boolean", "object", "array"


@dataclass(frozen=True)
class Field:
    """One request field and its rule.

    Attributes:
        name: the field's JSON name.
        rule: ``honoured``, ``neutral``, ``refused``, ``template`` or ``ignored`` (module doc).
        types: the JSON types it may have (``null`` always may: the field is then absent).
        endpoints: some of ``chat``, ``completions``, ``responses``; on another endpoint it is
            an unknown field.
        origin: ``OpenAI`` or ``vLLM`` (whose API defines it).
        why: how it is applied, or why it is refused or ignored (the docs, the 400's message).
        neutral: for ``neutral``: the values accepted (compared as JSON).
    """

    name: str
    rule: str
    types: tuple[str, ...]
    endpoints: tuple[str, ...]
    origin: str
    why: str
    neutral: tuple[Any, ...] = ()


_VLLM_GUIDED = "vLLM's fields for constrained decoding are not read: send `response_format` or `tool_choice` to `/v1/chat/completions`"
FIELDS: tuple[Field, ...] = (
    # ---- OpenAI: honoured ----------------------------------------------------------------
    Field("model", HONOURED, (STR,), ALL, "OpenAI", "one of the served names (GET /v1/models); another is a 404"),
    Field("messages", HONOURED, (LIST,), (CHAT,), "OpenAI", "roles system, developer, user, assistant, tool; text"),
    Field("prompt", HONOURED, (STR, LIST), (COMPLETIONS,), "OpenAI", "one text, or one list of token ids"),
    Field(
        "input",
        HONOURED,
        (STR, LIST),
        (RESPONSES,),
        "OpenAI",
        "a text, or items: messages (text parts), `function_call`, `function_call_output`",
    ),
    Field("instructions", HONOURED, (STR,), (RESPONSES,), "OpenAI", "a system message before the input"),
    Field(
        "previous_response_id",
        HONOURED,
        (STR,),
        (RESPONSES,),
        "OpenAI",
        "continues a response of the same session (its input and output, then this input)",
    ),
    Field(
        "tools",
        HONOURED,
        (LIST,),
        (CHAT, RESPONSES),
        "OpenAI",
        "function tools, rendered by the chat template (responses: the flat shape; other tool types refused)",
    ),
    Field(
        "tool_choice",
        HONOURED,
        (STR, OBJ),
        (CHAT, RESPONSES),
        "OpenAI",
        "`auto`, `none`, `required` or a named function (responses: the flat `{type, name}`); the last two "
        "constrain the reply to one Hermes tool call whose arguments follow the tool's schema (llguidance)",
    ),
    Field("temperature", HONOURED, (NUM,), ALL, "OpenAI", "0 to 2 (0 = greedy)"),
    Field("top_p", HONOURED, (NUM,), ALL, "OpenAI", "(0, 1]"),
    Field(
        "max_tokens",
        HONOURED,
        (INT,),
        BOTH,
        "OpenAI",
        "≥ 1; default `--max-tokens` in chat, 16 in completions (`--max-new-tokens` in an `--agent` episode)",
    ),
    Field("max_completion_tokens", HONOURED, (INT,), (CHAT,), "OpenAI", "as `max_tokens`"),
    Field("max_output_tokens", HONOURED, (INT,), (RESPONSES,), "OpenAI", "as `max_tokens` in chat"),
    Field("n", HONOURED, (INT,), BOTH, "OpenAI", "1 to 16"),
    Field("stop", HONOURED, (STR, LIST), BOTH, "OpenAI", "up to 4 strings; the text is cut before the first"),
    Field("seed", HONOURED, (INT,), BOTH, "OpenAI", "a seeded request is sampled alone with its own generator"),
    Field("logprobs", HONOURED, (BOOL,), (CHAT,), "OpenAI", "the sampled tokens' log-probs in `choices[].logprobs`"),
    Field("logprobs", HONOURED, (INT,), (COMPLETIONS,), "OpenAI", "0 to 20: log-probs and that many alternatives"),
    Field("top_logprobs", HONOURED, (INT,), (CHAT,), "OpenAI", "0 to 20 alternatives per token (needs `logprobs`)"),
    Field(
        "stream",
        HONOURED,
        (BOOL,),
        ALL,
        "OpenAI",
        "server-sent events: token by token for a text reply; a reply with tools to parse comes whole",
    ),
    Field("stream_options", HONOURED, (OBJ,), BOTH, "OpenAI", "`include_usage`"),
    Field(
        "response_format",
        HONOURED,
        (OBJ,),
        (CHAT,),
        "OpenAI",
        "`text`; `json_object` / `json_schema`: the reply is constrained to JSON valid under the schema "
        "(llguidance; a schema it cannot compile is a 400)",
    ),
    Field(
        "text",
        HONOURED,
        (OBJ,),
        (RESPONSES,),
        "OpenAI",
        "`format` `text`; `json_object` / `json_schema` (the flat `{type, name, schema, strict}`): the reply "
        "is constrained to JSON valid under the schema, as `response_format` on chat",
    ),
    Field(
        "truncation",
        NEUTRAL,
        (STR,),
        (RESPONSES,),
        "OpenAI",
        "`disabled` only: the context is never cut",
        ("disabled",),
    ),
    Field("background", NEUTRAL, (BOOL,), (RESPONSES,), "OpenAI", "`false` only: the reply is returned", (False,)),
    Field(
        "top_logprobs",
        NEUTRAL,
        (INT,),
        (RESPONSES,),
        "OpenAI",
        "0 only: the sampled tokens' log-probs are in `token_logprobs`",
        (0,),
    ),
    Field("frequency_penalty", NEUTRAL, (NUM,), BOTH, "OpenAI", "0 only: the sampler applies no penalty", (0,)),
    Field("presence_penalty", NEUTRAL, (NUM,), BOTH, "OpenAI", "0 only: the sampler applies no penalty", (0,)),
    Field("logit_bias", NEUTRAL, (OBJ,), BOTH, "OpenAI", "`{}` only: the sampler applies no bias", ({},)),
    Field("modalities", NEUTRAL, (LIST,), (CHAT,), "OpenAI", '`["text"]` only: the model writes text', (["text"],)),
    Field("echo", NEUTRAL, (BOOL,), (COMPLETIONS,), "OpenAI", "`false` only: the prompt is not returned", (False,)),
    Field("best_of", NEUTRAL, (INT,), (COMPLETIONS,), "OpenAI", "1 only: candidates are not ranked", (1,)),
    Field("suffix", REFUSED, (STR,), (COMPLETIONS,), "OpenAI", "insertion is not supported"),
    Field("audio", REFUSED, (OBJ,), (CHAT,), "OpenAI", "the model writes text only"),
    Field("web_search_options", REFUSED, (OBJ,), (CHAT,), "OpenAI", "no search tool runs here"),
    Field("functions", REFUSED, (LIST,), (CHAT,), "OpenAI", "deprecated: use `tools`"),
    Field("function_call", REFUSED, (STR, OBJ), (CHAT,), "OpenAI", "deprecated: use `tool_choice`"),
    Field(
        "conversation",
        REFUSED,
        (STR, OBJ),
        (RESPONSES,),
        "OpenAI",
        "no conversation is stored: send `previous_response_id` or the whole input",
    ),
    Field("prompt", REFUSED, (OBJ,), (RESPONSES,), "OpenAI", "no prompt template is stored: send `input`"),
    Field(
        "reasoning_effort",
        TEMPLATE,
        (STR,),
        (CHAT,),
        "OpenAI",
        "a chat-template variable: passed to the template when it reads `reasoning_effort`, else ignored",
    ),
    Field("user", IGNORED, (STR,), ALL, "OpenAI", "an end-user id"),
    Field("metadata", IGNORED, (OBJ,), ALL, "OpenAI", "stored-completion tags (nothing is stored)"),
    Field(
        "store",
        IGNORED,
        (BOOL,),
        ALL,
        "OpenAI",
        "nothing is stored but the session record (and a bounded memory of responses for `previous_response_id`)",
    ),
    Field(
        "parallel_tool_calls", IGNORED, (BOOL,), (CHAT, RESPONSES), "OpenAI", "the reply's calls are parsed as sampled"
    ),
    Field("service_tier", IGNORED, (STR,), ALL, "OpenAI", "one tier"),
    Field("prompt_cache_key", IGNORED, (STR,), ALL, "OpenAI", "sessions' K/V is cached anyway"),
    Field("prompt_cache_retention", IGNORED, (STR,), (RESPONSES,), "OpenAI", "sessions' K/V is cached anyway"),
    Field("safety_identifier", IGNORED, (STR,), ALL, "OpenAI", "an end-user id"),
    Field(
        "reasoning",
        IGNORED,
        (OBJ,),
        (RESPONSES,),
        "OpenAI",
        "no reasoning items are returned (a template's `reasoning_effort`: use chat completions)",
    ),
    Field(
        "include",
        IGNORED,
        (LIST,),
        (RESPONSES,),
        "OpenAI",
        "no extra output is added; the sampled ids and log-probs are always in `token_ids`, `token_logprobs`",
    ),
    Field("max_tool_calls", IGNORED, (INT,), (RESPONSES,), "OpenAI", "it limits built-in tools; none run here"),
    Field("stream_options", IGNORED, (OBJ,), (RESPONSES,), "OpenAI", "`include_obfuscation`: nothing is padded"),
    Field("prediction", IGNORED, (OBJ,), (CHAT,), "OpenAI", "a latency hint: the output is sampled all the same"),
    # ---- vLLM's extras ---------------------------------------------------------------------
    Field("top_k", HONOURED, (INT,), ALL, "vLLM", "≥ 1, or 0 / -1 = off; default `--top-k`"),
    Field(
        "chat_template_kwargs",
        HONOURED,
        (OBJ,),
        (CHAT,),
        "vLLM",
        "extra variables of the chat template (e.g. `enable_thinking`), on every rendering of the call",
    ),
    Field(
        "return_token_ids", HONOURED, (BOOL,), ALL, "vLLM", "ids are always returned (`prompt_token_ids`, `token_ids`)"
    ),
    Field("min_p", NEUTRAL, (NUM,), BOTH, "vLLM", "0 only: the sampler has no min-p filter", (0,)),
    Field("repetition_penalty", NEUTRAL, (NUM,), BOTH, "vLLM", "1 only: the sampler applies no penalty", (1,)),
    Field("min_tokens", NEUTRAL, (INT,), BOTH, "vLLM", "0 only: the end-of-turn token is never masked", (0,)),
    Field("ignore_eos", NEUTRAL, (BOOL,), BOTH, "vLLM", "`false` only: a reply ends at its end-of-turn", (False,)),
    Field("stop_token_ids", NEUTRAL, (LIST,), BOTH, "vLLM", "`[]` only: the model's own end ids stop", ([],)),
    Field("use_beam_search", NEUTRAL, (BOOL,), BOTH, "vLLM", "`false` only: replies are sampled", (False,)),
    Field("length_penalty", NEUTRAL, (NUM,), BOTH, "vLLM", "1 only (beam search)", (1,)),
    Field("prompt_logprobs", NEUTRAL, (INT,), BOTH, "vLLM", "0 only: prompt log-probs are not computed", (0,)),
    Field("add_generation_prompt", NEUTRAL, (BOOL,), (CHAT,), "vLLM", "`true` only: the reply opens a turn", (True,)),
    Field("continue_final_message", NEUTRAL, (BOOL,), (CHAT,), "vLLM", "`false` only", (False,)),
    Field("echo", NEUTRAL, (BOOL,), (CHAT,), "vLLM", "`false` only: the prompt is not returned", (False,)),
    Field("truncate_prompt_tokens", REFUSED, (INT,), BOTH, "vLLM", "the context is never cut"),
    Field("allowed_token_ids", REFUSED, (LIST,), BOTH, "vLLM", "the sampler does not mask the vocabulary"),
    Field("bad_words", REFUSED, (LIST,), BOTH, "vLLM", "the sampler does not mask the vocabulary"),
    Field("logits_processors", REFUSED, (LIST,), BOTH, "vLLM", "the sampler runs no custom processors"),
    Field("structured_outputs", REFUSED, (OBJ,), BOTH, "vLLM", _VLLM_GUIDED),
    Field("guided_json", REFUSED, (STR, OBJ), BOTH, "vLLM", _VLLM_GUIDED),
    Field("guided_regex", REFUSED, (STR,), BOTH, "vLLM", _VLLM_GUIDED),
    Field("guided_choice", REFUSED, (LIST,), BOTH, "vLLM", _VLLM_GUIDED),
    Field("guided_grammar", REFUSED, (STR,), BOTH, "vLLM", _VLLM_GUIDED),
    Field("priority", IGNORED, (INT,), BOTH, "vLLM", "requests are batched in arrival order"),
    Field("request_id", IGNORED, (STR,), BOTH, "vLLM", "the response's id is the server's"),
    Field("cache_salt", IGNORED, (STR,), BOTH, "vLLM", "no cache is shared between sessions"),
)


def fields(endpoint: str) -> dict[str, Field]:
    """The table's fields of ``endpoint`` (``chat``, ``completions`` or ``responses``) by name."""
    return {f.name: f for f in FIELDS if endpoint in f.endpoints}


def types(endpoint: str) -> dict[str, tuple[str, ...]]:
    """The JSON types each listed field of ``endpoint`` may have (``protocol.check_body_types``)."""
    return {name: f.types for name, f in fields(endpoint).items()}


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON values (``0`` and ``0.0`` are the same number, ``false`` is no number)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


class Refused(ValueError):
    """A field the table refuses at the value given (``field``: its name)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def apply(
    body: dict[str, Any], endpoint: str, template_reads: frozenset[str] | set[str] = frozenset()
) -> tuple[list[str], list[str]]:
    """Sort a body's fields by the table (values of honoured fields are checked elsewhere).

    Args:
        body: the request body (a JSON object; types already checked).
        endpoint: ``chat``, ``completions`` or ``responses``.
        template_reads: the ``template`` fields the model's chat template reads.

    Returns:
        (ignored, template): the fields given that are ignored (listed or unknown), in
        the body's order; the ``template`` fields given that go to the template.

    Raises:
        Refused: a ``refused`` field given, or a ``neutral`` one at another value.
    """
    table = fields(endpoint)
    ignored, template = [], []
    for name, value in body.items():
        f = table.get(name)
        if value is None and f is not None:
            continue  # null: the field is absent
        if f is None or f.rule == IGNORED or (f.rule == TEMPLATE and name not in template_reads):
            ignored.append(name)
        elif f.rule == TEMPLATE:
            template.append(name)
        elif f.rule == REFUSED:
            raise Refused(name, f"{name} is not supported ({f.why}); leave it out")
        elif f.rule == NEUTRAL and not any(_same(value, v) for v in f.neutral):
            allowed = " or ".join(json.dumps(v) for v in f.neutral)
            raise Refused(
                name, f"{name} {json.dumps(value)[:80]} is not supported ({f.why}); leave it out or send {allowed}"
            )
    return ignored, template


def template_reads(chat_template: Any) -> set[str]:
    """The ``template`` fields whose name occurs in ``chat_template`` (a string, or a dict of
    named templates): a template that never names the variable cannot read it."""
    text = chat_template if isinstance(chat_template, str) else json.dumps(chat_template or "")
    return {f.name for f in FIELDS if f.rule == TEMPLATE and f.name in text}


def markdown_table() -> str:
    """The table as Markdown, one row per field and endpoint set (docs/agents.md §5)."""
    rows = ["| field | endpoints | from | rule | what it does here |", "|---|---|---|---|---|"]
    for f in FIELDS:
        where = "all" if set(f.endpoints) == set(ALL) else ", ".join(e for e in ALL if e in f.endpoints)
        rows.append(f"| `{f.name}` | {where} | {f.origin} | {f.rule} | {f.why} |")
    return "\n".join(rows)

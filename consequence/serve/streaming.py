"""Token-by-token streaming: the text of a reply as its tokens are sampled, and the SSE chunks
(the Responses API's events: ``serve.responses``).

A choice is streamed as text deltas while it is sampled when its reply is plain text (no
tool calls to parse: no tools, ``tool_choice`` ``none``, or ``/v1/completions``). Every
delta sent is a prefix of the reply's final content, which is computed as for a whole
reply (``Renderer.parse``, the stop strings): :class:`TextStream` holds back what the end
of the reply may still change, namely

* a tail that may be the start of a stop string (the content ends before the first one);
* an incomplete UTF-8 character (a token that decodes to ``U+FFFD`` alone);
* trailing whitespace, and, in chat, a reply that opens with whitespace (the parser strips
  a finished reply, not one cut at ``max_tokens``: only the end tells which).

A reply with tool calls to parse is sent when it is sampled (its text would otherwise be
sent as content before it is read as a call). The last chunk of each choice carries the
rest of the content, the tool calls, the finish reason, the sampled ids and log-probs.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any


class TextStream:
    """The deltas of one streamed choice (module doc).

    Args:
        tokenizer: decodes the sampled ids (``skip_special_tokens=False``, as the parser).
        stop_ids: end-of-turn ids (never text).
        stops: the request's stop strings.
        strip: the final content is stripped of surrounding whitespace when the reply
            ends (chat); ``False`` for completions.
    """

    def __init__(self, tokenizer, stop_ids: Collection[int], stops: list[str], strip: bool):
        self.tokenizer, self.stop_ids, self.stops, self.strip = tokenizer, set(stop_ids), stops, strip
        self.ids: list[int] = []
        self.sent = ""  # the text sent so far

    def add(self, token_ids: list[int]) -> str:
        """Take newly sampled ids; the text that may be sent now (``""`` for none)."""
        self.ids += [t for t in token_ids if t not in self.stop_ids]
        safe = self._safe(self.tokenizer.decode(self.ids, skip_special_tokens=False))
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent) :], safe
        return delta

    def _safe(self, text: str) -> str:
        """The longest prefix of ``text`` that the final content is sure to start with."""
        at = min((text.find(s) for s in self.stops if s in text), default=-1)
        # before the first stop string, or short of a tail that may begin one
        text = text[:at] if at >= 0 else text[: len(text) - _stop_prefix_len(text, self.stops)]
        text = text.rstrip("\ufffd")
        if self.strip:
            if text[:1].isspace():
                return ""  # kept or stripped: the end of the reply decides
            text = text.rstrip()
        return text

    def rest(self, final: str) -> str:
        """The last delta: ``final`` (the content) after what was sent."""
        return final[len(self.sent) :] if final.startswith(self.sent) else ""


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def sse(chunk: dict[str, Any]) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(chunk)}\n\n"


DONE = "data: [DONE]\n\n"


def named_sse(event: str, data: dict[str, Any]) -> str:
    """One server-sent event with its name (the Responses API's ``event: response.created``)."""
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


# ---- chat.completion.chunk ---------------------------------------------------------------
def chat_base(full_id: str, created: int, model: str) -> dict[str, Any]:
    """The fields every ``chat.completion.chunk`` of one response shares."""
    return {"id": full_id, "object": "chat.completion.chunk", "created": created, "model": model}


def chat_delta(base: dict[str, Any], k: int, delta: dict[str, Any]) -> dict[str, Any]:
    """A chunk with ``delta`` for choice ``k``."""
    return base | {"choices": [{"index": k, "delta": delta, "finish_reason": None}]}


def chat_end(base: dict[str, Any], full: dict[str, Any], sent: list[str], include_usage: bool) -> list[dict[str, Any]]:
    """The last chunks of a chat stream: per choice the rest of its content after ``sent[k]``
    and its tool calls, then its finish reason with the ids and log-probs; then the usage
    when ``stream_options.include_usage`` asked for it."""
    chunks = []
    for ch in full["choices"]:
        msg, k = ch["message"], ch["index"]
        delta: dict[str, Any] = {}
        content = msg.get("content") or ""
        if content[len(sent[k]) :]:
            delta["content"] = content[len(sent[k]) :]
        if msg.get("tool_calls"):
            delta["tool_calls"] = [c | {"index": j} for j, c in enumerate(msg["tool_calls"])]
        if delta:
            chunks.append(chat_delta(base, k, delta))
        end = {
            "index": k,
            "delta": {},
            "finish_reason": ch["finish_reason"],
            "logprobs": ch["logprobs"],
            "token_ids": ch["token_ids"],
            "token_logprobs": ch["token_logprobs"],
        }
        chunks.append(base | {"choices": [end]})
    if include_usage:
        chunks.append(base | {"choices": [], "usage": full["usage"]})
    return chunks


# ---- text_completion chunks --------------------------------------------------------------
def completion_base(full_id: str, created: int, model: str) -> dict[str, Any]:
    """The fields every streamed ``text_completion`` chunk of one response shares."""
    return {"id": full_id, "object": "text_completion", "created": created, "model": model}


def completion_delta(base: dict[str, Any], k: int, text: str) -> dict[str, Any]:
    """A chunk with ``text`` for choice ``k``."""
    return base | {"choices": [{"index": k, "text": text, "logprobs": None, "finish_reason": None}]}


def completion_end(
    base: dict[str, Any], full: dict[str, Any], sent: list[str], include_usage: bool
) -> list[dict[str, Any]]:
    """The last chunks of a completions stream: per choice the rest of its text, its finish
    reason, log-probs, ids; then the usage when asked for."""
    chunks = []
    for ch in full["choices"]:
        k = ch["index"]
        end = {
            "index": k,
            "text": ch["text"][len(sent[k]) :],
            "logprobs": ch["logprobs"],
            "finish_reason": ch["finish_reason"],
            "token_ids": ch["token_ids"],
            "token_logprobs": ch["token_logprobs"],
        }
        chunks.append(base | {"choices": [end]})
    if include_usage:
        chunks.append(base | {"choices": [], "usage": full["usage"]})
    return chunks

"""The OpenAI ``/v1/completions`` wire format: a prompt in (text or token ids), text out.

For harnesses that apply their own chat template: the prompt is the model's whole input,
given as one string (tokenised as it is, without special tokens added) or one list of
token ids (used as they are). The response carries, besides ``text``, vLLM's
``prompt_token_ids`` and per choice ``token_ids`` and ``token_logprobs`` (always:
``return_token_ids`` changes nothing), and with ``logprobs`` = k the OpenAI ``logprobs``
object with k alternatives per token. A ``max_tokens`` left out is 16, as in OpenAI's
and vLLM's API (in an ``--agent`` episode: the run's ``--max-new-tokens``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from consequence.serve import compat
from consequence.serve.protocol import Choice, SamplingRequest, bad, check_body_types, read_sampling, usage

DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


@dataclass
class CompletionRequest(SamplingRequest):
    """A checked ``/v1/completions`` request.

    Attributes:
        prompt_text: the prompt as text (``None`` when given as ids).
        prompt_ids: the prompt as token ids (``None`` when given as text: tokenised later,
            off the event loop).
        logprobs: ``logprobs`` was given (then ``top_logprobs`` alternatives per token).
    """

    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    logprobs: bool = False


def parse_completion_request(body: Any, served: str | Sequence[str], vocab_size: int) -> CompletionRequest:
    """Check a ``/v1/completions`` body and return it as a :class:`CompletionRequest`.

    Args:
        body: the decoded JSON body.
        served: the served model name(s).
        vocab_size: token ids must be in ``[0, vocab_size)``.

    Raises:
        ServeError: 404 for a model not served; 400 for a refused field or value, or a
            prompt that is not one non-empty string or one non-empty list of token ids.
    """
    check_body_types(body, compat.COMPLETIONS)
    req = CompletionRequest(model="")
    read_sampling(body, req, compat.COMPLETIONS, served)
    req.logprobs = body.get("logprobs") is not None
    req.prompt_text, req.prompt_ids = _prompt(body["prompt"], vocab_size)
    return req


def _prompt(prompt: Any, vocab_size: int) -> tuple[str | None, list[int] | None]:
    """(text, None) or (None, ids) of ``prompt``; a list of one prompt is that prompt."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # clients send [prompt] for one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt is empty", "prompt", "invalid_value")
        return prompt, None
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        wrong = [t for t in prompt if not 0 <= t < vocab_size]
        if wrong:
            raise bad(
                f"prompt holds token id {wrong[0]}, outside this model's vocabulary [0, {vocab_size})",
                "prompt",
                "invalid_value",
            )
        return None, list(prompt)
    raise bad(
        "prompt must be one non-empty string or one non-empty list of token ids (integers); "
        "send several prompts as several requests",
        "prompt",
        "invalid_value",
    )


def completion_logprobs(ch: Choice) -> dict[str, Any]:
    """The legacy ``logprobs`` object of a choice: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (one ``{token: log-prob}`` per token) and ``text_offset``."""
    offsets, at = [], 0
    for t in ch.tokens:
        offsets.append(at)
        at += len(t)
    tops = ch.top or [[] for _ in ch.tokens]
    return {
        "tokens": list(ch.tokens),
        "token_logprobs": list(ch.token_logprobs),
        "top_logprobs": [dict(top) for top in tops],
        "text_offset": offsets,
    }


def text_completion(req: CompletionRequest, choices: list[Choice], prompt_ids: list[int]) -> dict[str, Any]:
    """The ``text_completion`` object, with vLLM's ``prompt_token_ids`` and, per choice,
    ``token_ids`` and ``token_logprobs``."""
    return {
        "id": "cmpl-" + uuid.uuid4().hex,
        "object": "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [
            {
                "index": k,
                "text": ch.message.get("content") or "",
                "logprobs": completion_logprobs(ch) if req.logprobs else None,
                "finish_reason": ch.finish_reason,
                "token_ids": ch.token_ids,
                "token_logprobs": ch.token_logprobs,
            }
            for k, ch in enumerate(choices)
        ],
        "usage": usage(prompt_ids, choices),
        "prompt_token_ids": prompt_ids,
    }

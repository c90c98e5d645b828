"""Constrained decoding: a grammar's allowed tokens at each step, through llguidance.

The sampler (``policy.sampler``) takes one :class:`Constraint` per completion (or ``None``)
and, at each step, draws the token from the model's distribution restricted to the tokens
the grammar allows next; it then feeds the sampled token back (:meth:`Constraint.advance`).
This module is the only one that knows the engine, llguidance
(https://github.com/guidance-ai/llguidance): it builds the engine's tokenizer from a Hugging
Face tokenizer, compiles a grammar (a JSON schema, or a Lark grammar whose rules may embed
JSON schemas with ``%json {...}``) and keeps one matcher per completion.

The order of the processing, and what is recorded (the sampler's module doc has the rest):
the grammar mask comes first, on the raw logits (as vLLM applies its guided-decoding mask
before temperature, top-k and top-p); then ``logits / T``; top-k and top-p are taken among
the allowed tokens only; the kept support is the allowed set ∩ the top-k / top-p set, and it
is recorded per token like any top-k / top-p support (``Sample.keep_ids``), so the trainer
scores the token under exactly the masked distribution it was drawn from.

JSON is written compactly with Python's separators (``", "`` and ``": "``, no other
whitespace: ``json.dumps``' own layout, the one tool calls are written in by
``harness.tool_formats``), so a model cannot spend its budget on whitespace.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Collection
from typing import Any

import llguidance
import llguidance.hf
import torch

# The JSON layout every grammar here writes (llguidance's JsonCompileOptions).
JSON_LAYOUT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_TOKENIZERS_LOCK = threading.Lock()


class GrammarError(ValueError):
    """A grammar (a JSON schema, a Lark grammar) the engine cannot compile; the message is the engine's reason."""


@functools.lru_cache(maxsize=8)
def _engine_tokenizer(hf_tokenizer, stop_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=len(hf_tokenizer), eos_token=list(stop_ids))


def engine_tokenizer(hf_tokenizer, stop_ids: Collection[int]) -> llguidance.LLTokenizer:
    """The llguidance tokenizer of a Hugging Face fast tokenizer (built once per tokenizer
    and stop ids, ~1 s on a 49k vocabulary; cached).

    Args:
        hf_tokenizer: a ``transformers`` fast tokenizer (its vocabulary is ``len(hf_tokenizer)`` ids).
        stop_ids: the ids that end a completion (end-of-turn, EOS): a finished grammar
            allows exactly these next.

    Raises:
        GrammarError: a slow (Python) tokenizer, which llguidance cannot read.
    """
    try:
        with _TOKENIZERS_LOCK:  # serve builds grammars in worker threads
            return _engine_tokenizer(hf_tokenizer, tuple(sorted(stop_ids)))
    except ValueError as e:
        raise GrammarError(f"constrained decoding needs a fast tokenizer: {e}") from None


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The llguidance grammar of one JSON value valid under ``schema`` (compact layout: module doc).

    Args:
        schema: a JSON schema (``{"type": "object"}``: any JSON object).

    Raises:
        GrammarError: ``schema`` is not a JSON object.
    """
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)  # type: ignore[arg-type]
    except ValueError as e:
        raise GrammarError(str(e)) from None


def lark_json(schema: dict[str, Any]) -> str:
    """``schema`` as a Lark ``%json`` item (a rule's body), laid out as :data:`JSON_LAYOUT`."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_LAYOUT})


def lark_grammar(lark: str) -> str:
    """The llguidance grammar of a Lark grammar (``start`` is its start rule)."""
    return llguidance.LLMatcher.grammar_from_lark(lark)


class Grammar:
    """A compiled grammar over one tokenizer: what each completion's :class:`Constraint` starts from.

    Args:
        spec: an llguidance grammar (:func:`json_schema_grammar`, :func:`lark_grammar`).
        tokenizer: the engine tokenizer (:func:`engine_tokenizer`).

    Raises:
        GrammarError: the engine cannot compile ``spec`` (its reason as the message).
    """

    def __init__(self, spec: str, tokenizer: llguidance.LLTokenizer) -> None:
        error = llguidance.LLMatcher.validate_grammar(spec, tokenizer)
        if error and not error.startswith("WARNING"):
            raise GrammarError(error.strip())
        self.spec, self.tokenizer = spec, tokenizer

    def start(self) -> Constraint:
        """A fresh :class:`Constraint` (nothing sampled yet) for one completion."""
        return Constraint(llguidance.LLMatcher(self.tokenizer, self.spec, log_level=0))


class Constraint:
    """One completion's grammar state: the ``policy.sampler.Constraint`` protocol.

    Args:
        matcher: a fresh ``llguidance.LLMatcher``.

    Raises:
        GrammarError: the matcher could not be built (its error).
    """

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        self.matcher = matcher

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """[vocab_size] bool on the CPU: the ids the grammar allows next (ids past the tokenizer's
        vocabulary, the model's padding rows, never are). Once the grammar is complete only the
        stop ids are allowed."""
        bias = self.matcher.compute_logit_bias()  # one byte per tokenizer id: 0 (refused) or 200
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        n = min(len(bias), vocab_size)
        mask[:n] = torch.frombuffer(bytearray(bias[:n]), dtype=torch.uint8) != 0
        return mask

    def advance(self, token: int) -> None:
        """Feed the sampled ``token`` to the grammar.

        Raises:
            RuntimeError: the grammar refuses it (the sampler drew outside :meth:`allowed`: a bug).
        """
        if not self.matcher.consume_token(token):
            raise RuntimeError(
                f"constrained decoding: token {token} refused by the grammar: {self.matcher.get_error()}"
            )

"""The renderer: one object owns both directions of token-in / token-out.

messages → prompt token ids (through the model's own chat template), and sampled token
ids → assistant message with an explicit stop reason. Observation tokens (what the
harness appends after a model call) are the suffix the chat template adds when the tool
results are rendered after the assistant turn, so the token stream of an episode equals
what ``apply_chat_template`` renders for the whole conversation (case 13), while the
assistant's own tokens stay exactly the sampled ids (case 09).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass
class ParsedTurn:
    """A sampled assistant turn, parsed.

    Attributes:
        message: the assistant message for the conversation history (role, content,
            tool_calls in the OpenAI shape).
        tool_calls: ``[{"name": str, "arguments": dict}, ...]`` in the order sampled.
        parse_error: why no valid call could be read, else ``None``.
        stop_reason: ``"stop"`` (end-of-turn sampled) or ``"length"`` (cut by the budget).
    """

    message: dict[str, Any]
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    parse_error: str | None = None
    stop_reason: str = "stop"


class Renderer:
    """Renders conversations with a Hugging Face tokenizer's chat template.

    Args:
        tokenizer: a ``PreTrainedTokenizerBase`` with ``chat_template`` set.
        tools: JSON-schema function specs (OpenAI function-calling shape).
        end_of_turn: the token that ends an assistant turn (``<|im_end|>`` for Qwen-style
            templates); defaults to ``<|im_end|>`` when the vocabulary has it, else EOS.

    Raises:
        ValueError: the tokenizer has no chat template, or no end-of-turn token.
    """

    def __init__(self, tokenizer, tools: list[dict], end_of_turn: str | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the tokenizer has no chat template; set tokenizer.chat_template (a Jinja "
                "template that renders tools and tool calls) or use an instruct checkpoint"
            )
        self.tokenizer = tokenizer
        self.tools = tools
        vocab = tokenizer.get_vocab()
        eot = end_of_turn or ("<|im_end|>" if "<|im_end|>" in vocab else tokenizer.eos_token)
        if eot is None or eot not in vocab:
            raise ValueError(f"end-of-turn token {eot!r} is not in the vocabulary")
        self.end_of_turn = eot
        self.eot_id: int = vocab[eot]
        self.stop_ids = {self.eot_id}
        if tokenizer.eos_token_id is not None:
            self.stop_ids.add(tokenizer.eos_token_id)
        self._check_tools_rendered()

    def _check_tools_rendered(self) -> None:
        """A template that silently drops ``tools=`` would give the policy a prompt without
        them (SmolLM2's does): refuse instead of training on such prompts.

        Raises:
            ValueError: some tool's name does not appear in the rendered prompt.
        """
        if not self.tools:
            return
        text = self.render_text([{"role": "user", "content": "x"}], add_generation_prompt=True)
        missing = [t["function"]["name"] for t in self.tools if t["function"]["name"] not in text]
        if missing:
            raise ValueError(f"this model's chat template does not render the environment's tools (no "
                             f"{', '.join(missing)} in the prompt): the policy would never see them. Use an "
                             "environment without tools (e.g. --env reasoning-gym) or a model whose chat template "
                             "renders tools= (a Hermes / Qwen-style template)")

    # ---- messages → tokens -------------------------------------------------------
    def render_text(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of the conversation followed by the assistant header."""
        return self.encode(self.render_text(messages, add_generation_prompt=True))

    def observation_ids(self, history: list[dict], assistant: dict,
                        tool_messages: list[dict]) -> list[int]:
        """Ids the template adds after the assistant turn's end-of-turn token.

        That is the boundary after end-of-turn, every tool result (all of them in one
        rendering, so parallel results share one turn: case 13), and the next assistant
        header. The end-of-turn token itself is not repeated: it was sampled and is a
        target (case 08).

        Raises:
            ValueError: the template does not render the earlier conversation as a prefix
                of the later one (then the context must be rebuilt, not extended).
        """
        before = self.render_text(history + [assistant], add_generation_prompt=False)
        cut = before.rfind(self.end_of_turn)
        if cut < 0:
            raise ValueError("the chat template did not close the assistant turn with "
                             f"{self.end_of_turn!r}")
        cut += len(self.end_of_turn)
        after = self.render_text(history + [assistant] + tool_messages,
                                 add_generation_prompt=True)
        if after[:cut] != before[:cut]:
            raise ValueError("chat template re-renders earlier turns differently: "
                             "the next prompt does not extend the previous one")
        return self.encode(after[cut:])

    # ---- tokens → message ----------------------------------------------------------
    def parse(self, output_ids: list[int], stop_reason: str, answers: bool = False) -> ParsedTurn:
        """Parse sampled ids into an assistant message and its tool calls.

        A malformed call is reported in ``parse_error`` (it becomes an error observation),
        never raised. With ``answers`` (the environment takes a reply without a tool call
        as its answer) such a reply is not an error; with no tools declared at all, no
        text is read as a tool call: the whole reply is the answer.
        """
        ids = output_ids[:-1] if output_ids and output_ids[-1] in self.stop_ids else output_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        calls, errors = [], []
        for block in _TOOL_CALL_RE.findall(text) if self.tools else ():
            call, err = _parse_call(block)
            (errors.append(err) if err else calls.append(call))
        content = _TOOL_CALL_RE.sub("", text).strip() if self.tools else text.strip()
        if stop_reason == "length":
            error = "output cut at the token limit"
        elif errors:
            error = errors[0]
        elif not calls and not answers:
            error = 'no tool call; answer with <tool_call>{"name": ..., "arguments": {...}}</tool_call>'
        else:
            error = None
        message: dict[str, Any] = {"role": "assistant", "content": content if error is None else text}
        if calls and error is None:
            message["tool_calls"] = [{"type": "function", "function": c} for c in calls]
        return ParsedTurn(message, calls if error is None else [], error, stop_reason)

    def format_call(self, name: str, arguments: dict) -> str:
        """The assistant text of one tool call, exactly as the template renders it."""
        return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def _parse_call(block: str) -> tuple[dict | None, str | None]:
    try:
        obj = json.loads(block.strip())
    except json.JSONDecodeError as e:
        return None, f"tool call is not valid JSON ({e.msg} at char {e.pos})"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, 'tool call must be an object with a string "name"'
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models emit arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None, "tool call arguments are not a JSON object"
    if not isinstance(args, dict):
        return None, "tool call arguments must be a JSON object"
    return {"name": obj["name"], "arguments": args}, None


def replay_conversation(renderer: Renderer, messages: list[dict]) -> list[tuple[list[int], list[int], list[int]]]:
    """Re-render a finished conversation (system, user, then assistant/tool turns) as calls.

    Used for demonstrations written as messages (not sampled): each assistant turn's ids
    are the template's own rendering of its tool calls plus end-of-turn, exactly what
    the model must learn to sample.

    Returns:
        one ``(context_ids, output_ids, observation_ids)`` per assistant turn.
    """
    history = list(messages[:2])
    context = renderer.prompt_ids(history)
    calls = []
    i = 2
    while i < len(messages):
        assistant = messages[i]
        j = i + 1
        while j < len(messages) and messages[j]["role"] == "tool":
            j += 1
        tools = messages[i + 1: j]
        text = "\n".join(renderer.format_call(c["function"]["name"], c["function"]["arguments"])
                         for c in assistant.get("tool_calls", [])) or assistant.get("content", "")
        out = renderer.encode(text) + [renderer.eot_id]
        obs = renderer.observation_ids(history, assistant, tools) if tools and j < len(messages) else []
        calls.append((list(context), out, obs))
        context = context + out + obs
        history = history + [assistant] + tools
        i = j
    return calls

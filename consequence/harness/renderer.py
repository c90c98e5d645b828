"""The renderer: one object owns both directions of token-in / token-out.

messages → prompt token ids (through the model's own chat template), and sampled token
ids → assistant message with an explicit stop reason. Observation tokens (what the
harness appends after a model call) are the suffix the chat template adds when the tool
results are rendered after the assistant turn, so the token stream of an episode equals
what ``apply_chat_template`` renders for the whole conversation (case 13), while the
assistant's own tokens stay exactly the sampled ids (case 09).

Tool formats. A template that renders ``tools=`` and ``tool_calls`` itself (Qwen2.5,
Hermes, the bundled tiny model's) is used as it is (``"native"``). A plain template
that drops them but renders the content of every turn (SmolLM2's ChatML) gets the tools
in the Hermes function-calling format instead (``"hermes"``, :func:`hermes_messages`):
the tool specs go into the system message in the wording of the Qwen2.5 chat template,
tool calls become ``<tool_call>`` blocks in the assistant's content, and tool results
become one user turn of ``<tool_response>`` blocks; the template then renders those
messages, so everything it renders is still exactly ``apply_chat_template``'s text.
A template that does neither is refused (:class:`Renderer`).
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

TOOL_FORMATS = ("auto", "native", "hermes")

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
    """One tool call as assistant text: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

    ``arguments`` given as a JSON string (the OpenAI wire shape) is decoded first.
    """
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):  # not JSON: kept as the text it is
            arguments = json.loads(arguments)
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def hermes_tools_text(tools: list[dict]) -> str:
    """The system-message text that declares ``tools`` in the Hermes / Qwen2.5 format."""
    return HERMES_TOOLS_HEAD + "".join("\n" + json.dumps(t) for t in tools) + HERMES_TOOLS_TAIL


def hermes_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """``messages`` with the tools written into their content (pure; the input is not changed).

    - The tool specs (:func:`hermes_tools_text`) are appended to the first message's
      content when it is a system message (after a blank line), else a system message
      holding only them is put first (so a template's default system prompt is not added
      on top of them).
    - An assistant message's ``tool_calls`` become its content: the original content (if
      any) and a newline, then each call as :func:`format_call` writes it, joined by
      newlines; the ``tool_calls`` key is dropped.
    - Consecutive ``tool`` messages become one ``user`` message whose content is each
      result as ``<tool_response>\\n{content}\\n</tool_response>``, joined by newlines, so
      parallel results share one turn (case 13), as in the Qwen2.5 template.
    """
    spec = hermes_tools_text(tools)
    out: list[dict] = []
    if messages and messages[0].get("role") == "system":
        first = messages[0].get("content") or ""
        out.append({**messages[0], "content": (first + "\n\n" if first else "") + spec})
        rest = messages[1:]
    else:
        out.append({"role": "system", "content": spec})
        rest = messages
    previous = None
    for m in rest:
        role = m.get("role")
        if role == "tool":
            block = "<tool_response>\n" + str(m.get("content") or "") + "\n</tool_response>"
            if previous == "tool":
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        elif role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(format_call(*_name_and_arguments(c)) for c in m["tool_calls"])
            content = m.get("content") or ""
            out.append(
                {
                    **{k: v for k, v in m.items() if k != "tool_calls"},
                    "content": (content + "\n" if content else "") + calls,
                }
            )
        else:
            out.append(dict(m))
        previous = role
    return out


def _name_and_arguments(call: dict) -> tuple[str, dict | str]:
    fn = call.get("function", call)
    return fn["name"], fn.get("arguments", {})


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

    Tool calls are read and written in the Hermes / Qwen2.5 convention
    ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``. How the tools
    reach the prompt is ``tool_format``:

    - ``"native"``: the template renders ``tools=`` and ``tool_calls`` itself.
    - ``"hermes"``: the template only renders the content of turns (SmolLM2's ChatML);
      the messages are rewritten by :func:`hermes_messages` (tool specs in the system
      message in the Qwen2.5 template's wording, calls in the assistant's content,
      results as ``<tool_response>`` blocks in one user turn) and rendered without
      ``tools=``. The text is still exactly what ``apply_chat_template`` renders for the
      rewritten messages, so the observation ids and the token stream of an episode work
      as in ``"native"``.
    - ``"auto"``: ``"native"`` when the template shows every tool's name given
      ``tools=``, else ``"hermes"`` when the rewritten messages show every tool's name, a
      probe tool call and a probe tool result verbatim and the generation prompt adds an
      assistant header.

    Args:
        tokenizer: a ``PreTrainedTokenizerBase`` with ``chat_template`` set.
        tools: JSON-schema function specs (OpenAI function-calling shape).
        end_of_turn: the token that ends an assistant turn (``<|im_end|>`` for Qwen-style
            templates); defaults to ``<|im_end|>`` when the vocabulary has it, else EOS.
        tool_format: ``"auto"`` (default), ``"native"`` or ``"hermes"``.

    Attributes:
        tool_format: the format in use: ``"native"``, ``"hermes"``, or ``"none"`` when
            there are no tools (then nothing is rewritten).

    Raises:
        ValueError: the tokenizer has no chat template, or no end-of-turn token; an
            unknown ``tool_format``; ``"native"`` with a template that drops ``tools=``;
            ``"hermes"`` (or ``"auto"`` after ``"native"`` failed) with a template that
            does not show the rewritten content (the message says what is missing).
    """

    def __init__(self, tokenizer, tools: list[dict], end_of_turn: str | None = None, tool_format: str = "auto"):
        if tool_format not in TOOL_FORMATS:
            raise ValueError(f"tool_format must be one of {', '.join(map(repr, TOOL_FORMATS))}, not {tool_format!r}")
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
        self.tool_format = "none" if not tools else self._resolve_tool_format(tool_format)

    def _resolve_tool_format(self, requested: str) -> str:
        """The tool format in use (see the class doc).

        A template that silently drops ``tools=`` would give the policy a prompt without
        them (SmolLM2's does): the Hermes format stands in for it only where the template
        shows what the rewritten messages carry; otherwise refuse instead of training on
        such prompts.

        Raises:
            ValueError: as in the class doc.
        """
        names = [t["function"]["name"] for t in self.tools]
        if requested in ("auto", "native"):
            self.tool_format = "native"
            text = self.render_text([{"role": "user", "content": "x"}], add_generation_prompt=True)
            missing = [n for n in names if n not in text]
            if not missing:
                return "native"
            dropped = (
                f"this model's chat template does not render the environment's tools (no "
                f"{', '.join(missing)} in the prompt)"
            )
            if requested == "native":
                raise ValueError(
                    f"{dropped}: the policy would never see them (tool_format='native'). Use "
                    "tool_format='auto' or 'hermes' to write them into the messages, an environment "
                    "without tools (e.g. --env reasoning-gym) or a model whose chat template renders "
                    "tools= (a Hermes / Qwen-style template)"
                )
        else:
            dropped = "tool_format='hermes' was asked for"
        self.tool_format = "hermes"
        gaps = self._hermes_gaps(names)
        if gaps:
            raise ValueError(
                f"{dropped}, and the Hermes tool format cannot stand in: with the tools written into "
                f"the messages, {'; '.join(gaps)}. Pass a chat template that renders tools= and "
                "tool_calls (tokenizer.chat_template, e.g. a Hermes / Qwen2.5-style template), use a "
                "model whose chat template renders the content of system, assistant and tool turns "
                "and an assistant header for the generation prompt, or an environment without tools "
                "(e.g. --env reasoning-gym)"
            )
        return "hermes"

    def _hermes_gaps(self, names: list[str]) -> list[str]:
        """What the template fails to show of a probe conversation in the Hermes format."""
        call = {"type": "function", "function": {"name": names[0], "arguments": {"probe": 1}}}
        probe: list[dict[str, Any]] = [
            {"role": "system", "content": "probe-system"},
            {"role": "user", "content": "probe-user"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": names[0], "content": "probe-result"},
        ]
        try:
            text = self.render_text(probe, add_generation_prompt=False)
            prompt = self.render_text(probe[:2], add_generation_prompt=True)
            no_header = self.render_text(probe[:2], add_generation_prompt=False)
        except Exception as e:  # noqa: BLE001  (a template may raise on roles it does not know)
            return [f"the template raised {type(e).__name__}: {e}"]
        gaps = []
        missing = [n for n in names if n not in prompt]
        if missing:
            gaps.append(f"the prompt does not show the tools {', '.join(missing)} (system message content)")
        if format_call(names[0], {"probe": 1}) not in text:
            gaps.append("an assistant tool call is not rendered verbatim (assistant message content)")
        if "<tool_response>\nprobe-result\n</tool_response>" not in text:
            gaps.append("a tool result is not rendered verbatim (user message content)")
        if prompt == no_header:
            gaps.append("the generation prompt adds no assistant header (add_generation_prompt renders nothing)")
        return gaps

    # ---- messages → tokens -------------------------------------------------------
    def render_text(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """``apply_chat_template``'s text of ``messages`` (rewritten first in ``"hermes"``)."""
        if getattr(self, "tool_format", None) == "hermes":
            return self.tokenizer.apply_chat_template(
                hermes_messages(messages, self.tools),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        return self.tokenizer.apply_chat_template(
            messages,
            tools=self.tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of the conversation followed by the assistant header."""
        return self.encode(self.render_text(messages, add_generation_prompt=True))

    def observation_ids(self, history: list[dict], assistant: dict, tool_messages: list[dict]) -> list[int]:
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
            raise ValueError(f"the chat template did not close the assistant turn with {self.end_of_turn!r}")
        cut += len(self.end_of_turn)
        after = self.render_text(history + [assistant] + tool_messages, add_generation_prompt=True)
        if after[:cut] != before[:cut]:
            raise ValueError(
                "chat template re-renders earlier turns differently: the next prompt does not extend the previous one"
            )
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
        calls: list[dict[str, Any]] = []
        errors: list[str] = []
        for block in _TOOL_CALL_RE.findall(text) if self.tools else ():
            call, err = _parse_call(block)  # exactly one of the two is None
            if err is not None:
                errors.append(err)
            elif call is not None:
                calls.append(call)
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
        """The assistant text of one tool call, exactly as the template renders it
        (:func:`format_call`; in ``"hermes"`` that is what the template is given)."""
        return format_call(name, arguments)


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


def replay_conversation(
    renderer: Renderer, messages: list[dict], opening: int | None = None
) -> list[tuple[list[int], list[int], list[int]]]:
    """Re-render a finished conversation (its opening, then assistant turns and their results) as calls.

    Used for demonstrations written as messages (not sampled): each assistant turn's ids
    are the template's own rendering of its text and tool calls plus end-of-turn (its
    content, then each call as :func:`format_call` writes it, one per line: what a policy
    samples for that turn), exactly what the model must learn to sample. The ``tool`` and
    ``user`` messages after an assistant turn are its observations (tool results; the
    environment's reply to an answer).

    Args:
        renderer: the renderer of the tokens.
        messages: the conversation.
        opening: how many messages come before the first assistant turn of the episode
            (system prompt, worked examples, request); default: up to and including the
            first user message (a conversation without worked examples).

    Returns:
        one ``(context_ids, output_ids, observation_ids)`` per assistant turn.
    """
    if opening is None:
        opening = next((k + 1 for k, m in enumerate(messages) if m.get("role") == "user"), len(messages))
    history = list(messages[:opening])
    context = renderer.prompt_ids(history)
    calls = []
    i = opening
    while i < len(messages):
        assistant = messages[i]
        j = i + 1
        while j < len(messages) and messages[j]["role"] in ("tool", "user"):
            j += 1
        results = messages[i + 1 : j]
        content = assistant.get("content") or ""
        tool_calls = "\n".join(
            renderer.format_call(c["function"]["name"], c["function"]["arguments"])
            for c in assistant.get("tool_calls") or []
        )
        text = (content + "\n" + tool_calls if content else tool_calls) if tool_calls else content
        out = renderer.encode(text) + [renderer.eot_id]
        obs = renderer.observation_ids(history, assistant, results) if results and j < len(messages) else []
        calls.append((list(context), out, obs))
        context = context + out + obs
        history = history + [assistant] + results
        i = j
    return calls

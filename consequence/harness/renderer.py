"""The renderer: one object owns both directions of token-in / token-out.

messages → prompt token ids (through the model's own chat template), and sampled token
ids → assistant message with an explicit stop reason. Observation tokens (what the
harness appends after a model call) are the suffix the chat template adds when the tool
results are rendered after the assistant turn, so the token stream of an episode equals
what ``apply_chat_template`` renders for the whole conversation (case 13), while the
assistant's own tokens stay exactly the sampled ids (case 09).

Tool formats. A template that renders ``tools=`` and ``tool_calls`` itself (Qwen2.5,
Hermes, Qwen3-Coder, Llama 3.1, the bundled tiny model's) is used as it is (``"native"``);
the replies are read in the call format the template itself writes (found by rendering a
probe call and reading it back with each format of :mod:`consequence.harness.tool_formats`;
Hermes when none reads it). A plain template that drops them but renders the content of
every turn (SmolLM2's ChatML) gets the tools in a declared format instead (``"hermes"`` by
default, or any format of the registry, :func:`~consequence.harness.tool_formats.declare`):
the tool specs go into the system message in that family's wording, tool calls become
text in the assistant's content, and tool results become that family's result messages;
the template then renders those messages, so everything it renders is still exactly
``apply_chat_template``'s text. A template that does neither is refused (:class:`Renderer`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from consequence.harness.tool_formats import (
    FORMATS,
    HERMES,
    HERMES_TOOLS_HEAD,
    HERMES_TOOLS_TAIL,
    ToolFormat,
    declare,
    format_call,
)

# What ``tool_format`` takes: how the tools reach the prompt (auto, native) or a declared format.
TOOL_FORMATS: tuple[str, ...] = ("auto", "native", *FORMATS)
__all__ = [
    "HERMES_TOOLS_HEAD",
    "HERMES_TOOLS_TAIL",
    "TOOL_FORMATS",
    "ParsedTurn",
    "Renderer",
    "format_call",
    "hermes_messages",
    "hermes_tools_text",
    "replay_conversation",
]


def hermes_tools_text(tools: list[dict]) -> str:
    """The system-message text that declares ``tools`` in the Hermes / Qwen2.5 format."""
    return HERMES.tools_text(tools)


def hermes_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """``messages`` with the tools written into their content in the Hermes format
    (:func:`~consequence.harness.tool_formats.declare` with ``hermes``; pure).

    The specs are appended to the system message in the Qwen2.5 template's wording, an
    assistant message's ``tool_calls`` become ``<tool_call>`` blocks of its content (after
    its text and a newline), and each run of ``tool`` messages becomes one ``user`` message
    of ``<tool_response>\\n{content}\\n</tool_response>`` blocks joined by newlines, so
    parallel results share one turn (case 13), as in the Qwen2.5 template.
    """
    return declare(HERMES, messages, tools)


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

    How the tools reach the prompt, and how calls are written and read, is ``tool_format``:

    - ``"native"``: the template renders ``tools=`` and ``tool_calls`` itself. Calls are
      read in the format the template writes a probe call in (:attr:`call_format`: the
      first format of :data:`~consequence.harness.tool_formats.FORMATS` that reads the
      template's own rendering of it back; ``"hermes"`` when none does).
    - a format name (``"hermes"``, ``"qwen3_coder"``, ``"llama3_json"``, ``"mistral"``,
      ``"pythonic"``): the template only has to render the content of turns (SmolLM2's
      ChatML); the messages are rewritten by
      :func:`~consequence.harness.tool_formats.declare` (tool specs in the system message
      in that family's wording, calls in the assistant's content, results as the format's
      result messages) and rendered without ``tools=``. The text is still exactly what
      ``apply_chat_template`` renders for the rewritten messages, so the observation ids
      and the token stream of an episode work as in ``"native"``.
    - ``"auto"``: ``"native"`` when the template shows every tool's name given
      ``tools=``, else ``"hermes"`` when the rewritten messages show every tool's name, a
      probe tool call and a probe tool result verbatim and the generation prompt adds an
      assistant header.

    Args:
        tokenizer: a ``PreTrainedTokenizerBase`` with ``chat_template`` set.
        tools: JSON-schema function specs (OpenAI function-calling shape).
        end_of_turn: the token that ends an assistant turn (``<|im_end|>`` for Qwen-style
            templates); defaults to ``<|im_end|>`` when the vocabulary has it, else EOS.
        tool_format: ``"auto"`` (default), ``"native"`` or a format name (:data:`TOOL_FORMATS`).
        template_kwargs: extra variables for the chat template on every rendering (vLLM's
            ``chat_template_kwargs``, e.g. ``{"enable_thinking": False}``); ``None`` for none.

    Attributes:
        tool_format: how the tools reach the prompt: ``"native"``, a format name (declared
            in the messages), or ``"none"`` when there are no tools (then nothing is
            rewritten and no text is read as a call).
        call_format: the format calls are written and read in (``"hermes"`` unless the
            template or ``tool_format`` says otherwise).

    Raises:
        ValueError: the tokenizer has no chat template, or no end-of-turn token; an
            unknown ``tool_format``; ``"native"`` with a template that drops ``tools=``;
            a format name (or ``"auto"`` after ``"native"`` failed) with a template that
            does not show the rewritten content, or tools whose names the format cannot
            write (the message says what is missing).
    """

    def __init__(
        self,
        tokenizer,
        tools: list[dict],
        end_of_turn: str | None = None,
        tool_format: str = "auto",
        template_kwargs: dict[str, Any] | None = None,
    ):
        self.template_kwargs = dict(template_kwargs or {})  # before any rendering: the tool-format probes use it
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
        self.call_format = "hermes"
        self.tool_format = "none" if not tools else self._resolve_tool_format(tool_format)

    @property
    def format(self) -> ToolFormat:
        """The :class:`~consequence.harness.tool_formats.ToolFormat` of :attr:`call_format`."""
        return FORMATS[self.call_format]

    def _resolve_tool_format(self, requested: str) -> str:
        """The tool format in use (see the class doc); sets :attr:`call_format`.

        A template that silently drops ``tools=`` would give the policy a prompt without
        them (SmolLM2's does): a declared format stands in for it only where the template
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
                self.call_format = self._native_call_format(names[0])
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
            requested, asked = "hermes", False
        else:
            dropped, asked = f"tool_format={requested!r} was asked for", True
        self._declare(requested, names, dropped, hint_native=asked)
        return requested

    def _declare(self, name: str, names: list[str], dropped: str, hint_native: bool) -> None:
        """Use format ``name`` declared in the messages, or refuse (see :meth:`_resolve_tool_format`)."""
        fmt = FORMATS[name]
        unwritable = fmt.check_tools(self.tools)
        if unwritable:
            raise ValueError(
                f"tool_format={name!r}: the {fmt.title} format cannot write these tools: {'; '.join(unwritable)}. "
                "Rename them or use another --tool-format"
            )
        self.tool_format = self.call_format = name
        gaps = self._declared_gaps(names)
        if gaps:
            native = self._renders_tools_as(names) if hint_native else None
            also = (
                f". This template renders tools= itself (its calls read as {native}): use tool_format='native'"
                if native
                else ""
            )
            raise ValueError(
                f"{dropped}, and the {fmt.title} tool format cannot stand in: with the tools written into "
                f"the messages, {'; '.join(gaps)}. Pass a chat template that renders tools= and "
                "tool_calls (tokenizer.chat_template, e.g. a Hermes / Qwen2.5-style template), use a "
                "model whose chat template renders the content of system, assistant and tool turns "
                f"and an assistant header for the generation prompt, or an environment without tools "
                f"(e.g. --env reasoning-gym){also}"
            )

    def _renders_tools_as(self, names: list[str]) -> str | None:
        """The call format of a template that renders ``tools=`` itself, else None (for a hint)."""
        try:
            text = self._native_text([{"role": "user", "content": "x"}], True)
        except Exception:  # noqa: BLE001  (any template error means: not usable natively)
            return None
        return self._native_call_format(names[0]) if all(n in text for n in names) else None

    def _native_call_format(self, name: str) -> str:
        """The format that reads the template's own rendering of a probe call back exactly.

        The probe is a system and a user message, then an assistant turn with one call of
        ``name`` with arguments ``{"probe": 1}``; its text after the generation prompt, up
        to the end-of-turn token, is read with each registered format in turn. Hermes when
        the template raises, does not render the probe turn after the prompt, or no format
        reads it (the behaviour before formats were registered).
        """
        head = [{"role": "system", "content": "probe-system"}, {"role": "user", "content": "probe-user"}]
        call = {"type": "function", "function": {"name": name, "arguments": {"probe": 1}}}
        try:
            prompt = self._native_text(head, True)
            full = self._native_text(head + [{"role": "assistant", "content": "", "tool_calls": [call]}], False)
        except Exception:  # noqa: BLE001  (a template may raise on a call without an id, say)
            return "hermes"
        if not full.startswith(prompt):
            return "hermes"
        reply = full[len(prompt) :].split(self.end_of_turn)[0]
        want = [{"name": name, "arguments": {"probe": 1}}]
        for fmt_name, fmt in FORMATS.items():
            content, calls, error = fmt.split(reply, self.tools)
            if error is None and calls == want and not content and not fmt.check_tools(self.tools):
                return fmt_name
        return "hermes"

    def _declared_gaps(self, names: list[str]) -> list[str]:
        """What the template fails to show of a probe conversation in the declared format."""
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
        if self.format.write([(names[0], {"probe": 1})]) not in text:
            gaps.append("an assistant tool call is not rendered verbatim (assistant message content)")
        results = self.format.result_messages(["probe-result"])
        if any(m["content"] not in text for m in results):
            gaps.append(f"a tool result is not rendered verbatim ({results[0]['role']} message content)")
        if prompt == no_header:
            gaps.append("the generation prompt adds no assistant header (add_generation_prompt renders nothing)")
        return gaps

    # ---- messages → tokens -------------------------------------------------------
    def render_text(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """``apply_chat_template``'s text of ``messages`` (rewritten first in a declared format)."""
        if getattr(self, "tool_format", None) in FORMATS:
            return self.tokenizer.apply_chat_template(
                declare(FORMATS[self.tool_format], messages, self.tools),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **self.template_kwargs,
            )
        return self._native_text(messages, add_generation_prompt)

    def _native_text(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=self.tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
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
        content, calls, parse_error = self.format.split(text, self.tools) if self.tools else (text.strip(), [], None)
        if stop_reason == "length":
            error = "output cut at the token limit"
        elif parse_error:
            error = parse_error
        elif not calls and not answers:
            error = f"no tool call; answer with {self.format.hint}"
        else:
            error = None
        message: dict[str, Any] = {"role": "assistant", "content": content if error is None else text}
        if calls and error is None:
            message["tool_calls"] = [{"type": "function", "function": c} for c in calls]
        return ParsedTurn(message, calls if error is None else [], error, stop_reason)

    def format_call(self, name: str, arguments: dict) -> str:
        """The assistant text of one tool call in :attr:`call_format` (in a declared format that is
        what the template is given; natively, what the template writes for it)."""
        return self.format.write([(name, arguments)])

    def format_calls(self, calls: list[tuple[str, Any]]) -> str:
        """The assistant text of one turn's ``(name, arguments)`` calls in :attr:`call_format`
        (Hermes: each as :meth:`format_call` writes it, one per line; Mistral and pythonic: one list)."""
        return self.format.write(calls)


def replay_conversation(
    renderer: Renderer, messages: list[dict], opening: int | None = None
) -> list[tuple[list[int], list[int], list[int]]]:
    """Re-render a finished conversation (its opening, then assistant turns and their results) as calls.

    Used for demonstrations written as messages (not sampled): each assistant turn's ids
    are the template's own rendering of its text and tool calls plus end-of-turn (its
    content, then its calls as :meth:`Renderer.format_calls` writes them: what a policy
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
        planned = [(c["function"]["name"], c["function"]["arguments"]) for c in assistant.get("tool_calls") or []]
        tool_calls = renderer.format_calls(planned) if planned else ""
        text = (content + "\n" + tool_calls if content else tool_calls) if tool_calls else content
        out = renderer.encode(text) + [renderer.eot_id]
        obs = renderer.observation_ids(history, assistant, results) if results and j < len(messages) else []
        calls.append((list(context), out, obs))
        context = context + out + obs
        history = history + [assistant] + results
        i = j
    return calls

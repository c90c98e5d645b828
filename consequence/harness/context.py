"""Harness box: what the model sees of its episode — the context builder C(h).

Two kinds of change, with different consequences for training (docs/environments.md, "What the
model sees"):

- **Presentation** of a new observation (``--observation-format``, ``--show-budget``): applied
  when the observation is created, before its ids are computed, so the model samples against
  exactly that text and the context is still a continuation (no new training row).
- **Rewrite** of the history (``--context last:K`` / ``summary:K``): earlier turns are dropped
  (or replaced by one summary), so the next context is tokenised fresh from the kept messages
  and is not a continuation of the previous call's context + sampled ids + observation ids;
  ``records.trajectory_to_rows`` then starts a new training row. Sampled ids (the targets) are
  never re-tokenised: each row's targets are exactly the calls' ``output_ids``.

A turn is one assistant message and the tool / user results that answer it. The opening
(system prompt, worked examples, the task's request) is always kept.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from consequence.config.views import parse_context, parse_observation_format
from consequence.records import Trajectory, trajectory_to_rows


def truncate(text: str, limit: int) -> str:
    """``text`` unchanged when at most ``limit`` characters; else its first ⌈limit/2⌉ and last
    ⌊limit/2⌋ characters around the marker ``"\\n[… C characters cut …]\\n"``, C the number cut
    (characters of the Python string, not bytes or tokens)."""
    if len(text) <= limit:
        return text
    head = (limit + 1) // 2
    tail = limit - head
    return f"{text[:head]}\n[… {len(text) - limit} characters cut …]\n{text[len(text) - tail :]}"


def budget_line(turns: int, tokens: int, tool_calls: int) -> str:
    """The line ``--show-budget`` appends to a turn's last observation (remaining counts)."""
    return f"[budget left: {turns} turns, {tokens} tokens, {tool_calls} tool calls]"


def summarise(dropped: Sequence[dict]) -> str:
    """The default summary of dropped turns: one line per tool call made (name and JSON
    arguments) or reply given, each followed by the first line of the result that answered it."""
    lines = ["Earlier turns, dropped from this context:"]
    for m in dropped:
        if m.get("role") == "assistant":
            calls = m.get("tool_calls") or []
            for c in calls:
                fn = c.get("function", c)
                lines.append(f"- called {fn.get('name')}({json.dumps(fn.get('arguments', {}), sort_keys=True)})")
            if not calls:
                lines.append(f"- replied: {_first_line(m.get('content'))}")
        else:
            lines.append(f"  result: {_first_line(m.get('content'))}")
    return "\n".join(lines)


def _first_line(content: Any) -> str:
    return str(content or "").strip().split("\n", 1)[0]


@dataclass(frozen=True)
class ContextBuilder:
    """The harness options of what the model sees (module doc); the defaults are today's harness.

    Attributes:
        context: ``full`` (every turn verbatim), ``last:K`` (the opening + the last K turns) or
            ``summary:K`` (as ``last:K``, the dropped turns summarised by ``summarise`` and the
            summary appended to the task's request message — one message, so templates that
            require user / assistant alternation accept it).
        observation_format: ``raw`` (the environment's text), ``json`` (``{"tool": name,
            "output": text}``; the reply to an answer has tool ``"answer"``) or ``truncated:N``
            (longer than N characters: head and tail kept, :func:`truncate`).
        show_budget: append :func:`budget_line` to each turn's last observation.
        summarise: ``dropped messages -> str`` for ``summary:K`` (Python API; default
            :func:`summarise`, deterministic).

    Raises:
        ValueError: a malformed ``context`` or ``observation_format`` (at construction).
    """

    context: str = "full"
    observation_format: str = "raw"
    show_budget: bool = False
    summarise: Callable[[Sequence[dict]], str] = summarise

    def __post_init__(self) -> None:
        parse_context(self.context)
        parse_observation_format(self.observation_format)

    def present(self, results: list[dict], turns: int, tokens: int, tool_calls: int) -> list[dict]:
        """The turn's result messages as the model is shown them: each formatted, and with
        ``show_budget`` the remaining ``turns`` / ``tokens`` / ``tool_calls`` on the last one."""
        kind, n = parse_observation_format(self.observation_format)
        shown = [dict(m, content=self._format(m, kind, n)) for m in results]
        if self.show_budget and shown:
            shown[-1]["content"] = f"{shown[-1]['content']}\n{budget_line(turns, tokens, tool_calls)}"
        return shown

    @staticmethod
    def _format(message: dict, kind: str, n: int) -> str:
        text = str(message.get("content") or "")
        if kind == "json":
            name = message.get("name") if message.get("role") == "tool" else "answer"
            return json.dumps({"tool": name, "output": text}, ensure_ascii=False)
        return truncate(text, n) if kind == "truncated" else text

    def window(self, messages: list[dict], opened: int) -> list[dict] | None:
        """The messages the next call sees, or None when that is all of ``messages`` (no rewrite).

        ``messages[:opened]`` is the opening (always kept); the rest are turns, each starting at
        an assistant message.
        """
        kind, k = parse_context(self.context)
        starts = [i for i in range(opened, len(messages)) if messages[i].get("role") == "assistant"]
        if kind == "full" or len(starts) <= k:
            return None
        cut = starts[-k]
        head = [dict(m) for m in messages[:opened]]
        if kind == "summary":
            note = self.summarise(messages[opened:cut])
            head[-1]["content"] = f"{head[-1].get('content') or ''}\n\n{note}"
        return head + messages[cut:]


def context_metrics(trajs: Sequence[Trajectory]) -> dict[str, float | None]:
    """Per iteration: ``rows_per_episode_mean`` (training rows of ``records.trajectory_to_rows``
    per episode that made a model call; None when none did) and ``context_rewrite_fraction``
    (the share of episodes whose context was rewritten at least once; None when there are none)."""
    called = [t for t in trajs if t.calls]
    return {
        "rows_per_episode_mean": sum(len(trajectory_to_rows(t)) for t in called) / len(called) if called else None,
        "context_rewrite_fraction": sum(t.context_rewrites > 0 for t in trajs) / len(trajs) if trajs else None,
    }

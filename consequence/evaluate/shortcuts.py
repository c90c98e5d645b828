"""Diagnostics that tell a real gain from a shortcut (issue 33): tool use, invalid calls, answers.

A success rate that rises can be a skill, or a policy that stopped calling its tools, copies
the last tool output, or gives one answer to every problem. These numbers show which. They
are pure functions of a list of :class:`~consequence.records.Trajectory`, generic over
environments: they read only the record's fields (``n_tool_calls``, the calls'
``parse_error`` / ``stop_reason`` / ``invalid_calls``, ``final_code``, ``messages``).

Conventions (every function here):

- **Episodes**: ``env_error`` episodes are left out (the environment failed, not the policy;
  as everywhere). "Valid episodes" below are the others.
- **Undefined is None**: a share over no episodes, calls or answers is ``None`` (JSON
  ``null``; shown as "—"), never 0 and never NaN (``metrics.jsonl`` is strict JSON).
- **Answer** of an episode (:func:`answer_of`): ``final_code`` with surrounding whitespace
  stripped: what the environment's episode kept as its answer (e.g. calculator: the number
  extracted from the reply; a single-turn task: the reply; code repair: the final program).
  An episode is **answered** when that is a non-empty string.
- **Tool value** of an episode (:func:`last_tool_value`): the text of the last
  ``role: "tool"`` message of ``messages`` that is not an error observation, stripped. Error
  observations start with ``error:`` (the harness's own: unparsable output, unknown tool,
  bad arguments; the built-in environments' failed tool runs use the same prefix).
- Answers and tool values are compared as exact strings after stripping (``"84"`` and
  ``"84.0"`` differ): the test is whether the answer is the tool's output, copied.

Units: every ``*_rate``, ``*_share``, ``invalid_call_*``, ``answered_fraction`` and
``answer_equals_tool_value`` is a fraction in [0, 1]; ``answer_entropy`` is in bits.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from consequence.harness.tools import BAD_ARGUMENTS, UNKNOWN_TOOL
from consequence.records import Trajectory

ERROR_PREFIX = "error:"  # how an error observation starts (harness and built-in environments)

# The keys of :func:`shortcut_metrics`, in order, with how reports label them.
SHORTCUT_METRICS: tuple[tuple[str, str], ...] = (
    ("tool_call_rate", "episodes with a tool call"),
    # not cost_summary's parse_error_fraction (report.md's cost line), which counts every call, cut ones too
    ("invalid_call_unparsable", "model calls that stopped on their own and did not parse (cut ones excluded)"),
    ("invalid_call_unknown_tool", "model calls naming an unknown tool"),
    ("invalid_call_bad_arguments", "model calls with bad arguments"),
    ("answered_fraction", "episodes answered"),
    ("answer_equals_tool_value", "answers equal to the last tool value"),
    ("top_answer_share", "answers equal to the most common one"),
    ("answer_entropy", "answer entropy (bits)"),
)


def valid_episodes(trajs: Sequence[Trajectory]) -> list[Trajectory]:
    """The episodes that are not ``env_error``."""
    return [t for t in trajs if t.outcome != "env_error"]


def answer_of(t: Trajectory) -> str | None:
    """The episode's answer: ``final_code`` stripped; None when it is missing or empty."""
    if not isinstance(t.final_code, str):
        return None
    a = t.final_code.strip()
    return a or None


def _text(content: Any) -> str:
    """A message's content as text (a list of OpenAI content parts: their texts joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def last_tool_value(t: Trajectory) -> str | None:
    """The text of the episode's last ``role: "tool"`` message that is not an error
    observation (starts with ``error:``) and not empty, stripped; None without one."""
    for m in reversed(t.messages):
        if m.get("role") != "tool":
            continue
        text = _text(m.get("content")).strip()
        if text and not text.startswith(ERROR_PREFIX):
            return text
    return None


def _share(hits: int, total: int) -> float | None:
    return hits / total if total else None


def tool_call_rate(trajs: Sequence[Trajectory]) -> float | None:
    """Share of valid episodes with at least one tool call (``n_tool_calls >= 1``: every
    call the harness read as a tool call counts, also one it refused as unknown or with bad
    arguments; an answer and the scripted opening turns of a recovery episode do not)."""
    valid = valid_episodes(trajs)
    return _share(sum(t.n_tool_calls >= 1 for t in valid), len(valid))


def invalid_call_shares(trajs: Sequence[Trajectory]) -> dict[str, float | None]:
    """How the model calls of valid episodes went wrong, each a share of all those calls.

    - ``invalid_call_unparsable``: the output ended by itself (``stop_reason == "stop"``)
      and did not parse into tool calls or an answer (``parse_error`` set: malformed JSON,
      no ``name``, or no tool call where one is required). A call cut at the token limit
      is a truncation (``truncated_fraction``), not counted here.
    - ``invalid_call_unknown_tool``: at least one of the call's tool calls names no
      declared tool (``"unknown_tool"`` in ``ModelCall.invalid_calls``).
    - ``invalid_call_bad_arguments``: at least one has arguments that do not match the
      tool's JSON schema (``"bad_arguments"``).

    A call with both kinds of refused tool calls counts in both; an unparsable call has no
    tool calls, so it is in neither. Records written before ``invalid_calls`` existed count
    0 for the last two. None for all three without model calls.
    """
    calls = [c for t in valid_episodes(trajs) for c in t.calls]
    return {
        "invalid_call_unparsable": _share(
            sum(c.parse_error is not None and c.stop_reason == "stop" for c in calls), len(calls)
        ),
        "invalid_call_unknown_tool": _share(sum(UNKNOWN_TOOL in c.invalid_calls for c in calls), len(calls)),
        "invalid_call_bad_arguments": _share(sum(BAD_ARGUMENTS in c.invalid_calls for c in calls), len(calls)),
    }


def answers(trajs: Sequence[Trajectory]) -> list[str]:
    """The answers of the answered valid episodes, in episode order."""
    return [a for t in valid_episodes(trajs) if (a := answer_of(t)) is not None]


def answered_fraction(trajs: Sequence[Trajectory]) -> float | None:
    """Share of valid episodes that answered (the denominator of the answer metrics)."""
    return _share(len(answers(trajs)), len(valid_episodes(trajs)))


def answer_equals_tool_value(trajs: Sequence[Trajectory]) -> float | None:
    """Share of answered valid episodes whose answer equals their last tool value (exact
    strings, both stripped; an episode without a tool value counts as not equal): a policy
    that answers with whatever the tool said last, right or wrong."""
    answered = [(a, t) for t in valid_episodes(trajs) if (a := answer_of(t)) is not None]
    return _share(sum(a == last_tool_value(t) for a, t in answered), len(answered))


def top_answer_share(trajs: Sequence[Trajectory]) -> float | None:
    """Share of answered valid episodes whose answer is the most common answer of ``trajs``
    (over the whole batch, all tasks together: a policy that gives one answer to every
    problem scores that answer's base rate)."""
    counts = Counter(answers(trajs))
    return _share(max(counts.values()), sum(counts.values())) if counts else None


def answer_entropy(trajs: Sequence[Trajectory]) -> float | None:
    """Shannon entropy, in bits, of the distribution of answers over the answered valid
    episodes: H = −Σ p_a log2 p_a with p_a = (episodes answering a) / (answered episodes).
    0 when every answer is the same; log2(n) when n episodes answer n different things."""
    counts = Counter(answers(trajs))
    n = sum(counts.values())
    if not n:
        return None
    return math.fsum(c / n * math.log2(n / c) for c in counts.values())


def shortcut_metrics(trajs: Sequence[Trajectory]) -> dict[str, float | None]:
    """Every diagnostic of this module, keyed as :data:`SHORTCUT_METRICS` (see the module
    doc and each function for the definitions; None where undefined)."""
    return {
        "tool_call_rate": tool_call_rate(trajs),
        **invalid_call_shares(trajs),
        "answered_fraction": answered_fraction(trajs),
        "answer_equals_tool_value": answer_equals_tool_value(trajs),
        "top_answer_share": top_answer_share(trajs),
        "answer_entropy": answer_entropy(trajs),
    }


def format_metric(key: str, value: float | None) -> str:
    """One value for a report: a share as a percentage, the entropy in bits, None as "—"."""
    if value is None or not math.isfinite(value):
        return "—"
    return f"{value:.2f} bits" if key == "answer_entropy" else f"{100 * value:.1f} %"

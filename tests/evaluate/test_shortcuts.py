"""The shortcut diagnostics (issue 33, part 3), each recomputed by hand on episodes built by hand."""

import json
import math

import pytest

from consequence.evaluate.compare import constant_answer_warning, summarize
from consequence.evaluate.shortcuts import (
    SHORTCUT_METRICS,
    answer_entropy,
    answer_equals_tool_value,
    answered_fraction,
    format_metric,
    invalid_call_shares,
    last_tool_value,
    shortcut_metrics,
    tool_call_rate,
    top_answer_share,
)
from consequence.records import ModelCall, Trajectory


def _ep(answer=None, tools=(), outcome="finished", n_tool_calls=0, calls=()):
    """One episode: its final answer, the contents of its tool messages in order, its calls."""
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "What is 4837 * 29 - 1204?"}]
    for content in tools:
        msgs += [{"role": "assistant", "content": ""}, {"role": "tool", "name": "calculator", "content": content}]
    return Trajectory(
        "p#0",
        "p#0",
        0,
        0,
        0,
        calls=list(calls),
        outcome=outcome,
        final_code=answer,
        messages=msgs,
        n_tool_calls=n_tool_calls,
    )


def _call(parse_error=None, stop="stop", invalid=(), tool_calls=()):
    return ModelCall(
        [1], [2], [0.0], stop, tool_calls=list(tool_calls), parse_error=parse_error, invalid_calls=list(invalid)
    )


def test_top_answer_share_and_entropy_by_hand():
    eps = [_ep("7"), _ep("7"), _ep(" 7\n"), _ep("12")]  # answers are stripped: " 7\n" is "7"
    eps += [_ep("12", outcome="env_error"), _ep("   "), _ep(None)]  # left out / not answered
    assert top_answer_share(eps) == 3 / 4
    by_hand = -(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25))  # = 0.8113 bits
    assert answer_entropy(eps) == pytest.approx(by_hand) and by_hand == pytest.approx(0.8113, abs=1e-4)
    assert answered_fraction(eps) == 4 / 6  # 6 valid episodes (the env_error left out), 4 answered
    assert answer_entropy([_ep("1")] * 5) == 0.0 and top_answer_share([_ep("1")] * 5) == 1.0
    # n different answers: log2(n) bits, each the top one's share 1/n
    assert answer_entropy([_ep(str(i)) for i in range(8)]) == pytest.approx(3.0)
    assert top_answer_share([_ep(str(i)) for i in range(8)]) == 1 / 8


def test_answer_equals_the_last_tool_value_by_hand():
    eps = [
        _ep("84", tools=["84"]),  # equal
        _ep(" 84\n", tools=["84", "error: calculator limit reached (4 calls)"]),  # an error is no value: equal
        _ep("85", tools=["84"]),  # the tool said otherwise: not equal
        _ep("84", tools=["84", "139069"]),  # the LAST value counts: not equal
        _ep("3"),  # no tool value: not equal
        _ep(None, tools=["3.5"]),  # not answered: left out
        _ep("9", tools=["9"], outcome="env_error"),  # left out
    ]
    assert answer_equals_tool_value(eps) == 2 / 5
    assert [last_tool_value(t) for t in eps[:5]] == ["84", "84", "84", "139069", None]
    harness_error = _ep("84", tools=["84"])
    harness_error.messages.append({"role": "tool", "name": "error", "content": "error: no tool call; ..."})
    parts = _ep("5")  # OpenAI content parts are read as their text
    parts.messages.append({"role": "tool", "name": "t", "content": [{"type": "text", "text": " 5 "}]})
    assert answer_equals_tool_value([harness_error, parts]) == 1.0


def test_tool_call_rate_by_hand():
    eps = [_ep(n_tool_calls=0), _ep(n_tool_calls=1), _ep(n_tool_calls=3), _ep(n_tool_calls=0)]
    assert tool_call_rate(eps + [_ep(n_tool_calls=2, outcome="env_error")]) == 2 / 4


def test_invalid_calls_split_by_kind_as_shares_of_model_calls():
    calc = [{"name": "calculator", "arguments": {"expression": "1+1"}}]
    one = _ep(
        calls=[
            _call(tool_calls=calc),  # ran
            _call(parse_error="tool call is not valid JSON (Expecting value at char 0)"),  # unparsable
            _call(tool_calls=[{"name": "calc", "arguments": {}}], invalid=["unknown_tool"]),
        ]
    )
    two = _ep(
        calls=[
            _call(tool_calls=calc * 2, invalid=["bad_arguments", "unknown_tool"]),  # counts in both
            _call(parse_error="output cut at the token limit", stop="length"),  # a truncation, not counted
            _call(),  # the answer
        ]
    )
    failed = _ep(outcome="env_error", calls=[_call(parse_error="no tool call")])  # left out
    assert invalid_call_shares([one, two, failed]) == {
        "invalid_call_unparsable": 1 / 6,
        "invalid_call_unknown_tool": 2 / 6,
        "invalid_call_bad_arguments": 1 / 6,
    }


def test_nothing_to_measure_is_none_never_a_crash_or_nan():
    keys = [k for k, _ in SHORTCUT_METRICS]
    for trajs in ([], [_ep("7", outcome="env_error", calls=[_call()], n_tool_calls=1)]):
        m = shortcut_metrics(trajs)
        assert list(m) == keys and all(v is None for v in m.values())
        json.dumps(m, allow_nan=False)  # metrics.jsonl is strict JSON
    unanswered = shortcut_metrics([_ep(None, calls=[_call()]), _ep("", n_tool_calls=1, calls=[_call()])])
    assert unanswered["tool_call_rate"] == 0.5 and unanswered["answered_fraction"] == 0.0
    assert unanswered["invalid_call_unparsable"] == 0.0
    assert [unanswered[k] for k in ("answer_equals_tool_value", "top_answer_share", "answer_entropy")] == [None] * 3
    assert [format_metric("top_answer_share", None), format_metric("answer_entropy", 0.8113)] == ["—", "0.81 bits"]
    assert format_metric("tool_call_rate", 0.5) == "50.0 %"


def test_summaries_carry_the_diagnostics_and_the_constant_warning_reads_answered_episodes():
    s = summarize([_ep("7", tools=["7"], n_tool_calls=1, calls=[_call()]), _ep("12"), _ep(None)])
    assert {k for k, _ in SHORTCUT_METRICS} <= set(s)
    assert (s["tool_call_rate"], s["answered_fraction"], s["answer_equals_tool_value"]) == (1 / 3, 2 / 3, 1 / 2)
    assert (s["top_answer"], s["answered_episodes"], s["top_answer_share"]) == ("7", 2, 1 / 2)
    # 20 answered of 40 episodes, all "1": the share is over the answered ones
    rl = summarize([_ep("1")] * 20 + [_ep(None)] * 20)
    warm = summarize([_ep(str(i % 4)) for i in range(40)])
    w = constant_answer_warning("test", "greedy", warm, rl)
    assert "'1' in 100% of its answered episodes (warm start: 25%; 20 of 40 episodes answered)" in w
    nothing = summarize([_ep(None)] * 30)  # no answer at all: no share, no warning
    assert nothing["top_answer_share"] is None and constant_answer_warning("test", "greedy", warm, nothing) is None
    assert constant_answer_warning("test", "greedy", nothing, rl) is not None  # a warm start without answers


def test_the_report_s_two_unparsable_rates_have_distinct_labels_and_values():
    """report.md's cost line counts every model call that did not parse (cut ones and env-error
    episodes' too); the shortcut table's row only calls that stopped on their own (valid episodes)."""
    from consequence.evaluate.episode_eval import cost_summary
    from consequence.evaluate.report import markdown

    eps = [
        _ep("7", calls=[_call(parse_error="bad json"), _call()]),
        _ep(None, outcome="truncated", calls=[_call(parse_error="cut", stop="length")]),
        _ep(None, outcome="env_error", calls=[_call(parse_error="bad json")]),
    ]
    budgets = {"max_turns": 2, "max_new_tokens": 16, "max_total_tokens": 768, "max_tool_calls": 10}
    settings = {"tasks": "t", "split": "validation", "model": "m", "problems": 3, "n": 1, "temperature": 1.0}
    result = {
        "settings": settings | {"seed": 0, "split_seed": 0, "budgets": budgets, "isolation": {}},
        "pass_at_k": {},
        "outcomes": {"shares": {}},
        "cost": cost_summary(eps),
        "env_errors": 1,
        "exclusion_rule": "env errors left out",
        "shortcuts": shortcut_metrics(eps),
    }
    text = markdown(result)
    # 3 of the 4 calls did not parse; of the 3 calls of valid episodes 1 stopped on its own unparsed
    assert "(75.0 % of all model calls did not parse, those cut at the token limit and of env-error " in text
    assert "| model calls that stopped on their own and did not parse (cut ones excluded) | 33.3 % |" in text
    assert text.count("unparsable") == 0 and text.count("did not parse") == 2

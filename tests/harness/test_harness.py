import json

import pytest

from consequence.harness.renderer import Renderer, replay_conversation
from consequence.harness.tools import BAD_ARGUMENTS, UNKNOWN_TOOL, call_problem, check_tool_specs, validate_call
from consequence.records import ModelCall, Trajectory, trajectory_to_rows
from consequence.rollout.episodes import Budgets, EpisodeSpec, run_episodes
from tool_specs import TOOLS

SYSTEM = [{"role": "system", "content": "You fix code."}, {"role": "user", "content": "Fix find_max."}]


def _call(name, **args):
    return {"type": "function", "function": {"name": name, "arguments": args}}


def test_parse_round_trip(renderer):
    text = renderer.format_call("replace_line", {"line": 2, "code": "    best = xs[0]"})
    turn = renderer.parse(renderer.encode(text) + [renderer.eot_id], "stop")
    assert turn.parse_error is None
    assert turn.tool_calls == [{"name": "replace_line", "arguments": {"line": 2, "code": "    best = xs[0]"}}]


def test_malformed_call_is_an_error_not_a_crash(renderer):
    bad = renderer.encode('<tool_call>\n{"name": "run_tests", "arguments": {\n</tool_call>') + [renderer.eot_id]
    assert "not valid JSON" in renderer.parse(bad, "stop").parse_error
    assert "no tool call" in renderer.parse(renderer.encode("hello") + [renderer.eot_id], "stop").parse_error
    assert "token limit" in renderer.parse(renderer.encode("<tool_call>"), "length").parse_error


def test_argument_validation_against_schema():
    specs = check_tool_specs(TOOLS)
    assert validate_call({"name": "replace_line", "arguments": {"line": 2, "code": "x"}}, specs) is None
    assert "line" in validate_call({"name": "replace_line", "arguments": {"line": "2", "code": "x"}}, specs)
    assert "unknown tool" in validate_call({"name": "rm", "arguments": {}}, specs)
    assert "Additional" in validate_call({"name": "run_tests", "arguments": {"x": 1}}, specs)
    # the kind of each problem, recorded in ModelCall.invalid_calls (never read back from the text)
    assert call_problem({"name": "replace_line", "arguments": {"line": 2, "code": "x"}}, specs) is None
    assert call_problem({"name": "rm", "arguments": {}}, specs)[0] == UNKNOWN_TOOL
    kind, message = call_problem({"name": "run_tests", "arguments": {"x": 1}}, specs)
    assert kind == BAD_ARGUMENTS and message == validate_call({"name": "run_tests", "arguments": {"x": 1}}, specs)


@pytest.mark.parametrize(
    "params,needle",
    [
        ({"type": "objekt"}, "'replace_line': parameters are not a valid JSON schema: 'objekt' is not valid"),
        ({"type": "object", "properties": {"line": {"type": 5}}}, "are not a valid JSON schema: 5 is not valid"),
        ({"type": "object", "required": "line"}, "are not a valid JSON schema: 'line' is not of type 'array'"),
        ({"type": "string"}, "parameters must be a JSON schema of type 'object', got type 'string'"),
    ],
)
def test_invalid_tool_schema_is_rejected_with_the_tool_name(params, needle):
    bad = [TOOLS[0], {"type": "function", "function": {"name": "replace_line", "parameters": params}}]
    with pytest.raises(ValueError) as e:
        check_tool_specs(bad)
    assert needle in str(e.value)
    with pytest.raises(ValueError, match="tool spec #0 must look like"):
        check_tool_specs([{"type": "function", "function": {"parameters": {}}}])  # no name


def test_episode_stream_equals_chat_template_and_mask_covers_only_sampled(renderer):
    # case 08 and case 13: two tool results after one assistant turn, stop token a target once
    msgs = SYSTEM + [
        {"role": "assistant", "content": "", "tool_calls": [_call("run_tests"), _call("finish")]},
        {"role": "tool", "name": "run_tests", "content": "2/5 passed"},
        {"role": "tool", "name": "finish", "content": "done"},
        {"role": "assistant", "content": "", "tool_calls": [_call("run_tests")]},
    ]
    calls = [
        ModelCall(c, o, [0.0] * len(o), "stop", observation_ids=obs)
        for c, o, obs in replay_conversation(renderer, msgs)
    ]
    rows = trajectory_to_rows(Trajectory("t", "g", 0, 0, 0, calls=calls))
    assert len(rows) == 1
    ids, mask = rows[0].input_ids, rows[0].loss_mask
    assert len(ids) == len(mask)
    full = renderer.render_text(msgs, add_generation_prompt=False)
    assert renderer.tokenizer.decode(ids) + "\n" == full  # template's own text, the trailing "\n" is not trained
    assert full.count("2/5 passed") == 1 and full.count("<tool_response>") == 2
    targets = [i for i, m in zip(ids, mask) if m]
    assert targets.count(renderer.eot_id) == 2  # each sampled end-of-turn trained exactly once
    newline_after_eot = ids[ids.index(renderer.eot_id) + 1]
    assert mask[ids.index(renderer.eot_id) + 1] == 0 and renderer.tokenizer.decode([newline_after_eot]).startswith("\n")


class _Env:
    """A stub environment: run_tests forever, finish scores 1; a reply without a tool call
    is an ordinary turn (as in code repair), not an answer."""

    tools = TOOLS
    code = "x = 1"
    answer_ends_episode = False

    def reset(self, seed=None, options=None):
        return "Fix find_max.", {}

    def step(self, action):
        if action["name"] == "finish":
            return "done", 1.0, True, False, {}
        return "2/5 passed", 0.0, False, False, {}


class _Scripted:
    def __init__(self, renderer, outputs):
        self.renderer, self.outputs, self.k = renderer, outputs, {}

    def __call__(self, prompts, max_new_tokens, idx):
        from types import SimpleNamespace

        out = []
        for i in idx:
            ids, reason = self.outputs[self.k.get(i, 0)]
            self.k[i] = self.k.get(i, 0) + 1
            out.append(SimpleNamespace(output_ids=ids, logprobs=[-0.5] * len(ids), stop_reason=reason))
        return out


def test_truncation_in_last_of_several_calls_is_recorded(renderer):
    # case 05: the third call hits max_new_tokens without end-of-turn
    ok = renderer.encode(renderer.format_call("run_tests", {})) + [renderer.eot_id]
    cut = renderer.encode('<tool_call>\n{"name": "fin')
    gen = _Scripted(renderer, [(ok, "stop"), (ok, "stop"), (cut, "length")])
    [t] = run_episodes(gen, renderer, [EpisodeSpec(_Env(), "t", "g", 0, 0)], Budgets(), "sys")
    assert t.outcome == "truncated" and t.truncation_reason == "max_new_tokens"
    assert len(t.calls) == 3 and t.calls[-1].stop_reason == "length"


def test_sampled_ids_are_kept_not_retokenised(renderer):
    # case 09: the sampler emits "a" then "b" although the tokenizer would merge them
    tok = renderer.tokenizer
    a, b = tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("b")
    merged = tok.encode("ab", add_special_tokens=False)
    assert merged != [a, b]  # the BPE does merge: the case is real
    finish = renderer.encode(renderer.format_call("finish", {})) + [renderer.eot_id]
    first = renderer.encode(renderer.format_call("run_tests", {})) + [a, b, renderer.eot_id]
    gen = _Scripted(renderer, [(first, "stop"), (finish, "stop")])
    [t] = run_episodes(gen, renderer, [EpisodeSpec(_Env(), "t", "g", 0, 0)], Budgets(), "sys")
    assert t.outcome == "finished" and t.verifier_score == 1.0
    [row] = trajectory_to_rows(t)
    targets = [i for i, m in zip(row.input_ids, row.loss_mask) if m]
    assert targets == first + finish
    assert t.calls[1].context_ids[: len(t.calls[0].context_ids) + len(first)] == t.calls[0].context_ids + first


def test_max_turns_and_parse_errors(renderer):
    junk = renderer.encode("hello") + [renderer.eot_id]
    gen = _Scripted(renderer, [(junk, "stop")] * 3)
    [t] = run_episodes(gen, renderer, [EpisodeSpec(_Env(), "t", "g", 0, 0)], Budgets(max_turns=3), "sys")
    assert t.outcome == "truncated" and t.truncation_reason == "max_turns"
    assert all(c.parse_error for c in t.calls)
    assert "error: no tool call" in renderer.tokenizer.decode(t.calls[0].observation_ids)
    assert json.dumps(t.messages)  # the readable view is plain JSON


def test_refused_calls_are_recorded_by_kind_on_their_model_call(renderer):
    from consequence.evaluate.shortcuts import invalid_call_shares

    def turn(*calls):
        return renderer.encode("\n".join(renderer.format_call(n, a) for n, a in calls)) + [renderer.eot_id], "stop"

    gen = _Scripted(
        renderer,
        [
            turn(("rm", {})),  # unknown tool
            turn(("replace_line", {"line": "2", "code": "x"}), ("rm", {})),  # bad arguments, then unknown
            (renderer.encode("hello") + [renderer.eot_id], "stop"),  # no tool call: unparsable
            turn(("finish", {})),
        ],
    )
    [t] = run_episodes(gen, renderer, [EpisodeSpec(_Env(), "t", "g", 0, 0)], Budgets(), "sys")
    assert [c.invalid_calls for c in t.calls] == [["unknown_tool"], ["bad_arguments", "unknown_tool"], [], []]
    assert t.outcome == "finished" and t.n_tool_calls == 4  # refused calls are still tool calls
    assert "error: unknown tool 'rm'" in json.dumps(t.messages)  # the model still sees the message
    assert invalid_call_shares([t]) == {
        "invalid_call_unparsable": 1 / 4,
        "invalid_call_unknown_tool": 2 / 4,
        "invalid_call_bad_arguments": 1 / 4,
    }


def test_a_reply_without_a_tool_call_is_the_answer_by_default(renderer):
    class Answering(_Env):
        answer_ends_episode = True  # the API's default

        def step(self, action):
            return "", float(action.get("answer") == "hello"), True, False, {}

    gen = _Scripted(renderer, [(renderer.encode("hello") + [renderer.eot_id], "stop")])
    [t] = run_episodes(gen, renderer, [EpisodeSpec(Answering(), "t", "g", 0, 0)], Budgets(max_turns=3), "sys")
    assert (t.outcome, t.verifier_score, len(t.calls), t.calls[0].parse_error) == ("finished", 1.0, 1, None)
    assert t.calls[0].reward == 1.0 and t.env_rewards == {"reward": 1.0}


def test_a_template_that_drops_tools_is_refused(tiny_tokenizer):
    """SmolLM2's template ignores tools=: such a prompt would hide the tools from the policy."""
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    with pytest.raises(ValueError, match="does not render the environment's tools \\(no run_tests"):
        Renderer(tok, TOOLS)
    assert Renderer(tok, []).tools == []  # an environment without tools needs none rendered

"""What the model sees (``harness.context`` in ``run_episodes``): a sliding window's row split and
loss mask, observation formats and the budget line, on scripted episodes of the tiny renderer."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from consequence.harness.context import ContextBuilder, budget_line, context_metrics, summarise, truncate
from consequence.records import read_trajectories, trajectory_to_rows, write_trajectories
from consequence.rollout.episodes import Budgets, EpisodeSpec, opening_messages, run_episodes

LONG = "x" * 30 + "MIDDLE" + "y" * 30  # 66 characters


class _Env:
    """Each ``run_tests`` returns the same ``text``; an answer ends the episode with reward 1."""

    answer_ends_episode = True

    def __init__(self, text="ok"):
        self.text = text

    def reset(self, seed=None):
        return "fix it", {}

    def step(self, action):
        if "answer" in action:
            return "", 1.0, True, False, {}
        return self.text, 0.0, False, False, {}


def _run(renderer, builder, turns, env=None, budgets=Budgets(max_turns=6, max_total_tokens=4000)):
    outputs = [renderer.encode(t) + [renderer.eot_id] for t in turns]
    queue = list(outputs)

    def generate(prompts, max_new_tokens, idx):
        out = queue.pop(0)
        return [SimpleNamespace(output_ids=out, logprobs=[-0.25] * len(out), stop_reason="stop")]

    spec = EpisodeSpec(env or _Env(), "t", "t", 0, 1, builder=builder)
    (traj,) = run_episodes(generate, renderer, [spec], budgets, "sys")
    return traj, outputs


def _calls(renderer, n):
    return [renderer.format_call("run_tests", {})] * n + ["done"]


def test_full_is_todays_harness_one_row_no_rewrite(renderer):
    today, outputs = _run(renderer, None, _calls(renderer, 3))
    full, _ = _run(renderer, ContextBuilder(), _calls(renderer, 3))
    today.wall_time_s = full.wall_time_s = 0.0  # the clock is the only difference allowed
    assert full == today  # ids, messages and counts: the default changes nothing
    assert full.context_rewrites == 0 and len(trajectory_to_rows(full)) == 1


@pytest.mark.parametrize("context", ["last:1", "summary:1"])
def test_sliding_window_splits_rows_and_trains_exactly_the_sampled_ids(renderer, context):
    traj, outputs = _run(renderer, ContextBuilder(context=context), _calls(renderer, 3))
    assert traj.outcome == "finished" and len(traj.calls) == 4
    # turns 1..3 end with 1, 2, 3 turns in the history: with K = 1 calls 3 and 4 see a rebuilt context
    assert traj.context_rewrites == 2
    rows = trajectory_to_rows(traj)
    assert len(rows) == 3 == 1 + traj.context_rewrites  # calls {1, 2}, {3}, {4}: a rewrite starts a new row
    targets = [[i for i, m in zip(r.input_ids, r.loss_mask) if m] for r in rows]
    assert targets == [outputs[0] + outputs[1], outputs[2], outputs[3]]
    assert sum(sum(r.loss_mask) for r in rows) == sum(len(c.output_ids) for c in traj.calls)
    assert all(lp == -0.25 for r in rows for lp, m in zip(r.old_logprobs, r.loss_mask) if m)
    # what call 3 saw: the opening and the last turn only (the summary appended to the request)
    opening = opening_messages("sys", "fix it")
    if context == "summary:1":
        dropped = traj.messages[len(opening) : len(opening) + 2]
        opening[-1]["content"] = "fix it\n\n" + summarise(dropped)
        assert summarise(dropped) == "Earlier turns, dropped from this context:\n- called run_tests({})\n  result: ok"
    kept = traj.messages[len(opening) + 2 : len(opening) + 4]
    assert traj.calls[2].context_ids == renderer.prompt_ids(opening + kept)
    assert traj.messages[: len(opening)] == opening_messages("sys", "fix it")  # the record keeps every turn


def test_truncated_observation_marker_by_hand(renderer):
    # 66 characters, N = 10: head 5, tail 5, 56 cut
    assert truncate(LONG, 10) == "xxxxx\n[… 56 characters cut …]\nyyyyy"
    assert truncate(LONG, 11) == "xxxxxx\n[… 55 characters cut …]\nyyyyy"
    assert truncate(LONG, 66) == LONG
    traj, _ = _run(renderer, ContextBuilder(observation_format="truncated:10"), _calls(renderer, 1), _Env(LONG))
    assert traj.messages[-3]["content"] == "xxxxx\n[… 56 characters cut …]\nyyyyy"
    assert len(trajectory_to_rows(traj)) == 1 and traj.context_rewrites == 0  # still a continuation


def test_json_observation_exact_string(renderer):
    traj, _ = _run(renderer, ContextBuilder(observation_format="json"), _calls(renderer, 1), _Env('a "b"'))
    assert traj.messages[-3]["content"] == '{"tool": "run_tests", "output": "a \\"b\\""}'
    assert json.loads(traj.messages[-3]["content"]) == {"tool": "run_tests", "output": 'a "b"'}


def test_budget_line_numbers_by_hand(renderer):
    budgets = Budgets(max_turns=5, max_new_tokens=48, max_total_tokens=4000, max_tool_calls=7)
    traj, outputs = _run(renderer, ContextBuilder(show_budget=True), _calls(renderer, 2), budgets=budgets)
    first, second = traj.messages[3]["content"], traj.messages[5]["content"]
    c1, c2 = traj.calls[0], traj.calls[1]
    # after call 1: 5 − 1 turns, 4000 − (context + sampled) tokens, 7 − 1 tool calls
    assert first == "ok\n" + budget_line(4, 4000 - len(c1.context_ids) - len(outputs[0]), 6)
    assert second == "ok\n" + budget_line(3, 4000 - len(c2.context_ids) - len(outputs[1]), 5)
    assert budget_line(4, 412, 6) == "[budget left: 4 turns, 412 tokens, 6 tool calls]"
    assert len(c2.context_ids) == len(c1.context_ids) + len(c1.output_ids) + len(c1.observation_ids)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"context": "last:0"}, "--context last:0: last:K needs a whole number >= 1"),
        ({"context": "window:2"}, "--context window:2: choose one of full, last:K, summary:K"),
        ({"observation_format": "truncated:abc"}, "--observation-format truncated:abc: truncated:N needs"),
        ({"observation_format": "xml"}, "--observation-format xml: choose one of raw, json, truncated:N"),
    ],
)
def test_bad_values_are_refused_with_the_option_named(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ContextBuilder(**kwargs)


def test_a_rewrite_after_the_last_call_is_not_counted(renderer):
    # max_turns 3 ends the episode after call 3, whose turn dropped turn 2: no call sees that context
    traj, _ = _run(renderer, ContextBuilder(context="last:1"), _calls(renderer, 3), budgets=Budgets(max_turns=3))
    assert traj.outcome == "truncated" and len(traj.calls) == 3
    assert traj.context_rewrites == 1 and len(trajectory_to_rows(traj)) == 2


def test_rows_and_rewrite_metrics(renderer):
    window, _ = _run(renderer, ContextBuilder(context="last:1"), _calls(renderer, 3))
    full, _ = _run(renderer, None, _calls(renderer, 3))
    # 3 rows and 1 row: mean 2; one of two episodes rewritten
    assert context_metrics([window, full]) == {"rows_per_episode_mean": 2.0, "context_rewrite_fraction": 0.5}
    assert context_metrics([]) == {"rows_per_episode_mean": None, "context_rewrite_fraction": None}


def test_rewrites_round_trip_and_old_files_read_with_zero(renderer, tmp_path):
    import pyarrow.parquet as pq

    window, _ = _run(renderer, ContextBuilder(context="last:1"), _calls(renderer, 3))
    path = tmp_path / "iter_0000.parquet"
    write_trajectories(path, [window])
    assert read_trajectories(path)[0].context_rewrites == 2
    old = tmp_path / "old.parquet"  # a file written before the field existed
    pq.write_table(pq.read_table(path).drop_columns(["context_rewrites"]), old)
    assert read_trajectories(old)[0].context_rewrites == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--context", "last:0"], "--context last:0: last:K needs a whole number >= 1"),
        (["--observation-format", "truncated:abc"], "--observation-format truncated:abc: truncated:N needs"),
        (["--show-budget", "--agent", "m:agent"], "--show-budget with --agent is not supported"),
    ],
)
def test_cli_refuses_bad_values_before_any_work(tmp_path, args, message):
    from typer.testing import CliRunner

    from consequence.cli import app

    res = CliRunner().invoke(app, ["train", *args, "--run-dir", str(tmp_path / "r")], env={"COLUMNS": "250"})
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split())
    assert not (tmp_path / "r").exists()

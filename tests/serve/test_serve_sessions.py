"""The session recorder (consequence.serve.sessions) on synthetic histories: every training
row after the first is a counted prefix break with its reason, rows == 1 + breaks, and the
check of that invariant catches a recorder or a record that breaks it (docs/agents.md §3)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from consequence.harness.renderer import Renderer
from consequence.policy.sampler import Sample
from consequence.records import ModelCall, Trajectory, trajectory_to_rows
from consequence.serve.sessions import Session

BUNDLED = "consequence/assets/tiny-repair"


@pytest.fixture(scope="module")
def renderer():
    return Renderer(AutoTokenizer.from_pretrained(BUNDLED), [])


def _session() -> Session:
    return Session("s", Trajectory(task_id="s", group_id="s", sample_id=0, seed=0, policy_version=0))


def U(text):
    return {"role": "user", "content": text}


def A(text):
    return {"role": "assistant", "content": text}


_LP = [-0.25, -0.5, -0.75, -1.0]  # distinct sampler log-probs, so a target moved or lost shows up


def _sample(renderer, text: str, eot: bool = True) -> Sample:
    ids = renderer.encode(text) + ([renderer.eot_id] if eot else [])
    return Sample(ids, [_LP[k % len(_LP)] for k in range(len(ids))], "stop" if eot else "length")


def _call(session, renderer, messages, *replies, sent=None):
    """One request: its context by the prefix rule, then each reply (``n`` = number of replies)
    recorded as a sampled choice. ``sent`` overrides the recorded message (a reply cut by a stop
    string is recorded with its cut content)."""
    ctx = session.context_for(messages, renderer)
    for text in replies:
        s = _sample(renderer, text)
        parsed = renderer.parse(s.output_ids, s.stop_reason, answers=True)
        if sent is not None:
            parsed.message = A(sent)
        session.record(messages, ctx, s, parsed)


def _targets(row):
    return [i for i, m in zip(row.input_ids, row.loss_mask) if m], [
        lp for lp, m in zip(row.old_logprobs, row.loss_mask) if m
    ]


# ---- each history: its rows, its breaks (with reasons), its targets -----------------------------
def _clean(s, r):
    _call(s, r, [U("fix add")], "I read the code.")
    _call(s, r, [U("fix add"), A("I read the code."), U("and now?")], "Now I test it.")
    _call(s, r, [U("fix add"), A("I read the code."), U("and now?"), A("Now I test it."), U("ok")], "Done.")


def _abandoned_then_continued(s, r):
    # calls[1] was sampled and recorded, but its client timed out: the next request is
    # calls[0]'s conversation plus a new user turn, without calls[1]'s reply.
    _call(s, r, [U("fix add")], "I read the code.")
    _call(s, r, [U("fix add"), A("I read the code."), U("tool said x")], "A reply nobody saw.")
    _call(s, r, [U("fix add"), A("I read the code."), U("tool said x"), U("you timed out")], "Sorry.")


def _retry(s, r):
    _call(s, r, [U("fix add")], "I read the code.")
    _call(s, r, [U("fix add"), A("I read the code."), U("tool said x")], "A reply nobody saw.")
    _call(s, r, [U("fix add"), A("I read the code."), U("tool said x")], "Second try.")
    _call(s, r, [U("fix add"), A("I read the code."), U("tool said x"), A("Second try."), U("ok")], "Done.")


def _n_choices(s, r):
    _call(s, r, [U("fix add")], "First choice.", "Second choice.")
    _call(s, r, [U("fix add"), A("Second choice."), U("go on")], "Going on.")


def _edited(s, r):
    _call(s, r, [U("fix add")], "I read the code.")
    _call(s, r, [U("fix add"), A("I will read the code."), U("and now?")], "Now I test it.")


UNUSED = "the client did not use the reply of calls[{}] (timed out or abandoned)"
CASES = {
    # name: (history, [(call, reason)], calls whose outputs are the targets of each row)
    "clean": (_clean, [], [[0, 1, 2]]),
    "abandoned_then_continued": (
        _abandoned_then_continued,
        [(2, "calls[2] continues calls[0], not the last call: " + UNUSED.format(1))],
        [[0, 1], [2]],
    ),
    "retry": (
        _retry,
        [(2, "calls[2] repeats the messages of calls[1] (a retry): " + UNUSED.format(1))],
        [[0, 1], [2, 3]],
    ),
    "n_choices": (
        _n_choices,
        [(1, "calls[1] is choice 1 of the request of calls[0] (n > 1): each further choice starts its own row")],
        [[0], [1, 2]],
    ),
    "edited": (
        _edited,
        [
            (
                1,
                "calls[1]: the messages continue no earlier reply of the session (an earlier turn was "
                "edited, dropped or reordered, or a reply's content or tool calls changed)",
            )
        ],
        [[0], [1]],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_rows_are_one_plus_the_counted_breaks_each_with_its_reason(renderer, name):
    history, breaks, row_calls = CASES[name]
    s = _session()
    history(s, renderer)
    calls = s.trajectory.calls
    rows = trajectory_to_rows(s.trajectory)
    assert len(rows) == 1 + s.prefix_breaks
    assert [(b["call"], b["reason"]) for b in s.record_dict()["breaks"]] == breaks
    # Each row's targets are exactly its calls' sampled ids with the sampler's log-probs (ratio = 1).
    assert [_targets(r) for r in rows] == [
        ([i for k in ks for i in calls[k].output_ids], [lp for k in ks for lp in calls[k].sample_logprobs])
        for ks in row_calls
    ]
    # The last call of a row that a break ends got no observation: nothing was glued onto it.
    for b in breaks:
        assert calls[b[0] - 1].observation_ids == []


def test_an_abandoned_reply_keeps_its_context_and_the_continued_call_its_observation(renderer):
    s = _session()
    _abandoned_then_continued(s, renderer)
    c0, c1, c2 = s.trajectory.calls
    assert c1.context_ids == c0.context_ids + c0.output_ids + c0.observation_ids  # sampled after the tool result
    assert c1.observation_ids == []  # never received: no later turn after it
    # The next call continues calls[0] with both user turns; calls[1]'s ids are nowhere in it.
    obs = renderer.observation_ids([U("fix add")], A("I read the code."), [U("tool said x"), U("you timed out")])
    assert c2.context_ids == c0.context_ids + c0.output_ids + obs
    rows = trajectory_to_rows(s.trajectory)
    assert rows[0].input_ids == c1.context_ids + c1.output_ids and rows[1].input_ids == c2.context_ids + c2.output_ids


def test_a_call_that_was_never_recorded_leaves_no_observation_behind(renderer):
    """A request refused or dropped after its context was built (a budget, a client that left
    before sampling): the next request continues the same reply with other messages."""
    s = _session()
    _call(s, renderer, [U("fix add")], "I read the code.")
    s.context_for([U("fix add"), A("I read the code."), U("tool said x")], renderer)  # never sampled
    _call(s, renderer, [U("fix add"), A("I read the code."), U("tool said y")], "Fine.")
    c0, c1 = s.trajectory.calls
    assert c0.observation_ids == renderer.observation_ids([U("fix add")], A("I read the code."), [U("tool said y")])
    assert len(trajectory_to_rows(s.trajectory)) == 1 and s.prefix_breaks == 0


def test_a_history_that_renders_to_exactly_the_sampled_ids_continues_the_row(renderer):
    """A client that sends back a reply cut by a stop string with the stop text kept: the
    messages do not match the recorded (cut) reply, but the template renders them to the
    sampled ids, so the row goes on, exact, with no break."""
    s = _session()
    _call(s, renderer, [U("fix add")], "I read the code.", sent="I read")  # recorded cut at the stop " the"
    _call(s, renderer, [U("fix add"), A("I read the code."), U("and now?")], "Now I test it.")
    c0, c1 = s.trajectory.calls
    assert c1.context_ids[: len(c0.context_ids) + len(c0.output_ids)] == c0.context_ids + c0.output_ids
    assert c0.observation_ids == c1.context_ids[len(c0.context_ids) + len(c0.output_ids) :]
    assert s.prefix_breaks == 0 and len(trajectory_to_rows(s.trajectory)) == 1


# ---- the check catches what breaks the invariant (negative controls) ---------------------------
class _Forgetful(list):
    """A broken recorder's break list: it loses every break."""

    def append(self, item):
        pass


@pytest.mark.parametrize("history", [_abandoned_then_continued, _retry, _n_choices, _edited])
def test_a_recorder_that_does_not_count_a_break_is_caught(renderer, history):
    from consequence.serve.sessions import RecorderError

    s = _session()
    s.breaks = _Forgetful()
    with pytest.raises(
        RecorderError,
        match=r"calls make 2 training rows \(new rows at calls \[0, \d\]\) but 0 "
        r"prefix breaks are counted \(at calls \[\]\)",
    ):
        history(s, renderer)


def _call_record(ctx, out):
    return ModelCall(context_ids=ctx, output_ids=out, sample_logprobs=[-1.0] * len(out), stop_reason="stop")


def test_check_rows_on_hand_made_records():
    from consequence.serve.sessions import RecorderError, check_rows

    t = Trajectory(task_id="t", group_id="t", sample_id=0, seed=0, policy_version=0)
    check_rows(t, [])  # no calls: no rows, no breaks
    t.calls = [_call_record([1, 2], [3]), _call_record([1, 2, 3, 4], [5])]  # 2 extends 1 (4 is context)
    check_rows(t, [])
    with pytest.raises(RecorderError, match=r"make 1 training rows .* but 1 prefix breaks"):
        check_rows(t, [{"call": 1, "reason": "counted, but the row goes on"}])
    t.calls[0].observation_ids = [9]  # the old recorder's fault: an observation no later call saw
    with pytest.raises(
        RecorderError,
        match=r"session 'x': its 2 calls make 2 training rows \(new rows at calls "
        r"\[0, 1\]\) but 0 prefix breaks",
    ):
        check_rows(t, [], "x")
    check_rows(t, [{"call": 1, "reason": "a break"}])
    with pytest.raises(RecorderError, match=r"at calls \[0\]"):  # the right number of breaks at the wrong call
        check_rows(t, [{"call": 0, "reason": "a break"}])

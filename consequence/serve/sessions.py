"""The recorder: one trajectory per session, with the prefix rule (docs/agents.md §3).

Every call of a session is kept as a :class:`~consequence.records.ModelCall`: the exact
context ids the renderer built, the sampled ids and the sampler's log-probs. The context
of a call is built the way the in-process harness builds it (``rollout.episodes``):

* the first call of a session: the renderer's prompt ids of the messages;
* a later call whose messages are an earlier call's messages, then the assistant message
  that call returned (compared after normalisation: ``serve.protocol``), then only tool /
  user messages: that call's context + its sampled ids verbatim + the observation ids the
  chat template adds for the new messages (``Renderer.observation_ids``). The sampled
  ids are never re-tokenised;
* the same messages as an earlier call (a retry): that call's context ids;
* a reply that was cut (``max_tokens``, a stop string) has no end-of-turn token among its
  sampled ids: the observation ids then start with it, so the turn is closed as the
  template closes it, and it is context, not a target;
* anything else (the agent edited, dropped or reordered an earlier turn, changed a reply's
  content or calls, or the template re-renders history differently): the renderer's
  prompt ids of the messages as sent. (Re-serialised tool-call arguments are not a
  change: they are compared as parsed JSON.)

**Rows and breaks.** ``records.trajectory_to_rows`` appends a call to the previous call's
row when its context extends that row, else starts a new row. A call continues the row
only when it continues the session's *last recorded* call; the observation ids are then
set on that call, when the continuing call is recorded (never before: a call that is
refused or never sampled leaves no trace), or when the template renders its messages to
that call's context and sampled ids exactly. Every other call after the first starts a
new row and is a **prefix break**, counted with its reason in :attr:`Session.breaks`:

* a retry (the client did not use the last reply: it timed out or gave up on it; the
  server still finished sampling that reply and recorded it, with no observation);
* a call that continues an earlier call than the last (the last reply was not used);
* a further choice of an ``n`` > 1 request (each starts its own row);
* an edited history, or a template that re-renders the earlier turns.

**Completions.** A ``/v1/completions`` call gives its context as ids (or text, tokenised
as given): it continues the row when its ids start with the last call's context and
sampled ids (the rest are that call's observation ids); any other prompt starts a new
row, a counted break (a retry when it repeats an earlier call's ids).

So for every session ``rows == 1 + breaks`` (0 rows for 0 calls): :meth:`Session.record`
checks it after every call against ``trajectory_to_rows`` and raises
:class:`RecorderError` when it fails. Each row's targets are exactly sampled ids with
the sampler's log-probs (ratio = 1); a reply the client never received stays a target of
its row (it was sampled from μ like any other) and nothing is appended after it.

**Lifetime.** :class:`SessionStore` makes a session on its first call and forgets it again
when that call ends without a recorded reply (refused, or its client left before
sampling), so an empty session is never left behind; a session without an episode that
has not been used for ``--session-ttl`` seconds is forgotten (:meth:`SessionStore.expire`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from consequence.harness.renderer import ParsedTurn, Renderer
from consequence.records import ModelCall, Trajectory, trajectory_to_rows


class RecorderError(RuntimeError):
    """The session's record breaks its invariant ``rows == 1 + prefix breaks`` (a bug of the recorder)."""


@dataclass
class _Sampled:
    """A sampled choice a later call may continue from."""

    history: list[dict[str, Any]]  # the normalised messages of the call
    message: dict[str, Any]  # the assistant message returned (harness shape)
    call: ModelCall
    index: int  # its position in ``trajectory.calls``


@dataclass
class CallContext:
    """The context of one request of a session (:meth:`Session.context_for`), to record its choices with.

    Attributes:
        ids: the context token ids (int), the model's input.
        continues: the candidate whose reply the messages continue (``None``: none).
        observation_ids: the ids the template adds after that reply (when ``continues``).
        retry_of: index in ``trajectory.calls`` of the call whose messages these repeat.
        reason: why the messages continue no earlier reply (for the break), else ``None``.
        recorded: choices of this request recorded so far (the second is an ``n`` > 1 sibling).
    """

    ids: list[int]
    continues: _Sampled | None = None
    observation_ids: list[int] = field(default_factory=list)
    retry_of: int | None = None
    reason: str | None = None
    recorded: int = 0


@dataclass
class Session:
    """One session: the calls of one episode, recorded as one trajectory.

    Attributes:
        id: the session id (from the URL ``/s/{id}/v1/...`` or the ``X-Session-Id`` header).
        trajectory: the recorded calls (``trajectory.calls``) and the readable messages.
        breaks: one ``{"call": index in trajectory.calls, "reason": text}`` per call that
            started a new training row (module doc); ``prefix_breaks`` is their number.
        episode: the environment episode bound to the session by the agent-runner
            (``serve.episode.BoundEpisode``), else ``None``.
        candidates: every sampled choice of the session, oldest first (a later call may
            continue any of them).
        lock: held while a call of the session is built, sampled and recorded, so two
            concurrent calls of one session are recorded in order.
        active: calls of the session in progress (:meth:`SessionStore.enter`).
        last_used: ``time.monotonic()`` when its last call ended (or it was made).
        responses: the conversation of each ``/v1/responses`` response the session returned,
            by response id, for ``previous_response_id`` (``serve.responses.keep``: bounded;
            forgotten with the session).
    """

    id: str
    trajectory: Trajectory
    breaks: list[dict[str, Any]] = field(default_factory=list)
    episode: Any = None
    candidates: list[_Sampled] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    active: int = 0
    last_used: float = field(default_factory=time.monotonic)
    responses: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    @property
    def prefix_breaks(self) -> int:
        """Calls that started a new training row after the first (``agent_prefix_breaks``)."""
        return len(self.breaks)

    def context_for(self, messages: list[dict[str, Any]], renderer: Renderer) -> CallContext:
        """The context of a call with ``messages`` (the prefix rule of the module doc).

        Changes nothing: the continued call's observation ids and a break are recorded by
        :meth:`record`, once the call is sampled.
        """
        for s in reversed(self.candidates):
            if messages == s.history:  # the same call again (a retry): the same context ids
                return CallContext(list(s.call.context_ids), retry_of=s.index)
            n = len(s.history)
            new = messages[n + 1 :]
            if (
                len(messages) > n + 1
                and messages[:n] == s.history
                and _same_reply(messages[n], s.message)
                and all(m["role"] in ("tool", "user") for m in new)
            ):
                try:
                    obs = renderer.observation_ids(s.history, s.message, new)
                except ValueError:  # the template re-renders earlier turns: the context cannot extend
                    return CallContext(
                        renderer.prompt_ids(messages),
                        reason=(
                            "the chat template renders the earlier turns differently once the new messages are added"
                        ),
                    )
                if not s.call.output_ids or s.call.output_ids[-1] not in renderer.stop_ids:
                    obs = [renderer.eot_id] + obs  # a reply cut by max_tokens or a stop string: close the turn
                return CallContext(s.call.context_ids + s.call.output_ids + obs, s, list(obs))
        return CallContext(
            renderer.prompt_ids(messages),
            reason=(
                "the messages continue no earlier reply of the session (an earlier turn was edited, dropped or "
                "reordered, or a reply's content or tool calls changed)"
            ),
        )

    def context_for_ids(self, ids: list[int]) -> CallContext:
        """The context of a ``/v1/completions`` call whose prompt is ``ids`` (module doc):
        the ids as given; :meth:`record` continues the last call's row when they extend it."""
        for k in reversed(range(len(self.trajectory.calls))):
            if self.trajectory.calls[k].context_ids == ids:
                return CallContext(list(ids), retry_of=k)
        return CallContext(list(ids), reason="the prompt ids do not start with the last call's context and sampled ids")

    def record(
        self, messages: list[dict[str, Any]] | None, context: CallContext, sample: Any, parsed: ParsedTurn
    ) -> ModelCall:
        """Keep one sampled choice as a call of the trajectory (and as a candidate to continue).

        Sets the observation ids of the call it continues when that is the last recorded
        call; otherwise, after the first call, counts a prefix break with its reason.

        Args:
            messages: the normalised messages of the call; ``None`` for a completions call
                (its reply is then no candidate for a chat call to continue).
            context: its context (:meth:`context_for`); each choice of the request is
                recorded with the same one.
            sample: the sampler's ``Sample`` (output ids, log-probs, stop reason, supports).
            parsed: ``Renderer.parse`` of the sample.

        Raises:
            RecorderError: the record no longer has ``1 + prefix_breaks`` training rows.
        """
        calls = self.trajectory.calls
        index, last = len(calls), len(calls) - 1
        reason = None
        if context.recorded:
            first = index - context.recorded
            reason = (
                f"calls[{index}] is choice {context.recorded} of the request of calls[{first}] (n > 1): each "
                "further choice starts its own row"
            )
        elif not calls:
            pass  # the first call starts the first row
        elif context.continues is not None and context.continues.index == last:
            calls[last].observation_ids = list(context.observation_ids)  # the reply was used: the row goes on
        elif context.continues is not None:
            reason = (
                f"calls[{index}] continues calls[{context.continues.index}], not the last call: the client did "
                f"not use the reply of calls[{last}] (timed out or abandoned)"
            )
        elif context.retry_of is not None:
            reason = (
                f"calls[{index}] repeats the messages of calls[{context.retry_of}] (a retry): the client did not "
                f"use the reply of calls[{context.retry_of}] (timed out or abandoned)"
            )
        else:
            reason = f"calls[{index}]: {context.reason}"
        if reason is not None and not context.recorded and calls:
            done = calls[last].context_ids + calls[last].output_ids
            if context.ids[: len(done)] == done:  # re-rendered to exactly the sampled ids: the row goes on
                calls[last].observation_ids, reason = context.ids[len(done) :], None
        context.recorded += 1
        keep = getattr(sample, "keep_ids", None)
        call = ModelCall(
            context_ids=list(context.ids),
            output_ids=list(sample.output_ids),
            sample_logprobs=list(sample.logprobs),
            stop_reason=sample.stop_reason,
            tool_calls=parsed.tool_calls,
            parse_error=parsed.parse_error,
            keep_ids=None if keep is None else [list(k) for k in keep],
            constrained=getattr(sample, "constrained", False),
        )
        calls.append(call)
        if reason is not None:
            self.breaks.append({"call": index, "reason": reason})
        if messages is not None:
            self.candidates.append(_Sampled(list(messages), parsed.message, call, index))
            self.trajectory.messages = list(messages) + [parsed.message]
        self.check_rows()
        return call

    def check_rows(self) -> None:
        """The invariant of the record: ``trajectory_to_rows`` makes ``1 + prefix_breaks``
        rows (none for a session without calls), so every row after the first is a counted
        break with its reason. Costs one pass over the session's ids.

        Raises:
            RecorderError: naming the counts, the calls that start rows and the breaks.
        """
        check_rows(self.trajectory, self.breaks, self.id)

    def record_dict(self) -> dict[str, Any]:
        """The trajectory as plain data plus ``prefix_breaks`` and ``breaks`` (``GET /s/{id}/record``)."""
        return self.trajectory.to_dict() | {
            "prefix_breaks": self.prefix_breaks,
            "breaks": [dict(b) for b in self.breaks],
        }


def check_rows(trajectory: Trajectory, breaks: list[dict[str, Any]], name: str = "") -> None:
    """Check that ``trajectory``'s calls make ``1 + len(breaks)`` training rows
    (``records.trajectory_to_rows``; 0 rows and no breaks for no calls), and that the
    breaks name exactly the calls that start a row after the first.

    Args:
        trajectory: a session's record.
        breaks: its ``{"call": int, "reason": str}`` entries (:attr:`Session.breaks`).
        name: the session id, for the message.

    Raises:
        RecorderError: the counts or the calls differ.
    """
    calls = trajectory.calls
    starts: list[int] = []  # the calls that start a row, by the rule of trajectory_to_rows (for the message)
    row: list[int] = []
    for k, c in enumerate(calls):
        if not (k and len(c.context_ids) >= len(row) and c.context_ids[: len(row)] == row):
            starts.append(k)
        row = c.context_ids + c.output_ids + c.observation_ids  # the row's ids after call k, either way
    rows = len(trajectory_to_rows(trajectory)) if calls else 0
    counted = [b["call"] for b in breaks]
    if rows != (1 + len(breaks) if calls else len(breaks)) or counted != starts[1:]:
        raise RecorderError(
            f"session {name!r}: its {len(calls)} calls make {rows} training rows (new rows at calls {starts}) but "
            f"{len(breaks)} prefix breaks are counted (at calls {counted}); every row after the first must be a "
            "counted break (consequence.serve.sessions; a bug of the recorder, please report it)"
        )


def _same_reply(sent: dict[str, Any], returned: dict[str, Any]) -> bool:
    """The assistant message the agent sent back is the one returned (content and calls;
    ``None`` and ``""`` content are the same, key order does not matter)."""
    if sent.get("role") != "assistant":
        return False
    calls = lambda m: [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []]  # noqa: E731
    return (sent.get("content") or "") == (returned.get("content") or "") and calls(sent) == calls(returned)


class SessionStore:
    """The open sessions by id (thread-safe)."""

    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}
        self._lock = threading.RLock()  # enter() takes it, then get() again

    def get(self, sid: str, create: bool = True) -> Session | None:
        """The session ``sid``; a new empty one when it does not exist and ``create``."""
        with self._lock:
            s = self._sessions.get(sid)
            if s is None and create:
                s = self._sessions[sid] = Session(
                    sid, Trajectory(task_id=sid, group_id=sid, sample_id=0, seed=0, policy_version=0)
                )
            return s

    def enter(self, sid: str) -> Session:
        """The session ``sid`` (made when new) with one more call in progress; pair with :meth:`leave`."""
        with self._lock:
            s = self.get(sid)
            assert s is not None  # get(create=True) always returns one
            s.active += 1
            return s

    def leave(self, session: Session) -> None:
        """A call of ``session`` ended: it is forgotten when no call is left in progress and
        none was ever recorded (and no episode is bound), so a refused first call leaves nothing."""
        with self._lock:
            session.active -= 1
            session.last_used = time.monotonic()
            empty = not session.active and not session.trajectory.calls and session.episode is None
            if empty and self._sessions.get(session.id) is session:
                del self._sessions[session.id]

    def expire(self, ttl_s: float) -> list[str]:
        """Forget the sessions without an episode, no call in progress and none ended in the
        last ``ttl_s`` seconds; their ids (their K/V is to be dropped too)."""
        cutoff = time.monotonic() - ttl_s
        with self._lock:
            old = [
                sid for sid, s in self._sessions.items() if s.episode is None and not s.active and s.last_used < cutoff
            ]
            for sid in old:
                del self._sessions[sid]
        return old

    def add(self, session: Session) -> None:
        """Register a session made by the caller (the agent-runner binds an episode to it)."""
        with self._lock:
            self._sessions[session.id] = session

    def pop(self, sid: str) -> Session | None:
        """Remove and return the session ``sid`` (``None`` when there is none)."""
        with self._lock:
            return self._sessions.pop(sid, None)

    def ids(self) -> list[str]:
        """The ids of the open sessions."""
        with self._lock:
            return list(self._sessions)

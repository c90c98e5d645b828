"""The recorder: one trajectory per session, with the prefix rule (docs/agents.md).

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
  content or calls, or the template re-renders history differently): a **prefix
  break**. (Re-serialised tool-call arguments are not a change: they are compared as
  parsed JSON.) The context is the
  renderer's prompt ids of the messages as sent, so the call starts a new training row
  (``records.trajectory_to_rows``) in which the earlier turns are context, never targets;
  ``Session.prefix_breaks`` counts it.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

from consequence.harness.renderer import ParsedTurn, Renderer
from consequence.records import ModelCall, Trajectory


@dataclass
class _Sampled:
    """A sampled choice a later call may continue from."""

    history: list[dict[str, Any]]  # the normalised messages of the call
    message: dict[str, Any]  # the assistant message returned (harness shape)
    call: ModelCall


@dataclass
class Session:
    """One session: the calls of one episode, recorded as one trajectory.

    Attributes:
        id: the session id (from the URL ``/s/{id}/v1/...`` or the ``X-Session-Id`` header).
        trajectory: the recorded calls (``trajectory.calls``) and the readable messages.
        prefix_breaks: calls whose history did not continue an earlier sampled reply.
        episode: the environment episode bound to the session by the agent-runner
            (``serve.episode.BoundEpisode``), else ``None``.
        candidates: every sampled choice of the session, oldest first (a later call may
            continue any of them).
        lock: held while a call of the session is built, sampled and recorded, so two
            concurrent calls of one session are recorded in order.
    """

    id: str
    trajectory: Trajectory
    prefix_breaks: int = 0
    episode: Any = None
    candidates: list[_Sampled] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def context_for(self, messages: list[dict[str, Any]], renderer: Renderer) -> list[int]:
        """The context ids of a call with ``messages`` (the prefix rule of the module doc).

        Sets the continued call's ``observation_ids`` (when not set yet) and counts a
        prefix break when the messages continue no earlier reply of this session.
        """
        for s in reversed(self.candidates):
            if messages == s.history:  # the same call again (a retry): the same context ids
                return list(s.call.context_ids)
            n = len(s.history)
            new = messages[n + 1:]
            if (len(messages) > n + 1 and messages[:n] == s.history and _same_reply(messages[n], s.message)
                    and all(m["role"] in ("tool", "user") for m in new)):
                try:
                    obs = renderer.observation_ids(s.history, s.message, new)
                except ValueError:  # the template re-renders earlier turns: the context cannot extend
                    break
                if not s.call.output_ids or s.call.output_ids[-1] not in renderer.stop_ids:
                    obs = [renderer.eot_id] + obs  # a reply cut by max_tokens or a stop string: close the turn
                if not s.call.observation_ids:
                    s.call.observation_ids = list(obs)
                return s.call.context_ids + s.call.output_ids + obs
        if self.trajectory.calls:
            self.prefix_breaks += 1
        return renderer.prompt_ids(messages)

    def record(self, messages: list[dict[str, Any]], context: list[int], sample: Any,
               parsed: ParsedTurn) -> ModelCall:
        """Keep one sampled choice as a call of the trajectory (and as a candidate to continue).

        Args:
            messages: the normalised messages of the call.
            context: its context ids (:meth:`context_for`).
            sample: the sampler's ``Sample`` (output ids, log-probs, stop reason, supports).
            parsed: ``Renderer.parse`` of the sample.
        """
        keep = getattr(sample, "keep_ids", None)
        call = ModelCall(context_ids=list(context), output_ids=list(sample.output_ids),
                         sample_logprobs=list(sample.logprobs), stop_reason=sample.stop_reason,
                         tool_calls=parsed.tool_calls, parse_error=parsed.parse_error,
                         keep_ids=None if keep is None else [list(k) for k in keep])
        self.trajectory.calls.append(call)
        self.candidates.append(_Sampled(list(messages), parsed.message, call))
        self.trajectory.messages = list(messages) + [parsed.message]
        return call

    def record_dict(self) -> dict[str, Any]:
        """The trajectory as plain data plus ``prefix_breaks`` (``GET /s/{id}/record``)."""
        return self.trajectory.to_dict() | {"prefix_breaks": self.prefix_breaks}


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
        self._lock = threading.Lock()

    def get(self, sid: str, create: bool = True) -> Session | None:
        """The session ``sid``; a new empty one when it does not exist and ``create``."""
        with self._lock:
            s = self._sessions.get(sid)
            if s is None and create:
                s = self._sessions[sid] = Session(sid, Trajectory(task_id=sid, group_id=sid, sample_id=0, seed=0,
                                                                  policy_version=0))
            return s

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

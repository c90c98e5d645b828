"""An environment episode bound to a session: its tools, budgets and end (agent-runner).

The agent-runner binds one :class:`BoundEpisode` to each session. It applies the rules
of the in-process harness (``rollout.episodes``) to calls that arrive over HTTP, so the
two paths record the same trajectory for the same samples:

* budgets (``Budgets``): a call after ``max_turns`` calls, one whose context plus
  ``max_new_tokens`` exceeds ``max_total_tokens``, one after ``max_tool_calls`` tool
  calls, and any call after a reply cut at ``max_new_tokens`` end the episode as
  ``truncated`` with that reason, and the call is refused (HTTP 400, code
  ``episode_over``);
* sampling: the run's settings (temperature, top-p, top-k, ``max_new_tokens``); a request
  may leave them out or repeat them, another value is refused (the trainer scores the
  samples under the run's settings: ratio = 1 needs the same distribution);
* tools: :meth:`BoundEpisode.call_tool` validates a call against the environment's specs
  (an invalid one returns ``error: ...``, as the harness's observation) and steps the
  environment, keeping the reward on the session's last call;
* the end: :meth:`BoundEpisode.finish` gives the agent's result to the environment as
  ``{"answer": result}`` when the environment takes answers and the episode is still
  open, then sets the outcome.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any

from consequence.envs.api import ANSWER_KEY
from consequence.harness.tools import call_problem
from consequence.policy.sampler import SamplingParams
from consequence.records import Trajectory
from consequence.rollout.episodes import Budgets, raised, take_reward
from consequence.serve.protocol import SamplingRequest, ServeError, bad


@dataclass
class BoundEpisode:
    """One environment episode driven by an agent through a session (module doc).

    Args:
        env: the episode (``reset`` already called by the runner).
        trajectory: the session's trajectory (the runner made it with the episode's ids).
        budgets: the run's budgets.
        sampling: the run's sampling settings (``max_new_tokens`` = ``budgets.max_new_tokens``).
        tool_specs: ``harness.tools.check_tool_specs`` of the environment's tools.
        answers: the environment takes a reply without a tool call as its answer.
    """

    env: Any
    trajectory: Trajectory
    budgets: Budgets
    sampling: SamplingParams
    tool_specs: dict[str, dict]
    answers: bool
    ended: bool = False
    t0: float = field(default_factory=time.perf_counter)

    # ---- before a call -------------------------------------------------------------
    def params_for(self, req: SamplingRequest) -> SamplingParams:
        """The run's sampling settings, after checking the request does not ask for others.

        Raises:
            ServeError: 400 for ``n`` > 1, a temperature, top-p or top-k other than the
                run's, or ``max_tokens`` above the run's ``max_new_tokens``.
        """
        s = self.sampling
        if req.n != 1:
            raise bad(
                "n must be 1 in a training episode (one session is one trajectory); run more sessions "
                "for more samples (--group-size)",
                "n",
                "invalid_value",
            )
        for key, mine in (("temperature", s.temperature), ("top_p", s.top_p), ("top_k", s.top_k)):
            theirs = getattr(req, key)
            if theirs is not None and abs(theirs - mine) > 1e-9:
                raise bad(
                    f"{key} {theirs} differs from the training run's {mine}: the trainer scores samples under "
                    f"the run's settings; leave {key} out or set --{key.replace('_', '-')} {theirs}",
                    key,
                    "invalid_value",
                )
        if req.max_tokens is not None and req.max_tokens > self.budgets.max_new_tokens:
            raise bad(
                f"max_tokens {req.max_tokens} exceeds the episode's budget of {self.budgets.max_new_tokens} "
                "tokens per call (--max-new-tokens); leave it out or lower it",
                "max_tokens",
                "invalid_value",
            )
        return dataclasses.replace(s, max_new_tokens=req.max_tokens or self.budgets.max_new_tokens)  # dtype kept

    def before_context(self) -> None:
        """Refuse a call of an episode that is over, or whose tool calls spent their budget.

        Raises:
            ServeError: 400, code ``episode_over``.
        """
        t = self.trajectory
        if not self.ended and t.calls and t.n_tool_calls >= self.budgets.max_tool_calls:
            self.end("truncated", "max_tool_calls")
        self._refuse_if_over()

    def before_sample(self, context: list[int]) -> None:
        """Refuse a call beyond ``max_turns`` or one that would overrun ``max_total_tokens``.

        Raises:
            ServeError: 400, code ``episode_over``.
        """
        if len(self.trajectory.calls) >= self.budgets.max_turns:
            self.end("truncated", "max_turns")
        elif len(context) + self.budgets.max_new_tokens > self.budgets.max_total_tokens:
            self.end("truncated", "total_tokens")
        self._refuse_if_over()

    def after_call(self, stop_reason: str) -> None:
        """A reply cut at the token limit ends the episode (as in the harness: case 05)."""
        if stop_reason == "length":
            self.end("truncated", "max_new_tokens")

    def _refuse_if_over(self) -> None:
        if self.ended:
            t = self.trajectory
            why = t.truncation_reason or t.error or "the environment ended it"
            raise ServeError(
                400, f"this episode is over ({t.outcome}: {why}); the agent should return", None, "episode_over"
            )

    # ---- tools and the end ---------------------------------------------------------
    def call_tool(self, name: str, arguments: Any) -> str:
        """Validate and run one tool call in the environment; the observation text.

        An invalid call (unknown tool, bad arguments, arguments not JSON) returns
        ``error: ...`` without stepping the environment, as the harness's observation. A
        call after the episode ended returns an ``error:`` text too.
        """
        if self.ended:
            return f"error: the episode is over ({self.trajectory.outcome})"
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                return self._observe(name, f"error: arguments of {name} are not valid JSON ({e.msg})")
        t = self.trajectory
        t.n_tool_calls += 1
        t.tool_histogram[name] = t.tool_histogram.get(name, 0) + 1
        problem = call_problem({"name": name, "arguments": arguments}, self.tool_specs)
        if problem:
            self._refused(problem[0])
            return self._observe(name, f"error: {problem[1]}")
        return self._observe(name, self._step({"name": name, "arguments": arguments}))

    def _refused(self, kind: str) -> None:
        """Record a refused call's kind on the model call it follows (``ModelCall.invalid_calls``)."""
        if self.trajectory.calls:
            self.trajectory.calls[-1].invalid_calls.append(kind)

    def _observe(self, name: str, text: str) -> str:
        self.trajectory.messages = self.trajectory.messages + [{"role": "tool", "name": name, "content": text}]
        return text

    def _step(self, action: dict) -> str:
        """``env.step(action)``: reward kept on the last call; the episode ends when the
        environment says so or fails (``env_error``)."""
        t = self.trajectory
        if not t.calls:
            self.end("env_error", error="a tool was called before any model call of the session")
            return ""
        try:
            obs, reward, terminated, truncated, info = self.env.step(action)
            if not isinstance(obs, str) or not isinstance(info, dict):
                raise TypeError(
                    "step() must return (observation: str, reward, terminated, truncated, info: dict); "
                    f"got observation {type(obs).__name__}, info {type(info).__name__}"
                )
            error = take_reward(t, t.calls[-1], reward, info)
        except Exception as err:  # an environment that raises is an env_error, never a 0
            obs, terminated, truncated, info, error = "", False, False, {}, raised("step", err)
        t.env_retries += int(info.get("env_retries", 0))
        if error or info.get("env_error"):
            self.end("env_error", error=error or str(info["env_error"]))
        elif terminated:
            t.verifier_score = sum(c.reward for c in t.calls)
            self.end("finished")
        elif truncated:
            self.end("truncated", "environment")
        return obs

    def finish(self, result: Any, agent_error: str | None = None) -> Trajectory:
        """End the episode after the agent returned ``result`` (or raised: ``agent_error``).

        Still open: an agent that raised makes an ``env_error`` (excluded, counted: the
        failure is not the policy's); an answer-taking environment gets ``{"answer":
        str(result)}``; an episode still open after that is ``truncated``, reason
        ``agent_returned``.
        """
        if not self.ended and agent_error is not None:
            self.end("env_error", error=agent_error)
        if not self.ended and self.answers and self.trajectory.calls and result is not None:
            self._step({ANSWER_KEY: str(result)})
        if not self.ended:
            self.end("truncated", "agent_returned")
        return self.trajectory

    def end(self, outcome: str, reason: str | None = None, error: str | None = None) -> None:
        """Set the episode's outcome once (later calls keep the first)."""
        if self.ended:
            return
        t = self.trajectory
        self.ended = True
        t.outcome = outcome  # type: ignore[assignment]
        t.truncation_reason = reason if outcome == "truncated" else None
        t.error = error
        t.wall_time_s = time.perf_counter() - self.t0
        t.final_code = getattr(self.env, "code", None)

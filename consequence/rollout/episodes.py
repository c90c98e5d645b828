"""Rollout box: run batched multi-turn episodes and record them token-in / token-out.

All active episodes advance one model call at a time in one batched ``generate``; the
harness parses each output, validates and executes the tool calls in the episode's own
environment, and appends the observation ids the chat template adds. Nothing is
re-tokenised: a call's ``context_ids`` are the previous context + sampled ids +
observation ids (docs/design.md §2).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from consequence.envs.api import ANSWER_KEY
from consequence.harness.context import ContextBuilder
from consequence.harness.renderer import Renderer
from consequence.harness.tools import call_problem, check_tool_specs
from consequence.records import ModelCall, Trajectory
from consequence.rollout.attempts import Attempts, attempt_step, final_verifier_score

# generate_fn(prompts, max_new_tokens, episode_indices) -> one sample per prompt with
# .output_ids, .logprobs, .stop_reason and optionally .keep_ids (the support of each sampled
# token under top-k / top-p, stored in the ModelCall for the trainer). episode_indices say
# which spec each prompt belongs to (a policy ignores them; a scripted teacher needs them).
_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tools")

GenerateFn = Callable[[list[list[int]], int, list[int]], list[Any]]


@dataclass(frozen=True)
class Budgets:
    """Per-episode budgets; hitting one ends the episode as ``truncated``."""

    max_turns: int = 8
    max_new_tokens: int = 48
    max_total_tokens: int = 768
    max_tool_calls: int = 10


@dataclass
class EpisodeSpec:
    """One episode to run: its environment (Gymnasium-style) and its identity.

    ``opening`` is a scripted start: tool calls ``(name, arguments)`` applied to the
    environment after ``reset`` and shown to the policy as its own earlier turns (e.g. the
    same wrong first patch for every policy in the recovery diagnostic). They are context,
    never targets, and do not count against the policy's tool-call budget.
    """

    env: Any
    task_id: str
    group_id: str
    sample_id: int
    seed: int
    opening: tuple[tuple[str, dict], ...] = ()
    answer_ends_episode: bool = True  # the environment's setting; an episode's own attribute wins
    # --shaping potential: Φ of the episode's state (Environment.potential), recorded after the
    # start and after every turn in Trajectory.potentials; None: nothing recorded
    potential: Callable[[Any], float] | None = None
    # what the model sees (--context, --observation-format, --show-budget: harness.context);
    # None: every turn verbatim, observations raw (today's harness)
    builder: ContextBuilder | None = None
    # --attempts k: a wrong answer reopens the episode with the verifier's feedback (rollout.attempts);
    # None: one attempt (today's harness)
    attempts: Attempts | None = None


@dataclass
class _Live:
    index: int
    spec: EpisodeSpec
    traj: Trajectory
    messages: list[dict]
    context: list[int]
    t0: float
    done: bool = False
    opened: int = 0  # messages of the opening (system, examples, request): always in the context
    rewritten: bool = False  # the harness rebuilt the context since the last call (harness.context)


def run_episodes(
    generate_fn: GenerateFn,
    renderer: Renderer,
    specs: Sequence[EpisodeSpec],
    budgets: Budgets,
    system_prompt: str,
    policy_version: int = 0,
    progress: Callable[[int], None] | None = None,
    examples: Sequence[tuple[str, str]] = (),
    max_live: int | None = None,
) -> list[Trajectory]:
    """Run every episode to its end and return one Trajectory per spec, in order.

    Every episode opens with ``system_prompt``, then the environment's worked
    ``examples`` (request, reply) as earlier turns, then the task's request
    (:func:`opening_messages`).

    ``progress(n_done)``, when given, is called after every batched model call with the
    number of episodes finished so far (for a progress bar), and once at the end.

    Outcome: ``finished`` when the environment terminated the episode, ``truncated`` when
    a budget ended it (a call cut at ``max_new_tokens`` counts, in any turn: case 05),
    ``env_error`` when the environment or verifier failed (not the policy's fault).

    ``max_live`` bounds the episodes in flight at once (their K/V is what grows with the
    batch: :func:`consequence.rollout.sampling.episodes_in_flight`): the specs then run in
    consecutive waves of at most that many, each to its end; an episode keeps its index
    (its random stream and cache key), so waves change no episode that samples from its
    own stream. None: all at once.

    Raises:
        ValueError: a tool spec is malformed, a spec's ``opening`` ends its episode, or
            ``max_live`` < 1.
    """
    if max_live is not None and max_live < 1:
        raise ValueError(f"max_live (episodes in flight) must be >= 1 or None, got {max_live}")
    tool_specs = check_tool_specs(renderer.tools)
    wave = max_live or max(1, len(specs))
    out: list[Trajectory] = []
    for a in range(0, len(specs), wave):
        shown = None if progress is None else (lambda n, a=a: progress(a + n))  # episodes of earlier waves are done
        wave_ids = range(a, min(a + wave, len(specs)))
        out += _run_wave(
            generate_fn, renderer, specs, wave_ids, budgets, tool_specs, system_prompt, policy_version, shown, examples
        )
    if progress is not None and not specs:
        progress(0)
    return out


def _run_wave(
    generate_fn: GenerateFn,
    renderer: Renderer,
    specs: Sequence[EpisodeSpec],
    indices: range,
    budgets: Budgets,
    tool_specs,
    system_prompt: str,
    policy_version: int,
    progress: Callable[[int], None] | None,
    examples: Sequence[tuple[str, str]],
) -> list[Trajectory]:
    """The episodes ``specs[i]`` for i in ``indices``, batched turn by turn (:func:`run_episodes`)."""
    live = [_start(i, specs[i], renderer, system_prompt, policy_version, examples) for i in indices]
    for _turn in range(budgets.max_turns):
        active = [e for e in live if not e.done]
        for e in active:
            if len(e.context) + budgets.max_new_tokens > budgets.max_total_tokens:
                _end(e, "truncated", "total_tokens")
        active = [e for e in active if not e.done]
        if not active:
            break
        samples = generate_fn([e.context for e in active], budgets.max_new_tokens, [e.index for e in active])
        # Tool execution runs sandboxed subprocesses: overlap them across episodes.
        list(_POOL.map(lambda es: _advance(es[0], es[1], renderer, tool_specs, budgets), zip(active, samples)))
        for e in active:  # every active episode made one call: Φ of the state its turn left
            _record_potential(e)
        if progress is not None:
            progress(sum(e.done for e in live))
    for e in live:
        if not e.done:
            _end(e, "truncated", "max_turns")
    if progress is not None:
        progress(len(live))
    return [e.traj for e in live]


def opening_messages(system_prompt: str, request: str, examples: Sequence[tuple[str, str]] = ()) -> list[dict]:
    """The conversation an episode starts from: the system prompt (none when empty), the worked
    examples as user / assistant turns, then the task's request."""
    shots = [{"role": role, "content": text} for q, a in examples for role, text in (("user", q), ("assistant", a))]
    return (
        ([{"role": "system", "content": system_prompt}] if system_prompt else [])
        + shots
        + [{"role": "user", "content": request}]
    )


def opening_prompt_len(
    renderer: Renderer, system_prompt: str, request: str, examples: Sequence[tuple[str, str]] = ()
) -> int:
    """Tokens of an episode's first prompt (before any opening turns): what a budget must fit."""
    return len(renderer.prompt_ids(opening_messages(system_prompt, request, examples)))


def reset_observation(spec: EpisodeSpec) -> str:
    """The opening observation of ``spec``'s episode: ``spec.env.reset(seed=spec.seed)``.

    Raises:
        TypeError: ``reset`` did not return ``(observation: str, info)``; anything ``reset`` raises.
    """
    obs, _info = spec.env.reset(seed=spec.seed)
    if not isinstance(obs, str):
        raise TypeError(
            f"reset() must return (observation: str, info: dict); the observation is a {type(obs).__name__}"
        )
    return obs


def _start(
    index: int,
    spec: EpisodeSpec,
    renderer: Renderer,
    system_prompt: str,
    version: int,
    examples: Sequence[tuple[str, str]] = (),
) -> _Live:
    traj = Trajectory(
        task_id=spec.task_id, group_id=spec.group_id, sample_id=spec.sample_id, seed=spec.seed, policy_version=version
    )
    e = _Live(index, spec, traj, [], [], time.perf_counter())
    try:
        obs = reset_observation(spec)
    except Exception as err:  # the environment's fault, not the policy's: excluded, counted
        _end(e, "env_error", error=raised("reset", err))
        return e
    e.messages = opening_messages(system_prompt, obs, examples)
    e.opened = len(e.messages)
    for name, arguments in spec.opening:
        obs, _r, terminated, truncated, info = spec.env.step({"name": name, "arguments": arguments})
        e.traj.env_retries += int(info.get("env_retries", 0))
        if info.get("env_error"):
            _end(e, "env_error", error=str(info["env_error"]))
            return e
        if terminated or truncated:
            raise ValueError(
                f"episode {spec.task_id}: the opening call {name!r} ended the episode; an "
                "opening may only set up a state for the policy to continue from"
            )
        call = {"type": "function", "function": {"name": name, "arguments": arguments}}
        e.messages = e.messages + [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": name, "content": obs},
        ]
    e.context = renderer.prompt_ids(e.messages)
    _record_potential(e)  # Φ(s_0): after reset and the scripted opening
    return e


def _record_potential(e: _Live) -> None:
    """Append Φ of ``e``'s current state to ``e.traj.potentials`` (with ``spec.potential``); a
    potential that raises or is not finite is the environment's fault: an env_error."""
    if e.spec.potential is None or e.traj.outcome == "env_error":
        return
    try:
        value = float(e.spec.potential(e.spec.env))
        if not math.isfinite(value):
            raise ValueError(f"returned {value!r}, not a finite number")
    except Exception as err:
        return _end(e, "env_error", error=raised("potential", err))
    e.traj.potentials.append(value)


def _end(e: _Live, outcome: str, reason: str | None = None, error: str | None = None) -> None:
    e.done = True
    e.traj.outcome = outcome  # type: ignore[assignment]
    e.traj.truncation_reason = reason if outcome == "truncated" else None
    e.traj.error = error
    e.traj.wall_time_s = time.perf_counter() - e.t0
    e.traj.final_code = getattr(e.spec.env, "code", None)
    e.traj.messages = e.messages


def raised(where: str, err: Exception) -> str:
    """The error text of an environment call that raised (an ``env_error``, never a 0)."""
    return f"environment {where} raised {type(err).__name__}: {err}"


def take_reward(traj: Trajectory, call: ModelCall, reward: Any, info: dict, scale: float = 1.0) -> str | None:
    """Keep one step's reward on its call and per component on the trajectory; an error
    text when the reward or its components are not numbers (then: env_error).

    ``scale`` multiplies the step's reward and each component (``--attempts``: d**(j−1) at the
    end of attempt j, 0 for a wrong attempt that is retried; :mod:`consequence.rollout.attempts`);
    the components are checked against the unscaled reward."""
    try:
        value = float(reward)
        parts = info.get("reward_components") or ({"reward": value} if value else {})
        parts = {str(k): float(v) for k, v in parts.items()}
    except (TypeError, ValueError, AttributeError) as err:
        return f"environment step returned a reward that is not a number: {reward!r} ({err})"
    if parts and not math.isclose(math.fsum(parts.values()), value, rel_tol=1e-9, abs_tol=1e-9):
        return (
            f"environment step returned reward {value!r} but its reward_components {parts!r} sum to "
            f"{math.fsum(parts.values())!r}; the components must add up to the step's reward"
        )
    call.reward += value * scale
    for k, v in parts.items():
        traj.env_rewards[k] = traj.env_rewards.get(k, 0.0) + v * scale
    return None


def _supports(sample: Any) -> list[list[int]] | None:
    """The sample's keep-sampling mask (``Sample.keep_ids``); ``None`` for a scripted sample without one."""
    keep = getattr(sample, "keep_ids", None)
    return None if keep is None else [list(k) for k in keep]


def _advance(e: _Live, sample: Any, renderer: Renderer, tool_specs: dict, budgets: Budgets) -> None:
    answers = getattr(e.spec.env, "answer_ends_episode", e.spec.answer_ends_episode)
    parsed = renderer.parse(sample.output_ids, sample.stop_reason, answers=answers)
    call = ModelCall(
        context_ids=list(e.context),
        output_ids=list(sample.output_ids),
        sample_logprobs=list(sample.logprobs),
        stop_reason=sample.stop_reason,
        tool_calls=parsed.tool_calls,
        parse_error=parsed.parse_error,
        keep_ids=_supports(sample),
    )
    e.traj.calls.append(call)
    e.traj.context_rewrites += e.rewritten  # counted when a call sees it: rows = 1 + rewrites
    e.rewritten = False
    if sample.stop_reason == "length":
        e.messages = e.messages + [parsed.message]
        return _end(e, "truncated", "max_new_tokens")
    results: list[dict] = []
    if parsed.parse_error:
        results.append({"role": "tool", "name": "error", "content": f"error: {parsed.parse_error}"})
    actions = list(parsed.tool_calls)
    if not actions and not parsed.parse_error and answers:
        actions = [{ANSWER_KEY: parsed.message.get("content") or ""}]
    for tc in actions:
        answer = ANSWER_KEY in tc
        if not answer:
            e.traj.n_tool_calls += 1
            e.traj.tool_histogram[tc["name"]] = e.traj.tool_histogram.get(tc["name"], 0) + 1
            problem = call_problem(tc, tool_specs)
            if problem:
                call.invalid_calls.append(problem[0])  # unknown_tool / bad_arguments, for the metrics
                results.append({"role": "tool", "name": tc["name"], "content": f"error: {problem[1]}"})
                continue
        retry, scale = None, 1.0
        try:
            obs, reward, terminated, truncated, info = e.spec.env.step(tc)
            if not isinstance(obs, str) or not isinstance(info, dict):
                raise TypeError(
                    "step() must return (observation: str, reward, terminated, truncated, info: dict); "
                    f"got observation {type(obs).__name__}, info {type(info).__name__}"
                )
            retry, scale = attempt_step(e.spec.attempts, e.spec.env, e.traj.attempts, terminated, info)
            error = take_reward(e.traj, call, reward, info, scale)
        except Exception as err:  # an environment that raises is an env_error, never a 0
            obs, terminated, truncated, info = "", False, False, {}
            error = raised("step", err)
        e.traj.env_retries += int(info.get("env_retries", 0))  # re-runs of a failed sandbox
        if error or info.get("env_error"):
            e.messages = e.messages + [parsed.message] + results
            return _end(e, "env_error", error=error or str(info["env_error"]))
        results.append(
            {"role": "user", "content": obs} if answer else {"role": "tool", "name": tc["name"], "content": obs}
        )
        if retry is not None:  # a wrong attempt reopened the episode (--attempts): its feedback, another turn
            results[-1] = {**results[-1], "content": retry}
            e.traj.attempts += 1
            break
        if terminated or truncated:
            e.messages = e.messages + [parsed.message] + results
            total = sum(c.reward for c in e.traj.calls)
            e.traj.verifier_score = final_verifier_score(total, float(reward), scale) if terminated else None
            e.traj.attempt_scale = scale
            return _end(e, "finished" if terminated else "truncated", None if terminated else "environment")
    if e.traj.n_tool_calls >= budgets.max_tool_calls:
        e.messages = e.messages + [parsed.message] + results
        return _end(e, "truncated", "max_tool_calls")
    history = e.messages
    view = e.spec.builder
    if view is not None:  # presentation: what the model samples against, still a continuation
        left = budgets.max_total_tokens - len(call.context_ids) - len(call.output_ids)
        tools_left = budgets.max_tool_calls - e.traj.n_tool_calls
        results = view.present(results, budgets.max_turns - len(e.traj.calls), left, tools_left)
    shown = (view.window(history, e.opened) if view is not None else None) or history
    call.observation_ids = renderer.observation_ids(shown, parsed.message, results)
    e.messages = history + [parsed.message] + results
    e.context = e.context + call.output_ids + call.observation_ids
    rewritten = view.window(e.messages, e.opened) if view is not None else None
    if rewritten is not None:  # turns dropped: a fresh context, a new training row (trajectory_to_rows)
        e.context = renderer.prompt_ids(rewritten)
        e.rewritten = True

"""The agent-runner: a user's own agent program drives the rollouts (``consequence train --agent``).

The user writes ``async def agent(client, task) -> result`` against the ``openai``
package only: ``client`` is an ``openai.AsyncOpenAI`` whose base URL is the episode's
own session on a loopback endpoint (``serve.app``), so every call it makes is recorded
token-exactly into that episode's trajectory (``serve.sessions``); ``task`` is an
:class:`AgentTask` (the opening messages, the tool specs, the model name, and
``await task.call_tool(name, arguments)`` to run a tool in the episode's environment).
What the agent returns is given to the environment as its answer when the environment
takes answers (``serve.episode``).

:func:`run_agent_episodes` runs one agent per episode spec, all concurrently (their
calls are batched together), and returns one trajectory per spec, like
``rollout.episodes.run_episodes``: the reward, credit and update boxes and the pre-step
checks take them as any other.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from consequence.harness.renderer import Renderer
from consequence.harness.tools import check_tool_specs
from consequence.policy.sampler import SamplingParams
from consequence.records import Trajectory
from consequence.rollout.episodes import Budgets, EpisodeSpec, opening_messages, raised, reset_observation
from consequence.serve.app import BackgroundServer, ServeSettings, create_app, model_context_length
from consequence.serve.episode import BoundEpisode
from consequence.serve.sessions import Session

AGENT_MODEL_NAME = "policy"
AGENT_TIMEOUT_S = 600.0  # one HTTP request of the agent's client
SECONDS_PER_TURN = 120.0  # the default wall-clock limit of an episode is this × max_turns


def episode_time_limit(budgets: Budgets, agent_timeout: float = 0.0) -> float:
    """The wall-clock limit of one agent episode: ``agent_timeout`` (``--agent-timeout``), or
    when 0 the default ``SECONDS_PER_TURN × budgets.max_turns``."""
    return agent_timeout if agent_timeout > 0 else SECONDS_PER_TURN * budgets.max_turns


@dataclass
class AgentTask:
    """What an agent gets beside its client (plain data; an agent needs no import of ours).

    Attributes:
        task_id: the task's id.
        messages: the opening messages (system prompt, worked examples, the task's request),
            in the OpenAI shape; send them as they are to start the episode.
        tools: the environment's tool specs (OpenAI function-calling shape); ``[]`` for none.
        model: the model name to pass to ``chat.completions.create``.
    """

    task_id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    model: str
    _episode: BoundEpisode = field(repr=False)

    async def call_tool(self, name: str, arguments: Any) -> str:
        """Run one tool call in the episode's environment; the observation text.

        ``arguments`` is the JSON string of the wire (``tool_call.function.arguments``)
        or a dict. An invalid call returns ``error: ...`` (as the harness shows it).
        """
        return await asyncio.to_thread(self._episode.call_tool, name, arguments)

    @property
    def done(self) -> bool:
        """The episode is over (the environment ended it, or a budget did): stop calling the model."""
        return self._episode.ended


def load_agent(target: str) -> Callable:
    """The agent function ``target`` names: ``package.module:function`` or ``path/to/file.py:function``.

    Raises:
        ValueError: no ``:``, a path that is not a .py file, a module or file that does not
            import, a missing attribute, a function that is not ``async def`` or cannot be
            called as ``fn(client, task)`` (the message says how to fix it).

    A ``module:function`` is imported with the current folder on ``sys.path`` (as
    ``python -m`` has it), so a module next to where ``consequence`` runs is found.
    """
    module, _, attr = target.rpartition(":")
    if not module or not attr:
        raise ValueError(
            f"--agent {target!r}: give module:function or path/to/file.py:function, e.g. "
            "examples/openai_agent/agent.py:agent"
        )
    # A path (or a file in this folder) is not a module name; a bare folder name may be a package.
    if not module.endswith(".py") and ("/" in module or "\\" in module or Path(module).is_file()):
        what = "a folder" if Path(module).is_dir() else "a file" if Path(module).exists() else "a path"
        raise ValueError(
            f"--agent {target!r}: {module!r} is {what}, not a .py file; give path/to/file.py:function "
            "or an importable package.module:function"
        )
    try:
        if module.endswith(".py"):
            path = Path(module)
            if not path.is_file():
                raise ImportError(f"no file {path}")
            spec = importlib.util.spec_from_file_location(f"consequence_agent_{path.stem}", path)
            mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
            sys.modules[spec.name] = mod  # type: ignore[union-attr]
            spec.loader.exec_module(mod)  # type: ignore[union-attr]
        else:
            # As `python -m` does: a module in the current folder is found.
            if "" not in sys.path and str(Path.cwd()) not in sys.path:
                sys.path.insert(0, str(Path.cwd()))
            mod = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001  (the user's module: name its error, not a traceback)
        raise ValueError(f"--agent {target!r}: importing {module!r} failed ({type(e).__name__}: {e})") from None
    fn = getattr(mod, attr, None)
    if fn is None:
        raise ValueError(f"--agent {target!r}: {module!r} has no attribute {attr!r}")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(
            f"--agent {target!r}: {attr} must be an async function, `async def {attr}(client, task)`, "
            "called with an openai.AsyncOpenAI client"
        )
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise ValueError(
            f"--agent {target!r}: {attr}{inspect.signature(fn)} cannot be called as {attr}(client, task); "
            f"define it as `async def {attr}(client, task)`"
        ) from None
    return fn


def agent_runner(
    target: str, model, renderer: Renderer, env, budgets: Budgets, sampling: SamplingParams, agent_timeout: float = 0.0
):
    """The agent-runner as an episode runner (``rollout.collect.EpisodeRunner``): the agent
    ``target`` names (:func:`load_agent`, called at each round) plays each episode through
    the loopback endpoint serving ``model``; its counts (``agent_*``) are the runner's stats."""

    def run(specs, seed, policy_version, progress):
        return run_agent_episodes(
            load_agent(target),
            model,
            renderer,
            specs,
            budgets,
            sampling,
            env.system_prompt,
            seed,
            policy_version=policy_version,
            examples=env.examples,
            progress=progress,
            agent_timeout=agent_timeout,
        )

    return run


def run_agent_episodes(
    agent: Callable,
    model,
    renderer: Renderer,
    specs: Sequence[EpisodeSpec],
    budgets: Budgets,
    sampling: SamplingParams,
    system_prompt: str,
    seed: int,
    policy_version: int = 0,
    examples: Sequence[tuple[str, str]] = (),
    progress: Callable[[int], None] | None = None,
    agent_timeout: float = 0.0,
) -> tuple[list[Trajectory], dict[str, float]]:
    """Run ``agent`` once per spec against a loopback endpoint serving ``model``; one
    trajectory per spec, in order, and the run's stats.

    Args:
        agent: ``async def agent(client, task) -> result`` (:func:`load_agent`).
        sampling: the run's sampling settings (the episodes' calls use them; a request
            asking for others is refused).
        seed: seed of the endpoint's sampling generator.
        agent_timeout: wall-clock limit of each episode's agent in seconds (0: the default,
            :func:`episode_time_limit`); an agent still running then is cancelled and its
            episode ends as ``env_error``.

    Returns:
        (trajectories, stats): ``agent_prefix_breaks`` (calls that started a new training
        row after their session's first: a retry, an unused or edited reply, each with its
        reason in ``Session.breaks``; rows = 1 + breaks per episode with calls), ``agent_calls``,
        ``agent_batches`` (``generate`` calls that sampled them); counts, so rounds add up.

    Raises:
        ValueError: a spec with a scripted ``opening`` (not supported on this path), or
            malformed tool specs; ``ImportError`` (as ValueError) without the ``openai`` package.
    """
    try:
        import openai
    except ImportError:
        raise ValueError("--agent needs the openai package: pip install 'consequence[agent]' (or openai)") from None
    check_tool_specs(renderer.tools)
    if any(s.opening for s in specs):
        raise ValueError("the agent-runner does not play scripted openings (EpisodeSpec.opening); use run_episodes")
    settings = ServeSettings(
        AGENT_MODEL_NAME,
        model_context_length(model),
        sampling.temperature,
        sampling.top_p,
        sampling.top_k,
        budgets.max_new_tokens,
        seed,
        max_batch=max(1, len(specs)),
    )
    app = create_app(model, renderer, settings)
    sessions = [
        _bind(i, s, renderer, budgets, sampling, system_prompt, policy_version, examples) for i, s in enumerate(specs)
    ]
    for s, _task in sessions:
        app.state.serve.sessions.add(s)
    with BackgroundServer(app) as server:
        limit = episode_time_limit(budgets, agent_timeout)
        asyncio.run(_run_all(agent, openai, server.url, sessions, progress, limit))
    b = app.state.serve.batcher.stats
    stats = {
        "agent_prefix_breaks": float(sum(s.prefix_breaks for s, _ in sessions)),
        "agent_calls": float(sum(len(s.trajectory.calls) for s, _ in sessions)),
        "agent_batches": float(b.batches),
    }
    return [s.trajectory for s, _ in sessions], stats


def _bind(
    index: int,
    spec: EpisodeSpec,
    renderer: Renderer,
    budgets: Budgets,
    sampling: SamplingParams,
    system_prompt: str,
    version: int,
    examples: Sequence[tuple[str, str]],
) -> tuple[Session, AgentTask | None]:
    """The session of one spec, its episode reset (a reset that fails is an env_error: no agent runs)."""
    traj = Trajectory(
        task_id=spec.task_id, group_id=spec.group_id, sample_id=spec.sample_id, seed=spec.seed, policy_version=version
    )
    answers = getattr(spec.env, "answer_ends_episode", spec.answer_ends_episode)
    ep = BoundEpisode(spec.env, traj, budgets, sampling, check_tool_specs(renderer.tools), answers)
    session = Session(f"episode-{index}", traj, episode=ep)
    try:
        obs = reset_observation(spec)
    except Exception as err:  # the environment's fault, not the policy's: excluded, counted
        ep.end("env_error", error=raised("reset", err))
        return session, None
    messages = opening_messages(system_prompt, obs, examples)
    traj.messages = list(messages)
    return session, AgentTask(spec.task_id, messages, list(renderer.tools), AGENT_MODEL_NAME, ep)


async def _run_all(agent: Callable, openai, url: str, sessions, progress, limit_s: float) -> None:
    done = [0]

    async def one(session: Session, task: AgentTask | None) -> None:
        if task is not None:
            await _run_one(agent, openai, url, session, task, limit_s)
        done[0] += 1
        if progress is not None:
            progress(done[0])

    await asyncio.gather(*(one(s, t) for s, t in sessions))


async def _run_one(agent: Callable, openai, url: str, session: Session, task: AgentTask, limit_s: float) -> None:
    """One agent on one episode; whatever it raises, or its running past ``limit_s``, ends
    the episode (an ``env_error`` when it was still open), never the run."""
    client = openai.AsyncOpenAI(
        base_url=f"{url}/s/{session.id}/v1", api_key="consequence-local", max_retries=0, timeout=AGENT_TIMEOUT_S
    )
    ep = session.episode
    try:
        result = await asyncio.wait_for(agent(client, task), limit_s)
    except TimeoutError:  # a hang is the agent program's failure (the token budgets bound the policy)
        ep.finish(
            None,
            agent_error=None
            if ep.ended
            else f"the agent did not return within {limit_s:g} s (--agent-timeout; the default is "
            f"{SECONDS_PER_TURN:g} s × --max-turns) and was cancelled",
        )
    except Exception as e:  # noqa: BLE001  (an agent's own failure is counted, not a crash of the run)
        ep.finish(None, agent_error=None if ep.ended else f"the agent raised {type(e).__name__}: {e}")
    else:
        ep.finish(result)
    finally:
        await client.close()

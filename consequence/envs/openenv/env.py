"""Environments served by an OpenEnv server (Meta's ``openenv-core``) as an environment: ``openenv``.

An OpenEnv environment (``openenv.core.env_server.Environment``: ``reset(seed) -> Observation``,
``step(Action) -> Observation`` with ``done`` and ``reward`` on the observation) is served
over HTTP by ``create_app(EnvClass, ActionClass, ObservationClass)``; a stateful episode is
one WebSocket session at ``/ws`` (the stateless ``/reset`` and ``/step`` routes make a fresh
environment per request, so they cannot hold an episode). This adapter speaks that protocol
itself (messages ``{"type": "reset", "data": {...}}``, ``{"type": "step", "data": action}``,
``{"type": "close"}``; replies ``{"type": "observation", "data": {"observation", "reward",
"done"}}`` or ``{"type": "error", "data": {"message", "code"}}``, as OpenEnv's own
``EnvClient`` does), so a run needs only the ``websockets`` package on our side
(``pip install 'consequence[openenv]'``), not the server's dependencies.

Tasks. Problem ``i`` (``0 <= i < n_problems``) is the episode that ``reset(seed=i,
**reset_kwargs)`` starts; its task and problem id are ``seed-i``, and the split seed splits
the ids 80 / 10 / 10 (:func:`consequence.envs.repair.jsonl.split_by_problem`). The G episodes of a
group reset with the same seed (the runner's own sampling seed is not sent). An environment
that ignores the seed gives the same problem under every id: its splits are then nominal.

Mapping (one episode = one WebSocket session, closed when the episode ends):

- observation → text: the observation's fields (the server drops ``done``, ``reward`` and
  ``metadata``): the field ``observation_field`` when given, else the only field when there
  is one, else all fields as sorted JSON; a string value is shown as is, others as JSON.
- action, ``action="answer"`` (default; no tools): a reply without a tool call is the
  action ``{answer_field: text}``; ``answer_field`` defaults to the action schema's only field
  (``GET /schema``; ``metadata`` aside). The episode goes on after an answer unless the
  server says ``done`` (the next observation is shown as a user turn).
- action, ``action="tool"``: one tool, ``tool_name`` (default: the action class's title
  in snake case without ``Action``, e.g. ``GuessAction`` → ``guess``), whose parameters are
  the action schema; a tool call's arguments are the action. A reply without a tool call is
  just a turn (``answer_ends_episode = False``).
- reward → the component ``reward``: the observation's reward at each step (``None`` is 0.0,
  ``True`` 1.0), summed over steps; ``reward_range`` (option, default ``[0, 1]``) bounds the
  episode's total, which the reward box checks. ``done`` → ``terminated``; OpenEnv has no
  truncation flag, so budgets (``--max-turns``) truncate.
- errors: an action the server's action model refuses (error code ``VALIDATION_ERROR``) is
  the policy's fault: an ``error: ...`` observation, reward 0, the episode goes on. Any other
  error reply (the environment raised: ``EXECUTION_ERROR``; no free session:
  ``CAPACITY_REACHED``), a lost connection, a reply that is not the protocol's or a reward
  that is not a finite number is an ``env_error`` (excluded, never 0).

Concurrency: every live episode holds one session, and the runner keeps all episodes of a
batch live at once (tasks per iteration × group size, or the evaluation batch), so the
server must allow that many (``create_app(..., max_concurrent_envs=N)`` with an environment
that sets ``SUPPORTS_CONCURRENT_SESSIONS = True``; OpenEnv's default is 1).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, TypeGuard

from consequence.envs.api import SPLITS, Environment

__all__ = ["INSTALL_HINT", "OpenEnvTask", "OpenEnvEpisode", "OpenEnvEnvironment", "observation_text", "tool_name_of"]

INSTALL_HINT = "pip install 'consequence[openenv]'"
_ACTIONS = ("answer", "tool")
_MAX_MESSAGE = 100 * 1024 * 1024  # bytes of one reply (OpenEnv's client allows 100 MB: screenshots, DOM)
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def _websockets_client():
    """``websockets.sync.client`` (imported only when an OpenEnv environment is made).

    Raises:
        ValueError: websockets is not installed, or older than 15 (names the extra that installs it).
    """
    try:
        import websockets
        from websockets.sync import client
    except ImportError as e:
        raise ValueError(
            f"--env openenv needs the websockets package (>= 15) to talk to the server ({e}); {INSTALL_HINT}"
        ) from None
    major = int(re.match(r"\d+", websockets.__version__).group())
    if major < 15:
        raise ValueError(f"--env openenv needs websockets >= 15 (installed: {websockets.__version__}); {INSTALL_HINT}")
    return client


@dataclass(frozen=True)
class OpenEnvTask:
    """One problem: the episode that ``reset(seed=seed, **reset_kwargs)`` starts."""

    task_id: str
    problem_id: str
    seed: int


def observation_text(observation: dict, field: str | None = None) -> str:
    """The text the policy sees for an OpenEnv observation (see the module doc).

    Raises:
        ValueError: ``field`` is not a field of the observation (names the ones it has).
    """
    if field is not None:
        if field not in observation:
            raise ValueError(
                f"the observation has no field {field!r} (option observation_field); it has "
                + (", ".join(map(repr, observation)) or "none")
            )
        value = observation[field]
    elif len(observation) == 1:
        value = next(iter(observation.values()))
    else:
        value = observation
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False)


def tool_name_of(schema: dict) -> str:
    """The default tool name of an action schema: its title in snake case without ``Action``."""
    title = str(schema.get("title") or "act")
    title = re.sub(r"Action$", "", title) or "act"
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", re.sub(r"[^A-Za-z0-9]+", "_", title)).strip("_").lower() or "act"


def _is_server_url(url: Any) -> TypeGuard[str]:
    """True when ``url`` is a string with an http(s) / ws(s) scheme and a host."""
    try:
        parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
        return bool(parts and parts.scheme in ("http", "https", "ws", "wss") and parts.hostname)
    except ValueError:  # e.g. an unclosed [ of an IPv6 host
        return False


class _ServerError(RuntimeError):
    """An error reply of the OpenEnv server (its message and code)."""

    def __init__(self, where: str, data: dict):
        self.code = str(data.get("code", "UNKNOWN"))
        self.data = data
        text = f"OpenEnv server: {where} failed: {data.get('message', 'no message')} (code {self.code})"
        if self.code == "CAPACITY_REACHED":
            text += (
                f"; the server holds at most {data.get('max_sessions', '?')} sessions and every live episode "
                "needs one: serve it with create_app(..., max_concurrent_envs=N) for N >= the episodes run at "
                "once (tasks per iteration x group size, or the evaluation batch)"
            )
        super().__init__(text)


class _Session:
    """One WebSocket session at ``{base_url}/ws``: one live OpenEnv environment on the server."""

    def __init__(self, ws_url: str, timeout_s: float, loopback: bool):
        self.timeout_s = timeout_s
        conn = _websockets_client().connect(
            ws_url, open_timeout=timeout_s, max_size=_MAX_MESSAGE, proxy=None if loopback else True
        )
        self.conn = conn.__enter__()  # held open across steps; close() ends it (websockets 17 asks for this)

    def send(self, where: str, message: dict) -> dict:
        """Send one message and return the reply's ``data``.

        Raises:
            _ServerError: an error reply. RuntimeError: a reply that is not the protocol's.
            TimeoutError / websockets errors: no reply in time, a closed connection.
        """
        try:
            self.conn.send(json.dumps(message))
        except Exception:  # closed: a server that refuses a session says why, then closes (no free session)
            try:
                raw = self.conn.recv(timeout=self.timeout_s)
            except Exception:
                raw = None
            if raw is None:
                raise
        else:
            raw = self.conn.recv(timeout=self.timeout_s)
        try:
            reply = json.loads(raw)
        except (TypeError, ValueError) as e:
            raise RuntimeError(f"OpenEnv server: {where}: the reply is not JSON ({e}): {str(raw)[:200]!r}") from None
        kind = reply.get("type") if isinstance(reply, dict) else None
        data = reply.get("data") if isinstance(reply, dict) else None
        if kind == "error":
            raise _ServerError(where, data if isinstance(data, dict) else {})
        if kind != "observation" or not isinstance(data, dict) or not isinstance(data.get("observation"), dict):
            raise RuntimeError(f"OpenEnv server: {where}: expected an observation reply, got {str(raw)[:200]!r}")
        return data

    def close(self) -> None:
        """Ask the server to end the session, let it close the connection (so that it does not log
        a disconnect), then close our side. Best effort: the server may be gone already."""
        with contextlib.suppress(Exception):  # ConnectionClosed: the server closed it, as asked
            self.conn.send(json.dumps({"type": "close"}))
            self.conn.recv(timeout=min(2.0, self.timeout_s))  # returns only if the server replied instead
        with contextlib.suppress(Exception):
            self.conn.close()


class OpenEnvEpisode:
    """One episode of an OpenEnv environment: a WebSocket session from ``reset`` to ``done``."""

    def __init__(self, env: OpenEnvEnvironment, task: OpenEnvTask):
        self.env = env
        self.task = task
        self.answer_ends_episode = env.answer_ends_episode
        self.code: str | None = None  # the last answer (the trajectory's final_code)
        self._session: _Session | None = None

    def _info(self, **kw) -> dict:
        return {"task_id": self.task.task_id, "problem_id": self.task.problem_id, "openenv_seed": self.task.seed, **kw}

    def close(self) -> None:
        """End the server-side session (also done when the episode ends, and on garbage collection)."""
        session, self._session = getattr(self, "_session", None), None
        if session is not None:
            session.close()

    def __del__(self):
        self.close()

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        """Open a session and reset it with the task's seed (``seed`` is the runner's and is not sent).

        Raises:
            RuntimeError: the server replied with an error, or ended the episode at reset.
            OSError / websockets errors: no server at ``base_url``.
        """
        self.close()
        self.code = None
        self._session = _Session(self.env.ws_url, self.env.timeout_s, self.env.loopback)
        try:
            data = self._session.send(
                "reset", {"type": "reset", "data": {**self.env.reset_kwargs, "seed": self.task.seed}}
            )
            if data.get("done"):
                raise RuntimeError(
                    f"OpenEnv server: reset(seed={self.task.seed}) returned an observation with "
                    "done=True: the episode ended before any action"
                )
            text = observation_text(data["observation"], self.env.observation_field)
        except BaseException:
            self.close()
            raise
        return text, self._info(observation=data["observation"], openenv_reward=data.get("reward"))

    def _action(self, action: dict) -> dict:
        if "answer" in action:
            if self.env.action != "answer":
                raise ValueError(f"{self.task.task_id}: action=tool takes tool calls, not an answer")
            self.code = str(action["answer"])
            return {self.env.answer_field: self.code}
        if self.env.action != "tool" or action.get("name") != self.env.tool_name:
            raise ValueError(
                f"{self.task.task_id}: unknown tool {action.get('name')!r}; "
                + (
                    f"the only tool is {self.env.tool_name!r}"
                    if self.env.action == "tool"
                    else "action=answer declares no tools"
                )
            )
        return dict(action.get("arguments") or {})

    def step(self, action: dict) -> tuple[str, float, bool, bool, dict]:
        """Send the action; the server's observation, reward and ``done`` come back (see the module doc).

        Raises:
            ValueError: an action this mapping does not make (a tool call in answer mode).
            RuntimeError: no open session (``reset`` not called, or the episode already ended).
        """
        if self._session is None:
            raise RuntimeError(
                f"{self.task.task_id}: step without an open session (reset first; the episode may have ended)"
            )
        payload = self._action(action)
        try:
            data = self._session.send("step", {"type": "step", "data": payload})
        except _ServerError as e:
            if e.code == "VALIDATION_ERROR":  # the server's action model refused it: the policy's fault
                detail = "; ".join(
                    f"{'/'.join(map(str, err.get('loc', ())))}: {err.get('msg')}"
                    for err in e.data.get("errors", [])
                    if isinstance(err, dict)
                )
                return (
                    f"error: the environment refused the action {json.dumps(payload, ensure_ascii=False)}: "
                    + (detail or str(e.data.get("message"))),
                    0.0,
                    False,
                    False,
                    self._info(reward_components={"reward": 0.0}, invalid_action=e.data),
                )
            self.close()
            return "", 0.0, True, False, self._info(env_error=str(e))
        except BaseException:
            self.close()
            raise
        raw = data.get("reward")
        if raw is None:
            reward = 0.0
        elif isinstance(raw, (bool, int, float)) and math.isfinite(float(raw)):
            reward = float(raw)
        else:
            self.close()
            return (
                "",
                0.0,
                True,
                False,
                self._info(env_error=f"OpenEnv server: step returned a reward that is not a finite number: {raw!r}"),
            )
        done = bool(data.get("done"))
        try:
            text = observation_text(data["observation"], self.env.observation_field)
        except ValueError as e:
            self.close()
            return "", 0.0, True, False, self._info(env_error=f"OpenEnv server: {e}")
        if done:
            self.close()
        return (
            text,
            reward,
            done,
            False,
            self._info(reward_components={"reward": reward}, observation=data["observation"], openenv_reward=raw),
        )


class OpenEnvEnvironment(Environment):
    """An environment served by an OpenEnv server at ``base_url`` (see the module doc for the mapping).

    Args:
        split_seed: seed of the problem-level split (≈ 80 / 10 / 10 of the reset seeds).
        base_url: the server, ``http://HOST:PORT`` (``https://`` for TLS); required.
        n_problems: problems, i.e. reset seeds ``0 .. n_problems - 1`` (1 .. 1000000; default 100).
        action: ``"answer"`` (a reply is the action ``{answer_field: text}``) or ``"tool"``
            (the action schema is one tool).
        answer_field: the action field an answer fills (default: the action's only field).
        tool_name: the tool's name with ``action="tool"`` (default: from the action class's title).
        observation_field: the observation field shown to the policy (default: the only
            field, else all fields as JSON).
        reset_kwargs: extra keyword arguments of every ``reset`` (a mapping; ``seed`` is the task's).
        reward_range: ``[low, high]`` of an episode's total reward (default ``[0, 1]``).
        system_prompt: the system message of every episode (default: none).
        timeout_s: seconds to connect and to wait for each reply (default 60).

    Raises:
        ValueError: a missing or bad option (names it and the fix), the websockets package
            missing (names the extra), no server at ``base_url``, or an action schema that the
            chosen mapping cannot use.
    """

    name = "openenv"
    version = "1"
    system_prompt = ""
    tools: list[dict] = []
    reward_components = ("reward",)
    reward_range = (0.0, 1.0)
    answer_ends_episode = True

    def __init__(
        self,
        split_seed: int = 0,
        base_url: str | None = None,
        n_problems: int = 100,
        action: str = "answer",
        answer_field: str | None = None,
        tool_name: str | None = None,
        observation_field: str | None = None,
        reset_kwargs: dict | None = None,
        reward_range: list | tuple = (0.0, 1.0),
        system_prompt: str = "",
        timeout_s: float = 60.0,
    ):
        where = "--env openenv: option"
        if not _is_server_url(base_url):
            raise ValueError(
                f"{where} base_url={base_url!r} must be the server's URL (--env-option "
                "base_url=http://127.0.0.1:8000; serve an OpenEnv environment with its create_app)"
            )
        if type(n_problems) is not int or not 1 <= n_problems <= 1_000_000:
            raise ValueError(
                f"{where} n_problems={n_problems!r} must be an integer from 1 to 1000000 (reset seeds "
                "0 .. n-1; --env-option n_problems=N)"
            )
        if action not in _ACTIONS:
            raise ValueError(
                f"{where} action={action!r} must be one of {', '.join(_ACTIONS)} (--env-option action=tool)"
            )
        for opt, value in (
            ("answer_field", answer_field),
            ("tool_name", tool_name),
            ("observation_field", observation_field),
            ("system_prompt", system_prompt),
        ):
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{where} {opt}={value!r} must be a string")
        if tool_name is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]{0,63}", tool_name):
            raise ValueError(f"{where} tool_name={tool_name!r} must be a name (letters, digits, _ or -)")
        if reset_kwargs is None:
            reset_kwargs = {}
        try:
            json.dumps(reset_kwargs)
            ok = isinstance(reset_kwargs, dict)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(
                f"{where} reset_kwargs={reset_kwargs!r} must be a JSON mapping (--env-option "
                "'reset_kwargs={difficulty: hard}')"
            )
        try:
            low, high = (float(x) for x in reward_range) if isinstance(reward_range, (list, tuple)) else (1.0, 0.0)
            ok = math.isfinite(low) and math.isfinite(high) and low <= high
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(
                f"{where} reward_range={reward_range!r} must be [low, high], two finite numbers with "
                "low <= high (--env-option 'reward_range=[-1, 1]')"
            )
        if type(timeout_s) not in (int, float) or not 0 < timeout_s <= 3600:
            raise ValueError(f"{where} timeout_s={timeout_s!r} must be a number of seconds in (0, 3600]")
        _websockets_client()  # fail here, before any work, when the extra is not installed
        parts = urllib.parse.urlsplit(base_url)
        self.base_url = base_url.rstrip("/")
        http = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
        ws = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
        self.http_url = urllib.parse.urlunsplit((http, parts.netloc, parts.path.rstrip("/"), "", ""))
        self.ws_url = urllib.parse.urlunsplit((ws, parts.netloc, parts.path.rstrip("/") + "/ws", "", ""))
        self.loopback = parts.hostname in _LOOPBACK
        self.n_problems, self.action, self.timeout_s = n_problems, action, float(timeout_s)
        self.observation_field, self.reset_kwargs = observation_field, dict(reset_kwargs)
        self.reward_range = (low, high)
        self.system_prompt = system_prompt
        schemas = self._get("/schema")
        meta = self._get("/metadata")  # name, description, version; its README is left out of the manifest
        self.server_metadata = (
            {k: v for k, v in meta.items() if k != "readme_content"} if isinstance(meta, dict) else {}
        )
        schema = schemas.get("action") if isinstance(schemas, dict) else None
        if not isinstance(schema, dict):
            raise ValueError(f"--env openenv: {self.http_url}/schema gave no action schema: {str(schemas)[:200]}")
        self.action_schema = schema
        fields = [k for k in (schema.get("properties") or {}) if k != "metadata"]
        self.answer_field = answer_field
        self.tool_name = None
        if action == "answer":
            if tool_name is not None:
                raise ValueError(f"{where} tool_name is for action=tool (this run answers in text: action=answer)")
            if answer_field is None:
                if len(fields) != 1:
                    raise ValueError(
                        f"--env openenv: the action has the fields {', '.join(map(repr, fields))}, so an "
                        "answer cannot fill it by itself: name the text field (--env-option "
                        "answer_field=NAME) or make the action a tool (--env-option action=tool)"
                    )
                self.answer_field = fields[0]
            elif answer_field not in fields:
                raise ValueError(
                    f"{where} answer_field={answer_field!r} is not a field of the action; it has "
                    + ", ".join(map(repr, fields))
                )
            self.tools = []
            self.answer_ends_episode = True
        else:
            if answer_field is not None:
                raise ValueError(
                    f"{where} answer_field is for action=answer (with action=tool a reply without a "
                    "tool call is just a turn)"
                )
            self.tool_name = tool_name or tool_name_of(schema)
            self.tools = [self._tool_spec(schema)]
            self.answer_ends_episode = False
        super().__init__(split_seed)

    def _get(self, path: str) -> Any:
        """``GET`` a JSON route of the server (no proxy for a loopback host)."""
        url = self.http_url + path
        handlers = [urllib.request.ProxyHandler({})] if self.loopback else []
        try:
            with urllib.request.build_opener(*handlers).open(url, timeout=self.timeout_s) as resp:
                return json.loads(resp.read())
        except (OSError, ValueError) as e:  # URLError, HTTPError, timeouts, bad JSON
            raise ValueError(
                f"--env openenv: cannot read {url} ({e}); is an OpenEnv server running there? Serve an "
                "environment with openenv.core.env_server.create_app (e.g. uvicorn my_env.server.app:app "
                "--port 8000) and pass --env-option base_url=http://HOST:PORT"
            ) from None

    def _tool_spec(self, schema: dict) -> dict:
        props = {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}
        params: dict[str, Any] = {"type": "object", "properties": props}
        required = [k for k in schema.get("required") or [] if k != "metadata"]
        if required:
            params["required"] = required
        if "$defs" in schema:
            params["$defs"] = schema["$defs"]
        params["additionalProperties"] = False  # OpenEnv actions forbid extra fields
        doc = str(schema.get("description") or f"Take one action in the {self.server_name} environment.")
        return {"type": "function", "function": {"name": self.tool_name, "description": doc, "parameters": params}}

    @property
    def server_name(self) -> str:
        meta = self.server_metadata if isinstance(self.server_metadata, dict) else {}
        return str(meta.get("name") or "OpenEnv")

    @property
    def label(self) -> str:
        return f"openenv:{self.server_name}:{self.n_problems}"

    def load_splits(self, split_seed: int) -> dict[str, list]:
        from consequence.envs.repair.jsonl import split_by_problem

        tasks = [OpenEnvTask(f"seed-{i}", f"seed-{i}", i) for i in range(self.n_problems)]
        ids = split_by_problem([t.problem_id for t in tasks], seed=split_seed)
        return {s: [t for t in tasks if t.problem_id in ids[s]] for s in SPLITS}

    def make_episode(self, task: OpenEnvTask) -> OpenEnvEpisode:
        return OpenEnvEpisode(self, task)

    def request(self, task: OpenEnvTask) -> str:
        """The opening observation of ``task`` (its session is closed at once)."""
        episode = self.make_episode(task)
        try:
            return episode.reset()[0]
        finally:
            episode.close()

    def describe(self) -> dict[str, Any]:
        return super().describe() | {
            "server": {"base_url": self.base_url, "metadata": self.server_metadata, "action_schema": self.action_schema}
        }

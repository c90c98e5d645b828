"""Demonstrations from a teacher behind an OpenAI-compatible URL (the cold start's third source).

A larger model served by vLLM (``vllm serve MODEL --enable-auto-tool-choice
--tool-call-parser ...``), any OpenAI-compatible endpoint, or ``consequence serve`` plays
episodes of the environment: for each of N train-split task instances
(``env.sample("train", N, seed=draw_seed + 1)``, as the environment's demonstrator) a fresh
episode is reset (seed = the split seed) and the teacher is the policy. Each turn is one
``POST {URL}/chat/completions`` with the conversation so far in the OpenAI chat shape: the
system prompt, the environment's worked examples, the observation as ``user``; the teacher's
assistant turns with their ``tool_calls`` (arguments as JSON strings); each tool result as
``{"role": "tool", "tool_call_id": ..., "content": ...}``; the environment's reply to an answer
as ``user``. ``tools`` are the environment's, plus ``temperature``, ``max_tokens`` and a
``seed`` per call (derived from the draw seed, the episode and the turn: a server that honours
it, as vLLM and ``consequence serve`` do, repeats the run). Each tool call is validated
against the tool specs and run in the episode as the harness does (``rollout/episodes.py``:
an invalid call gets an ``error: ...`` result, an answer-taking environment gets a reply
without a tool call as ``{"answer": text}``); the episode ends when the environment ends it,
after ``max_turns`` calls, or after the harness's tool-call budget.

The transcript then goes through exactly the verification of a file of demonstrations
(``distill/demonstrations.py``): :func:`~consequence.distill.teacher.plan_from_messages`
reads its assistant turns as a plan, and ``distill.teacher.verify_plans`` replays the plan
through a fresh episode of its task in the student's tokens and keeps it only when the
environment's reward verified it. An episode the teacher could not play is counted, never a
crash: ``teacher_http_error`` (an HTTP error status, a broken connection),
``teacher_timeout`` (no reply within the timeout), ``teacher_unparsable_reply`` (not a chat
completion, or a message with neither content nor tool calls), ``teacher_max_tokens`` (a
reply cut at ``max_tokens``: the harness ends such an episode truncated), ``env_error`` (the environment failed while the teacher played). A
malformed tool call (arguments that are not a JSON object) ends the teacher's episode and is
rejected as ``unparsable_tool_call`` by the file check.

Before any work the server is probed (``GET {URL}/models``): an unreachable or non-OpenAI
server is one ``ValueError`` naming the URL. The cost is counted (:class:`TeacherCost`):
episodes attempted, HTTP calls, the prompt and completion tokens the replies' ``usage``
reports (never estimated: calls whose reply has no ``usage`` are counted apart, and a total
is None when no reply reported it), attempts per accepted demonstration, wall seconds.
The HTTP client is the standard library's (``urllib``): proxies from the environment are
used, except for loopback hosts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.client import HTTPException
from typing import Any

from consequence.distill.teacher import DemoSet, plan_from_messages, read_tool_call, verify_plans
from consequence.envs.api import ANSWER_KEY
from consequence.harness.renderer import Renderer
from consequence.harness.tools import call_problem, check_tool_specs
from consequence.reward.judge_client import (  # one HTTP client style
    http_error_text,
    json_headers,
    loopback_aware_opener,
)
from consequence.rollout.episodes import Budgets, opening_messages

__all__ = [
    "DEFAULT_CONCURRENCY",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_MAX_TURNS",
    "DEFAULT_TEMPERATURE",
    "DEFAULT_TIMEOUT_S",
    "TeacherCost",
    "TeacherEndpoint",
    "cost_line",
    "probe_teacher",
    "teacher_base_url",
    "teacher_url_demo_set",
]

# Temperature 1: the teacher's own distribution, filtered by the verifier (rejection sampling
# from the teacher, as the RL loop samples the student); greedy decoding would give every
# copy of one problem (N above the train split) the same demonstration. 0 raises a weak
# teacher's acceptance rate.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_MAX_TOKENS = 1024  # per call: room for a larger model's reasoning before its tool call
DEFAULT_MAX_TURNS = Budgets().max_turns  # the training runs' --max-turns default
DEFAULT_TIMEOUT_S = 120.0
DEFAULT_CONCURRENCY = 4
PROBE_TIMEOUT_S = 30.0
_DETAIL = 200  # characters of a server's error text kept in the log


@dataclass(frozen=True)
class TeacherEndpoint:
    """Where the teacher is and how it is asked (all but the key recorded in ``sft.json``).

    Attributes:
        url: the server's URL, with or without its ``/v1`` (``http://127.0.0.1:8000``).
        model: the model name sent in each request; None: the one ``GET /v1/models`` lists
            (:func:`probe_teacher` fills it in; a server listing several needs it).
        api_key_env: the name of an environment variable holding the API key (sent as
            ``Authorization: Bearer KEY``); None: no key. The key itself is never recorded.
        temperature: sampling temperature of every call.
        max_tokens: tokens per reply (``max_tokens`` of each call).
        max_turns: calls per episode at most.
        timeout_s: seconds a call may wait for the connection and for each read of its reply.
        concurrency: episodes in flight at once (threads).
    """

    url: str
    model: str | None = None
    api_key_env: str | None = None
    temperature: float = DEFAULT_TEMPERATURE
    max_tokens: int = DEFAULT_MAX_TOKENS
    max_turns: int = DEFAULT_MAX_TURNS
    timeout_s: float = DEFAULT_TIMEOUT_S
    concurrency: int = DEFAULT_CONCURRENCY

    def check(self) -> None:
        """Refuse settings out of range and a key variable that is not set.

        Raises:
            ValueError: a bad URL (:func:`teacher_base_url`), a temperature outside [0, 2],
                ``max_tokens`` / ``max_turns`` / ``concurrency`` below 1, a timeout ≤ 0, or
                ``api_key_env`` naming an unset or empty variable.
        """
        teacher_base_url(self.url)
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"--teacher-temperature {self.temperature}: give a number in [0, 2]")
        for option, value in (
            ("--teacher-max-tokens", self.max_tokens),
            ("--teacher-max-turns", self.max_turns),
            ("--teacher-concurrency", self.concurrency),
        ):
            if value < 1:
                raise ValueError(f"{option} {value}: give at least 1")
        if not self.timeout_s > 0:
            raise ValueError(f"--teacher-timeout {self.timeout_s}: give a number of seconds above 0")
        self.api_key()

    def api_key(self) -> str | None:
        """The API key from ``api_key_env`` (None when no variable is named).

        Raises:
            ValueError: the variable is not set, or empty.
        """
        if self.api_key_env is None:
            return None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ValueError(
                f"--teacher-api-key-env {self.api_key_env}: the environment variable {self.api_key_env} is "
                "not set (or empty); export the teacher's API key in it"
            )
        return key

    def as_dict(self) -> dict[str, Any]:
        """The settings as recorded (the key's variable name, never the key)."""
        return dataclasses.asdict(self) | {"url": teacher_base_url(self.url)}


def teacher_base_url(url: str) -> str:
    """The API base of ``url``: ``http(s)://host[:port][/path]/v1`` (``/v1`` added when missing;
    a route given with it, ``.../v1/chat/completions`` or ``.../v1/models``, is dropped).

    Args:
        url: the server's URL, e.g. ``http://127.0.0.1:8000``, ``http://host:8000/v1`` or
            ``http://host:8000/v1/chat/completions``.

    Returns:
        the base the routes ``/models`` and ``/chat/completions`` are appended to.

    Raises:
        ValueError: not an ``http://`` or ``https://`` URL with a host.
    """
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--teacher-url {url}: give an http:// or https:// URL, e.g. http://127.0.0.1:8000/v1")
    base = url.strip().rstrip("/")
    for route in _ROUTES:  # the URL of an endpoint, pasted whole: its base
        if base.endswith(route):
            base = base[: -len(route)].rstrip("/")
            break
    return base if base.endswith("/v1") else base + "/v1"


_ROUTES = ("/chat/completions", "/completions", "/models")  # the routes a base URL is given with by mistake


def _key_refused(teacher: TeacherEndpoint) -> str:
    """What a 401 / 403 reply means and which option sets the key."""
    if teacher.api_key_env is None:
        return (
            "the server refused the request without an API key; export the key in an environment variable "
            "and name that variable with --teacher-api-key-env VAR (sent as a Bearer token)"
        )
    return (
        f"the server refused the API key in the environment variable {teacher.api_key_env} "
        f"(--teacher-api-key-env {teacher.api_key_env}); export the right key in it, or name another "
        "variable with --teacher-api-key-env"
    )


def probe_teacher(teacher: TeacherEndpoint) -> TeacherEndpoint:
    """Check that the teacher answers ``GET {URL}/models``; the endpoint with its model named.

    Args:
        teacher: the endpoint (:meth:`TeacherEndpoint.check` is applied first).

    Returns:
        ``teacher`` with ``model`` set (the one model listed, when it named none).

    Raises:
        ValueError: bad settings; the server cannot be reached, refuses the key, or is not
            OpenAI-compatible (each names the URL and the fix); it lists no model or several
            and ``model`` is None; ``model`` is not among those it lists.
    """
    teacher.check()
    base = teacher_base_url(teacher.url)
    where = f"--teacher-url {teacher.url}: GET {base}/models"
    req = urllib.request.Request(base + "/models", headers=json_headers(teacher.api_key()), method="GET")
    try:
        with loopback_aware_opener(base).open(req, timeout=min(teacher.timeout_s, PROBE_TIMEOUT_S)) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            raise ValueError(f"{where} failed ({http_error_text(e)}): {_key_refused(teacher)}") from None
        fix = "is it an OpenAI-compatible server (vLLM, `consequence serve`)? give its URL, e.g. http://HOST:PORT/v1"
        raise ValueError(f"{where} failed ({http_error_text(e)}); {fix}") from None
    except (urllib.error.URLError, TimeoutError, HTTPException, OSError) as e:
        why = e.reason if isinstance(e, urllib.error.URLError) else e
        raise ValueError(
            f"{where}: the server cannot be reached ({type(why).__name__ if not str(why) else why}); start it "
            "(vLLM: `vllm serve MODEL`, or `consequence serve`) or fix the URL"
        ) from None
    try:
        listed = json.loads(raw)["data"]
        ids = [m["id"] for m in listed]
        if not all(isinstance(i, str) for i in ids):
            raise TypeError("a model id is not a string")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise ValueError(
            f"{where}: the reply is not an OpenAI model list ({type(e).__name__}: {e}); give the URL of an "
            "OpenAI-compatible server (vLLM, `consequence serve`)"
        ) from None
    if teacher.model is not None:
        if ids and teacher.model not in ids:
            raise ValueError(
                f"--teacher-model {teacher.model}: {base} serves {', '.join(map(repr, ids))}; give one of them"
            )
        return teacher
    if len(ids) != 1:
        served = ", ".join(map(repr, ids)) if ids else "no model"
        raise ValueError(f"{where} lists {served}; name the teacher with --teacher-model NAME")
    return dataclasses.replace(teacher, model=ids[0])


@dataclass
class TeacherCost:
    """What the teacher's episodes cost (thread-safe counters, filled by the client).

    Attributes:
        attempts: episodes the teacher was asked to play.
        http_calls: ``POST /chat/completions`` made (failed ones included).
        replies: calls answered with a 2xx status.
        prompt_tokens, completion_tokens: sums of the replies' ``usage`` (None when no reply
            carried it; replies without it are not counted, never estimated).
        calls_without_usage: 2xx replies with no ``usage`` (an unparsable reply included).
        wall_seconds: wall-clock seconds of the teacher's episodes (calls and environment steps).
        replay_seconds: wall-clock seconds of the verification replays in the student's tokens.
    """

    attempts: int = 0
    http_calls: int = 0
    replies: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    calls_without_usage: int = 0
    wall_seconds: float = 0.0
    replay_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count_reply(self, usage: Any) -> None:
        """Count one 2xx reply and its ``usage`` (a dict with integer token counts, or anything else: none)."""
        with self._lock:
            self.replies += 1
            p = usage.get("prompt_tokens") if isinstance(usage, dict) else None
            c = usage.get("completion_tokens") if isinstance(usage, dict) else None
            if not (isinstance(p, int) and isinstance(c, int) and _count(p) and _count(c)):
                self.calls_without_usage += 1
                return
            self.prompt_tokens = (self.prompt_tokens or 0) + p
            self.completion_tokens = (self.completion_tokens or 0) + c

    def count_call(self) -> None:
        """Count one HTTP call."""
        with self._lock:
            self.http_calls += 1

    def record(self, accepted: int) -> dict[str, Any]:
        """The JSON record, with ``attempts_per_accepted`` (= 1 / acceptance rate; None when
        none was accepted) and completion tokens per accepted demonstration.

        Args:
            accepted: demonstrations kept after verification.
        """
        return {
            "attempts": self.attempts,
            "http_calls": self.http_calls,
            "replies": self.replies,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "calls_without_usage": self.calls_without_usage,
            "attempts_per_accepted": round(self.attempts / accepted, 6) if accepted else None,
            "completion_tokens_per_accepted": (
                round(self.completion_tokens / accepted, 3) if accepted and self.completion_tokens is not None else None
            ),
            "wall_seconds": round(self.wall_seconds, 3),
            "replay_seconds": round(self.replay_seconds, 3),
        }


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


class _Failed(Exception):
    """An episode the teacher could not play: ``reason`` (of ``demonstrations.REASONS``) and what happened."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class _Client:
    """``POST /chat/completions`` with the standard library, counted in a :class:`TeacherCost`."""

    def __init__(self, teacher: TeacherEndpoint, cost: TeacherCost):
        self.teacher, self.cost = teacher, cost
        self.url = teacher_base_url(teacher.url) + "/chat/completions"
        self.headers = json_headers(teacher.api_key())
        self.opener = loopback_aware_opener(self.url)

    def chat(self, body: dict[str, Any], turn: int = 0) -> tuple[dict[str, Any], str | None]:
        """One call: the assistant message (OpenAI shape; a call without an id gets
        ``call_TURN_J``) and the finish reason.

        Raises:
            _Failed: ``teacher_http_error``, ``teacher_timeout`` or ``teacher_unparsable_reply``.
        """
        req = urllib.request.Request(self.url, json.dumps(body).encode(), self.headers, method="POST")
        self.cost.count_call()
        try:
            with self.opener.open(req, timeout=self.teacher.timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            refused = f": {_key_refused(self.teacher)}" if e.code in (401, 403) else ""
            raise _Failed("teacher_http_error", http_error_text(e) + refused) from None
        except TimeoutError:
            raise _Failed("teacher_timeout", f"no reply within {self.teacher.timeout_s:g} s") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                raise _Failed("teacher_timeout", f"no reply within {self.teacher.timeout_s:g} s") from None
            raise _Failed("teacher_http_error", f"{type(e.reason).__name__}: {e.reason}") from None
        except (HTTPException, OSError) as e:
            raise _Failed("teacher_http_error", f"{type(e).__name__}: {e}") from None
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            self.cost.count_reply(None)
            text = " ".join(raw.decode("utf-8", "replace").split())
            raise _Failed("teacher_unparsable_reply", f"not JSON: {text[:_DETAIL]!r}") from None
        self.cost.count_reply(obj.get("usage") if isinstance(obj, dict) else None)
        return _message(obj, turn)


def _message(obj: Any, turn: int = 0) -> tuple[dict[str, Any], str | None]:
    """The first choice's assistant message of a chat completion, and its finish reason.

    Raises:
        _Failed: ``teacher_unparsable_reply`` (no ``choices[0].message``, content that is not
            text, ``tool_calls`` that is not a list of objects, a message with neither content
            nor tool calls).
    """
    try:
        choice = obj["choices"][0]
        msg = choice["message"]
        if not isinstance(msg, dict):
            raise TypeError("message is not an object")
    except (KeyError, IndexError, TypeError) as e:
        raise _Failed(
            "teacher_unparsable_reply", f"no choices[0].message ({type(e).__name__}: {e}): {json.dumps(obj)[:_DETAIL]}"
        ) from None
    content = msg.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        content = "".join(str(p.get("text") or "") for p in content)
    if content is not None and not isinstance(content, str):
        raise _Failed("teacher_unparsable_reply", f"the message's content is a {type(content).__name__}, not text")
    calls = msg.get("tool_calls") or []
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise _Failed("teacher_unparsable_reply", f"tool_calls is not a list of objects: {calls!r:.{_DETAIL}}")
    finish = choice.get("finish_reason") if isinstance(choice, dict) else None
    finish = finish if isinstance(finish, str) else None
    if content is None and not calls and finish != "length":  # (a reply cut at max_tokens is counted as such)
        raise _Failed(
            "teacher_unparsable_reply",
            f"the message has neither content nor tool_calls: {json.dumps(msg)[:_DETAIL]}",
        )
    out: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        out["tool_calls"] = [
            {"id": c.get("id") or f"call_{turn}_{j}", "type": c.get("type", "function"), "function": c.get("function")}
            for j, c in enumerate(calls)
        ]
    elif content is None:
        out["content"] = ""
    return out, finish


def _call_seed(draw_seed: int, episode: int, turn: int) -> int:
    return (draw_seed * 1_000_003 + episode * 1_009 + turn) % 2**31


def _play(
    env: Any, task: Any, client: _Client, teacher: TeacherEndpoint, seed: int, draw_seed: int, index: int
) -> list[dict]:
    """One episode of ``task`` with the teacher as the policy; its conversation (OpenAI shape).

    Raises:
        _Failed: the teacher could not play it (a failed or unparsable call, a reply cut at
            ``max_tokens``) or the environment failed (``env_error``).
    """
    specs = check_tool_specs(env.tools)
    max_tool_calls = Budgets().max_tool_calls
    try:
        episode = env.make_episode(task)
        obs, _info = episode.reset(seed=seed)
        if not isinstance(obs, str):
            raise TypeError(f"reset() must return (observation: str, info); the observation is a {type(obs).__name__}")
    except Exception as e:  # the environment's fault: excluded, counted
        raise _Failed("env_error", f"environment reset raised {type(e).__name__}: {e}") from None
    answers = getattr(episode, "answer_ends_episode", env.answer_ends_episode)
    messages = opening_messages(env.system_prompt, obs, env.examples)
    n_tool_calls = 0
    for turn in range(teacher.max_turns):
        body: dict[str, Any] = {
            "model": teacher.model,
            "messages": messages,
            "temperature": teacher.temperature,
            "max_tokens": teacher.max_tokens,
            "seed": _call_seed(draw_seed, index, turn),
        }
        if env.tools:
            body["tools"] = env.tools
        msg, finish = client.chat(body, turn)
        if finish == "length":
            raise _Failed(
                "teacher_max_tokens",
                f"turn {turn + 1}: the reply was cut at max_tokens {teacher.max_tokens} (finish_reason length)",
            )
        messages = messages + [msg]
        actions: list[tuple[str | None, dict]] = []
        for call in msg.get("tool_calls") or []:
            action, error = read_tool_call(call)
            if error or action is None:
                return messages  # plan_from_messages counts it as unparsable_tool_call
            actions.append((call["id"], action))
        results: list[dict] = []
        if not actions:
            if not answers:  # the harness shows an error observation and goes on
                results.append({"role": "user", "content": "error: no tool call; call one of the tools"})
                messages = messages + results
                continue
            actions = [(None, {ANSWER_KEY: msg.get("content") or ""})]
        for call_id, action in actions:
            if call_id is not None:
                n_tool_calls += 1
                problem = call_problem(action, specs)
                if problem:
                    results.append({"role": "tool", "tool_call_id": call_id, "content": f"error: {problem[1]}"})
                    continue
            try:
                obs, _reward, terminated, truncated, info = episode.step(action)
                if not isinstance(obs, str) or not isinstance(info, dict):
                    raise TypeError(
                        "step() must return (observation: str, reward, terminated, truncated, info: dict); "
                        f"got observation {type(obs).__name__}, info {type(info).__name__}"
                    )
            except Exception as e:  # the environment's fault: excluded, counted
                raise _Failed("env_error", f"environment step raised {type(e).__name__}: {e}") from None
            if info.get("env_error"):
                raise _Failed("env_error", str(info["env_error"]))
            results.append(
                {"role": "user", "content": obs}
                if call_id is None
                else {"role": "tool", "tool_call_id": call_id, "content": obs}
            )
            if terminated or truncated:
                return messages + results
        messages = messages + results
        if n_tool_calls >= max_tool_calls:
            break
    return messages


def teacher_url_demo_set(
    env: Any,
    renderer: Renderer,
    teacher: TeacherEndpoint,
    episodes: int,
    seed: int = 0,
    draw_seed: int | None = None,
    log: Callable[[str], None] = print,
) -> DemoSet:
    """The teacher at ``teacher.url`` plays ``episodes`` train tasks; the verified episodes, in
    ``renderer``'s tokens (the module doc gives the episode and the verification).

    Args:
        env: the environment (any: no demonstrator needed).
        renderer: the student's renderer.
        teacher: the endpoint and its settings (probed first: :func:`probe_teacher`).
        episodes: task instances to play, ``env.sample("train", episodes, seed=draw_seed + 1)``.
        seed: the split seed: each episode's reset seed (the teacher's and the replay's).
        draw_seed: which instances (default ``seed``); also seeds the calls' ``seed``.
        log: the counts and the cost.

    Returns:
        the :class:`~consequence.distill.teacher.DemoSet`: ``total`` = ``episodes``; its
        ``source`` holds ``kind`` ``teacher_url``, the settings (no key), the draw seed and
        ``cost`` (:meth:`TeacherCost.record`).

    Raises:
        ValueError: as :func:`probe_teacher` (the server is not there at the start; nothing
            is played), or ``episodes`` < 1. Failed calls later are counted, never raised.
    """
    if episodes < 1:
        raise ValueError(f"give the number of teacher episodes (>= 1), got {episodes}")
    teacher = probe_teacher(teacher)
    d = seed if draw_seed is None else draw_seed
    tasks = env.sample("train", episodes, seed=d + 1)
    cost = TeacherCost(attempts=len(tasks))
    client = _Client(teacher, cost)
    log(
        f"teacher {teacher.model} at {teacher_base_url(teacher.url)}: {len(tasks)} episodes of --env {env.label}, "
        f"{teacher.concurrency} at a time (temperature {teacher.temperature:g}, max_tokens {teacher.max_tokens}, "
        f"max_turns {teacher.max_turns})"
    )

    def play(k: int) -> tuple[list[dict] | None, _Failed | None]:
        try:
            return _play(env, tasks[k], client, teacher, seed, d, k), None
        except _Failed as f:
            return None, f

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=teacher.concurrency, thread_name_prefix="teacher") as pool:
        played = list(pool.map(play, range(len(tasks))))
    cost.wall_seconds = time.perf_counter() - t0
    demos = DemoSet(
        source={
            "kind": "teacher_url",
            "environment": env.label,
            "draw_seed": d,
            **teacher.as_dict(),
        }
    )
    kept_tasks, plans, where = [], [], []
    for k, (task, (messages, failed)) in enumerate(zip(tasks, played)):
        label = f"teacher episode {k} (task {task.task_id})"
        if failed is not None:
            demos.total += 1
            demos.reject(failed.reason, f"{label}: {failed.detail}")
            continue
        plan, problem = plan_from_messages(messages or [], tuple(env.examples))
        if problem is not None or plan is None:
            reason, detail = problem or ("no_actions", "no assistant turn")
            demos.total += 1
            demos.reject(reason, f"{label}: {detail}")
            continue
        kept_tasks.append(task)
        plans.append(plan)
        where.append(label)
    t1 = time.perf_counter()
    verify_plans(env, kept_tasks, plans, renderer, seed, where, demos)
    cost.replay_seconds = time.perf_counter() - t1
    demos.source["cost"] = cost.record(len(demos.kept))
    log(f"teacher at {teacher_base_url(teacher.url)}: {demos.summary()}")
    log(f"teacher cost: {cost_line(demos.source['cost'])}")
    return demos


def cost_line(cost: dict[str, Any]) -> str:
    """One line of a :meth:`TeacherCost.record`: attempts, calls, tokens, attempts per accepted, seconds."""
    if cost["prompt_tokens"] is None:
        tokens = "tokens not reported (no reply carried usage)"
    else:
        tokens = f"{cost['prompt_tokens']} prompt + {cost['completion_tokens']} completion tokens"
        if cost["calls_without_usage"]:
            tokens += f" ({cost['calls_without_usage']} replies without usage not counted)"
    per = cost["attempts_per_accepted"]
    return (
        f"{cost['attempts']} episodes, {cost['http_calls']} HTTP calls, {tokens}, "
        f"{'no demonstration accepted' if per is None else f'{per:g} attempts per accepted demonstration'}, "
        f"{cost['wall_seconds']:.1f} s"
    )

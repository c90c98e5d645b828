"""An LLM judge's HTTP client: ``POST {URL}/chat/completions`` with bounded retries (reward box).

The judge is any OpenAI-compatible server: ``consequence serve``, vLLM
(``vllm serve MODEL``), or a hosted API the user configures. One judgement is one call at
temperature 0 (``seed`` 0 for a server that honours it), whose reply text is returned for the
caller to parse (:mod:`consequence.reward.judge`). The client is the standard library's
(``urllib``), as in ``consequence/distill/teacher_url.py``, whose helpers these mirror (the
reward box, floor 5, cannot import the distillation box, floor 11): proxies from the
environment are used, except for loopback hosts.

A call that fails raises :class:`JudgeFailure` with one of these reasons:

- ``judge_timeout``: no reply within ``timeout_s`` (each attempt);
- ``judge_connection_error``: the connection was refused, reset or broken;
- ``judge_http_error``: an HTTP error status (the server's ``error.message`` kept);
- ``judge_unparsable_reply``: a 2xx reply that is not a chat completion with text content.

Timeouts, connection errors and the statuses 408, 429 and 5xx are transient: the call is
made again, up to ``retries`` more times, after ``backoff_s`` · 2^k seconds before retry
k + 1 (exponential backoff). Any other 4xx (a bad request, a refused key) and an
unparsable reply are not retried: asking again at temperature 0 gets the same answer.

The API key is read from the environment variable ``api_key_env`` at each start (sent as
``Authorization: Bearer KEY``, the OpenAI client's convention); only the variable's name is
ever recorded.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from http.client import HTTPException
from typing import Any

__all__ = [
    "DEFAULT_KEY_ENV",
    "JudgeClient",
    "JudgeEndpoint",
    "JudgeFailure",
    "judge_base_url",
    "probe_judge",
]

DEFAULT_KEY_ENV = "OPENAI_API_KEY"  # the OpenAI client's variable; unset = no key (a local server)
JUDGE_MAX_TOKENS = 512  # room for a short reasoning before the score line
PROBE_TIMEOUT_S = 30.0
_RETRYABLE_STATUS = frozenset({408, 429})  # plus every 5xx
_DETAIL = 200  # characters of a server's error text kept in an error


@dataclass(frozen=True)
class JudgeEndpoint:
    """Where the judge is and how it is asked (``--judge-*`` settings).

    Attributes:
        url: the server's URL, with or without its ``/v1`` (``http://127.0.0.1:8000``).
        model: the model name sent in every request (also in the cache key and the manifest).
        api_key_env: the environment variable holding the API key. Unset: no key is sent when it
            is :data:`DEFAULT_KEY_ENV`; any other name must be set (a user who names a
            variable means to send a key).
        timeout_s: seconds each attempt may wait for the connection and each read of the reply.
        retries: attempts after the first, for transient failures only (module doc).
        concurrency: judgements in flight at once (threads).
        backoff_s: seconds before the first retry; doubled before each further one.
        max_tokens: ``max_tokens`` of each call.
    """

    url: str
    model: str
    api_key_env: str = DEFAULT_KEY_ENV
    timeout_s: float = 60.0
    retries: int = 2
    concurrency: int = 8
    backoff_s: float = 1.0
    max_tokens: int = JUDGE_MAX_TOKENS

    def check(self) -> None:
        """Refuse settings out of range and a named key variable that is not set.

        Raises:
            ValueError: a bad URL (:func:`judge_base_url`), an empty model name, a timeout ≤ 0,
                retries < 0, concurrency or max_tokens < 1, backoff < 0, or ``api_key_env``
                (not the default) naming an unset or empty variable.
        """
        judge_base_url(self.url)
        if not self.model.strip():
            raise ValueError("--judge-model is empty: give the model name the judge's server serves")
        if not self.timeout_s > 0:
            raise ValueError(f"--judge-timeout {self.timeout_s}: give a number of seconds above 0")
        if self.retries < 0:
            raise ValueError(f"--judge-retries {self.retries}: give 0 or more")
        if self.concurrency < 1:
            raise ValueError(f"--judge-concurrency {self.concurrency}: give at least 1")
        if self.backoff_s < 0 or self.max_tokens < 1:
            raise ValueError(f"backoff {self.backoff_s} s, max_tokens {self.max_tokens}: give ≥ 0 s and ≥ 1 token")
        self.api_key()

    def api_key(self) -> str | None:
        """The API key from ``api_key_env``; None when the default variable is unset.

        Raises:
            ValueError: a variable other than the default is unset, or empty.
        """
        key = os.environ.get(self.api_key_env)
        if key:
            return key
        if self.api_key_env == DEFAULT_KEY_ENV:
            return None
        raise ValueError(
            f"--judge-api-key-env {self.api_key_env}: the environment variable {self.api_key_env} is not set "
            "(or empty); export the judge's API key in it"
        )

    def as_dict(self) -> dict[str, Any]:
        """The settings as recorded (the key's variable name, never the key)."""
        return dataclasses.asdict(self) | {"url": judge_base_url(self.url)}


def judge_base_url(url: str) -> str:
    """The API base of ``url``: ``http(s)://host[:port][/path]/v1`` (``/v1`` added when missing;
    a route pasted with it, ``.../v1/chat/completions`` or ``.../v1/models``, dropped).

    Raises:
        ValueError: not an ``http://`` or ``https://`` URL with a host.
    """
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--judge-url {url}: give an http:// or https:// URL, e.g. http://127.0.0.1:8000/v1")
    base = url.strip().rstrip("/")
    for route in ("/chat/completions", "/completions", "/models"):
        if base.endswith(route):
            base = base[: -len(route)].rstrip("/")
            break
    return base if base.endswith("/v1") else base + "/v1"


def loopback_aware_opener(base: str) -> urllib.request.OpenerDirector:
    """urllib's opener: the environment's proxies, but none for a loopback host."""
    host = urllib.parse.urlsplit(base).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    return urllib.request.build_opener(urllib.request.ProxyHandler({})) if loopback else urllib.request.build_opener()


def json_headers(key: str | None) -> dict[str, str]:
    """JSON request headers, with a bearer token when ``key`` is given."""
    return {"Content-Type": "application/json", "Accept": "application/json"} | (
        {"Authorization": f"Bearer {key}"} if key else {}
    )


def http_error_text(e: urllib.error.HTTPError) -> str:
    """``HTTP 500: message`` of an error reply (the OpenAI ``error.message`` when it has one)."""
    try:
        raw = e.read()
    except (OSError, HTTPException):
        raw = b""
    text = raw.decode("utf-8", "replace")
    try:
        obj = json.loads(text)
        err = obj.get("error") if isinstance(obj, dict) else None
        text = str(err.get("message") if isinstance(err, dict) else err or obj.get("detail") or text)
    except (json.JSONDecodeError, AttributeError):
        pass
    text = " ".join(text.split())
    return f"HTTP {e.code}" + (f": {text[:_DETAIL]}" if text else "")


class JudgeFailure(Exception):
    """A judgement that could not be had: ``reason`` (module doc) and what happened."""

    def __init__(self, reason: str, detail: str, retryable: bool = False):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail, self.retryable = reason, detail, retryable


def probe_judge(endpoint: JudgeEndpoint) -> None:
    """Check, before any work, that the judge answers ``GET {URL}/models`` and serves the model.

    Raises:
        ValueError: bad settings (:meth:`JudgeEndpoint.check`); the server cannot be reached,
            refuses the key or is not OpenAI-compatible; it lists models and ``model`` is not
            one of them. Each message names the option and the fix.
    """
    endpoint.check()
    base = judge_base_url(endpoint.url)
    where = f"--judge-url {endpoint.url}: GET {base}/models"
    req = urllib.request.Request(base + "/models", headers=json_headers(endpoint.api_key()), method="GET")
    try:
        with loopback_aware_opener(base).open(req, timeout=min(endpoint.timeout_s, PROBE_TIMEOUT_S)) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        fix = (
            f"export the judge's key in {endpoint.api_key_env} or name its variable with --judge-api-key-env"
            if e.code in (401, 403)
            else "is it an OpenAI-compatible server (vLLM, `consequence serve`)? give its URL, e.g. http://HOST:PORT/v1"
        )
        raise ValueError(f"{where} failed ({http_error_text(e)}); {fix}") from None
    except (urllib.error.URLError, TimeoutError, HTTPException, OSError) as e:
        why = e.reason if isinstance(e, urllib.error.URLError) else e
        raise ValueError(
            f"{where}: the server cannot be reached ({str(why) or type(why).__name__}); start it "
            "(vLLM: `vllm serve MODEL`, or `consequence serve`) or fix --judge-url"
        ) from None
    try:
        ids = [m["id"] for m in json.loads(raw)["data"]]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise ValueError(
            f"{where}: the reply is not an OpenAI model list ({type(e).__name__}: {e}); give the URL of an "
            "OpenAI-compatible server"
        ) from None
    if ids and endpoint.model not in ids:
        raise ValueError(f"--judge-model {endpoint.model}: {base} serves {', '.join(map(repr, ids))}; give one of them")


@dataclass
class _Counts:
    """HTTP requests made and retries taken (thread-safe)."""

    requests: int = 0
    retries: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)


class JudgeClient:
    """``POST /chat/completions`` to the judge, retried as the module doc says.

    Args:
        endpoint: where and how (checked: :meth:`JudgeEndpoint.check`).
        sleep: how a backoff waits (``time.sleep``; a test may record the waits instead).

    Raises:
        ValueError: bad settings.
    """

    def __init__(self, endpoint: JudgeEndpoint, sleep: Callable[[float], None] = time.sleep):
        endpoint.check()
        self.endpoint, self.sleep = endpoint, sleep
        self.url = judge_base_url(endpoint.url) + "/chat/completions"
        self.headers = json_headers(endpoint.api_key())
        self.opener = loopback_aware_opener(self.url)
        self.counts = _Counts()

    def complete(self, messages: list[dict[str, str]]) -> str:
        """The judge's reply text to ``messages`` (temperature 0, ``seed`` 0).

        Raises:
            JudgeFailure: after the last attempt of a transient failure, or at once for the others.
        """
        body = {
            "model": self.endpoint.model,
            "messages": messages,
            "temperature": 0.0,
            "max_tokens": self.endpoint.max_tokens,
            "seed": 0,
        }
        data = json.dumps(body).encode()
        attempts = self.endpoint.retries + 1
        for k in range(attempts):
            try:
                return self._once(data)
            except JudgeFailure as f:
                if not f.retryable or k == attempts - 1:
                    tried = f" (attempt {k + 1} of {attempts})" if f.retryable else ""
                    raise JudgeFailure(f.reason, f.detail + tried) from None
            self.counts.add("retries")
            self.sleep(self.endpoint.backoff_s * 2**k)
        raise AssertionError("unreachable")  # the loop returns or raises

    def _once(self, data: bytes) -> str:
        req = urllib.request.Request(self.url, data, self.headers, method="POST")
        self.counts.add("requests")
        timeout = self.endpoint.timeout_s
        try:
            with self.opener.open(req, timeout=timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            transient = e.code in _RETRYABLE_STATUS or e.code >= 500
            raise JudgeFailure("judge_http_error", http_error_text(e), transient) from None
        except TimeoutError:
            raise JudgeFailure("judge_timeout", f"no reply within {timeout:g} s", True) from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                raise JudgeFailure("judge_timeout", f"no reply within {timeout:g} s", True) from None
            raise JudgeFailure("judge_connection_error", f"{type(e.reason).__name__}: {e.reason}", True) from None
        except (HTTPException, OSError) as e:
            raise JudgeFailure("judge_connection_error", f"{type(e).__name__}: {e}", True) from None
        return _reply_text(raw)


def _reply_text(raw: bytes) -> str:
    """The first choice's text content of a chat completion body.

    Raises:
        JudgeFailure: ``judge_unparsable_reply`` (not JSON, no ``choices[0].message``, content not text).
    """
    try:
        obj = json.loads(raw)
        content = obj["choices"][0]["message"]["content"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, IndexError, TypeError) as e:
        text = " ".join(raw.decode("utf-8", "replace").split())
        raise JudgeFailure(
            "judge_unparsable_reply", f"not a chat completion ({type(e).__name__}): {text[:_DETAIL]!r}"
        ) from None
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        content = "".join(str(p.get("text") or "") for p in content)
    if not isinstance(content, str):
        raise JudgeFailure("judge_unparsable_reply", f"the message's content is {type(content).__name__}, not text")
    return content

"""``GET /metrics``: the endpoint's counters in the Prometheus text format (version 0.0.4).

* ``consequence_requests_total{endpoint, status}``: responses sent, by route and HTTP
  status (counted by :class:`CountResponses`, so a 413 refused before any route ran counts);
* ``consequence_batch_size``: a histogram of the requests per ``generate`` call;
* ``consequence_queue_length``, ``consequence_requests_in_flight``: requests waiting for a
  batch, requests being sampled;
* ``consequence_sessions_open``: the sessions held (``serve.sessions``);
* ``consequence_generated_tokens_total`` and ``consequence_generated_tokens_per_second``
  (sampled tokens over the last 60 s).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKENS_WINDOW_S = 60.0
# Routes by name, so a session id never becomes a label value (bounded cardinality).
_ROUTES = (
    (re.compile(r"^(/s/[^/]+)?/v1/chat/completions$"), "chat_completions"),
    (re.compile(r"^(/s/[^/]+)?/v1/completions$"), "completions"),
    (re.compile(r"^(/s/[^/]+)?/v1/responses$"), "responses"),
    (re.compile(r"^(/s/[^/]+)?/v1/models(/.*)?$"), "models"),
    (re.compile(r"^/s/[^/]+(/record)?$"), "session"),
    (re.compile(r"^/health$"), "health"),
    (re.compile(r"^/metrics$"), "metrics"),
)


def route(path: str) -> str:
    """The route name of a request path (``other`` for any path not served)."""
    return next((name for pattern, name in _ROUTES if pattern.match(path)), "other")


class Responses:
    """Responses sent, by (route, status); thread-safe."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()

    def add(self, path: str, status: int) -> None:
        """Count one response to ``path`` with ``status``."""
        key = (route(path), status)
        with self._lock:
            self.counts[key] = self.counts.get(key, 0) + 1


Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]


class CountResponses:
    """ASGI middleware: counts every HTTP response's status into ``responses``."""

    def __init__(self, app: ASGIApp, responses: Responses):
        self.app, self.responses = app, responses

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counted(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.responses.add(scope["path"], int(message["status"]))
            await send(message)

        await self.app(scope, receive, counted)


def render(responses: Responses, stats, queued: int, in_flight: int, sessions: int) -> str:
    """The Prometheus text of the counters.

    Args:
        responses: the responses by route and status.
        stats: the batcher's ``BatchStats`` (batches by size, tokens, recent batches).
        queued, in_flight: requests waiting for a batch / being sampled.
        sessions: open sessions.
    """
    out = [
        "# HELP consequence_requests_total HTTP responses sent, by route and status.",
        "# TYPE consequence_requests_total counter",
    ]
    for (name, status), n in sorted(dict(responses.counts).items()):
        out.append(f'consequence_requests_total{{endpoint="{name}",status="{status}"}} {n}')
    out += _histogram(dict(stats.sizes))
    out += [
        "# HELP consequence_queue_length Requests waiting for a batch.",
        "# TYPE consequence_queue_length gauge",
        f"consequence_queue_length {queued}",
        "# HELP consequence_requests_in_flight Requests being sampled.",
        "# TYPE consequence_requests_in_flight gauge",
        f"consequence_requests_in_flight {in_flight}",
        "# HELP consequence_sessions_open Sessions held (recorded calls, cached K/V).",
        "# TYPE consequence_sessions_open gauge",
        f"consequence_sessions_open {sessions}",
        "# HELP consequence_generated_tokens_total Tokens sampled.",
        "# TYPE consequence_generated_tokens_total counter",
        f"consequence_generated_tokens_total {stats.tokens}",
        f"# HELP consequence_generated_tokens_per_second Tokens sampled per second over the last {TOKENS_WINDOW_S:g} s.",
        "# TYPE consequence_generated_tokens_per_second gauge",
        f"consequence_generated_tokens_per_second {stats.tokens_per_s(TOKENS_WINDOW_S):.6g}",
    ]
    return "\n".join(out) + "\n"


def _histogram(sizes: dict[int, int]) -> list[str]:
    """``consequence_batch_size`` as a Prometheus histogram (cumulative ``le`` buckets)."""
    out = [
        "# HELP consequence_batch_size Requests per generate call.",
        "# TYPE consequence_batch_size histogram",
    ]
    for le in BATCH_BUCKETS:
        out.append(f'consequence_batch_size_bucket{{le="{le}"}} {sum(n for s, n in sizes.items() if s <= le)}')
    total = sum(sizes.values())
    out.append(f'consequence_batch_size_bucket{{le="+Inf"}} {total}')
    out.append(f"consequence_batch_size_sum {sum(s * n for s, n in sizes.items())}")
    out.append(f"consequence_batch_size_count {total}")
    return out

"""The FastAPI application of ``consequence serve`` and the uvicorn server that runs it.

Routes (each also under ``/s/{session}/``, which puts the call in that session; a
``X-Session-Id`` header does the same on the plain routes; a call without either is
served but not recorded):

* ``GET /v1/models``: the served names (``--served-model-name``); ``GET /v1/models/{id}``
  one of them (an OpenAI-shaped 404 for any other);
* ``POST /v1/chat/completions``: the OpenAI chat-completions call (``serve.protocol``);
  ``POST /v1/completions``: a text or token-id prompt (``serve.completions``);
  ``POST /v1/responses``: the OpenAI Responses call (``serve.responses``); all three
  sampled by the batcher (``serve.batcher``) with the current policy, recorded by the
  session (``serve.sessions``), their fields sorted by ``serve.compat`` (``serve.calls``);
* ``GET /s/{session}/record``: the session's trajectory as plain data (every call's
  context ids, sampled ids, sampler log-probs), its ``prefix_breaks`` and their reasons (``breaks``);
  ``DELETE /s/{session}`` returns it once more and forgets the session;
* ``GET /health``: queue length, requests being sampled, batch counters, open sessions;
  ``GET /metrics``: the same and more in the Prometheus text format (``serve.metrics``).

Errors are OpenAI-shaped JSON (``{"error": {...}}``) with a 4xx status; every 4xx is
logged with its reason (logger ``consequence.serve``, level INFO). A body over
``max_body_bytes`` is a 413 before it is parsed (``serve.limits``). Sessions without an
episode unused for ``session_ttl_s`` seconds are forgotten. On shutdown (SIGTERM, SIGINT,
:meth:`BackgroundServer.stop`) uvicorn stops accepting connections, waits for the
requests in flight, then the batcher stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from consequence.harness.renderer import Renderer
from consequence.serve import calls, compat, metrics
from consequence.serve.batcher import Batcher
from consequence.serve.limits import DEFAULT_MAX_BODY_BYTES, BodyLimit
from consequence.serve.protocol import ServeError, bad
from consequence.serve.sessions import SessionStore

SESSION_HEADER = "x-session-id"
# A session id becomes part of URLs and file names downstream: a safe charset, bounded.
SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
log = logging.getLogger("consequence.serve")
MAX_RENDERERS = 256  # renderers kept for the tool sets and template variables requests give


@dataclass
class ServeSettings:
    """What the server samples with when a request does not say.

    Attributes:
        model_name: the name ``/v1/models`` lists first and responses carry by default.
        max_context: the model's context length (``max_position_embeddings``).
        temperature, top_p, top_k: defaults (a request's ``temperature`` / ``top_p`` / ``top_k`` win).
        max_tokens: default tokens per reply (capped by the context left).
        seed: seed of the shared sampling generator.
        max_batch, wait_s: the batcher's settings.
        aliases: further names requests may give (``--served-model-name`` given several
            times; a registered model's folder name).
        max_body_bytes: the largest request body (413 above it).
        session_ttl_s: a session without an episode unused this long is forgotten (0: never).
    """

    model_name: str
    max_context: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    seed: int = 0
    max_batch: int = 64
    wait_s: float = 0.005
    aliases: tuple[str, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    session_ttl_s: float = 0.0

    def served_names(self) -> list[str]:
        """Every name a request may give, ``model_name`` first."""
        return [self.model_name] + [a for a in self.aliases if a != self.model_name]


@dataclass
class ServeState:
    """The server's state: settings, the base renderer, the batcher and the sessions (and
    ``kept_responses``: the conversations of the ``/v1/responses`` calls made outside a
    session, for ``previous_response_id``, the last ``serve.responses.MAX_KEPT``)."""

    settings: ServeSettings
    renderer: Renderer
    batcher: Batcher
    sessions: SessionStore = field(default_factory=SessionStore)
    renderers: dict[str, Renderer] = field(default_factory=dict)
    renderers_lock: threading.Lock = field(default_factory=threading.Lock)
    responses: metrics.Responses = field(default_factory=metrics.Responses)
    kept_responses: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        tok = self.renderer.tokenizer
        # the template fields of serve.compat this model's template reads (others are ignored)
        self.template_reads = compat.template_reads(getattr(tok, "chat_template", None))
        # the most characters one token covers (serve.calls refuses over-long text before tokenising)
        self.max_token_chars = max(1, max((len(t) for t in tok.get_vocab()), default=1))

    def renderer_for(self, tools: list[dict], template_kwargs: dict[str, Any] | None = None) -> Renderer:
        """The renderer of a request's tools and chat-template variables (the base one for the
        same tools and none), cached.

        Raises:
            ServeError: 400 when the model's chat template cannot show these tools, or fails
                with these variables.
        """
        key = json.dumps([tools, template_kwargs or {}], sort_keys=True)
        if not template_kwargs and json.dumps(tools, sort_keys=True) == json.dumps(self.renderer.tools, sort_keys=True):
            return self.renderer
        with self.renderers_lock:  # called from worker threads
            cached = self.renderers.get(key)
        if cached is not None:
            return cached
        fmt = "auto" if self.renderer.tool_format == "none" else self.renderer.tool_format
        try:
            renderer = Renderer(self.renderer.tokenizer, tools, self.renderer.end_of_turn, fmt, template_kwargs)
            if template_kwargs:  # a template that fails on these variables fails here, not mid-call
                renderer.render_text([{"role": "user", "content": "probe"}], add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001  (the chat template failing on these tools is the request's fault)
            param = "chat_template_kwargs" if template_kwargs else "tools"
            what = "chat_template_kwargs" if template_kwargs else "tool schema"
            raise bad(
                f"bad {what} for this model: {type(e).__name__}: {e}",
                param,
                "invalid_value" if template_kwargs else "invalid_tools",
            ) from None
        with self.renderers_lock:
            if len(self.renderers) >= MAX_RENDERERS:  # distinct tools / variables per request: keep the newest
                del self.renderers[next(iter(self.renderers))]
            self.renderers[key] = renderer
        return renderer


def check_session_id(sid: str) -> None:
    """Refuse a session id outside ``[A-Za-z0-9][A-Za-z0-9._-]{0,127}``.

    Raises:
        ServeError: 400 ``invalid_session_id``.
    """
    if not SESSION_ID.fullmatch(sid):
        raise bad(
            f"session id {sid[:40]!r} is not allowed: use 1 to 128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit",
            "session",
            "invalid_session_id",
        )


def model_context_length(model) -> int:
    """The model's context length (``config.max_position_embeddings``; 2**31 when not declared)."""
    return int(getattr(getattr(model, "config", None), "max_position_embeddings", None) or 2**31)


def create_app(model, renderer: Renderer, settings: ServeSettings) -> FastAPI:
    """The application serving ``model`` (eval mode, no gradients) through ``renderer``.

    The returned app's ``state.serve`` is the :class:`ServeState` (sessions, batcher).
    """
    state = ServeState(
        settings, renderer, Batcher(model, renderer.stop_ids, settings.seed, settings.max_batch, settings.wait_s)
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.batcher.start()
        sweeper = asyncio.get_running_loop().create_task(_expire_sessions(state))
        yield
        sweeper.cancel()
        await state.batcher.stop()

    app = FastAPI(title="consequence serve", lifespan=lifespan)
    app.state.serve = state
    _errors(app)
    # outermost first: every response counted (the 413s too), then the body limit
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(metrics.CountResponses, responses=state.responses)

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "consequence"}

    @app.get("/v1/models")
    @app.get("/s/{session}/v1/models")
    async def models(session: str | None = None) -> dict[str, Any]:
        return {"object": "list", "data": [model_card(n) for n in settings.served_names()]}

    @app.get("/v1/models/{model:path}")
    @app.get("/s/{session}/v1/models/{model:path}")
    async def one_model(model: str, session: str | None = None) -> dict[str, Any]:
        if model not in settings.served_names():
            raise ServeError(
                404,
                f"the model {model!r} does not exist; this server serves "
                f"{', '.join(map(repr, settings.served_names()))}",
                "model",
                "model_not_found",
            )
        return model_card(model)

    for path, endpoint in (
        ("chat/completions", compat.CHAT),
        ("responses", compat.RESPONSES),
        ("completions", compat.COMPLETIONS),
    ):
        _post_routes(app, state, path, endpoint)

    @app.get("/s/{session}/record")
    async def record(session: str) -> dict[str, Any]:
        s = state.sessions.get(session, create=False)
        if s is None:
            raise ServeError(
                404,
                f"no session {session!r}; sessions: {', '.join(state.sessions.ids()) or 'none'}",
                None,
                "session_not_found",
            )
        return s.record_dict()

    @app.delete("/s/{session}")
    async def close(session: str) -> dict[str, Any]:
        """Forget a session (its record and its K/V); its record is returned one last time."""
        s = state.sessions.pop(session)
        if s is None:
            raise ServeError(404, f"no session {session!r}", None, "session_not_found")
        state.batcher.forget([session])
        return s.record_dict()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        b = state.batcher
        return {
            "queued": b.queued,
            "in_flight": b.in_flight,
            "batches": b.stats.batches,
            "requests": b.stats.requests,
            "largest_batch": b.stats.largest,
            "dropped": b.stats.dropped,
            "sessions": len(state.sessions.ids()),
            "generated_tokens": b.stats.tokens,
        }

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        b = state.batcher
        text = metrics.render(state.responses, b.stats, b.queued, b.in_flight, len(state.sessions.ids()))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


def _post_routes(app: FastAPI, state: ServeState, path: str, endpoint: str) -> None:
    """``POST /v1/{path}`` (its session from ``X-Session-Id``) and ``POST /s/{session}/v1/{path}``."""

    async def plain(request: Request):
        return await _call(state, request, request.headers.get(SESSION_HEADER), endpoint)

    async def in_session(session: str, request: Request):
        return await _call(state, request, session, endpoint)

    app.add_api_route(f"/v1/{path}", plain, methods=["POST"], name=f"{endpoint}_plain")
    app.add_api_route(f"/s/{{session}}/v1/{path}", in_session, methods=["POST"], name=f"{endpoint}_session")


async def _call(state: ServeState, request: Request, sid: str | None, endpoint: str):
    if sid is not None:
        check_session_id(sid)
    return await calls.handle(state, request, sid, endpoint)


async def _expire_sessions(state: ServeState) -> None:
    """Forget idle sessions every quarter of ``session_ttl_s`` (at most every minute; never when 0)."""
    ttl = state.settings.session_ttl_s
    if ttl <= 0:
        return
    while True:
        await asyncio.sleep(min(60.0, max(ttl / 4, 0.05)))
        gone = state.sessions.expire(ttl)
        if gone:
            state.batcher.forget(gone)
            log.info("forgot %d session(s) idle for %g s (--session-ttl): %s", len(gone), ttl, ", ".join(gone[:10]))


def _errors(app: FastAPI) -> None:
    @app.exception_handler(ServeError)
    async def serve_error(request: Request, e: ServeError):
        return _error_response(request, e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        code = "not_found" if e.status_code == 404 else None
        return _error_response(request, ServeError(e.status_code, str(e.detail), None, code))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):  # a bug of ours: still JSON, with what failed
        log.exception("%s %s -> 500", request.method, request.url.path)
        return _error_response(
            request, ServeError(500, f"internal error: {type(e).__name__}: {e}", None, "internal_error")
        )

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        return _error_response(request, bad(f"bad request: {e.errors()}"))


def _error_response(request: Request, e: ServeError) -> JSONResponse:
    """The OpenAI-shaped error response; a 4xx is logged with its reason (INFO: a client's mistake)."""
    if 400 <= e.status < 500:
        log.info(
            "%s %s -> %d %s (param %s): %s", request.method, request.url.path, e.status, e.code, e.param, e.message
        )
    return JSONResponse(e.body(), status_code=e.status)


# ---- the server ----------------------------------------------------------------------
class BackgroundServer:
    """uvicorn serving an app on a loopback port in a background thread (the agent-runner, tests).

    Args:
        app: the FastAPI app.
        host: the address to bind (loopback by default).
        port: 0 picks a free port (:attr:`port` holds the one bound).

    Raises:
        RuntimeError: from :meth:`start`, the server did not start within ``timeout_s``.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.app, self.host = app, host
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, name="consequence-serve", daemon=True)
        self.port = port

    def start(self, timeout_s: float = 30.0) -> BackgroundServer:
        """Start serving; returns once the port is bound (:attr:`port` is then the real one)."""
        # Signals belong to the main thread: uvicorn installs its handlers only there (Server.capture_signals).
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"the endpoint on {self.host}:{self.port} did not start (port in use?)")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        """``http://host:port`` of the running server."""
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        """Stop accepting, finish the requests in flight, stop the batcher; wait for the thread."""
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

"""The FastAPI application of ``consequence serve`` and the uvicorn server that runs it.

Routes (each also under ``/s/{session}/``, which puts the call in that session; a
``X-Session-Id`` header does the same on the plain routes; a call without either is
served but not recorded):

* ``GET /v1/models``: the one model served;
* ``POST /v1/chat/completions``: the OpenAI chat-completions call (``serve.protocol``),
  sampled by the batcher (``serve.batcher``) with the current policy, recorded by the
  session (``serve.sessions``);
* ``GET /s/{session}/record``: the session's trajectory as plain data (every call's
  context ids, sampled ids, sampler log-probs), its ``prefix_breaks`` and their reasons (``breaks``);
  ``DELETE /s/{session}`` returns it once more and forgets the session;
* ``GET /health``: queue length, requests being sampled, batch counters, open sessions.

Errors are OpenAI-shaped JSON (``{"error": {...}}``) with a 4xx status. On shutdown
(SIGTERM, SIGINT, :meth:`BackgroundServer.stop`) uvicorn stops accepting connections,
waits for the requests in flight, then the batcher stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from consequence.harness.renderer import ParsedTurn, Renderer
from consequence.policy.sampler import Sample, SamplingParams
from consequence.serve.batcher import Batcher
from consequence.serve.protocol import ChatRequest, Choice, ServeError, bad, completion, parse_request, stream_chunks
from consequence.serve.sessions import Session, SessionStore

SESSION_HEADER = "x-session-id"
# A session id becomes part of URLs and file names downstream: a safe charset, bounded.
SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
DISCONNECT_POLL_S = 0.05


@dataclass
class ServeSettings:
    """What the server samples with when a request does not say.

    Attributes:
        model_name: the name ``/v1/models`` lists and requests must give.
        temperature, top_p, top_k: defaults (a request's ``temperature`` / ``top_p`` win).
        max_tokens: default tokens per reply (capped by the context left).
        max_context: the model's context length (``max_position_embeddings``).
        seed: seed of the shared sampling generator.
        max_batch, wait_s: the batcher's settings.
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


@dataclass
class ServeState:
    """The server's state: settings, the base renderer, the batcher and the sessions."""

    settings: ServeSettings
    renderer: Renderer
    batcher: Batcher
    sessions: SessionStore = field(default_factory=SessionStore)
    renderers: dict[str, Renderer] = field(default_factory=dict)

    def renderer_for(self, tools: list[dict]) -> Renderer:
        """The renderer of a request's tools (the base one for the same tools), cached.

        Raises:
            ServeError: 400 when the model's chat template cannot show these tools.
        """
        key = json.dumps(tools, sort_keys=True)
        if key == json.dumps(self.renderer.tools, sort_keys=True):
            return self.renderer
        if key not in self.renderers:
            try:
                fmt = "auto" if self.renderer.tool_format == "none" else self.renderer.tool_format
                self.renderers[key] = Renderer(self.renderer.tokenizer, tools, self.renderer.end_of_turn, fmt)
            except Exception as e:  # noqa: BLE001  (the chat template failing on these tools is the request's fault)
                raise bad(
                    f"bad tool schema for this model: {type(e).__name__}: {e}", "tools", "invalid_tools"
                ) from None
        return self.renderers[key]


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
        yield
        await state.batcher.stop()

    app = FastAPI(title="consequence serve", lifespan=lifespan)
    app.state.serve = state
    _errors(app)

    @app.get("/v1/models")
    @app.get("/s/{session}/v1/models")
    async def models(session: str | None = None) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": settings.model_name, "object": "model", "created": 0, "owned_by": "consequence"}],
        }

    @app.post("/v1/chat/completions")
    async def chat_plain(request: Request):
        return await _chat(state, request, request.headers.get(SESSION_HEADER))

    @app.post("/s/{session}/v1/chat/completions")
    async def chat_session(session: str, request: Request):
        return await _chat(state, request, session)

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
        }

    return app


def _errors(app: FastAPI) -> None:
    @app.exception_handler(ServeError)
    async def serve_error(_request: Request, e: ServeError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, e: StarletteHTTPException):
        return JSONResponse(
            ServeError(e.status_code, str(e.detail), None, "not_found" if e.status_code == 404 else None).body(),
            status_code=e.status_code,
        )

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, e: Exception):  # a bug of ours: still JSON, with what failed
        return JSONResponse(
            ServeError(500, f"internal error: {type(e).__name__}: {e}", None, "internal_error").body(), status_code=500
        )

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, e: RequestValidationError):
        return JSONResponse(bad(f"bad request: {e.errors()}").body(), status_code=400)


async def _chat(state: ServeState, request: Request, sid: str | None):
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise bad("the request body is not valid JSON") from None
    req = parse_request(body, state.settings.model_name)
    if sid is not None:
        check_session_id(sid)
    renderer = state.renderer_for(req.tools)
    session = state.sessions.get(sid) if sid else None
    if session is None:
        context = renderer.prompt_ids(req.messages)
        sampled, _left = await _sample(state, request, renderer, req, context, _params(state, req, len(context)), None)
        choices = [choice for choice, _s, _p in sampled]
    else:
        async with session.lock:
            context, choices = await _session_call(state, request, session, renderer, req)
    full = completion(
        req,
        choices,
        [[f"call_{uuid.uuid4().hex[:24]}" for _ in (c.message.get("tool_calls") or [])] for c in choices],
        context,
    )
    if not req.stream:
        return full
    lines = [f"data: {json.dumps(c)}\n\n" for c in stream_chunks(full, req)] + ["data: [DONE]\n\n"]
    return StreamingResponse(iter(lines), media_type="text/event-stream")


async def _session_call(
    state: ServeState, request: Request, session: Session, renderer: Renderer, req: ChatRequest
) -> tuple[list[int], list[Choice]]:
    """Build the context by the prefix rule, apply the bound episode's budgets, sample, record.

    A reply whose client left while it was being sampled is recorded too (it was sampled
    from the policy; dropping it would keep only the replies that came back in time), then
    the call ends with 499; the session's next call that does not continue it is a counted
    prefix break (``serve.sessions``).
    """
    ep = session.episode
    if ep is not None:
        params = ep.params_for(req)
        ep.before_context()
    context = session.context_for(req.messages, renderer)
    if ep is not None:
        ep.before_sample(context.ids)
    else:
        params = _params(state, req, len(context.ids))
    _check_context(state, len(context.ids), params.max_new_tokens)
    answers = True if ep is None else ep.answers
    sampled, left = await _sample(state, request, renderer, req, context.ids, params, session.id, answers)
    for _choice, sample, parsed in sampled:
        session.record(req.messages, context, sample, parsed)
        if ep is not None:
            ep.after_call(sample.stop_reason)
    if left:
        raise ServeError(499, "the client closed the connection")
    return context.ids, [choice for choice, _s, _p in sampled]


def _params(state: ServeState, req: ChatRequest, n_context: int) -> SamplingParams:
    """The sampling settings of a request outside an episode (the server's defaults where it says nothing)."""
    s = state.settings
    room = s.max_context - n_context
    if req.max_tokens is None and room < 1:
        _check_context(state, n_context, 1)
    max_new = req.max_tokens if req.max_tokens is not None else min(s.max_tokens, room)
    _check_context(state, n_context, max_new)
    temperature = s.temperature if req.temperature is None else req.temperature
    top_p = s.top_p if req.top_p is None else req.top_p
    return SamplingParams(temperature, s.top_k if temperature > 0 else 0, top_p, max_new)


def _check_context(state: ServeState, n_context: int, max_new: int) -> None:
    limit = state.settings.max_context
    if n_context + max_new > limit:
        raise bad(
            f"this model's maximum context length is {limit} tokens; the messages take {n_context} tokens and "
            f"the reply may take {max_new} (max_tokens): shorten the messages or lower max_tokens",
            "messages",
            "context_length_exceeded",
        )


async def _sample(
    state: ServeState,
    request: Request,
    renderer: Renderer,
    req: ChatRequest,
    context: list[int],
    params: SamplingParams,
    key: str | None,
    answers: bool = True,
) -> tuple[list[tuple[Choice, Sample, ParsedTurn]], bool]:
    """Sample ``req.n`` choices for ``context``: per choice the reply, its sample and its parse
    (for the recorder), and whether the client left while they were sampled.

    A client that leaves before sampling began cancels the request (499). One that leaves
    during sampling: the batch finishes anyway; a session call (``key``) waits for its
    samples, so the recorder keeps them, and returns with ``left`` true; a call without a
    session is cancelled (499; nothing is recorded).

    Raises:
        ServeError: 499 the client disconnected; 503 the server is shutting down.
    """
    try:
        job = state.batcher.submit([context] * req.n, params, key, req.seed)
    except RuntimeError as e:
        raise ServeError(503, str(e), None, "shutting_down") from None
    waiting = asyncio.ensure_future(job.result())
    left = False
    while not waiting.done():
        await asyncio.wait({waiting}, timeout=DISCONNECT_POLL_S)
        if not waiting.done() and not left and await request.is_disconnected():
            if key is None or not job.started:
                job.cancel()
                waiting.cancel()
                raise ServeError(499, "the client closed the connection")
            left = True  # sampled already: wait for it, so it is recorded
    try:
        samples = waiting.result()
    except RuntimeError as e:
        raise ServeError(503, str(e), None, "shutting_down") from None
    out = []
    parser = renderer if req.parse_tools else state.renderer_for([])
    tok = renderer.tokenizer
    for s in samples:
        s, cut = _cut_at_stop(s, req.stop, tok)
        parsed = parser.parse(s.output_ids, s.stop_reason, answers=answers)
        if cut:
            parsed.message = _without_stop_text(parsed.message, req.stop)
        finish = "length" if s.stop_reason == "length" else ("tool_calls" if parsed.tool_calls else "stop")
        ch = Choice(
            parsed.message,
            finish,
            list(s.output_ids),
            list(s.logprobs),
            [tok.decode([i], skip_special_tokens=False) for i in s.output_ids],
        )
        out.append((ch, s, parsed))
    return out, left


def _cut_at_stop(sample: Sample, stops: list[str], tokenizer) -> tuple[Sample, bool]:
    """The sample up to and including the first token whose text completes a stop string
    (``stop_reason`` ``stop``) and ``True``; unchanged and ``False`` when none occurs. The
    ids after it were sampled but are not part of the reply, so they are not recorded either."""
    if not stops:
        return sample, False
    for k in range(1, len(sample.output_ids) + 1):
        text = tokenizer.decode(sample.output_ids[:k], skip_special_tokens=False)
        if any(s in text for s in stops):
            keep = None if sample.keep_ids is None else sample.keep_ids[:k]
            return Sample(sample.output_ids[:k], sample.logprobs[:k], "stop", keep), True
    return sample, False


def _without_stop_text(message: dict[str, Any], stops: list[str]) -> dict[str, Any]:
    """The reply's content up to the first stop string, as OpenAI returns it. The ids stay
    as sampled (the training record), so ``token_ids`` include the stop text and may run
    past it within the token that completed it; the recorded message is this cut one, so
    an agent that sends the reply back continues the row."""
    content = message.get("content") or ""
    at = min((content.find(s) for s in stops if s in content), default=-1)
    return message if at < 0 else message | {"content": content[:at]}


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

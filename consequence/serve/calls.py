"""One call of ``/v1/chat/completions``, ``/v1/completions`` or ``/v1/responses``, from the body to the response.

A ``/v1/responses`` call is a chat call once checked (``serve.responses`` turns its items
into chat messages): the same context, sampling and record; only its response object and
its stream's events differ.

1. **Prepare** (in a worker thread, so a large body never stalls the event loop): decode
   the JSON, check the request (``serve.protocol``, ``serve.completions``, the field rules
   of ``serve.compat``), pick the renderer of its tools and template variables.
2. **Begin** (under the session's lock): the context ids (the prefix rule of
   ``serve.sessions``, or the prompt's ids; tokenised in a worker thread), the sampling
   settings (the bound episode's, or the request's over the server's defaults), the
   budgets and the context length; then the request is queued in the batcher.
3. **Finish**: wait for the samples, cut them at stop strings, parse them, record each in
   the session, and answer, whole or as server-sent events token by token
   (``serve.streaming``). A streamed call is finished by a task of its own, so its reply
   is recorded even when the client leaves mid-stream.

A session is entered before the call begins and left when it ends
(``SessionStore.enter`` / ``leave``): a call refused or abandoned before anything was
recorded leaves no session behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from consequence.harness.renderer import ParsedTurn, Renderer
from consequence.policy.constrained import Grammar
from consequence.policy.sampler import Sample, SamplingParams
from consequence.serve import compat, responses, streaming, structured
from consequence.serve.batcher import Job
from consequence.serve.completions import (
    DEFAULT_MAX_TOKENS,
    CompletionRequest,
    parse_completion_request,
    text_completion,
)
from consequence.serve.protocol import ChatRequest, Choice, ServeError, bad, completion, parse_request
from consequence.serve.responses import ResponsesRequest, parse_responses_request
from consequence.serve.sessions import CallContext, Session

if TYPE_CHECKING:
    from consequence.serve.app import ServeState

DISCONNECT_POLL_S = 0.05
log = logging.getLogger("consequence.serve")
_RUNNING: set[asyncio.Task] = set()  # streamed calls being finished (a strong reference each)


@dataclass
class Call:
    """One request on its way through :func:`handle`.

    Attributes:
        req: the checked request.
        renderer: renders the prompt (chat: of its tools and template variables) and decodes.
        parser: parses the replies (chat), ``None`` for plain text (completions).
        session: the session the call is recorded in, else ``None``.
        context: the context ids and how they extend the session (:meth:`Session.context_for`).
        job: the queued requests of its choices.
        tokens: the sampled ids of streamed choices, ``(choice, id)``; ``None`` at the end.
        kept: where a ``/v1/responses`` call's conversation is kept for ``previous_response_id``
            (its session's, else the server's), ``None`` for the other endpoints.
        grammar: the grammar its choices are sampled under (``serve.structured``), ``None``
            for free text.
    """

    req: ChatRequest | CompletionRequest
    renderer: Renderer
    parser: Renderer | None
    session: Session | None = None
    context: CallContext | None = None
    job: Job | None = None
    tokens: asyncio.Queue | None = None
    kept: dict[str, list[dict[str, Any]]] | None = None
    grammar: Grammar | None = None

    @property
    def chat(self) -> bool:
        return isinstance(self.req, ChatRequest)

    def streams_text(self) -> bool:
        """Its choices are streamed token by token (plain text: no tool calls to parse)."""
        return self.req.stream and (self.parser is None or not self.parser.tools)


async def handle(state: ServeState, request: Request, sid: str | None, endpoint: str):
    """Serve one call of ``endpoint`` (``compat.CHAT``, ``compat.COMPLETIONS`` or
    ``compat.RESPONSES``) in session ``sid``.

    Raises:
        ServeError: an OpenAI-shaped 4xx (the request), 499 (the client left), 503 (shutting down).
    """
    raw = await request.body()
    call = await asyncio.to_thread(prepare, state, raw, endpoint, sid)
    if call.req.ignored:
        log.info("%s: ignored field(s) %s (they cannot change what is sampled)", request.url.path, _names(call))
    call.session = state.sessions.enter(sid) if sid else None
    if isinstance(call.req, ResponsesRequest):
        call.kept = call.session.responses if call.session is not None else state.kept_responses
    if call.req.stream:
        return await _stream(state, call)
    try:
        lock = call.session.lock if call.session is not None else contextlib.nullcontext()
        async with lock:
            await begin(state, call)
            choices = await finish(state, call, request)
    finally:
        if call.session is not None:
            state.sessions.leave(call.session)
    return JSONResponse(respond(call, choices), headers=ignored_header(call))


def ignored_header(call: Call) -> dict[str, str]:
    """The ``x-consequence-ignored-fields`` header naming the request's ignored fields (none: no header)."""
    return {compat.IGNORED_HEADER: _names(call)} if call.req.ignored else {}


def _names(call: Call) -> str:
    """The ignored fields' names, comma-separated, as printable ASCII (a JSON key may hold
    any character, a header only these), each cut at 64 characters, at most 2000 in all."""
    names = [json.dumps(n)[1:-1][:64] for n in call.req.ignored]  # escapes control and non-ASCII characters
    return ", ".join(names)[:2000]


# ---- 1. prepare ----------------------------------------------------------------------------
def prepare(state: ServeState, raw: bytes, endpoint: str, sid: str | None = None) -> Call:
    """Decode and check a body; the call with its renderer (run in a worker thread).

    Args:
        sid: the call's session (``/v1/responses``: whose responses ``previous_response_id`` may name).

    Raises:
        ServeError: 400 for a body that is not JSON, a refused field or value, a prompt
            that cannot fit the context, an unknown ``previous_response_id``; 404 for a
            model not served.
    """
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise bad("the request body is not valid JSON") from None
    names = state.settings.served_names()
    if endpoint == compat.COMPLETIONS:
        req = parse_completion_request(body, names, len(state.renderer.tokenizer))
        _check_length(state, len(req.prompt_text or ""), "prompt")
        return Call(req, state.renderer, None)
    if endpoint == compat.RESPONSES:
        session = state.sessions.get(sid, create=False) if sid else None
        kept = session.responses if session is not None else ({} if sid else state.kept_responses)
        chat: ChatRequest = parse_responses_request(body, names, kept.get, state.template_reads)
    else:
        chat = parse_request(body, names, state.template_reads)
    param = "input" if endpoint == compat.RESPONSES else "messages"
    _check_length(state, sum(len(m.get("content") or "") for m in chat.messages), param)
    renderer = state.renderer_for(chat.tools, chat.template_kwargs)
    parser = renderer if chat.parse_tools else state.renderer_for([])
    return Call(chat, renderer, parser, grammar=structured.grammar_for(chat, renderer))


def _check_length(state: ServeState, chars: int, param: str) -> None:
    """Refuse, before tokenising, text too long for the context whatever its tokens: no
    token covers more than ``state.max_token_chars`` characters, so n characters take at
    least n / that many tokens (halved for normalisers that merge characters).

    Raises:
        ServeError: 400 ``context_length_exceeded``.
    """
    at_least = chars // (2 * state.max_token_chars)
    limit = state.settings.max_context
    if at_least > limit:
        raise bad(
            f"this model's maximum context length is {limit} tokens; the {param} take at least {at_least} tokens "
            f"({chars} characters): shorten them",
            param,
            "context_length_exceeded",
        )


# ---- 2. begin -------------------------------------------------------------------------------
async def begin(state: ServeState, call: Call) -> None:
    """Build the context and the sampling settings, apply the episode's budgets, queue the choices.

    Raises:
        ServeError: 400 (context too long, settings the episode refuses, an episode that
            is over), 503 (shutting down).
    """
    req, session = call.req, call.session
    ep = session.episode if session is not None else None
    if ep is not None:
        params = ep.params_for(req)
        ep.before_context()
    call.context = await asyncio.to_thread(_context, call)
    ids = call.context.ids
    if ep is not None:
        ep.before_sample(ids)
    else:
        params = _params(state, req, len(ids))
    check_context(state, len(ids), params.max_new_tokens)
    params = dataclasses.replace(params, top_logprobs=req.top_logprobs)
    on_token = None
    if call.streams_text():
        tokens: asyncio.Queue = asyncio.Queue()
        call.tokens = tokens
        loop = asyncio.get_running_loop()

        def on_token(k: int, token: int, _logprob: float) -> None:  # the sampling thread
            loop.call_soon_threadsafe(tokens.put_nowait, (k, token))

    try:
        call.job = state.batcher.submit(
            [ids] * req.n, params, session.id if session is not None else None, req.seed, on_token, call.grammar
        )
    except RuntimeError as e:
        raise ServeError(503, str(e), None, "shutting_down") from None


def _context(call: Call) -> CallContext:
    """The call's context ids (a worker thread: tokenising may take a while)."""
    req, session, renderer = call.req, call.session, call.renderer
    if isinstance(req, ChatRequest):
        if session is None:
            return CallContext(renderer.prompt_ids(req.messages))
        return session.context_for(req.messages, renderer)
    ids = req.prompt_ids if req.prompt_ids is not None else renderer.encode(req.prompt_text or "")
    if not ids:
        raise bad("the prompt has no tokens", "prompt", "invalid_value")
    return session.context_for_ids(ids) if session is not None else CallContext(list(ids))


def _params(state: ServeState, req, n_context: int) -> SamplingParams:
    """The sampling settings of a request outside an episode (the server's defaults where it
    says nothing; ``max_tokens``: ``--max-tokens`` in chat, 16 in completions, as OpenAI's)."""
    s = state.settings
    room = s.max_context - n_context
    if req.max_tokens is None and room < 1:
        check_context(state, n_context, 1)
    default = s.max_tokens if isinstance(req, ChatRequest) else DEFAULT_MAX_TOKENS
    max_new = req.max_tokens if req.max_tokens is not None else min(default, room)
    check_context(state, n_context, max_new)
    temperature = s.temperature if req.temperature is None else req.temperature
    top_p = s.top_p if req.top_p is None else req.top_p
    top_k = s.top_k if req.top_k is None else req.top_k
    return SamplingParams(temperature, top_k if temperature > 0 else 0, top_p, max_new)


def check_context(state: ServeState, n_context: int, max_new: int) -> None:
    """Refuse a context that with ``max_new`` tokens would pass the model's context length.

    Raises:
        ServeError: 400 ``context_length_exceeded``.
    """
    limit = state.settings.max_context
    if n_context + max_new > limit:
        raise bad(
            f"this model's maximum context length is {limit} tokens; the messages take {n_context} tokens and "
            f"the reply may take {max_new} (max_tokens): shorten the messages or lower max_tokens",
            "messages",
            "context_length_exceeded",
        )


# ---- 3. finish ------------------------------------------------------------------------------
async def finish(state: ServeState, call: Call, request: Request | None) -> list[Choice]:
    """Wait for the samples, make the choices, record them; the choices.

    A client that leaves before sampling began cancels the call (499). One that leaves
    during sampling (``request`` given, polled): the batch finishes anyway; a session call
    waits for its samples, records them, then ends with 499; a call without a session is
    cancelled (499; nothing is recorded). A streamed call (``request`` ``None``) is never
    polled: it is recorded whatever the client does.

    Raises:
        ServeError: 499 the client disconnected; 503 the server is shutting down.
    """
    assert call.job is not None and call.context is not None
    job, session = call.job, call.session
    waiting = asyncio.ensure_future(job.result())
    left = False
    while not waiting.done():
        await asyncio.wait({waiting}, timeout=DISCONNECT_POLL_S)
        if request is not None and not waiting.done() and not left and await request.is_disconnected():
            if session is None or not job.started:
                job.cancel()
                waiting.cancel()
                raise ServeError(499, "the client closed the connection")
            left = True  # sampled already: wait for it, so it is recorded
    try:
        samples = waiting.result()
    except RuntimeError as e:
        raise ServeError(503, str(e), None, "shutting_down") from None
    ep = session.episode if session is not None else None
    out = [_choice(state, call, s, answers=True if ep is None else ep.answers) for s in samples]
    if session is not None:
        messages = call.req.messages if isinstance(call.req, ChatRequest) else None
        for _, sample, parsed in out:
            session.record(messages, call.context, sample, parsed)
            if ep is not None:
                ep.after_call(sample.stop_reason)
    if left:
        raise ServeError(499, "the client closed the connection")
    return [choice for choice, _s, _p in out]


def _choice(state: ServeState, call: Call, s: Sample, answers: bool) -> tuple[Choice, Sample, ParsedTurn]:
    """One sample as a choice: cut at the first stop string, parsed (chat) or decoded (completions)."""
    tok = call.renderer.tokenizer
    s, cut = cut_at_stop(s, call.req.stop, tok)
    if call.parser is not None:
        parsed = call.parser.parse(s.output_ids, s.stop_reason, answers=answers)
    else:  # completions: the text, without the end-of-turn id that ended it
        ids = s.output_ids[:-1] if s.output_ids and s.output_ids[-1] in state.renderer.stop_ids else s.output_ids
        text = tok.decode(ids, skip_special_tokens=False)
        parsed = ParsedTurn({"role": "assistant", "content": text}, stop_reason=s.stop_reason)
    if cut:
        parsed.message = without_stop_text(parsed.message, call.req.stop)
    finish_reason = "length" if s.stop_reason == "length" else ("tool_calls" if parsed.tool_calls else "stop")
    top = [[(tok.decode([i], skip_special_tokens=False), lp) for i, lp in alts] for alts in s.top_logprobs or []]
    choice = Choice(
        parsed.message,
        finish_reason,
        list(s.output_ids),
        list(s.logprobs),
        [tok.decode([i], skip_special_tokens=False) for i in s.output_ids],
        top,
    )
    return choice, s, parsed


def cut_at_stop(sample: Sample, stops: list[str], tokenizer) -> tuple[Sample, bool]:
    """The sample up to and including the first token whose text completes a stop string
    (``stop_reason`` ``stop``) and ``True``; unchanged and ``False`` when none occurs. The
    ids after it were sampled but are not part of the reply, so they are not recorded either."""
    if not stops:
        return sample, False
    for k in range(1, len(sample.output_ids) + 1):
        text = tokenizer.decode(sample.output_ids[:k], skip_special_tokens=False)
        if any(s in text for s in stops):
            keep = None if sample.keep_ids is None else sample.keep_ids[:k]
            top = None if sample.top_logprobs is None else sample.top_logprobs[:k]
            return Sample(sample.output_ids[:k], sample.logprobs[:k], "stop", keep, top, sample.constrained), True
    return sample, False


def without_stop_text(message: dict[str, Any], stops: list[str]) -> dict[str, Any]:
    """The reply's content up to the first stop string, as OpenAI returns it. The ids stay
    as sampled (the training record), so ``token_ids`` include the stop text and may run
    past it within the token that completed it; the recorded message is this cut one, so
    an agent that sends the reply back continues the row."""
    content = message.get("content") or ""
    at = min((content.find(s) for s in stops if s in content), default=-1)
    return message if at < 0 else message | {"content": content[:at]}


def respond(call: Call, choices: list[Choice]) -> dict[str, Any]:
    """The response object of the call's choices (``chat.completion``, ``text_completion`` or,
    for ``/v1/responses``, ``response``, whose conversation is then kept for ``previous_response_id``)."""
    assert call.context is not None
    if isinstance(call.req, CompletionRequest):
        return text_completion(call.req, choices, call.context.ids)
    if isinstance(call.req, ResponsesRequest):
        (choice,) = choices  # the Responses API has no n
        if call.kept is not None:
            responses.keep(call.kept, call.req, choice)
        return responses.response_object(call.req, choice, call.context.ids)
    ids = [[f"call_{uuid.uuid4().hex[:24]}" for _ in (c.message.get("tool_calls") or [])] for c in choices]
    return completion(call.req, choices, ids, call.context.ids)


# ---- streaming ------------------------------------------------------------------------------
async def _stream(state: ServeState, call: Call) -> StreamingResponse:
    """Begin the call, then finish it in a task of its own while its tokens are streamed."""
    lock = call.session.lock if call.session is not None else None
    if lock is not None:
        await lock.acquire()
    try:
        await begin(state, call)
    except BaseException:
        _release(state, call, lock)
        raise

    async def run() -> list[Choice]:
        try:
            return await finish(state, call, None)
        finally:
            _release(state, call, lock)
            if call.tokens is not None:
                call.tokens.put_nowait(None)

    task = asyncio.get_running_loop().create_task(run())
    _RUNNING.add(task)
    task.add_done_callback(_forget_task)
    events = _response_events(call, task) if isinstance(call.req, ResponsesRequest) else _events(call, task)
    return StreamingResponse(events, media_type="text/event-stream", headers=ignored_header(call))


def _release(state: ServeState, call: Call, lock: asyncio.Lock | None) -> None:
    if lock is not None:
        lock.release()
    if call.session is not None:
        state.sessions.leave(call.session)


def _forget_task(task: asyncio.Task) -> None:
    _RUNNING.discard(task)
    if not task.cancelled() and task.exception() is not None:  # retrieved: the stream reports it if still open
        log.info("a streamed call ended with %s", task.exception())


async def _events(call: Call, task: asyncio.Task) -> AsyncIterator[str]:
    """The server-sent events of a streamed call: deltas as tokens come, then the end chunks."""
    req = call.req
    full_id, created = ("chatcmpl-" if call.chat else "cmpl-") + uuid.uuid4().hex, int(time.time())
    base = (streaming.chat_base if call.chat else streaming.completion_base)(full_id, created, req.model)
    texts = _text_streams(call)
    if call.chat:
        for k in range(req.n):
            yield streaming.sse(streaming.chat_delta(base, k, {"role": "assistant", "content": ""}))
    async for k, delta in _deltas(call, texts):
        yield streaming.sse(_delta(call, base, k, delta))
    choices = await _outcome(task)
    if isinstance(choices, dict):  # the call failed: the stream says why
        yield streaming.sse(choices)
        return
    full = respond(call, choices)
    sent = [t.sent if t is not None else "" for t in texts]
    end = streaming.chat_end if call.chat else streaming.completion_end
    for chunk in end(base, full, sent, req.include_usage):
        yield streaming.sse(chunk)
    yield streaming.DONE


async def _response_events(call: Call, task: asyncio.Task) -> AsyncIterator[str]:
    """The server-sent events of a streamed ``/v1/responses`` call (``responses.Events``):
    the text deltas as tokens come (a plain-text reply), then the rest of the output items."""
    assert isinstance(call.req, ResponsesRequest)
    events = responses.Events(call.req)
    for event in events.start():
        yield event
    texts = _text_streams(call)
    async for _k, delta in _deltas(call, texts):
        if not events.opened:
            for event in events.open_text():
                yield event
        yield events.text(delta)
    choices = await _outcome(task)
    if isinstance(choices, dict):
        yield events.error(choices)
        return
    for event in events.end(respond(call, choices), texts[0].sent if texts[0] is not None else ""):
        yield event


def _text_streams(call: Call) -> list[streaming.TextStream | None]:
    """One text stream per choice when its tokens are streamed, else ``None`` each."""
    req = call.req
    if call.tokens is None:
        return [None] * req.n
    return [
        streaming.TextStream(call.renderer.tokenizer, call.renderer.stop_ids, req.stop, call.chat) for _ in range(req.n)
    ]


async def _deltas(call: Call, texts: list[streaming.TextStream | None]) -> AsyncIterator[tuple[int, str]]:
    """``(choice, text)`` as the streamed tokens arrive, until the sampling ends."""
    while call.tokens is not None:
        batch = [await call.tokens.get()]
        while not call.tokens.empty():  # decode what has arrived at once
            batch.append(call.tokens.get_nowait())
        new: dict[int, list[int]] = {}
        for item in batch:
            if item is not None:
                new.setdefault(item[0], []).append(item[1])
        for k, ids in new.items():
            delta = texts[k].add(ids)  # type: ignore[union-attr]  # made whenever tokens are streamed
            if delta:
                yield k, delta
        if None in batch:
            break


async def _outcome(task: asyncio.Task) -> list[Choice] | dict[str, Any]:
    """The choices of a streamed call's task, or the OpenAI-shaped error body it failed with."""
    try:
        return await task
    except ServeError as e:
        return e.body()
    except Exception as e:  # noqa: BLE001  (a bug of ours: the stream says what failed)
        return ServeError(500, f"internal error: {type(e).__name__}: {e}", None, "internal_error").body()


def _delta(call: Call, base: dict[str, Any], k: int, text: str) -> dict[str, Any]:
    if call.chat:
        return streaming.chat_delta(base, k, {"content": text})
    return streaming.completion_delta(base, k, text)

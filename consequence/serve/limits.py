"""The request body-size limit (``--max-body-bytes``): a 413 before anything is parsed.

A body whose ``Content-Length`` is over the limit is refused before the application runs;
one sent without a length (chunked) is refused as soon as the bytes received pass it. In
both cases the rest of the body is read and dropped, up to :data:`DRAIN_CAP_BYTES`, so a
client that is still sending reads the 413 instead of a reset connection; nothing of it is
decoded, so the event loop stays free for every other request.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, MutableMapping
from typing import Any

from consequence.serve.protocol import ServeError

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
DRAIN_CAP_BYTES = 256 * 2**20  # past this much of a refused body the connection is just closed
log = logging.getLogger("consequence.serve")


def too_large(size: int | None, limit: int) -> ServeError:
    """The 413 of a body of ``size`` bytes (``None``: more than ``limit`` so far)."""
    what = f"{size} bytes" if size is not None else f"more than {limit} bytes"
    return ServeError(
        413,
        f"the request body is {what}, over this server's limit of {limit} bytes; send less or raise --max-body-bytes",
        None,
        "request_too_large",
    )


class BodyLimit:
    """ASGI middleware refusing bodies over ``limit`` bytes with an OpenAI-shaped 413.

    Args:
        app: the ASGI application.
        limit: the most bytes a request body may have.
    """

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: MutableMapping[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        size = _content_length(scope)
        if size is not None and size > self.limit:
            await _drain(receive, 0)
            await self._refuse(scope, send, too_large(size, self.limit))
            return
        seen = 0

        async def limited() -> MutableMapping[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    if message.get("more_body"):
                        await _drain(receive, seen)
                    raise too_large(None, self.limit)  # an OpenAI-shaped 413 from the app's handler
            return message

        await self.app(scope, limited, send)

    async def _refuse(self, scope, send: Callable, error: ServeError) -> None:
        log.info("%s %s -> %d %s: %s", scope.get("method"), scope.get("path"), error.status, error.code, error.message)
        body = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _content_length(scope: MutableMapping[str, Any]) -> int | None:
    for name, value in scope.get("headers") or []:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _drain(receive: Callable, seen: int) -> None:
    """Read and drop the rest of a refused body (up to :data:`DRAIN_CAP_BYTES` in all)."""
    while seen <= DRAIN_CAP_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body"):
            return

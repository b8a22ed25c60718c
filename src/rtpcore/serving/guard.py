"""The request boundary's ASGI middleware (:class:`Guard`, pure ASGI: Starlette's
``BaseHTTPMiddleware`` would hide disconnects from the handlers): the connection cap, the API
key, the body limit (413), a body that stops arriving (408), lone surrogates (400)."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from rtpcore.serving.protocol import (
    ErrorBody,
    lone_surrogate,
)
from rtpcore.serving.state import Served

__all__ = ['Guard']

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class Guard:
    """Pure ASGI middleware: the request-body limit (413) and the API key (401)."""

    def __init__(self, app: Any, served: Served):
        self.app = app
        self.served = served

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        served = self.served
        if (served.max_connections is not None and served.open_connections is not None
                and scope["path"] != "/health" and served.open_connections() > served.max_connections):
            await _send_error(send, 503, ErrorBody(
                message=f"the server holds {served.open_connections()} connections, over its limit of "
                        f"{served.max_connections} (--max-connections); retry later",
                type="server_error", code="too_many_connections"), retry_after=True)
            return
        if served.api_key is not None and scope["path"].startswith("/v1/"):
            header = _header(scope, b"authorization")
            if not hmac.compare_digest(header.encode(), f"Bearer {served.api_key}".encode()):
                await _send_error(send, 401, ErrorBody(
                    message="missing or wrong API key (Authorization: Bearer KEY)",
                    type="authentication_error", code="invalid_api_key"))
                return
        limit = served.max_request_bytes
        length = _header(scope, b"content-length")
        if length.isdigit() and int(length) > limit:
            await _send_error(send, 413, _too_large(limit))
            return
        # Read the body here, counting (a chunked body has no length), then hand it on whole;
        # later receives (the disconnect) go to the server's own.
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            try:
                message = await asyncio.wait_for(receive(), served.header_timeout)
            except TimeoutError:  # a body that stopped coming: its connection is closed after the answer
                await _send_error(send, 408, ErrorBody(
                    message=f"the request body stopped arriving: nothing came for {served.header_timeout:g} s "
                            "(--header-timeout)", type="invalid_request_error", code="request_timeout"))
                return
            if message["type"] != "http.request":  # gone before sending it all
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _send_error(send, 413, _too_large(limit))
                return
            chunks.append(chunk)
            more = bool(message.get("more_body"))
        body = b"".join(chunks)
        if b"\\u" in body and scope["method"] == "POST":  # an escape: it may be a lone surrogate
            where = _lone_surrogate_in(body)
            if where is not None:
                await _send_error(send, 400, ErrorBody(
                    message=f"{where}: holds a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF escape), "
                            "which is no text", type="invalid_request_error", param=where))
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _lone_surrogate_in(body: bytes) -> str | None:
    """Where a JSON body holds a lone surrogate (None also when it is not JSON: the app's own
    parser answers that)."""
    try:
        return lone_surrogate(json.loads(body))
    except (ValueError, RecursionError):
        return None


def _too_large(limit: int) -> ErrorBody:
    return ErrorBody(message=f"the request body is over the server's limit of {limit} bytes (--max-request-bytes)",
                     type="invalid_request_error", code="request_too_large")


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return ""


async def _send_error(send: Send, status: int, body: ErrorBody, *, retry_after: bool = False) -> None:
    payload = json.dumps(body.wrap()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if retry_after:
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})

"""The request boundary's ASGI middleware (:class:`Guard`, pure ASGI: Starlette's
``BaseHTTPMiddleware`` would hide disconnects from the handlers): the request's ``X-Request-Id``
(on every response, and in the server's log lines about it), the connection cap, the API key,
the body limit (413), a body that stops arriving (408), and the body parsed once for the handler
(``request.state.json_body``: in a worker process when it is large, ``rtpcore.serving.json_body``),
JSON nested deeper than :data:`MAX_JSON_DEPTH` levels and lone surrogates refused (400)."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from rtpcore.serving.errors import REQUEST_ID
from rtpcore.serving.json_body import MAX_JSON_DEPTH, json_too_deep
from rtpcore.serving.protocol import ErrorBody
from rtpcore.serving.state import Served

__all__ = ["MAX_JSON_DEPTH", "Guard", "json_too_deep", "request_id"]

#: Paths outside /v1/ that need the API key too (they run the tokenizer on the client's input).
GUARDED = ("/tokenize", "/detokenize")
CHAT_PATH = "/v1/chat/completions"  # a large body here has its conversation judged by the body parser


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
        rid = request_id(_header(scope, b"x-request-id"))
        scope.setdefault("state", {})["request_id"] = rid
        token = REQUEST_ID.set(rid)
        header = (b"x-request-id", rid.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        try:
            await self._guard(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(token)

    async def _guard(self, scope: Scope, receive: Receive, send: Send) -> None:
        served = self.served
        if (served.max_connections is not None and served.open_connections is not None
                and scope["path"] != "/health" and served.open_connections() > served.max_connections):
            await _send_error(send, 503, ErrorBody(
                message=f"the server holds {served.open_connections()} connections, over its limit of "
                        f"{served.max_connections} (--max-connections); retry later",
                type="server_error", code="too_many_connections"), retry_after=True)
            return
        if served.api_key is not None and (scope["path"].startswith("/v1/") or scope["path"] in GUARDED):
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
        if scope["method"] == "POST" and body:  # parsed once, off the event loop when large
            parsed = await served.body_parser.parse(body, chat=scope["path"] == CHAT_PATH)
            if parsed.refusal is not None:  # a chat body's conversation, judged where it was parsed
                await _send_error(send, 400, served.chat_refusal_body(parsed.refusal))
                return
            if parsed.too_deep:
                await _send_error(send, 400, ErrorBody(
                    message=f"the request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels",
                    type="invalid_request_error", param="body"))
                return
            if parsed.surrogate is not None:
                await _send_error(send, 400, ErrorBody(
                    message=f"{parsed.surrogate}: holds a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF "
                            "escape), which is no text", type="invalid_request_error", param=parsed.surrogate))
                return
            scope["state"]["json_body"] = parsed  # the handler's (rtpcore.serving.state.json_body)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def request_id(sent: str) -> str:
    """The request's id: the client's ``X-Request-Id`` when it is 1-128 printable ASCII
    characters, else a new one."""
    if 0 < len(sent) <= 128 and all(33 <= ord(c) < 127 for c in sent):
        return sent
    return uuid.uuid4().hex


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

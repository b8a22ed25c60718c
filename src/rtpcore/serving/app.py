"""The OpenAI-compatible HTTP app over one :class:`~rtpcore.engine.async_engine.AsyncEngine`.

``build_app(...)`` is the app factory: the lifespan, the middleware, the exception handlers and
the routers (``routers/``, one per endpoint). The HTTP layer validates (``protocol``), turns a
request into token ids, a grammar and SamplingParams (``requests``: the chat template and
tokenizer run in a worker thread, never on the event loop) and streams (``streaming``); the
engine's own loop thread steps the model, and each request talks to it through its stream (an
asyncio queue). Aborts travel the same way: a client that disconnects -- streamed or not -- ends
its request's streams, which aborts the requests and frees their KV blocks within a step. The
handlers share one ``state.Served`` (``app.state.served``).

The request boundary (docs/design.md §15, §17, §22) is guarded by one pure ASGI middleware
(``guard.Guard``): the connection cap, the bearer key on ``/v1/`` (compared in constant time),
a body over ``max_request_bytes`` (413 before it is parsed), a body that stops arriving (408)
and lone surrogates (400).

``n`` choices: a greedy request is run once and its text is every choice (they are equal);
a sampled one runs ``n`` requests -- choice ``i`` seeded with ``seed + i`` when a seed is
given -- and choices 1.. start once choice 0's prompt is in the prefix cache, so the prompt
is prefilled once.

Error shape and statuses follow docs/design.md §8 (``errors``): 400 for a malformed or invalid
request (``param`` names the field), 401 for a missing or wrong bearer key, 404 for another
model name, 413 for a body over the limit, 429 when ``max_waiting`` requests already wait, 503
while the server drains or once the engine broke. A client mistake is never a 500. A request
that fails while it runs is a 500 (or an error event in its stream) that says what failed for
that request only: a request's own fault (``RequestFailedError``) is named; any other failure
is logged with the request's id and the client is told to look there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from rtpcore.engine.async_engine import AsyncEngine
from rtpcore.reasoning import REASONING_FIELDS, ReasoningParser
from rtpcore.serving.errors import ApiError, validation_body
from rtpcore.serving.guard import Guard
from rtpcore.serving.heap import freeze_long_lived
from rtpcore.serving.protocol import ErrorBody
from rtpcore.serving.routers import chat, completions, health, models, prometheus, tokens, version
from rtpcore.serving.state import DEFAULT_STREAM_BUFFER_BYTES, RequestLimits, Served

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "REASONING_FIELDS", "ApiError", "begin_drain", "build_app", "cut_requests"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 32 << 20  # --max-request-bytes
ROUTERS = (health.router, prometheus.router, models.router, completions.router, chat.router, tokens.router,
           version.router)


def build_app(
    engine: AsyncEngine,
    *,
    model_name: str,
    api_key: str | None = None,
    on_shutdown: Callable[[], Any] | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    tool_call_parser: Any = None,
    header_timeout: float | None = None,
    max_connections: int | None = None,
    open_connections: Callable[[], int] | None = None,
    skip_tokenizer: bool = False,
    limits: RequestLimits | None = None,
    enable_prompt_tokens_details: bool = False,
    stream_buffer_bytes: int = DEFAULT_STREAM_BUFFER_BYTES,
    own_process: bool = False,
    reasoning_parser: type[Any] | None = None,
    reasoning_field: str = "reasoning",
) -> FastAPI:
    """The FastAPI app serving ``engine`` as ``model_name``, with the engine's own text side
    (``engine.engine.text``: its tokenizer -- without one, token ids only, see ``Served`` -- and
    its chat template, without which chat completions are a 400).
    ``on_shutdown`` runs when the app's lifespan ends (after uvicorn has drained or cut the
    open requests).
    ``tool_call_parser``: the ``ToolCallParser`` class that finds calls in answers to requests
    with tools and ``tool_choice: "auto"`` (None: such requests are a 400). Connection rules
    (docs/design.md §22; the server that runs the app enforces the rest, see
    ``rtpcore.serving.server``): ``header_timeout``, seconds a request body may stop arriving
    before it is a 408 (None: no limit); ``max_connections`` with ``open_connections()``, the
    connections open, past which every request but ``/health`` is a 503. ``skip_tokenizer``:
    serve token ids only, without the checkpoint's tokenizer (``Served``). ``limits``: the caps on
    one request (``state.RequestLimits``; its defaults when None).
    ``enable_prompt_tokens_details``: usage reports ``prompt_tokens_details.cached_tokens`` (off,
    it is left out: the count tells a client whether another sent the same prompt before).
    ``stream_buffer_bytes``: the unsent bytes a streamed response may hold (its client reads
    slower than the model writes) before its engine requests pause, holding no KV blocks, until
    the client has taken half of them. ``own_process``: the app is the whole process (``rtpcore
    serve``), and may tune it for serving: the body parser's worker process starts with the app,
    and the objects alive once it has started, or once the grammar compiler is built, are frozen
    out of the garbage collector's walks (``rtpcore.serving.heap``). Off, an app embedded in
    another program leaves that program's collector alone. ``reasoning_parser``: the
    ``rtpcore.reasoning.ReasoningParser`` class that splits each chat answer's reasoning from
    its content, returned in the message's (a stream's deltas') ``reasoning_field``:
    ``"reasoning"`` or vLLM's older ``"reasoning_content"``."""
    if reasoning_field not in REASONING_FIELDS:
        raise ValueError(f"reasoning_field must be one of {', '.join(REASONING_FIELDS)}, got {reasoning_field!r}")
    if reasoning_parser is not None and not (isinstance(reasoning_parser, type)
                                             and issubclass(reasoning_parser, ReasoningParser)):
        raise ValueError(f"reasoning_parser must be a ReasoningParser subclass, got {reasoning_parser!r}")
    if isinstance(stream_buffer_bytes, bool) or not isinstance(stream_buffer_bytes, int) or stream_buffer_bytes < 1:
        raise ValueError(f"stream_buffer_bytes must be a positive int, got {stream_buffer_bytes!r}")
    served = Served(engine, model_name, api_key, max_request_bytes, tool_call_parser, skip_tokenizer=skip_tokenizer,
                    limits=limits)
    served.header_timeout = header_timeout
    served.max_connections = max_connections
    served.open_connections = open_connections
    served.prompt_tokens_details = enable_prompt_tokens_details
    served.stream_buffer_bytes = stream_buffer_bytes
    served.freeze_heap = own_process
    served.reasoning_parser = reasoning_parser
    served.reasoning_field = reasoning_field

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if own_process:  # before the first connection: the worker's start and full collections stay short
            await asyncio.to_thread(served.body_parser.start)
            freeze_long_lived("the app's start")
        yield
        served.draining = True
        served.body_parser.close()
        if on_shutdown is not None:
            result = on_shutdown()
            if asyncio.iscoroutine(result):
                await result

    app = FastAPI(title="rtpcore", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.served = served
    app.add_middleware(Guard, served=served)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body.wrap(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_body(exc).wrap(), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:  # a bug of ours, not the client's
        logger.exception("internal error serving %s (X-Request-Id %s)", request.url.path,
                         getattr(request.state, "request_id", None))
        body = ErrorBody(message=f"internal error: {type(exc).__name__}", type="server_error")
        return JSONResponse(body.wrap(), status_code=500)

    for router in ROUTERS:
        app.include_router(router)
    return app


def begin_drain(app: FastAPI) -> None:
    """Shutdown has begun: ``app`` answers every new request with a 503 from now on."""
    app.state.served.draining = True


def cut_requests(app: FastAPI) -> int:
    """Shutdown past its timeout: abort every request ``app`` is running (each ends with
    finish_reason "abort"; a stream with its last chunk and [DONE]); how many there were."""
    return int(app.state.served.cut())

"""The OpenAI-compatible HTTP app over one :class:`~rtpcore.engine.async_engine.AsyncEngine`.

``build_app(...)`` is the app factory: the HTTP layer validates (``protocol``),
renders (chat template, tokenizer: in a worker thread, never on the event loop) and
streams; the engine's own loop thread steps the model, and each request talks to it
through its stream (an asyncio queue). Aborts travel the same way: a client that
disconnects -- streamed or not -- ends its request's streams, which aborts the requests
and frees their KV blocks within a step.

The request boundary (docs/design.md §15) is guarded by one pure ASGI middleware
(:class:`_Guard`; Starlette's ``BaseHTTPMiddleware`` would hide disconnects from the
handlers): a body over ``max_request_bytes`` is a 413 before it is parsed, and the
``/v1/`` endpoints need the bearer key when one is set, compared in constant time.

``n`` choices: a greedy request is run once and its text is every choice (they are equal);
a sampled one runs ``n`` requests -- choice ``i`` seeded with ``seed + i`` when a seed is
given -- and choices 1.. start once choice 0's prompt is in the prefix cache, so the prompt
is prefilled once.

Error shape and statuses follow docs/design.md §8: 400 for a malformed or invalid request
(``param`` names the field), 401 for a missing or wrong bearer key, 404 for another model
name, 413 for a body over the limit, 429 when ``max_waiting`` requests already wait, 503
while the server drains. A client mistake is never a 500. A request that fails while it
runs is a 500 (or an error event in its stream) that says what failed for that request
only: a request's own fault (``RequestFailedError``) is named; any other failure is
logged with the request's id and the client is told to look there.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from typing import Any

import attrs
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rtpcore.engine.async_engine import AsyncEngine, RequestStream
from rtpcore.engine.core.outputs import RequestOutput
from rtpcore.engine.sample.grammar import Grammar, GrammarCompiler
from rtpcore.engine.sample.params import SampledToken, SamplingParams
from rtpcore.engine.text.chat_template import ChatTemplate
from rtpcore.engine.text.detokenize import IncrementalDecoder
from rtpcore.engine.text.tokenizer import Tokenizer
from rtpcore.errors import (
    EngineClosedError,
    InvalidRequestError,
    QueueFullError,
    RequestFailedError,
    RtpcoreError,
)
from rtpcore.plugins.tool_parser import ToolCall
from rtpcore.serving.metrics import ServerMetrics
from rtpcore.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorBody,
    NamedToolChoice,
    ResponseFormat,
    lone_surrogate,
)

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "ApiError", "begin_drain", "build_app", "cut_requests"]

logger = logging.getLogger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_MAX_REQUEST_BYTES = 32 << 20  # --max-request-bytes
_RESERVED_TEMPLATE_KWARGS = ("messages", "add_generation_prompt", "tools", "documents")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class ApiError(Exception):
    """An answer other than 200, in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.body = ErrorBody(message=message, type=type, param=param, code=code)


class _Served:
    """What the handlers share: the engine, the text side, the model's limits, metrics."""

    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, chat_template: ChatTemplate | None,
                 model_name: str, api_key: str | None, max_request_bytes: int, tool_parser: Any = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.model_name = model_name
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.max_model_len = engine.engine.max_model_len  # prompt + output, at most
        self.vocab_size = engine.engine.vocab_size
        # Stop ids (docs/design.md §15): the engine's (generation_config.json, else config.json)
        # plus the tokenizer's eos_token, which some checkpoints name nowhere else.
        eos = tokenizer.eos_token_id
        self.tokenizer_eos = () if eos is None or eos in engine.engine.eos_token_ids else (eos,)
        self.metrics = ServerMetrics(lambda: engine.stats().as_dict())
        engine.add_step_observer(self.metrics.observe_step)
        self.created = int(time.time())
        self.draining = False  # shutting down: new requests are 503s
        self.cutting = False  # past the shutdown timeout: running requests are aborted
        self.responses: weakref.WeakSet[_Response] = weakref.WeakSet()  # HTTP requests being answered
        # Connection rules (docs/design.md §22), set by the server that runs the app (rtpcore.serving.server).
        self.header_timeout: float | None = None  # a request body idle this long is a 408
        self.max_connections: int | None = None
        self.open_connections: Callable[[], int] | None = None
        self.tool_parser = tool_parser  # the ToolCallParser class of --tool-call-parser, or None
        self._grammars: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()

    def cut(self) -> int:
        """Abort every request running (shutdown past its timeout): each ends with
        finish_reason "abort", streams with their last chunk and [DONE]. How many HTTP requests
        were running."""
        self.draining = self.cutting = True
        cut = len(self.responses)
        self.engine.abort_all()
        return cut

    def grammars(self) -> GrammarCompiler:
        """The grammar compiler over this model's vocabulary (built on first use; call it from
        a worker thread)."""
        with self._grammar_lock:
            if self._grammars is None:
                stops = [*self.engine.engine.eos_token_ids, *self.tokenizer_eos]
                if not stops:
                    raise ApiError(400, "this model names no stop token (eos_token_id), which a grammar needs to "
                                        "end: structured outputs and tool calls are unavailable",
                                   param="response_format")
                size = max(self.vocab_size or 0, self.tokenizer.vocab_size)
                self._grammars = GrammarCompiler(self.tokenizer.json_path, vocab_size=size, stop_token_ids=stops)
            return self._grammars


class _Guard:
    """Pure ASGI middleware: the request-body limit (413) and the API key (401)."""

    def __init__(self, app: Any, served: _Served):
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


def build_app(
    engine: AsyncEngine,
    *,
    tokenizer: Tokenizer,
    chat_template: ChatTemplate | None,
    model_name: str,
    api_key: str | None = None,
    on_shutdown: Callable[[], Any] | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    tool_call_parser: Any = None,
    header_timeout: float | None = None,
    max_connections: int | None = None,
    open_connections: Callable[[], int] | None = None,
) -> FastAPI:
    """The FastAPI app serving ``engine`` as ``model_name``. ``on_shutdown`` runs when the
    app's lifespan ends (after uvicorn has drained or cut the open requests).
    ``tool_call_parser``: the ``ToolCallParser`` class that finds calls in answers to requests
    with tools and ``tool_choice: "auto"`` (None: such requests are a 400). Connection rules
    (docs/design.md §22; the server that runs the app enforces the rest, see
    ``rtpcore.serving.server``): ``header_timeout``, seconds a request body may stop arriving
    before it is a 408 (None: no limit); ``max_connections`` with ``open_connections()``, the
    connections open, past which every request but ``/health`` is a 503."""
    served = _Served(engine, tokenizer, chat_template, model_name, api_key, max_request_bytes, tool_call_parser)
    served.header_timeout = header_timeout
    served.max_connections = max_connections
    served.open_connections = open_connections

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        served.draining = True
        if on_shutdown is not None:
            result = on_shutdown()
            if asyncio.iscoroutine(result):
                await result

    app = FastAPI(title="rtpcore", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.served = served
    app.add_middleware(_Guard, served=served)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body.wrap(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(_validation_body(exc).wrap(), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:  # a bug of ours, not the client's
        logger.exception("internal error serving %s", request.url.path)
        body = ErrorBody(message=f"internal error: {type(exc).__name__}", type="server_error")
        return JSONResponse(body.wrap(), status_code=500)

    @app.get("/health", response_model=None)
    async def health() -> Any:
        failure = served.engine.failure
        if failure is not None:  # closed, its loop broke or a rank failed: every request would fail now
            return JSONResponse({"status": "error", "message": str(failure)}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(served.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": served.model_name, "object": "model", "created": served.created, "owned_by": "rtpcore",
             "max_model_len": served.max_model_len}
        ]}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        _check_model(served, body.model)
        if isinstance(body.prompt, str):
            ids = await asyncio.to_thread(served.tokenizer.encode, body.prompt, True)
        else:
            ids = list(body.prompt)
            if served.vocab_size is not None and max(ids) >= served.vocab_size:
                raise ApiError(400, f"prompt: token id {max(ids)} is not below the vocabulary size "
                                    f"{served.vocab_size}", param="prompt")
        limit = body.max_tokens if body.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        grammar = await asyncio.to_thread(_format_grammar, served, body.response_format)
        params = _params(served, body, ids, limit, "max_tokens", body.logprobs, grammar)
        return await _respond(served, request, body, ids, params, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        _check_model(served, body.model)
        tools, grammar = await asyncio.to_thread(_tool_plan, served, body)
        if grammar is None:
            grammar = await asyncio.to_thread(_format_grammar, served, body.response_format)
        ids = await asyncio.to_thread(_render_chat, served, body)
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        limit = body.token_limit if body.token_limit is not None else max(1, served.max_model_len - len(ids))  # chat may run to max_model_len
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = _params(served, body, ids, limit, field, top, grammar)
        return await _respond(served, request, body, ids, params, chat=True, tools=tools)

    return app


def begin_drain(app: FastAPI) -> None:
    """Shutdown has begun: ``app`` answers every new request with a 503 from now on."""
    app.state.served.draining = True


def cut_requests(app: FastAPI) -> int:
    """Shutdown past its timeout: abort every request ``app`` is running (each ends with
    finish_reason "abort"; a stream with its last chunk and [DONE]); how many there were."""
    return int(app.state.served.cut())


def _validation_body(exc: RequestValidationError) -> ErrorBody:
    """The first validation error as OpenAI's 400: ``param`` names the field (``messages[0].content``)."""
    error = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    path = ""
    for part in error.get("loc", ()):
        if part == "body":
            continue
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    param = path or None
    if error.get("type") == "extra_forbidden":
        message = (f"{param}: unknown field; rtpcore refuses fields it does not honour rather than ignore them "
                   "(docs/serving.md lists the fields)")
    else:
        msg = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        message = f"{param}: {msg}" if param else msg
    return ErrorBody(message=message, type="invalid_request_error", param=param)


def _format_grammar(served: _Served, fmt: ResponseFormat | None) -> Grammar | None:
    """The grammar of ``response_format`` (runs in a worker thread); None for text."""
    if fmt is None or fmt.type == "text":
        return None
    try:
        if fmt.type == "json_object":
            return served.grammars().json_object()
        assert fmt.json_schema is not None
        schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {}
        return served.grammars().json_schema(schema, field="response_format")
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc), param="response_format.json_schema.schema") from None


def _tool_plan(served: _Served, body: ChatCompletionRequest) -> tuple[_Tools | None, Grammar | None]:
    """How the request's tools are answered, and the grammar that constrains the output to a
    call ("required" or a named function; runs in a worker thread)."""
    mode = body.tool_mode
    if mode is None:
        return None, None
    if body.response_format is not None and body.response_format.type != "text":
        raise ApiError(400, "response_format cannot be combined with tool calls (tool_choice "
                            f"{body.tool_choice!r}); send one of them", param="response_format")
    tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
    if mode == "auto":
        if served.tool_parser is None:
            raise ApiError(400, "tool_choice 'auto' needs a tool-call parser: start the server with "
                                "--tool-call-parser NAME (or send tool_choice 'required' or a named function)",
                           param="tool_choice")
        return _Tools("auto", parser=served.tool_parser, tools=tools), None
    functions = {t.function.name: t.function for t in body.tools or ()}
    try:
        if mode == "named":
            assert isinstance(body.tool_choice, NamedToolChoice)
            name = body.tool_choice.function.name
            grammar = served.grammars().json_schema(_parameters(functions[name]), field="tools")
            return _Tools("named", name=name, tools=tools), grammar
        calls = {"anyOf": [
            {"type": "object", "properties": {"name": {"enum": [n]}, "parameters": _parameters(f)},
             "required": ["name", "parameters"], "additionalProperties": False}
            for n, f in functions.items()
        ]}
        schema: dict[str, Any] = {"type": "array", "items": calls, "minItems": 1}
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return _Tools("required", tools=tools), served.grammars().json_schema(schema, field="tools")
    except InvalidRequestError as exc:
        raise ApiError(400, f"tools: a function's parameters are not a usable JSON schema: "
                            f"{str(exc).removeprefix('tools: ')}", param="tools") from None


def _parameters(function: Any) -> dict[str, Any]:
    return function.parameters if function.parameters is not None else {"type": "object", "properties": {}}


def _render_chat(served: _Served, body: ChatCompletionRequest) -> list[int]:
    """The token ids of the rendered conversation (runs in a worker thread)."""
    if served.chat_template is None:
        raise ApiError(400, "this model has no chat template (chat_template.jinja or tokenizer_config.json's "
                            "chat_template); use /v1/completions", param="messages")
    extra = dict(body.chat_template_kwargs or {})
    reserved = [k for k in extra if k in _RESERVED_TEMPLATE_KWARGS]
    if reserved:
        raise ApiError(400, f"chat_template_kwargs: {reserved[0]!r} is set by the request itself, not here",
                       param="chat_template_kwargs")
    messages = [m.for_template() for m in body.messages]
    final = bool(body.continue_final_message)
    add = body.add_generation_prompt if body.add_generation_prompt is not None else not final
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    try:
        text = served.chat_template.render(messages, add_generation_prompt=add, tools=tools, **extra)
    except RtpcoreError as exc:
        raise ApiError(400, f"messages: {exc}", param="messages") from None
    if final:  # cut what the template closes the last message with: the model continues it
        content = str(messages[-1].get("content") or "")
        end = text.rfind(content) if content else -1
        if end < 0:
            raise ApiError(400, "continue_final_message: the chat template does not render the last message's "
                                "content verbatim", param="continue_final_message")
        text = text[: end + len(content)]
    return served.tokenizer.encode(text, add_special_tokens=False)  # the template wrote BOS if any


def _check_model(served: _Served, model: str) -> None:
    if model != served.model_name:
        raise ApiError(404, f"model {model!r} is not served here; this server serves {served.model_name!r}",
                       param="model", code="model_not_found")


def _params(served: _Served, body: Any, ids: list[int], limit: int, field: str, logprobs: int | None,
            grammar: Grammar | None = None) -> SamplingParams:
    if not ids:
        raise ApiError(400, "the prompt encodes to no tokens", param="prompt" if field == "max_tokens" else "messages")
    if len(ids) + limit > served.max_model_len:
        raise ApiError(400, f"This model's maximum context length is {served.max_model_len} tokens (max_model_len); "
                            f"the prompt has {len(ids)} tokens and {field}={limit} asks for {limit} more "
                            f"({len(ids) + limit} in all): shorten the prompt or lower {field}", param=field,
                       code="context_length_exceeded")
    vocab = served.vocab_size
    for name, tokens in (("logit_bias", [int(k) for k in body.logit_bias or {}]), ("stop_token_ids", body.stop_token_ids or [])):
        if vocab is not None and tokens and max(tokens) >= vocab:
            raise ApiError(400, f"{name}: token id {max(tokens)} is not below the vocabulary size {vocab}", param=name)
    top_k = body.top_k if body.top_k not in (None, -1, 0) else None
    top_p = body.top_p if body.top_p not in (None, 1.0) else None
    ignore_eos = bool(body.ignore_eos)
    stop_ids = [*(body.stop_token_ids or ()), *(() if ignore_eos else served.tokenizer_eos)]
    try:
        return SamplingParams(
            max_tokens=limit,
            temperature=1.0 if body.temperature is None else body.temperature,  # OpenAI's default
            top_k=top_k, top_p=top_p, min_p=body.min_p, seed=body.seed, logprobs=logprobs,
            stop=body.stop_strings, stop_token_ids=stop_ids, ignore_eos=ignore_eos,
            logit_bias=body.logit_bias, min_tokens=body.min_tokens or 0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
            grammar=grammar,
        )
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc), param=getattr(exc, "field", None)) from None


# -- running a request ------------------------------------------------------------------------


@attrs.frozen
class _Delta:
    """New text of one choice, and its new tokens: (the token's draw, the text it added)."""

    text: str
    tokens: tuple[tuple[SampledToken, str], ...] = ()


class _Choice:
    """One engine request's trip: outputs -> text deltas (stop strings cut), per-token text."""

    def __init__(self, served: _Served, params: SamplingParams, *, skip_special: bool, include_stop: bool):
        self.served, self.params = served, params
        self.stream: RequestStream | None = None
        self.decoder = IncrementalDecoder(served.tokenizer, skip_special_tokens=skip_special, stop=params.stop,
                                          include_stop=include_stop)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.started = asyncio.Event()  # the first output came: the prompt is computed (and cached)
        self.last_time: float | None = None

    def submit(self, ids: list[int]) -> None:
        """Queue the engine request; raises an ApiError (nothing queued) when it is refused."""
        try:
            self.stream = self.served.engine.stream(ids, self.params)
        except QueueFullError as exc:
            raise ApiError(429, str(exc), type="rate_limit_error", code="queue_full") from None
        except InvalidRequestError as exc:
            raise ApiError(400, str(exc), param=getattr(exc, "field", None), code=getattr(exc, "code", None)) from None
        except EngineClosedError as exc:
            raise ApiError(503, str(exc), type="server_error") from None

    def end_unsubmitted(self, reason: str) -> None:
        """End a choice that was never queued (its deltas are none)."""
        self._finish(reason)

    @property
    def request_id(self) -> str:
        return self.stream.request_id if self.stream is not None else "-"

    async def deltas(self) -> AsyncIterator[_Delta]:
        """The choice's deltas until it ends; raises the RtpcoreError of a failed request. A
        choice cut short (its client left, the server stopped) ends as "abort"."""
        if self.stream is None:  # never queued (end_unsubmitted)
            assert self.finish_reason is not None
            return
        try:
            async with self.stream as stream:
                async for out in stream:
                    self.started.set()
                    delta = self._take(out)
                    if self.decoder.stopped:  # a stop string: the text is cut, the request ends here
                        self._finish("stop")
                        yield delta
                        return
                    if out.finished:
                        self._finish({"length": "length", "abort": "abort"}.get(out.finish_reason or "", "stop"))
                        tail = self.decoder.finish()
                        if tail and delta.tokens:  # the held-back text belongs to the last token
                            *head, (token, piece) = delta.tokens
                            delta = _Delta(delta.text + tail, (*head, (token, piece + tail)))
                        elif tail:
                            delta = _Delta(delta.text + tail)
                        yield delta
                        return
                    if delta.text or delta.tokens:
                        yield delta
        except RtpcoreError:
            self._finish("error")
            raise
        finally:
            if self.finish_reason is None:
                self._finish("abort")
            self.started.set()  # a failed or cut choice 0 must not hold the others back

    def _finish(self, reason: str) -> None:
        """End the choice with ``reason`` (what clients see), counted once in the metrics."""
        if self.finish_reason is None:
            self.finish_reason = reason
            self.served.metrics.requests.labels(finish_reason=reason).inc()

    def _take(self, out: RequestOutput) -> _Delta:
        self._observe(out)
        self.cached_tokens = out.num_cached_tokens
        ids = list(out.token_ids)
        stop_token = out.stop_token_id is not None and bool(ids) and ids[-1] == out.stop_token_id
        draws = list(out.logprobs or ())
        # One token at a time: an output holds several tokens (a lagging consumer, an accepted
        # speculative run), and tokens after the one completing a stop string are not the client's.
        tokens: list[tuple[SampledToken, str]] = []
        pieces = []
        for i, token in enumerate(ids):
            if stop_token and i == len(ids) - 1:
                break
            piece = self.decoder.push([token])
            pieces.append(piece)
            tokens.append((draws[i] if i < len(draws) else SampledToken(token), piece))
            if self.decoder.stopped:
                break
        # a stop token counts, its text is not returned
        self.completion_tokens += len(tokens) + (stop_token and not self.decoder.stopped)
        return _Delta("".join(pieces), tuple(tokens) if self.params.logprobs is not None else ())

    def _observe(self, out: RequestOutput) -> None:
        m = self.served.metrics
        m.generated_tokens.inc(len(out.token_ids))
        for t in out.token_times:
            if self.last_time is None:
                m.time_to_first_token.observe(max(0.0, t - out.arrival_time))
            else:
                m.time_between_tokens.observe(max(0.0, t - self.last_time))
            self.last_time = t


class _Response:
    """One HTTP request's choices, and the shapes they are returned in."""

    def __init__(self, served: _Served, body: Any, ids: list[int], params: SamplingParams, *, chat: bool,
                 tools: _Tools | None = None):
        self.served, self.params, self.chat, self.model = served, params, chat, body.model
        self.tools = tools
        # Per choice index: how its text becomes content and tool calls.
        self.tool_streams = [tools.stream() if tools is not None else None for _ in range(body.num_choices)]
        self.ids = ids
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.n = body.num_choices
        options = {"skip_special": body.skip_special_tokens is not False,
                   "include_stop": bool(body.include_stop_str_in_output)}
        # Greedy choices are equal: run one. Sampled ones each draw (seed + i when seeded).
        runs = 1 if params.greedy else self.n
        self.choices = [
            _Choice(served, params if i == 0 or params.seed is None else attrs.evolve(params, seed=params.seed + i),
                    **options)
            for i in range(runs)
        ]

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def submit_first(self) -> None:
        self.choices[0].submit(self.ids)

    async def _start_others(self) -> None:
        """Choices 1.. once choice 0's prompt is computed: they find it in the prefix cache."""
        if len(self.choices) > 1:
            await self.choices[0].started.wait()
            for choice in self.choices[1:]:
                if self.served.cutting:  # shutdown cut choice 0: the others end as it did, never run
                    choice.end_unsubmitted("abort")
                else:
                    choice.submit(self.ids)

    def _indices(self, run: int) -> range:
        """The choice indices run ``run`` answers (every one for a shared greedy run)."""
        return range(self.n) if len(self.choices) == 1 else range(run, run + 1)

    @property
    def usage(self) -> dict[str, Any]:
        per_run = [c.completion_tokens for c in self.choices]
        completion = per_run[0] * self.n if len(self.choices) == 1 else sum(per_run)
        prompt = len(self.ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": self.choices[0].cached_tokens}}

    async def collect(self) -> dict[str, Any]:
        """The whole answer (non-streamed)."""

        async def run(choice: _Choice) -> list[_Delta]:
            return [d async for d in choice.deltas()]

        first = asyncio.ensure_future(run(self.choices[0]))
        rest: list[asyncio.Future[list[_Delta]]] = []
        try:
            await self._start_others()
            rest = [asyncio.ensure_future(run(c)) for c in self.choices[1:]]
            results = await asyncio.gather(first, *rest)
        except BaseException:
            for task in (first, *rest):
                task.cancel()
            raise
        choices = []
        for r, (choice, deltas) in enumerate(zip(self.choices, results, strict=True)):
            for index in self._indices(r):
                choices.append(self._whole_choice(index, choice, deltas))
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage}

    def _whole_choice(self, index: int, choice: _Choice, deltas: list[_Delta]) -> dict[str, Any]:
        text = "".join(d.text for d in deltas)
        tokens = [t for d in deltas for t in d.tokens]
        out: dict[str, Any] = {"index": index, "finish_reason": choice.finish_reason,
                               "logprobs": self._logprobs(tokens, 0)}
        stream = self.tool_streams[index]
        if stream is not None:
            content, _ = stream.feed(text)
            rest, _ = stream.finish()
            message: dict[str, Any] = {"role": "assistant", "content": (content + rest) or None}
            if stream.calls:
                message["tool_calls"] = stream.call_objects()
                out["finish_reason"] = _tool_finish(choice.finish_reason)
            else:
                message["content"] = content + rest
            out["message"] = message
        elif self.chat:
            out["message"] = {"role": "assistant", "content": text}
        else:
            out["text"] = text
        return out

    async def events(self, include_usage: bool, request: Request) -> AsyncIterator[str]:
        """Server-sent events: chunks of every choice as they come, each finish, usage if asked,
        [DONE]. The client leaving (noticed at once, not only at the next write) or closing
        the generator aborts every choice's request."""
        queue: asyncio.Queue[tuple[int, _Delta | BaseException | None]] = asyncio.Queue()

        async def pump(r: int, choice: _Choice) -> None:
            try:
                async for delta in choice.deltas():
                    await queue.put((r, delta))
                await queue.put((r, None))
            except BaseException as exc:  # handed to the consumer, which reports it in the stream
                await queue.put((r, exc))
                if isinstance(exc, asyncio.CancelledError):
                    raise

        async def start_others() -> None:
            try:
                await self._start_others()
            except ApiError as exc:  # refused later (a full queue): those choices fail in the stream
                for r in range(1, len(self.choices)):
                    await queue.put((r, exc))
                return
            for r, choice in enumerate(self.choices[1:], start=1):
                tasks.append(asyncio.ensure_future(pump(r, choice)))

        tasks = [asyncio.ensure_future(pump(0, self.choices[0]))]
        starter = asyncio.ensure_future(start_others())
        gone = asyncio.ensure_future(_disconnected(request))
        offsets = [0] * self.n
        try:
            if self.chat:
                for i in range(self.n):
                    yield _sse(self._chunk(i, {"role": "assistant", "content": ""}, None, []))
            pending = len(self.choices)
            while pending:
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():  # the client left
                    getter.cancel()
                    return
                r, item = getter.result()
                if item is None or isinstance(item, BaseException):
                    pending -= 1
                if isinstance(item, BaseException):
                    yield _sse(self._failure(self.choices[r], item).wrap())
                    continue
                choice = self.choices[r]
                done = item is None
                delta = item or _Delta("")
                for index in self._indices(r):
                    stream = self.tool_streams[index]
                    if stream is not None:
                        for chunk in self._tool_chunks(index, stream, delta, done, choice.finish_reason):
                            yield _sse(chunk)
                        continue
                    if delta.text or delta.tokens or done:
                        body = {"content": delta.text} if self.chat else delta.text
                        yield _sse(self._chunk(index, body, choice.finish_reason if done else None,
                                               list(delta.tokens), offsets[index]))
                    offsets[index] += len(delta.text)
            if include_usage:
                yield _sse({"id": self.id, "object": self._chunk_object, "created": self.created,
                            "model": self.model, "choices": [], "usage": self.usage})
            yield "data: [DONE]\n\n"
        finally:
            self.served.responses.discard(self)
            gone.cancel()
            starter.cancel()
            for task in tasks:
                task.cancel()

    def _tool_chunks(self, index: int, stream: _ToolStream, delta: _Delta, done: bool,
                     finish: str | None) -> list[dict[str, Any]]:
        """The chunks of one delta of a choice with tools: content that cannot be a call yet,
        then tool-call pieces; at the end, what was held back and the finish."""
        content, calls = stream.feed(delta.text)
        chunks = []
        if content or delta.tokens:
            chunks.append(self._chunk(index, {"content": content}, None, list(delta.tokens)))
        if calls:
            chunks.append(self._chunk(index, {"tool_calls": calls}, None, []))
        if done:
            rest, calls = stream.finish()
            if rest:
                chunks.append(self._chunk(index, {"content": rest}, None, []))
            if calls:
                chunks.append(self._chunk(index, {"tool_calls": calls}, None, []))
            reason = _tool_finish(finish) if stream.calls else finish
            chunks.append(self._chunk(index, {}, reason, []))
        return chunks

    def _failure(self, choice: _Choice, exc: BaseException) -> ErrorBody:
        """What a client is told about its failed request, and the log line with its id."""
        if isinstance(exc, ApiError):
            return exc.body
        error = exc if isinstance(exc, RtpcoreError) else RtpcoreError(f"{type(exc).__name__}: {exc}")
        return _failure_body(self.id, choice.request_id, error, choice.params)

    def _chunk(self, index: int, delta: Any, finish: str | None, tokens: list[tuple[SampledToken, str]],
               offset: int = 0) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": self._logprobs(tokens, offset)}
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        return {"id": self.id, "object": self._chunk_object, "created": self.created, "model": self.model,
                "choices": [choice]}

    def _logprobs(self, tokens: list[tuple[SampledToken, str]], offset: int) -> dict[str, Any] | None:
        """OpenAI's logprobs of ``tokens`` (the model's raw log-probabilities, exactly the number
        of alternatives asked). Chat: each token's text and own bytes. Completions: ``tokens``
        are the text each token added (joined, the choice's text), ``text_offset`` where each
        starts (``offset``: the text before these tokens)."""
        if self.params.logprobs is None:
            return None
        tok = self.served.tokenizer
        if self.chat:
            return {"content": [
                {"token": _piece(tok, t.token_id), "logprob": t.logprob, "bytes": list(tok.token_bytes(t.token_id)),
                 "top_logprobs": [{"token": _piece(tok, i), "logprob": lp, "bytes": list(tok.token_bytes(i))}
                                  for i, lp in t.top]}
                for t, _ in tokens
            ]}
        offsets = []
        for _, piece in tokens:
            offsets.append(offset)
            offset += len(piece)
        return {"tokens": [piece for _, piece in tokens],
                "token_logprobs": [t.logprob for t, _ in tokens],
                "top_logprobs": [_top_by_text(tok, t.top) for t, _ in tokens],
                "text_offset": offsets}


# -- tools ------------------------------------------------------------------------------------------


def _tool_finish(reason: str | None) -> str | None:
    """A choice that called tools ends with "tool_calls" (unless it was cut: "length", "abort")."""
    return "tool_calls" if reason in (None, "stop") else reason


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class _Tools:
    """How the choices of one request become tool calls: ``mode`` "named" (the output is the
    named function's arguments), "required" (a JSON array of ``{"name", "parameters"}``) or
    "auto" (``parser`` finds the calls in free text)."""

    def __init__(self, mode: str, *, name: str | None = None, parser: Any = None,
                 tools: Sequence[dict[str, Any]] = ()):
        self.mode, self.name, self.parser, self.tools = mode, name, parser, tools

    def stream(self) -> _ToolStream:
        return _ToolStream(self)


class _ToolStream:
    """One choice's text -> content and tool-call deltas, as it streams (``feed``) and at its
    end (``finish``); ``calls`` holds the calls found."""

    def __init__(self, tools: _Tools):
        self.tools = tools
        self.calls: list[ToolCall] = []
        self.ids: list[str] = []
        self._held = ""  # text that may be (the start of) a call
        self._holding = False  # a marker was seen: everything from it on waits for the end
        self._started = False  # named: the call's header was sent
        self._sent = 0  # text seen so far (to know whether a prefix marker is at the start)
        self._parser: Any = tools.parser(tools.tools) if tools.parser is not None else None

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        mode = self.tools.mode
        if mode == "named":
            pieces: list[dict[str, Any]] = []
            if not self._started:
                self._started = True
                self.ids.append(_call_id())
                pieces.append({"index": 0, "id": self.ids[0], "type": "function",
                               "function": {"name": self.tools.name, "arguments": ""}})
            self._held += text
            if text:
                pieces.append({"index": 0, "function": {"arguments": text}})
            return "", pieces
        if mode == "required" or self._holding:
            self._held += text
            return "", []
        # auto: stream content until it may be a call
        held = self._held + text
        parser = self._parser
        at_start = self._sent == 0
        cut = _marker_cut(held, parser.markers, parser.prefix_markers if at_start else ())
        if cut is None:
            keep = _partial_marker(held, parser.markers, parser.prefix_markers if at_start else ())
            out, self._held = held[: len(held) - keep], held[len(held) - keep :]
        else:
            out, self._held, self._holding = held[:cut], held[cut:], True
        self._sent += len(out)
        return out, []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What was held back: the content after the calls, and the calls (not for "named",
        whose pieces already went out)."""
        mode, text = self.tools.mode, self._held
        self._held = ""
        if mode == "named":
            self.calls = [ToolCall(str(self.tools.name), text)] if _is_json_object(text) else []
            return "", []
        if mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:  # cut short (max_tokens): no call
                return text, []
            self.calls = [ToolCall.of(i["name"], i.get("parameters", {})) for i in items
                          if isinstance(i, dict) and isinstance(i.get("name"), str)]
            content = ""
        else:
            parsed = self._parser.parse(text) if self._holding else None
            if parsed is None or not parsed.calls:
                return text, []
            self.calls = list(parsed.calls)
            content = parsed.content or ""
        self.ids = [_call_id() for _ in self.calls]
        return content, self.call_objects(indexed=True)

    def call_objects(self, indexed: bool = False) -> list[dict[str, Any]]:
        """The calls as OpenAI's ``tool_calls`` (``index`` added for stream deltas)."""
        out = []
        for i, (call, call_id) in enumerate(zip(self.calls, self.ids, strict=True)):
            obj: dict[str, Any] = {"id": call_id, "type": "function",
                                   "function": {"name": call.name, "arguments": call.arguments}}
            out.append({"index": i, **obj} if indexed else obj)
        return out


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _marker_cut(text: str, markers: tuple[str, ...], prefix: tuple[str, ...]) -> int | None:
    """Where the first marker starts in ``text`` (a prefix marker only at its start, after blanks)."""
    found = [i for i in (text.find(m) for m in markers) if i >= 0]
    stripped = text.lstrip()
    if any(stripped.startswith(m) for m in prefix):
        found.append(len(text) - len(stripped))
    return min(found) if found else None


def _partial_marker(text: str, markers: tuple[str, ...], prefix: tuple[str, ...]) -> int:
    """How much of ``text``'s end may be the start of a marker (all of it while it is only
    blanks or a prefix marker's start, at the answer's start)."""
    if prefix and (not text.strip() or any(m.startswith(text.lstrip()) for m in prefix)):
        return len(text)
    longest = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), longest, -1):
            if text.endswith(m[:k]):
                longest = k
                break
    return longest


def _piece(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _top_by_text(tokenizer: Tokenizer, top: tuple[tuple[int, float], ...]) -> dict[str, float]:
    """Completions' alternatives keyed by their text; two ids of one text (halves of characters
    decode alike) fall back to the vocabulary entry, then to the id, so none is lost."""
    out: dict[str, float] = {}
    for token_id, lp in top:
        for key in (_piece(tokenizer, token_id), tokenizer.id_to_token(token_id), f"<id {token_id}>"):
            if key not in out:
                out[key] = lp
                break
    return out


def _failure_body(response_id: str, request_id: str, error: RtpcoreError, params: SamplingParams | None = None
                  ) -> ErrorBody:
    """A failed request's error for its client: its own fault named (a grammar the grammar
    engine gave up on is the client's schema: ``invalid_request_error`` naming its field),
    anything else only pointed at (logged here with both ids)."""
    logger.error("request %s (engine request %s) failed: %s", response_id, request_id, error)
    if isinstance(error, RequestFailedError) and error.reason == "grammar":
        field = getattr(params.grammar, "field", None) if params is not None else None
        return ErrorBody(message=f"{field or 'the schema'}: {error}", type="invalid_request_error", param=field,
                         code="grammar")
    if isinstance(error, RequestFailedError):
        return ErrorBody(message=f"the request failed: {error}", type="server_error", code=error.reason)
    return ErrorBody(message=f"the request failed: the engine could not run it; the server log has the "
                             f"details under request id {response_id}", type="server_error")


def _failure_status(served: _Served, error: RtpcoreError) -> int:
    """The status of a non-streamed request that failed while it ran: 400 for a schema the
    grammar engine gave up on, 503 when the engine itself broke (every request fails now),
    500 for the request's own fault."""
    if isinstance(error, RequestFailedError):
        return 400 if error.reason == "grammar" else 500
    return 503 if served.engine.failure is not None else 500


async def _respond(served: _Served, request: Request, body: Any, ids: list[int], params: SamplingParams,
                   *, chat: bool, tools: _Tools | None = None) -> Any:
    if served.draining:
        raise ApiError(503, "the server is shutting down", type="server_error")
    response = _Response(served, body, ids, params, chat=chat, tools=tools)
    response.submit_first()
    served.responses.add(response)  # until its answer is written (a stream: its generator ends)
    if body.stream:
        return StreamingResponse(response.events(body.include_usage, request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    task = asyncio.ensure_future(response.collect())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        served.responses.discard(response)
    if not task.done():  # the client left before the answer: abort its requests now
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)
    try:
        return JSONResponse(task.result())
    except RtpcoreError as exc:  # this request failed while it ran
        failed = _failure_body(response.id, response.choices[0].request_id, exc, response.params)
        return JSONResponse(failed.wrap(), status_code=_failure_status(served, exc))


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects (the body is read: the next message is that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

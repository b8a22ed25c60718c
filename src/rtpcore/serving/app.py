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
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import attrs
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rtpcore.engine.async_engine import AsyncEngine, RequestStream
from rtpcore.engine.core import RequestOutput
from rtpcore.engine.sampling import SampledToken, SamplingParams
from rtpcore.errors import (
    EngineClosedError,
    InvalidRequestError,
    QueueFullError,
    RequestFailedError,
    RtpcoreError,
)
from rtpcore.serving.chat_template import ChatTemplate
from rtpcore.serving.detokenize import IncrementalDecoder
from rtpcore.serving.metrics import ServerMetrics
from rtpcore.serving.protocol import ChatCompletionRequest, CompletionRequest, ErrorBody
from rtpcore.serving.tokenizer import Tokenizer

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "ApiError", "build_app"]

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
                 model_name: str, api_key: str | None, max_request_bytes: int):
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
        engine.engine._core.step_observers.append(self.metrics.observe_step)
        self.created = int(time.time())
        self.draining = False


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
            message = await receive()
            if message["type"] != "http.request":  # gone before sending it all
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _send_error(send, 413, _too_large(limit))
                return
            chunks.append(chunk)
            more = bool(message.get("more_body"))
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _too_large(limit: int) -> ErrorBody:
    return ErrorBody(message=f"the request body is over the server's limit of {limit} bytes (--max-request-bytes)",
                     type="invalid_request_error", code="request_too_large")


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return ""


async def _send_error(send: Send, status: int, body: ErrorBody) -> None:
    payload = json.dumps(body.wrap()).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
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
) -> FastAPI:
    """The FastAPI app serving ``engine`` as ``model_name``. ``on_shutdown`` runs when the
    app's lifespan ends (after uvicorn has drained or cut the open requests)."""
    served = _Served(engine, tokenizer, chat_template, model_name, api_key, max_request_bytes)

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
        failure = served.engine.engine.failure
        if failure is not None:  # closed, or a rank failed: every request would fail now
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
        params = _params(served, body, ids, limit, "max_tokens", body.logprobs)
        return await _respond(served, request, body, ids, params, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        _check_model(served, body.model)
        ids = await asyncio.to_thread(_render_chat, served, body)
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        limit = body.token_limit if body.token_limit is not None else max(1, served.max_model_len - len(ids))  # chat may run to max_model_len
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = _params(served, body, ids, limit, field, top)
        return await _respond(served, request, body, ids, params, chat=True)

    return app


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
    try:
        text = served.chat_template.render(messages, add_generation_prompt=add, **extra)
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


def _params(served: _Served, body: Any, ids: list[int], limit: int, field: str, logprobs: int | None) -> SamplingParams:
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

    @property
    def request_id(self) -> str:
        return self.stream.request_id if self.stream is not None else "-"

    async def deltas(self) -> AsyncIterator[_Delta]:
        """The choice's deltas until it ends; raises the RtpcoreError of a failed request. A
        choice cut short (its client left, the server stopped) ends as "abort"."""
        assert self.stream is not None
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

    def __init__(self, served: _Served, body: Any, ids: list[int], params: SamplingParams, *, chat: bool):
        self.served, self.params, self.chat, self.model = served, params, chat, body.model
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
        if self.chat:
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
            gone.cancel()
            starter.cancel()
            for task in tasks:
                task.cancel()

    def _failure(self, choice: _Choice, exc: BaseException) -> ErrorBody:
        """What a client is told about its failed request, and the log line with its id."""
        if isinstance(exc, ApiError):
            return exc.body
        error = exc if isinstance(exc, RtpcoreError) else RtpcoreError(f"{type(exc).__name__}: {exc}")
        return _failure_body(self.id, choice.request_id, error)

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


def _failure_body(response_id: str, request_id: str, error: RtpcoreError) -> ErrorBody:
    """A failed request's error for its client: its own fault named, anything else only pointed
    at (logged here with both ids)."""
    logger.error("request %s (engine request %s) failed: %s", response_id, request_id, error)
    if isinstance(error, RequestFailedError):
        return ErrorBody(message=f"the request failed: {error}", type="server_error", code=error.reason)
    return ErrorBody(message=f"the request failed: the engine could not run it; the server log has the "
                             f"details under request id {response_id}", type="server_error")


async def _respond(served: _Served, request: Request, body: Any, ids: list[int], params: SamplingParams,
                   *, chat: bool) -> Any:
    if served.draining:
        raise ApiError(503, "the server is shutting down", type="server_error")
    response = _Response(served, body, ids, params, chat=chat)
    response.submit_first()
    if body.stream:
        return StreamingResponse(response.events(body.include_usage, request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    task = asyncio.ensure_future(response.collect())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():  # the client left before the answer: abort its requests now
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)
    try:
        return JSONResponse(task.result())
    except RtpcoreError as exc:  # this request failed while it ran
        failed = _failure_body(response.id, response.choices[0].request_id, exc)
        return JSONResponse(failed.wrap(), status_code=500)


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects (the body is read: the next message is that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

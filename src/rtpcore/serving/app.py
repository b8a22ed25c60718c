"""The OpenAI-compatible HTTP app over one :class:`~rtpcore.engine.async_engine.AsyncEngine`.

``build_app(...)`` is the app factory: the HTTP layer validates (``protocol``),
renders (chat template, tokenizer) and streams; the engine's own loop thread steps
the model, and each request talks to it through its stream (an asyncio queue).
Aborts travel the same way: a client that disconnects ends its request's stream,
which aborts the request and frees its KV blocks within a step.

Error shape and statuses follow docs/design.md §8: 400 for a malformed or invalid
request (``param`` names the field), 401 for a missing or wrong bearer key, 404 for
another model name, 429 when ``max_waiting`` requests already wait, 503 while the
server drains. A client mistake is never a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rtpcore.engine.async_engine import AsyncEngine
from rtpcore.engine.core import RequestOutput
from rtpcore.engine.sampling import SampledToken, SamplingParams
from rtpcore.errors import (
    EngineClosedError,
    InvalidRequestError,
    QueueFullError,
    RtpcoreError,
)
from rtpcore.serving.chat_template import ChatTemplate
from rtpcore.serving.detokenize import IncrementalDecoder
from rtpcore.serving.metrics import ServerMetrics
from rtpcore.serving.protocol import ChatCompletionRequest, CompletionRequest, ErrorBody
from rtpcore.serving.tokenizer import Tokenizer

__all__ = ["ApiError", "build_app"]

logger = logging.getLogger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


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
                 model_name: str, api_key: str | None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.model_name = model_name
        self.api_key = api_key
        self.max_model_len = engine.engine.max_model_len  # prompt + output, at most
        self.vocab_size = engine.engine.vocab_size
        self.metrics = ServerMetrics(lambda: engine.stats().as_dict())
        engine.engine._core.step_observers.append(self.metrics.observe_step)
        self.created = int(time.time())
        self.draining = False


def build_app(
    engine: AsyncEngine,
    *,
    tokenizer: Tokenizer,
    chat_template: ChatTemplate | None,
    model_name: str,
    api_key: str | None = None,
    on_shutdown: Callable[[], Any] | None = None,
) -> FastAPI:
    """The FastAPI app serving ``engine`` as ``model_name``. ``on_shutdown`` runs when the
    app's lifespan ends (after uvicorn has drained or cut the open requests)."""
    served = _Served(engine, tokenizer, chat_template, model_name, api_key)

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

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body.wrap(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(p) for p in error.get("loc", ()) if p != "body" and not isinstance(p, int)]
        param = ".".join(loc) or None
        message = f"{param}: {error.get('msg')}" if param else str(error.get("msg"))
        body = ErrorBody(message=message, type="invalid_request_error", param=param)
        return JSONResponse(body.wrap(), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:  # a bug of ours, not the client's
        logger.exception("internal error serving %s", request.url.path)
        body = ErrorBody(message=f"internal error: {type(exc).__name__}", type="server_error")
        return JSONResponse(body.wrap(), status_code=500)

    @app.middleware("http")
    async def _auth(request: Request, call_next: Callable[[Request], Any]) -> Response:
        if served.api_key is not None and request.url.path.startswith("/v1/"):
            header = request.headers.get("authorization", "")
            if header != f"Bearer {served.api_key}":
                body = ErrorBody(message="missing or wrong API key (Authorization: Bearer KEY)",
                                 type="authentication_error", code="invalid_api_key")
                return JSONResponse(body.wrap(), status_code=401)
        response: Response = await call_next(request)
        return response

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
            {"id": served.model_name, "object": "model", "created": served.created, "owned_by": "rtpcore"}
        ]}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        _check_model(served, body.model)
        if isinstance(body.prompt, str):
            ids = served.tokenizer.encode(body.prompt, add_special_tokens=True)
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
        if served.chat_template is None:
            raise ApiError(400, "this model has no chat template (chat_template.jinja or tokenizer_config.json's "
                                "chat_template); use /v1/completions", param="messages")
        try:
            text = served.chat_template.render([m.for_template() for m in body.messages], add_generation_prompt=True)
        except RtpcoreError as exc:
            raise ApiError(400, f"messages: {exc}", param="messages") from None
        ids = served.tokenizer.encode(text, add_special_tokens=False)  # the template wrote BOS if any
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        limit = body.token_limit if body.token_limit is not None else max(1, served.max_model_len - len(ids))  # chat may run to max_model_len
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = _params(served, body, ids, limit, field, top)
        return await _respond(served, request, body, ids, params, chat=True)

    return app


def _check_model(served: _Served, model: str) -> None:
    if model != served.model_name:
        raise ApiError(404, f"model {model!r} is not served here; this server serves {served.model_name!r}",
                       param="model", code="model_not_found")


def _params(served: _Served, body: Any, ids: list[int], limit: int, field: str, logprobs: int | None) -> SamplingParams:
    if not ids:
        raise ApiError(400, "the prompt encodes to no tokens", param="prompt" if field == "max_tokens" else "messages")
    if len(ids) + limit > served.max_model_len:
        raise ApiError(400, f"{field}: the prompt's {len(ids)} tokens plus {field}={limit} exceed the model's "
                            f"context of {served.max_model_len} tokens (max_model_len)", param=field,
                       code="context_length_exceeded")
    top_k = body.top_k if body.top_k not in (None, -1, 0) else None
    top_p = body.top_p if body.top_p not in (None, 1.0) else None
    try:
        return SamplingParams(
            max_tokens=limit,
            temperature=1.0 if body.temperature is None else body.temperature,  # OpenAI's default
            top_k=top_k, top_p=top_p, seed=body.seed, logprobs=logprobs, stop=body.stop_strings,
            ignore_eos=body.ignore_eos,
        )
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc), param=getattr(exc, "field", None)) from None


async def _respond(served: _Served, request: Request, body: Any, ids: list[int], params: SamplingParams,
                   *, chat: bool) -> Any:
    if served.draining:
        raise ApiError(503, "the server is shutting down", type="server_error")
    try:
        stream = served.engine.stream(ids, params)
    except QueueFullError as exc:
        raise ApiError(429, str(exc), type="rate_limit_error", code="queue_full") from None
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc), param=getattr(exc, "field", None), code=getattr(exc, "code", None)) from None
    except EngineClosedError as exc:
        raise ApiError(503, str(exc), type="server_error") from None
    run = _Run(served, stream, params, len(ids), chat=chat, model=body.model)
    if body.stream:
        return StreamingResponse(run.events(body.include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    task = asyncio.ensure_future(run.collect())
    while not task.done():  # a client gone before the answer aborts its request
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if not done and await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return Response(status_code=499)
    try:
        return JSONResponse(task.result())
    except RtpcoreError as exc:  # this request's own fault (a model fault on it, a non-finite row)
        raise ApiError(500, f"the request failed: {exc}", type="server_error") from None


class _Run:
    """One request's trip: engine outputs -> text deltas (stop strings cut), usage, metrics."""

    def __init__(self, served: _Served, stream: Any, params: SamplingParams, prompt_tokens: int,
                 *, chat: bool, model: str):
        self.served, self.stream, self.params, self.chat, self.model = served, stream, params, chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0  # prompt tokens the prefix cache held (docs/design.md §14)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.decoder = IncrementalDecoder(served.tokenizer, skip_special_tokens=True, stop=params.stop)
        self.last_time: float | None = None

    async def steps(self) -> AsyncIterator[tuple[str, list[SampledToken]]]:
        """(new text, new tokens' logprobs) per engine output, until the request ends."""
        async with self.stream as stream:
            async for out in stream:
                text, logprobs = self._take(out)
                if self.decoder.stopped:  # a stop string: the text is cut, the request ends here
                    self.finish_reason = "stop"
                    yield text, logprobs
                    return
                if out.finished:
                    if out.finish_reason == "error":
                        raise out.error or RtpcoreError("the request failed")
                    self.finish_reason = "length" if out.finish_reason == "length" else "stop"
                    text += self.decoder.finish()
                    yield text, logprobs
                    return
                if text or logprobs:
                    yield text, logprobs

    def _take(self, out: RequestOutput) -> tuple[str, list[SampledToken]]:
        self._observe(out)
        self.cached_tokens = out.num_cached_tokens
        ids = list(out.token_ids)
        stop_token = out.stop_token_id is not None and bool(ids) and ids[-1] == out.stop_token_id
        if stop_token:
            ids = ids[:-1]
        # One token at a time: an output holds several tokens (a lagging consumer, an accepted
        # speculative run), and tokens after the one completing a stop string are not the client's.
        pieces, taken = [], 0
        for token in ids:
            pieces.append(self.decoder.push([token]))
            taken += 1
            if self.decoder.stopped:
                break
        # a stop token counts, its text is not returned
        self.completion_tokens += taken + (stop_token and not self.decoder.stopped)
        return "".join(pieces), list(out.logprobs or ())[:taken]

    def _observe(self, out: RequestOutput) -> None:
        m = self.served.metrics
        m.generated_tokens.inc(len(out.token_ids))
        for t in out.token_times:
            if self.last_time is None:
                m.time_to_first_token.observe(max(0.0, t - out.arrival_time))
            else:
                m.time_between_tokens.observe(max(0.0, t - self.last_time))
            self.last_time = t
        if out.finished:
            m.requests.labels(finish_reason=out.finish_reason or "").inc()

    @property
    def usage(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    async def collect(self) -> dict[str, Any]:
        texts: list[str] = []
        logprobs: list[SampledToken] = []
        async for text, lp in self.steps():
            texts.append(text)
            logprobs.extend(lp)
        text = "".join(texts)
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish_reason,
                                  "logprobs": self._logprobs(logprobs)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage}

    async def events(self, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: one chunk per piece of text, the finish, usage if asked, [DONE]."""
        try:
            if self.chat:
                yield _sse(self._chunk({"role": "assistant", "content": ""}, None, []))
            async for text, lp in self.steps():
                done = self.finish_reason is not None
                if text or lp or done:
                    yield _sse(self._chunk({"content": text} if self.chat else text, self.finish_reason, lp))
            if include_usage:
                yield _sse({"id": self.id, "object": self._chunk_object, "created": self.created,
                            "model": self.model, "choices": [], "usage": self.usage})
        except RtpcoreError as exc:  # the engine failed mid-stream: say so in the stream
            yield _sse(ErrorBody(message=str(exc), type="server_error").wrap())
        yield "data: [DONE]\n\n"

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, delta: Any, finish: str | None, logprobs: list[SampledToken]) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": self._logprobs(logprobs)}
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        return {"id": self.id, "object": self._chunk_object, "created": self.created, "model": self.model,
                "choices": [choice]}

    def _logprobs(self, tokens: list[SampledToken]) -> dict[str, Any] | None:
        if self.params.logprobs is None:
            return None
        piece = self._piece
        if self.chat:
            return {"content": [
                {"token": piece(t.token_id), "logprob": t.logprob, "bytes": list(piece(t.token_id).encode()),
                 "top_logprobs": [{"token": piece(i), "logprob": lp, "bytes": list(piece(i).encode())}
                                  for i, lp in t.top]}
                for t in tokens
            ]}
        # Completions key the alternatives by token: vocabulary entries, which are unique per
        # id (decoded pieces are not: two ids can each decode to half a character).
        entry = self.served.tokenizer.id_to_token
        return {"tokens": [entry(t.token_id) for t in tokens],
                "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [{entry(i): lp for i, lp in t.top} for t in tokens]}

    def _piece(self, token_id: int) -> str:
        return self.served.tokenizer.decode([token_id], skip_special_tokens=False)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

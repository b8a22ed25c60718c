"""What the handlers of one app share (:class:`Served`): the engine, its text side, the model's
limits, the metrics, the grammar compiler, the requests being answered and the shutdown state.
A router's handler takes it as a parameter annotated :data:`ServedDep` (FastAPI reads
``request.app.state.served``, where ``build_app`` put it)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import attrs
from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from rtpcore.engine.async_engine import AsyncEngine
from rtpcore.engine.sample.grammar import GrammarCompiler
from rtpcore.engine.text.prompts import TextSide
from rtpcore.engine.text.tokenizer import Tokenizer, has_tokenizer
from rtpcore.serving.errors import ApiError
from rtpcore.serving.heap import long_lived
from rtpcore.serving.json_body import BodyParser
from rtpcore.serving.metrics import ServerMetrics
from rtpcore.serving.protocol import MAX_MESSAGES, MESSAGE_ROLES, TEMPLATE_AS_SENT, ErrorBody

__all__ = ["DEFAULT_STREAM_BUFFER_BYTES", "RequestLimits", "Served", "ServedDep", "body_openapi", "json_body",
           "served_state"]

_M = TypeVar("_M", bound=BaseModel)

logger = logging.getLogger(__name__)

# Unsent bytes one streamed response holds before its requests pause (--stream-buffer-bytes). With
# the connection's write buffer (asyncio's 64 KiB high-water mark) and the chunks of the step in
# flight, a stream whose client reads nothing holds under 1 MiB (docs/design.md §17).
DEFAULT_STREAM_BUFFER_BYTES = 768 << 10


@attrs.frozen
class RequestLimits:
    """The caps on one request (docs/design.md §17), each a 400 naming the field and the cap;
    ``rtpcore serve`` has a flag to raise each (``--max-n``, ...)."""

    max_logit_bias: int = 1024  # logit_bias entries
    max_stop_strings: int = 16  # stop strings (each at most protocol.MAX_STOP_LENGTH characters)
    max_stop_token_ids: int = 1024
    max_n: int = 16  # choices (the engine's own limit: rtpcore.engine.sample.params.MAX_N)
    max_tools: int = 128
    max_schema_bytes: int = 4 << 20  # a response_format or tool schema, as JSON


class Served:
    """What the handlers share: the engine, its text side, the model's limits, metrics.

    ``text`` is the engine's own :class:`~rtpcore.engine.text.prompts.TextSide`
    (``engine.engine.text``): the server encodes, renders and detokenizes with the objects
    ``Engine.generate`` and ``Engine.chat`` use. Without a tokenizer -- the checkpoint has no
    ``tokenizer.json`` (a warning), or ``skip_tokenizer`` (``--skip-tokenizer-init``) --
    prompts are token ids, answers carry ``token_ids`` and no text, and whatever needs text
    (text prompts, chat, stop strings, logprobs, response_format, tools) is a 400 naming the
    field and the missing tokenizer (:meth:`require_tokenizer`). The tokenizer and the chat
    template are loaded now, so that a broken one fails before the first request.
    """

    def __init__(self, engine: AsyncEngine, model_name: str, api_key: str | None, max_request_bytes: int,
                 tool_parser: Any = None, *, skip_tokenizer: bool = False, limits: RequestLimits | None = None):
        self.engine = engine
        self.limits = limits or RequestLimits()
        self.text: TextSide = engine.engine.text
        self.no_tokenizer: str | None = None  # why this server has no tokenizer (None: it has one)
        if skip_tokenizer:
            self.no_tokenizer = "this server was started with --skip-tokenizer-init"
        elif not has_tokenizer(self.text.path):
            self.no_tokenizer = f"the checkpoint has no tokenizer ({str(self.text.path / 'tokenizer.json')!r} is missing)"
            logger.warning("serving token ids only: %s; text prompts and chat requests are answered 400",
                           self.no_tokenizer)
        if self.no_tokenizer is not None:
            self.text = self.text.without_tokenizer()
        self.tokenizer: Tokenizer | None = self.text.tokenizer  # loaded now: a broken one ends the start
        if self.tokenizer is not None:  # read once now, not by the first request (TextSide.check_length)
            _ = self.tokenizer.max_chars_per_token
        self.has_chat_template = self.text.has_chat_template  # none: chat completions are a 400
        self.model_name = model_name
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.max_model_len = engine.engine.max_model_len  # prompt + output, at most
        self.vocab_size = engine.engine.vocab_size
        self.metrics = ServerMetrics(lambda: engine.stats().as_dict(), model_name)
        engine.add_step_observer(self.metrics.observe_step)
        self.created = int(time.time())
        self.draining = False  # shutting down: new requests are 503s
        self.cutting = False  # past the shutdown timeout: running requests are aborted
        self.responses: weakref.WeakSet[Any] = weakref.WeakSet()  # the HTTP requests being answered (streaming)
        # Connection rules (docs/design.md §22), set by the server that runs the app (rtpcore.serving.server).
        self.header_timeout: float | None = None  # a request body idle this long is a 408
        self.max_connections: int | None = None
        self.open_connections: Callable[[], int] | None = None
        self.tool_parser = tool_parser  # the ToolCallParser class of --tool-call-parser, or None
        # --enable-prompt-tokens-details: usage reports prompt_tokens_details.cached_tokens (docs/design.md §17)
        self.prompt_tokens_details = False
        self.stream_buffer_bytes = DEFAULT_STREAM_BUFFER_BYTES  # unsent bytes of a stream before its requests pause
        # request bodies, the large ones in a worker process (the guard's), which judges a large
        # chat body's conversation by chat_rules
        self.body_parser = BodyParser(chat_rules=self.chat_rules)
        self.reasoning_parser: type[Any] | None = None  # the ReasoningParser class of --reasoning-parser
        self.reasoning_field = "reasoning"  # the message/delta field the reasoning is in (--reasoning-field)
        self.freeze_heap = False  # the process is the server's own: long-lived builds are frozen (heap)
        self._grammars: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()

    def chat_rules(self) -> dict[str, Any] | None:
        """What the body parser's worker needs to refuse a large chat body's conversation as
        ``requests.render_messages`` would (rtpcore.serving.json_body.chat_refusal): None when
        no length bound holds (no template, no tokenizer, no max_model_len, a tokenizer with no
        longest token). Called once, from the body parser's thread."""
        tok = self.tokenizer
        if not self.has_chat_template or tok is None or self.text.max_model_len is None:
            return None
        per_token = tok.max_chars_per_token
        if per_token is None:
            return None
        template = self.text.chat_template()
        return {
            "model": self.model_name, "templates": dict(template.templates),
            "special_tokens": dict(template.special_tokens), "max_chars": per_token * self.text.max_model_len,
            "max_messages": MAX_MESSAGES, "roles": list(MESSAGE_ROLES), "keys": list(TEMPLATE_AS_SENT),
        }

    def chat_refusal_body(self, refusal: tuple[str, Any]) -> ErrorBody:
        """The 400 of a chat body the body parser's worker refused (:meth:`chat_rules`): the
        words ``requests.render_messages`` uses for the same conversation."""
        kind, detail = refusal
        if kind == "length":
            problem = self.text.length_problem(int(detail), "messages", "rendered conversation")
            if problem is not None:
                return ErrorBody(message=str(problem), type="invalid_request_error", param=problem.field,
                                 code=problem.code)
        return ErrorBody(message=f"messages: {detail}", type="invalid_request_error", param="messages")

    def require_tokenizer(self, what: str, param: str) -> Tokenizer:
        """The tokenizer, or a 400 naming ``param`` on a server without one."""
        if self.tokenizer is None:
            raise ApiError(400, f"{param}: {what} needs a tokenizer, and {self.no_tokenizer}: send the prompt "
                                "as token ids to /v1/completions (answers carry token_ids)", param=param)
        return self.tokenizer

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
                stops = [*self.text.eos_token_ids, *self.text.tokenizer_eos]  # what ends a request (PromptRun)
                if not stops:
                    raise ApiError(400, "this model names no stop token (eos_token_id), which a grammar needs to "
                                        "end: structured outputs and tool calls are unavailable",
                                   param="response_format")
                tokenizer = self.require_tokenizer("structured output", "response_format")
                size = max(self.vocab_size or 0, tokenizer.vocab_size)
                # its imports (torch.compile's, ~200k objects) stay for the process's life
                with long_lived("the grammar compiler") if self.freeze_heap else contextlib.nullcontext():
                    self._grammars = GrammarCompiler(tokenizer, vocab_size=size, stop_token_ids=stops)
            return self._grammars


def served_state(request: Request) -> Served:
    """The :class:`Served` of the app answering ``request`` (a FastAPI dependency)."""
    served: Served = request.app.state.served
    return served


#: A handler parameter annotated so receives the app's :class:`Served`.
ServedDep = Annotated[Served, Depends(served_state)]


def json_body(model: type[_M]) -> Any:
    """A FastAPI dependency: the request body as ``model``, from the JSON the guard parsed (in a
    worker process when large: ``rtpcore.serving.json_body``), so that the event loop never
    parses a large body. A body that is not JSON, or not a valid ``model``, raises FastAPI's
    ``RequestValidationError``, answered as a 400 naming the field, as a body parameter is."""

    async def body(request: Request) -> _M:
        parsed = request.scope.get("state", {}).get("json_body")
        if parsed is None:  # not through the guard (or no body): parse here
            parsed = await served_state(request).body_parser.parse(await request.body())
        if parsed.invalid is not None:
            message, pos = parsed.invalid
            raise RequestValidationError([{"type": "json_invalid", "loc": ("body", pos), "msg": "JSON decode error",
                                           "input": {}, "ctx": {"error": message}}])
        try:
            return model.model_validate(parsed.value)
        except ValidationError as exc:
            raise RequestValidationError(
                [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]) from None

    return Depends(body)


def body_openapi(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` of a route whose body comes through :func:`json_body`: the body's schema."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {
        "title": model.__name__, "type": "object", "description": (model.__doc__ or "").strip()}}}}}

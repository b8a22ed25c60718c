"""Errors of the HTTP boundary: ``ApiError`` (an answer other than 200, in OpenAI's shape), the 400
of a request that fails validation (``param`` names the field), and what a client is told
about a request that failed while it ran."""

from __future__ import annotations

import logging
import re
from contextvars import ContextVar

from fastapi.exceptions import RequestValidationError

from rtpcore.engine.sample.params import SamplingParams
from rtpcore.errors import (
    InvalidRequestError,
    RequestFailedError,
    RtpcoreError,
)
from rtpcore.serving.protocol import (
    ErrorBody,
)

__all__ = ["REQUEST_ID", "ApiError", "failure_body", "failure_status", "validation_body"]

logger = logging.getLogger(__name__)

#: The ``X-Request-Id`` of the HTTP request being answered (set by ``guard.Guard``), for the
#: server's log lines about it.
REQUEST_ID: ContextVar[str | None] = ContextVar("rtpcore_request_id", default=None)

class ApiError(Exception):
    """An answer other than 200, in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.body = ErrorBody(message=message, type=type, param=param, code=code)

    @classmethod
    def invalid_request(cls, exc: InvalidRequestError) -> ApiError:
        """The 400 of a request the engine side refused: its message, ``param`` its field."""
        return cls(400, str(exc), param=exc.field, code=exc.code)


#: What pydantic adds to an error's location for the member of a union it tried (``str``,
#: ``list[dict[str,any]]``, ``function-after[...]``, a model's class name): not a field.
_UNION_MEMBER = re.compile(r"[A-Z]\w*|(?:str|int|float|bool|none|dict|list|tuple|literal|json-or-python|"
                           r"function-\w+|nullable|union|tagged-union)(?:\[.*\])?")


def validation_body(exc: RequestValidationError) -> ErrorBody:
    """The first validation error as OpenAI's 400: ``param`` names the field (``messages[0].content``)."""
    error = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    path = ""
    for part in error.get("loc", ()):
        if part == "body" or (isinstance(part, str) and _UNION_MEMBER.fullmatch(part)):
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


def failure_body(response_id: str, request_id: str, error: RtpcoreError, params: SamplingParams | None = None
                  ) -> ErrorBody:
    """A failed request's error for its client: its own fault named (a grammar the grammar
    engine gave up on is the client's schema: ``invalid_request_error`` naming its field),
    anything else only pointed at (logged here with both ids)."""
    logger.error("request %s (X-Request-Id %s, engine request %s) failed: %s", response_id, REQUEST_ID.get(),
                 request_id, error)
    if isinstance(error, RequestFailedError) and error.reason == "grammar":
        field = getattr(params.grammar, "field", None) if params is not None else None
        return ErrorBody(message=f"{field or 'the schema'}: {error}", type="invalid_request_error", param=field,
                         code="grammar")
    if isinstance(error, RequestFailedError):
        return ErrorBody(message=f"the request failed: {error}", type="server_error", code=error.reason)
    return ErrorBody(message=f"the request failed: the engine could not run it; the server log has the "
                             f"details under request id {response_id}", type="server_error")


def failure_status(error: RtpcoreError, *, engine_broken: bool) -> int:
    """The status of a non-streamed request that failed while it ran: 400 for a schema the
    grammar engine gave up on, 503 when the engine itself broke (every request fails now),
    500 for the request's own fault."""
    if isinstance(error, RequestFailedError):
        return 400 if error.reason == "grammar" else 500
    return 503 if engine_broken else 500

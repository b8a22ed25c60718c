"""Parsing a request body without holding the event loop (docs/design.md §17).

``json.loads`` of a large body is one C call that holds the GIL: a 28 MB body holds it for a
quarter of a second or more, and a worker *thread* would hold the event loop as long. So a body
of :data:`OFFLOAD_BYTES` or more is parsed in a worker *process*
(:class:`BodyParser`; one, started at the first such body): the event loop only hands it the
bytes and takes back the parsed object, which costs a copy, not a parse. The rules a body is
held to before any handler sees it are checked there too: JSON nested deeper than
:data:`MAX_JSON_DEPTH` levels, and lone UTF-16 surrogates in any string or key.

This module imports the standard library only, so that the worker process starts light.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import multiprocessing
import re
import threading
from concurrent.futures import ProcessPoolExecutor
from typing import Any

__all__ = ["MAX_JSON_DEPTH", "OFFLOAD_BYTES", "BodyParser", "Parsed", "json_too_deep", "lone_surrogate", "parse"]

#: The deepest nesting of arrays and objects a request body may have (docs/design.md §17).
MAX_JSON_DEPTH = 64
#: Bodies of this size or more are parsed in the worker process; smaller ones on the event loop,
#: where they take well under a millisecond per 100 KB.
OFFLOAD_BYTES = 256 << 10
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # unrolled: one C loop per run of plain characters
_INNERMOST = re.compile(rb"[\[{][^\[\]{}]*[\]}]")


class Parsed:
    """What :func:`parse` found: ``value`` (the parsed body) when ``ok``; else one of ``too_deep``,
    ``surrogate`` (the path of the string, e.g. ``messages[0].content``) or ``invalid`` (the
    decoder's ``(message, position)``: not JSON)."""

    __slots__ = ("invalid", "ok", "surrogate", "too_deep", "value")

    def __init__(self, value: Any = None, *, too_deep: bool = False, surrogate: str | None = None,
                 invalid: tuple[str, int] | None = None):
        self.value = value
        self.too_deep = too_deep
        self.surrogate = surrogate
        self.invalid = invalid
        self.ok = not too_deep and surrogate is None and invalid is None

    def __reduce__(self) -> Any:  # travels back from the worker process
        return (_rebuild, (self.value, self.too_deep, self.surrogate, self.invalid))


def _rebuild(value: Any, too_deep: bool, surrogate: str | None, invalid: tuple[str, int] | None) -> Parsed:
    return Parsed(value, too_deep=too_deep, surrogate=surrogate, invalid=invalid)


def parse(body: bytes) -> Parsed:
    """``body`` parsed as JSON, after the depth rule and before the surrogate rule."""
    if json_too_deep(body):
        return Parsed(too_deep=True)
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, or bytes that are not UTF-8 text
        return Parsed(invalid=(getattr(exc, "msg", str(exc)), getattr(exc, "pos", 0)))
    if b"\\u" in body:  # only an escape can make a lone surrogate
        where = lone_surrogate(value)
        if where is not None:
            return Parsed(surrogate=where)
    return Parsed(value)


def json_too_deep(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``body`` (JSON or not) nests ``[`` / ``{`` deeper than ``limit``. Linear and in
    C: a body with fewer brackets than that cannot; else strings are cut out, then each pass
    removes the innermost level, ``limit`` passes at most."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    rest = _STRING.sub(b"0", body)
    for _ in range(limit):
        rest, n = _INNERMOST.subn(b"0", rest)
        if n == 0:
            return False
    return b"[" in rest or b"{" in rest


def lone_surrogate(value: Any) -> str | None:
    """The path (``messages[0].content``) of the first string in a parsed JSON body that holds
    a lone UTF-16 surrogate (a ``\\ud800`` escape with no partner: valid JSON, but no text a
    tokenizer can take), or None. Keys are checked too. Iterative: any depth."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if _has_surrogate(item):
                return path or "body"
        elif isinstance(item, dict):
            for key, sub in reversed(list(item.items())):
                name = str(key).encode("utf-8", "backslashreplace").decode("utf-8")  # a surrogate as \\udXXX
                where = f"{path}.{name}" if path else name
                if isinstance(key, str) and _has_surrogate(key):
                    return where
                stack.append((where, sub))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", sub) for i, sub in reversed(list(enumerate(item))))
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class BodyParser:
    """Parses request bodies: small ones at once, large ones (``offload_bytes`` or more) in one
    worker process, started (spawned: a fresh interpreter that imports only this module) at the
    first large body and stopped by :meth:`close` or at exit. A worker that dies is replaced at
    the next large body."""

    def __init__(self, offload_bytes: int = OFFLOAD_BYTES):
        self.offload_bytes = offload_bytes
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    async def parse(self, body: bytes) -> Parsed:
        if len(body) < self.offload_bytes:
            return parse(body)
        pool = self._worker()
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, parse, body)
        except Exception:  # the worker died (BrokenProcessPool) or could not start: parse here, start anew next time
            self._discard(pool)
            return await asyncio.to_thread(parse, body)

    def _worker(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
                atexit.register(self._pool.shutdown, wait=False, cancel_futures=True)
            return self._pool

    def _discard(self, pool: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is pool:
                self._pool = None
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stop the worker process, if one runs."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

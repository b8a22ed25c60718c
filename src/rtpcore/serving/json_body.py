"""Parsing a request body without holding the event loop (docs/design.md §17).

``json.loads`` of a large body is one C call that holds the GIL: a 28 MB body holds it for a
quarter of a second or more, and a worker *thread* would hold the event loop as long. So a body
of :data:`OFFLOAD_BYTES` or more is parsed in a worker *process*
(:class:`BodyParser`; one, this file run as a script): the event loop only hands it the
bytes and takes back the parsed object, which costs a copy, not a parse. The rules a body is
held to before any handler sees it are checked there too: JSON nested deeper than
:data:`MAX_JSON_DEPTH` levels, and lone UTF-16 surrogates in any string or key.

This module imports the standard library only, so that the worker process starts light.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import pickle
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

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


def _background() -> None:
    """The worker process's start: a lower CPU priority (nice +10), so that where cores are
    few the server's event loop and engine, and the processes of other clients, run first when
    they have work (measured by benchmarks/bench_hostile.py on 2 cores: a 28 MB parse at the
    same priority left /health unanswered for up to 190 ms). The worker holds no lock the server
    waits on, so its priority never holds the server back."""
    with contextlib.suppress(OSError):  # not permitted, or no such call: the same priority then
        os.nice(10)


def _write_frame(stream: IO[bytes], data: bytes) -> None:
    """One length-prefixed frame, whole (``stream`` may be unbuffered: each write may take part)."""
    for part in (len(data).to_bytes(8, "little"), data):
        view, sent = memoryview(part), 0
        while sent < len(part):
            sent += stream.write(view[sent:]) or 0
    stream.flush()


def _read_frame(stream: IO[bytes]) -> bytearray:
    """One length-prefixed frame; EOFError when the stream ends before it does."""
    head = _read_exactly(stream, bytearray(8))
    return _read_exactly(stream, bytearray(int.from_bytes(head, "little")))


def _read_exactly(stream: IO[bytes], buf: bytearray) -> bytearray:
    view, got = memoryview(buf), 0
    while got < len(buf):
        n = stream.readinto(view[got:])  # type: ignore[attr-defined]
        if not n:
            raise EOFError("the stream ended inside a frame")
        got += n
    return buf


def _worker_main() -> None:
    """The worker process: parse each body framed on stdin, answer each on stdout, until stdin
    ends. It runs this file as a script (``python -I json_body.py``): the standard library
    only, no rtpcore package, and nothing of the server's ``__main__``."""
    _background()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            body = bytes(_read_frame(stdin))
        except EOFError:
            return
        found = parse(body)
        _write_frame(stdout, pickle.dumps((found.value, found.too_deep, found.surrogate, found.invalid),
                                          protocol=pickle.HIGHEST_PROTOCOL))


class BodyParser:
    """Parses request bodies: small ones at once, large ones (``offload_bytes`` or more) in one
    worker process, one body at a time, and stopped by :meth:`close` or at exit. The worker is
    this file run as a script by a fresh interpreter (``python -I``; not ``multiprocessing``,
    whose spawned children import the parent's ``__main__`` again: a launcher script without a
    main guard would start a second server), at a lower CPU priority; started by :meth:`start`
    or at the first large body. A worker that dies is replaced at the next large body; the body
    it died on is parsed in this process."""

    def __init__(self, offload_bytes: int = OFFLOAD_BYTES):
        self.offload_bytes = offload_bytes
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # the worker's pipes, one body at a time
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rtpcore-body")  # waits on them
        self._at_exit = False  # close() is registered to run at exit

    async def parse(self, body: bytes) -> Parsed:
        if len(body) < self.offload_bytes:
            return parse(body)
        return await asyncio.get_running_loop().run_in_executor(self._io, self._parse_in_worker, body)

    def start(self) -> None:
        """Start the worker process now (the app's start), not at the first large body: starting
        a process from a server holding gigabytes is itself a pause of every thread."""
        self._parse_in_worker(b"{}")

    def worker_pid(self) -> int | None:
        """The worker process's id, None when none runs."""
        with self._lock:
            return None if self._proc is None else self._proc.pid

    def _parse_in_worker(self, body: bytes) -> Parsed:
        with self._lock:
            try:
                if self._proc is None or self._proc.poll() is not None:
                    self._proc = subprocess.Popen([sys.executable, "-I", __file__], stdin=subprocess.PIPE,
                                                  stdout=subprocess.PIPE, bufsize=0)
                    if not self._at_exit:
                        atexit.register(self.close)
                        self._at_exit = True
                assert self._proc.stdin is not None and self._proc.stdout is not None
                _write_frame(self._proc.stdin, body)
                value, too_deep, surrogate, invalid = pickle.loads(_read_frame(self._proc.stdout))
            except (OSError, EOFError, ValueError, pickle.UnpicklingError):  # it died, or could not start
                self._stop_locked()
                return parse(body)
        return Parsed(value, too_deep=too_deep, surrogate=surrogate, invalid=invalid)

    def _stop_locked(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        try:
            proc.wait(timeout=5)  # stdin closed: it ends at once
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """Stop the worker process, if one runs."""
        with self._lock:
            self._stop_locked()


if __name__ == "__main__":
    _worker_main()

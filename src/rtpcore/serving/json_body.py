"""Parsing a request body without holding the event loop (docs/design.md §17).

``json.loads`` of a large body is one C call that holds the GIL: a 28 MB body holds it for a
quarter of a second or more, and a worker *thread* would hold the event loop as long. So a body
of :data:`OFFLOAD_BYTES` or more is parsed in a worker *process*
(:class:`BodyParser`; one, this file run as a script): the event loop only hands it the
bytes and takes back the parsed object, which costs a copy, not a parse. The rules a body is
held to before any handler sees it are checked there too: JSON nested deeper than
:data:`MAX_JSON_DEPTH` levels, and lone UTF-16 surrogates in any string or key.

A chat-completions body that large is also measured there (:func:`chat_refusal`): its
conversation rendered by the chat template exactly as the server would render it, and refused
when it is certain to be over ``max_model_len`` (or when the template refuses it), so that a
conversation of megabytes is never unpickled, rendered or measured by the server's process. The
server hands the worker what that takes (:class:`BodyParser`'s ``chat_rules``: the template,
its special tokens, the longest prompt in characters, the model's name, the message fields whose
values reach the template as sent). A body of any other shape (tools, template arguments, a
message field the server transforms) is left to the server, which renders it as always.

This module imports the standard library only, so that the worker process starts light; the
chat template's renderer (rtpcore.engine.text.chat_template, with jinja2) is imported by the
worker at its first chat body.
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

__all__ = [
    "MAX_JSON_DEPTH", "OFFLOAD_BYTES", "BodyParser", "Parsed", "chat_refusal", "json_too_deep", "lone_surrogate", "parse",
]

#: The deepest nesting of arrays and objects a request body may have (docs/design.md §17).
MAX_JSON_DEPTH = 64
#: Bodies of this size or more are parsed in the worker process; smaller ones on the event loop,
#: where they take well under a millisecond per 100 KB.
OFFLOAD_BYTES = 256 << 10
_RULES, _BODY, _CHAT = b"R", b"B", b"C"  # a frame to the worker: its first byte says what the rest is
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # unrolled: one C loop per run of plain characters
_INNERMOST = re.compile(rb"[\[{][^\[\]{}]*[\]}]")


class Parsed:
    """What :func:`parse` found: ``value`` (the parsed body) when ``ok``; else one of ``too_deep``,
    ``surrogate`` (the path of the string, e.g. ``messages[0].content``), ``invalid`` (the
    decoder's ``(message, position)``: not JSON) or ``refusal`` (a chat body's conversation
    refused by the worker, :func:`chat_refusal`; ``value`` is then None)."""

    __slots__ = ("invalid", "ok", "refusal", "surrogate", "too_deep", "value")

    def __init__(self, value: Any = None, *, too_deep: bool = False, surrogate: str | None = None,
                 invalid: tuple[str, int] | None = None, refusal: tuple[str, Any] | None = None):
        self.value = value
        self.too_deep = too_deep
        self.surrogate = surrogate
        self.invalid = invalid
        self.refusal = refusal
        self.ok = not too_deep and surrogate is None and invalid is None and refusal is None


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


def chat_refusal(value: Any, rules: dict[str, Any]) -> tuple[str, Any] | None:
    """Whether the chat-completions body ``value`` (parsed) is certain to be refused for its
    conversation, judged as the server would judge it: ``("length", characters)`` when the
    conversation rendered by the chat template is longer than ``rules["max_chars"]`` (the
    longest prompt this model's tokenizer can fit in max_model_len), ``("template", message)``
    when the template refuses the conversation; None when it fits, or when the body is not of
    the shape judged here exactly: its ``model`` the served one, no tools, template arguments or
    continued final message, and messages whose fields are only ``rules["keys"]``, each a
    string, a content a string or a list of text parts (joined, as the server joins them).
    The template's source is compiled once per process (``ChatTemplate``'s own cache)."""
    if not isinstance(value, dict) or value.get("model") != rules["model"]:
        return None
    if any(value.get(k) is not None for k in ("tools", "chat_template_kwargs", "reasoning_effort")):
        return None
    final, generation = value.get("continue_final_message"), value.get("add_generation_prompt")
    if final not in (None, False) or generation not in (None, True, False):
        return None
    messages = value.get("messages")
    if not isinstance(messages, list) or not 0 < len(messages) <= rules["max_messages"]:
        return None
    chat = []
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in rules["roles"]:
            return None
        plain: dict[str, str] = {}
        for key, item in message.items():
            if item is None:
                continue
            if key not in rules["keys"]:
                return None
            if key == "content" and isinstance(item, list):
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in item):
                    return None
                item = "".join(p["text"] for p in item)
            if not isinstance(item, str):
                return None
            plain[key] = item
        chat.append(plain)
    try:
        from rtpcore.engine.text.chat_template import ChatTemplate
        from rtpcore.errors import ChatTemplateError
    except ImportError:  # not where the server is: the server judges the body
        return None
    template = ChatTemplate(rules["templates"], special_tokens=rules["special_tokens"])
    try:
        text = template.render(chat, add_generation_prompt=True if generation is None else generation)
    except ChatTemplateError as exc:
        return ("template", str(exc))
    return ("length", len(text)) if len(text) > rules["max_chars"] else None


def _background() -> None:
    """The worker process's start: a lower CPU priority (nice +10), so that where cores are
    few the server's event loop and engine, and the processes of other clients, run first when
    they have work (measured by benchmarks/bench_hostile.py on 2 cores: a 28 MB parse at the
    same priority left /health unanswered for up to 190 ms). The worker holds no lock the server
    waits on, so its priority never holds the server back."""
    with contextlib.suppress(OSError):  # not permitted, or no such call: the same priority then
        os.nice(10)


def _write_frame(stream: IO[bytes], data: bytes | tuple[bytes, bytes]) -> None:
    """One length-prefixed frame, whole (``stream`` may be unbuffered: each write may take part);
    a pair is written as one frame of both, without joining them."""
    parts = data if isinstance(data, tuple) else (data,)
    for part in (sum(len(p) for p in parts).to_bytes(8, "little"), *parts):
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
    only, nothing of the server's ``__main__``, and of rtpcore the chat template's renderer
    alone, at the first chat body (:func:`chat_refusal`)."""
    _background()
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or ".") == here:  # the serving package's files are no modules here
        del sys.path[0]
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    rules: dict[str, Any] | None = None
    while True:
        try:
            frame = _read_frame(stdin)
        except EOFError:
            return
        tag, body = frame[:1], bytes(memoryview(frame)[1:])
        if tag == _RULES:
            rules = pickle.loads(body)
            continue
        found = parse(body)
        refusal = None
        if tag == _CHAT and found.ok and rules is not None:
            try:
                refusal = chat_refusal(found.value, rules)
            except Exception:  # the server renders the body itself, and answers whatever this was
                refusal = None
        answer = (None if refusal else found.value, found.too_deep, found.surrogate, found.invalid, refusal)
        _write_frame(stdout, pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL))


class BodyParser:
    """Parses request bodies: small ones at once, large ones (``offload_bytes`` or more) in one
    worker process, one body at a time, and stopped by :meth:`close` or at exit. The worker is
    this file run as a script by a fresh interpreter (``python -I``; not ``multiprocessing``,
    whose spawned children import the parent's ``__main__`` again: a launcher script without a
    main guard would start a second server), at a lower CPU priority; started by :meth:`start`
    or at the first large body. A worker that dies is replaced at the next large body; the body
    it died on is parsed in this process. ``chat_rules``: called once, where the worker starts,
    for what :func:`chat_refusal` needs (None: large chat bodies are only parsed)."""

    def __init__(self, offload_bytes: int = OFFLOAD_BYTES,
                 chat_rules: Callable[[], dict[str, Any] | None] | None = None):
        self.offload_bytes = offload_bytes
        self._chat_rules = chat_rules
        self._rules: bytes | None = None  # chat_rules(), pickled once
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # the worker's pipes, one body at a time
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rtpcore-body")  # waits on them
        self._at_exit = False  # close() is registered to run at exit

    async def parse(self, body: bytes, *, chat: bool = False) -> Parsed:
        """``body`` parsed; a large one in the worker, which also judges its conversation when
        ``chat`` (a /v1/chat/completions body: :func:`chat_refusal`)."""
        if len(body) < self.offload_bytes:
            return parse(body)
        return await asyncio.get_running_loop().run_in_executor(self._io, self._parse_in_worker, body, chat)

    def start(self) -> None:
        """Start the worker process now (the app's start), not at the first large body: starting
        a process from a server holding gigabytes is itself a pause of every thread."""
        self._parse_in_worker(b"{}")

    def worker_pid(self) -> int | None:
        """The worker process's id, None when none runs."""
        with self._lock:
            return None if self._proc is None else self._proc.pid

    def _parse_in_worker(self, body: bytes, chat: bool = False) -> Parsed:
        with self._lock:
            try:
                if self._proc is None or self._proc.poll() is not None:
                    self._stop_locked()  # a worker that died: its pipes closed, it reaped
                    if self._rules is None and self._chat_rules is not None:
                        self._rules = pickle.dumps(self._chat_rules(), protocol=pickle.HIGHEST_PROTOCOL)
                    self._proc = subprocess.Popen([sys.executable, "-I", __file__], stdin=subprocess.PIPE,
                                                  stdout=subprocess.PIPE, bufsize=0)
                    if not self._at_exit:
                        atexit.register(self.close)
                        self._at_exit = True
                    if self._rules is not None:
                        assert self._proc.stdin is not None
                        _write_frame(self._proc.stdin, _RULES + self._rules)
                assert self._proc.stdin is not None and self._proc.stdout is not None
                _write_frame(self._proc.stdin, (_CHAT if chat else _BODY, body))
                value, too_deep, surrogate, invalid, refusal = pickle.loads(_read_frame(self._proc.stdout))
            except (OSError, EOFError, ValueError, pickle.UnpicklingError):  # it died, or could not start
                self._stop_locked()
                return parse(body)
        return Parsed(value, too_deep=too_deep, surrogate=surrogate, invalid=invalid, refusal=refusal)

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

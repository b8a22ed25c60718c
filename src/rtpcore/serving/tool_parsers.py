"""The built-in tool-call parsers, and finding one by name (docs/design.md §16).

``hermes``: Hermes / Qwen 2.5+ style -- each call is ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``; the text outside the tags is content. ``llama3_json``: Llama 3.1+ JSON
tool calling -- the answer is one JSON object ``{"name": ..., "parameters": {...}}`` (or
``"arguments"``), several separated by ``;``, optionally after ``<|python_tag|>``.

Both are incremental (docs/design.md §17): the server feeds them each streamed piece of text
from the first marker on, and the work per piece is bounded by the piece, not by the answer so
far (``scanned`` counts the characters each examined). ``parse`` is a fresh parser fed the
whole answer at once.

Plugins add parsers for their models through the ``rtpcore_register_tool_parsers`` hook
(``rtpcore.plugins.tool_parser``); :func:`find_tool_parser` looks in both.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from rtpcore.plugins.tool_parser import ParsedToolCalls, ToolCall, ToolCallParser

__all__ = ["BUILTIN", "HermesParser", "Llama3JsonParser", "find_tool_parser", "tool_parser_names"]


def _call_from(obj: Any, *argument_keys: str) -> ToolCall | None:
    """A call from a parsed JSON object with a string ``name`` and an object of arguments."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in argument_keys:
        if key in obj:
            args = obj[key]
            return ToolCall.of(obj["name"], args) if isinstance(args, dict) else None
    return ToolCall.of(obj["name"], {})


class HermesParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``: a call is the text from a
    ``<tool_call>`` to the first ``</tool_call>`` after it; one whose JSON is not a call stays
    text, as does a ``<tool_call>`` never closed. Incremental: each character fed is examined
    once (twice inside a call: found, then read as JSON), and each call is returned by the
    :meth:`feed` that closes it. ``scanned`` counts the characters examined."""

    name = "hermes"
    markers = ("<tool_call>",)
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, tools: Sequence[Mapping[str, Any]] = ()):
        super().__init__(tools)
        self._content: list[str] = []  # the text outside well-formed calls, in order
        self._call: list[str] | None = None  # the call being read (after its OPEN); None outside one
        self._tail = ""  # the end of the text fed that may be the start of the marker looked for
        self._found = False  # a call was returned
        self.scanned = 0

    def parse(self, text: str) -> ParsedToolCalls:
        return _whole(self, text)

    def feed(self, text: str) -> tuple[ToolCall, ...]:
        buf, self._tail = self._tail + text, ""
        calls: list[ToolCall] = []
        at = 0
        while True:
            call = self._call
            marker = self.OPEN if call is None else self.CLOSE
            i = buf.find(marker, at)
            self.scanned += (len(buf) if i < 0 else i + len(marker)) - at
            if i < 0:
                keep = _partial_tail(buf, at, (marker,))
                piece, self._tail = buf[at : len(buf) - keep], buf[len(buf) - keep :]
                (self._content if call is None else call).append(piece)
                return tuple(calls)
            if call is None:
                self._content.append(buf[at:i])
                self._call = []
            else:
                call.append(buf[at:i])
                body = "".join(call)
                self._call = None
                self.scanned += len(body)
                found = _json_call(body.strip(), "arguments", "parameters")
                if found is None:  # not a well-formed call: it stays text
                    self._content.append(self.OPEN + body + self.CLOSE)
                else:
                    calls.append(found)
                    self._found = True
            at = i + len(marker)

    def finish(self) -> ParsedToolCalls:
        if self._call is not None:  # never closed: text
            self._content.append(self.OPEN + "".join(self._call))
            self._call = None
        self._content.append(self._tail)
        text, self._content, self._tail = "".join(self._content), [], ""
        if not self._found:
            return ParsedToolCalls(text)
        return ParsedToolCalls(text.strip() or None)


class Llama3JsonParser(ToolCallParser):
    """The whole answer (blanks around it aside, after an optional ``<|python_tag|>``) is one
    or more JSON objects ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``) separated
    by blanks or ``;``; anything else makes it text. Incremental: each object's end is found
    as its text arrives (a scan that tracks braces and strings) and it is read once then;
    since text after the calls can still make the answer text, the calls come with
    :meth:`finish`. ``scanned`` counts the characters examined."""

    name = "llama3_json"
    prefix_markers = ("<|python_tag|>", "{")
    TAG = "<|python_tag|>"
    _OBJECT = re.compile(r'[{}"]')  # what changes the scan's state outside a string
    _STRING = re.compile(r'["\\]')  # ... inside one
    _SEPARATOR = re.compile(r"[^ \n\t;]")  # the first character that is not a separator
    _NON_BLANK = re.compile(r"\S")

    def __init__(self, tools: Sequence[Mapping[str, Any]] = ()):
        super().__init__(tools)
        self._text: list[str] = []  # everything fed: the content when it is not calls
        self._state = "start"  # start, tagged, object, between, trailing (blanks only), failed
        self._head = ""  # start: what came of the python tag so far
        self._object: list[str] = []
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._calls: list[ToolCall] = []
        self.scanned = 0

    def parse(self, text: str) -> ParsedToolCalls:
        return _whole(self, text)

    def feed(self, text: str) -> tuple[ToolCall, ...]:
        self._text.append(text)
        at = 0
        while at < len(text) and self._state != "failed":
            at = self._step(text, at)
        return ()

    def _step(self, text: str, at: int) -> int:
        """Advance the scan from ``at`` in one state; where it stopped."""
        state = self._state
        if state in ("start", "tagged", "trailing"):
            m = self._NON_BLANK.search(text, at)
            self.scanned += (m.start() if m else len(text)) - at
            if m is None:
                return len(text)
            at = m.start()
            if state == "trailing":
                self._state = "failed"
            elif state == "start" and (self._head or text[at] == "<"):
                need = self.TAG[len(self._head) :]
                piece = text[at : at + len(need)]
                self.scanned += len(piece)
                if not need.startswith(piece):
                    self._state = "failed"
                    return at
                self._head += piece
                if self._head == self.TAG:
                    self._state = "tagged"
                return at + len(piece)
            else:
                self._state = "object" if text[at] == "{" else "failed"
            return at
        if state == "between":
            m = self._SEPARATOR.search(text, at)
            self.scanned += (m.start() if m else len(text)) - at
            if m is None:
                return len(text)
            at = m.start()
            self._state = "object" if text[at] == "{" else "trailing" if text[at].isspace() else "failed"
            return at
        return self._scan_object(text, at)

    def _scan_object(self, text: str, at: int) -> int:
        start, closed = at, False
        while at < len(text) and not closed:
            if self._escaped:
                self._escaped, at = False, at + 1
                continue
            m = (self._STRING if self._in_string else self._OBJECT).search(text, at)
            if m is None:
                at = len(text)
                break
            at, c = m.end(), m.group()
            if c == "\\":
                self._escaped = True
            elif c == '"':
                self._in_string = not self._in_string
            elif c == "{":
                self._depth += 1
            else:
                self._depth -= 1
                closed = self._depth == 0
        self.scanned += at - start
        self._object.append(text[start:at])
        if closed:
            body, self._object = "".join(self._object), []
            self.scanned += len(body)
            call = _json_call(body, "parameters", "arguments")
            if call is None:
                self._state = "failed"
            else:
                self._calls.append(call)
                self._state = "between"
        return at

    def finish(self) -> ParsedToolCalls:
        text, self._text = "".join(self._text), []
        if self._state in ("between", "trailing") and self._calls:
            return ParsedToolCalls(None, tuple(self._calls))
        return ParsedToolCalls(text)


def _whole(parser: ToolCallParser, text: str) -> ParsedToolCalls:
    """``parse`` as a fresh parser of the same class fed the whole answer, then finished."""
    fresh = type(parser)(parser.tools)
    calls = fresh.feed(text)
    rest = fresh.finish()
    return ParsedToolCalls(rest.content, calls + rest.calls)


def _json_call(text: str, *argument_keys: str) -> ToolCall | None:
    """The call a JSON text holds, or None (not JSON, nested past the parser's depth, or not a call)."""
    try:
        return _call_from(json.loads(text), *argument_keys)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        return None


def _partial_tail(text: str, start: int, markers: tuple[str, ...]) -> int:
    """How many characters at the end of ``text[start:]`` may be the start of a marker."""
    longest = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text) - start), longest, -1):
            if text.endswith(m[:k]):
                longest = k
                break
    return longest


BUILTIN: dict[str, type[ToolCallParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}


def find_tool_parser(name: str, registry: Any = None) -> type[ToolCallParser] | None:
    """The parser class named ``name``: built in, or registered by a loaded plugin."""
    if name in BUILTIN:
        return BUILTIN[name]
    return registry.get_tool_parser(name) if registry is not None else None


def tool_parser_names(registry: Any = None) -> list[str]:
    """Every parser name ``--tool-call-parser`` accepts, sorted."""
    return sorted({*BUILTIN, *(registry.tool_parser_names() if registry is not None else ())})

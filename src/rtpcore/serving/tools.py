"""Tool calls in answers: how a choice's text becomes content and tool-call deltas as it
streams and at its end (``named``, ``required`` and ``auto`` tool_choice)."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from rtpcore.plugins.tool_parser import ToolCall

__all__ = ['ToolStream', 'Tools', 'tool_finish']

logger = logging.getLogger(__name__)

def tool_finish(reason: str | None) -> str | None:
    """A choice that called tools ends with "tool_calls" (unless it was cut: "length", "abort")."""
    return "tool_calls" if reason in (None, "stop") else reason


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class Tools:
    """How the choices of one request become tool calls: ``mode`` "named" (the output is the
    named function's arguments), "required" (a JSON array of ``{"name", "parameters"}``) or
    "auto" (``parser`` finds the calls in free text)."""

    def __init__(self, mode: str, *, name: str | None = None, parser: Any = None,
                 tools: Sequence[dict[str, Any]] = ()):
        self.mode, self.name, self.parser, self.tools = mode, name, parser, tools

    def stream(self) -> ToolStream:
        return ToolStream(self)


class ToolStream:
    """One choice's text -> content and tool-call deltas, as it streams (``feed``) and at its
    end (``finish``); ``calls`` holds the calls found. The work per piece of text is bounded by
    the piece (docs/design.md §17; this runs on the event loop): before a marker, only what may
    be a marker's start is held back (and, at the answer's start, the blanks before it); from
    the marker on, each piece goes to the parser (``ToolCallParser.feed``), whose calls stream
    as they complete."""

    def __init__(self, tools: Tools):
        self.tools = tools
        self.calls: list[ToolCall] = []
        self.ids: list[str] = []
        self._held = ""  # auto: text that may be (the start of) a call, before a marker was seen
        self._blank = True  # auto: _held is all blanks (what a prefix marker may follow)
        self._pieces: list[str] = []  # named, required: the output so far, read at the end
        self._holding = False  # auto: a marker was seen; everything from it on goes to the parser
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
            self._pieces.append(text)
            if text:
                pieces.append({"index": 0, "function": {"arguments": text}})
            return "", pieces
        if mode == "required":
            self._pieces.append(text)
            return "", []
        parser = self._parser
        if self._holding:
            return "", self._found(parser.feed(text)) if text else []
        # auto: stream content until it may be a call
        at_start = self._sent == 0
        if at_start and self._blank and not text.strip():  # blanks at the start: held, as a prefix marker may follow
            self._held += text
            return "", []
        held = self._held + text
        prefix = parser.prefix_markers if at_start else ()
        cut = _marker_cut(held, parser.markers, prefix)
        calls: list[dict[str, Any]] = []
        if cut is None:
            keep = _partial_marker(held, parser.markers, prefix)
            out, self._held = held[: len(held) - keep], held[len(held) - keep :]
        else:
            out, self._held, self._holding = held[:cut], "", True
            calls = self._found(parser.feed(held[cut:]))
        self._sent += len(out)
        self._blank = self._sent == 0 and not self._held.strip()
        return out, calls

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What was held back: the content after the calls, and the calls not streamed yet
        (none for "named", whose pieces already went out)."""
        mode = self.tools.mode
        if mode in ("named", "required"):
            text, self._pieces = "".join(self._pieces), []
            if mode == "named":
                self.calls = [ToolCall(str(self.tools.name), text)] if _is_json_object(text) else []
                return "", []
            try:
                items = json.loads(text)
            except (ValueError, RecursionError):  # cut short (max_tokens): no call
                return text, []
            if not isinstance(items, list):
                return text, []
            return "", self._found(ToolCall.of(i["name"], i.get("parameters", {})) for i in items
                                   if isinstance(i, dict) and isinstance(i.get("name"), str))
        if not self._holding:
            rest, self._held = self._held, ""
            return rest, []
        parsed = self._parser.finish()  # without any call, its content is the whole text fed
        return parsed.content or "", self._found(parsed.calls)

    def _found(self, calls: Iterable[ToolCall]) -> list[dict[str, Any]]:
        """Record new calls; their stream pieces, each whole (``index``, ``id``, ``type``,
        ``function``)."""
        out = []
        for call in calls:
            self.calls.append(call)
            self.ids.append(_call_id())
            out.append({"index": len(self.calls) - 1, "id": self.ids[-1], "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments}})
        return out

    def call_objects(self) -> list[dict[str, Any]]:
        """The calls as OpenAI's ``tool_calls`` of a whole message."""
        return [{"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                for call, call_id in zip(self.calls, self.ids, strict=True)]


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
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

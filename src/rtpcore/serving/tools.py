"""Tool calls in answers: how a choice's text becomes content and tool-call deltas as it
streams and at its end (``named``, ``required`` and ``auto`` tool_choice)."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Sequence
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
    end (``finish``); ``calls`` holds the calls found."""

    def __init__(self, tools: Tools):
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

"""DeepSeek-V3's tool-call format, as a parser ``rtpcore serve --tool-call-parser deepseek_v3``
finds through the ``rtpcore_register_tool_parsers`` hook.

DeepSeek-V3 writes its calls between its own tokens::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

several calls one after another inside the begin/end pair; text before them is content.

The parser is incremental (docs/design.md §17): the server feeds it the answer piece by piece
from ``<｜tool▁calls▁begin｜>`` on, each call is returned by the piece that ends it, and every
character is examined a bounded number of times, however many markers the answer holds
(``scanned`` counts them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from rtpcore import ParsedToolCalls, ToolCall, ToolCallParser

__all__ = ["DeepseekV3ToolParser"]

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
SEP = "<｜tool▁sep｜>"
ARGS_END = "\n```<｜tool▁call▁end｜>"
_WORD = re.compile(r"\w*")
_FENCES = ("```json\n", "```\n")


class DeepseekV3ToolParser(ToolCallParser):
    """A call is ``<｜tool▁call▁begin｜>TYPE<｜tool▁sep｜>NAME`` up to the first newline, then
    ```` ```json ```` (or ```` ``` ````) and a newline, then the arguments up to the first
    ``\n```<｜tool▁call▁end｜>``; calls are looked for from the first
    ``<｜tool▁calls▁begin｜>`` on. A call of another TYPE, or whose arguments are not a JSON
    object, is skipped; one that is malformed is text, and calls are looked for again after it.
    With calls, the content is the text before ``<｜tool▁calls▁begin｜>`` and after the first
    ``<｜tool▁calls▁end｜>``; without, the whole answer.

    Incremental: the scan keeps where it stopped (``_state`` and ``_pos`` in ``_buf``, which
    holds the text from the call being read on), so each character is examined a bounded
    number of times whatever the pieces."""

    name = "deepseek_v3"
    markers = (CALLS_BEGIN,)

    def __init__(self, tools: Sequence[Mapping[str, Any]] = ()):
        super().__init__(tools)
        self._text: list[str] = []  # everything fed (the content when no call is found)
        self._begun = False  # CALLS_BEGIN was seen
        self._head = ""  # before it: the tail that may be its start
        self._before: list[str] = []  # the text before CALLS_BEGIN
        self._end_scan = ""  # after it: the tail that may be the start of CALLS_END
        self._after: list[str] | None = None  # the text after the first CALLS_END, once seen
        self._buf = ""  # the text from the call being read (or the tail that may begin one)
        self._state = "seek"  # seek, type, sep, name, fence, args
        self._pos = 0  # where the scan of _buf resumes
        self._sep = 0  # where the type ended (the separator starts)
        self._fence = 0  # where the line after the name starts
        self._args = 0  # where the arguments start
        self._found = False
        self.scanned = 0

    def parse(self, text: str) -> ParsedToolCalls:
        fresh = type(self)(self.tools)
        calls = fresh.feed(text)
        rest = fresh.finish()
        return ParsedToolCalls(rest.content, calls + rest.calls)

    def feed(self, text: str) -> tuple[ToolCall, ...]:
        self._text.append(text)
        if not self._begun:
            buf = self._head + text
            i = buf.find(CALLS_BEGIN)
            self.scanned += len(buf)
            if i < 0:
                keep = _partial(buf, CALLS_BEGIN)
                self._before.append(buf[: len(buf) - keep])
                self._head = buf[len(buf) - keep :]
                return ()
            self._before.append(buf[:i])
            self._begun, self._head = True, ""
            text = buf[i + len(CALLS_BEGIN) :]
        self._track_end(text)
        self._buf += text
        calls: list[ToolCall] = []
        while (step := self._step()) is not None:
            if isinstance(step, ToolCall):
                calls.append(step)
                self._found = True
        return tuple(calls)

    def _track_end(self, text: str) -> None:
        """Find the first CALLS_END after CALLS_BEGIN (each character examined once) and keep
        what follows it."""
        if self._after is not None:
            self._after.append(text)
            return
        buf = self._end_scan + text
        i = buf.find(CALLS_END)
        self.scanned += len(buf)
        if i < 0:
            self._end_scan = buf[len(buf) - _partial(buf, CALLS_END) :]
        else:
            self._after, self._end_scan = [buf[i + len(CALLS_END) :]], ""

    def _restart(self, at: int) -> bool:
        """Look for the next call from ``_buf[at:]`` on (what is before it is done with)."""
        self._buf, self._state, self._pos = self._buf[at:], "seek", 0
        return False

    def _step(self) -> ToolCall | bool | None:
        """Advance the scan by one stage: a call read (a ToolCall), a stage passed or a call
        skipped (False), or None when ``_buf`` holds too little to go on."""
        buf, pos, state = self._buf, self._pos, self._state
        if state == "seek":
            i = buf.find(CALL_BEGIN, pos)
            if i < 0:
                self.scanned += len(buf) - pos
                self._restart(len(buf) - min(_partial(buf, CALL_BEGIN), len(buf) - pos))
                return None
            self.scanned += i + len(CALL_BEGIN) - pos
            self._restart(i)
            self._state, self._pos = "type", len(CALL_BEGIN)
            return False
        if state == "type":
            end = _WORD.match(buf, pos).end()  # type: ignore[union-attr]  # \w* always matches
            self.scanned += end - pos
            self._pos = end
            if end == len(buf):
                return None
            if end == len(CALL_BEGIN):  # no type: not a call
                return self._restart(len(CALL_BEGIN))
            self._state, self._sep = "sep", end
            return False
        if state == "sep":
            got = buf[pos : pos + len(SEP)]
            self.scanned += len(got)
            if not SEP.startswith(got):  # not a call: look again after its begin token
                return self._restart(len(CALL_BEGIN))
            if len(got) < len(SEP):
                return None
            self._state, self._pos = "name", pos + len(SEP)
            return False
        if state == "name":
            i = buf.find("\n", pos)
            self.scanned += (len(buf) if i < 0 else i + 1) - pos
            if i < 0:
                self._pos = len(buf)
                return None
            if i == self._sep + len(SEP):  # no name: every begin before this newline fails with it
                return self._restart(i + 1)
            self._state, self._fence, self._pos = "fence", i + 1, i + 1
            return False
        if state == "fence":
            got = buf[pos : pos + len(_FENCES[0])]
            self.scanned += len(got)
            opened = next((f for f in _FENCES if got.startswith(f)), None)
            if opened is None:
                if any(f.startswith(got) for f in _FENCES) and len(got) < len(_FENCES[0]):
                    return None  # the fence may still be coming
                return self._restart(pos)  # no fence: every begin before the newline fails with it
            self._state, self._args, self._pos = "args", pos + len(opened), pos + len(opened)
            return False
        i = buf.find(ARGS_END, pos)  # args
        if i < 0:
            self._pos = max(self._args, len(buf) - len(ARGS_END) + 1)
            self.scanned += len(buf) - pos
            return None
        self.scanned += i + len(ARGS_END) - pos + (i - self._args)  # found, then read as JSON
        kind, name, body = buf[len(CALL_BEGIN) : self._sep], buf[self._sep + len(SEP) : self._fence - 1], buf[self._args : i]
        self._restart(i + len(ARGS_END))
        try:
            value = json.loads(body)
        except (ValueError, RecursionError):
            return False
        if kind != "function" or not isinstance(value, dict):
            return False
        return ToolCall.of(name.strip(), value)

    def finish(self) -> ParsedToolCalls:
        text, self._text = "".join(self._text), []
        if not self._found:
            return ParsedToolCalls(text)
        content = ("".join(self._before) + "".join(self._after or ())).strip()
        return ParsedToolCalls(content or None)


def _partial(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` may be the start of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0

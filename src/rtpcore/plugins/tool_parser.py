"""Tool-call parsers: how a model family writes a tool call in its text (docs/design.md §16).

Which text marks a call differs per family -- Hermes/Qwen ``<tool_call>`` JSON, Llama 3
JSON, DeepSeek's own tokens -- so a parser belongs to the package that serves the model,
registered like the model itself::

    from rtpcore import ToolCall, ToolCallParser, ParsedToolCalls, hookimpl

    class MyParser(ToolCallParser):
        name = "my_family"
        markers = ("<call>",)          # text that starts a call; what comes before it is content

        def parse(self, text):
            ...                        # -> ParsedToolCalls(content, (ToolCall(name, arguments), ...))

    @hookimpl
    def rtpcore_register_tool_parsers(registry):
        registry.register_tool_parser(MyParser)

``rtpcore serve --tool-call-parser my_family`` then parses every answer to a request with
``tools`` and ``tool_choice: "auto"``. Text streams as content until it may be a marker's
start (``markers`` anywhere, ``prefix_markers`` only at the start of the answer, after blanks;
``""`` among them holds every answer); from the marker on, the server hands the parser each
new piece of text (:meth:`ToolCallParser.feed`), streams the calls it returns at once, and
asks it for the rest when the answer ends (:meth:`ToolCallParser.finish`).

A parser that implements only :meth:`~ToolCallParser.parse` works as is: the default ``feed``
keeps the pieces and the default ``finish`` parses them once, whole. A parser that overrides
``feed`` and ``finish`` makes its work per piece bounded by the piece, not by the text so
far (docs/design.md §17: the server parses on its event loop, and an answer can hold tens of
thousands of markers); the built-in ``hermes`` and ``llama3_json`` parsers do.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs

__all__ = ["ParsedToolCalls", "ToolCall", "ToolCallParser", "tool_parser_problems"]

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@attrs.frozen
class ToolCall:
    """One call: the function's name and its arguments as JSON text (an object)."""

    name: str
    arguments: str

    @classmethod
    def of(cls, name: str, arguments: Any) -> ToolCall:
        """A call whose arguments are given as a Python object (or as JSON text already)."""
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return cls(name, text)


@attrs.frozen
class ParsedToolCalls:
    """What a parser found in an answer: the text around the calls (None when there is
    none) and the calls, in order."""

    content: str | None
    calls: tuple[ToolCall, ...] = ()


class ToolCallParser:
    """Base class of tool-call parsers. Subclasses set :attr:`name` and the markers, and
    implement :meth:`parse`. One instance serves one request: ``tools`` are the request's
    tool definitions (OpenAI's ``{"type": "function", "function": {...}}``)."""

    name: ClassVar[str] = ""
    markers: ClassVar[tuple[str, ...]] = ()  # text that starts a call anywhere in the answer
    # Text that starts a call only at the answer's start; "" holds every answer for parse().
    prefix_markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tools: Sequence[Mapping[str, Any]] = ()):
        self.tools = list(tools)

    def parse(self, text: str) -> ParsedToolCalls:
        """The calls in a whole answer. Text that is not a well-formed call stays content."""
        raise NotImplementedError

    def feed(self, text: str) -> tuple[ToolCall, ...]:
        """Streaming: the next piece of the answer, from the marker that started a call on
        (the text before it went out as content). Returns the calls this piece completed
        that nothing later in the answer can change (the server streams them at once); the
        rest waits for :meth:`finish`. An override examines each character a bounded number
        of times. This default keeps the piece for :meth:`finish`."""
        self._fed().append(text)
        return ()

    def finish(self) -> ParsedToolCalls:
        """The answer ended: its content (of the text fed) and the calls :meth:`feed` did not
        return. This default: :meth:`parse` of the text fed, whole."""
        fed = self._fed()
        text = "".join(fed)
        fed.clear()
        return self.parse(text)

    def _fed(self) -> list[str]:
        pieces: list[str] = self.__dict__.setdefault("_fed_pieces", [])
        return pieces

    @property
    def tool_names(self) -> list[str]:
        return [str((t.get("function") or {}).get("name", "")) for t in self.tools]


def tool_parser_problems(cls: Any) -> list[str]:
    """What is wrong with a class registered as a tool-call parser (empty when nothing)."""
    if not (isinstance(cls, type) and issubclass(cls, ToolCallParser)):
        return [f"{cls!r} is not a subclass of rtpcore.ToolCallParser"]
    problems = []
    if not isinstance(cls.name, str) or not _NAME_RE.fullmatch(cls.name):
        problems.append(f"its name must be letters, digits, '_', '-' or '.', got {cls.name!r}")
    if not isinstance(cls.markers, tuple) or not all(isinstance(m, str) and m for m in cls.markers):
        problems.append(f"markers must be a tuple of non-empty strings, got {cls.markers!r}")
    if not isinstance(cls.prefix_markers, tuple) or not all(isinstance(m, str) for m in cls.prefix_markers):
        problems.append(f"prefix_markers must be a tuple of strings, got {cls.prefix_markers!r}")
    if not (cls.markers or cls.prefix_markers):
        problems.append("it needs markers or prefix_markers: the text that starts a call")
    if cls.parse is ToolCallParser.parse:
        problems.append("it does not implement parse(text)")
    return problems

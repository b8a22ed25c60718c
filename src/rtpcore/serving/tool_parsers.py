"""The built-in tool-call parsers, and finding one by name (docs/design.md §16).

``hermes``: Hermes / Qwen 2.5+ style -- each call is ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``; the text outside the tags is content. ``llama3_json``: Llama 3.1+ JSON
tool calling -- the answer is one JSON object ``{"name": ..., "parameters": {...}}`` (or
``"arguments"``), several separated by ``;``, optionally after ``<|python_tag|>``.

Plugins add parsers for their models through the ``rtpcore_register_tool_parsers`` hook
(``rtpcore.plugins.tool_parser``); :func:`find_tool_parser` looks in both.
"""

from __future__ import annotations

import json
import re
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
    name = "hermes"
    markers = ("<tool_call>",)
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def parse(self, text: str) -> ParsedToolCalls:
        calls: list[ToolCall] = []
        content: list[str] = []
        last = 0
        for m in self._CALL.finditer(text):
            try:
                call = _call_from(json.loads(m.group(1)), "arguments", "parameters")
            except json.JSONDecodeError:
                call = None
            if call is None:  # not a well-formed call: it stays text
                continue
            content.append(text[last : m.start()])
            calls.append(call)
            last = m.end()
        content.append(text[last:])
        rest = "".join(content).strip()
        return ParsedToolCalls(rest or None, tuple(calls)) if calls else ParsedToolCalls(text)


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    prefix_markers = ("<|python_tag|>", "{")

    def parse(self, text: str) -> ParsedToolCalls:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return ParsedToolCalls(text)
        calls: list[ToolCall] = []
        decoder = json.JSONDecoder()
        at = 0
        while at < len(body):
            try:
                obj, end = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return ParsedToolCalls(text)
            call = _call_from(obj, "parameters", "arguments")
            if call is None:
                return ParsedToolCalls(text)
            calls.append(call)
            at = end
            while at < len(body) and body[at] in " \n\t;":
                at += 1
        return ParsedToolCalls(None, tuple(calls))


BUILTIN: dict[str, type[ToolCallParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}


def find_tool_parser(name: str, registry: Any = None) -> type[ToolCallParser] | None:
    """The parser class named ``name``: built in, or registered by a loaded plugin."""
    if name in BUILTIN:
        return BUILTIN[name]
    return registry.get_tool_parser(name) if registry is not None else None


def tool_parser_names(registry: Any = None) -> list[str]:
    """Every parser name ``--tool-call-parser`` accepts, sorted."""
    return sorted({*BUILTIN, *(registry.tool_parser_names() if registry is not None else ())})

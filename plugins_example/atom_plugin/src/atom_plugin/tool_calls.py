"""DeepSeek-V3's tool-call format, as a parser ``rtpcore serve --tool-call-parser deepseek_v3``
finds through the ``rtpcore_register_tool_parsers`` hook.

DeepSeek-V3 writes its calls between its own tokens::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

several calls one after another inside the begin/end pair; text before them is content.
"""

from __future__ import annotations

import json
import re

from rtpcore import ParsedToolCalls, ToolCall, ToolCallParser

__all__ = ["DeepseekV3ToolParser"]

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(?P<type>\w+)<｜tool▁sep｜>(?P<name>[^\n]+)\n```(?:json)?\n(?P<args>.*?)\n```<｜tool▁call▁end｜>",
    re.DOTALL,
)


class DeepseekV3ToolParser(ToolCallParser):
    name = "deepseek_v3"
    markers = (CALLS_BEGIN,)

    def parse(self, text: str) -> ParsedToolCalls:
        start = text.find(CALLS_BEGIN)
        if start < 0:
            return ParsedToolCalls(text)
        calls = []
        for m in _CALL.finditer(text, start):
            try:
                args = json.loads(m.group("args"))
            except json.JSONDecodeError:
                continue
            if m.group("type") == "function" and isinstance(args, dict):
                calls.append(ToolCall.of(m.group("name").strip(), args))
        if not calls:
            return ParsedToolCalls(text)
        end = text.find(CALLS_END, start)
        after = text[end + len(CALLS_END) :] if end >= 0 else ""
        content = (text[:start] + after).strip()
        return ParsedToolCalls(content or None, tuple(calls))

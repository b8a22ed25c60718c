"""atom-plugin's DeepSeek-V3 tool-call parser is incremental (docs/design.md §17): fed the answer
piece by piece, as ``rtpcore serve`` feeds each streamed delta, it examines every character a
bounded number of times however many markers the answer holds, streams each call with the piece
that ends it, and finds what the whole-answer regex found, however the text is cut."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atom_plugin.tool_calls import CALL_BEGIN, CALLS_BEGIN, CALLS_END, SEP, DeepseekV3ToolParser
from rtpcore import ParsedToolCalls, ToolCall

MARKERS = 16_384
END = "\n```<｜tool▁call▁end｜>"


def call(name: str, args: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{args}{END}"


def fed(parser: DeepseekV3ToolParser, pieces: list[str]) -> tuple[list[ToolCall], ParsedToolCalls]:
    streamed: list[ToolCall] = []
    for piece in pieces:
        streamed += parser.feed(piece)
    return streamed, parser.finish()


@pytest.mark.parametrize("piece", [CALL_BEGIN, f"{CALL_BEGIN}function{SEP}f\n```json\n", CALLS_BEGIN, "\n```"])
def test_16k_markers_never_closed_cost_linear_work(piece: str) -> None:
    """16,384 markers that start a call and never end one, 8 per piece: the work is linear (the
    regex scanned from each marker to the end of the answer), and the answer stays text."""
    parser = DeepseekV3ToolParser()
    pieces = [CALLS_BEGIN] + [piece * 8] * (MARKERS // 8)
    streamed, rest = fed(parser, pieces)
    total = sum(map(len, pieces))
    assert streamed == [] and rest == ParsedToolCalls("".join(pieces))
    assert parser.scanned <= 4 * total + 64 * len(pieces), (parser.scanned, total)


def test_16k_calls_stream_one_by_one_with_linear_work() -> None:
    one = call("get_time", '{"zone": 1}')
    parser = DeepseekV3ToolParser()
    streamed = parser.feed("Sure." + CALLS_BEGIN)
    for _ in range(MARKERS):
        got = parser.feed(one[:7]) + parser.feed(one[7:])
        assert len(got) == 1  # each call with the piece that ends it
        streamed += got
    streamed += parser.feed(CALLS_END + " done")
    rest = parser.finish()
    assert len(streamed) == MARKERS and rest == ParsedToolCalls("Sure. done")
    assert parser.scanned <= 4 * MARKERS * len(one) + 1000


_REGEX = re.compile(
    r"<｜tool▁call▁begin｜>(?P<type>\w+)<｜tool▁sep｜>(?P<name>[^\n]+)\n```(?:json)?\n(?P<args>.*?)\n```<｜tool▁call▁end｜>",
    re.DOTALL,
)


def reference(text: str) -> ParsedToolCalls:
    """The parser before it was incremental: one regex over the whole answer."""
    start = text.find(CALLS_BEGIN)
    if start < 0:
        return ParsedToolCalls(text)
    calls = []
    for m in _REGEX.finditer(text, start):
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


PARTS = [CALLS_BEGIN, CALLS_END, CALL_BEGIN, SEP, "function", "other", "get_weather", "\n", "```", "json", "```json\n",
         '{"city": "Paris"}', "{bad", END, " ", "text ", "<｜", "x", call("f", '{"a": 1}'), call("g", "[1]")]


@settings(max_examples=500)
@given(st.lists(st.sampled_from(PARTS), max_size=12), st.lists(st.integers(0, 300), max_size=8))
def test_it_finds_what_the_whole_answer_regex_finds_however_the_text_is_cut(parts: list[str], cuts: list[int]) -> None:
    text = "".join(parts)
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    streamed, rest = fed(DeepseekV3ToolParser(), pieces)
    expected = reference(text)
    assert (rest.content, (*streamed, *rest.calls)) == (expected.content, expected.calls)
    assert DeepseekV3ToolParser().parse(text) == expected

"""Tool-call parsers (docs/design.md §16): the built-in ``hermes`` and ``llama3_json`` on their families'
text, atom-plugin's DeepSeek-V3 parser found through the ``rtpcore_register_tool_parsers`` hook of the
installed package, and the registry's rules (a name taken twice, a reserved name, a malformed class)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rtpcore import ParsedToolCalls, ToolCall, ToolCallParser
from rtpcore.errors import PluginConflictError, PluginLoadError
from rtpcore.plugins.registration import BUILTIN_TOOL_PARSERS
from rtpcore.serving.tool_parsers import (
    BUILTIN,
    HermesParser,
    Llama3JsonParser,
    find_tool_parser,
    tool_parser_names,
)


def args(call: ToolCall) -> dict[str, object]:
    return json.loads(call.arguments)


def test_hermes_finds_every_tagged_call_and_keeps_the_text_around_them() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {"zone": 2}}</tool_call>')
    parsed = HermesParser().parse(text)
    assert [c.name for c in parsed.calls] == ["get_weather", "get_time"]
    assert args(parsed.calls[0]) == {"city": "Paris"} and args(parsed.calls[1]) == {"zone": 2}
    assert parsed.content == "Let me check."


def test_hermes_leaves_malformed_calls_and_plain_text_as_content() -> None:
    assert HermesParser().parse("no calls here") == ParsedToolCalls("no calls here")
    broken = "<tool_call>{not json}</tool_call>"
    assert HermesParser().parse(broken) == ParsedToolCalls(broken)
    nameless = '<tool_call>{"arguments": {}}</tool_call>'
    assert HermesParser().parse(nameless).calls == ()


def test_llama3_json_reads_one_or_several_calls_and_the_python_tag() -> None:
    one = Llama3JsonParser().parse('{"name": "get_time", "parameters": {"zone": -3}}')
    assert [(c.name, args(c)) for c in one.calls] == [("get_time", {"zone": -3})] and one.content is None
    two = Llama3JsonParser().parse('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}')
    assert [(c.name, args(c)) for c in two.calls] == [("a", {}), ("b", {"x": 1})]
    assert Llama3JsonParser().parse("The answer is 4.") == ParsedToolCalls("The answer is 4.")
    assert Llama3JsonParser().parse('{"name": "a", "parameters": {}} and more').calls == ()


def test_the_reserved_names_are_the_built_in_parsers() -> None:
    assert sorted(BUILTIN) == sorted(BUILTIN_TOOL_PARSERS) == ["hermes", "llama3_json"]
    assert tool_parser_names() == ["hermes", "llama3_json"] and find_tool_parser("nope") is None


def test_atom_plugins_deepseek_parser_comes_through_the_hook() -> None:
    pytest.importorskip("atom_plugin")
    from rtpcore import Allowlist, load_plugins

    registry = load_plugins(Allowlist.from_cli(plugins=["atom-plugin"]).resolve())
    parser = find_tool_parser("deepseek_v3", registry)
    assert parser is not None and parser.__module__ == "atom_plugin.tool_calls"
    assert "deepseek_v3" in tool_parser_names(registry)
    text = ("Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
            '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n'
            '{"zone": 1}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    parsed = parser().parse(text)
    assert [(c.name, args(c)) for c in parsed.calls] == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": 1})]
    assert parsed.content == "Sure."
    assert registry.by_provider("atom-plugin")  # the plugin is loaded once, its parser with it


def _hooks(body: str) -> str:
    return "from rtpcore import ToolCallParser, ParsedToolCalls, hookimpl\n" + body


GOOD = """
class P(ToolCallParser):
    name = "{name}"
    markers = ("<c>",)
    def parse(self, text):
        return ParsedToolCalls(text)

@hookimpl
def rtpcore_register_tool_parsers(registry):
    registry.register_tool_parser(P)

@hookimpl
def rtpcore_register_models(registry):
    pass
"""


def test_two_plugins_with_one_parser_name_conflict_and_a_reserved_name_is_refused(plugin_env: object) -> None:
    from rtpcore import Allowlist, load_plugins

    env = plugin_env  # type: ignore[assignment]
    env.add_dist("tp-one", plugins={"one": "tp_one"}, modules={"tp_one.py": _hooks(GOOD.format(name="mine"))})  # type: ignore[attr-defined]
    env.add_dist("tp-two", plugins={"two": "tp_two"}, modules={"tp_two.py": _hooks(GOOD.format(name="mine"))})  # type: ignore[attr-defined]
    env.add_dist("tp-res", plugins={"res": "tp_res"}, modules={"tp_res.py": _hooks(GOOD.format(name="hermes"))})  # type: ignore[attr-defined]
    registry = load_plugins(Allowlist.from_cli(plugins=["tp-one"]).resolve())
    assert registry.get_tool_parser("mine") is not None
    with pytest.raises(PluginConflictError, match="tool-call parser 'mine'"):
        load_plugins(Allowlist.from_cli(plugins=["tp-one", "tp-two"]).resolve())
    with pytest.raises(PluginConflictError, match="'hermes' is built into rtpcore"):
        load_plugins(Allowlist.from_cli(plugins=["tp-res"]).resolve())


def test_a_parser_without_parse_or_markers_is_an_invalid_plugin(plugin_env: object) -> None:
    from rtpcore import Allowlist, load_plugins

    bad = """
class P(ToolCallParser):
    name = "lazy"

@hookimpl
def rtpcore_register_tool_parsers(registry):
    registry.register_tool_parser(P)
"""
    plugin_env.add_dist("tp-bad", plugins={"bad": "tp_bad"}, modules={"tp_bad.py": _hooks(bad)})  # type: ignore[attr-defined]
    with pytest.raises(PluginLoadError, match="needs markers or prefix_markers") as excinfo:
        load_plugins(Allowlist.from_cli(plugins=["tp-bad"]).resolve())
    assert "does not implement parse" in str(excinfo.value) and excinfo.value.state == "invalid"


def test_the_base_class_is_abstract_over_parse() -> None:
    with pytest.raises(NotImplementedError):
        ToolCallParser().parse("x")


# -- incremental parsing (docs/design.md §17) -----------------------------------------------------

MARKERS = 16_384


def stream_through(parser: type[ToolCallParser], pieces: list[str]) -> tuple[str, list[ToolCall], Any]:
    """The pieces through the server's ToolStream (tool_choice "auto"): the content it lets
    out, the calls, and the parser instance (its ``scanned``)."""
    from rtpcore.serving.tools import Tools

    stream = Tools("auto", parser=parser, tools=[]).stream()
    content = ""
    for piece in pieces:
        out, _ = stream.feed(piece)
        content += out
    rest, _ = stream.finish()
    return content + rest, list(stream.calls), stream._parser


def test_hermes_work_is_linear_in_16k_unclosed_markers() -> None:
    """16,384 ``<tool_call>`` markers never closed, fed 8 at a time as the server feeds each
    streamed delta: every character is examined a bounded number of times (the whole-answer
    regex before this scanned from each marker to the end: 16,384 times the answer), and the
    answer stays text."""
    pieces = ["<tool_call>" * 8] * (MARKERS // 8)
    content, calls, parser = stream_through(HermesParser, pieces)
    total = sum(map(len, pieces))
    assert calls == [] and content == "".join(pieces)
    assert parser.scanned <= 2 * total + 16 * len(pieces), (parser.scanned, total)


def test_hermes_streams_16k_calls_each_from_the_delta_that_closes_it() -> None:
    one = '<tool_call>{"name": "f", "arguments": {"i": 1}}</tool_call>'
    from rtpcore.serving.tools import Tools

    stream = Tools("auto", parser=HermesParser, tools=[]).stream()
    streamed = 0
    for _ in range(MARKERS):
        half = len(one) // 2
        for piece in (one[:half], one[half:]):
            _, calls = stream.feed(piece)
            streamed += len(calls)
    assert streamed == MARKERS  # each call went out with the delta that closed it
    rest, calls = stream.finish()
    assert calls == [] and rest == "" and len(stream.calls) == MARKERS
    assert stream._parser.scanned <= 3 * MARKERS * len(one) + 32 * 2 * MARKERS


def test_llama3_json_work_is_linear_in_16k_calls_and_16k_open_braces() -> None:
    call = '{"name": "f", "parameters": {"s": "}{"}}; '
    content, calls, parser = stream_through(Llama3JsonParser, [call] * MARKERS)
    assert len(calls) == MARKERS and content == ""
    assert parser.scanned <= 3 * MARKERS * len(call)
    braces = ["{" * 8] * (MARKERS // 8)
    content, calls, parser = stream_through(Llama3JsonParser, braces)
    assert calls == [] and content == "".join(braces) and parser.scanned <= 2 * MARKERS


# The parsers before they were incremental: each reads the whole answer (the reference the
# incremental ones must agree with on every text, however it is cut into pieces).
def reference_hermes(text: str) -> ParsedToolCalls:
    import re

    from rtpcore.serving.tool_parsers import _call_from

    calls: list[ToolCall] = []
    content: list[str] = []
    last = 0
    for m in re.finditer(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.DOTALL):
        try:
            call = _call_from(json.loads(m.group(1)), "arguments", "parameters")
        except json.JSONDecodeError:
            call = None
        if call is None:
            continue
        content.append(text[last : m.start()])
        calls.append(call)
        last = m.end()
    content.append(text[last:])
    rest = "".join(content).strip()
    return ParsedToolCalls(rest or None, tuple(calls)) if calls else ParsedToolCalls(text)


def reference_llama3(text: str) -> ParsedToolCalls:
    from rtpcore.serving.tool_parsers import _call_from

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


HERMES_PARTS = ["<tool_call>", "</tool_call>", '{"name": "f", "arguments": {"x": 1}}', "{bad", " ", "\n", "text ",
                "<tool", "_call>", "</tool_", '{"name": 3}', '{"name": "g", "parameters": {}}']
LLAMA_PARTS = ["<|python_tag|>", "{", "}", '{"name": "f", "parameters": {"x": "}"}}', '"', "\\", ";", " ", "\n", "\r",
               "text", '{"name": "g"}', "<|py", "thon_tag|>", '{"a": [1, {"b": "\\"}"}]}']


def _pieces(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


@pytest.mark.parametrize(("parser", "reference", "parts"), [
    (HermesParser, reference_hermes, HERMES_PARTS), (Llama3JsonParser, reference_llama3, LLAMA_PARTS)])
def test_incremental_parsers_agree_with_the_whole_answer_parsers_however_the_text_is_cut(
    parser: type[ToolCallParser], reference: Any, parts: list[str]
) -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=400)
    @given(st.lists(st.sampled_from(parts), max_size=10), st.text(" ", max_size=2),
           st.lists(st.integers(0, 200), max_size=8))
    def check(chosen: list[str], lead: str, cuts: list[int]) -> None:
        text = lead + "".join(chosen)
        expected = reference(text)
        assert parser().parse(text) == expected
        content, calls, _ = stream_through(parser, _pieces(text, cuts))
        whole_content, whole_calls, _ = stream_through(parser, [text])
        assert (content, calls) == (whole_content, whole_calls)
        assert tuple(calls) == expected.calls
        if not expected.calls:
            assert content == text

    check()


def test_a_parser_with_only_parse_streams_through_the_default_feed_and_finish() -> None:
    """A plugin's parser that implements only parse (the API before feed and finish) works
    unchanged: the default feed keeps the pieces and finish parses them whole."""

    class Whole(ToolCallParser):
        name = "whole"
        markers = ("<c>",)

        def parse(self, text: str) -> ParsedToolCalls:
            calls = tuple(ToolCall.of(n, {}) for n in text.split("<c>")[1:])
            return ParsedToolCalls(None, calls) if calls else ParsedToolCalls(text)

    content, calls, _ = stream_through(Whole, ["Hi ", "<", "c>a<c", ">b"])
    assert content == "Hi " and [c.name for c in calls] == ["a", "b"]
    assert stream_through(Whole, ["no call"])[:2] == ("no call", [])

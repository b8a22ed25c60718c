"""Tool-call parsers (docs/design.md §16): the built-in ``hermes`` and ``llama3_json`` on their families'
text, atom-plugin's DeepSeek-V3 parser found through the ``rtpcore_register_tool_parsers`` hook of the
installed package, and the registry's rules (a name taken twice, a reserved name, a malformed class)."""

from __future__ import annotations

import json

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

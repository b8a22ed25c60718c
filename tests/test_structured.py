"""Structured outputs and tool calls (docs/design.md §16) against live ``rtpcore serve`` processes on a
random-weight model, which never writes JSON by itself: ``response_format`` JSON schemas parse and
validate (greedy and sampled, streamed and not); ``required`` and named tool calls parse and validate,
streamed deltas assemble to the same call, ``finish_reason`` is ``tool_calls``; tools reach the chat
template; a conversation with tool calls and tool results continues; a plugin's tool-call parser is
found through the hook and used; bad schemas, missing functions and unknown parsers are refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from test_llama import make_checkpoint  # noqa: E402
from test_serve import Server, write_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow

PATIENCE_S = 300.0  # a bound against hanging, never a speed requirement

TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t.function.name }} "
    "{{ t.function.parameters | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments }}}</tool_call>{% endfor %}"
    "{%- else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                    "required": ["zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "active", "tags", "address"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                     "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("structured")
    vocab = write_tokenizer(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    make_checkpoint(path, vocab_size=vocab, max_position_embeddings=1024)
    return path


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[Server]:
    srv = Server(checkpoint, "--tool-call-parser", "hermes")
    yield srv
    code, out = srv.stop()
    assert code == 0, out


def chat(server: Server, **body: Any) -> dict[str, Any]:
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": ASK, **body},
                   timeout=PATIENCE_S)
    assert r.status_code == 200, r.text
    return r.json()


def stream_chat(server: Server, **body: Any) -> list[dict[str, Any]]:
    chunks = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=PATIENCE_S,
                      json={"model": "tiny", "messages": ASK, "stream": True, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def assembled_calls(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tool calls streamed deltas assemble to (by index)."""
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for piece in (chunk["choices"][0]["delta"].get("tool_calls") or []) if chunk.get("choices") else []:
            call = calls.setdefault(piece["index"], {"id": None, "name": "", "arguments": ""})
            call["id"] = piece.get("id") or call["id"]
            fn = piece.get("function") or {}
            call["name"] += fn.get("name") or ""
            call["arguments"] += fn.get("arguments") or ""
    return [calls[i] for i in sorted(calls)]


SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 1},
                                      {"temperature": 1.0, "seed": 2}, {"temperature": 0.7, "seed": 3, "top_p": 0.9}])
def test_json_schema_output_parses_and_validates(server: Server, sampling: dict[str, Any]) -> None:
    body = {"response_format": SCHEMA_FORMAT, "max_tokens": 400, **sampling}
    answer = chat(server, **body)
    text = answer["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(text), PERSON)
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert ", " in text and ": " in text and "  " not in text and "\n" not in text  # json.dumps separators only
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in stream_chat(server, **body) if c["choices"])
    jsonschema.validate(json.loads(streamed), PERSON)
    if "seed" in sampling or sampling["temperature"] == 0:
        assert streamed == text  # the same request, the same draws


def test_json_object_mode_on_chat_and_completions(server: Server) -> None:
    answer = chat(server, response_format={"type": "json_object"}, max_tokens=300, temperature=0)
    assert isinstance(json.loads(answer["choices"][0]["message"]["content"]), dict)
    r = httpx.post(server.url + "/v1/completions", timeout=PATIENCE_S, json={
        "model": "tiny", "prompt": "Data:", "max_tokens": 400, "temperature": 1.0, "seed": 4,
        "response_format": SCHEMA_FORMAT})
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), PERSON)


def test_unconstrained_requests_beside_constrained_ones_keep_their_text(server: Server) -> None:
    plain = {"messages": ASK, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    want = chat(server, **plain)["choices"][0]["message"]["content"]
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        constrained = [pool.submit(chat, server, response_format=SCHEMA_FORMAT, max_tokens=400, temperature=1.0,
                                   seed=s) for s in range(3)]
        got = pool.submit(chat, server, **plain)
        assert got.result()["choices"][0]["message"]["content"] == want
        for f in constrained:
            jsonschema.validate(json.loads(f.result()["choices"][0]["message"]["content"]), PERSON)


def check_call(call: dict[str, Any], name: str | None = None) -> None:
    fn = call.get("function", call)
    assert fn["name"] in SCHEMAS and (name is None or fn["name"] == name)
    jsonschema.validate(json.loads(fn["arguments"]), SCHEMAS[fn["name"]])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_tool_calls_parse_validate_and_stream_the_same(server: Server, choice: Any) -> None:
    name = None if choice == "required" else "get_time"
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}):
        # one call: a random model asked for "any number of calls" may go on calling until max_tokens
        body = {"tools": TOOLS, "tool_choice": choice, "max_tokens": 300, "parallel_tool_calls": False, **sampling}
        answer = chat(server, **body)["choices"][0]
        assert answer["finish_reason"] == "tool_calls" and answer["message"]["tool_calls"]
        for call in answer["message"]["tool_calls"]:
            assert call["type"] == "function" and call["id"].startswith("call_")
            check_call(call, name)
        chunks = stream_chat(server, **body)
        streamed = assembled_calls(chunks)
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in answer["message"]["tool_calls"]]
        assert all(c["id"] for c in streamed)
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert finishes == ["tool_calls"]


def test_parallel_tool_calls_false_makes_one_call(server: Server) -> None:
    for seed in range(3):
        answer = chat(server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=300,
                      temperature=1.0, seed=seed)
        assert len(answer["choices"][0]["message"]["tool_calls"]) == 1


def test_the_openai_client_reads_the_calls(server: Server) -> None:
    with server.client(timeout=PATIENCE_S) as c:
        r = c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=200, temperature=0,
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])


def test_tools_reach_the_template_and_a_conversation_with_calls_continues(server: Server, checkpoint: Path) -> None:
    from rtpcore.engine.text.chat_template import ChatTemplate
    from rtpcore.engine.text.tokenizer import Tokenizer

    template, tok = ChatTemplate.from_pretrained(checkpoint), Tokenizer.from_pretrained(checkpoint)

    def tokens(messages: list[dict[str, Any]], tools: Any) -> int:
        return len(tok.encode(template.render(messages, add_generation_prompt=True, tools=tools), add_special_tokens=False))

    with_tools = chat(server, tools=TOOLS, tool_choice="none", max_tokens=2)
    without = chat(server, max_tokens=2)
    assert with_tools["usage"]["prompt_tokens"] == tokens(ASK, TOOLS) > without["usage"]["prompt_tokens"]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    cont = chat(server, messages=history, tools=TOOLS, max_tokens=4)
    assert cont["usage"]["prompt_tokens"] == tokens(history, TOOLS)
    assert cont["choices"][0]["message"]["role"] == "assistant"


def test_auto_with_hermes_returns_text_when_the_model_calls_nothing(server: Server) -> None:
    answer = chat(server, tools=TOOLS, max_tokens=16, temperature=0, ignore_eos=True)["choices"][0]
    assert answer["finish_reason"] == "length" and "tool_calls" not in answer["message"]
    text = "".join(c["choices"][0]["delta"].get("content") or ""
                   for c in stream_chat(server, tools=TOOLS, max_tokens=16, temperature=0, ignore_eos=True) if c["choices"])
    assert text == answer["message"]["content"]


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None),
    ({"tool_choice": "required"}, None),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
]


@pytest.mark.parametrize(("body", "param"), BAD)
def test_bad_structured_requests_are_400s_naming_the_field(server: Server, body: dict[str, Any], param: str | None) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": ASK, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    if body.get("tool_choice", {}) and isinstance(body["tool_choice"], dict):
        assert "'nope'" in error["message"] and "get_weather" in error["message"]


def test_auto_without_a_parser_is_a_400_naming_the_flag(checkpoint: Path) -> None:
    srv = Server(checkpoint)
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                       json={"model": "tiny", "messages": ASK, "tools": TOOLS})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        assert "--tool-call-parser" in r.json()["error"]["message"]
    finally:
        code, out = srv.stop()
    assert code == 0, out


def test_an_unknown_parser_exits_2_listing_the_known_ones(checkpoint: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "rtpcore", "serve", str(checkpoint), "--port", "1",
                           "--tool-call-parser", "nope"], capture_output=True, text=True, timeout=PATIENCE_S)
    assert proc.returncode == 2
    assert "--tool-call-parser 'nope'" in proc.stderr and "hermes" in proc.stderr and "llama3_json" in proc.stderr


ECHO_PARSER = """
from rtpcore import ParsedToolCalls, ToolCall, ToolCallParser, hookimpl


class EchoParser(ToolCallParser):
    name = "echo_calls"
    prefix_markers = ("",)

    def parse(self, text):
        return ParsedToolCalls(None, (ToolCall.of(self.tool_names[0], {"said": text}),))


@hookimpl
def rtpcore_register_tool_parsers(registry):
    registry.register_tool_parser(EchoParser)
"""


def test_a_plugins_parser_is_found_through_the_hook_and_used(checkpoint: Path, tmp_path: Path) -> None:
    """A module loaded with --external-model-packages registers a parser; --tool-call-parser selects it and
    every answer to a request with tools becomes its call, streamed or not."""
    (tmp_path / "echo_calls.py").write_text(textwrap.dedent(ECHO_PARSER))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    srv = Server(checkpoint, "--external-model-packages", "echo_calls", "--tool-call-parser", "echo_calls", env=env)
    try:
        body = {"tools": TOOLS, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        plain = chat(srv, **body, tool_choice="none")["choices"][0]["message"]["content"]  # the same text, unparsed
        answer = chat(srv, **body)["choices"][0]
        call = answer["message"]["tool_calls"][0]["function"]
        assert answer["finish_reason"] == "length"  # cut by max_tokens, its call is still parsed
        assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"said": plain}
        streamed = assembled_calls(stream_chat(srv, **body))
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [("get_weather", {"said": plain})]
    finally:
        code, out = srv.stop()
    assert code == 0, out

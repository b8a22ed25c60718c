"""Fuzzing ``rtpcore serve`` (docs/design.md §17, §22): hypothesis draws request bodies and JSON
schemas, a live server answers them over HTTP, and no answer may be a 5xx -- a client's mistake
is a 400 (or 404/413/422-free 4xx) in OpenAI's error shape, a well-formed request is served --
and after every batch the engine still serves a plain request, /health says ok and every KV
block is free.

The bodies start from valid chat and completion requests and replace fields with values drawn
from a hostile pool: wrong types at any depth, huge and tiny numbers, lone UTF-16 surrogates,
unknown fields, token ids past the vocabulary, deep nesting. The schemas are drawn from JSON
Schema's vocabulary (objects, arrays, strings, numbers, enums, anyOf, $ref to the root and to
$defs, recursion with and without a way out) and sent as response_format and as tool
parameters. Generation is kept short (a few tokens) so that the suite runs in well under a
minute; examples are derandomized, so CI sees the same ones each run (raise ``max_examples``
locally, and drop ``derandomize``, to search further).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from test_llama import make_checkpoint  # noqa: E402
from test_serve import Server, write_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow

TIMEOUT = 300.0  # a bound against hanging, never a speed requirement
FUZZ = settings(max_examples=150, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = tmp_path_factory.mktemp("fuzz")
    vocab = write_tokenizer(path)
    make_checkpoint(path, vocab_size=vocab, max_position_embeddings=512)
    srv = Server(path, "--max-batch-size", "8", "--max-waiting", "4096")
    yield srv
    code, out = srv.stop()
    assert code == 0, out
    assert "Traceback" not in out, out[-4000:]


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[Any]:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        yield c


# -- values ------------------------------------------------------------------------------------

surrogates = st.text(st.characters(categories=["Cs"]), min_size=1, max_size=3)
texts = st.text(max_size=40) | surrogates | st.builds(lambda a, s, b: a + s + b, st.text(max_size=8), surrogates,
                                                      st.text(max_size=8)) | st.sampled_from(["Hi", "x" * 64, ""])
numbers = (st.integers(min_value=-(2**70), max_value=2**70)
           | st.floats(allow_nan=False, allow_infinity=False)
           | st.sampled_from([0, 1, -1, 1e-308, 5e-324, 1e308, -1e308, 2**63, 2**64, 1e-6, 0.5, 2, 100, 1e5]))
scalars = st.none() | st.booleans() | numbers | texts
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
                    max_leaves=12)


def deep(depth: int) -> Any:
    value: Any = "x"
    for i in range(depth):
        value = [value] if i % 2 else {"a": value}
    return value


token_ids = st.integers(min_value=-5, max_value=400)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "robot"]),
     "content": texts | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                         "text": texts}), max_size=2) | junk},
    optional={"name": texts, "tool_call_id": texts, "reasoning_content": texts}), min_size=0, max_size=3)

LOGIT_BIAS_KEYS = st.sampled_from(["5", "²", "٣", " 12", "12 ", "1e3", "-1", "+3", "0x10", "399", "100000", ""]) | texts
FIELD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["tiny", "other", ""]) | texts,
    "prompt": texts | st.lists(token_ids, max_size=6) | st.lists(texts, max_size=2),
    "messages": messages,
    "max_tokens": st.integers(min_value=-2, max_value=8) | st.sampled_from([10**9, 511, 512]),
    "max_completion_tokens": st.integers(min_value=-2, max_value=8),
    "temperature": numbers,
    "top_p": numbers,
    "top_k": st.integers(min_value=-3, max_value=500),
    "min_p": numbers,
    "seed": numbers,
    "n": st.integers(min_value=-1, max_value=20),
    "stop": texts | st.lists(texts, max_size=20),
    "stop_token_ids": st.lists(token_ids, max_size=4),
    "logit_bias": st.dictionaries(LOGIT_BIAS_KEYS, numbers, min_size=1, max_size=4),
    "logprobs": st.booleans() | st.integers(min_value=-1, max_value=25),
    "top_logprobs": st.integers(min_value=-1, max_value=25),
    "presence_penalty": numbers,
    "frequency_penalty": numbers,
    "repetition_penalty": numbers,
    "min_tokens": st.integers(min_value=-1, max_value=10),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | junk}),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"},
                                        {"type": "xml"}]),
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "function": {"name": "f"}},
                                    {"type": "function", "function": {"name": "nope"}}]),
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": st.sampled_from(["f", "g", "bad name", ""]) | texts}, optional={"parameters": junk})}),
        max_size=2),
    "chat_template_kwargs": st.dictionaries(texts, junk, max_size=2),
    "echo": junk,
    "best_of": junk,
    "unknown_field": junk,
}


def base(chat: bool) -> dict[str, Any]:
    if chat:
        return {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    return {"model": "tiny", "prompt": "Hello", "max_tokens": 4}


CHAT_ONLY = {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "chat_template_kwargs"}
COMPLETIONS_ONLY = {"prompt", "echo", "best_of"}


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, Any]:
    """A valid request with one or two of its endpoint's fields replaced (now and then: a field
    it does not have, or a body that is not an object at all)."""
    chat = draw(st.booleans())
    body: Any = base(chat)
    own = sorted(set(FIELD_VALUES) - (COMPLETIONS_ONLY if chat else CHAT_ONLY) - {"unknown_field"})
    for name in draw(st.lists(st.sampled_from(own), min_size=1, max_size=2, unique=True)):
        # mostly a value of the field's own kind (the bugs hide there), sometimes anything at all
        body[name] = draw(junk) if draw(st.integers(0, 4)) == 4 else draw(FIELD_VALUES[name])
    if isinstance(body.get("max_tokens"), int) and 16 < body["max_tokens"] < 10**6:
        body["max_tokens"] = 8  # keep generation short: the suite fuzzes the boundary, not the model
    rare = draw(st.integers(0, 39))
    if rare == 39:
        body["unknown_field"] = draw(junk)
    elif rare == 38:  # not an object at all, or nested too deep
        body = draw(st.sampled_from([[], "x", 3, None, deep(900), {"model": "tiny", "prompt": deep(200)}]))
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


# -- schemas -----------------------------------------------------------------------------------

leaf_schemas = st.one_of(
    st.fixed_dictionaries({"type": st.just("string")},
                          optional={"maxLength": st.integers(0, 20), "minLength": st.integers(0, 5),
                                    "pattern": st.sampled_from(["^[a-z]+$", "[", "(a|b)*", "^$"]),
                                    "format": st.sampled_from(["date", "email", "uuid", "bogus"])}),
    st.fixed_dictionaries({"type": st.sampled_from(["integer", "number"])},
                          optional={"minimum": numbers, "maximum": numbers, "multipleOf": numbers}),
    st.fixed_dictionaries({"enum": st.lists(scalars, min_size=0, max_size=4)}),
    st.fixed_dictionaries({"const": scalars}),
    st.sampled_from([{}, {"type": "boolean"}, {"type": "null"}, {"$ref": "#"}, {"$ref": "#/$defs/node"},
                     {"$ref": "#/nowhere"}, {"not": {}}, {"type": ["string", "null"]}, True, False]),
)


def _compound(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    names = st.sampled_from(["a", "b", "x", "id", "name"])
    return st.one_of(
        st.builds(lambda props, req, extra: {"type": "object", "properties": props,
                                             "required": [k for k in props if k in req],
                                             **({"additionalProperties": extra} if extra is not None else {})},
                  st.dictionaries(names, inner, max_size=3), st.lists(names, max_size=3),
                  st.none() | st.booleans()),
        st.builds(lambda items, lo, hi: {"type": "array", "items": items, "minItems": lo,
                                         **({"maxItems": hi} if hi is not None else {})},
                  inner, st.integers(0, 3), st.none() | st.integers(0, 4)),
        st.builds(lambda xs: {"anyOf": xs}, st.lists(inner, min_size=0, max_size=3)),
        st.builds(lambda xs: {"allOf": xs}, st.lists(inner, min_size=1, max_size=2)),
    )


schemas = st.builds(
    lambda root, node: {**root, "$defs": {"node": node}} if isinstance(root, dict) else root,
    st.recursive(leaf_schemas, _compound, max_leaves=8), st.recursive(leaf_schemas, _compound, max_leaves=4),
)


@st.composite
def schema_bodies(draw: st.DrawFn) -> tuple[str, Any]:
    schema = draw(schemas)
    place = draw(st.sampled_from(["chat", "completions", "named", "required"]))
    body: dict[str, Any] = base(place != "completions")
    body["max_tokens"] = 6
    if place in ("chat", "completions"):
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    else:
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        body["tool_choice"] = "required" if place == "required" else {"type": "function", "function": {"name": "f"}}
    body["stream"] = draw(st.booleans())
    return ("/v1/completions" if place == "completions" else "/v1/chat/completions"), body


# -- the checks --------------------------------------------------------------------------------


def send(client: Any, path: str, body: Any) -> httpx.Response:
    # ensure_ascii: lone surrogates travel as \\udXXX escapes, valid JSON text that decodes to them
    return client.post(path, content=json.dumps(body, ensure_ascii=True), headers={"content-type": "application/json"})


STATUSES: dict[str, Counter[int]] = {"bodies": Counter(), "schemas": Counter()}  # what the fuzz reached


def check_answer(path: str, body: Any, r: httpx.Response) -> None:
    """Never a 5xx; a 4xx in OpenAI's error shape; a 200 whole (a stream ends with [DONE])."""
    shown = json.dumps(body, ensure_ascii=True)[:600]
    assert r.status_code < 500, f"{r.status_code} for {path} {shown}: {r.text[:600]}"
    if r.status_code >= 400:
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["message"], r.text
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert lines and lines[-1] == "data: [DONE]", r.text[-600:]
        for line in lines[:-1]:
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, f"an error event for {path} {shown}: {line[:600]}"
    else:
        assert r.json()["choices"], r.text


def still_serving(client: Any) -> None:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    assert client.get("/health").json() == {"status": "ok"}


@FUZZ
@given(case=bodies())
def test_fuzzed_bodies_are_never_5xx(client: Any, case: tuple[str, Any]) -> None:
    path, body = case
    r = send(client, path, body)
    STATUSES["bodies"][r.status_code] += 1
    check_answer(path, body, r)


@settings(FUZZ, max_examples=80)
@given(case=schema_bodies())
def test_fuzzed_schemas_are_never_5xx(client: Any, case: tuple[str, Any]) -> None:
    path, body = case
    r = send(client, path, body)
    STATUSES["schemas"][r.status_code] += 1
    check_answer(path, body, r)


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETION = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {**COMPLETION, "logit_bias": {"²": 1}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {" 12": 1}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"1e3": 1}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"٣": 1}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "prompt": "Hi \ud800"}, "prompt"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a\udfffb"}]}, "messages[0].content"),
    ("/v1/completions", {**COMPLETION, "stop": ["ok", "\ud83d"]}, "stop[1]"),
    ("/v1/chat/completions", {**CHAT, "user": {"\udc00": 1}}, "user.\\udc00"),
], ids=["superscript-two", "space", "exponent", "arabic-digit", "prompt", "message", "stop", "key"])
def test_known_client_mistakes_are_400s_naming_the_field(client: Any, path: str, body: dict[str, Any],
                                                          param: str) -> None:
    """What the fuzz found once, as 500s: logit_bias keys that are not ASCII decimal ids, and lone
    surrogates (sent as escapes) anywhere in the body. Each is a 400 naming the field."""
    r = send(client, path, body)  # json.dumps writes each lone surrogate as its \\u escape
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_the_engine_still_serves_after_the_fuzz(client: Any, server: Server) -> None:
    """Runs after the fuzz tests (file order): a plain request is served, /health is ok, every KV
    block has come back and no request ended the engine."""
    still_serving(client)
    for name, seen in STATUSES.items():  # the fuzz reached both sides of the boundary: it can find bugs
        if seen:
            assert seen[200] >= 10 and sum(n for code, n in seen.items() if 400 <= code < 500) >= 10, (name, seen)
    m = server.wait_idle(timeout=TIMEOUT)
    assert m["rtpcore_kv_blocks_free"] == m["rtpcore_kv_blocks_total"]


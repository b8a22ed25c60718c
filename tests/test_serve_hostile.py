"""docs/design.md §17 over HTTP, against a spawned ``rtpcore serve``: a client mistake is a 400
naming the field and the connection keeps working; the caps and their flags; the fields
clients send today; vLLM's ``structured_outputs``; /v1/models/{id}, /tokenize, /detokenize,
/version; ``X-Request-Id`` on every response; the metrics vLLM's dashboard reads."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import rtpcore
from rtpcore.serving.json_body import OFFLOAD_BYTES
from test_llama import make_checkpoint
from test_serve import Server, write_tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hostile")
    make_checkpoint(path, vocab_size=write_tokenizer(path), max_position_embeddings=256)
    return path


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[Server]:
    srv = Server(checkpoint, "--max-n", "20", "--max-logit-bias", "3")
    yield srv
    code, out = srv.stop()
    assert code == 0, out


def children(pid: int) -> list[int]:
    """The body parser workers of ``pid`` (from /proc: its children running json_body.py)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                argv = (entry / "cmdline").read_bytes()
            except OSError:  # gone meanwhile
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"json_body.py" in argv:
                found.append(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_the_body_parser_worker_starts_with_the_server_at_a_lower_priority(server: Server) -> None:
    # First in this module: no body has been sent to this server yet (bodies of OFFLOAD_BYTES or
    # more are parsed in the worker; it must not start at the first of them, in the middle of serving).
    workers = children(server.proc.pid)
    assert len(workers) == 1, f"rtpcore serve has {len(workers)} worker processes, not its body parser's one"
    ours = os.getpriority(os.PRIO_PROCESS, server.proc.pid)
    assert os.getpriority(os.PRIO_PROCESS, workers[0]) == min(ours + 10, 19)
    big = {**COMPLETION, "prompt": "hi " * (OFFLOAD_BYTES // 3)}
    answer = httpx.post(server.url + "/v1/completions", json=big, timeout=120)
    assert answer.status_code == 400 and "maximum context length" in answer.json()["error"]["message"], answer.text
    assert children(server.proc.pid) == workers  # the same worker parsed it


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


CHAT = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "tiny", "max_tokens": 2, "prompt": "hi"}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"deep": nested(900)}}, "body"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi", "x": nested(65)}]}, "body"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"²": 1}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {" 12": 1}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"1e3": 1}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"-1": 1}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": 3}}]},
     "tools[0].function.name"),
    ("/v1/chat/completions", {**CHAT, "modalities": ["text", "audio"]}, "modalities"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"choice": ["b"]},
                         "response_format": {"type": "json_object"}}, None),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
])
def test_a_client_mistake_is_a_400_naming_the_field_and_the_connection_goes_on(
    server: Server, path: str, body: dict[str, Any], param: str | None
) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        bad = client.post(path, json=body)
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["param"] == param, bad.json()
        good = client.post("/v1/completions", json=COMPLETION)  # the same connection
        assert good.status_code == 200, good.text


PAD = "x" * (OFFLOAD_BYTES + 1000)  # makes a body large enough to be parsed in the worker process


@pytest.mark.parametrize("large", [False, True], ids=["on-the-loop", "in-the-worker-process"])
@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"pad": "", "deep": nested(65)}}, "body"),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"pad": ""},
                              "messages": [{"role": "user", "content": "a \ud800 b"}]}, "messages[0].content"),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"pad": ""},
                              "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
])
def test_a_large_body_is_held_to_the_same_rules_as_a_small_one(
    server: Server, path: str, body: dict[str, Any], param: str, large: bool,
) -> None:
    """A body over OFFLOAD_BYTES is parsed in the worker process: the depth, surrogate and field
    rules, and the length checks after them, answer exactly as for the same body small."""
    body = json.loads(json.dumps(body))
    body["chat_template_kwargs"]["pad"] = PAD if large else "x"
    raw = json.dumps(body).encode()
    assert (len(raw) >= OFFLOAD_BYTES) is large
    with httpx.Client(base_url=server.url, timeout=120) as client:
        bad = client.post(path, content=raw, headers={"Content-Type": "application/json"})
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["param"] == param, bad.json()
        good = client.post("/v1/completions", json=COMPLETION)  # the same connection
        assert good.status_code == 200, good.text


def test_a_large_conversation_is_refused_as_the_server_itself_refuses_it(server: Server) -> None:
    """A large chat body of the shape the body parser's worker judges (rtpcore.serving.json_body)
    is refused there with the 400 the server's own path gives the same conversation (sent with a
    template argument the template ignores, which the worker leaves to the server)."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "lorem ipsum " * 40_000}]
    judged = {**CHAT, "messages": messages}
    rendered_here = {**judged, "chat_template_kwargs": {"unused": True}}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        answers = [client.post("/v1/chat/completions", json=body) for body in (judged, rendered_here)]
        after = client.post("/v1/chat/completions", json=CHAT)  # the same connection
    assert len(json.dumps(judged)) >= OFFLOAD_BYTES
    for answer in answers:
        assert answer.status_code == 400, answer.text
    assert answers[0].json()["error"] == answers[1].json()["error"]
    assert answers[0].json()["error"]["code"] == "context_length_exceeded"
    assert answers[0].json()["error"]["param"] == "messages"
    assert after.status_code == 200, after.text


def test_a_large_body_whose_conversation_fits_is_served_as_a_small_one(server: Server) -> None:
    small = json.dumps({**CHAT, "temperature": 0}).encode()
    large = small[:-1] + b" " * OFFLOAD_BYTES + b"}"  # the same JSON, padded to be parsed by the worker
    with httpx.Client(base_url=server.url, timeout=120) as client:
        answers = [client.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
                   for raw in (small, large)]
    for answer in answers:
        assert answer.status_code == 200, answer.text
    assert answers[0].json()["choices"][0]["message"] == answers[1].json()["choices"][0]["message"]


@pytest.mark.parametrize("size", [10, OFFLOAD_BYTES + 10])
def test_a_body_that_is_not_json_is_a_400_at_any_size(server: Server, size: int) -> None:
    raw = b'{"model": "tiny", "prompt": "' + b"y" * size  # never closed
    answer = httpx.post(server.url + "/v1/completions", content=raw, headers={"Content-Type": "application/json"},
                        timeout=120)
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error", answer.text


def test_nesting_up_to_the_limit_is_served(server: Server) -> None:
    body = {**CHAT, "chat_template_kwargs": {"deep": nested(60)}}
    assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).status_code == 200


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({**COMPLETION, "logit_bias": {"1": 1, "2": 1, "3": 1, "4": 1}}, "logit_bias", "at most 3 entries on this server (--max-logit-bias), got 4"),
    ({**COMPLETION, "n": 21, "temperature": 1}, "n", "at most 20 choices on this server (--max-n), got 21"),
    ({**COMPLETION, "stop": [str(i) for i in range(17)]}, "stop", "at most 16 strings on this server (--max-stop-strings)"),
    ({**COMPLETION, "stop_token_ids": list(range(1025))}, "stop_token_ids", "at most 1024 ids"),
])
def test_each_cap_is_a_400_naming_the_field_and_its_flag(server: Server, body: dict[str, Any], param: str,
                                                          needle: str) -> None:
    answer = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param
    assert needle in answer.json()["error"]["message"]


def test_a_raised_cap_admits_what_the_default_refuses(server: Server) -> None:
    """--max-n 20: 17 choices (over the default 16) are served."""
    answer = httpx.post(server.url + "/v1/completions", json={**COMPLETION, "n": 17, "temperature": 1, "seed": 1},
                        timeout=300)
    assert answer.status_code == 200 and len(answer.json()["choices"]) == 17


def test_the_fields_official_clients_send_are_accepted(server: Server) -> None:
    client = server.client()
    reply = client.chat.completions.create(
        model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False},
        extra_body={"safety_identifier": "u-1", "prompt_cache_key": "k", "modalities": ["text"],
                    "reasoning_effort": "low"},
    )
    chunks = list(reply)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_structured_outputs_choice_regex_json_and_grammar_constrain_the_text(server: Server) -> None:
    def text(so: dict[str, Any]) -> str:
        answer = httpx.post(server.url + "/v1/completions", json={**COMPLETION, "max_tokens": 24,
                                                                  "structured_outputs": so}, timeout=300)
        assert answer.status_code == 200, answer.text
        return str(answer.json()["choices"][0]["text"])

    assert text({"choice": ["yes", "no", "maybe so"]}) in ("yes", "no", "maybe so")
    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", text({"regex": "[0-9]{3}-[a-c]{2}"}))
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "additionalProperties": False}
    for given in (schema, json.dumps(schema)):  # a schema, or its JSON text
        value = json.loads(text({"json": given}))
        assert set(value) == {"a"} and isinstance(value["a"], int)
    # A bounded grammar: an unbounded one ("ab")+ lets a random model repeat "ab" past max_tokens.
    assert re.fullmatch(r"(ab|cd){1,2}!", text({"grammar": 'start: ("ab" | "cd") ("ab" | "cd")? "!"\n'}))


def test_models_by_id_version_tokenize_and_detokenize(server: Server, checkpoint: Path) -> None:
    from rtpcore.engine.text.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(checkpoint)
    with httpx.Client(base_url=server.url, timeout=120) as client:
        assert client.get("/v1/models/tiny").json()["id"] == "tiny"
        missing = client.get("/v1/models/other")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert client.get("/version").json() == {"version": rtpcore.__version__}
        got = client.post("/tokenize", json={"prompt": "hello world"}).json()
        assert got["tokens"] == tok.encode("hello world", add_special_tokens=True)
        assert got["count"] == len(got["tokens"]) and got["max_model_len"] == 256
        plain = client.post("/tokenize", json={"prompt": "hello world", "add_special_tokens": False}).json()
        assert plain["tokens"] == tok.encode("hello world", add_special_tokens=False)
        chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert tok.decode(chat["tokens"], skip_special_tokens=False).startswith("<|im_start|>user\nhi")
        back = client.post("/detokenize", json={"tokens": plain["tokens"]}).json()
        assert back == {"prompt": "hello world"}
        too_big = client.post("/detokenize", json={"tokens": [10**6]})
        assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "tokens"
        both = client.post("/tokenize", json={"prompt": "a", "messages": [{"role": "user", "content": "b"}]})
        assert both.status_code == 400


def test_every_response_carries_x_request_id(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        mine = client.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "trace-42"})
        assert mine.status_code == 200 and mine.headers["x-request-id"] == "trace-42"
        error = client.post("/v1/completions", json={**COMPLETION, "model": "other"}, headers={"X-Request-Id": "e-1"})
        assert error.status_code == 404 and error.headers["x-request-id"] == "e-1"
        with client.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True},
                           headers={"X-Request-Id": "s-1"}) as stream:
            assert stream.headers["x-request-id"] == "s-1"
            assert any(line == "data: [DONE]" for line in stream.iter_lines())
        made = {client.get("/health").headers["x-request-id"] for _ in range(2)}
        assert len(made) == 2 and all(re.fullmatch(r"[0-9a-f]{32}", m) for m in made)  # generated, each new
        long = client.get("/health", headers={"X-Request-Id": "x" * 129}).headers["x-request-id"]
        assert long != "x" * 129
        deep = client.post("/v1/completions", json={**COMPLETION, "x": nested(100)}, headers={"X-Request-Id": "d-1"})
        assert deep.status_code == 400 and deep.headers["x-request-id"] == "d-1"  # the guard's own answers too


def test_the_metrics_vllms_dashboard_reads(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        client.post("/v1/completions", json={"model": "tiny", "max_tokens": 4, "prompt": [5, 6, 7], "ignore_eos": True})
        server.wait_idle()
        m = server.metrics()
    label = '{model_name="tiny"}'
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "prefix_cache_queries_total", "prefix_cache_hits_total"):
        assert f"vllm:{name}{label}" in m, name
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert f"vllm:{name}_count{label}" in m, name
    assert m[f"vllm:generation_tokens_total{label}"] == m["rtpcore_generated_tokens_total"]
    assert m[f"vllm:prefix_cache_hits_total{label}"] == m["rtpcore_prefix_cache_hits_total"]
    assert m[f"vllm:num_requests_running{label}"] == 0 and m[f"vllm:kv_cache_usage_perc{label}"] == 0
    assert m[f"vllm:prompt_tokens_total{label}"] >= 3
    assert m[f"vllm:e2e_request_latency_seconds_count{label}"] == m[f"vllm:time_to_first_token_seconds_count{label}"]

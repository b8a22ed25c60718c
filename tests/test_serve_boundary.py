"""The HTTP boundary (docs/design.md §15) against live ``rtpcore serve`` processes, with the ``openai``
client and raw HTTP: every honoured field reaches the engine (the server's text equals the engine's
own tokens for the same settings), nulls mean absent, bookkeeping fields are accepted, ``n`` choices,
stop ids from the tokenizer, raw logprobs with exactly the alternatives asked, text offsets and token
bytes, the body limit, the context-length code, and disconnects that abort requests that could not
finish on their own."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from rtpcore.engine.sample.params import SamplingParams  # noqa: E402
from rtpcore.engine.text.tokenizer import Tokenizer  # noqa: E402
from slow_model import slow_checkpoint  # noqa: E402
from test_llama import make_checkpoint  # noqa: E402
from test_serve import Server, write_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow

PATIENCE_S = 120.0  # a bound against hanging, never a speed requirement


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny served Llama, with no eos_token_id in config.json or generation_config.json: only the
    tokenizer names its end-of-text token ("</s>", id 2)."""
    path = tmp_path_factory.mktemp("boundary")
    vocab = write_tokenizer(path)
    make_checkpoint(path, vocab_size=vocab, max_position_embeddings=512)
    for name in ("config.json", "generation_config.json"):
        file = path / name
        if file.is_file():
            data = json.loads(file.read_text())
            data.pop("eos_token_id", None)
            file.write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[Server]:
    srv = Server(checkpoint, "--max-batch-size", "8", "--max-request-bytes", "20000")
    yield srv
    code, out = srv.stop()
    assert code == 0, out


@pytest.fixture(scope="module")
def tok(checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(checkpoint)


def engine_tokens(checkpoint: Path, ids: list[int], params: SamplingParams) -> list[int]:
    """What the engine itself generates for ``ids`` with ``params`` (in this process)."""
    from rtpcore import AsyncEngine

    async def main() -> list[int]:
        engine = AsyncEngine.from_pretrained(checkpoint)
        try:
            out: list[int] = []
            async for o in engine.stream(ids, params):
                out += o.token_ids
            return out
        finally:
            await engine.aclose()

    return asyncio.run(main())


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "tiny", **body}, timeout=PATIENCE_S)


PROMPT = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58]


def test_every_sampling_field_reaches_the_engine(server: Server, checkpoint: Path, tok: Tokenizer) -> None:
    """Penalties, min_p, logit_bias, min_tokens, stop_token_ids and a seed through HTTP give the
    text of the engine's own tokens for the same SamplingParams."""
    fields = {"temperature": 0.8, "seed": 3, "repetition_penalty": 1.3, "presence_penalty": 0.5,
              "frequency_penalty": 0.7, "min_p": 0.05, "logit_bias": {"50": 3.0}, "min_tokens": 4,
              "stop_token_ids": [60]}
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=3, repetition_penalty=1.3, presence_penalty=0.5,
                            frequency_penalty=0.7, min_p=0.05, logit_bias={50: 3.0}, min_tokens=4,
                            stop_token_ids=[60, 2])
    want = engine_tokens(checkpoint, PROMPT, params)
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 24, **fields})
    assert r.status_code == 200, r.text
    shown = want[:-1] if want[-1] in (60, 2) else want
    assert r.json()["choices"][0]["text"] == tok.decode(shown)
    plain = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "temperature": 0.8, "seed": 3})
    assert plain.json()["choices"][0]["text"] != r.json()["choices"][0]["text"]  # the fields changed something


def test_nulls_mean_absent_and_bookkeeping_fields_are_accepted(server: Server) -> None:
    nulls = {k: None for k in ("n", "stream", "logprobs", "echo", "presence_penalty", "frequency_penalty",
                               "temperature", "top_p", "seed", "stop", "stream_options", "best_of", "suffix",
                               "logit_bias", "user")}
    base = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    want = post(server, "/v1/completions", base).json()["choices"][0]["text"]
    r = post(server, "/v1/completions", {**nulls, **base})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0,
            "user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
            "logprobs": None, "top_logprobs": None, "tools": None, "tool_choice": None, "response_format": None,
            "max_completion_tokens": None, "n": None, "stream": None}
    assert post(server, "/v1/chat/completions", chat).status_code == 200


def test_the_tokenizers_eos_token_stops_and_ignore_eos_runs_past_it(server: Server) -> None:
    """The checkpoint names no eos_token_id: the tokenizer's "</s>" (id 2), pushed first by
    logit_bias, still ends the request (finish_reason stop); with ignore_eos it runs to max_tokens."""
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logit_bias": {"2": 100}}
    stopped = post(server, "/v1/completions", body).json()
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] == 1
    ran = post(server, "/v1/completions", {**body, "ignore_eos": True}).json()
    assert ran["choices"][0]["finish_reason"] == "length" and ran["usage"]["completion_tokens"] == 6


def test_stop_token_ids_min_tokens_and_stop_strings_kept_or_cut(server: Server, tok: Tokenizer) -> None:
    forced = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logit_bias": {"70": 100}}
    r = post(server, "/v1/completions", {**forced, "stop_token_ids": [70]}).json()
    assert r["usage"]["completion_tokens"] == 1 and r["choices"][0]["finish_reason"] == "stop"
    r = post(server, "/v1/completions", {**forced, "stop_token_ids": [70], "min_tokens": 3}).json()
    assert r["usage"]["completion_tokens"] == 4 and r["choices"][0]["finish_reason"] == "stop"
    piece = tok.decode([70])
    cut = post(server, "/v1/completions", {**forced, "stop": [piece]}).json()["choices"][0]
    kept = post(server, "/v1/completions", {**forced, "stop": [piece], "include_stop_str_in_output": True}).json()
    assert cut["text"] == "" and kept["choices"][0]["text"] == piece and cut["finish_reason"] == "stop"


def test_special_tokens_are_skipped_unless_asked(server: Server) -> None:
    forced = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logit_bias": {"3": 100}, "ignore_eos": True}
    assert post(server, "/v1/completions", forced).json()["choices"][0]["text"] == ""
    shown = post(server, "/v1/completions", {**forced, "skip_special_tokens": False}).json()
    assert shown["choices"][0]["text"] == "<|im_start|>" * 3


def test_n_choices_greedy_equal_sampled_seeded_and_the_prompt_prefilled_once(server: Server) -> None:
    long_prompt = [1, *range(100, 200)]  # 101 tokens: 6 full blocks of 16
    greedy = post(server, "/v1/completions", {"prompt": long_prompt, "max_tokens": 5, "temperature": 0, "n": 3}).json()
    texts = [c["text"] for c in greedy["choices"]]
    assert [c["index"] for c in greedy["choices"]] == [0, 1, 2] and len(set(texts)) == 1
    assert greedy["usage"]["completion_tokens"] == 15
    before = server.metrics()["rtpcore_prefix_cache_hits_total"]
    body = {"prompt": [*long_prompt, 7], "max_tokens": 12, "temperature": 1.0, "seed": 11, "n": 4, "ignore_eos": True}
    first, again = post(server, "/v1/completions", body).json(), post(server, "/v1/completions", body).json()
    sampled = [c["text"] for c in first["choices"]]
    assert sampled == [c["text"] for c in again["choices"]] and len(set(sampled)) > 1
    assert first["usage"]["completion_tokens"] == 48
    hits = server.metrics()["rtpcore_prefix_cache_hits_total"] - before
    assert hits >= 2 * 3 * 96  # per call, choices 1-3 found the prompt's 6 blocks cached
    with server.client(timeout=PATIENCE_S) as c:
        chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=6, temperature=0.9, seed=2, n=3, stream=True))
    finished = {ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].finish_reason}
    assert finished == {0, 1, 2}


def test_logprobs_are_raw_with_exactly_the_alternatives_asked(server: Server, tok: Tokenizer) -> None:
    """20 alternatives on chat, 7 on completions, whatever the temperature or top_k (the model's
    raw log-probabilities: the same numbers at temperature 0 and 1.7 with top_k 2); completions'
    tokens join to the text and text_offset says where each starts; chat bytes are the token's own."""
    with server.client(timeout=PATIENCE_S) as c:
        msgs = [{"role": "user", "content": "Caf\u00e9 na\u00efve \u65e5\u672c"}]
        chat = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=20)
        content = chat.choices[0].logprobs.content
        assert len(content) == 6 and all(len(t.top_logprobs) == 20 for t in content)
        assert b"".join(bytes(t.bytes) for t in content).decode(errors="replace") == chat.choices[0].message.content
        ids = tok.encode("Caf\u00e9 na\u00efve \u65e5\u672c", add_special_tokens=True)
        cold = c.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0, logprobs=7)
        hot = c.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=1.7, logprobs=7,
                                   extra_body={"top_k": 2, "seed": 5})
    lp = cold.choices[0].logprobs
    assert all(len(top) == 7 for top in lp.top_logprobs) and len(lp.tokens) == 8
    assert "".join(lp.tokens) == cold.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    assert hot.choices[0].logprobs.top_logprobs[0] == pytest.approx(lp.top_logprobs[0])


def test_a_body_over_the_limit_is_a_413_before_parsing(server: Server) -> None:
    big = {"prompt": "x " * 12000, "max_tokens": 1}
    r = post(server, "/v1/completions", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    chunked = httpx.post(server.url + "/v1/completions", timeout=PATIENCE_S, headers={"content-type": "application/json"},
                         content=iter([json.dumps({"model": "tiny", **big}).encode()]))  # no content-length
    assert chunked.status_code == 413
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_context_overflow_names_the_code_and_the_maximum_context_length(server: Server) -> None:
    r = post(server, "/v1/completions", {"prompt": [1] * 400, "max_tokens": 200})
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    assert "maximum context length is 512 tokens" in error["message"]


def test_chat_template_controls(server: Server, checkpoint: Path, tok: Tokenizer) -> None:
    """add_generation_prompt=false leaves the assistant header out; continue_final_message renders
    the last assistant message open, so the prompt ends with its text."""
    from rtpcore.engine.text.chat_template import ChatTemplate

    template = ChatTemplate.from_pretrained(checkpoint)
    msgs = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon"}]
    open_text = template.render(msgs, add_generation_prompt=False)
    open_text = open_text[: open_text.rfind("Once upon") + len("Once upon")]
    base = {"messages": msgs, "max_tokens": 2, "temperature": 0}
    cont = post(server, "/v1/chat/completions", {**base, "continue_final_message": True,
                                                 "add_generation_prompt": False}).json()
    assert cont["usage"]["prompt_tokens"] == len(tok.encode(open_text, add_special_tokens=False))
    closed = post(server, "/v1/chat/completions", {**base, "add_generation_prompt": False}).json()
    header = post(server, "/v1/chat/completions", base).json()
    assert closed["usage"]["prompt_tokens"] < header["usage"]["prompt_tokens"]
    kwargs = post(server, "/v1/chat/completions", {**base, "chat_template_kwargs": {"enable_thinking": False}})
    assert kwargs.status_code == 200


# -- disconnects: a model too slow to finish on its own --------------------------------------------

@pytest.fixture(scope="module")
def slow_server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # 50 ms more a step: 4000 tokens take over 200 s, so no request here finishes on its own
    ckpt, env = slow_checkpoint(checkpoint, tmp_path_factory.mktemp("slow"), step_seconds=0.05,
                                max_position_embeddings=4096)
    srv = Server(ckpt, "--external-model-packages", "slow_llama", "--kv-cache-memory", "64MiB", env=env)
    yield srv
    code, out = srv.stop()
    assert code == 0, out


def wait_for(server: Server, what: str, check: Any) -> dict[str, float]:
    deadline = time.monotonic() + PATIENCE_S
    while True:
        m = server.metrics()
        if check(m):
            return m
        assert time.monotonic() < deadline, f"{what}: {m}"
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_disconnects_aborts_a_request_that_cannot_finish(slow_server: Server, stream: bool) -> None:
    """A raw socket sends a 4000-token request, waits until it runs, and closes: the request is
    aborted (finish_reason abort), nothing runs and every KV block is free -- long before it could
    have finished."""
    before = slow_server.metrics().get('rtpcore_requests_total{finish_reason="abort"}', 0.0)
    body = json.dumps({"model": "tiny", "prompt": [1, 40, 41], "max_tokens": 4000, "ignore_eos": True,
                       "temperature": 0, "stream": stream}).encode()
    sock = socket.create_connection(("127.0.0.1", slow_server.port), timeout=PATIENCE_S)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        wait_for(slow_server, "the request never ran", lambda m: m["rtpcore_requests_running"] == 1)
        if stream:
            assert sock.recv(64).startswith(b"HTTP/1.1 200")
    finally:
        sock.close()
    m = wait_for(slow_server, "the request was not aborted",
                 lambda m: m["rtpcore_requests_running"] == 0 and m["rtpcore_kv_blocks_free"] == m["rtpcore_kv_blocks_total"])
    assert m['rtpcore_requests_total{finish_reason="abort"}'] == before + 1
    assert m["rtpcore_generated_tokens_total"] < 4000

"""docs/design.md §17, "the event loop stays free" and "bounded memory per client", against a
spawned ``rtpcore serve``: a prompt certain to exceed max_model_len is refused before it is
tokenized; tool calls stream from the server's incremental parser; a stream whose client reads
nothing is paused and then aborted, its KV blocks freed.

The work of the tool-call parsers per delta is counted in characters in
tests/test_tool_parsers.py; here the server is driven over HTTP and raw sockets, and every wait
polls /metrics against a generous deadline (no sleep stands for a synchronisation)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from test_llama import make_checkpoint
from test_serve import Server, write_tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("loop")
    make_checkpoint(path, vocab_size=write_tokenizer(path), max_position_embeddings=256)
    return path


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[Server]:
    srv = Server(checkpoint, "--tool-call-parser", "hermes", "--max-batch-size", "8", "--kv-cache-memory", "8MiB")
    yield srv
    code, out = srv.stop()
    assert code == 0, out


def longest_token(checkpoint: Path) -> int:
    vocab = json.loads((checkpoint / "tokenizer.json").read_text())
    return max(len(t) for t in [*vocab["model"]["vocab"], *(a["content"] for a in vocab["added_tokens"])])


@pytest.mark.parametrize(("path", "param"), [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")])
def test_a_prompt_longer_than_max_model_len_tokens_could_hold_is_a_400_before_tokenizing(
    server: Server, checkpoint: Path, path: str, param: str
) -> None:
    """Its characters over the tokenizer's longest token exceed max_model_len (256 here): a 400
    naming the prompt (``code`` context_length_exceeded), as a prompt that encodes too long is."""
    text = "a" * (256 * longest_token(checkpoint) + 1)
    body = {"model": "tiny", "max_tokens": 1, "prompt": text} if param == "prompt" else \
        {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": text}]}
    r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, "context_length_exceeded"), error
    assert "at least" in error["message"] and "max_model_len" in error["message"]

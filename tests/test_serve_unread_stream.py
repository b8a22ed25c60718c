"""A client that stops reading its stream (docs/design.md §17, bounded memory per client), against a
real ``rtpcore serve`` process on 127.0.0.1: once the stream's unsent bytes pass
``--stream-buffer-bytes`` its request is paused -- not scheduled, holding no KV block -- while other
clients are served; after ``--stream-idle-timeout`` seconds of reading nothing the connection is
aborted, the request with it, and the stream never reaches ``[DONE]``. A client that reads again
before then gets its whole answer.

The client is a raw socket with a small receive buffer, so that what the server writes backs up in
the server rather than in the kernel. Every wait polls the server's metrics for an event, bounded.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")

from test_llama import make_checkpoint  # noqa: E402
from test_serve import Server, write_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow

PATIENCE = 180.0  # a bound against hanging, never a speed requirement
MAX_TOKENS = 3000
N = 16  # choices: N * MAX_TOKENS chunks are far more than the server's buffer and the kernel's (4 MiB) hold


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("unread")
    vocab = write_tokenizer(path)
    make_checkpoint(path, vocab_size=vocab, max_position_embeddings=4096)
    return path


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[Server]:
    srv = Server(checkpoint, "--stream-buffer-bytes", "16KiB", "--stream-idle-timeout", "8")
    yield srv
    code, out = srv.stop()
    assert code == 0, out


@pytest.fixture(scope="module")
def patient_server(checkpoint: Path) -> Iterator[Server]:
    """The default --stream-idle-timeout (300 s): a client's pause never reaches it here."""
    srv = Server(checkpoint, "--stream-buffer-bytes", "16KiB")
    yield srv
    code, out = srv.stop()
    assert code == 0, out


def unread_stream(server: Server) -> socket.socket:
    """Open a streamed completion of N choices of MAX_TOKENS tokens (5 logprobs each: big chunks) and read
    nothing."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    sock.connect(("127.0.0.1", server.port))
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": MAX_TOKENS, "ignore_eos": True,
                       "stream": True, "logprobs": 5, "n": N, "temperature": 1.0, "seed": 3}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


def poll(server: Server, cond: Callable[[dict[str, float]], bool], what: str) -> dict[str, float]:
    deadline = time.monotonic() + PATIENCE
    while True:
        m = server.metrics()
        if cond(m):
            return m
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {m}\n{server.output()[-3000:]}"
        time.sleep(0.05)


def read_all(sock: socket.socket) -> bytes:
    """What the server sent, until it closed or reset the connection."""
    sock.settimeout(PATIENCE)
    data = bytearray()
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return bytes(data)


def aborted(m: dict[str, float]) -> float:
    return m.get('rtpcore_requests_total{finish_reason="abort"}', 0.0)


def test_an_unread_stream_pauses_holding_no_blocks_then_is_aborted_after_the_idle_timeout(server: Server) -> None:
    before = aborted(server.metrics())
    sock = unread_stream(server)
    try:
        m = poll(server, lambda m: m["rtpcore_requests_paused"] == N and m["rtpcore_requests_running"] == 0,
                 "the unread stream's requests to pause and leave the batch")
        assert m["rtpcore_kv_blocks_free"] == m["rtpcore_kv_blocks_total"]  # they hold no block
        assert m["rtpcore_generated_tokens_total"] < N * MAX_TOKENS  # it stopped well before its end
        # Others are served meanwhile.
        other = httpx.post(server.url + "/v1/completions", timeout=PATIENCE,
                           json={"model": "tiny", "prompt": "hi", "max_tokens": 8, "ignore_eos": True})
        assert other.status_code == 200 and other.json()["usage"]["completion_tokens"] == 8
        m = poll(server, lambda m: aborted(m) == before + N, "the idle connection to be aborted")
        assert m["rtpcore_requests_paused"] == 0
        data = read_all(sock)
    finally:
        sock.close()
    assert data.startswith(b"HTTP/1.1 200") and b"data: {" in data and b"[DONE]" not in data
    assert "--stream-idle-timeout" in server.output()
    server.wait_idle()


def test_a_client_that_reads_again_before_the_timeout_gets_its_whole_answer(patient_server: Server) -> None:
    server = patient_server
    sock = unread_stream(server)
    try:
        poll(server, lambda m: m["rtpcore_requests_paused"] == N, "the unread stream to pause")
        data = read_all_until_done(sock)
    finally:
        sock.close()
    events = [json.loads(line[6:]) for line in data.split(b"\r\n") if line.startswith(b"data: {")]
    tokens = [0] * N
    finish = [None] * N
    for e in events:
        for c in e["choices"]:
            tokens[c["index"]] += len(c["logprobs"]["tokens"])
            finish[c["index"]] = finish[c["index"]] or c["finish_reason"]
    assert tokens == [MAX_TOKENS] * N and finish == ["length"] * N
    server.wait_idle()


def read_all_until_done(sock: socket.socket) -> bytes:
    """Read the chunked stream until its [DONE] event."""
    sock.settimeout(PATIENCE)
    data = bytearray()
    while b"data: [DONE]" not in data:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the stream before [DONE]"
        data += chunk
    return bytes(data)

"""``rtpcore serve`` stays up (docs/design.md §22), as a real process on 127.0.0.1: the schemas that
once ended the engine are 400s and the next request is a 200; a fault in the engine loop outside any
request ends every request at once, /health answers 503 and serve exits non-zero; streams cut at
``--shutdown-timeout`` end with an abort chunk and ``[DONE]``, with no traceback; connections that
never send their headers are closed after ``--header-timeout``; past ``--max-connections`` requests
are 503s but /health answers; ``repetition_penalty`` outside [0.01, 100] is a 400 naming it.

A slow model (a plugin whose every forward takes 20 ms more) keeps requests running for as long as
a test needs them to, on any machine: the tests wait for events, never for time to pass. Every loop
is bounded; every server is stopped.
"""

from __future__ import annotations

import asyncio
import json
import socket
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")

from slow_model import slow_checkpoint  # noqa: E402
from test_llama import make_checkpoint  # noqa: E402
from test_serve import Server, write_tokenizer  # noqa: E402
from test_staying_up import MANY_PROPERTIES, REQUIRED_RECURSION, SELF_REFERENCE  # noqa: E402

pytestmark = pytest.mark.slow

TIMEOUT = 300.0  # a bound against hanging, never a speed requirement
SENTINEL = 77  # a prompt starting with this token makes the planted scheduler raise

PLANTED = f"""
import sys
from rtpcore.engine.core import scheduler
from rtpcore.cli import main

real = scheduler.Scheduler.schedule

def schedule(self):
    # A fault planted in the engine loop's own work (planning a step), outside any request's.
    if any(r.tokens and r.tokens[0] == {SENTINEL} for r in self.waiting):
        raise RuntimeError("planted fault in the engine loop")
    return real(self)

scheduler.Scheduler.schedule = schedule
sys.exit(main(sys.argv[1:]))
"""



@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("staying_up")
    vocab = write_tokenizer(path)
    make_checkpoint(path, vocab_size=vocab, max_position_embeddings=2048)
    return path


@pytest.fixture(scope="module")
def slow(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The checkpoint served by SlowLlama (20 ms more a step), and the environment that finds it."""
    return slow_checkpoint(checkpoint, tmp_path_factory.mktemp("slow"), step_seconds=0.02)


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[Server]:
    srv = Server(checkpoint, "--max-batch-size", "8")
    yield srv
    code, out = srv.stop()
    assert code == 0, out


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16, **extra}


def schema_bodies(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any], str]]:
    """(path, body, the field a 400 names) for ``schema`` in every place a request can carry one."""
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    tool = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    return [
        ("/v1/chat/completions", chat_body(tools=tool, tool_choice="required"), "tools"),
        ("/v1/chat/completions", chat_body(tools=tool, tool_choice={"type": "function", "function": {"name": "f"}}),
         "tools"),
        ("/v1/chat/completions", chat_body(response_format=fmt), "response_format.json_schema.schema"),
        ("/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 16, "response_format": fmt},
         "response_format.json_schema.schema"),
    ]


@pytest.mark.parametrize("schema", [SELF_REFERENCE, REQUIRED_RECURSION, MANY_PROPERTIES],
                         ids=["self-reference", "required-recursion", "5000-properties"])
def test_the_schemas_that_ended_the_engine_are_400s_and_the_next_request_is_a_200(
    server: Server, schema: dict[str, Any]
) -> None:
    """Each schema, as tool parameters (required and named tool_choice) and as response_format on
    both endpoints, is a 400 naming the field; the next plain request is a 200 and /health says ok."""
    for path, body, param in schema_bodies(schema):
        r = httpx.post(server.url + path, json=body, timeout=TIMEOUT)
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
        plain = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 4,
                                                               "ignore_eos": True},
                           timeout=TIMEOUT)
        assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(server.url + "/health", timeout=30).json() == {"status": "ok"}


@pytest.mark.parametrize("value", [1e-308, 0.0099, 100.5, -1.0])
def test_a_repetition_penalty_outside_its_bounds_is_a_400_naming_it(server: Server, value: float) -> None:
    r = httpx.post(server.url + "/v1/completions", timeout=TIMEOUT, json={
        "model": "tiny", "prompt": "Hi", "max_tokens": 4, "repetition_penalty": value})
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty", r.text


@pytest.mark.parametrize("value", [0.01, 100.0])
def test_a_repetition_penalty_at_its_bounds_is_served(server: Server, value: float) -> None:
    r = httpx.post(server.url + "/v1/completions", timeout=TIMEOUT, json={
        "model": "tiny", "prompt": "Hi", "max_tokens": 4, "repetition_penalty": value, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


async def read_stream(client: Any, url: str, body: dict[str, Any], first: asyncio.Event | None = None) -> list[str]:
    """The data lines of one streamed request (``first`` set once its first content chunk came)."""
    lines = []
    async with client.stream("POST", url, json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                lines.append(line[len("data: "):])
                if first is not None and len(lines) >= 2:
                    first.set()
    return lines


def finish_reasons(lines: list[str]) -> list[str]:
    return [c["finish_reason"] for line in lines if line != "[DONE]" for c in json.loads(line)["choices"]
            if c["finish_reason"] is not None]


def test_streams_cut_at_the_shutdown_timeout_end_with_abort_and_done(slow: tuple[Path, dict[str, str]]) -> None:
    """SIGTERM with six requests running far past --shutdown-timeout (a stream of n=2 sampled
    choices, a non-streamed one among them): once the timeout passes each is cut -- every stream's
    last chunk per choice has finish_reason "abort", then data: [DONE]; the non-streamed one answers
    200 with "abort" -- the log has one line counting them and no traceback, and serve exits 0."""
    path, env = slow
    srv = Server(path, "--external-model-packages", "slow_llama", "--shutdown-timeout", "2", env=env)
    long = {"model": "tiny", "prompt": "Hello", "max_tokens": 1500, "ignore_eos": True}

    async def main() -> tuple[list[list[str]], Any]:
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            started = [asyncio.Event() for _ in range(5)]
            bodies = [long, long, long, {**long, "n": 2, "temperature": 1.0, "seed": 3},
                      {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1500,
                       "ignore_eos": True}]
            paths = ["/v1/completions"] * 4 + ["/v1/chat/completions"]
            streams = [asyncio.ensure_future(read_stream(client, srv.url + p, b, e))
                       for p, b, e in zip(paths, bodies, started, strict=True)]
            whole = asyncio.ensure_future(client.post(srv.url + "/v1/completions", json=long))
            await asyncio.gather(*(e.wait() for e in started))
            srv.proc.send_signal(15)
            return list(await asyncio.gather(*streams)), await whole

    try:
        streams, whole = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    finally:
        code, out = srv.stop()
    for lines in streams:
        assert lines[-1] == "[DONE]", lines[-3:]
    assert [finish_reasons(lines) for lines in streams] == [["abort"]] * 3 + [["abort", "abort"]] + [["abort"]]
    assert whole.status_code == 200 and whole.json()["choices"][0]["finish_reason"] == "abort"
    assert code == 0, out
    cut = [line for line in out.splitlines() if "were cut" in line]
    assert len(cut) == 1 and "6 request(s)" in cut[0], out
    assert "Traceback" not in out and "CancelledError" not in out, out


def _closed(sock: socket.socket, deadline: float) -> bool:
    """Whether the server closes ``sock`` before ``deadline`` (a blocking read: EOF or a reset)."""
    sock.settimeout(max(0.1, deadline - time.monotonic()))
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_connections_that_never_send_their_headers_are_closed_and_a_long_stream_is_not(
    slow: tuple[Path, dict[str, str]]
) -> None:
    """With --header-timeout 2: 30 silent connections and 30 that sent half their headers are
    closed by the server, without an answer; a request body that stops arriving is a 408; a
    stream that runs on past the timeout, on its own connection, is served to the end."""
    path, env = slow
    srv = Server(path, "--external-model-packages", "slow_llama", "--header-timeout", "2", env=env)
    first = threading.Event()
    lines: list[str] = []

    def long_stream() -> None:
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=TIMEOUT, json={
                "model": "tiny", "prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[len("data: "):])
                    first.set()

    reader = threading.Thread(target=long_stream)
    try:
        reader.start()
        assert first.wait(TIMEOUT)
        socks = []
        for i in range(60):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=TIMEOUT)
            if i % 2:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
            socks.append(s)
        body = socket.create_connection(("127.0.0.1", srv.port), timeout=TIMEOUT)
        body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\":")
        deadline = time.monotonic() + TIMEOUT
        try:
            assert all(_closed(s, deadline) for s in socks)
            answer = b""
            while b"--header-timeout" not in answer:  # the answer may come in several segments
                body.settimeout(max(0.1, deadline - time.monotonic()))
                chunk = body.recv(4096)
                if not chunk:
                    break
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408") and b"--header-timeout" in answer, answer
        finally:
            for s in (*socks, body):
                s.close()
        reader.join(TIMEOUT)
        assert not reader.is_alive()
        assert lines[-1] == "[DONE]" and finish_reasons(lines) == ["length"]
    finally:
        code, out = srv.stop()
    assert code == 0, out


def test_past_max_connections_requests_are_503s_and_health_answers(checkpoint: Path) -> None:
    """With --max-connections 4 and six idle connections open, a request is a 503 naming the flag
    (with Retry-After) while /health answers 200; once they close, requests are served again."""
    srv = Server(checkpoint, "--max-connections", "4", "--header-timeout", "600")
    idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=TIMEOUT) for _ in range(6)]
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    try:
        deadline = time.monotonic() + TIMEOUT  # until the server has accepted the idle connections
        while True:
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=TIMEOUT)
            if r.status_code == 503 or time.monotonic() > deadline:
                break
        assert r.status_code == 503 and "--max-connections" in r.json()["error"]["message"], r.text
        assert r.headers.get("retry-after") == "1"
        assert httpx.get(srv.url + "/health", timeout=TIMEOUT).status_code == 200
        for s in idle:
            s.close()
        deadline = time.monotonic() + TIMEOUT
        while True:
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=TIMEOUT)
            if r.status_code == 200 or time.monotonic() > deadline:
                break
        assert r.status_code == 200, r.text
    finally:
        for s in idle:
            s.close()
        code, out = srv.stop()
    assert code == 0, out


def test_a_fault_in_the_engine_loop_ends_every_request_and_serve_exits_non_zero(
    slow: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """A fault planted in the scheduler (the engine loop's own work) while three streams run: each
    stream ends at once with an error event and [DONE] (no hang), every /health answer from then on
    is a 503 naming the fault (or the server is gone), and serve exits 1, well within its
    --shutdown-timeout of 60 s (the streams it would drain have ended)."""
    path, env = slow
    launcher = tmp_path / "planted.py"
    launcher.write_text(textwrap.dedent(PLANTED))
    srv = Server(path, "--external-model-packages", "slow_llama", "--shutdown-timeout", "60", env=env,
                 launcher=(str(launcher),))
    long = {"model": "tiny", "prompt": "Hello", "max_tokens": 1500, "ignore_eos": True}

    async def main() -> tuple[list[list[str]], Any]:
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            started = [asyncio.Event() for _ in range(3)]
            streams = [asyncio.ensure_future(read_stream(client, srv.url + "/v1/completions", long, e))
                       for e in started]
            await asyncio.gather(*(e.wait() for e in started))
            fatal = await client.post(srv.url + "/v1/completions", json={
                "model": "tiny", "prompt": [SENTINEL, 5, 6], "max_tokens": 4})
            return list(await asyncio.gather(*streams)), fatal

    try:
        streams, fatal = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
        health = []
        deadline = time.monotonic() + TIMEOUT
        while srv.proc.poll() is None and time.monotonic() < deadline:
            try:
                health.append(httpx.get(srv.url + "/health", timeout=30))
            except httpx.HTTPError:  # it stopped listening: it is exiting
                break
        exited = srv.proc.wait(timeout=TIMEOUT)  # by itself: nobody signals it
    finally:
        code, out = srv.stop(timeout=TIMEOUT)
    assert fatal.status_code == 503, fatal.text
    for lines in streams:
        assert lines[-1] == "[DONE]" and "error" in json.loads(lines[-2]), lines[-3:]
    assert all(h.status_code == 503 and "planted fault" in h.json()["message"] for h in health)
    assert exited == code == 1, out
    assert "the engine is broken" in out and "planted fault in the engine loop" in out


def test_health_is_503_from_the_moment_the_engine_loop_breaks(checkpoint: Path) -> None:
    """In-process app: /health is 200, then a fault planted in the engine loop's planning breaks the
    engine -- the request that was running gets its error event and [DONE], a non-streamed one a
    503 -- and from then on /health answers 503 naming the fault (it once kept answering ok over a
    loop that had ended)."""
    from rtpcore import AsyncEngine
    from rtpcore.serving.app import build_app

    async def main() -> None:
        engine = AsyncEngine.from_pretrained(checkpoint)
        app = build_app(engine, model_name="tiny")
        scheduler = engine.engine.core.scheduler  # the fault is planted on this instance only
        real = scheduler.schedule
        ran = [0]  # steps planned that ran the request (a plan with nothing to run does not count)

        def schedule() -> Any:
            if ran[0] >= 4:  # the request is running: its fifth step is never planned
                raise RuntimeError("planted fault in the engine loop")
            plan = real()
            ran[0] += bool(plan.seqs)
            return plan

        scheduler.schedule = schedule
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://app", timeout=TIMEOUT) as client:
                assert (await client.get("/health")).status_code == 200
                lines = []
                body = {"model": "tiny", "prompt": "Hello", "max_tokens": 1000, "ignore_eos": True, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            lines.append(line[len("data: "):])
                assert lines[-1] == "[DONE]" and "error" in json.loads(lines[-2])
                # it broke mid-request: four steps had run it (their text may still be held back
                # as an incomplete UTF-8 character, so the stream's chunks are not counted)
                assert ran[0] == 4
                health = await client.get("/health")
                assert health.status_code == 503 and "planted fault" in health.json()["message"]
                r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
                assert r.status_code == 503, r.text
        finally:
            await engine.aclose()

    asyncio.run(asyncio.wait_for(main(), TIMEOUT))


def test_the_command_line_defaults_are_the_servers() -> None:
    """rtpcore serve's --header-timeout, --max-connections, --stream-idle-timeout and
    --stream-buffer-bytes defaults (written in the CLI, which does not import uvicorn for --help)
    are rtpcore.serving's."""
    from rtpcore.cli import _serve
    from rtpcore.serving import server, state

    assert (_serve.DEFAULT_HEADER_TIMEOUT, _serve.DEFAULT_MAX_CONNECTIONS, _serve.DEFAULT_STREAM_IDLE_TIMEOUT) == (
        server.DEFAULT_HEADER_TIMEOUT, server.DEFAULT_MAX_CONNECTIONS, server.DEFAULT_STREAM_IDLE_TIMEOUT)
    assert _serve.DEFAULT_STREAM_BUFFER_BYTES == state.DEFAULT_STREAM_BUFFER_BYTES

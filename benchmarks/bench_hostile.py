"""Hostile loads against ``rtpcore serve`` while a separate process probes ``/health``
(docs/design.md §17: the event loop stays free; bounded memory per client).

    python benchmarks/bench_hostile.py [--load NAME ...] [--markers 16384] [--unread 8]
        [--idle-timeout 10] [--keep DIR]

Builds a small seeded Llama (transformers' LlamaForCausalLM, 2 layers, width 64, a 20k-token
context) with a byte-level BPE tokenizer in which ``<tool_call>`` and ``</tool_call>`` are
single (non-special) tokens, serves it with ``--tool-call-parser hermes --stream-idle-timeout
S`` on 127.0.0.1, and runs each load in turn:

- ``huge-prompts``: two 7.2 MB chat bodies at once, then one 28 MB body (each a 400: the
  prompt cannot fit ``max_model_len``, found before it is tokenized);
- ``big-grammar``: a ``response_format`` schema whose one property is an enum of 50,000
  values, ``n=16``, sent twice at once (compiled once, off the loop; each choice copies the
  matcher);
- ``tool-markers``: a streamed chat with tools whose ``logit_bias`` makes every one of
  ``--markers`` tokens ``<tool_call>`` (the incremental hermes parser reads each delta once);
- ``unread-streams``: ``--unread`` clients each open a streamed completion of 16 choices of
  3,000 tokens with 5 logprobs and read nothing (a 4 KiB receive buffer): their requests pause
  once their unsent bytes pass ``--stream-buffer-bytes``, and each connection is aborted after
  ``--stream-idle-timeout`` seconds (``--idle-timeout``, default 10).

A separate process sends ``GET /health`` back to back on one keep-alive connection for the
whole run; each load's line gives how many probes it saw, their median, and the worst one:
the longest the event loop left a client unanswered. The server's resident memory (VmRSS of
the process, benchmarks/soak.py's ``tree_rss``) is read before and after each load (after:
once the server has no request running, waiting or paused). Printed: the CPU
(benchmarks/soak.py's ``cpu_line``), the server command, a table (load, the answers' status
codes, probes, p50 and worst /health latency in ms, RSS before, peak and after in MB), and two
target lines: every worst latency under 100 ms, and RSS after the unread streams within 10%
of RSS before them. Exit status 0 when every load ran (targets met or not; ``--check`` makes
a missed target exit 1).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from soak import HOST, Server, ServerFailed, cpu_line, free_port, tree_rss

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
MARKERS = ["<tool_call>", "</tool_call>"]
CONTEXT = 20480
LOADS = ("huge-prompts", "big-grammar", "tool-markers", "unread-streams")
TIMEOUT = 900.0  # a bound against hanging, not a speed requirement


# ---------------------------------------------------------------- checkpoint


def build_checkpoint(path: Path) -> int:
    """The seeded tiny Llama and its tokenizer; returns the id of ``<tool_call>``."""
    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    rng = random.Random(0)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 8))) for _ in range(3000)]
    corpus = [" ".join(rng.choices(words, k=16)) for _ in range(3000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=1000, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": CHATML,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=tok.get_vocab_size(), max_position_embeddings=CONTEXT,
                      bos_token_id=1, eos_token_id=2, pad_token_id=None)
    LlamaForCausalLM(cfg).save_pretrained(path)
    marker = tok.token_to_id(MARKERS[0])
    assert marker is not None
    return int(marker)


# ---------------------------------------------------------------- the /health probe


def probe(url: str, conn: Any, stop: Any) -> None:
    """In its own process: GET /health back to back until ``stop`` is set; sends the list of
    (start time, latency) pairs (time.monotonic, seconds) through ``conn``."""
    import httpx

    seen: list[tuple[float, float]] = []
    with httpx.Client(base_url=url, timeout=TIMEOUT) as client:
        while not stop.is_set():
            t0 = time.monotonic()
            with contextlib.suppress(httpx.HTTPError):
                client.get("/health")
            seen.append((t0, time.monotonic() - t0))
            time.sleep(0.005)
    conn.send(seen)


# ---------------------------------------------------------------- loads


def huge_bodies(model: str, _: argparse.Namespace) -> list[bytes]:
    """The huge-prompts load's bodies: built before the load (the client's work is not the
    server's: on 2 cores a client building 40 MB of JSON inside the window takes CPU from the
    server and the probe alike)."""

    def body(size: int) -> bytes:
        word = "lorem ipsum "
        text = word * (size // len(word))
        return json.dumps({"model": model, "max_tokens": 4,
                           "messages": [{"role": "user", "content": text}]}).encode()

    return [body(7_200_000), body(7_200_000), body(28_000_000)]


async def huge_prompts(url: str, bodies: list[bytes], _: argparse.Namespace) -> list[int]:
    """Each body sent by http.client in a thread: one ``sendall`` of the bytes, so that the
    client costs the machine little CPU beside the server (httpx spent 140 ms of CPU on the 28 MB
    body, inside the window)."""
    import http.client
    from urllib.parse import urlsplit

    where = urlsplit(url)

    def post(body: bytes) -> int:
        conn = http.client.HTTPConnection(where.hostname, where.port, timeout=TIMEOUT)
        try:
            conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
            answer = conn.getresponse()
            answer.read()
            return answer.status
        finally:
            conn.close()

    statuses = list(await asyncio.gather(*(asyncio.to_thread(post, b) for b in bodies[:2])))
    statuses.append(await asyncio.to_thread(post, bodies[2]))
    return statuses


def grammar_body(model: str, _: argparse.Namespace) -> bytes:
    """The big-grammar load's body (built before the load, as :func:`huge_bodies`)."""
    schema = {"type": "object", "properties": {"pick": {"enum": [f"value-{i}" for i in range(50_000)]}},
              "required": ["pick"], "additionalProperties": False}
    return json.dumps({"model": model, "prompt": "pick one", "max_tokens": 8, "n": 16, "temperature": 1.0, "seed": 1,
                       "response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}},
                      ).encode()


async def big_grammar(url: str, body: bytes, _: argparse.Namespace) -> list[int]:
    import httpx

    headers = {"Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        answers = await asyncio.gather(*(client.post("/v1/completions", content=body, headers=headers)
                                         for _ in range(2)))
    return [a.status_code for a in answers]


async def tool_markers(url: str, model: str, args: argparse.Namespace) -> list[int]:
    import httpx

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    body = {"model": model, "messages": [{"role": "user", "content": "call"}], "tools": tools, "stream": True,
            "max_tokens": args.markers, "ignore_eos": True, "logit_bias": {str(args.marker_id): 100}}
    status, events = 0, 0
    async with (httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client,
                client.stream("POST", "/v1/chat/completions", json=body) as answer):
        status = answer.status_code
        async for line in answer.aiter_lines():
            events += line.startswith("data: ")
    print(f"  tool-markers: {events} events streamed", flush=True)
    return [status]


async def unread_streams(url: str, model: str, args: argparse.Namespace) -> list[int]:
    """Open the streams, read only the status line of each, then nothing; return once the
    server has aborted every connection (the idle timeout)."""
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 3000, "ignore_eos": True, "stream": True,
                       "logprobs": 5, "n": 16, "temperature": 1.0, "seed": 3}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    socks = []
    for _ in range(args.unread):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect((HOST, port))
        s.sendall(request)
        socks.append(s)
    statuses = []
    for s in socks:
        s.settimeout(TIMEOUT)
        head = s.recv(12)
        statuses.append(int(head[9:12]) if head.startswith(b"HTTP/1.1 ") else 0)
    args.peak = await wait_for(url, lambda m: m["rtpcore_requests_paused"] >= 16 * args.unread, TIMEOUT, args)
    await wait_for(url, lambda m: m["rtpcore_requests_paused"] == 0 and m["rtpcore_requests_running"] == 0,
                   args.idle_timeout + TIMEOUT, None)
    for s in socks:
        s.close()
    return statuses


async def wait_for(url: str, cond: Callable[[dict[str, float]], bool], timeout: float,
                   args: argparse.Namespace | None) -> int:
    """Poll /metrics until ``cond`` holds; the server's peak RSS meanwhile (when ``args``)."""
    import httpx

    deadline = time.monotonic() + timeout
    peak = 0
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        while True:
            if args is not None:
                peak = max(peak, tree_rss(args.pid))
            m = metrics((await client.get("/metrics")).text)
            if cond(m):
                return peak
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server never reached the state waited for: {m}")
            await asyncio.sleep(0.1)


def metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


#: Built before a load's window opens: what its function gets as its second argument (else the model name).
PREPARE: dict[str, Callable[[str, argparse.Namespace], Any]] = {"huge-prompts": huge_bodies,
                                                                "big-grammar": grammar_body}
LOAD_FUNCS = {"huge-prompts": huge_prompts, "big-grammar": big_grammar, "tool-markers": tool_markers,
              "unread-streams": unread_streams}


# ---------------------------------------------------------------- the run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", action="append", choices=LOADS, help="run only these loads (repeatable)")
    p.add_argument("--markers", type=int, default=16384, help="tool-call markers of the tool-markers load")
    p.add_argument("--unread", type=int, default=8, help="unread streams of the unread-streams load")
    p.add_argument("--idle-timeout", type=float, default=10.0, help="the server's --stream-idle-timeout")
    p.add_argument("--keep", type=Path, help="build the checkpoint here (kept) instead of a temporary folder")
    p.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = p.parse_args(argv)
    loads = args.load or list(LOADS)
    print(cpu_line(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.keep or Path(tmp) / "ckpt"
        ckpt.mkdir(parents=True, exist_ok=True)
        args.marker_id = build_checkpoint(ckpt)
        port = free_port()
        argv_ = [sys.executable, "-m", "rtpcore", "serve", str(ckpt), "--port", str(port), "--served-model-name",
                 "hostile", "--tool-call-parser", "hermes", "--stream-idle-timeout", str(args.idle_timeout),
                 "--max-request-bytes", "64MiB", "--log-level", "warning"]
        print("server:", " ".join(argv_[1:]), flush=True)
        server = Server(argv_, port, Path(tmp) / "server.log")
        try:
            server.start(TIMEOUT)
        except ServerFailed as exc:
            print(exc, file=sys.stderr)
            return 1
        args.pid = server.pid
        ctx = mp.get_context("spawn")  # a fresh interpreter: the probe shares no lock or thread with this one
        parent, child = ctx.Pipe()
        stop = ctx.Event()
        prober = ctx.Process(target=probe, args=(server.url, child, stop), daemon=True)
        rows = []
        try:
            prober.start()
            time.sleep(1.0)  # the probe's first answers: a baseline before any load
            for name in loads:
                args.peak = 0
                payload = PREPARE[name]("hostile", args) if name in PREPARE else "hostile"
                before = tree_rss(server.pid)
                t0 = time.monotonic()
                statuses = asyncio.run(LOAD_FUNCS[name](server.url, payload, args))
                del payload
                t1 = time.monotonic()
                after = tree_rss(server.pid)
                rows.append((name, statuses, t0, t1, before, max(args.peak, after), after))
                print(f"  {name}: {t1 - t0:.1f} s, statuses {dict(Counter(statuses))}", flush=True)
        finally:
            stop.set()
            seen = parent.recv() if prober.is_alive() or parent.poll(30) else []
            prober.join(30)
            server.stop()
    return report(rows, seen, args)


def report(rows: list[tuple[Any, ...]], seen: list[tuple[float, float]], args: argparse.Namespace) -> int:
    print(f"\n{'load':16} {'answers':22} {'probes':>6} {'p50 ms':>7} {'worst ms':>9} "
          f"{'RSS before MB':>13} {'peak MB':>8} {'after MB':>8}")
    worst_all, rss_ok = 0.0, True
    for name, statuses, t0, t1, before, peak, after in rows:
        during = [lat for start, lat in seen if start + lat >= t0 and start <= t1]
        worst = max(during, default=float("nan"))
        p50 = statistics.median(during) if during else float("nan")
        worst_all = max(worst_all, worst) if during else worst_all
        answers = ", ".join(f"{code}x{n}" for code, n in sorted(Counter(statuses).items()))
        print(f"{name:16} {answers:22} {len(during):>6} {p50 * 1e3:>7.1f} {worst * 1e3:>9.1f} "
              f"{before / 2**20:>13.1f} {peak / 2**20:>8.1f} {after / 2**20:>8.1f}")
        if name == "unread-streams":
            rss_ok = after <= before * 1.10
    ok_gap = worst_all < 0.100
    print(f"\ntarget: worst /health latency under 100 ms for every load: {worst_all * 1e3:.1f} ms "
          f"({'met' if ok_gap else 'MISSED'})")
    if any(r[0] == "unread-streams" for r in rows):
        print(f"target: RSS after the unread streams within 10% of before: {'met' if rss_ok else 'MISSED'}")
    return 1 if args.check and not (ok_gap and rss_ok) else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())

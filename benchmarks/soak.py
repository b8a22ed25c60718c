"""Resident memory of ``rtpcore serve`` under a steady mixed load (docs/design.md §22:
after warm-up, RSS grows by under 0.2 KB per request, with or without the prefix cache).

    python benchmarks/soak.py [--duration 600] [--clients 8] [--demo llama | --checkpoint PATH]
        [--interval 60] [--warmup S] [--seed 0] [--serve-arg ARG ...] [-- SERVE ARGS ...]
    python benchmarks/soak.py --url http://127.0.0.1:PORT --pid PID [--model NAME] ...

Starts ``rtpcore serve --demo llama`` (the built-in demo checkpoint, built on first use under
``~/.cache/rtpcore/demo``; ``--checkpoint`` serves a checkpoint folder instead) as a
subprocess on 127.0.0.1 with a free port, waits for ``/health``, then runs ``--clients``
concurrent clients for ``--duration`` seconds. Extra ``rtpcore serve`` options are given
with ``--serve-arg`` (repeatable; ``--serve-arg=--no-enable-prefix-caching``) or after ``--``:

    python benchmarks/soak.py --duration 240 -- --no-enable-prefix-caching

``--url`` and ``--pid`` drive a server that is already running instead (started by hand, e.g.
under a profiler) and sample the process ``--pid``.

Each client loops, with no pause, over requests drawn from its own seeded generator: chat
completions and completions (half each), streamed or not (half each), 4-24 tokens of
``max_tokens``, prompts of 3-60 seeded pseudo-words (a third of the chats with a shared
system message), stop strings (a third), logprobs (a quarter: ``logprobs``/``top_logprobs``
0-3), and ``n=2`` with ``temperature`` 0.8 and a ``seed`` (a fifth); the rest are greedy or
sampled at 0.7 with a seed; a streamed request asks for its usage half the time. A request is
served when it answers 200 and (streamed) ends with ``[DONE]`` and no error event; any other
outcome is counted as failed under its status (``stream-error``, or the exception's name).

The server's resident memory (VmRSS of ``/proc/PID/status``, plus that of its child
processes, if any) is sampled when the load starts, at the end of ``--warmup`` (default 60 s,
or a fifth of a shorter run), every ``--interval`` seconds (from the start) and once more
when the last request has finished. Printed: the CPU model (``/proc/cpuinfo``) and its
avx2/avx512f/amx flags, the server command, one line per sample (elapsed seconds, requests
served so far, RSS in MB, growth since the warm-up sample), requests served and failed (by
status), requests/s, then the growth after warm-up per request served after warm-up --
(RSS_end - RSS_warmup) / requests -- and the least-squares slope of RSS over requests served
across the post-warm-up samples (bytes/request), with a line saying whether the target
(``--target`` bytes/request, default 200, on the first figure) was met. Exit status 0 when the
soak ran (the target met or not; ``--check`` makes a missed target exit 1); 1 when the server
failed to start or died, or when no request was served.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
STOP_STRINGS = ["\n", ".", "e", "th", " a", "!", "ab"]
SYSTEM = "You are a terse assistant. Answer in one short line, with no preamble and no lists."


# ---------------------------------------------------------------- machine


def cpu_line() -> str:
    """The CPU model and the instruction-set flags that matter to the kernels."""
    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown CPU":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    feats = [f for f in ISA_FLAGS if f in flags]
    return f"CPU: {model} ({os.cpu_count()} logical CPUs); flags: {' '.join(feats) or 'none of avx2/avx512f/amx'}"


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def _vmrss(pid: int) -> int:
    """VmRSS of one process in bytes (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_rss(pid: int) -> int:
    """VmRSS of ``pid`` and of all its descendants, in bytes."""
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        total += _vmrss(p)
        todo += _children(p)
    return total


# ---------------------------------------------------------------- server


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class ServerFailed(RuntimeError):
    pass


class Server:
    """``rtpcore serve`` as a subprocess; ``start`` returns once /health answers 200."""

    def __init__(self, argv: list[str], port: int, log: Path):
        self.argv, self.port, self.log = argv, port, log
        self.url = f"http://{HOST}:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float) -> None:
        import httpx

        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "NO_PROXY": HOST}
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise ServerFailed(f"the server did not answer /health within {timeout:.0f} s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30) -> None:
        if not self.alive():
            return
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


# ---------------------------------------------------------------- load


def word_list(seed: int, size: int = 2000) -> list[str]:
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
    return sorted({"".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(size)})


def draw_request(rng: random.Random, words: list[str], model: str) -> tuple[str, dict[str, Any]]:
    """One request of the mix: (path, JSON body)."""
    chat = rng.random() < 0.5
    text = " ".join(rng.choices(words, k=rng.randint(3, 60)))
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(4, 24)}
    if rng.random() < 0.2:
        body.update(n=2, temperature=0.8, seed=rng.randrange(1 << 30))
    elif rng.random() < 0.5:
        body["temperature"] = 0.0
    else:
        body.update(temperature=0.7, seed=rng.randrange(1 << 30))
    if rng.random() < 1 / 3:
        body["stop"] = rng.sample(STOP_STRINGS, rng.randint(1, 2))
    logprobs = rng.random() < 0.25
    top = rng.randint(0, 3)
    if rng.random() < 0.5:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    if chat:
        messages = [{"role": "user", "content": text}]
        if rng.random() < 1 / 3:
            messages.insert(0, {"role": "system", "content": SYSTEM})
        body["messages"] = messages
        if logprobs:
            body.update(logprobs=True, top_logprobs=top)
        return "/v1/chat/completions", body
    body["prompt"] = text
    if logprobs:
        body["logprobs"] = top
    return "/v1/completions", body


@dataclass
class Tally:
    served: int = 0
    failed: collections.Counter[str] = field(default_factory=collections.Counter)
    tokens: int = 0


async def one_request(client: Any, path: str, body: dict[str, Any]) -> tuple[bool, str]:
    """Send one request; (served, status)."""
    if body.get("stream"):
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return False, str(resp.status_code)
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                elif '"error"' in data and "error" in json.loads(data):
                    return False, "stream-error"
            return done, "200" if done else "stream-cut"
    resp = await client.post(path, json=body)
    if resp.status_code != 200:
        return False, str(resp.status_code)
    resp.json()
    return True, "200"


async def client_loop(i: int, url: str, model: str, seed: int, deadline: float, tally: Tally,
                      timeout: float) -> None:
    import httpx

    rng = random.Random(seed * 1000 + i)
    words = word_list(seed)
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        while time.monotonic() < deadline:
            path, body = draw_request(rng, words, model)
            try:
                ok, status = await one_request(client, path, body)
            except httpx.HTTPError as exc:
                ok, status = False, type(exc).__name__
            if ok:
                tally.served += 1
            else:
                tally.failed[status] += 1


@dataclass
class Sample:
    t: float
    served: int
    rss: int
    label: str = ""


async def soak(url: str, pid: int, model: str, args: argparse.Namespace,
               alive: Any = lambda: True) -> tuple[list[Sample], Sample, Tally, float]:
    """Run the load; the samples, the warm-up sample, the tally and the wall time."""
    tally = Tally()
    start = time.monotonic()
    deadline = start + args.duration
    samples = [Sample(0.0, 0, tree_rss(pid), "start")]
    print(f"{'t (s)':>8} {'served':>8} {'RSS (MB)':>10} {'since warm-up':>14}", flush=True)
    _print_sample(samples[0], None)
    clients = [asyncio.ensure_future(client_loop(i, url, model, args.seed, deadline, tally, args.request_timeout))
               for i in range(args.clients)]
    marks = sorted({args.warmup, *[k * args.interval for k in range(1, int(args.duration // args.interval) + 1)]})
    marks = [m for m in marks if m < args.duration]
    warm: Sample | None = None
    for mark in marks:
        delay = start + mark - time.monotonic()
        done, _ = await asyncio.wait(clients, timeout=max(0.0, delay))
        if len(done) == len(clients) or not alive():
            break
        s = Sample(time.monotonic() - start, tally.served, tree_rss(pid), "warm-up" if mark == args.warmup else "")
        samples.append(s)
        if mark == args.warmup:
            warm = s
        _print_sample(s, warm)
    await asyncio.gather(*clients, return_exceptions=True)
    wall = time.monotonic() - start
    end = Sample(wall, tally.served, tree_rss(pid), "end")
    samples.append(end)
    _print_sample(end, warm)
    if warm is None:
        warm = samples[0]
    return samples, warm, tally, wall


def _print_sample(s: Sample, warm: Sample | None) -> None:
    growth = "" if warm is None or s is warm else f"{(s.rss - warm.rss) / 1e6:+.2f} MB"
    print(f"{s.t:8.1f} {s.served:8d} {s.rss / 1e6:10.1f} {growth:>14} {s.label}", flush=True)


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of y over x."""
    if len(points) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in points) / sxx


def report(samples: list[Sample], warm: Sample, tally: Tally, wall: float, args: argparse.Namespace) -> bool:
    """Print the figures; whether the target was met."""
    end = samples[-1]
    failed = sum(tally.failed.values())
    statuses = ", ".join(f"{k}: {v}" for k, v in sorted(tally.failed.items())) or "none"
    print(f"\nrequests served: {tally.served} in {wall:.0f} s ({tally.served / wall:.1f}/s, {args.clients} clients); "
          f"failed: {failed} ({statuses})")
    print(f"RSS: start {samples[0].rss / 1e6:.1f} MB, warm-up ({warm.t:.0f} s, {warm.served} served) "
          f"{warm.rss / 1e6:.1f} MB, end {end.rss / 1e6:.1f} MB")
    after = end.served - warm.served
    post = [s for s in samples if s.t >= warm.t]
    fit = slope([(s.served, s.rss) for s in post])
    if after <= 0:
        print("no request was served after the warm-up: no per-request growth")
        return False
    per_request = (end.rss - warm.rss) / after
    minutes = (end.t - warm.t) / 60
    print(f"growth after warm-up: {(end.rss - warm.rss) / 1e6:+.2f} MB over {after} requests = "
          f"{per_request:.0f} B/request ({(end.rss - warm.rss) / 1e6 / minutes:+.2f} MB/min)")
    if fit is not None:
        print(f"least-squares slope over the {len(post)} post-warm-up samples: {fit:.0f} B/request")
    if len(post) >= 3:  # the last third: does it still grow?
        tail = post[len(post) - max(2, len(post) // 3):]
        if tail[-1].served > tail[0].served:
            print(f"last third ({tail[0].t:.0f}-{tail[-1].t:.0f} s): "
                  f"{(tail[-1].rss - tail[0].rss) / (tail[-1].served - tail[0].served):.0f} B/request")
    met = per_request < args.target
    print(f"target (< {args.target:.0f} B/request after warm-up): {'MET' if met else 'NOT MET'} "
          f"({per_request:.0f} B/request)")
    return met


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=600, help="seconds of load (default 600)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    parser.add_argument("--demo", default="llama", metavar="MODEL",
                        help="serve `rtpcore serve --demo MODEL` (default llama)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="serve this checkpoint folder instead of a demo")
    parser.add_argument("--interval", type=float, default=60, help="seconds between RSS samples (default 60)")
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds of load before the reference sample (default 60, or a fifth of a shorter run)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request mix (default 0)")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="an extra `rtpcore serve` argument (repeatable); also: everything after `--`")
    parser.add_argument("--target", type=float, default=200, help="bytes/request of growth allowed (default 200)")
    parser.add_argument("--check", action="store_true", help="exit 1 when the target is not met")
    parser.add_argument("--start-timeout", type=float, default=300, help="seconds for /health to answer (default 300)")
    parser.add_argument("--request-timeout", type=float, default=120, help="seconds a request may take (default 120)")
    parser.add_argument("--log", type=Path, default=None, help="keep the server's log here (default: a temporary file)")
    parser.add_argument("--url", default=None, help="drive this running server instead of starting one (with --pid)")
    parser.add_argument("--pid", type=int, default=None, help="with --url: the server process to sample")
    parser.add_argument("--model", default=None, help="the model name to send (default: soak, or /v1/models' first with --url)")
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.clients < 1 or args.interval <= 0:
        parser.error("--duration and --interval must be > 0, --clients >= 1")
    if (args.url is None) != (args.pid is None):
        parser.error("--url and --pid go together")
    if args.warmup is None:
        args.warmup = 60.0 if args.duration >= 300 else args.duration / 5
    if not 0 < args.warmup < args.duration:
        parser.error("--warmup must be > 0 and below --duration")
    serve_args = [*args.serve_arg, *passthrough]

    import httpx

    print(cpu_line())
    print(f"Python {platform.python_version()}, {platform.machine()}; soak of {args.duration:.0f} s, "
          f"{args.clients} clients, warm-up {args.warmup:.0f} s, RSS every {args.interval:.0f} s, seed {args.seed}")
    server: Server | None = None
    tmp = tempfile.TemporaryDirectory(prefix="soak_")
    try:
        if args.url is None:
            port = free_port()
            model = args.model or "soak"
            target = [str(args.checkpoint)] if args.checkpoint is not None else ["--demo", args.demo]
            cmd = [sys.executable, "-m", "rtpcore", "serve", *target, "--host", HOST, "--port", str(port),
                   "--served-model-name", model, *serve_args]
            log = args.log or Path(tmp.name) / "server.log"
            server = Server(cmd, port, log)
            print("server: " + " ".join(cmd[1:]), flush=True)
            t0 = time.monotonic()
            try:
                server.start(args.start_timeout)
            except ServerFailed as exc:
                print(f"FAILED: {exc}", file=sys.stderr)
                return 1
            print(f"server up in {time.monotonic() - t0:.1f} s (pid {server.pid}, log {log})", flush=True)
            url, pid, alive = server.url, server.pid, server.alive
        else:
            url, pid, alive = args.url.rstrip("/"), args.pid, lambda: os.path.exists(f"/proc/{args.pid}")
            model = args.model or httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
            print(f"server: {url} (pid {pid}), model {model!r}", flush=True)
        samples, warm, tally, wall = asyncio.run(soak(url, pid, model, args, alive))
        if not alive():
            print("FAILED: the server died during the soak" + (f":\n{server.log_tail()}" if server else ""),
                  file=sys.stderr)
            return 1
        met = report(samples, warm, tally, wall, args)
        if tally.served == 0:
            return 1
        return 1 if args.check and not met else 0
    finally:
        if server is not None:
            server.stop()
        tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())

"""Serving throughput and latency of ``rtpcore serve`` against ``transformers serve
--continuous-batching`` on the same checkpoint, driven by the real ``openai`` client.

    python benchmarks/bench_serve.py [--scenario steady|load|both|multiturn|llamacpp] [--quick]
        [--clients N] [--skip-transformers] [--rtpcore-arg=--FLAG ...]
      steady:    [--tokens 64] [--rounds 3] [--max-batch-size 16]
      load:      [--prompt-tokens 64:768] [--output-tokens 256:512] [--arrival-rate 4]
                 [--kv-fraction 0.25] [--max-batch-size N] [--max-num-batched-tokens N] [--seed 0]
      llamacpp:  --llamacpp DIR [--gguf-model smollm2-135m] [--gguf-types f32,q8_0] [--prompt-words 64:512]
      multiturn: [--turns 4] [--turn-tokens 64] [--system-tokens 1500] [--max-batch-size N]
                 [--max-num-batched-tokens N] [--seed 0]

Builds, in a temporary folder, a seeded ~56M-parameter Llama (the shape of
``bench_decode.py``: hidden 512, 8 layers, 8 heads, 4 KV heads, intermediate 1376) whose
vocabulary is a byte-level BPE ``tokenizer.json`` trained here on seeded text (32000
tokens), with a ChatML template in ``tokenizer_config.json``. The checkpoint has no
``eos_token_id`` (config.json and generation_config.json), so that both servers generate
exactly ``--tokens`` tokens; rtpcore is also sent ``ignore_eos``.

Each server runs in turn as a subprocess on 127.0.0.1 (``--dtype``: float32 unless
``bfloat16``, CPU, offline), and is sent
one warm-up round then ``--rounds`` timed rounds; a round is ``--clients`` concurrent
streaming chat completions of ``--tokens`` tokens each. Per engine it prints output tokens/s
(completion tokens of the timed rounds over their wall time), p50 and p99 time to first
token (first chunk with text) and p50 time between tokens (per request: from its first to
its last text chunk, over its tokens after the first; chunks that carry several tokens
are counted as such), and the ratio rtpcore/transformers. A server that cannot start or
fails is reported and the other row is still printed. This is ``--scenario steady``, the
default (``--clients`` 16).

``--scenario load`` (``--clients`` 64): one warm-up of a few short requests, then one timed
run of ``--clients`` streaming chat completions that arrive as a seeded Poisson process of
``--arrival-rate`` requests/s (the first at t=0). Prompt lengths are spread uniformly over
``--prompt-tokens`` (seeded, stratified: one length per equal slice of the range, shuffled),
counted as the servers count them: the ChatML-rendered conversation encoded by the
checkpoint's tokenizer, checked against each response's ``usage.prompt_tokens``. Each
request's ``max_tokens`` is drawn uniformly from ``--output-tokens`` (seeded). rtpcore gets a
KV pool of ``--kv-fraction`` (a quarter) of the worst case, the sum over requests of their
prompt + max_tokens tokens in whole KV blocks (block bytes from ``rtpcore kv-spec --json``),
as ``--kv-cache-memory``; ``--max-batch-size`` and ``--max-num-batched-tokens`` are passed to
it only when given (otherwise rtpcore's defaults). transformers sizes its own cache. Per
engine: output tokens/s (completion tokens over the time from the first arrival to the last
completion), TTFT p50/p99 (from each request's arrival time), time between tokens p50/p99
(every gap between consecutive text chunks, pooled over all requests: p99 is what prompts
arriving mid-run do to the streams that are decoding), requests completed, then the ratios
and the targets (tokens/s >= 3x transformers, p50 TTFT <= 0.5x transformers', rtpcore's p99
TBT <= 3x its own p50 TBT). ``--scenario both`` runs steady, then load, on one checkpoint.

``--scenario multiturn`` (``--clients`` 16) measures automatic prefix caching: ``--clients``
conversations of ``--turns`` turns over one shared seeded system prompt of
``--system-tokens`` tokens (its ChatML-rendered system message, counted by the checkpoint's
tokenizer), each conversation with its own seeded user messages (16-48 tokens each, rendered
as a one-message conversation). Turn n of a conversation sends the system prompt, the user
messages so far and the replies the server returned to the earlier turns (their text), as a
streaming chat completion of ``--turn-tokens`` tokens; the conversations run concurrently,
each through its turns one after the other with no pause. Three engines run in turn, after a
warm-up of a few short requests that share nothing with the conversations: rtpcore (prefix
caching on, its default), rtpcore-nocache (``--no-enable-prefix-caching``) and transformers.
rtpcore's KV pool holds ``--clients`` sequences of the checkpoint's whole context (what its
CPU default gives with a ``--max-batch-size`` of ``--clients``), more than every turn of every
conversation needs, so no cached block a later turn reads is evicted; ``--max-batch-size`` and
``--max-num-batched-tokens`` are passed only when given. Per engine: output tokens/s
(completion tokens over the time from the first turn sent to the last completed), TTFT p50 of
turn 1 and of turns 2..N, the mean fraction of the prompt tokens of turns 2..N that the
response reports cached (``usage.prompt_tokens_details.cached_tokens``; none reported counts as
0), turns completed, then the ratios rtpcore/rtpcore-nocache and rtpcore/transformers and the
targets (TTFT p50 of turns 2..N <= 0.3x rtpcore-nocache's, tokens/s >= 1.5x rtpcore-nocache).

``--scenario llamacpp`` (``--clients`` 32) compares ``rtpcore serve`` with llama.cpp's
``llama-server`` on the same GGUF files: ``--llamacpp DIR`` is what
``../shared/tools/setup_llamacpp.sh DIR CKPT`` built (``DIR/bin/llama-server`` and
``DIR/<model>-<type>.gguf``; ``--gguf-model``, default ``smollm2-135m``, the checkpoint
benchmarks/_smollm2.py writes), one pair of servers per ``--gguf-types`` (default
``f32,q8_0``). Each round is ``--clients`` concurrent streaming completions (``/v1/completions``:
the file has no chat template) of ``--tokens`` (default 128) tokens with ``ignore_eos``, over
seeded prompts of 64-512 words (``--prompt-words``), new prompts every round, so neither
server's prompt cache serves a round from an earlier one; one warm-up round, then ``--rounds``
(default 2) timed ones. llama-server runs with ``-t 2 -tb 2`` (its threads = this machine's 2
cores), ``--parallel`` = ``--clients`` slots of 2048 tokens each and continuous batching;
rtpcore with its defaults (``--max-batch-size`` and ``--max-num-batched-tokens`` passed only
when given). Per type: the steady table's columns, ratios rtpcore/llama-server, whether both
counted the same prompt tokens, and the targets (tokens/s >= 1.2x, p50 TTFT and p50 time
between tokens <= 1.0x llama-server's).

``--profile DIR`` (steady, load, llamacpp) samples each rtpcore server with py-spy through its timed
rounds and prints where its threads spent their samples (innermost frames, rtpcore functions):
the measurement to read before changing the serving loop. ``--rtpcore-arg ARG`` (repeatable) appends
ARG to every rtpcore serve command line, for A/B runs of one option; ``--skip-transformers`` runs
rtpcore alone (no transformers, and no llama-server in the llamacpp scenario).

``--quick`` shrinks everything (a handful of clients, short prompts and completions; multiturn:
3 conversations x 2 turns of 8 tokens over a 200-token system prompt) to check that the script
and the servers work; explicit options win over it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
HOST = "127.0.0.1"
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]  # ids 0..4


def _bench_decode() -> Any:
    """benchmarks/bench_decode.py as a module (for ``cpu_line``), loaded by path as
    bench_decode loads its deepseek helper."""
    spec = importlib.util.spec_from_file_location("bench_decode", HERE / "bench_decode.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- checkpoint


def corpus(seed: int = 0, words: int = 60000, lines: int = 20000) -> list[str]:
    """Seeded text of pseudo-words (Zipf-like frequencies) rich enough for a 32000-token BPE."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "ch", "sh", "qu", "ng"]
    vocab = sorted({"".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(words)})
    cum = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(len(vocab))))
    rng.shuffle(vocab)
    punct = [".", ",", "!", "?", ";", ""]
    return [
        " ".join(rng.choices(vocab, cum_weights=cum, k=rng.randint(8, 24))) + rng.choice(punct)
        for _ in range(lines)
    ]


def write_tokenizer(path: Path, vocab_size: int) -> int:
    """A byte-level BPE tokenizer.json of (at most) ``vocab_size`` tokens and a
    tokenizer_config.json with a ChatML template; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": CHATML,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }))
    return int(tok.get_vocab_size())


def make_checkpoint(path: Path, vocab_size: int) -> int:
    """The seeded Llama of bench_decode's shape with the tokenizer's vocabulary and no
    ``eos_token_id``; returns the parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(path, vocab_size)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=vocab, max_position_embeddings=2048, initializer_range=0.05,
        bos_token_id=1, eos_token_id=None, pad_token_id=None,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "do_sample": False}))
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class ServerFailed(RuntimeError):
    def summary(self) -> str:
        """The first line, and the last one when the first only introduces a log tail."""
        lines = [line for line in str(self).splitlines() if line.strip()]
        if len(lines) > 1 and lines[0].endswith(":"):
            return f"{lines[0]} {lines[-1].strip()}"
        return lines[0] if lines else "failed"


class Server:
    """A server subprocess on 127.0.0.1; ``start`` returns once /health answers 200."""

    def __init__(self, name: str, argv: list[str], port: int, log: Path, model: str):
        self.name, self.argv, self.port, self.log, self.model = name, argv, port, log, model
        self.url = f"http://{HOST}:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float) -> None:
        import httpx

        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "NO_PROXY": HOST}
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise ServerFailed(f"{self.name} did not answer /health within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM, then SIGKILL once ``timeout`` seconds pass."""
        if self.proc is None or self.proc.poll() is not None:
            return
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


RTPCORE_ARGS: list[str] = []  # --rtpcore-arg: appended to every rtpcore serve command line


def rtpcore_server(ckpt: Path, tmp: Path, max_batch_size: int | None, extra: list[str] | None = None, *,
                   dtype: str, name: str = "rtpcore") -> Server:
    """``rtpcore serve``; ``--max-batch-size`` only when given, then ``extra`` options; ``name``
    (which names its log too) starts with "rtpcore", which is what gets it ``ignore_eos``."""
    port = free_port()
    argv = [sys.executable, "-m", "rtpcore", "serve", str(ckpt), "--host", HOST, "--port", str(port),
            "--dtype", dtype, "--served-model-name", "bench",
            "--enable-prompt-tokens-details"]  # the cached fraction is read from usage
    if max_batch_size is not None:
        argv += ["--max-batch-size", str(max_batch_size)]
    argv += [*(extra or []), *RTPCORE_ARGS]
    return Server(name, argv, port, tmp / f"{name}.log", model="bench")


def transformers_server(ckpt: Path, tmp: Path, dtype: str = "float32") -> Server:
    """``transformers serve`` pinned to the checkpoint (requests must name it as given); its
    log (level warning) shows continuous batching: ``CB: True`` per request (transformers before
    5.2x) or a line of its ``ContinuousBatchingLogger`` (5.2x, when the batching manager starts)."""
    port = free_port()
    exe = Path(sys.executable).with_name("transformers")
    cli = [str(exe)] if exe.is_file() else [sys.executable, "-m", "transformers.cli.transformers"]
    argv = [*cli, "serve", str(ckpt), "--continuous-batching", "--device", "cpu", "--dtype", dtype,
            "--host", HOST, "--port", str(port), "--log-level", "warning"]
    return Server("transformers", argv, port, tmp / "transformers.log", model=str(ckpt))


# ---------------------------------------------------------------- clients


@dataclass
class Sample:
    start: float
    text_times: list[float] = field(default_factory=list)
    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens (0 when not reported)
    text: str = ""

    @property
    def ttft(self) -> float:
        return self.text_times[0] - self.start

    @property
    def tbt(self) -> float | None:
        """Mean time between tokens after the first, from first to last text chunk."""
        if self.tokens < 2 or len(self.text_times) < 2:
            return None
        return (self.text_times[-1] - self.text_times[0]) / (self.tokens - 1)


async def one_request(client: Any, server: Server, i: int, tokens: int, content: str | None = None,
                      start: float | None = None, messages: list[dict[str, str]] | None = None) -> Sample:
    """One streaming chat completion of one user message ``content``, or of the conversation
    ``messages`` when given; ``start`` (default: now) is when the request counts as sent."""
    extra: dict[str, Any] = {"ignore_eos": True} if server.name.startswith("rtpcore") else {}
    sample = Sample(start=time.perf_counter() if start is None else start)
    if messages is None:
        if content is None:
            content = f"Request {i}: tell me a long story about city number {i}."
        messages = [{"role": "user", "content": content}]
    stream = await client.chat.completions.create(
        model=server.model, stream=True, max_tokens=tokens, temperature=0.0,
        stream_options={"include_usage": True}, extra_body=extra or None, messages=messages,
    )
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            sample.text_times.append(now)
            sample.text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            sample.tokens = chunk.usage.completion_tokens
            sample.prompt_tokens = chunk.usage.prompt_tokens
            details = getattr(chunk.usage, "prompt_tokens_details", None)
            sample.cached_tokens = int(getattr(details, "cached_tokens", None) or 0)
    if not sample.text_times:
        raise ServerFailed(f"{server.name}: request {i} streamed no text")
    return sample


async def one_round(server: Server, clients: int, tokens: int, timeout: float) -> tuple[float, list[Sample]]:
    """``clients`` concurrent streams; (wall seconds, samples)."""
    import httpx
    from openai import AsyncOpenAI

    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=clients + 4), trust_env=False)
    async with AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                           timeout=timeout, http_client=http) as client:
        t = time.perf_counter()
        samples = await asyncio.wait_for(
            asyncio.gather(*(one_request(client, server, i, tokens) for i in range(clients))), timeout)
        return time.perf_counter() - t, list(samples)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


@dataclass
class Result:
    tok_s: float
    ttft_p50: float
    ttft_p99: float
    tbt_p50: float
    exact: bool  # every request produced exactly the asked tokens


def transformers_missing() -> list[str]:
    """Modules of ``transformers[serving]`` that ``transformers serve`` needs and are not installed."""
    return [m for m in ("fastapi", "uvicorn", "accelerate", "rich") if importlib.util.find_spec(m) is None]


def check_missing(server: Server) -> None:
    if server.name == "transformers" and (missing := transformers_missing()):
        raise ServerFailed(f"transformers serve needs transformers[serving]; missing: {', '.join(missing)}")


CB_MARKERS = ("CB: True", "ContinuousBatchingLogger")


def warn_no_cb(server: Server) -> None:
    """A warning when transformers' log does not show continuous batching serving a request
    (a version whose log says it otherwise, or a fallback to sequential generation)."""
    if server.name != "transformers":
        return
    log = server.log.read_text(errors="replace")
    if not any(marker in log for marker in CB_MARKERS) or "Falling back to sequential generation" in log:
        print(f"  warning: transformers' log does not show continuous batching (none of {CB_MARKERS})", flush=True)


@contextlib.contextmanager
def serving(server: Server, args: argparse.Namespace, what: str) -> Iterator[None]:
    """Start ``server`` for the block and always stop it; a failure in the block is a
    ServerFailed with the server's last log lines (``what`` names the run that timed out)."""
    try:
        server.start(args.start_timeout)
        yield
    except TimeoutError as exc:
        raise ServerFailed(f"{server.name}: {what} ran past {args.round_timeout:.0f} s:\n{server.log_tail()}") from exc
    except Exception as exc:
        if isinstance(exc, ServerFailed):
            raise
        raise ServerFailed(f"{server.name}: {type(exc).__name__}: {exc}\n{server.log_tail()}") from exc
    finally:
        server.stop()
    warn_no_cb(server)


@contextlib.contextmanager
def profiled(server: Server, args: argparse.Namespace) -> Iterator[None]:
    """With ``--profile DIR``, py-spy samples an rtpcore server (every thread, 100/s, without
    pausing it) while the block runs: collapsed stacks in DIR/<name>.txt and a summary printed
    after (where the server's threads spent their samples, by innermost frame and by rtpcore
    function). Without it, or for another server, nothing happens."""
    if args.profile is None or not server.name.startswith("rtpcore") or server.proc is None:
        yield
        return
    args.profile.mkdir(parents=True, exist_ok=True)
    out = args.profile / f"{server.name}.txt"
    spy = subprocess.Popen(["py-spy", "record", "--pid", str(server.proc.pid), "--rate", "100", "--format", "raw",
                            "--nonblocking", "--threads", "--output", str(out)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)
        _, err = spy.communicate(timeout=60)
    if not out.is_file():
        print(f"  profile: py-spy wrote nothing ({err.decode(errors='replace').strip()[-300:]})", flush=True)
        return
    print(profile_summary(out), flush=True)


def profile_summary(path: Path, top: int = 12) -> str:
    """The top innermost frames and the top rtpcore functions (inclusive) of py-spy's raw output."""
    leaf: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    threads: dict[str, int] = {}
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        threads[frames[0]] = threads.get(frames[0], 0) + count
        leaf[frames[-1]] = leaf.get(frames[-1], 0) + count
        for name in {f.split(" (")[0] + " (" + f.split(" (")[-1].split(":")[0] + ")" for f in frames[1:]
                     if "rtpcore" in f}:
            inclusive[name] = inclusive.get(name, 0) + count
    if not total:
        return f"  profile: {path}: no samples"

    def rows(d: dict[str, int]) -> list[str]:
        return [f"    {n / total:6.1%}  {name}" for name, n in sorted(d.items(), key=lambda kv: -kv[1])[:top]]

    return "\n".join([f"  profile of {path.stem}: {total} samples ({path})", "  by thread:", *rows(threads),
                      "  innermost frames:", *rows(leaf), "  rtpcore functions (inclusive):", *rows(inclusive)])


def bench(server: Server, args: argparse.Namespace) -> Result:
    """Start ``server``, one warm-up round, ``args.rounds`` timed rounds; always stops it."""
    check_missing(server)
    walls, samples = [], []
    with serving(server, args, "a round"):
        asyncio.run(one_round(server, args.clients, args.tokens, args.round_timeout))  # warm-up
        with profiled(server, args):
            for _ in range(args.rounds):
                wall, got = asyncio.run(one_round(server, args.clients, args.tokens, args.round_timeout))
                walls.append(wall)
                samples.extend(got)
                print(f"  {server.name}: round of {args.clients} x {args.tokens} tokens in {wall:.2f} s", flush=True)
    tbts = [x for x in (s.tbt for s in samples) if x is not None]
    return Result(
        tok_s=sum(s.tokens for s in samples) / sum(walls),
        ttft_p50=percentile([s.ttft for s in samples], 0.5),
        ttft_p99=percentile([s.ttft for s in samples], 0.99),
        tbt_p50=percentile(tbts, 0.5) if tbts else float("nan"),
        exact=all(s.tokens == args.tokens for s in samples),
    )


def table(results: dict[str, Result | str]) -> str:
    rows = ["| engine | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | TBT p50 (ms) | exact tokens |",
            "|---|---:|---:|---:|---:|---|"]
    for name, r in results.items():
        if isinstance(r, str):
            rows.append(f"| {name} | failed: {r} | | | | |")
        else:
            rows.append(f"| {name} | {r.tok_s:.1f} | {r.ttft_p50 * 1e3:.0f} | {r.ttft_p99 * 1e3:.0f} "
                        f"| {r.tbt_p50 * 1e3:.1f} | {'yes' if r.exact else 'no'} |")
    rt, hf = results.get("rtpcore"), results.get("transformers")
    if isinstance(rt, Result) and isinstance(hf, Result):
        rows.append(f"| rtpcore / transformers | {rt.tok_s / hf.tok_s:.2f}x | {rt.ttft_p50 / hf.ttft_p50:.2f}x "
                    f"| {rt.ttft_p99 / hf.ttft_p99:.2f}x | {rt.tbt_p50 / hf.tbt_p50:.2f}x | |")
    return "\n".join(rows)


# ---------------------------------------------------------------- load scenario


@dataclass
class LoadPlan:
    """The seeded requests of the load scenario: prompt texts and their token counts (as the
    servers count them), ``max_tokens``, arrival offsets (s), and the rtpcore KV pool."""
    contents: list[str]
    prompt_tokens: list[int]
    max_tokens: list[int]
    arrivals: list[float]
    bytes_per_block: int
    tokens_per_block: int
    worst_case_bytes: int
    kv_cache_memory: int
    kv_note: str


def parse_range(text: str) -> tuple[int, int]:
    """``"64:768"`` (or ``64-768``) -> (64, 768)."""
    lo, sep, hi = text.replace("-", ":").partition(":")
    try:
        a, b = int(lo), int(hi if sep else lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX, got {text!r}") from None
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return a, b


def chat_prompt_counter(ckpt: Path, role: str = "user", generation_prompt: bool = True) -> Callable[[str], int]:
    """``count(content) -> int``: tokens of the one-message conversation (a ``role`` message,
    then the assistant's header when ``generation_prompt``) rendered with the checkpoint's chat
    template and encoded without added special tokens (as both servers do)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt))

    def count(content: str) -> int:
        text = tok.apply_chat_template([{"role": role, "content": content}], tokenize=False,
                                       add_generation_prompt=generation_prompt)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    return count


class PromptBuilder:
    """Message texts of an exact rendered token count: seeded words of the training corpus
    (each a pre-token of its own, so counts add up), topped up with one-token words, then
    checked with the full tokenizer."""

    def __init__(self, ckpt: Path):
        from tokenizers import Tokenizer

        words = sorted({w.strip(".,!?;") for line in corpus() for w in line.split()} - {""})
        tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
        spaced = tok.encode_batch([" " + w for w in words], add_special_tokens=False)
        bare = tok.encode_batch(words, add_special_tokens=False)
        self.words = words
        self.spaced = {w: len(e.ids) for w, e in zip(words, spaced, strict=True)}
        self.bare = {w: len(e.ids) for w, e in zip(words, bare, strict=True)}
        self.ones = [w for w in words if self.spaced[w] == 1 and self.bare[w] == 1]

    def build(self, n: int, rng: random.Random, count: Callable[[str], int]) -> str:
        """A message whose conversation, as ``count`` renders it, is exactly ``n`` tokens."""
        want = n - count("")
        if want <= 0:
            raise SystemExit(f"a {n}-token message is not longer than the chat template's {n - want} tokens")
        parts: list[str] = []
        got = 0
        while got < want:
            w = rng.choice(self.words) if want - got > 8 else rng.choice(self.ones)
            c = self.spaced[w] if parts else self.bare[w]
            if got + c <= want:
                parts.append(w)
                got += c
        content = " ".join(parts)
        if (real := count(content)) != n:
            raise SystemExit(f"prompt built for {n} tokens renders to {real}; the tokenizer does not add up")
        return content


def build_prompts(ckpt: Path, lengths: list[int], seed: int) -> list[str]:
    """One user message per length whose rendered conversation is exactly that many tokens
    (``PromptBuilder``), from one seeded stream."""
    count = chat_prompt_counter(ckpt)
    overhead = count("")
    if min(lengths) <= overhead:
        raise SystemExit(f"prompts need more than the chat template's {overhead} tokens; raise --prompt-tokens")
    builder = PromptBuilder(ckpt)
    rng = random.Random(seed)
    return [builder.build(n, rng, count) for n in lengths]


def kv_block_spec(ckpt: Path, dtype: str = "float32") -> tuple[int, int, str]:
    """(bytes per block over all layers, tokens per block, source) from ``rtpcore kv-spec
    --json``; else the float32 Llama formula 2 * layers * kv_heads * head_dim * 4 bytes per
    token, 16 tokens per block."""
    try:
        out = subprocess.run([sys.executable, "-m", "rtpcore", "kv-spec", str(ckpt), "--json", "--dtype", dtype],
                             capture_output=True, text=True, timeout=120, check=True).stdout
        spec = json.loads(out)
        return int(spec["bytes_per_block"]), int(spec["tokens_per_block"]), "rtpcore kv-spec --json"
    except (subprocess.SubprocessError, OSError, ValueError, KeyError) as exc:
        cfg = json.loads((ckpt / "config.json").read_text())
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * (2 if dtype == "bfloat16" else 4)
        return per_token * 16, 16, f"Llama float32 formula (rtpcore kv-spec failed: {type(exc).__name__})"


def load_plan(ckpt: Path, args: argparse.Namespace) -> LoadPlan:
    n = args.clients
    lo, hi = args.prompt_tokens
    rng = random.Random(args.seed)
    # Stratified: one length per equal slice of [lo, hi], in seeded order.
    lengths = [min(hi, lo + int((hi - lo + 1) * (k + rng.random()) / n)) for k in range(n)]
    rng.shuffle(lengths)
    out_lo, out_hi = args.output_tokens
    max_tokens = [random.Random(f"{args.seed}-out-{i}").randint(out_lo, out_hi) for i in range(n)]
    arrival_rng = random.Random(f"{args.seed}-arrivals")
    arrivals = [0.0]
    for _ in range(n - 1):
        arrivals.append(arrivals[-1] + arrival_rng.expovariate(args.arrival_rate))
    contents = build_prompts(ckpt, lengths, args.seed)
    block, tpb, source = kv_block_spec(ckpt, args.dtype)
    blocks = [-(-(p + m) // tpb) for p, m in zip(lengths, max_tokens, strict=True)]
    worst = sum(blocks) * block
    memory = int(worst * args.kv_fraction)
    note = f"block {block} bytes / {tpb} tokens from {source}"
    if memory < max(blocks) * block:  # every request must fit an empty cache
        memory = max(blocks) * block
        note += f"; raised to the largest request ({max(blocks)} blocks)"
    return LoadPlan(contents, lengths, max_tokens, arrivals, block, tpb, worst, memory, note)


@dataclass
class LoadResult:
    tok_s: float
    ttft_p50: float
    ttft_p99: float
    tbt_p50: float
    tbt_p99: float
    completed: int
    total: int
    exact: bool  # every completed request produced exactly its max_tokens
    wall: float
    chunks_per_token: float
    prompts_as_planned: bool
    first_error: str


async def load_run(server: Server, plan: LoadPlan, timeout: float) -> tuple[float, float, list[Sample | BaseException]]:
    """The requests of ``plan`` sent at their arrival offsets; (t0, last completion, samples or errors)."""
    import httpx
    from openai import AsyncOpenAI

    n = len(plan.contents)
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=n + 4), trust_env=False)
    async with AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                           timeout=timeout, http_client=http) as client:
        t0 = time.perf_counter() + 0.05
        ends: list[float] = []

        async def arrive(i: int) -> Sample:
            at = t0 + plan.arrivals[i]
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            sample = await one_request(client, server, i, plan.max_tokens[i], plan.contents[i], start=at)
            ends.append(time.perf_counter())
            return sample

        got = await asyncio.wait_for(asyncio.gather(*(arrive(i) for i in range(n)), return_exceptions=True),
                                     timeout + plan.arrivals[-1])
        return t0, max(ends, default=time.perf_counter()), list(got)


def bench_load(server: Server, plan: LoadPlan, args: argparse.Namespace) -> LoadResult:
    """Start ``server``, a warm-up of a few short requests, one timed load run; always stops it."""
    check_missing(server)
    n = len(plan.contents)
    shortest = min(range(n), key=lambda i: plan.prompt_tokens[i])
    warm = LoadPlan([plan.contents[shortest]] * min(4, n), [plan.prompt_tokens[shortest]] * min(4, n),
                    [8] * min(4, n), [0.0] * min(4, n), 0, 0, 0, 0, "")
    with serving(server, args, "the load run"):
        _, _, got = asyncio.run(load_run(server, warm, args.round_timeout))
        if errors := [g for g in got if isinstance(g, BaseException)]:
            raise errors[0]
        with profiled(server, args):
            t0, end, got = asyncio.run(load_run(server, plan, args.round_timeout))
        engine_note = engine_counters(server)
    done = [(i, g) for i, g in enumerate(got) if isinstance(g, Sample)]
    errors = [g for g in got if not isinstance(g, Sample)]
    first_error = f"{type(errors[0]).__name__}: {errors[0]}".splitlines()[0][:200] if errors else ""
    if not done:
        raise ServerFailed(f"{server.name}: no request completed ({len(errors)} failed; first: {first_error})"
                           f"\n{server.log_tail()}")
    wall = end - t0
    samples = [g for _, g in done]
    gaps = [b - a for s in samples for a, b in zip(s.text_times, s.text_times[1:], strict=False)]
    ttfts = [s.ttft for s in samples]
    print(f"  {server.name}: {len(samples)}/{n} requests completed in {wall:.2f} s (last arrival at "
          f"{plan.arrivals[-1]:.2f} s: arrivals span {plan.arrivals[-1] / wall:.0%} of the run)", flush=True)
    if engine_note:
        planned = sum(plan.prompt_tokens) + sum(plan.max_tokens)
        print(f"  {server.name}: {engine_note} (the timed run plans {planned} tokens: prompts + max_tokens)", flush=True)
    return LoadResult(
        tok_s=sum(s.tokens for s in samples) / wall,
        ttft_p50=percentile(ttfts, 0.5),
        ttft_p99=percentile(ttfts, 0.99),
        tbt_p50=percentile(gaps, 0.5) if gaps else float("nan"),
        tbt_p99=percentile(gaps, 0.99) if gaps else float("nan"),
        completed=len(samples),
        total=n,
        exact=all(s.tokens == plan.max_tokens[i] for i, s in done),
        wall=wall,
        chunks_per_token=sum(len(s.text_times) for s in samples) / max(1, sum(s.tokens for s in samples)),
        prompts_as_planned=all(s.prompt_tokens == plan.prompt_tokens[i] for i, s in done),
        first_error=first_error,
    )


def engine_counters(server: Server) -> str:
    """What an rtpcore server's ``/metrics`` say about the work it did since it started (the
    warm-up included): engine steps, tokens scheduled (prompt chunks, decodes, recomputation
    after preemption), preemptions. Empty for another server or when the page cannot be read."""
    if not server.name.startswith("rtpcore"):
        return ""
    import httpx

    try:
        text = httpx.get(server.url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return ""
    values: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("rtpcore_iteration_tokens_count", "rtpcore_iteration_tokens_sum", "rtpcore_preemptions_total"):
            values[name] = float(value)
    if len(values) < 3:
        return ""
    return (f"{values['rtpcore_iteration_tokens_count']:.0f} engine steps, "
            f"{values['rtpcore_iteration_tokens_sum']:.0f} tokens scheduled, "
            f"{values['rtpcore_preemptions_total']:.0f} preemptions")


def target_line(what: str, value: float | None, ok: bool) -> str:
    """``  what: 1.23x — met`` (or ``not met``; ``n/a`` without a value)."""
    if value is None:
        return f"  {what}: n/a"
    return f"  {what}: {value:.2f}x — {'met' if ok else 'not met'}"


def load_table(results: dict[str, LoadResult | str]) -> str:
    rows = ["| engine | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | TBT p50 (ms) | TBT p99 (ms) | completed "
            "| exact tokens |",
            "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, r in results.items():
        if isinstance(r, str):
            rows.append(f"| {name} | failed: {r} | | | | | | |")
        else:
            rows.append(f"| {name} | {r.tok_s:.1f} | {r.ttft_p50 * 1e3:.0f} | {r.ttft_p99 * 1e3:.0f} "
                        f"| {r.tbt_p50 * 1e3:.1f} | {r.tbt_p99 * 1e3:.1f} | {r.completed}/{r.total} "
                        f"| {'yes' if r.exact else 'no'} |")
    rt, hf = results.get("rtpcore"), results.get("transformers")
    if isinstance(rt, LoadResult) and isinstance(hf, LoadResult):
        rows.append(f"| rtpcore / transformers | {rt.tok_s / hf.tok_s:.2f}x | {rt.ttft_p50 / hf.ttft_p50:.2f}x "
                    f"| {rt.ttft_p99 / hf.ttft_p99:.2f}x | {rt.tbt_p50 / hf.tbt_p50:.2f}x "
                    f"| {rt.tbt_p99 / hf.tbt_p99:.2f}x | | |")
    lines = ["\n".join(rows), "", "Targets:"]
    tok = ttft = own = None
    if isinstance(rt, LoadResult):
        own = rt.tbt_p99 / rt.tbt_p50
        if isinstance(hf, LoadResult):
            tok, ttft = rt.tok_s / hf.tok_s, rt.ttft_p50 / hf.ttft_p50
    lines.append(target_line("output tokens/s >= 3x transformers", tok, tok is not None and tok >= 3))
    lines.append(target_line("p50 TTFT <= 0.5x transformers'", ttft, ttft is not None and ttft <= 0.5))
    lines.append(target_line("rtpcore p99 TBT <= 3x its own p50 TBT (p99 / p50)", own, own is not None and own <= 3))
    for name, r in results.items():
        if isinstance(r, LoadResult):
            note = (f"  {name}: {r.wall:.2f} s, {r.chunks_per_token:.2f} text chunks per token, prompt tokens as "
                    f"planned: {'yes' if r.prompts_as_planned else 'no'}")
            if r.completed < r.total:
                note += f"; {r.total - r.completed} failed, first: {r.first_error}"
            lines.append(note)
    return "\n".join(lines)


def run_load(ckpt: Path, tmp: Path, args: argparse.Namespace) -> dict[str, LoadResult | str]:
    plan = load_plan(ckpt, args)
    n = len(plan.contents)
    # The longest request bounds --max-model-len, as an operator serving this load would set it:
    # rtpcore refuses a pool that cannot hold one max_model_len sequence (docs/design.md §13).
    longest = max(p + m for p, m in zip(plan.prompt_tokens, plan.max_tokens, strict=True))
    extra = ["--kv-cache-memory", str(plan.kv_cache_memory), "--max-model-len", str(longest)]
    if args.max_num_batched_tokens is not None:
        extra += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    server = rtpcore_server(ckpt, tmp, args.max_batch_size, extra, dtype=args.dtype)
    mib = 1 << 20
    print(f"load: {n} streaming chat completions, prompts {min(plan.prompt_tokens)}-{max(plan.prompt_tokens)} "
          f"tokens (range {args.prompt_tokens[0]}:{args.prompt_tokens[1]}, {sum(plan.prompt_tokens)} in all), "
          f"max_tokens {min(plan.max_tokens)}-{max(plan.max_tokens)} (range {args.output_tokens[0]}:"
          f"{args.output_tokens[1]}, {sum(plan.max_tokens)} in all), Poisson arrivals at {args.arrival_rate:g}/s "
          f"(last at {plan.arrivals[-1]:.1f} s), seed {args.seed}", flush=True)
    print(f"load: KV worst case {plan.worst_case_bytes} bytes ({plan.worst_case_bytes / mib:.1f} MiB: sum of "
          f"prompt + max_tokens in whole blocks; {plan.kv_note}); rtpcore --kv-cache-memory {plan.kv_cache_memory} "
          f"({plan.kv_cache_memory / mib:.1f} MiB, {plan.kv_cache_memory / plan.worst_case_bytes:.2f} of it, "
          f"{plan.kv_cache_memory // plan.bytes_per_block} blocks)", flush=True)
    print(f"load: rtpcore serve {' '.join(server.argv[server.argv.index('--dtype'):])}"
          f"{'' if args.max_batch_size is not None else ' (rtpcore default --max-batch-size)'}", flush=True)
    servers = [server] if args.skip_transformers else [server, transformers_server(ckpt, tmp, args.dtype)]
    results: dict[str, LoadResult | str] = {}
    for s in servers:
        try:
            results[s.name] = bench_load(s, plan, args)
        except ServerFailed as exc:
            print(f"{s.name} FAILED: {exc}", file=sys.stderr, flush=True)
            results[s.name] = exc.summary()
    return results


# ---------------------------------------------------------------- llama-server on the same GGUF file

LLAMACPP_SLOT_TOKENS = 4096  # llama-server's context per slot (-c = slots x this): 512 words of benchmarks/_smollm2.py's 8000-piece vocabulary reach ~2000 tokens, + --tokens


def llama_server(llamacpp: Path, gguf: Path, tmp: Path, slots: int, name: str) -> Server:
    """llama.cpp's ``llama-server`` on ``gguf``: 2 threads (this machine's cores), ``slots``
    parallel sequences with continuous batching."""
    exe = llamacpp / "bin" / "llama-server"
    port = free_port()
    argv = [str(exe), "-m", str(gguf), "-t", "2", "-tb", "2", "--parallel", str(slots),
            "-c", str(slots * LLAMACPP_SLOT_TOKENS), "--cont-batching", "--host", HOST, "--port", str(port),
            "--alias", "bench"]
    return Server(name, argv, port, tmp / f"{name}.log", model="bench")


def word_prompts(count: int, words: tuple[int, int], seed: int) -> list[str]:
    """``count`` seeded prompts of pseudo-words, lengths spread uniformly over ``words``."""
    rng = random.Random(seed)
    text = " ".join(corpus(seed=seed + 1, lines=4000)).split()
    prompts = []
    for _ in range(count):
        n = rng.randint(*words)
        at = rng.randrange(0, len(text) - n)
        prompts.append(" ".join(text[at:at + n]))
    return prompts


async def completion_request(client: Any, server: Server, prompt: str, tokens: int) -> Sample:
    """One streaming completion of ``prompt``: times of the chunks that carry tokens (text, or
    none yet but not the final chunk); a server that reports no usage has its tokens counted as
    such chunks."""
    sample = Sample(start=time.perf_counter())
    stream = await client.completions.create(
        model=server.model, prompt=prompt, stream=True, max_tokens=tokens, temperature=0.0,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        now = time.perf_counter()
        # a token's chunk: llama-server streams one per token, with "" for a token whose text is
        # not complete yet (a partial UTF-8 sequence, a control token)
        if chunk.choices and (chunk.choices[0].text or chunk.choices[0].finish_reason is None):
            sample.text_times.append(now)
            sample.text += chunk.choices[0].text or ""
        if chunk.usage is not None:
            sample.tokens = chunk.usage.completion_tokens
            sample.prompt_tokens = chunk.usage.prompt_tokens
    if not sample.text_times:
        raise ServerFailed(f"{server.name}: a completion streamed no tokens")
    if not sample.tokens:
        sample.tokens = len(sample.text_times)
    return sample


async def completion_round(server: Server, prompts: list[str], tokens: int, timeout: float) -> tuple[float, list[Sample]]:
    import httpx
    from openai import AsyncOpenAI

    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=len(prompts) + 4), trust_env=False)
    async with AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                           timeout=timeout, http_client=http) as client:
        t = time.perf_counter()
        samples = await asyncio.wait_for(
            asyncio.gather(*(completion_request(client, server, p, tokens) for p in prompts)), timeout)
        return time.perf_counter() - t, list(samples)


def bench_completions(server: Server, rounds: list[list[str]], args: argparse.Namespace) -> tuple[Result, list[int]]:
    """Start ``server``; the first round of prompts warms it up, the others are timed; always
    stops it. Returns the result and the prompt tokens it counted per timed request."""
    walls, samples = [], []
    with serving(server, args, "a round"):
        asyncio.run(completion_round(server, rounds[0], args.tokens, args.round_timeout))
        with profiled(server, args):
            for prompts in rounds[1:]:
                wall, got = asyncio.run(completion_round(server, prompts, args.tokens, args.round_timeout))
                walls.append(wall)
                samples.extend(got)
                print(f"  {server.name}: round of {len(prompts)} x {args.tokens} tokens in {wall:.2f} s",
                      flush=True)
    tbts = [x for x in (s.tbt for s in samples) if x is not None]
    result = Result(
        tok_s=sum(s.tokens for s in samples) / sum(walls),
        ttft_p50=percentile([s.ttft for s in samples], 0.5),
        ttft_p99=percentile([s.ttft for s in samples], 0.99),
        tbt_p50=percentile(tbts, 0.5) if tbts else float("nan"),
        exact=all(s.tokens == args.tokens for s in samples),
    )
    return result, [s.prompt_tokens for s in samples]


def llamacpp_table(results: dict[str, Result | str], counted: dict[str, list[int]], types: list[str]) -> str:
    rows = ["| engine | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | TBT p50 (ms) | exact tokens |",
            "|---|---:|---:|---:|---:|---|"]
    targets = ["Targets (per type):"]
    for t in types:
        rt, lc = results.get(f"rtpcore[{t}]"), results.get(f"llama-server[{t}]")
        rows += table({k: v for k, v in results.items() if k.endswith(f"[{t}]")}).splitlines()[2:]
        if isinstance(rt, Result) and isinstance(lc, Result):
            tok, ttft, tbt = rt.tok_s / lc.tok_s, rt.ttft_p50 / lc.ttft_p50, rt.tbt_p50 / lc.tbt_p50
            rows.append(f"| rtpcore / llama-server [{t}] | {tok:.2f}x | {ttft:.2f}x | {rt.ttft_p99 / lc.ttft_p99:.2f}x "
                        f"| {tbt:.2f}x | |")
            same = counted.get(f"rtpcore[{t}]") == counted.get(f"llama-server[{t}]")
            targets += [target_line(f"{t}: output tokens/s >= 1.2x llama-server", tok, tok >= 1.2),
                        target_line(f"{t}: p50 TTFT <= 1.0x llama-server's", ttft, ttft <= 1.0),
                        target_line(f"{t}: p50 time between tokens <= 1.0x llama-server's", tbt, tbt <= 1.0),
                        f"  {t}: both servers counted the same prompt tokens: {'yes' if same else 'no'}"]
    return "\n".join([*rows, "", *targets])


def run_llamacpp(tmp: Path, args: argparse.Namespace) -> tuple[str, bool]:
    files = {t: args.llamacpp / f"{args.gguf_model}-{t}.gguf" for t in args.gguf_types}
    missing = [str(f) for f in files.values() if not f.is_file()]
    if not (args.llamacpp / "bin" / "llama-server").is_file():
        missing.insert(0, str(args.llamacpp / "bin" / "llama-server"))
    if missing:
        raise SystemExit(f"--llamacpp {args.llamacpp}: missing {', '.join(missing)} "
                         "(../shared/tools/setup_llamacpp.sh DIR CKPT builds them)")
    rounds = [word_prompts(args.clients, args.prompt_words, args.seed + r) for r in range(args.rounds + 1)]
    extra = []
    if args.max_batch_size is not None:
        extra += ["--max-batch-size", str(args.max_batch_size)]
    if args.max_num_batched_tokens is not None:
        extra += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    print(f"llamacpp: {args.clients} concurrent streaming completions x {args.tokens} tokens, prompts of "
          f"{args.prompt_words[0]}-{args.prompt_words[1]} words, 1 warm-up + {args.rounds} timed rounds; "
          f"llama-server -t 2 -tb 2 --parallel {args.clients} -c {args.clients * LLAMACPP_SLOT_TOKENS} --cont-batching; "
          f"rtpcore serve --dtype float32 {' '.join([*extra, *RTPCORE_ARGS]) or '(its defaults)'}", flush=True)
    results: dict[str, Result | str] = {}
    counted: dict[str, list[int]] = {}
    for t, gguf in files.items():
        servers = [rtpcore_server(gguf, tmp, None, extra, dtype="float32", name=f"rtpcore[{t}]")]
        if not args.skip_transformers:
            servers.append(llama_server(args.llamacpp, gguf, tmp, args.clients, f"llama-server[{t}]"))
        for server in servers:
            try:
                results[server.name], counted[server.name] = bench_completions(server, rounds, args)
            except ServerFailed as exc:
                print(f"{server.name} FAILED: {exc}", file=sys.stderr, flush=True)
                results[server.name] = exc.summary()
    head = (f"llama.cpp peer: {args.clients} streams x {args.tokens} tokens, {args.gguf_model} GGUF "
            f"({', '.join(args.gguf_types)})")
    return f"{head}\n\n{llamacpp_table(results, counted, args.gguf_types)}", all(
        isinstance(r, Result) for r in results.values())


# ---------------------------------------------------------------- multi-turn scenario

USER_TOKENS = (16, 48)  # multiturn: each user message's tokens, rendered as a one-message conversation


@dataclass
class MultiturnPlan:
    """The seeded conversations of the multi-turn scenario: the shared system prompt, each
    conversation's user messages (one per turn) and their token counts, and rtpcore's KV pool."""
    system: str
    system_tokens: int
    users: list[list[str]]
    user_tokens: list[list[int]]
    turn_tokens: int
    max_model_len: int
    longest: int  # the longest final turn's prompt + turn_tokens, if each reply re-encodes to turn_tokens
    kv_cache_memory: int
    kv_note: str

    @property
    def turns(self) -> int:
        return len(self.users[0])


def multiturn_plan(ckpt: Path, args: argparse.Namespace) -> MultiturnPlan:
    """Seeded system prompt and user messages (a seed of its own per conversation); a KV pool
    of ``args.clients`` sequences of the checkpoint's context."""
    builder = PromptBuilder(ckpt)
    system_count = chat_prompt_counter(ckpt, role="system", generation_prompt=False)
    system = builder.build(args.system_tokens, random.Random(f"{args.seed}-system"), system_count)
    user_count = chat_prompt_counter(ckpt)
    users, lengths = [], []
    for c in range(args.clients):
        rng = random.Random(f"{args.seed}-conversation-{c}")
        ns = [rng.randint(*USER_TOKENS) for _ in range(args.turns)]
        users.append([builder.build(n, rng, user_count) for n in ns])
        lengths.append(ns)
    # A user message counts the assistant's header after it; a reply in the history adds its
    # tokens and the end of its message (<|im_end|> and a newline: 2 tokens).
    longest = max(args.system_tokens + sum(ns) + (args.turns - 1) * (args.turn_tokens + 2)
                  + args.turn_tokens for ns in lengths)
    max_model_len = int(json.loads((ckpt / "config.json").read_text())["max_position_embeddings"])
    if longest > max_model_len:
        raise SystemExit(f"the longest conversation needs about {longest} tokens, more than the checkpoint's "
                         f"{max_model_len}; lower --system-tokens, --turns or --turn-tokens")
    block, tpb, source = kv_block_spec(ckpt, args.dtype)
    memory = args.clients * -(-max_model_len // tpb) * block
    note = (f"{args.clients} sequences x {max_model_len} tokens (the checkpoint's context), block {block} bytes / "
            f"{tpb} tokens from {source}")
    return MultiturnPlan(system, args.system_tokens, users, lengths, args.turn_tokens, max_model_len, longest,
                         memory, note)


@dataclass
class MultiturnResult:
    tok_s: float
    ttft_first: float  # p50 over turn 1
    ttft_later: float  # p50 over turns 2..N
    cached_first: float  # mean fraction of prompt tokens reported cached, turn 1
    cached_later: float  # the same over turns 2..N
    completed: int
    total: int
    exact: bool  # every completed turn produced exactly turn_tokens tokens
    wall: float
    prompt_range: tuple[int, int]
    first_error: str


async def conversation(client: Any, server: Server, plan: MultiturnPlan, c: int) -> tuple[list[Sample], str]:
    """Conversation ``c`` turn by turn, each turn's reply (its text) in the next one's history;
    (the samples of its completed turns, the error that ended it early or "")."""
    messages = [{"role": "system", "content": plan.system}]
    samples: list[Sample] = []
    for t, user in enumerate(plan.users[c]):
        messages.append({"role": "user", "content": user})
        try:
            sample = await one_request(client, server, c * plan.turns + t, plan.turn_tokens, messages=list(messages))
        except Exception as exc:
            return samples, f"conversation {c} turn {t + 1}: {type(exc).__name__}: {exc}".splitlines()[0][:200]
        samples.append(sample)
        messages.append({"role": "assistant", "content": sample.text})
    return samples, ""


async def multiturn_run(server: Server, plan: MultiturnPlan, timeout: float) -> tuple[float, float, list[tuple[list[Sample], str]]]:
    """All conversations at once; (t0, last completion, per conversation: samples, error)."""
    import httpx
    from openai import AsyncOpenAI

    n = len(plan.users)
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=n + 4), trust_env=False)
    async with AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                           timeout=timeout, http_client=http) as client:
        t0 = time.perf_counter()
        got = await asyncio.wait_for(asyncio.gather(*(conversation(client, server, plan, c) for c in range(n))),
                                     timeout * plan.turns)
        ends = [s.text_times[-1] for samples, _ in got for s in samples]
        return t0, max(ends, default=time.perf_counter()), list(got)


async def warm_up(server: Server, requests: int, timeout: float) -> None:
    """A few concurrent short requests whose prompts share nothing with the conversations."""
    import httpx
    from openai import AsyncOpenAI

    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=requests + 4), trust_env=False)
    async with AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                           timeout=timeout, http_client=http) as client:
        await asyncio.wait_for(asyncio.gather(*(one_request(client, server, i, 8) for i in range(requests))), timeout)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def bench_multiturn(server: Server, plan: MultiturnPlan, args: argparse.Namespace) -> MultiturnResult:
    """Start ``server``, a warm-up of a few short requests, one timed run of all conversations;
    always stops it."""
    check_missing(server)
    with serving(server, args, "the multi-turn run"):
        asyncio.run(warm_up(server, min(4, len(plan.users)), args.round_timeout))
        t0, end, got = asyncio.run(multiturn_run(server, plan, args.round_timeout))
    errors = [e for _, e in got if e]
    samples = [s for conv, _ in got for s in conv]
    if not samples:
        raise ServerFailed(f"{server.name}: no turn completed ({len(errors)} conversations failed; first: "
                           f"{errors[0] if errors else '?'})\n{server.log_tail()}")
    first = [conv[0] for conv, _ in got if conv]
    later = [s for conv, _ in got for s in conv[1:]]
    wall = end - t0

    def cached(xs: list[Sample]) -> float:
        return mean([s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0 for s in xs])

    total = len(plan.users) * plan.turns
    print(f"  {server.name}: {len(samples)}/{total} turns completed in {wall:.2f} s", flush=True)
    return MultiturnResult(
        tok_s=sum(s.tokens for s in samples) / wall,
        ttft_first=percentile([s.ttft for s in first], 0.5),
        ttft_later=percentile([s.ttft for s in later], 0.5) if later else float("nan"),
        cached_first=cached(first),
        cached_later=cached(later),
        completed=len(samples),
        total=total,
        exact=all(s.tokens == plan.turn_tokens for s in samples),
        wall=wall,
        prompt_range=(min(s.prompt_tokens for s in samples), max(s.prompt_tokens for s in samples)),
        first_error=errors[0] if errors else "",
    )


def multiturn_table(results: dict[str, MultiturnResult | str], turns: int) -> str:
    later = f"turns 2-{turns}" if turns > 2 else "turn 2"
    rows = [f"| engine | output tok/s | TTFT p50 turn 1 (ms) | TTFT p50 {later} (ms) | cached {later} | completed "
            "| exact tokens |",
            "|---|---:|---:|---:|---:|---:|---|"]
    for name, r in results.items():
        if isinstance(r, str):
            rows.append(f"| {name} | failed: {r} | | | | | |")
        else:
            rows.append(f"| {name} | {r.tok_s:.1f} | {r.ttft_first * 1e3:.0f} | {r.ttft_later * 1e3:.0f} "
                        f"| {r.cached_later:.1%} | {r.completed}/{r.total} | {'yes' if r.exact else 'no'} |")
    rt = results.get("rtpcore")
    for other in ("rtpcore-nocache", "transformers"):
        base = results.get(other)
        if isinstance(rt, MultiturnResult) and isinstance(base, MultiturnResult):
            rows.append(f"| rtpcore / {other} | {rt.tok_s / base.tok_s:.2f}x | {rt.ttft_first / base.ttft_first:.2f}x "
                        f"| {rt.ttft_later / base.ttft_later:.2f}x | | | |")
    lines = ["\n".join(rows), "", "Targets:"]
    nocache = results.get("rtpcore-nocache")
    ttft = tok = None
    if isinstance(rt, MultiturnResult) and isinstance(nocache, MultiturnResult):
        ttft, tok = rt.ttft_later / nocache.ttft_later, rt.tok_s / nocache.tok_s
    lines.append(target_line(f"TTFT p50 {later} <= 0.3x rtpcore-nocache's", ttft, ttft is not None and ttft <= 0.3))
    lines.append(target_line("output tokens/s >= 1.5x rtpcore-nocache", tok, tok is not None and tok >= 1.5))
    for name, r in results.items():
        if isinstance(r, MultiturnResult):
            note = (f"  {name}: {r.wall:.2f} s, turn prompts {r.prompt_range[0]}-{r.prompt_range[1]} tokens, "
                    f"cached turn 1 {r.cached_first:.1%}")
            if r.completed < r.total:
                note += f"; {r.total - r.completed} turns not completed, first error: {r.first_error}"
            lines.append(note)
    return "\n".join(lines)


def run_multiturn(ckpt: Path, tmp: Path, args: argparse.Namespace) -> dict[str, MultiturnResult | str]:
    plan = multiturn_plan(ckpt, args)
    extra = ["--kv-cache-memory", str(plan.kv_cache_memory)]
    if args.max_num_batched_tokens is not None:
        extra += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    servers = [rtpcore_server(ckpt, tmp, args.max_batch_size, extra, dtype=args.dtype),
               rtpcore_server(ckpt, tmp, args.max_batch_size, [*extra, "--no-enable-prefix-caching"], dtype=args.dtype,
                              name="rtpcore-nocache")]
    if not args.skip_transformers:
        servers.append(transformers_server(ckpt, tmp, args.dtype))
    users = [n for ns in plan.user_tokens for n in ns]
    print(f"multiturn: {len(plan.users)} concurrent conversations x {plan.turns} turns of {plan.turn_tokens} tokens, "
          f"shared system prompt {plan.system_tokens} tokens, user messages {min(users)}-{max(users)} tokens "
          f"(range {USER_TOKENS[0]}:{USER_TOKENS[1]}), longest conversation about {plan.longest} tokens, "
          f"seed {args.seed}", flush=True)
    print(f"multiturn: rtpcore --kv-cache-memory {plan.kv_cache_memory} ({plan.kv_cache_memory / (1 << 20):.1f} MiB: "
          f"{plan.kv_note})", flush=True)
    for s in servers[:2]:
        print(f"multiturn: {s.name}: rtpcore serve {' '.join(s.argv[s.argv.index('--dtype'):])}"
              f"{'' if args.max_batch_size is not None else ' (rtpcore default --max-batch-size)'}", flush=True)
    results: dict[str, MultiturnResult | str] = {}
    for s in servers:
        try:
            results[s.name] = bench_multiturn(s, plan, args)
        except ServerFailed as exc:
            print(f"{s.name} FAILED: {exc}", file=sys.stderr, flush=True)
            results[s.name] = exc.summary()
    return results


# --quick: defaults for a fast check that everything runs (not a measurement)
QUICK: dict[str, Any] = {
    "steady_clients": 4, "load_clients": 6, "tokens": 16, "rounds": 1, "prompt_tokens": (16, 64),
    "output_tokens": (8, 24), "arrival_rate": 6.0,
    "multiturn_clients": 3, "turns": 2, "system_tokens": 200, "turn_tokens": 8,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=("steady", "load", "both", "multiturn", "llamacpp"), default="steady",
                        help="steady: rounds of equal concurrent requests (default); load: Poisson arrivals of "
                        "mixed prompt and completion lengths with a quarter-size rtpcore KV pool; both: steady then "
                        "load; multiturn: concurrent conversations over a shared system prompt, prefix caching on "
                        "against off; llamacpp: rtpcore serve against llama-server on the same GGUF files")
    parser.add_argument("--quick", action="store_true",
                        help="a few clients, short prompts and completions: checks that the script runs")
    parser.add_argument("--clients", type=int, default=None,
                        help="concurrent streams per round (steady, default 16) / requests of the load run "
                        "(default 64) / concurrent conversations (multiturn, default 16)")
    parser.add_argument("--tokens", type=int, default=None, help="steady: completion tokens per request (default 64)")
    parser.add_argument("--rounds", type=int, default=None, help="steady: timed rounds after one warm-up round (default 3)")
    parser.add_argument("--max-batch-size", type=int, default=None,
                        help="rtpcore serve --max-batch-size (steady: default 16; load, multiturn: passed only "
                        "when given)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="rtpcore serve --max-num-batched-tokens, passed only when given")
    parser.add_argument("--prompt-tokens", type=parse_range, default=None, metavar="MIN:MAX",
                        help="load: prompt lengths in tokens, chat template included (default 64:768)")
    parser.add_argument("--output-tokens", type=parse_range, default=None, metavar="MIN:MAX",
                        help="load: range of each request's max_tokens (default 256:512)")
    parser.add_argument("--arrival-rate", type=float, default=None,
                        help="load: Poisson arrivals, requests/s (default 4: 64 requests arrive in about 16 s, "
                        "a third of a 48 s run, i.e. of 24,500 output tokens at 500 tok/s)")
    parser.add_argument("--kv-fraction", type=float, default=0.25,
                        help="load: rtpcore's --kv-cache-memory as a fraction of the worst case (default 0.25)")
    parser.add_argument("--turns", type=int, default=None, help="multiturn: turns per conversation (default 4)")
    parser.add_argument("--turn-tokens", type=int, default=None,
                        help="multiturn: completion tokens per turn (default 64)")
    parser.add_argument("--system-tokens", type=int, default=None,
                        help="multiturn: the shared system prompt's tokens, ChatML-rendered (default 1500)")
    parser.add_argument("--seed", type=int, default=0,
                        help="load: seed of lengths, max_tokens and arrivals; multiturn: of the messages")
    parser.add_argument("--llamacpp", type=Path, default=None, metavar="DIR",
                        help="llamacpp: what ../shared/tools/setup_llamacpp.sh DIR CKPT built")
    parser.add_argument("--gguf-model", default="smollm2-135m",
                        help="llamacpp: the GGUF files DIR/<model>-<type>.gguf (default smollm2-135m)")
    parser.add_argument("--gguf-types", type=lambda v: v.split(","), default=["f32", "q8_0"],
                        help="llamacpp: comma-separated GGUF types (default f32,q8_0)")
    parser.add_argument("--prompt-words", type=parse_range, default=None, metavar="MIN:MAX",
                        help="llamacpp: prompt lengths in words (default 64:512)")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="steady, load, llamacpp: py-spy samples each rtpcore server through its timed rounds "
                        "(DIR/<name>.txt, a summary printed); needs py-spy")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="both servers' --dtype (default float32)")
    parser.add_argument("--skip-transformers", action="store_true",
                        help="benchmark rtpcore serve alone (no transformers; in the llamacpp scenario no llama-server)")
    parser.add_argument("--rtpcore-arg", action="append", default=[], metavar="ARG",
                        help="one more argument to every rtpcore serve (repeatable; --rtpcore-arg=--no-kv-cache-prefault), "
                        "for A/B runs of an option")
    parser.add_argument("--start-timeout", type=float, default=180, help="seconds for a server to answer /health")
    parser.add_argument("--round-timeout", type=float, default=None,
                        help="seconds a round (steady, default 600) or a request of the load or multiturn run "
                        "(default 1800) may take")
    args = parser.parse_args(argv)
    RTPCORE_ARGS[:] = args.rtpcore_arg
    quick = args.quick

    def pick(value: Any, full: Any, fast: Any) -> Any:
        """The option as given, else the --quick or the full default."""
        return value if value is not None else (fast if quick else full)

    steady_clients = pick(args.clients, 16, QUICK["steady_clients"])
    load_clients = pick(args.clients, 64, QUICK["load_clients"])
    given_tokens, given_rounds = args.tokens, args.rounds
    args.tokens = pick(args.tokens, 64, QUICK["tokens"])
    args.rounds = pick(args.rounds, 3, QUICK["rounds"])
    args.prompt_tokens = pick(args.prompt_tokens, (64, 768), QUICK["prompt_tokens"])
    args.output_tokens = pick(args.output_tokens, (256, 512), QUICK["output_tokens"])
    args.arrival_rate = pick(args.arrival_rate, 4.0, QUICK["arrival_rate"])
    multiturn_clients = pick(args.clients, 16, QUICK["multiturn_clients"])
    args.turns = pick(args.turns, 4, QUICK["turns"])
    args.turn_tokens = pick(args.turn_tokens, 64, QUICK["turn_tokens"])
    args.system_tokens = pick(args.system_tokens, 1500, QUICK["system_tokens"])
    if min(steady_clients, load_clients, args.tokens, args.rounds, args.max_batch_size or 1,
           args.max_num_batched_tokens or 1) < 1:
        parser.error("--clients, --tokens, --rounds, --max-batch-size and --max-num-batched-tokens must be >= 1")
    if not args.arrival_rate > 0 or not 0 < args.kv_fraction <= 1:
        parser.error("--arrival-rate must be > 0 and --kv-fraction in (0, 1]")
    if args.scenario == "multiturn" and (args.turns < 2 or min(multiturn_clients, args.turn_tokens, args.system_tokens) < 1):
        parser.error("--turns must be >= 2 (turns 2.. are what the cache serves); --clients, --turn-tokens and "
                     "--system-tokens >= 1")
    scenarios = ["steady", "load"] if args.scenario == "both" else [args.scenario]
    if args.scenario == "llamacpp" and args.llamacpp is None:
        parser.error("--scenario llamacpp needs --llamacpp DIR")

    import torch

    print(_bench_decode().cpu_line())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads in this process; "
          f"servers run one at a time, each with torch's default thread count"
          f"{'; --quick (validation settings, not a measurement)' if quick else ''}")
    if args.scenario == "llamacpp":
        args.clients = pick(args.clients, 32, QUICK["steady_clients"])
        args.tokens = pick(given_tokens, 128, QUICK["tokens"])
        args.rounds = pick(given_rounds, 2, QUICK["rounds"])
        args.prompt_words = pick(args.prompt_words, (64, 512), (16, 48))
        args.round_timeout = args.round_timeout or 1200
        with tempfile.TemporaryDirectory(prefix="bench_serve_") as tmp_name:
            text, ok = run_llamacpp(Path(tmp_name), args)
        print(text)
        return 0 if ok else 1
    with tempfile.TemporaryDirectory(prefix="bench_serve_") as tmp_name:
        tmp = Path(tmp_name)
        ckpt = tmp / "llama-56m"
        params = make_checkpoint(ckpt, args.vocab_size)
        vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
        print(f"Llama {params / 1e6:.0f}M parameters, vocab {vocab}, {args.dtype}", flush=True)
        tables: list[str] = []
        ok = True
        if "steady" in scenarios:
            steady = argparse.Namespace(**vars(args))
            steady.clients = steady_clients
            steady.max_batch_size = args.max_batch_size or 16
            steady.round_timeout = args.round_timeout or 600
            print(f"steady: {steady.clients} concurrent streaming chat completions x {steady.tokens} tokens, "
                  f"1 warm-up + {steady.rounds} timed rounds, rtpcore --max-batch-size {steady.max_batch_size}"
                  f"{f' --max-num-batched-tokens {args.max_num_batched_tokens}' if args.max_num_batched_tokens else ''}",
                  flush=True)
            extra = ([] if args.max_num_batched_tokens is None
                     else ["--max-num-batched-tokens", str(args.max_num_batched_tokens)])
            servers = [rtpcore_server(ckpt, tmp, steady.max_batch_size, extra, dtype=args.dtype)]
            if not args.skip_transformers:
                servers.append(transformers_server(ckpt, tmp, args.dtype))
            results: dict[str, Result | str] = {}
            for server in servers:
                try:
                    results[server.name] = bench(server, steady)
                except ServerFailed as exc:
                    print(f"{server.name} FAILED: {exc}", file=sys.stderr, flush=True)
                    results[server.name] = exc.summary()
            tables.append(f"Steady: {steady.clients} streams x {steady.tokens} tokens\n\n{table(results)}")
            ok = ok and all(isinstance(r, Result) for r in results.values())
        if "load" in scenarios:
            load = argparse.Namespace(**vars(args))
            load.clients = load_clients
            load.round_timeout = args.round_timeout or 1800
            load_results = run_load(ckpt, tmp, load)
            tables.append(f"Load: {load.clients} requests, Poisson {load.arrival_rate:g}/s, prompts "
                          f"{load.prompt_tokens[0]}:{load.prompt_tokens[1]} tokens, max_tokens "
                          f"{load.output_tokens[0]}:{load.output_tokens[1]}\n\n{load_table(load_results)}")
            ok = ok and all(isinstance(r, LoadResult) and r.completed == r.total for r in load_results.values())
        if "multiturn" in scenarios:
            multi = argparse.Namespace(**vars(args))
            multi.clients = multiturn_clients
            multi.round_timeout = args.round_timeout or 1800
            multi_results = run_multiturn(ckpt, tmp, multi)
            tables.append(f"Multi-turn: {multi.clients} conversations x {multi.turns} turns x {multi.turn_tokens} "
                          f"tokens over a shared {multi.system_tokens}-token system prompt\n\n"
                          f"{multiturn_table(multi_results, multi.turns)}")
            ok = ok and all(isinstance(r, MultiturnResult) and r.completed == r.total for r in multi_results.values())
    print("\n\n".join(tables))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

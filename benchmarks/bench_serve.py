"""Serving throughput and latency of ``rtpcore serve`` against ``transformers serve
--continuous-batching`` on the same checkpoint, driven by the real ``openai`` client.

    python benchmarks/bench_serve.py [--clients 16] [--tokens 64] [--rounds 3]
        [--max-batch-size 16] [--skip-transformers]

Builds, in a temporary folder, a seeded ~56M-parameter Llama (the shape of
``bench_decode.py``: hidden 512, 8 layers, 8 heads, 4 KV heads, intermediate 1376) whose
vocabulary is a byte-level BPE ``tokenizer.json`` trained here on seeded text (32000
tokens), with a ChatML template in ``tokenizer_config.json``. The checkpoint has no
``eos_token_id`` (config.json and generation_config.json), so that both servers generate
exactly ``--tokens`` tokens; rtpcore is also sent ``ignore_eos``.

Each server runs in turn as a subprocess on 127.0.0.1 (float32, CPU, offline), and is sent
one warm-up round then ``--rounds`` timed rounds; a round is ``--clients`` concurrent
streaming chat completions of ``--tokens`` tokens each. Per engine it prints output tokens/s
(completion tokens of the timed rounds over their wall time), p50 and p99 time to first
token (first chunk with text) and p50 time between tokens (per request: from its first to
its last text chunk, over its tokens after the first; chunks that carry several tokens
are counted as such), and the ratio rtpcore/transformers. A server that cannot start or
fails is reported and the other row is still printed.
"""

from __future__ import annotations

import argparse
import asyncio
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
    pass


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


def rtpcore_server(ckpt: Path, tmp: Path, max_batch_size: int) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "rtpcore", "serve", str(ckpt), "--host", HOST, "--port", str(port),
            "--dtype", "float32", "--max-batch-size", str(max_batch_size), "--served-model-name", "bench"]
    return Server("rtpcore", argv, port, tmp / "rtpcore.log", model="bench")


def transformers_server(ckpt: Path, tmp: Path) -> Server:
    """``transformers serve`` pinned to the checkpoint (requests must name it as given); its
    log (level warning) names each request with ``CB: True`` when continuous batching serves it."""
    port = free_port()
    exe = Path(sys.executable).with_name("transformers")
    cli = [str(exe)] if exe.is_file() else [sys.executable, "-m", "transformers.cli.transformers"]
    argv = [*cli, "serve", str(ckpt), "--continuous-batching", "--device", "cpu", "--dtype", "float32",
            "--host", HOST, "--port", str(port), "--log-level", "warning"]
    return Server("transformers", argv, port, tmp / "transformers.log", model=str(ckpt))


# ---------------------------------------------------------------- clients


@dataclass
class Sample:
    start: float
    text_times: list[float] = field(default_factory=list)
    tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.text_times[0] - self.start

    @property
    def tbt(self) -> float | None:
        """Mean time between tokens after the first, from first to last text chunk."""
        if self.tokens < 2 or len(self.text_times) < 2:
            return None
        return (self.text_times[-1] - self.text_times[0]) / (self.tokens - 1)


async def one_request(client: Any, server: Server, i: int, tokens: int) -> Sample:
    extra: dict[str, Any] = {"ignore_eos": True} if server.name == "rtpcore" else {}
    sample = Sample(start=time.perf_counter())
    stream = await client.chat.completions.create(
        model=server.model, stream=True, max_tokens=tokens, temperature=0.0,
        stream_options={"include_usage": True}, extra_body=extra or None,
        messages=[{"role": "user", "content": f"Request {i}: tell me a long story about city number {i}."}],
    )
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            sample.text_times.append(now)
        if chunk.usage is not None:
            sample.tokens = chunk.usage.completion_tokens
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


def bench(server: Server, args: argparse.Namespace) -> Result:
    """Start ``server``, one warm-up round, ``args.rounds`` timed rounds; always stops it."""
    if server.name == "transformers" and (missing := transformers_missing()):
        raise ServerFailed(f"transformers serve needs transformers[serving]; missing: {', '.join(missing)}")
    try:
        server.start(args.start_timeout)
        asyncio.run(one_round(server, args.clients, args.tokens, args.round_timeout))  # warm-up
        walls, samples = [], []
        for _ in range(args.rounds):
            wall, got = asyncio.run(one_round(server, args.clients, args.tokens, args.round_timeout))
            walls.append(wall)
            samples.extend(got)
            print(f"  {server.name}: round of {args.clients} x {args.tokens} tokens in {wall:.2f} s", flush=True)
    except TimeoutError as exc:
        raise ServerFailed(f"{server.name}: a round ran past {args.round_timeout:.0f} s:\n{server.log_tail()}") from exc
    except Exception as exc:
        if isinstance(exc, ServerFailed):
            raise
        raise ServerFailed(f"{server.name}: {type(exc).__name__}: {exc}\n{server.log_tail()}") from exc
    finally:
        server.stop()
    if server.name == "transformers" and "CB: True" not in server.log.read_text(errors="replace"):
        print("  warning: transformers' log does not show 'CB: True' (continuous batching)", flush=True)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16, help="concurrent streams per round")
    parser.add_argument("--tokens", type=int, default=64, help="completion tokens per request")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up round")
    parser.add_argument("--max-batch-size", type=int, default=16, help="rtpcore serve --max-batch-size")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--skip-transformers", action="store_true", help="benchmark rtpcore serve alone")
    parser.add_argument("--start-timeout", type=float, default=180, help="seconds for a server to answer /health")
    parser.add_argument("--round-timeout", type=float, default=600, help="seconds a round may take")
    args = parser.parse_args(argv)
    if min(args.clients, args.tokens, args.rounds, args.max_batch_size) < 1:
        parser.error("--clients, --tokens, --rounds and --max-batch-size must be >= 1")

    import torch

    print(_bench_decode().cpu_line())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads in this process; "
          f"servers run one at a time, each with torch's default thread count")
    with tempfile.TemporaryDirectory(prefix="bench_serve_") as tmp_name:
        tmp = Path(tmp_name)
        ckpt = tmp / "llama-56m"
        params = make_checkpoint(ckpt, args.vocab_size)
        vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
        print(f"Llama {params / 1e6:.0f}M parameters, vocab {vocab}, float32; {args.clients} concurrent streaming "
              f"chat completions x {args.tokens} tokens, 1 warm-up + {args.rounds} timed rounds", flush=True)
        servers = [rtpcore_server(ckpt, tmp, args.max_batch_size)]
        if not args.skip_transformers:
            servers.append(transformers_server(ckpt, tmp))
        results: dict[str, Result | str] = {}
        for server in servers:
            try:
                results[server.name] = bench(server, args)
            except ServerFailed as exc:
                print(f"{server.name} FAILED: {exc}", file=sys.stderr, flush=True)
                results[server.name] = str(exc).splitlines()[0]
    print(table(results))
    return 0 if all(isinstance(r, Result) for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

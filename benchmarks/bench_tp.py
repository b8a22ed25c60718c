"""Tensor parallelism on this machine: decode tokens/s with 1 and N ranks, communication included.

    python benchmarks/bench_tp.py [--sizes 1,2] [--batches 1,8] [--new-tokens 64]
        [--prompt-len 32] [--dtype float32] [--quick]

Builds a seeded Llama checkpoint with transformers (hidden 1024, 4 layers, 16 heads,
8 KV heads, MLP 2816, vocab 32000: ~84M parameters, so a decode step reads ~340 MB of
float32 weights) and, for each tensor-parallel size, times one greedy ``generate`` of
``--new-tokens`` tokens per batch size after a warm-up, through
``Engine.from_pretrained(..., tensor_parallel_size=N)``. The N=1 engine is the named
baseline; ratios are against it, measured in the same run.

The ranks share this machine's cores: each rank runs ``cores / N`` torch threads, so
N=2 on a 2-core machine does the same arithmetic on the same cores as N=1 plus the
all-reduces (two per layer per step) and the step broadcast: it shows the cost of the
worker machinery, not a speed-up (that needs more cores or devices than one rank can
use). Rows: N=1 on all cores (the baseline), N=1 on ``cores / N`` threads (the thread
split alone), N ranks. The second table isolates the machinery: one step that does
nothing, and one gloo all-reduce of a decode step's hidden state.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

CONFIG = dict(
    vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
    num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048,
)
QUICK = dict(CONFIG, hidden_size=256, intermediate_size=704, vocab_size=4096)


def make_checkpoint(path: Path, config: dict[str, Any]) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config)).eval()
    model.save_pretrained(path)


def decode_rates(path: Path, runs: list[tuple[int, int]], batches: list[int], args: argparse.Namespace) -> dict:
    """tokens/s per (N, threads per rank) and batch size."""
    from rtpcore import Engine

    rates: dict[tuple[int, int, int], float] = {}
    outputs: dict[tuple[int, int, int], list[list[int]]] = {}
    default_threads = torch.get_num_threads()
    for n, threads in runs:
        torch.set_num_threads(threads)  # this process is rank 0; workers get the same share
        try:
            with Engine.from_pretrained(
                path, dtype=args.dtype, tensor_parallel_size=n, max_batch_size=max(batches)
            ) as engine:
                for b in batches:
                    prompts = [[(7 * i + 3 * j) % 1000 + 1 for j in range(args.prompt_len)] for i in range(b)]
                    engine.generate(prompts, max_new_tokens=4, stop_token_ids=[])  # warm-up
                    start = time.perf_counter()
                    outs = engine.generate(prompts, max_new_tokens=args.new_tokens, stop_token_ids=[])
                    elapsed = time.perf_counter() - start
                    rates[n, threads, b] = sum(map(len, outs)) / elapsed
                    outputs[n, threads, b] = outs
        finally:
            torch.set_num_threads(default_threads)
    return {"rates": rates, "outputs": outputs}


class _Probe:
    """The local object of the overhead probe: a no-op step and an all-reduce."""

    def __init__(self, ctx: Any, hidden: int):
        self.ctx = ctx
        self.x = torch.randn(1, hidden)

    def noop(self, _: Any) -> None:
        return None

    def all_reduce(self, repeats: int) -> float:
        start = time.perf_counter()
        for _ in range(repeats):
            self.ctx.all_reduce(self.x)
        return (time.perf_counter() - start) / repeats


def _probe(ctx: Any, hidden: int) -> _Probe:
    return _Probe(ctx, hidden)


def overheads(sizes: list[int], hidden: int, repeats: int = 200) -> dict[int, tuple[float, float]]:
    from rtpcore.parallel.leader import WorkerGroup

    out = {}
    for n in sizes:
        with WorkerGroup.spawn(_probe, hidden, n) as group:
            group.run("noop")
            start = time.perf_counter()
            for _ in range(repeats):
                group.run("noop")
            step = (time.perf_counter() - start) / repeats
            reduce = group.run("all_reduce", repeats)
        out[n] = (step, reduce)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,2", help="tensor-parallel sizes, starting with 1")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quick", action="store_true", help="a 4x smaller model, 16 tokens")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if sizes[0] != 1:
        parser.error("--sizes must start with 1 (the baseline)")
    batches = [int(b) for b in args.batches.split(",")]
    config = QUICK if args.quick else CONFIG
    if args.quick:
        args.new_tokens = min(args.new_tokens, 16)

    cores = torch.get_num_threads()
    # N=1 on every core is the baseline; N=1 on one rank's share of the cores shows how much
    # of N ranks' result is the thread split alone; N ranks split the cores between them.
    runs = [(1, cores)]
    for n in sizes[1:]:
        runs += [(1, max(1, cores // n)), (n, max(1, cores // n))]
    runs = list(dict.fromkeys(runs))
    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(Path(tmp), config)
        result = decode_rates(Path(tmp), runs, batches, args)
    rates, outputs = result["rates"], result["outputs"]
    params = "hidden {hidden_size}, {num_hidden_layers} layers, vocab {vocab_size}".format(**config)
    print(f"decode, Llama ({params}), {args.dtype}, {args.new_tokens} new tokens, "
          f"prompt {args.prompt_len}, {cores} cores")
    print(f"{'N':>3} {'threads/rank':>13} {'batch':>6} {'tokens/s':>10} {'vs N=1':>8} {'same tokens':>12}")
    for n, threads in runs:
        for b in batches:
            base = rates[1, cores, b]
            same = outputs[n, threads, b] == outputs[1, cores, b]
            rate = rates[n, threads, b]
            print(f"{n:>3} {threads:>13} {b:>6} {rate:>10.1f} {rate / base:>7.2f}x {'yes' if same else 'NO':>12}")

    print("\nper-step machinery (same machine, same run)")
    print(f"{'N':>3} {'empty step':>12} {'all-reduce (1, hidden)':>24}")
    for n, (step, reduce) in overheads(sizes, config["hidden_size"]).items():
        print(f"{n:>3} {step * 1e6:>10.0f}us {reduce * 1e6:>22.0f}us")


if __name__ == "__main__":
    main()

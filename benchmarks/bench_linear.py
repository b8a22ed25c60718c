"""The float32 products of one decode step, rtpcore_native against torch, by activation rows.

A Llama's matrix products as a step runs them: every layer's q/k/v, o, gate/up and down over
weights of its own (so that they stream from memory, as a model's do, instead of staying in the
cache as one repeated matrix would), then the vocabulary head. For each row count, the best of
``--repeats`` passes of ``rtpcore_native._kernels.linear`` (the native decode step's and a float32
multi-token step's products: a per-row kernel at 1 row, register tiles up to the GEMM's row count,
the GEMM from it on) and of ``torch.nn.functional.linear`` on the same weights, in the same run:
ms per step, GFLOP/s, and torch's time over ours (above 1: faster than torch). The CPU and the
kernel set head the output.

    python benchmarks/bench_linear.py [--model 56m|smollm2] [--rows 1,2,4,8,16,24,32,48,64,128] [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from bench_decode import cpu_line

from rtpcore_native import _kernels as kernels

# (hidden, intermediate, kv width, layers, vocab): the bars' 56M Llama and SmolLM2-135M
MODELS = {"56m": (512, 1376, 256, 8, 32000), "smollm2": (576, 1536, 192, 30, 49152)}


def step_shapes(model: str) -> list[tuple[int, int]]:
    """(out, in) of every product of one step, in order."""
    hidden, inter, kv, layers, vocab = MODELS[model]
    layer = [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    return layer * layers + [(vocab, hidden)]


def best(fn: Callable[[], None], repeats: int) -> float:
    fn()
    out = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="56m")
    parser.add_argument("--rows", default="1,2,4,8,16,24,32,48,64,128")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    kernels.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    print(cpu_line(), flush=True)
    print(f"{kernels.num_threads()} threads, torch {torch.__version__}", flush=True)
    gen = torch.Generator().manual_seed(0)
    shapes = step_shapes(args.model)
    weights = [torch.randn(n, k, generator=gen) * 0.05 for n, k in shapes]
    native = [kernels.LinearWeights(w.data_ptr(), "float32", 0, 0, n, k) for w, (n, k) in zip(weights, shapes, strict=True)]
    flops = sum(2 * n * k for n, k in shapes)
    print(f"{args.model}: {len(shapes)} products, {sum(w.numel() for w in weights) * 4 / 1e6:.0f} MB of float32 weights")
    print("| rows | rtpcore ms | GFLOP/s | torch ms | GFLOP/s | torch / rtpcore |")
    print("|---:|---:|---:|---:|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in shapes}}
        ys = {n: torch.empty(rows, n) for n in {n for n, _ in shapes}}
        for w, lw, (n, k) in zip(weights, native, shapes, strict=True):  # the products are checked before they are timed
            kernels.linear(lw, xs[k].data_ptr(), rows, ys[n].data_ptr())
            torch.testing.assert_close(ys[n], F.linear(xs[k], w), rtol=1e-4, atol=1e-3)

        def ours(rows: int = rows, xs: dict = xs, ys: dict = ys) -> None:
            for lw, (n, k) in zip(native, shapes, strict=True):
                kernels.linear(lw, xs[k].data_ptr(), rows, ys[n].data_ptr())

        def theirs(xs: dict = xs, ys: dict = ys) -> None:
            for w, (n, k) in zip(weights, shapes, strict=True):
                torch.mm(xs[k], w.t(), out=ys[n])

        a, b = best(ours, args.repeats), best(theirs, args.repeats)
        print(f"| {rows} | {a * 1e3:.2f} | {flops * rows / a / 1e9:.0f} | {b * 1e3:.2f} | {flops * rows / b / 1e9:.0f} "
              f"| {b / a:.2f}x |", flush=True)


if __name__ == "__main__":
    main()

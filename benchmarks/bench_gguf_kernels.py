"""Micro-benchmark of the native GGUF matrix kernels (``rtpcore_native._kernels``, DESIGN §20).

For every GGUF weight type and every instruction set this CPU supports: the time of one
``linear`` call ``y (rows, N) = x (rows, K) @ dequant(W).T`` and the GB/s of weight bytes it
reads, at rows = 1 (decode), 8 (a batch) and 64 (a prefill chunk), for a 576 x 1536 matrix
(SmolLM2-135M's down projection) and a 1024 x 4096 one; the baseline is torch's float32
matmul on the dequantized weights, measured in the same run (ratio = torch time / ours, so
above 1 is faster than torch). The CPU (model name, avx2 / avx512f / avx512_vnni / avx_vnni)
heads the output. ``--dtype int8`` measures rtpcore's own int8 weights (one scale per row; the
integer kernel below ``INT8_QUANTIZED_ROWS`` rows, the float32 one from it on).

``--crossover`` measures instead where dequantizing a weight for torch's GEMM overtakes the block
kernel (``rtpcore.checkpoint.gguf.linear.GEMM_ROWS``): per type and row count, the block kernel
against ``gguf_dequantize_rows`` + ``F.linear``, one thread each, in CPU time of this thread (so
other load on the machine does not count), best of 5.

    python benchmarks/bench_gguf_kernels.py [--threads 2] [--seconds 0.2] [--isa avx2 ...] [--dtype q4_k ...]
    python benchmarks/bench_gguf_kernels.py --crossover [--dtype q8_0 q4_k ...]

``--cpu-time`` runs one thread and times the kernels in CPU time of this thread (best of 5 pairs
of calls) instead of wall time, for a machine other processes share; ``--shape 2816x1024`` picks
the matrices.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch

from rtpcore_native import _kernels as kernels

SHAPES = [(576, 1536), (1024, 4096)]  # (N out, K in)
ROWS = [1, 8, 64]
CROSSOVER_SHAPES = [(2816, 1024), (1024, 2816), (1536, 576), (576, 1536)]  # Llama-1024x16's and SmolLM2's MLP


def cpu_line() -> str:
    """The CPU's model name and the vector flags that choose our kernels, from /proc/cpuinfo."""
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown CPU":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    have = " ".join(f"{f}={'yes' if f in flags else 'no'}" for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni"))
    return f"{model}; {have}"


def random_blocks(dtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """(n, row bytes) uint8: valid random GGUF blocks (random integers, scales in [1e-3, 1e-2]);
    for int8, (n, k) int8 weights."""
    if dtype == "int8":
        return rng.integers(-127, 128, (n, k), dtype=np.int8)
    row = kernels.gguf_row_bytes(dtype, k)
    if dtype == "f16":
        return rng.standard_normal((n, k)).astype(np.float16).view(np.uint8)
    out = rng.integers(0, 256, (n, row), dtype=np.uint8)
    size = row // (k // (256 if dtype.endswith("_k") else 32))
    blocks = out.reshape(-1, size)
    halves = [size - 2] if dtype == "q6_k" else [0, 2] if dtype in ("q5_1", "q4_k", "q5_k") else [0]
    for at in halves:
        blocks[:, at : at + 2] = rng.uniform(1e-3, 1e-2, (blocks.shape[0], 1)).astype(np.float16).view(np.uint8)
    return out


def dequantize(dtype: str, w: np.ndarray, n: int, k: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    if dtype == "int8":
        return torch.from_numpy(w).float() * scale[:, None]
    out = torch.empty(n, k)
    ids = torch.arange(n, dtype=torch.int64)
    kernels.gguf_dequantize_rows(dtype, w.ctypes.data, k, ids.data_ptr(), n, out.data_ptr())
    return out


def best_time(fn: Callable[[], object], seconds: float) -> float:
    """Seconds per call: the best of 5 rounds of about ``seconds / 5`` each."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    reps = max(1, int(seconds / 5 / once))
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def weights_of(dtype: str, w: np.ndarray, scale: torch.Tensor, n: int, k: int) -> object:
    return kernels.LinearWeights(w.ctypes.data, dtype, scale.data_ptr() if dtype == "int8" else 0, 0, n, k)


def cpu_time(fn: Callable[[], object]) -> float:
    """Seconds of this thread's CPU per call: the best of 5 pairs of calls."""
    fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.thread_time()
        fn()
        fn()
        best = min(best, (time.thread_time() - t0) / 2)
    return best


def block_vs_gemm(dtype: str, w: np.ndarray, n: int, k: int, rows: int) -> tuple[float, float]:
    """CPU seconds of the block kernel and of dequantize + F.linear for ``rows`` rows."""
    weights = weights_of(dtype, w, torch.empty(0), n, k)
    ids, out = torch.arange(n, dtype=torch.int64), torch.empty(n, k)
    x, y = torch.randn(rows, k), torch.empty(rows, n)

    def gemm() -> None:
        kernels.gguf_dequantize_rows(dtype, w.ctypes.data, k, ids.data_ptr(), n, out.data_ptr())
        torch.nn.functional.linear(x, out)

    return cpu_time(lambda: kernels.linear(weights, x.data_ptr(), rows, y.data_ptr())), cpu_time(gemm)


def crossover(dtypes: list[str], rng: np.random.Generator, counts: list[int] | None = None) -> None:
    """Block kernel against dequantize + torch's GEMM, one thread, per type and row count (ms)."""
    torch.set_num_threads(1)
    kernels.set_num_threads(1)
    counts = counts or [8, 16, 32, 48, 64, 96, 128]
    print("ms per call, one thread (CPU time): block kernel / dequantize + F.linear")
    print(f"{'dtype':6} {'N x K':>11} " + " ".join(f"{f'rows {r}':>13}" for r in counts))
    for n, k in CROSSOVER_SHAPES:
        for dtype in dtypes:
            if dtype == "int8":
                continue  # no dequantization path: Linear's int8 forward is native at every row count
            if dtype.endswith("_k") and k % 256:
                continue  # no whole number of K blocks
            w = random_blocks(dtype, n, k, rng)
            times = [block_vs_gemm(dtype, w, n, k, rows) for rows in counts]
            print(f"{dtype:6} {f'{n}x{k}':>11} " + " ".join(f"{a * 1e3:6.2f}/{b * 1e3:6.2f}" for a, b in times), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=0.2, help="time per measurement")
    parser.add_argument("--isa", nargs="*", default=None, help="instruction sets (default: all supported)")
    parser.add_argument("--dtype", nargs="*", default=None, help="GGUF types or int8 (default: the GGUF types)")
    parser.add_argument("--crossover", action="store_true", help="where dequantize + GEMM overtakes the block kernel")
    parser.add_argument("--cpu-time", action="store_true", help="one thread, this thread's CPU time")
    parser.add_argument("--rows", nargs="*", type=int, default=None,
                        help="--crossover's row counts (default: 8 16 32 48 64 96 128)")
    parser.add_argument("--shape", nargs="*", default=None, help="N x K matrices, e.g. 2816x1024 (default: two)")
    args = parser.parse_args()
    if args.cpu_time:
        args.threads = 1
    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shape] if args.shape else SHAPES
    timer = cpu_time if args.cpu_time else (lambda fn: best_time(fn, args.seconds))
    torch.set_num_threads(args.threads)
    kernels.set_num_threads(args.threads)
    isas = args.isa or kernels.supported_isas()
    dtypes = args.dtype or kernels.gguf_dtypes()
    rng = np.random.default_rng(0)
    print(f"CPU: {cpu_line()}")
    if args.crossover:
        print(f"instruction set: {kernels.isa()}; torch {torch.__version__}")
        crossover(dtypes, rng, args.rows)
        return
    print(f"threads: {args.threads}; default instruction set: {kernels.default_isa()}; torch {torch.__version__}")
    print(f"{'dtype':6} {'isa':12} {'N x K':>11} {'rows':>4} {'us/call':>9} {'GB/s':>6} "
          f"{'torch us':>9} {'ratio':>6}")
    try:
        for n, k in shapes:
            x_all = torch.randn(max(ROWS), k)
            for dtype in dtypes:
                torch_us = {}
                w = random_blocks(dtype, n, k, rng)
                scale = torch.rand(n) * 1e-2 + 1e-3  # int8's per-row scales
                dense = dequantize(dtype, w, n, k, scale)  # torch's operand: the same weights in float32
                for rows in ROWS:
                    x = x_all[:rows].contiguous()
                    torch_us[rows] = timer(lambda x=x, dense=dense: torch.matmul(x, dense.T)) * 1e6
                weights = weights_of(dtype, w, scale, n, k)
                for isa in isas:
                    kernels.set_isa(isa)
                    for rows in ROWS:
                        x = x_all[:rows].contiguous()
                        y = torch.empty(rows, n)
                        def call(x: torch.Tensor = x, y: torch.Tensor = y, rows: int = rows,
                                 weights: object = weights) -> None:
                            kernels.linear(weights, x.data_ptr(), rows, y.data_ptr())

                        us = timer(call) * 1e6
                        print(f"{dtype:6} {isa:12} {f'{n}x{k}':>11} {rows:>4} {us:9.1f} {w.nbytes / us / 1e3:6.1f} "
                              f"{torch_us[rows]:9.1f} {torch_us[rows] / us:6.2f}", flush=True)
    finally:
        kernels.set_isa(kernels.default_isa())


if __name__ == "__main__":
    main()

"""Micro-benchmark of the native bf16 matrix kernels (``rtpcore_native._kernels``) against oneDNN.

For bf16 weights of the shapes of the bars' 56M Llama (hidden 512, intermediate 1376, vocab 32000)
and of SmolLM2-135M's MLP, and row counts from decode (1) to a prefill chunk (512): the time of one
``y (rows, N) = x (rows, K) @ W.T`` in bfloat16, each in the same run:

* ``F.linear``: torch's bf16 linear on the plain weight (oneDNN; what transformers runs);
* ``packed``: oneDNN on a weight it laid out once (``torch.ops.mkldnn._linear_pointwise``; the
  ``Linear`` kernel ``"packed"``);
* ``vdpbf16ps``: rtpcore's AVX512-BF16 kernel on the blocked layout (``linear_bf16``, set avx512_bf16);
* ``amx``: rtpcore's AMX-BF16 tiles on the same layout (set amx, AMX at every row count);
* ``widened``: the same layout widened to float32 in registers (set avx512_vnni, float32
  activations: the path of CPUs without bf16 dot products).

Ratios are oneDNN's packed time over ours (above 1: faster than oneDNN). The row count from which
the ``amx`` set uses AMX (``_kernels.amx_rows()``) is chosen where ``amx`` beats ``vdpbf16ps`` here.
Columns the CPU cannot run are blank. The CPU heads the output.

    python benchmarks/bench_bf16_kernels.py [--threads 2] [--seconds 0.2] [--rows 1,2,4,8,16,32,64,512]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from rtpcore.models.layers import pack_bf16
from rtpcore_native import _kernels as kernels

SHAPES = [(2752, 512), (512, 1376), (1024, 512), (32000, 512), (3072, 576)]  # (N out, K in)
ROWS = [1, 2, 4, 8, 16, 32, 64, 512]


def cpu_line() -> str:
    """The CPU's model name and the flags that choose the bf16 kernels, from /proc/cpuinfo."""
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
    have = " ".join(f"{f}={'yes' if f in flags else 'no'}" for f in ("avx512f", "avx512_bf16", "amx_bf16"))
    return f"{model}; {have}; rtpcore_native sets: {', '.join(kernels.supported_isas())}"


def best_time(fn: Callable[[], object], seconds: float) -> float:
    """Seconds per call: the best of five batches of calls, each about seconds / 5 long."""
    fn()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds / 10:
        fn()
        n += 1
    n = max(1, n)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best


class Operands:
    """One shape's weights in every form, in copies enough to outgrow the L2 caches: each call
    takes the next copy, so the weights come from L3 or memory, as a model's do in a decode step."""

    def __init__(self, n: int, k: int, resident: int, gen: torch.Generator):
        self.n, self.k = n, k
        self.copies = max(2, -(-resident // (2 * n * k)))
        self.plain = [(torch.randn(n, k, generator=gen) * 0.05).bfloat16() for _ in range(self.copies)]
        self.onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in self.plain]
        self.blocked = [pack_bf16(w) for w in self.plain]
        self.ours = [kernels.LinearWeights(b.data_ptr(), "bfloat16_packed", 0, 0, n, k) for b in self.blocked]
        self.turn = 0

    def next(self) -> int:
        self.turn = (self.turn + 1) % self.copies
        return self.turn


def measure(ops: Operands, rows: int, seconds: float, isas: list[str], gen: torch.Generator) -> dict[str, float | None]:
    """Seconds per product of ``rows`` rows by each kernel (None: not on this CPU)."""
    x = torch.randn(rows, ops.k, generator=gen).bfloat16()
    xf = x.float()
    y = torch.empty(rows, ops.n, dtype=torch.bfloat16)
    yf = torch.empty(rows, ops.n)
    times: dict[str, float | None] = {
        "F.linear": best_time(lambda: F.linear(x, ops.plain[ops.next()]), seconds),
        "packed": best_time(lambda: torch.ops.mkldnn._linear_pointwise(x, ops.onednn[ops.next()], None, "none", [], ""),
                            seconds),
    }
    amx_rows = kernels.amx_rows()
    for name, isa in (("vdpbf16ps", "avx512_bf16"), ("amx", "amx"), ("widened", "avx512_vnni")):
        if isa not in isas:
            times[name] = None
            continue
        kernels.set_isa(isa)
        kernels.set_amx_rows(1)
        if name == "widened":
            times[name] = best_time(lambda: kernels.linear(ops.ours[ops.next()], xf.data_ptr(), rows, yf.data_ptr()),
                                    seconds)
        else:
            times[name] = best_time(lambda: kernels.linear_bf16(ops.ours[ops.next()], x.data_ptr(), rows, y.data_ptr()),
                                    seconds)
    kernels.set_isa(kernels.default_isa())
    kernels.set_amx_rows(amx_rows)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seconds", type=float, default=0.2, help="time per measurement")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="NxK,...")
    parser.add_argument("--resident", type=int, default=32 << 20,
                        help="bytes of distinct weights each measurement cycles through (default 32 MiB)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels.set_num_threads(args.threads)
    isas = kernels.supported_isas()
    print(f"CPU: {cpu_line()}; {args.threads} threads; torch {torch.__version__}")
    print(f"amx set: AMX tiles from {kernels.amx_rows()} rows on (below: vdpbf16ps)")
    print("| N x K | rows | F.linear us | packed us | vdpbf16ps us | amx us | widened us | "
          "packed / vdpbf16ps | packed / amx | packed / best of ours |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        ops = Operands(n, k, args.resident, gen)
        for rows in (int(r) for r in args.rows.split(",")):
            t = measure(ops, rows, args.seconds, isas, gen)
            base = t["packed"]
            assert base is not None
            mine = [v for key, v in t.items() if key in ("vdpbf16ps", "amx") and v is not None]
            cells = [f"{v * 1e6:.1f}" if v is not None else "" for v in t.values()]
            ratios = [f"{base / v:.2f}x" if v is not None else "" for v in (t["vdpbf16ps"], t["amx"], min(mine, default=None))]
            print(f"| {n} x {k} | {rows} | {' | '.join(cells)} | {' | '.join(ratios)} |", flush=True)


if __name__ == "__main__":
    main()

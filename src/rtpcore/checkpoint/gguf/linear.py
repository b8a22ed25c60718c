"""The ``gguf`` quantization method's layers: a ``Linear`` whose weight stays in GGUF blocks.

``rtpcore.quantization.GgufMethod.create_weights`` calls :func:`attach` for a ``Linear`` built
from a :class:`~rtpcore.checkpoint.gguf.blocks.GGUFBlocks` weight, and ``apply`` calls
:func:`forward`. The layer then holds (all non-persistent buffers, no float weight):

* ``weight``: uint8 ``(out, row bytes)``, the file's blocks, when every row has one GGML type;
  else None and ``weight_0``, ``weight_1``, ... one per run of rows of one type, top first;
* ``gguf_parts``: ``((type name, rows), ...)``, one per byte buffer (lower-case GGML names:
  ``"q8_0"``, ``"q4_k"``, ``"f16"``);
* ``bias`` in the model's dtype and ``bias_f32`` in float32 (or None).

Two implementations of the product ``y = x @ dequant(W).T + bias``, chosen once per process
by :func:`~rtpcore.checkpoint.gguf.blocks.gguf_native`:

* **native** (``rtpcore_native._kernels`` with ``gguf_dtypes``): ``LinearWeights(ptr, type, 0,
  bias, out, in)`` per part and ``linear(...)``, the activations quantized per block as llama.cpp
  does (its tolerance: ``tests/test_gguf_method.py``); from :data:`GEMM_ROWS` rows on (per GGML
  type), that part's weight dequantized natively into a scratch buffer and torch's GEMM (faster
  for prefill);
* **reference** (a build without them): the blocks dequantized with the ``gguf`` package on
  every call, then ``F.linear`` in float32. Slow -- a float copy of the weight per call -- but
  exact: the result is bit for bit that of a float32 model loaded with the same weights
  dequantized, which is what the tests compare the native kernels against.

Either way the activations are computed in float32 and the result is cast to the input's dtype.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F

from rtpcore.checkpoint.gguf.blocks import GGUFBlocks, dequantize_rows, gguf_native

__all__ = ["attach", "forward", "gguf_blocks", "native_gguf_weights"]


def attach(layer: Any, weight: GGUFBlocks, bias: torch.Tensor | None) -> None:
    """Give ``layer`` (an ``rtpcore.layers.Linear`` being built) ``weight``'s blocks and ``bias``."""
    if weight.device.type != "cpu":
        raise ValueError(f"GGUF weights in blocks are multiplied on the CPU; this one is on {weight.device}")
    parts = weight.parts
    layer.gguf_parts = tuple((kind, int(data.shape[0])) for kind, data in parts)
    if len(parts) == 1:
        layer.register_buffer("weight", parts[0][1].contiguous(), persistent=False)
    else:
        layer.register_buffer("weight", None, persistent=False)
        for i, (_, data) in enumerate(parts):
            layer.register_buffer(f"weight_{i}", data.contiguous(), persistent=False)
    layer.register_buffer("bias", bias, persistent=False)
    layer.register_buffer("bias_f32", None if bias is None else bias.float().contiguous(), persistent=False)
    layer.gguf_native = _native_weights(layer)


def gguf_blocks(layer: Any) -> list[tuple[str, torch.Tensor]]:
    """``(type name, uint8 (rows, row bytes))`` of each part of a layer :func:`attach` built."""
    if len(layer.gguf_parts) == 1:
        return [(layer.gguf_parts[0][0], layer.weight)]
    return [(kind, getattr(layer, f"weight_{i}")) for i, (kind, _) in enumerate(layer.gguf_parts)]


def native_gguf_weights(kind: str, blocks: torch.Tensor, bias: torch.Tensor | None, in_features: int,
                        row_offset: int = 0, rows: int | None = None) -> Any:
    """The native kernels' ``LinearWeights`` of ``rows`` rows of ``blocks`` from ``row_offset``
    (every row when None), with float32 ``bias`` of those rows or None. ``blocks`` (and ``bias``)
    must outlive it."""
    native = gguf_native()
    n = blocks.shape[0] - row_offset if rows is None else rows
    ptr = blocks.data_ptr() + row_offset * blocks.stride(0)
    return native.LinearWeights(ptr, kind, 0, 0 if bias is None else bias.data_ptr(), n, in_features)


def _native_weights(layer: Any) -> list[Any] | None:
    """One native ``LinearWeights`` per part, or None without the native kernels."""
    if gguf_native() is None:
        return None
    out, start = [], 0
    bias = layer.bias_f32
    for kind, blocks in gguf_blocks(layer):
        rows = blocks.shape[0]
        part_bias = None if bias is None else bias[start: start + rows]
        out.append(native_gguf_weights(kind, blocks, part_bias, layer.in_features))
        start += rows
    return out


#: From this many rows (a prefill chunk, a large batch), per GGML type, the native path dequantizes a
#: part's weight into a float32 scratch and multiplies it with torch's GEMM instead of the block
#: kernels; activations then stay float32. Measured with benchmarks/bench_gguf_kernels.py
#: ``--crossover`` (one thread, CPU time; 2816 x 1024, 1024 x 2816, 1536 x 576 and 576 x 1536
#: weights), block kernel against dequantize + GEMM. The dequantization (7-8 G elements/s per
#: thread) is paid once per call. Where the crossover lies depends on the CPU's vendor more than
#: on its instruction sets: torch's float32 GEMM runs about twice as fast per cycle on a Xeon
#: as on an EPYC (Zen 4 executes a 512-bit FMA as two halves), the integer block kernels about
#: as fast on both, so :data:`GEMM_ROWS` is chosen once per process by :func:`gemm_rows`.
#:
#: Intel (Xeon with AVX-512 VNNI, before the VNNI GEMM below; every vendor but AMD): the
#: 32-element types break even at about 32 rows (q8_0 1024 x 2816: 2.3 ms against 2.2 at 32
#: rows, 3.5 against 2.5 at 48), the K types at about 96 (q4_k 1024 x 2816: 2.5 against 2.9 ms
#: at 64, 3.7 both ways at 96, 4.9 against 4.6 at 128; with the AVX2 kernels and MKL capped at
#: AVX2, 5.1 against 5.6 at 96, 6.6 against 7.0 at 128), f16 (a float32 kernel) at about 96.
GEMM_ROWS_INTEL = {"q8_0": 32, "q4_0": 32, "q5_0": 32, "q5_1": 32, "q4_k": 96, "q5_k": 96, "q6_k": 96, "f16": 96}
#: AMD (EPYC, Zen 4) with the AVX-512 VNNI kernels (before the byte-dot-product GEMM below, which now
#: takes the 32-element types at every row count): the 32-element types broke even at 128 rows
#: on SmolLM2's widths and stayed ahead there on wider ones (q8_0 2816 x 1024: 4.2 ms against 5.7
#: at 64 rows, 8.3 against 10.0 at 128, 16.4 against 16.7 at 256; q8_0 576 x 1536: 2.5 against
#: 2.5 at 128; q4_0 1536 x 576: 2.9 against 2.8 at 128); the K types and f16 stay ahead at 512
#: rows, twice a CPU step's default token budget (q4_k 1024 x 2816: 21.4 against
#: 31.0 ms, q6_k 19.8 against 31.5, q5_k 22.9 against 38.4, f16 31.2 against 35.1).
GEMM_ROWS_AMD = {"q8_0": 128, "q4_0": 128, "q5_0": 128, "q5_1": 128, "q4_k": 512, "q5_k": 512, "q6_k": 512,
                 "f16": 512}
#: AMD with the AVX2 kernels (an AVX2-only EPYC, Zen 3; or ``--cpu-isa avx2``): the K types stay
#: ahead at 512 rows (on the AVX2-only EPYC, one thread, CPU time: q4_k 2816 x 1024 36.6 against
#: 39.7 ms, 1024 x 2816 38.7 against 46.9; q6_k 37.8 against 51.0, 576 x 1536 16.8 against 14.1),
#: f16 as on Intel (not measured apart); the 32-element types: see GEMM_SETS_AMD.
GEMM_ROWS_AMD_AVX2 = {"q8_0": 64, "q4_0": 64, "q5_0": 64, "q5_1": 64, "q4_k": 512, "q5_k": 512, "q6_k": 512,
                      "f16": 96}


#: A threshold no step reaches: the block kernels at every row count.
NEVER = 1 << 62
#: The 32-element types (and rtpcore's int8) multiply from ``rtpcore_native._kernels.gemm_rows()``
#: rows on (16) as a GEMM over weights repacked per 16 columns (``src/rtpcore_native/_gguf_isa.hpp``,
#: ``qgemm``) on every vector kernel set; torch's GEMM never takes them where that GEMM was
#: measured ahead of it at every row count:
#: - with VNNI (vpdpbusd), on the Zen 4 EPYC (AVX-512 VNNI, one thread, CPU time): q8_0 2816 x 1024
#:   0.94 ms against dequantize + GEMM's 2.97 at 32 rows, 5.4 against 16.7 at 256, 10.6 against
#:   33.0 at 512; 576 x 1536 3.8 against 9.3 at 512; q4_0, q5_0 and q5_1 alike (2-3x: q5_1
#:   576 x 1536 4.7 against 10.0 at 512). On a Xeon the same instructions run; its float32 GEMM is
#:   about twice as fast per cycle, against which the old per-row kernel broke even at 32 rows
#:   and this one is 2-3x that kernel's speed from 32 rows on: the Xeon's tables take the same
#:   value (not measured there yet: ``--crossover`` does);
#: - with AVX2's vpmaddubsw on AMD (the AVX2-only EPYC, Zen 3, one thread, CPU time): q8_0
#:   576 x 1536 0.42 ms against 0.87 at 16 rows, 1.37 against 1.91 at 64, 9.8 against 11.2 at 512
#:   (the per-row kernel: 23.3); q4_0 6.7 against 12.8 at 512, q5_1 7.6 against 11.6; q8_0
#:   2816 x 1024 34.6 against 44.0 at 512. On an AMD CPU with AVX-512 but no VNNI (only
#:   ``--cpu-isa avx512`` on a Zen 4) the same code runs with more registers: taken alike, not
#:   measured. On Intel without VNNI the old crossover (32 rows) stands: not measured there.
GEMM_SETS_AMD = ("avx512", "avx2")
VNNI_SETS = ("amx", "avx512_bf16", "avx512_vnni", "avx2_vnni")
VNNI_GEMM_TYPES = ("q8_0", "q4_0", "q5_0", "q5_1")


def gemm_rows(vendor: str | None = None, kernel_set: str | None = None) -> dict[str, int]:
    """The row counts from which each GGML type's weight is dequantized for torch's GEMM on
    this CPU (``vendor``: CPUID's vendor string; ``kernel_set``: the native kernel set the
    caps allow, ``rtpcore_native._kernels.default_isa()``); :data:`NEVER` where the block
    kernels win at every row count."""
    kernels = gguf_native()
    if vendor is None:
        vendor = kernels.cpu_vendor() if kernels is not None else ""
    if kernel_set is None:
        kernel_set = kernels.default_isa() if kernels is not None else "baseline"
    if vendor != "AuthenticAMD":
        table = dict(GEMM_ROWS_INTEL)
    else:
        table = dict(GEMM_ROWS_AMD if kernel_set.startswith(("avx512", "amx")) else GEMM_ROWS_AMD_AVX2)
    if kernel_set in VNNI_SETS or (vendor == "AuthenticAMD" and kernel_set in GEMM_SETS_AMD):
        table.update(dict.fromkeys(VNNI_GEMM_TYPES, NEVER))
    return table


#: This process's thresholds (:func:`gemm_rows` at import: the CPU's vendor and the kernel set
#: RTPCORE_CPU_ISA allows; ``--cpu-isa`` is applied before a model is built).
GEMM_ROWS = gemm_rows()

_scratch = threading.local()


def _dequantized(kind: str, blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """``blocks`` (rows, row bytes) of GGML type ``kind`` as float32 (rows, in), in a scratch buffer of
    this thread reused by every layer (valid until the next call)."""
    kernels = gguf_native()
    rows = blocks.shape[0]
    numel = rows * in_features
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _scratch.buf = torch.empty(numel, dtype=torch.float32)
    ids = getattr(_scratch, "ids", None)
    if ids is None or ids.numel() < rows:
        ids = _scratch.ids = torch.arange(max(rows, 1), dtype=torch.int64)
    w = buf[:numel].view(rows, in_features)
    kernels.gguf_dequantize_rows(kind, blocks.data_ptr(), in_features, ids.data_ptr(), rows, w.data_ptr())
    return w


def forward(layer: Any, x: torch.Tensor) -> torch.Tensor:
    """``layer``'s output (..., out) for ``x`` (..., in), in ``x``'s dtype."""
    rows = x.reshape(-1, layer.in_features).float().contiguous()  # (n, in)
    native = layer.gguf_native
    n = rows.shape[0]
    if native is not None and n > 0:
        kernels = gguf_native()
        kernels.set_num_threads(torch.get_num_threads())
        outs, start = [], 0
        for (kind, blocks), weights in zip(gguf_blocks(layer), native, strict=True):
            if n >= GEMM_ROWS[kind]:
                bias = None if layer.bias_f32 is None else layer.bias_f32[start: start + blocks.shape[0]]
                y = F.linear(rows, _dequantized(kind, blocks, layer.in_features), bias)
            else:
                y = torch.empty(n, weights.out_features, dtype=torch.float32)  # (n, part rows)
                kernels.linear(weights, rows.data_ptr(), n, y.data_ptr())
            outs.append(y)
            start += blocks.shape[0]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    else:  # the reference: the weight dequantized for this call
        w = torch.cat([dequantize_rows(kind, blocks, layer.in_features) for kind, blocks in gguf_blocks(layer)])
        y = F.linear(rows, w, layer.bias_f32)
    return y.to(x.dtype).reshape(*x.shape[:-1], layer.out_features)

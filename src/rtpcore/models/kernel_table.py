"""Which kernel runs a step: per weight dtype and step kind (``rtpcore info``), and per step run
(``EngineStats.kernel_calls``).

Two drivers run a step on the CPU: rtpcore_native's whole decode step
(``rtpcore.models.native``, a pure decode step of a Llama-family model whose layers it can read)
or the model's torch modules, whose linear layers run what :func:`linear_kernel` names for the
step's row count. The labels:

* ``native:<set>`` -- rtpcore_native's kernels of that set (``rtpcore.models.cpu_isa``): int8
  weights with float32 inputs, bf16 weights in the blocked layout (``Linear``'s ``native-bf16``:
  vdpbf16ps, AMX tiles), GGUF blocks below ``GEMM_ROWS`` rows
  (``rtpcore.checkpoint.gguf.linear``), float32 weights in the float32 steps of a Llama-family
  model whose ``native_decode`` is on (``RowOps.linear``: the tile kernel, the GEMM from 40 rows
  with AVX2, from 64 otherwise);
* ``torch (oneDNN)`` -- ``Linear``'s ``packed`` kernel (oneDNN's prepacked bf16 / fp16 GEMM,
  AMX or AVX512-BF16 where the CPU has them), and ``packed+fp32`` for one row;
* ``torch (float32 GEMM)`` -- torch's float32 GEMM: float32 weights otherwise, the float32 copy of
  ``packed+fp32`` from two rows on, GGUF blocks dequantized natively from their type's ``GEMM_ROWS`` rows on;
* ``torch (F.linear)`` -- ``F.linear`` on reduced-precision weights (no prepacked kernel here);
* ``torch (int8 weight)`` -- torch's int8-weight kernel (int8 weights with bf16 / fp16 inputs);
* ``torch (reference dequantize)`` -- GGUF blocks dequantized per call (a build without the
  GGUF kernels);
* a quantization method's ``kernel`` (a plugin's) otherwise.

A step is counted under ``native_decode[<set>]`` or ``torch_step[<label>]`` (:func:`step_kernel`),
the keys :func:`kernel_table` lists per dtype and step kind: the table is computed by building a
small ``Linear`` of each weight kind on this machine, under the caps in force, and asking the
same functions the counters ask (tests/test_cpu_isa.py runs engines and compares).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from rtpcore.checkpoint.gguf.linear import GEMM_ROWS, NEVER
from rtpcore.models.cpu_isa import native_kernels
from rtpcore.models.layers import Linear, linear_kernels, weight_quantization
from rtpcore.models.native import NativeLlamaDecode, native_operands

__all__ = ["STEP_KINDS", "kernel_table", "linear_kernel", "representative_linear", "step_kernel", "weight_kinds"]

STEP_KINDS = ("decode", "prefill", "mixed")
_IN = 256  # the probe layers' width: a whole number of every GGUF block


def native_label() -> str:
    """``native:<set>``, the kernel set in use."""
    k = native_kernels()
    return f"native:{k.isa()}" if k is not None else "native:unavailable"


def linear_kernel(layer: Any, rows: int, dtype: torch.dtype, native_rows: bool = False) -> str:
    """The label (module doc) of what ``layer`` (an ``rtpcore.models.layers.Linear``) runs for an
    input of ``rows`` rows of ``dtype``, as its forward decides, or, with ``native_rows`` (a
    float32 step of a Llama-family model whose ``native_decode`` is on), as
    ``rtpcore.models.llama_modules.RowOps.linear`` decides."""
    if getattr(layer, "gguf_parts", None) is not None:  # rtpcore.checkpoint.gguf.linear.forward
        if layer.gguf_native is None:
            return "torch (reference dequantize)"
        kind = layer.gguf_parts[0][0]  # per part, by its GGML type; several types: the first part's
        return "torch (float32 GEMM)" if rows >= GEMM_ROWS[kind] else native_label()
    kernel = layer.kernel
    if kernel == "int8":  # rtpcore.quantization.Int8Method.apply
        return native_label() if layer.native_weights is not None and dtype == torch.float32 else "torch (int8 weight)"
    if kernel == "native-bf16":  # Linear._native_bf16: the blocked bf16 weight, every row count
        return native_label()
    if kernel == "packed+fp32":  # Linear.forward: the float32 copy from two rows on
        return "torch (float32 GEMM)" if rows > 1 else "torch (oneDNN)"
    if kernel == "packed":
        return "torch (oneDNN)"
    if kernel == "plain":
        if native_rows and dtype == torch.float32 and layer._native_float32() is not None:
            return native_label()
        on_cpu = layer.weight.device.type == "cpu"
        return "torch (float32 GEMM)" if on_cpu and layer.weight.dtype == torch.float32 else "torch (F.linear)"
    return str(kernel)


def representative_linear(model: Any) -> Any:
    """The ``Linear`` whose kernel names a torch step of ``model``: the last one outside the
    head (a layer's, which sees every token of the step), else any; None without one."""
    found = None
    for name, module in model.named_modules() if isinstance(model, torch.nn.Module) else ():
        if isinstance(module, Linear) and (not name.endswith("lm_head") or found is None):
            found = module
    return found


def step_kernel(model: Any, batch: Any, linear: Any, dtype: torch.dtype) -> str:
    """The ``EngineStats.kernel_calls`` key of a step ``model`` just ran on ``batch`` (a
    ``ForwardBatch``): ``native_decode[<set>]`` where the native decode step served it, else
    ``torch_step[<label>]`` of ``linear`` (:func:`representative_linear`) for the step's tokens."""
    if getattr(model, "decode_kernel", None) == "native" and NativeLlamaDecode.serves(batch):
        return f"native_decode[{native_label().removeprefix('native:')}]"
    if linear is None:
        return "torch_step"
    # RowOps.linear multiplies a Linear in place; the representative layer of a shard sits inside
    # a RowParallel, which it leaves to its own forward
    parallel = getattr(model, "parallel", None)
    native_rows = (bool(getattr(model, "native_enabled", False)) and native_kernels() is not None
                   and (parallel is None or parallel.world_size == 1))
    return f"torch_step[{linear_kernel(linear, batch.num_tokens, dtype, native_rows)}]"


def weight_kinds() -> tuple[str, ...]:
    """The weight kinds of the table: float32, bfloat16, int8 and each GGUF type rtpcore keeps in
    its blocks."""
    from rtpcore.quantization import GgufMethod

    return ("float32", "bfloat16", "int8", *GgufMethod.gguf_types)


@contextlib.contextmanager
def _building(kind: str) -> Iterator[None]:
    """As the engine builds a layer of ``kind`` by default (rtpcore.engine.worker.rank)."""
    from rtpcore.quantization import GgufMethod

    method = "int8" if kind == "int8" else GgufMethod() if kind not in ("float32", "bfloat16") else None
    with linear_kernels(batched_fp32=None), weight_quantization(method):
        yield


def _probe_layer(kind: str) -> tuple[Linear, torch.dtype]:
    """A small ``Linear`` of weight ``kind`` built as the engine builds one, and the dtype of its
    inputs (a GGUF or int8 model computes in float32 on the CPU)."""
    from rtpcore.checkpoint.gguf.blocks import GGUFBlocks, row_bytes

    with _building(kind):
        if kind in ("float32", "bfloat16"):
            dtype = getattr(torch, kind)
            return Linear(torch.zeros(32, _IN, dtype=dtype)), dtype
        if kind == "int8":
            return Linear(torch.ones(32, _IN)), torch.float32
        blocks = GGUFBlocks([(kind, torch.zeros(32, row_bytes(kind, _IN), dtype=torch.uint8))], _IN)
        return Linear(blocks), torch.float32


def _segments(label: Any, low: int) -> list[dict[str, str]]:
    """``label(rows)`` over rows ``low..``, as runs of equal labels: ``[{"rows": "1", "kernel": ...},
    {"rows": "2-95", ...}, {"rows": "96+", ...}]`` (the labels change only at 2 and at a type's GEMM_ROWS)."""
    cuts = sorted({low, *(r for r in (2, *GEMM_ROWS.values()) if low < r < NEVER)})
    runs: list[list[Any]] = []  # [first row, last row or None, kernel]
    for i, start in enumerate(cuts):
        last = cuts[i + 1] - 1 if i + 1 < len(cuts) else None
        kernel = label(start)
        if runs and runs[-1][2] == kernel:
            runs[-1][1] = last
        else:
            runs.append([start, last, kernel])
    def rows(first: int, last: int | None) -> str:
        return f"{first}+" if last is None else str(first) if last == first else f"{first}-{last}"
    return [{"rows": rows(first, last), "kernel": kernel} for first, last, kernel in runs]


def kernel_table() -> list[dict[str, Any]]:
    """Per weight kind (:func:`weight_kinds`) and step kind (:data:`STEP_KINDS`), the
    ``EngineStats.kernel_calls`` key of a step of a Llama-family model with the engine's default
    options on this machine, under the caps in force: ``{"weights", "step", "kernels": [{"rows",
    "kernel"}]}``, ``rows`` the step's tokens (decode: its sequences). A bf16 model whose float32
    copies would exceed a quarter of the memory limit keeps none (``packed``; rank.py)."""
    k = native_kernels()
    out: list[dict[str, Any]] = []
    for kind in weight_kinds():
        layer, dtype = _probe_layer(kind)
        native_decode = k is not None and native_operands(layer) is not None

        def torch_step(rows: int, layer: Any = layer, dtype: torch.dtype = dtype) -> str:
            # a Llama-family model's steps take RowOps where native_decode is on (its default)
            return f"torch_step[{linear_kernel(layer, rows, dtype, k is not None)}]"

        for step in STEP_KINDS:
            if step == "decode" and native_decode:
                kernels = [{"rows": "1+", "kernel": f"native_decode[{native_label().removeprefix('native:')}]"}]
            else:
                kernels = _segments(torch_step, 2 if step == "mixed" else 1)
            out.append({"weights": kind, "step": step, "kernels": kernels})
    return out

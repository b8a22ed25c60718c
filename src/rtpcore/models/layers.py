"""Building blocks for model authors: ``Linear``, a frozen linear layer on the fastest kernel.

``Linear(weight, bias=None)`` computes ``y = x @ weight.T + bias`` as
``torch.nn.functional.linear`` does, on the fastest kernel torch offers for that
on this machine. Use it for every projection of a model served by rtpcore
(built-in models do; so does the ``atom-plugin`` example)::

    from rtpcore.layers import Linear, row_parallel

    self.qkv = Linear(w["qkv.weight"].to(dtype))                       # (out, in)
    self.o = row_parallel(Linear, w["o.weight"].to(dtype), None, parallel)  # sharded or not

The kernels, and what each promises (``layer.kernel`` says which one runs):

* ``"plain"`` -- **float32**, any device other than the CPU, or a build without
  oneDNN: ``F.linear`` on the weight as given (no copy: the layer holds the tensor
  you pass, so views into a larger stacked tensor stay views). Bit-identical to
  ``F.linear``; Hugging Face transformers computes float32 projections with this
  same kernel, which is what keeps float32 greedy tokens identical to it.
* ``"packed"`` -- **bf16 / fp16 on the CPU** (bf16 where ``"native-bf16"`` is not chosen).
  ``F.linear`` re-lays the weight out
  on every call; oneDNN can lay it out once (``torch.ops.mkldnn._reorder_linear_weight``)
  and reuse it, about 1.5x faster at decode batch sizes. Both accumulate in float32
  and round once to the weight's dtype, but their summation orders may differ, so
  an output element can differ from ``F.linear``'s by one rounding step of that
  dtype (whether it does depends on the CPU and the data: on CPUs without bf16
  instructions it does, on a few elements in a thousand). No bit-exactness is claimed.
* ``"native-bf16"`` -- **bf16 on a CPU with bf16 dot products** (AVX512-BF16 or AMX-BF16,
  as rtpcore_native's kernels in use say: ``ONEDNN_MAX_CPU_ISA`` caps them as it caps oneDNN).
  The weight is kept once, in the blocked layout of rtpcore_native's bf16 kernels
  (``rtpcore.models.bf16_blocked.pack_bf16``; no float32 copy, no second bf16 copy), and every
  input is multiplied there: vdpbf16ps for one row, AMX tiles from ``amx_rows()`` rows on
  (decode batches and prefill chunks alike). The products of bf16 values are exact in float32
  and summed in float32, the result rounded once to bf16: within one rounding step of
  ``F.linear``, as ``"packed"``. The native decode step (``rtpcore.models.native``) reads the
  same weight. ``fp32_batched_linear=True`` still asks for ``"packed+fp32"``.
* ``"packed+fp32"`` -- ``"packed"`` for one-row inputs (decode at batch 1), plus a
  float32 copy of the weight for inputs of several rows (batched decode, prefill; torch's
  float32 GEMM, and the native decode step of ``rtpcore.models.native`` for every decode
  batch of a bf16 model): the input is widened to float32, multiplied on float32 hardware and the
  result rounded to the weight's dtype. On CPUs without bf16 (fp16) dot-product
  instructions oneDNN emulates reduced-precision GEMMs, and the float32 kernel is
  about twice as fast from two rows on. It costs a float32 copy of the weight
  (three times the bytes of a bf16 weight), so it is chosen only on such CPUs and
  only where the host allows it (:func:`linear_kernels`; the Engine's
  ``fp32_batched_linear`` option). Same tolerance as ``"packed"``.

* ``"int8"`` -- **weight-only int8** (the engine's ``quantization="int8"``, on the CPU: the
  ``int8`` quantization method, ``rtpcore.quantization.Int8Method``; any method whose
  ``create_weights`` builds the layer computes it, and ``kernel`` is then its name):
  built inside :func:`weight_quantization`, the layer stores its weight as int8 with one
  scale per output channel (``amax / 127`` of that row, rounded to nearest) and multiplies
  with rtpcore_native's int8 kernels for float32 inputs (``rtpcore.models.native``; below
  ``INT8_QUANTIZED_ROWS`` rows the activations quantized to int8 per block of 32 and integer
  dot products, as llama.cpp's Q8_0; from it on the weight widened to float32 in registers,
  products summed in float32, up to ``gemm_rows()`` rows (16 with any vector kernel set), from which
  the activations are quantized again for a byte-dot-product GEMM: ``rtpcore.quantization.Int8Method``) and with torch's
  int8-weight CPU kernel for bf16/fp16 inputs. A weight element is off by at most half a
  step (``amax / 254`` of its row); the checkpoint stays float.

The weight and bias are non-persistent buffers (the checkpoint, not the module's
state dict, is the source of truth); a packed weight is opaque: read
``in_features`` / ``out_features``, not ``weight.shape``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rtpcore.models.bf16_blocked import pack_bf16
from rtpcore.models.cpu_isa import announce_kernels, native_dot_allowed

__all__ = ["QUANTIZATIONS", "Linear", "cpu_has_native_dot", "linear_kernels", "native_kernels",
           "packed_linear_supported", "weight_quantization"]

logger = logging.getLogger(__name__)

# Whether Linear may keep a float32 copy for several-row inputs: None = automatic
# (only on CPUs without native bf16/fp16 dot products). Set with linear_kernels().
_BATCHED_FP32: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "rtpcore_linear_batched_fp32", default=None
)
QUANTIZATIONS = ("int8",)  # rtpcore's own weight-only schemes Linear builds (weight_quantization)
# The quantization method (rtpcore.quantization) of the model being built in this thread.
_QUANTIZATION: contextvars.ContextVar[Any] = contextvars.ContextVar("rtpcore_linear_quantization", default=None)

# cpuinfo flags of native reduced-precision dot products, and the oneDNN ISA names
# (ONEDNN_MAX_CPU_ISA) below which oneDNN does not use them.
_NATIVE_FLAGS = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16"),
}
_ISAS_WITHOUT_NATIVE_DOT = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_CORE", "AVX512_CORE_VNNI"}


class Linear(nn.Module):
    """A frozen linear layer; ``weight`` is (out, in), ``bias`` (out,) or None.

    Inputs are (..., in) in the weight's dtype; outputs (..., out) in that dtype.
    ``kernel`` is ``"plain"``, ``"packed"``, ``"native-bf16"`` or ``"packed+fp32"`` (see the
    module doc).
    """

    weight: torch.Tensor  # (out, in), or oneDNN's packed form of it
    bias: torch.Tensor | None
    weight_fp32: torch.Tensor | None  # a float32 copy, (out, in) ("packed+fp32")
    scales: torch.Tensor  # per output channel ("int8" only)
    scales_f32: torch.Tensor  # the same in float32, for the native kernel ("int8" only)
    bias_f32: torch.Tensor | None  # the bias in float32 ("int8" only)
    bias_fp32: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"Linear weight must be 2-D (out, in); got shape {tuple(weight.shape)}")
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(
                f"Linear bias must have shape ({weight.shape[0]},) to match weight {tuple(weight.shape)}; "
                f"got {tuple(bias.shape)}"
            )
        self.out_features, self.in_features = weight.shape
        self._method: Any = None
        self._native: Any = None
        self._native_weights: Any = None
        self._f32_weights: Any = None  # _native_float32(): None before the first call, False if none
        method = _QUANTIZATION.get()
        if method is not None and method.create_weights(self, weight, bias):
            # The method's form (rtpcore.quantization): it computes the layer too.
            self._method = method
            self.packed = False
            self.kernel = method.kernel or method.name
            for name in ("weight", "bias", "weight_fp32", "bias_fp32"):
                if name not in self._buffers and not hasattr(self, name):
                    self.register_buffer(name, None, persistent=False)
            return
        allowed = _BATCHED_FP32.get()
        if allowed is not True and weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and native_bf16_dot():
            # rtpcore_native's bf16 kernels on their blocked layout: the one copy of the weight
            self.packed = True
            self.kernel = "native-bf16"
            self.register_buffer("weight", pack_bf16(weight), persistent=False)
            self.register_buffer("bias", bias, persistent=False)
            self.register_buffer("bias_f32", None if bias is None else bias.float().contiguous(), persistent=False)
            self.register_buffer("weight_fp32", None, persistent=False)
            self.register_buffer("bias_fp32", None, persistent=False)
            self.refresh_native_weights()
            return
        self.packed = weight.device.type == "cpu" and packed_linear_supported(weight.dtype)
        batched_fp32 = False
        if self.packed:
            batched_fp32 = not cpu_has_native_dot(weight.dtype) if allowed is None else allowed
        fp32_weight = fp32_bias = None
        if batched_fp32:  # a plain float32 copy: torch's float32 GEMM and the native decode read it
            fp32_weight = weight.float().contiguous()
            fp32_bias = None if bias is None else bias.float().contiguous()
        if self.packed:
            weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
        self.kernel = "packed+fp32" if batched_fp32 else "packed" if self.packed else "plain"
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.register_buffer("weight_fp32", fp32_weight, persistent=False)
        self.register_buffer("bias_fp32", fp32_bias, persistent=False)

    def refresh_native_weights(self) -> None:
        """Point the native kernel at this layer's operands after they were built or moved: int8
        (``weight``, ``scales_f32``, ``bias_f32``) or, for ``"native-bf16"``, the blocked bf16
        ``weight`` and ``bias_f32``; None without the kernels or off the CPU."""
        self._native = native_kernels()
        self._native_weights = None
        if self._native is None or self.weight.device.type != "cpu":
            return
        bf16 = getattr(self, "kernel", None) == "native-bf16"  # else int8 (its method sets kernel after)
        self._native_weights = self._native.LinearWeights(
            self.weight.data_ptr(), "bfloat16_packed" if bf16 else "int8", 0 if bf16 else self.scales_f32.data_ptr(),
            0 if self.bias_f32 is None else self.bias_f32.data_ptr(), self.out_features, self.in_features,
        )

    @property
    def native_weights(self) -> Any:
        """The native kernel's view of this layer's int8 or blocked bf16 operands
        (:meth:`refresh_native_weights`)."""
        return self._native_weights

    def _native_float32(self) -> Any:
        """rtpcore_native's view (``LinearWeights``, ``"float32"``) of a ``"plain"`` float32 weight
        on the CPU, made at the first call and kept until the layer moves; None where the kernels
        cannot read the weight in place (another kernel or dtype, a non-contiguous weight or bias,
        a build without the kernels). The float32 steps of ``rtpcore.models.llama_modules`` multiply
        with it where the engine's ``native_decode`` allows rtpcore_native."""
        if self._f32_weights is None:
            self._f32_weights = False
            kernels = native_kernels()
            w, b = self.weight, self.bias
            if (kernels is not None and self.kernel == "plain" and w.device.type == "cpu" and w.dtype == torch.float32
                    and w.is_contiguous() and (b is None or (b.dtype == torch.float32 and b.is_contiguous()))):
                self._f32_weights = kernels.LinearWeights(w.data_ptr(), "float32", 0, 0 if b is None else b.data_ptr(),
                                                          self.out_features, self.in_features)
        return self._f32_weights or None

    def native_linear(self, native: Any, rows: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (n, out) float32 = the native int8 product of ``rows`` (n, in) float32."""
        self._native.set_num_threads(torch.get_num_threads())
        self._native.linear(native, rows.data_ptr(), rows.shape[0], out.data_ptr())

    def _apply(self, fn: Any, recurse: bool = True) -> Any:  # .to(), .float(), ...: tensors may move
        out = super()._apply(fn, recurse)
        self._f32_weights = None
        if self._native_weights is not None:
            self.refresh_native_weights()
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        if self._method is not None:
            out: torch.Tensor = self._method.apply(self, x)
            return out
        if self.kernel == "native-bf16":
            return self._native_bf16(x)
        if self.weight_fp32 is not None and x.numel() > self.in_features:  # several rows
            return F.linear(x.float(), self.weight_fp32, self.bias_fp32).to(x.dtype)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def _native_bf16(self, x: torch.Tensor) -> torch.Tensor:
        """The ``"native-bf16"`` product: bf16 rows in, bf16 rows out (other dtypes pass through bf16)."""
        if self._native_weights is None:
            raise RuntimeError(f"a 'native-bf16' Linear computes on the CPU; its weight is on {self.weight.device}")
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.bfloat16)
        if rows.shape[0]:
            self._native.set_num_threads(torch.get_num_threads())
            self._native.linear_bf16(self._native_weights, rows.data_ptr(), rows.shape[0], out.data_ptr())
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, kernel={self.kernel}"


def native_bf16_dot() -> bool:
    """True when rtpcore_native's kernels in use multiply bf16 with bf16 dot products
    (its ``avx512_bf16`` or ``amx`` set: the CPU has them and ``ONEDNN_MAX_CPU_ISA`` allows them)."""
    kernels = native_kernels()
    return kernels is not None and bool(kernels.bf16_dot())


def native_kernels() -> Any:
    """The ``rtpcore_native._kernels`` module (int8 products of float32 inputs here, the decode
    step of ``rtpcore.models.native``), or None where this build has none. The first call in a
    process logs why AMX is not used where it could be (``rtpcore.models.cpu_isa``)."""
    try:
        from rtpcore_native import _kernels
    except ImportError as exc:  # a build without the kernels: torch's kernels serve
        logger.debug("rtpcore_native._kernels unavailable: %s", exc)
        return None
    announce_kernels(logger)
    return _kernels


@contextlib.contextmanager
def linear_kernels(*, batched_fp32: bool | None) -> Iterator[None]:
    """Within the block, :class:`Linear` layers built in this thread keep (True), never keep
    (False) or automatically keep (None: on CPUs without native dot products for the
    weight's dtype) a float32 copy for several-row inputs."""
    token = _BATCHED_FP32.set(batched_fp32)
    try:
        yield
    finally:
        _BATCHED_FP32.reset(token)


@contextlib.contextmanager
def weight_quantization(method: Any) -> Iterator[None]:
    """Within the block, :class:`Linear` layers built in this thread take their weights in the
    form of ``method`` (an ``rtpcore.quantization.QuantizationMethod`` whose ``create_weights``
    builds them, or ``"int8"``: rtpcore's :class:`~rtpcore.quantization.Int8Method`, per output
    channel, see the module docstring); None keeps them float."""
    if isinstance(method, str):
        if method not in QUANTIZATIONS:
            raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got {method!r}")
        from rtpcore.quantization import Int8Method

        method = Int8Method()
    token = _QUANTIZATION.set(method)
    try:
        yield
    finally:
        _QUANTIZATION.reset(token)


def cpu_has_native_dot(dtype: torch.dtype, cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """True when this CPU has dot-product instructions for ``dtype`` (bf16: ``avx512_bf16``
    or AMX; fp16: ``avx512_fp16`` or AMX-FP16) and neither ``ONEDNN_MAX_CPU_ISA`` nor rtpcore's
    ``--cpu-isa`` (``RTPCORE_CPU_ISA``, ``rtpcore.models.cpu_isa``) hides them.

    Unknown (no ``/proc/cpuinfo``, another architecture) counts as False: the float32
    route is the one that is fast everywhere.
    """
    flags = _NATIVE_FLAGS.get(dtype)
    if flags is None or not native_dot_allowed(str(dtype).removeprefix("torch.")):
        return False
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if isa in _ISAS_WITHOUT_NATIVE_DOT:
        return False
    return bool(set(flags) & _cpu_flags(str(cpuinfo)))


@functools.cache
def _cpu_flags(cpuinfo: str) -> frozenset[str]:
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


@functools.cache
def packed_linear_supported(dtype: torch.dtype) -> bool:
    """True when prepacked oneDNN linear exists for ``dtype`` and agrees with ``F.linear``
    to the dtype's rounding on a probe (it catches builds whose ops are missing or broken).

    Always False for float32 (``F.linear`` is already the exact, fast kernel) and for
    builds without oneDNN. The probe runs once per dtype.
    """
    if dtype not in (torch.bfloat16, torch.float16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(24, 40, generator=gen).to(dtype)
        b = torch.randn(24, generator=gen).to(dtype)
        x = torch.randn(3, 40, generator=gen).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
    except (RuntimeError, AttributeError, NotImplementedError) as exc:
        logger.debug("prepacked oneDNN linear unavailable for %s: %s", dtype, exc)
        return False
    close = torch.allclose(got.float(), F.linear(x, w, b).float(), rtol=2 * torch.finfo(dtype).eps, atol=1e-2)
    if not close:
        logger.debug("prepacked oneDNN linear disagrees with F.linear for %s; not using it", dtype)
    return close

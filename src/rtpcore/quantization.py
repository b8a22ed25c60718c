"""Quantization methods: the ``quantization_methods`` seam (docs/design.md §18, docs/plugins.md
"Quantization methods").

A quantization method says how a model's linear weights are stored and computed. The engine
takes one per model: the method ``--quantization NAME`` names (``quantization=NAME``), else the
one whose ``name`` is ``config.json``'s ``quantization_config.quant_method``, else none (float
weights). :func:`quantization_method` resolves it among the registered methods; an unknown
``quant_method`` is a :class:`~rtpcore.errors.CheckpointError` naming it, the known methods and
any installed plugin that declares it under the entry-point group
``rtpcore.quantization_methods`` (a hint, like ``rtpcore.architectures``).

``--quantization none`` (``quantization="none"``) asks for float weights whatever the checkpoint
declares: fp8 and GGUF weights are dequantized at load.

A method acts at two moments:

* **the load** (``rtpcore.checkpoint.load_checkpoint(..., quantization=method)``):
  :meth:`QuantizationMethod.select` names the extra tensors read with the model's weights
  (scales, zero points: they enter the pruned load, so their shards are opened and no other)
  and returns a :class:`QuantizedTensors`, whose ``process_weights_after_loading`` turns what
  was read into what the model receives;
* **the model's build** (``rtpcore.layers.Linear``, the layer every model's projections use):
  :meth:`QuantizationMethod.create_weights` may give the layer its weights in the method's form
  (True), and :meth:`QuantizationMethod.apply` then computes the layer's output.

Built in, registered through the same hook a plugin implements (``rtpcore.models``): ``fp8``
(:class:`Fp8Method`: DeepSeek-V3's block-quantized fp8 checkpoints, dequantized at load,
``rtpcore.checkpoint.quantized``) and ``int8`` (:class:`Int8Method`: rtpcore's weight-only int8,
quantized at load from a float or fp8 checkpoint, on the CPU) and ``gguf`` (:class:`GgufMethod`:
a GGUF checkpoint's quantized weights kept in their blocks from the file to the kernel,
docs/design.md §20; the method of every GGUF checkpoint unless another is asked for). A method
extending a built-in subclasses it under another ``name``.

Public constants: :data:`BUILTIN_QUANTIZATION_METHODS` (the built-in names), :data:`NO_QUANTIZATION`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from rtpcore.checkpoint.quantized import Fp8BlockQuantization
from rtpcore.errors import CheckpointError, RtpcoreError

if TYPE_CHECKING:
    import torch

    from rtpcore.checkpoint.patterns import WeightSelection

__all__ = [
    "BUILTIN_QUANTIZATION_METHODS",
    "NO_QUANTIZATION",
    "Fp8Method",
    "GgufMethod",
    "Int8Method",
    "QuantizationMethod",
    "QuantizedTensors",
    "quantization_method",
]

#: The names of rtpcore's own quantization methods.
BUILTIN_QUANTIZATION_METHODS = ("fp8", "gguf", "int8")
#: The ``--quantization`` value that asks for float weights (quantized checkpoints dequantized at load).
NO_QUANTIZATION = "none"


class QuantizedTensors(Protocol):
    """What a method's :meth:`~QuantizationMethod.select` returns for one load: ``selection``
    (the load's selection with the extra tensors added), ``extra_slices()`` (extra tensor name ->
    ``(dim, start, stop)`` of a tensor-parallel rank's part), ``extra_dtypes()`` (extra tensor ->
    the dtype it is read in), ``check(infos)`` (raise a CheckpointError naming a tensor whose
    stored dtype or shape, from the headers, the method cannot read: before any data is read)
    and ``process_weights_after_loading(weights, dtype_of)`` (in place, as each shard's tensors
    arrive: turn what was read into what the model receives, dropping the extra tensors).
    ``rtpcore.checkpoint.quantized.ScaledTensors`` is fp8's."""

    @property
    def selection(self) -> WeightSelection: ...

    def extra_slices(self) -> dict[str, tuple[int, int, int]]: ...

    def extra_dtypes(self) -> dict[str, str]: ...

    def check(self, infos: Mapping[str, Any]) -> None: ...

    def process_weights_after_loading(
        self, weights: dict[str, torch.Tensor], dtype_of: Callable[[str], torch.dtype | None]
    ) -> None: ...


class QuantizationMethod(abc.ABC):
    """The base of every quantization method (the ``quantization_methods`` seam).

    ``name`` is matched against ``quantization_config.quant_method`` and selected by
    ``--quantization``; ``api_version`` is the seam's version the class was written for;
    ``replaces`` built-in methods it takes over; ``kernel`` what ``Linear.kernel`` says for a
    layer it builds (its ``name`` when it does not say).
    """

    name: ClassVar[str]
    api_version: ClassVar[str] = "1.0"
    replaces: ClassVar[tuple[str, ...]] = ()
    kernel: ClassVar[str | None] = None
    #: The GGML types (lower-case) whose 2-D tensors a GGUF checkpoint's loader hands this method
    #: in their blocks (``rtpcore.checkpoint.gguf.blocks.GGUFBlocks``); none: every tensor as floats.
    gguf_types: ClassVar[tuple[str, ...]] = ()

    @classmethod
    @abc.abstractmethod
    def from_config(cls, quantization_config: Mapping[str, Any] | None) -> QuantizationMethod:
        """The method for a checkpoint whose ``config.json`` has this ``quantization_config``
        (None: it has none -- a method that quantizes float checkpoints at load accepts that).
        A value it cannot honour is a CheckpointError naming the field and the value."""

    @classmethod
    def device_problem(cls, device_type: str) -> str | None:
        """Why the method cannot run on a device of ``device_type`` (None: it can)."""
        return None

    def select(self, selection: WeightSelection, names: Collection[str],
               slices: Mapping[str, tuple[int, int, int]] | None = None) -> QuantizedTensors | None:
        """The extra tensors to read with ``selection`` from a checkpoint holding ``names``
        (``slices`` as given to the loader, by pattern), or None: nothing besides the weights,
        which reach the model as stored (converted to the model's dtype)."""
        return None

    def create_weights(self, layer: Any, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Give ``layer`` (an ``rtpcore.layers.Linear`` being built from the float ``weight``
        (out, in) and ``bias``) its weights in this method's form -- register its buffers on it
        -- and return True; :meth:`apply` then computes it. False (the default): the layer keeps
        rtpcore's float kernels."""
        return False

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        """``layer``'s output for ``x`` (..., in) -> (..., out), for a layer :meth:`create_weights`
        built."""
        raise NotImplementedError(f"quantization method {self.name!r} builds no layer of its own")

    @classmethod
    def seam_problems(cls) -> list[str]:
        """The seam's rules beyond the common ones (``rtpcore.plugins.seams``)."""
        from_config = cls.__dict__.get("from_config")
        if from_config is not None and not isinstance(from_config, classmethod):
            return ["from_config must be a classmethod"]
        return []

    def __repr__(self) -> str:
        return f"<quantization method {self.name!r} ({type(self).__module__}.{type(self).__qualname__})>"


class Fp8Method(QuantizationMethod):
    """``fp8``: block-quantized fp8 weights (``float8_e4m3fn``, one ``_scale_inv`` per block of
    ``weight_block_size``), read with their scales and dequantized at load into the model's
    dtype (``rtpcore.checkpoint.quantized``); the layers compute in that dtype. ``config`` is the
    checked ``quantization_config``."""

    name = "fp8"

    def __init__(self, config: Fp8BlockQuantization):
        self.config = config

    @classmethod
    def from_config(cls, quantization_config: Mapping[str, Any] | None) -> QuantizationMethod:
        if quantization_config is None:
            raise CheckpointError(
                f"quantization method {cls.name!r} reads fp8 block-quantized checkpoints, and this checkpoint's "
                "config.json has no quantization_config"
            )
        # The fields are fp8's whatever name the checkpoint gave the method (a subclass's).
        parsed = Fp8BlockQuantization.from_hf({"quantization_config": {**quantization_config, "quant_method": "fp8"}})
        assert parsed is not None
        return cls(parsed)

    def select(self, selection: WeightSelection, names: Collection[str],
               slices: Mapping[str, tuple[int, int, int]] | None = None) -> QuantizedTensors | None:
        return self.config.select(selection, names, slices)


class Int8Method(QuantizationMethod):
    """``int8``: weight-only int8, quantized at load (the checkpoint stays float, or fp8: then
    dequantized first, as :class:`Fp8Method` does). Each ``Linear`` stores its weight as int8
    with one scale per output channel (``amax / 127`` of that row, rounded to nearest) and
    multiplies with rtpcore_native's int8 kernels for float32 inputs and with torch's
    int8-weight CPU kernel for bf16/fp16 inputs. A weight element is off by at most half a step
    (``amax / 254`` of its row). The native kernels: below ``INT8_QUANTIZED_ROWS`` rows (decode
    of a few sequences) the activations are quantized to int8 per block of 32 as llama.cpp's
    Q8_0 product does and meet the weights in integer dot products (VNNI where the CPU has it),
    each activation off by at most ``max|x_block| / 254`` besides; from it on (prefill, larger
    batches) the weight is widened to float32 in registers and the products summed in float32,
    except from ``rtpcore_native._kernels.gemm_rows()`` rows on (16, with VNNI or AVX2), where
    the activations are quantized again and the weights, repacked, meet them in a byte-dot-product
    GEMM, 2-3x the float kernel (tolerances: tests/test_native_decode.py ``int8_bound``, tests/test_int8.py). On the CPU."""

    name = "int8"
    kernel = "int8"

    def __init__(self, load: QuantizationMethod | None = None):
        self.load = load  # what reads the checkpoint first (fp8), or None: float weights

    @classmethod
    def from_config(cls, quantization_config: Mapping[str, Any] | None) -> QuantizationMethod:
        if quantization_config is None:
            return cls()
        declared = quantization_config.get("quant_method") if isinstance(quantization_config, Mapping) else None
        if declared == "fp8":
            return cls(Fp8Method.from_config(quantization_config))
        if declared == "gguf":  # a GGUF file read as floats (dequantized at load), then quantized to int8
            return cls()
        raise CheckpointError(
            f"quantization method {cls.name!r} quantizes float or fp8 checkpoints at load, and this checkpoint's "
            f"config.json quantization_config.quant_method is {declared!r}"
        )

    @classmethod
    def device_problem(cls, device_type: str) -> str | None:
        if device_type != "cpu":
            return (f"{cls.name!r} runs on the CPU only (rtpcore's and torch's int8-weight CPU kernels); this engine "
                    f"runs on {device_type}")
        return None

    def select(self, selection: WeightSelection, names: Collection[str],
               slices: Mapping[str, tuple[int, int, int]] | None = None) -> QuantizedTensors | None:
        return None if self.load is None else self.load.select(selection, names, slices)

    def create_weights(self, layer: Any, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        import torch

        if weight.device.type != "cpu" or not callable(getattr(torch, "_weight_int8pack_mm", None)):
            raise ValueError(
                f"int8 weight-only quantization runs on the CPU with torch's int8-weight kernel; "
                f"this weight is on {weight.device} (torch {torch.__version__})"
            )
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0  # (out,)
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        layer.register_buffer("weight", q, persistent=False)
        layer.register_buffer("scales", scale.to(weight.dtype), persistent=False)  # in the input's dtype
        layer.register_buffer("bias", bias, persistent=False)
        # The native kernel's operands (float32 activations): scales and bias in float32.
        layer.register_buffer("scales_f32", scale.contiguous(), persistent=False)
        layer.register_buffer("bias_f32", None if bias is None else bias.float().contiguous(), persistent=False)
        layer.refresh_native_weights()
        return True

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        import torch

        rows = x.reshape(-1, layer.in_features).contiguous()
        native = layer.native_weights
        if native is not None and rows.dtype == torch.float32 and rows.shape[0] > 0:
            y = torch.empty(rows.shape[0], layer.out_features, dtype=torch.float32)
            layer.native_linear(native, rows, y)
            return y.reshape(*x.shape[:-1], layer.out_features)
        y = torch._weight_int8pack_mm(rows, layer.weight, layer.scales)
        if layer.bias is not None:
            y = y + layer.bias
        return y.reshape(*x.shape[:-1], layer.out_features)


class GgufMethod(QuantizationMethod):
    """``gguf``: a GGUF checkpoint's weights kept in their blocks, from the file to the kernel
    (docs/design.md §20). The loader hands every 2-D tensor of a type in :attr:`gguf_types`
    (Q8_0, Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, F16) to the model as a
    ``rtpcore.checkpoint.gguf.blocks.GGUFBlocks`` -- the file's bytes, Q/K rows un-permuted --
    and each ``Linear`` built from one keeps the bytes (``rtpcore.checkpoint.gguf.linear``); a token
    embedding in blocks dequantizes the rows it looks up. F32 and BF16 tensors are floats as
    stored; other quantized types are dequantized at load, with a warning. The products run in
    rtpcore_native's GGUF kernels (activations quantized per block, as llama.cpp does), or,
    in a build without them, on the weights dequantized per call (exact, slow). On the CPU.

    The method of every GGUF checkpoint unless ``--quantization`` names another (``none``:
    floats, every weight dequantized at load); asked for on any other checkpoint, a
    CheckpointError."""

    name = "gguf"
    kernel = "gguf"
    gguf_types: ClassVar[tuple[str, ...]] = ("q8_0", "q4_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "f16")

    @classmethod
    def from_config(cls, quantization_config: Mapping[str, Any] | None) -> QuantizationMethod:
        declared = quantization_config.get("quant_method") if isinstance(quantization_config, Mapping) else None
        if declared != "gguf":
            what = ("its config.json has no quantization_config" if quantization_config is None
                    else f"its config.json quantization_config.quant_method is {declared!r}")
            raise CheckpointError(
                f"quantization method {cls.name!r} multiplies the weights of a GGUF checkpoint (a .gguf file, a split "
                f"set or a folder holding one) in their blocks; this checkpoint is not one ({what})"
            )
        return cls()

    @classmethod
    def device_problem(cls, device_type: str) -> str | None:
        if device_type != "cpu":
            return f"{cls.name!r} multiplies GGUF blocks on the CPU only; this engine runs on {device_type}"
        return None

    def create_weights(self, layer: Any, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        from rtpcore.checkpoint.gguf.blocks import GGUFBlocks

        if not isinstance(weight, GGUFBlocks):  # F32/BF16 in the file, or a plugin's float tensor
            return False
        from rtpcore.checkpoint.gguf.linear import attach

        attach(layer, weight, bias)
        return True

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        from rtpcore.checkpoint.gguf.linear import forward

        return forward(layer, x)


#: What a GGUF checkpoint declares, as a config.json's quantization_config would.
_GGUF_CONFIG: Mapping[str, Any] = {"quant_method": "gguf"}


def quantization_method(
    hf_config: Mapping[str, Any],
    classes: Mapping[str, type[QuantizationMethod]],
    *,
    requested: str | None = None,
    what: str = "quantization",
    gguf: bool = False,
) -> QuantizationMethod | None:
    """The engine's quantization method for a checkpoint with this ``config.json``, among the
    registered ``classes`` (name -> class): ``requested`` (``--quantization``; ``what`` spells
    the option in messages) when given (``"none"``: None, float weights), else the one
    ``quantization_config.quant_method`` names, else None. A GGUF checkpoint (``gguf=True``)
    declares ``{"quant_method": "gguf"}``: the ``gguf`` method unless ``requested`` names
    another. An unknown ``requested`` is an RtpcoreError listing the known methods; an unknown
    ``quant_method`` a CheckpointError naming it, the known methods and the installed plugins
    that declare it (entry-point group ``rtpcore.quantization_methods``)."""
    if requested == NO_QUANTIZATION:
        return None
    if gguf:
        hf_config = {**hf_config, "quantization_config": _GGUF_CONFIG}
    config = hf_config.get("quantization_config") if "quantization_config" in hf_config else None
    if "quantization_config" in hf_config and not isinstance(config, Mapping):
        raise CheckpointError(
            f"config.json quantization_config {config!r} must be an object with 'quant_method' "
            f"(known: {', '.join(sorted(classes))})"
        )
    if requested is not None:
        cls = classes.get(requested)
        if cls is None:
            raise RtpcoreError(
                f"{what}={requested!r} is not a quantization method here; known: {', '.join(sorted(classes))} "
                f"or {NO_QUANTIZATION!r} (a plugin adds more with rtpcore_register_quantization_methods)"
            )
        return cls.from_config(config)
    if config is None:
        return None
    if "quant_method" not in config:
        raise CheckpointError(
            f"config.json quantization_config lacks 'quant_method'; known: {', '.join(sorted(classes))}"
        )
    method = config["quant_method"]
    cls = classes.get(method) if isinstance(method, str) else None
    if cls is None:
        from rtpcore.plugins.discovery import quantization_hints

        hints = quantization_hints(method) if isinstance(method, str) else []
        hint = f"; installed and declaring it: {'; '.join(hints)}" if hints else ""
        raise CheckpointError(
            f"config.json quantization_config.quant_method {method!r} is not a quantization method here; known: "
            f"{', '.join(sorted(classes))}{hint}"
        )
    return cls.from_config(config)

"""Block-quantized fp8 checkpoints (DeepSeek-V3/R1's format), dequantized at load.

``config.json`` declares the format::

    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                            "activation_scheme": "dynamic", "fmt": "e4m3"}

A quantized tensor ``W`` of shape (out, in) is stored as ``float8_e4m3fn`` next to
``<name>_scale_inv``, one scale per (bo, bi) block, of shape
(ceil(out / bo), ceil(in / bi)); blocks at the bottom and right edges are partial.
Its value is ``W.float() * scale_inv[r // bo, c // bi]`` at element (r, c)::

    quantization = Fp8BlockQuantization.from_hf(hf_config)       # None when not quantized
    weights = load_checkpoint(path, patterns, ranges, dtype=torch.bfloat16,
                              quantization=quantization)          # already dequantized

**Which tensors are quantized**: exactly those the checkpoint stores with a
``_scale_inv`` companion (real checkpoints quantize the linear projections and keep
norms, embeddings, ``lm_head`` and the MoE router in a float format). The loader
reads the companion of every wanted tensor that has one, and no other, so the
shards it opens are still only those holding wanted tensors. Before any tensor data
is read, the headers must show that each such tensor is a 2-D ``float8_e4m3fn``
tensor with a scale of the block-grid shape, and that no wanted tensor is stored as
fp8 without a scale; each violation is a :class:`~rtpcore.errors.CheckpointError`
naming the tensor. The model then receives the dequantized tensors in the engine
dtype (a pattern's ``dtypes`` entry wins; float32 when no dtype is given) and never
sees the scales.

**Tensor parallelism**: a sliced weight (``slices=``) reads the scale rows or
columns of the blocks its slice touches, and the slice's offset into its first
block is taken into account, so a rank's slice need not be block-aligned.

``activation_scheme`` matters only to fp8 matmul kernels; dequantized weights run
through the ordinary ones. Any other ``quant_method`` is refused, naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

from attrs import frozen

from rtpcore.checkpoint.patterns import PatternTable, WeightSelection
from rtpcore.errors import CheckpointError

if TYPE_CHECKING:
    import torch

    from rtpcore.checkpoint.index import TensorInfo

__all__ = [
    "SCALE_SUFFIX",
    "Fp8BlockQuantization",
    "ScaledTensors",
    "dequantize_fp8_blocks",
    "quantize_fp8_blocks",
]

SCALE_SUFFIX = "_scale_inv"
_QUANTIZED_DTYPE = "float8_e4m3fn"
_SCALE_DTYPES = ("float32", "bfloat16", "float16")
_ACTIVATION_SCHEMES = ("dynamic", "static")
_FORMATS = ("e4m3",)
_SHOWN = 5

Slice = tuple[int, int, int]


def _config_error(field: str, value: Any, rule: str) -> CheckpointError:
    return CheckpointError(f"config.json quantization_config.{field} {value!r} {rule}")


def _is_count(value: object) -> bool:
    return type(value) is int and value > 0


@frozen
class Fp8BlockQuantization:
    """A validated ``quantization_config`` of ``quant_method`` ``"fp8"``.

    ``block_size`` is ``weight_block_size``: (rows, columns) of one scale block.
    """

    block_size: tuple[int, int]
    activation_scheme: str = "dynamic"
    fmt: str = "e4m3"

    @classmethod
    def from_hf(cls, hf_config: Mapping[str, Any]) -> Fp8BlockQuantization | None:
        """The quantization a parsed ``config.json`` declares; None when it has no
        ``quantization_config``. A config this loader cannot honour is a
        :class:`CheckpointError` naming the field and its value."""
        if "quantization_config" not in hf_config:
            return None
        q = hf_config["quantization_config"]
        if not isinstance(q, Mapping):
            raise CheckpointError(
                f"config.json quantization_config {q!r} must be an object with 'quant_method' "
                "(supported: 'fp8')"
            )
        if "quant_method" not in q:
            raise CheckpointError(
                "config.json quantization_config lacks 'quant_method'; supported: 'fp8'"
            )
        method = q["quant_method"]
        if method != "fp8":
            raise _config_error(
                "quant_method", method, "is not supported; supported: 'fp8' (block-wise scales)"
            )
        if "weight_block_size" not in q:
            raise CheckpointError(
                "config.json quantization_config lacks 'weight_block_size' (e.g. [128, 128]), "
                "required for quant_method 'fp8'"
            )
        block = q["weight_block_size"]
        if not (isinstance(block, list | tuple) and len(block) == 2 and all(map(_is_count, block))):
            raise _config_error(
                "weight_block_size",
                block,
                "must be a list of two positive integers, e.g. [128, 128]",
            )
        scheme = q.get("activation_scheme", "dynamic")
        if scheme not in _ACTIVATION_SCHEMES:
            raise _config_error(
                "activation_scheme", scheme, f"is not supported; supported: {_ACTIVATION_SCHEMES!r}"
            )
        fmt = q.get("fmt", "e4m3")
        if fmt not in _FORMATS:
            raise _config_error("fmt", fmt, f"is not supported; supported: {_FORMATS!r}")
        return cls(block_size=(block[0], block[1]), activation_scheme=scheme, fmt=fmt)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The scale grid of a 2-D weight of ``shape``: partial edge blocks count."""
        (rows, cols), (bo, bi) = shape, self.block_size
        return (-(-rows // bo), -(-cols // bi))

    def select(
        self,
        selection: WeightSelection,
        names: Collection[str],
        slices: Mapping[str, Slice] | None = None,
    ) -> ScaledTensors:
        """The scales to read with ``selection`` from a checkpoint holding ``names``:
        the companion of every wanted tensor that has one (``slices`` as given to the
        loader, by pattern)."""
        lookup = PatternTable(slices)
        scales: dict[str, str] = {}
        weight_slices: dict[str, Slice] = {}
        for name in names:
            scale = name + SCALE_SUFFIX
            if scale in names and selection.wants(name):
                scales[name] = scale
                spec = lookup.get(name)
                if spec is not None:
                    weight_slices[name] = spec
        extended = WeightSelection(
            required=selection.required | frozenset(scales.values()), optional=selection.optional
        )
        return ScaledTensors(self, extended, scales, weight_slices)


@frozen
class ScaledTensors:
    """One load's quantized tensors: ``scales`` maps each to its scale's name.

    ``selection`` is the load's selection plus the scales; ``weight_slices`` holds
    the slices of the sliced quantized tensors.
    """

    quantization: Fp8BlockQuantization
    selection: WeightSelection
    scales: Mapping[str, str]
    weight_slices: Mapping[str, Slice]

    def scale_slices(self) -> dict[str, Slice]:
        """Scale name -> the slice of the blocks its weight's slice touches."""
        out: dict[str, Slice] = {}
        for name, spec in self.weight_slices.items():
            try:
                dim, start, stop = spec
                block = self.quantization.block_size[dim]
            except (TypeError, ValueError, IndexError):
                continue  # a malformed slice is reported for the weight itself
            out[self.scales[name]] = (dim, start // block, -(-stop // block))
        return out

    def scale_dtypes(self) -> dict[str, str]:
        """Scales are read in float32, whatever the engine dtype."""
        return dict.fromkeys(self.scales.values(), "float32")

    # The names of the load protocol of a quantization method (rtpcore.quantization.QuantizedTensors).
    def extra_slices(self) -> dict[str, Slice]:
        return self.scale_slices()

    def extra_dtypes(self) -> dict[str, str]:
        return self.scale_dtypes()

    def check(self, infos: Mapping[str, TensorInfo]) -> None:
        """Validate dtypes and shapes from the headers of the tensors to be read."""
        problems: list[str] = []
        for name, scale in self.scales.items():
            w, s = infos[name], infos[scale]
            if w.torch_dtype_name != _QUANTIZED_DTYPE or len(w.shape) != 2:
                problems.append(
                    f"tensor {name!r} has a scale {scale!r} but is stored as {w.torch_dtype_name} "
                    f"of shape {list(w.shape)}; a quantized weight is a 2-D {_QUANTIZED_DTYPE} tensor"
                )
                continue
            want = self.quantization.scale_shape(w.shape)
            if s.shape != want:
                problems.append(
                    f"scale tensor {scale!r} has shape {list(s.shape)}, expected {list(want)} for "
                    f"weight {name!r} of shape {list(w.shape)} in blocks of "
                    f"{list(self.quantization.block_size)}"
                )
            elif s.torch_dtype_name not in _SCALE_DTYPES:
                problems.append(
                    f"scale tensor {scale!r} is stored as {s.torch_dtype_name}; "
                    f"supported: {', '.join(_SCALE_DTYPES)}"
                )
        unscaled = sorted(
            n
            for n, i in infos.items()
            if i.torch_dtype_name == _QUANTIZED_DTYPE and n not in self.scales
        )
        problems += [
            f"tensor {n!r} is stored as {_QUANTIZED_DTYPE} but its scale tensor "
            f"{n + SCALE_SUFFIX!r} is missing from the checkpoint"
            for n in unscaled
        ]
        if problems:
            more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
            raise CheckpointError(
                f"fp8 block-quantized checkpoint: {'; '.join(problems[:_SHOWN])}{more}"
            )

    def process_weights_after_loading(
        self, weights: dict[str, torch.Tensor], dtype_of: Callable[[str], torch.dtype | None]
    ) -> None:
        """:meth:`dequantize`, under the name of the quantization methods' load protocol."""
        self.dequantize(weights, dtype_of)

    def dequantize(
        self, weights: dict[str, torch.Tensor], dtype_of: Callable[[str], torch.dtype | None]
    ) -> None:
        """Replace, in place, every quantized tensor of ``weights`` whose scale is
        loaded too by its dequantized value in ``dtype_of(name)`` (float32 for None),
        and drop the scale."""
        import torch

        for name, scale in self.scales.items():
            if name not in weights or scale not in weights:
                continue
            offset = [0, 0]
            if name in self.weight_slices:
                dim, start, _ = self.weight_slices[name]
                offset[dim] = start % self.quantization.block_size[dim]
            weights[name] = dequantize_fp8_blocks(
                weights[name],
                weights.pop(scale),
                self.quantization.block_size,
                offset=(offset[0], offset[1]),
                dtype=dtype_of(name) or torch.float32,
            )


def dequantize_fp8_blocks(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: tuple[int, int],
    *,
    offset: tuple[int, int] = (0, 0),
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``weight`` (R, C) times its per-block ``scale_inv``, as ``dtype`` (float32 by default).

    ``scale_inv`` holds one scale per ``block_size`` block of the blocks ``weight``
    touches; ``offset`` is where ``weight`` starts inside its first block (non-zero
    for a tensor-parallel slice that is not block-aligned). The product is formed in
    float32, then converted once.
    """
    import torch

    bo, bi = block_size
    rows, cols = weight.shape
    r0, c0 = offset
    n_rows, n_cols = scale_inv.shape
    if not (0 <= r0 < bo and 0 <= c0 < bi):
        raise ValueError(f"offset {offset!r} must lie inside one block of {list(block_size)}")
    if (n_rows, n_cols) != (-(-(r0 + rows) // bo), -(-(c0 + cols) // bi)):
        raise ValueError(
            f"scale_inv of shape {list(scale_inv.shape)} does not cover a weight of shape "
            f"{[rows, cols]} at offset {list(offset)} in blocks of {list(block_size)}"
        )
    per_row = scale_inv.to(torch.float32).repeat_interleave(bo, dim=0)[r0 : r0 + rows]  # (R, C/bi)
    if c0 == 0 and cols == n_cols * bi:
        out = weight.to(torch.float32)  # (R, C)
    else:  # partial blocks: pad the columns to whole blocks, scale, crop
        out = torch.zeros(rows, n_cols * bi, dtype=torch.float32, device=weight.device)
        out[:, c0 : c0 + cols] = weight
    out.view(rows, n_cols, bi).mul_(per_row.unsqueeze(-1))  # (R, C/bi, bi)
    out = out[:, c0 : c0 + cols]
    return out.to(dtype or torch.float32).contiguous()


def quantize_fp8_blocks(weight: torch.Tensor, block_size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, as DeepSeek-V3's checkpoints store weights: (R, C) float -> (float8_e4m3fn
    (R, C), float32 ``scale_inv`` (ceil(R/bo), ceil(C/bi))), each block scaled so that its
    largest magnitude becomes e4m3's largest finite value (448). For writing test
    checkpoints and converting weights; the engine only reads this format."""
    import torch

    (rows, cols), (bo, bi) = weight.shape, block_size
    nr, nc = -(-rows // bo), -(-cols // bi)
    padded = torch.zeros(nr * bo, nc * bi)  # partial edge blocks padded with zeros
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(nr, bo, nc, bi)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0  # (nr, nc)
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(nr * bo, nc * bi)
    return q[:rows, :cols].contiguous(), scale

"""Load the tensors a model needs from a GGUF checkpoint, and nothing else.

``load_gguf`` is what :func:`rtpcore.checkpoint.load_checkpoint` runs for a GGUF checkpoint,
with the same selection rules (weight patterns, placeholder ranges, expected shapes, slices,
dtypes) applied to the checkpoint names that ``tensor_names`` (GGUF name -> checkpoint name,
a plugin's ``gguf_tensor_names``) gives the file's tensors; a GGUF tensor no entry renames
keeps its GGUF name. Only the wanted tensors' bytes are read from the file mapping.

Each wanted tensor is turned into a float ``torch.Tensor`` by :func:`tensor_from_gguf`: F32,
F16 and BF16 are copied as stored; every quantized type is dequantized with
``gguf.quants.dequantize`` (one warning per load names the types and the memory the float
copies take). The rows llama.cpp's converter permuted are put back. The quantized kernels of
docs/design.md §20 replace the dequantization for the types they multiply: they read
:meth:`~rtpcore.checkpoint.gguf.reader.GGUFTensor.raw` blocks instead, through the same
selection.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rtpcore.checkpoint.gguf.config import GGUFTensorName
from rtpcore.checkpoint.gguf.reader import GGUFCheckpoint, GGUFTensor, _fail
from rtpcore.checkpoint.patterns import PatternTable
from rtpcore.errors import CheckpointError, MissingTensorsError

if TYPE_CHECKING:
    import torch

__all__ = ["load_gguf", "renamed_tensors", "tensor_from_gguf"]

logger = logging.getLogger(__name__)

_FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})


def renamed_tensors(
    checkpoint: GGUFCheckpoint, tensor_names: Mapping[str, str | GGUFTensorName] | None
) -> dict[str, tuple[GGUFTensor, int | None]]:
    """Checkpoint name -> (the GGUF tensor, its permuted heads or None) for every tensor of
    the file: renamed by ``tensor_names``, else under its GGUF name."""
    out: dict[str, tuple[GGUFTensor, int | None]] = {}
    for gguf_name, tensor in checkpoint.tensors.items():
        target = (tensor_names or {}).get(gguf_name, gguf_name)
        name, heads = (target.name, target.permuted_heads) if isinstance(target, GGUFTensorName) else (target, None)
        if name in out:
            raise _fail(checkpoint.path, f"tensors {out[name][0].name!r} and {gguf_name!r} both map to {name!r}", name)
        out[name] = (tensor, heads)
    return out


def tensor_from_gguf(tensor: GGUFTensor, permuted_heads: int | None = None) -> torch.Tensor:
    """``tensor`` as a float32 (or, stored so, float16/bfloat16) torch tensor that owns its
    memory, dequantized when quantized, with llama.cpp's Q/K row permutation undone when
    ``permuted_heads`` is given."""
    import numpy as np
    import torch

    raw = tensor.raw()
    if tensor.type_name == "BF16":  # numpy has no bfloat16: the reader gives the raw bytes
        t = torch.from_numpy(np.ascontiguousarray(raw).view(np.int16).copy()).view(torch.bfloat16)
        t = t.reshape(tensor.shape)
    elif tensor.type_name in _FLOAT_TYPES:
        t = torch.from_numpy(np.array(raw, copy=True)).reshape(tensor.shape)
    else:
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        try:
            values = dequantize(raw, GGMLQuantizationType(tensor.ggml_type))
        except NotImplementedError:
            raise _fail(tensor.file, f"tensor {tensor.name!r}: the gguf package cannot dequantize "
                        f"{tensor.type_name}", tensor.name) from None
        t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(tensor.shape)
    if permuted_heads is not None:
        t = _unpermute(t, permuted_heads, tensor)
    return t


def _unpermute(t: torch.Tensor, heads: int, tensor: GGUFTensor) -> torch.Tensor:
    """Undo ``LlamaModel.permute`` of llama.cpp's converter: rows ``(heads, 2, d/2)`` were
    written as ``(heads, d/2, 2)``."""
    rows = t.shape[0]
    if heads <= 0 or rows % (2 * heads):
        raise _fail(tensor.file, f"tensor {tensor.name!r}: {rows} rows are not {heads} heads of rotary pairs",
                    tensor.name)
    rest = tuple(t.shape[1:])
    return t.reshape(heads, rows // heads // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest).contiguous()


def load_gguf(
    checkpoint: GGUFCheckpoint,
    selection: Any,
    *,
    tensor_names: Mapping[str, str | GGUFTensorName] | None = None,
    dtype: torch.dtype | None = None,
    expected_shapes: Mapping[str, Sequence[int]] | None = None,
    device: Any = "cpu",
    slices: Mapping[str, tuple[int, int, int]] | None = None,
    dtypes: Mapping[str, Any] | None = None,
) -> tuple[dict[str, torch.Tensor], int]:
    """The tensors ``selection`` (a :class:`~rtpcore.checkpoint.patterns.WeightSelection` over
    checkpoint names) wants, converted, and the stored bytes read. Required names the file
    lacks are a :class:`MissingTensorsError`; shapes are checked before any data is read."""
    named = renamed_tensors(checkpoint, tensor_names)
    wanted = [name for name in named if selection.wants(name)]
    missing = sorted(selection.required.difference(named))
    if missing:
        gguf_of = {(v.name if isinstance(v, GGUFTensorName) else v): k for k, v in (tensor_names or {}).items()}
        shown = ", ".join(f"{gguf_of.get(m, m)!r}" + (f" ({m!r})" if m in gguf_of else "") for m in missing[:10])
        more = f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""
        raise MissingTensorsError(
            f"GGUF file {str(checkpoint.path)!r}: {len(missing)} required tensor(s) are missing: {shown}{more}",
            missing=missing,
            path=checkpoint.path,
        )
    _check_shapes(checkpoint, named, wanted, PatternTable(expected_shapes))
    slice_of, dtype_of = PatternTable(slices), PatternTable(dtypes)
    _warn_dequantized(checkpoint, [named[n][0] for n in wanted])
    out: dict[str, torch.Tensor] = {}
    nbytes = 0
    for name in wanted:
        tensor, heads = named[name]
        t = tensor_from_gguf(tensor, heads)
        nbytes += tensor.nbytes
        spec = slice_of.get(name)
        if spec is not None:
            t = _slice(t, spec, name, checkpoint).contiguous()
        target = dtype_of.get(name) or dtype
        if target is not None:
            t = t.to(_torch_dtype(target))
        if str(device) != "cpu":
            t = t.to(device)
        out[name] = t
    return out, nbytes


def _check_shapes(
    checkpoint: GGUFCheckpoint, named: Mapping[str, tuple[GGUFTensor, int | None]], wanted: Iterable[str],
    shapes: PatternTable,
) -> None:
    bad, first = [], None
    for name in wanted:
        want = shapes.get(name)
        tensor = named[name][0]
        if want is not None and tuple(want) != tensor.shape:
            first = first or tensor.name
            bad.append(f"{name!r} ({tensor.name!r}) expected {list(want)}, got {list(tensor.shape)}")
    if bad:
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise CheckpointError(f"GGUF file {str(checkpoint.path)!r}: tensor shape mismatch: {'; '.join(bad[:5])}{more}",
                              path=checkpoint.path, key=first)


def _slice(t: torch.Tensor, spec: Any, name: str, checkpoint: GGUFCheckpoint) -> torch.Tensor:
    dim, start, stop = spec
    if not (0 <= dim < t.dim() and 0 <= start <= stop <= t.shape[dim]):
        raise CheckpointError(f"GGUF file {str(checkpoint.path)!r}: slice (dim={dim}, {start}:{stop}) does not fit "
                              f"tensor {name!r} of shape {list(t.shape)}", path=checkpoint.path, key=name)
    return t.narrow(dim, start, stop - start)


def _torch_dtype(value: Any) -> torch.dtype:
    import torch

    if isinstance(value, torch.dtype):
        return value
    found = getattr(torch, str(value), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"dtype {value!r} is not a torch dtype name")
    return found


def _warn_dequantized(checkpoint: GGUFCheckpoint, tensors: Sequence[GGUFTensor]) -> None:
    """One warning naming the quantized types dequantized at load and what it costs."""
    quantized = [t for t in tensors if t.is_quantized]
    if not quantized:
        return
    stored = sum(t.nbytes for t in quantized)
    floats = sum(4 * _count(t.shape) for t in quantized)
    kinds = sorted({t.type_name for t in quantized})
    logger.warning(
        "%s: %d quantized tensor(s) (%s) are dequantized to float32 at load: %.1f MB in memory instead of "
        "%.1f MB in the file (no quantized GGUF kernels yet)",
        checkpoint.path, len(quantized), ", ".join(kinds), floats / 1e6, stored / 1e6,
    )


def _count(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n

"""Load the tensors a model needs from a GGUF checkpoint, and nothing else.

``load_gguf`` is what :func:`rtpcore.checkpoint.load_checkpoint` runs for a GGUF checkpoint,
with the same selection rules (weight patterns, placeholder ranges, expected shapes, slices,
dtypes) applied to the checkpoint names that ``tensor_names`` (GGUF name -> checkpoint name,
a plugin's ``gguf_tensor_names``) gives the file's tensors; a GGUF tensor no entry renames
keeps its GGUF name. Only the wanted tensors' bytes are read from the file mapping.

Each wanted tensor is turned into a float ``torch.Tensor`` by :func:`tensor_from_gguf`: F32,
F16 and BF16 are copied as stored; every quantized type is dequantized with
``gguf.quants.dequantize`` (one warning per load names the types and the memory the float
copies take). The rows llama.cpp's converter permuted are put back.

``block_types`` (what the ``gguf`` quantization method multiplies, ``GgufMethod.gguf_types``:
the engine passes it through ``load_checkpoint(..., quantization=method)``) keeps the 2-D
tensors of those GGML types in their blocks instead (:func:`blocks_from_gguf`): a
:class:`~rtpcore.checkpoint.gguf.blocks.GGUFBlocks` of the tensor's shape holding the file's
bytes as uint8 ``(rows, row bytes)``. Every other tensor is read as above; a caller that passes
no ``block_types`` gets float tensors, as before.

Weights kept in blocks are not copied: they view the read-only file mapping
(``GGUFCheckpoint.mapped_rows``), so loading them reads nothing (the first forward pages them
in from the page cache) and they cost file-backed pages, shared with every other process
mapping the file, not the process's own memory. Where the stored rows cannot be used as they
are, one copy is made, when the model first needs the rows (``GGUFBlocks.parts``), straight from
the mapping: the Q/K rows llama.cpp's converter permuted are pieces of the mapping in the
original order (each a strided view, a row is whole blocks), and a fused projection
(``torch.cat`` of q, k and v) joins them into one fresh buffer; a fused projection of tensors the
file stores back to back (gate then up) stays a view. Once the model is built,
:func:`release_unread_pages` unmaps the file pages only such copies read: they would stay
resident beside the copies for as long as the mapping lives. Float tensors (norms, biases, an F32 or
BF16 file's weights) stored in the dtype the model wants view a copy-on-write mapping of the
file instead (``GGUFCheckpoint.mapped_floats``): a model may write its float weights in place,
and such a write makes a private copy of the page it touches; converted or permuted, they are
copied.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rtpcore.checkpoint.gguf.config import GGUFTensorName
from rtpcore.checkpoint.gguf.reader import (
    GGUFCheckpoint,
    GGUFTensor,
    _fail,
    release_gguf_files,
    release_unviewed_pages,
)
from rtpcore.checkpoint.patterns import PatternTable
from rtpcore.errors import CheckpointError, MissingTensorsError

if TYPE_CHECKING:
    import torch

    from rtpcore.checkpoint.gguf.blocks import GGUFBlocks

__all__ = ["blocks_from_gguf", "load_gguf", "release_unread_pages", "renamed_tensors", "tensor_from_gguf"]

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


def tensor_from_gguf(tensor: GGUFTensor, permuted_heads: int | None = None,
                     checkpoint: GGUFCheckpoint | None = None) -> torch.Tensor:
    """``tensor`` as a float32 (or, stored so, float16/bfloat16) torch tensor, dequantized when
    quantized, with llama.cpp's Q/K row permutation undone when ``permuted_heads`` is given. A
    float tensor of the ``checkpoint`` it comes from, not permuted, views a copy-on-write
    mapping of the file (``GGUFCheckpoint.mapped_floats``); anything else owns its memory."""
    import numpy as np
    import torch

    if checkpoint is not None and permuted_heads is None and tensor.type_name in ("F32", "F16", "BF16"):
        return checkpoint.mapped_floats(tensor)
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


def blocks_from_gguf(tensor: GGUFTensor, permuted_heads: int | None = None, dtype: torch.dtype | None = None,
                     checkpoint: GGUFCheckpoint | None = None) -> GGUFBlocks:
    """``tensor`` (2-D, of a type in ``GGUF_BLOCK_TYPES``) kept in its blocks: a
    :class:`GGUFBlocks` of its shape and ``dtype`` (float32 when None) over its stored bytes as
    uint8 ``(rows, row bytes)``, llama.cpp's Q/K row permutation undone when ``permuted_heads``
    is given (the same rows :func:`tensor_from_gguf` moves). With the ``checkpoint`` it comes
    from, the bytes are views of the file mapping (its permuted rows as strided pieces, joined
    into one buffer when first used); without, a copy."""
    import numpy as np
    import torch

    from rtpcore.checkpoint.gguf.blocks import GGUFBlocks

    rows, cols = tensor.shape
    if checkpoint is None:
        data = torch.from_numpy(np.ascontiguousarray(tensor.raw()).view(np.uint8).reshape(rows, -1).copy())
    else:
        data = checkpoint.mapped_rows(tensor)  # (rows, row bytes), no copy
    kind = tensor.type_name.lower()
    if permuted_heads is None:
        return GGUFBlocks([(kind, data)], cols, dtype or torch.float32)
    _check_heads(rows, permuted_heads, tensor)
    # Rows (heads, d/2, 2) as stored; each head's first rotary half is every other row from 0,
    # its second every other row from 1: 2 * heads strided pieces in the original order.
    stored = data.view(permuted_heads, rows // permuted_heads // 2, 2, data.shape[1])
    pieces = [(kind, stored[h, :, half]) for h in range(permuted_heads) for half in (0, 1)]
    return GGUFBlocks(pieces, cols, dtype or torch.float32)


def _check_heads(rows: int, heads: int, tensor: GGUFTensor) -> None:
    if heads <= 0 or rows % (2 * heads):
        raise _fail(tensor.file, f"tensor {tensor.name!r}: {rows} rows are not {heads} heads of rotary pairs",
                    tensor.name)


def _unpermute(t: torch.Tensor, heads: int, tensor: GGUFTensor) -> torch.Tensor:
    """Undo ``LlamaModel.permute`` of llama.cpp's converter: rows ``(heads, 2, d/2)`` were
    written as ``(heads, d/2, 2)``."""
    rows = t.shape[0]
    _check_heads(rows, heads, tensor)
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
    block_types: Collection[str] = (),
) -> tuple[dict[str, torch.Tensor], int]:
    """The tensors ``selection`` (a :class:`~rtpcore.checkpoint.patterns.WeightSelection` over
    checkpoint names) wants, converted, and the stored bytes read. Required names the file
    lacks are a :class:`MissingTensorsError`; shapes are checked before any data is read.
    2-D tensors of the GGML types in ``block_types`` (lower-case) stay in their blocks
    (:func:`blocks_from_gguf`); a slice of one across its rows that does not fall on block
    edges is dequantized."""
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
    kept = {n for n in wanted if _kept(named[n][0], slice_of.get(n), block_types)}
    _warn_dequantized(checkpoint, [named[n][0] for n in wanted if n not in kept])
    out: dict[str, torch.Tensor] = {}
    nbytes = 0
    for name in wanted:
        tensor, heads = named[name]
        target = dtype_of.get(name) or dtype
        nbytes += tensor.nbytes
        spec = slice_of.get(name)
        if name in kept:
            blocks = blocks_from_gguf(tensor, heads, None if target is None else _torch_dtype(target), checkpoint)
            if spec is not None:
                blocks = _slice_blocks(blocks, spec, name, checkpoint)
            out[name] = blocks if str(device) == "cpu" else blocks.to(device)
            continue
        t = tensor_from_gguf(tensor, heads, checkpoint)
        if spec is not None:
            t = _slice(t, spec, name, checkpoint).contiguous()
        if target is not None:
            t = t.to(_torch_dtype(target))  # the view itself when stored in the target dtype
        if str(device) != "cpu":
            t = t.to(device)
        out[name] = t
    # The checkpoint is let go: weights kept in blocks hold the mapping through their views, and
    # pages read for float copies (an F32 or BF16 file's weights) would otherwise count resident
    # for as long as it stayed open. The tokenizer's reading opens the file again (headers only).
    release_gguf_files()
    return out, nbytes


def release_unread_pages(model: Any) -> int:
    """After a model is built from a GGUF file: give back the file pages only the weights it
    copied read (:func:`~rtpcore.checkpoint.gguf.reader.release_unviewed_pages`), keeping every
    page its parameters, buffers and tensor attributes view (a GGUF weight in blocks: each of
    its pieces and parts). Returns the bytes released."""
    import torch

    from rtpcore.checkpoint.gguf.blocks import GGUFBlocks

    live: list[torch.Tensor] = []
    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    for module in modules:
        found = [*module.parameters(recurse=False), *module.buffers(recurse=False),
                 *(v for v in vars(module).values() if isinstance(v, torch.Tensor))]
        for t in found:
            if isinstance(t, GGUFBlocks):
                live.extend(t.storage_views())
            else:
                live.append(t)
    released = release_unviewed_pages(live)
    if released:
        logger.debug("released %.1f MB of GGUF file pages only copied weights read", released / 1e6)
    return released


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


def _kept(tensor: GGUFTensor, spec: Any, block_types: Collection[str]) -> bool:
    """Whether ``tensor`` (sliced by ``spec``) stays in its blocks."""
    kind = tensor.type_name.lower()
    if kind not in block_types or len(tensor.shape) != 2:
        return False
    if spec is None or spec[0] in (0, -2):
        return True
    from rtpcore.checkpoint.gguf.blocks import _block_size

    block = _block_size(kind)[0]
    return spec[1] % block == 0 and spec[2] % block == 0  # columns on block edges


def _slice_blocks(t: GGUFBlocks, spec: Any, name: str, checkpoint: GGUFCheckpoint) -> GGUFBlocks:
    """A slice of a weight kept in blocks: rows, or columns on block edges (:func:`_kept`)."""
    from rtpcore.checkpoint.gguf.blocks import GGUFBlocks, _block_size, row_bytes

    dim, start, stop = spec
    if not (-2 <= dim < 2 and 0 <= start <= stop <= t.shape[dim]):
        raise CheckpointError(f"GGUF file {str(checkpoint.path)!r}: slice (dim={dim}, {start}:{stop}) does not fit "
                              f"tensor {name!r} of shape {list(t.shape)}", path=checkpoint.path, key=name)
    if dim in (0, -2):
        return t[start:stop]  # type: ignore[return-value]
    [(kind, data)] = t.parts
    block, size = _block_size(kind)
    part = data[:, start // block * size: stop // block * size].contiguous()
    assert part.shape[1] == row_bytes(kind, stop - start)
    return GGUFBlocks([(kind, part)], stop - start, t.dtype)


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
        "%.1f MB in the file (the gguf quantization method keeps Q8_0, Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K and F16 "
        "in their blocks)",
        checkpoint.path, len(quantized), ", ".join(kinds), floats / 1e6, stored / 1e6,
    )


def _count(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n

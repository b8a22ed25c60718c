"""GGUF weights kept in their blocks: :class:`GGUFBlocks`, a (out, in) tensor that stores rows of blocks.

The loader hands a model each 2-D tensor whose GGML type the ``gguf`` quantization method
multiplies (:data:`GGUF_BLOCK_TYPES`) as a :class:`GGUFBlocks` instead of a float tensor: a
torch tensor of the weight's logical shape ``(out, in)`` and the model's float dtype that holds
no float data, only the file's bytes -- ``parts``, each ``(type name, uint8 (rows, row bytes))``
(one part, except where a model concatenated rows of different types, as a fused qkv of a
Q4_K_M file whose v rows are Q6_K). A model builds itself from it with the operations it uses
on float weights, each kept on the bytes:

* ``.to(dtype)`` changes the logical dtype only, ``.to(device)`` moves the bytes;
* ``torch.cat`` along the rows concatenates byte rows (rows of one type join into one part);
* slicing rows (``narrow``, ``w[a:b]``) slices byte rows;
* ``nn.Parameter(w)``, ``detach``, ``register_buffer`` keep it as it is;
* ``F.embedding(ids, w)`` dequantizes the rows looked up (a quantized token embedding, tied to
  the head or not, stays quantized);
* ``rtpcore.layers.Linear(w)`` inside the ``gguf`` method's ``weight_quantization`` block takes
  the bytes (``rtpcore.quantization.GgufMethod``).

The bytes are views of the file mapping where the loader could keep them so
(``rtpcore.checkpoint.gguf.weights``): a ``GGUFBlocks`` holds its rows as *pieces*, each a uint8
``(rows, row bytes)`` tensor whose rows may be strided (the Q/K rows llama.cpp's converter
permuted, read in their original order), and joins the pieces of one type into a part -- a
contiguous tensor -- only when ``parts`` is first asked for: pieces stored back to back in one
storage join into one view, any others are copied once into a fresh buffer. Concatenating and
slicing work on the pieces, so a fused projection of permuted rows is copied once, from the
mapping into its buffer. Nothing here writes to the bytes.

Any other operation dequantizes the whole weight first (logged once per operation, with the
memory the float copy takes) and runs on the float tensor, so a model that does something else
with a weight is still correct.

Dequantization runs in ``rtpcore_native._kernels`` where the build has the GGUF kernels
(:func:`gguf_native`), else with the ``gguf`` package's reference dequantizers (numpy, slow but
exact). Both give the values ``gguf.quants.dequantize`` gives.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["GGUF_BLOCK_TYPES", "GGUFBlocks", "dequantize_rows", "gguf_native", "row_bytes"]

logger = logging.getLogger(__name__)

#: The GGML types kept in their blocks (lower-case, as rtpcore_native names them).
GGUF_BLOCK_TYPES = ("q8_0", "q4_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "f16")

_aten = torch.ops.aten


def gguf_native() -> Any:
    """``rtpcore_native._kernels`` when it has the GGUF kernels (``gguf_dtypes``), else None:
    the one place that decides between the native kernels and the reference path."""
    try:
        from rtpcore_native import _kernels
    except ImportError:
        return None
    return _kernels if hasattr(_kernels, "gguf_dtypes") else None


@functools.cache
def _block_size(dtype: str) -> tuple[int, int]:
    """(weights per block, bytes per block) of GGML type ``dtype``."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    if dtype not in GGUF_BLOCK_TYPES:
        raise ValueError(f"GGUF type {dtype!r} is not kept in blocks; known: {', '.join(GGUF_BLOCK_TYPES)}")
    return GGML_QUANT_SIZES[GGMLQuantizationType[dtype.upper()]]


def row_bytes(dtype: str, in_features: int) -> int:
    """The bytes one row of ``in_features`` weights takes in GGML type ``dtype``; a width that
    is not whole blocks is a ValueError."""
    block, size = _block_size(dtype)
    if in_features % block:
        raise ValueError(f"a row of {in_features} is not whole {dtype} blocks of {block}")
    return in_features // block * size


def dequantize_rows(dtype: str, blocks: torch.Tensor, in_features: int,
                    rows: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weights (n, ``in_features``) of ``rows`` (int64 ids; None: all) of ``blocks``
    (uint8 (N, row bytes) of GGML type ``dtype``)."""
    if blocks.device.type != "cpu":
        return dequantize_rows(dtype, blocks.cpu(), in_features, None if rows is None else rows.cpu()).to(
            blocks.device)
    native = gguf_native()
    if native is not None:
        ids = (torch.arange(blocks.shape[0]) if rows is None else rows).to(torch.int64).contiguous()
        out = torch.empty(ids.shape[0], in_features, dtype=torch.float32)
        src = blocks.contiguous()
        native.gguf_dequantize_rows(dtype, src.data_ptr(), in_features, ids.data_ptr(), ids.shape[0], out.data_ptr())
        return out
    import numpy as np
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    picked = blocks if rows is None else blocks[rows.to(torch.int64)]
    values = dequantize(picked.contiguous().numpy(), GGMLQuantizationType[dtype.upper()])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(-1, in_features)


class GGUFBlocks(torch.Tensor):
    """A (out, in) weight of a float ``dtype`` stored as GGUF blocks (see the module doc).

    ``parts``: ``(type name, uint8 (rows, row bytes))`` pairs, top rows first, each contiguous;
    built from the pieces given (whose rows may be strided) on first use.
    """

    _pieces: tuple[tuple[str, torch.Tensor], ...]
    _parts: tuple[tuple[str, torch.Tensor], ...] | None

    @staticmethod
    def __new__(cls, parts: Sequence[tuple[str, torch.Tensor]], in_features: int,
                dtype: torch.dtype = torch.float32) -> GGUFBlocks:
        pieces = tuple((kind, data) for kind, data in parts if data.shape[0] != 0)
        if not pieces:
            raise ValueError("GGUFBlocks needs at least one part")
        for kind, data in pieces:
            want = row_bytes(kind, in_features)
            if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != want or data.stride(1) != 1:
                raise ValueError(f"a {kind} part of width {in_features} is uint8 (rows, {want}), each row "
                                 f"contiguous; got {data.dtype} {tuple(data.shape)} strides {data.stride()}")
        out_features = sum(int(d.shape[0]) for _, d in pieces)
        t = torch.Tensor._make_wrapper_subclass(
            cls, (out_features, in_features), dtype=dtype, device=pieces[0][1].device, requires_grad=False)
        t._pieces = pieces
        t._parts = None
        return t

    @property
    def parts(self) -> tuple[tuple[str, torch.Tensor], ...]:
        """``(type name, uint8 (rows, row bytes))`` per run of rows of one type, each contiguous:
        the pieces joined (a view where they lie back to back, else one copy), once."""
        if self._parts is None:
            self._parts = _joined(self._pieces)
        return self._parts

    def storage_views(self) -> tuple[torch.Tensor, ...]:
        """The plain tensors holding this weight's bytes: the pieces it was built from and, once
        joined, its parts (a GGUFBlocks has no storage of its own)."""
        return tuple(d for _, d in (*self._pieces, *(self._parts or ())))

    @property
    def gguf_types(self) -> tuple[str, ...]:
        """The GGML type of each part."""
        kinds: list[str] = []
        for kind, _ in self._pieces:
            if not kinds or kinds[-1] != kind:
                kinds.append(kind)
        return tuple(kinds)

    @property
    def stored_bytes(self) -> int:
        """The bytes the blocks take (what the weight costs in memory)."""
        return sum(d.shape[0] * d.shape[1] for _, d in self._pieces)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weights as a plain tensor of this tensor's dtype: every row, or ``rows`` (int64 ids)."""
        k = self.shape[1]
        if rows is None:
            out = torch.cat([dequantize_rows(kind, d, k) for kind, d in self.parts])
            return out.to(self.dtype)
        if len(self.parts) == 1:
            kind, d = self.parts[0]
            return dequantize_rows(kind, d, k, rows.reshape(-1)).reshape(*rows.shape, k).to(self.dtype)
        flat = rows.reshape(-1).to(torch.int64)
        out = torch.empty(flat.shape[0], k, dtype=torch.float32, device=flat.device)
        start = 0
        for kind, d in self.parts:
            mine = (flat >= start) & (flat < start + d.shape[0])
            if mine.any():
                out[mine] = dequantize_rows(kind, d, k, flat[mine] - start)
            start += d.shape[0]
        return out.reshape(*rows.shape, k).to(self.dtype)

    def __repr__(self) -> str:  # type: ignore[override]
        kinds = "+".join(self.gguf_types)
        return f"GGUFBlocks({kinds}, shape={tuple(self.shape)}, dtype={self.dtype}, bytes={self.stored_bytes})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (_rebuild, (self.parts, self.shape[1], self.dtype))

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # The operations a model builds with are answered here, before torch's dispatcher: its first
        # call into a Python subclass's __torch_dispatch__ imports torch.distributed.tensor (about a
        # second). Everything else takes the dispatcher (__torch_dispatch__ below), results unwrapped.
        kwargs = kwargs or {}
        handler = _FUNCTIONS.get(func)
        if handler is not None:
            out = handler(*args, **kwargs)
            if out is not NotImplemented:
                return out
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            out = handler(*args, **kwargs)
            if out is not NotImplemented:
                return out
        _warn_dequantized(func, args)
        return func(*_dense(args), **_dense(kwargs))


def _rebuild(parts: Any, in_features: int, dtype: torch.dtype) -> GGUFBlocks:
    return GGUFBlocks(parts, in_features, dtype)


def _joined(pieces: Sequence[tuple[str, torch.Tensor]]) -> tuple[tuple[str, torch.Tensor], ...]:
    """Adjacent pieces of one type joined into one contiguous part (a fused projection of one
    type is one part): a view when they lie back to back in one storage, else one copy."""
    runs: list[tuple[str, list[torch.Tensor]]] = []
    for kind, data in pieces:
        if runs and runs[-1][0] == kind:
            runs[-1][1].append(data)
        else:
            runs.append((kind, [data]))
    return tuple((kind, _join(ds)) for kind, ds in runs)


def _join(pieces: list[torch.Tensor]) -> torch.Tensor:
    first = pieces[0]
    if all(p.is_contiguous() for p in pieces):
        if len(pieces) == 1:
            return first
        storage = first.untyped_storage().data_ptr()
        end = first.data_ptr() + first.numel()
        for p in pieces[1:]:
            if p.untyped_storage().data_ptr() != storage or p.data_ptr() != end:
                break
            end += p.numel()
        else:  # back to back: one view of the storage spanning them
            return first.as_strided((sum(p.shape[0] for p in pieces), first.shape[1]), (first.shape[1], 1))
    return torch.cat(pieces) if len(pieces) > 1 else first.contiguous()


def _dense(value: Any) -> Any:
    if isinstance(value, GGUFBlocks):
        return value.dequantize()
    if isinstance(value, list | tuple):
        return type(value)(_dense(v) for v in value)
    if isinstance(value, dict):
        return {k: _dense(v) for k, v in value.items()}
    return value


_WARNED: set[str] = set()


def _warn_dequantized(func: Any, args: Any) -> None:
    name = str(func)
    if name in _WARNED:
        return
    _WARNED.add(name)
    found = [a for a in (args[0] if args and isinstance(args[0], list | tuple) else args) if isinstance(a, GGUFBlocks)]
    size = sum(4 * a.numel() for a in found)
    logger.warning("%s on a GGUF weight kept in blocks dequantizes it first (%.1f MB of floats); keep weights "
                   "in blocks with rtpcore.layers.Linear and F.embedding", name, size / 1e6)


def _same(t: GGUFBlocks, pieces: Any = None, dtype: torch.dtype | None = None) -> GGUFBlocks:
    out = GGUFBlocks(t._pieces if pieces is None else pieces, t.shape[1], t.dtype if dtype is None else dtype)
    if pieces is None:
        out._parts = t._parts  # the same rows: their parts, once joined, are shared
    return out


def _alias(t: GGUFBlocks, *_: Any, **__: Any) -> Any:
    return _same(t)


def _to_copy(t: GGUFBlocks, *, dtype: torch.dtype | None = None, device: Any = None, **_: Any) -> Any:
    if dtype is not None and not dtype.is_floating_point:
        return NotImplemented  # an integer view of float weights: dequantize
    if device is None or torch.device(device) == t.device:
        return _same(t, None, dtype)
    return _same(t, tuple((kind, d.to(device)) for kind, d in t.parts), dtype)


def _cat(tensors: Sequence[Any], dim: int = 0) -> Any:
    if dim not in (0, -2) or not all(isinstance(x, GGUFBlocks) for x in tensors):
        return NotImplemented
    first = tensors[0]
    if any(x.shape[1] != first.shape[1] or x.dtype != first.dtype for x in tensors):
        return NotImplemented
    return _same(first, [p for x in tensors for p in x._pieces])


def _rows(t: GGUFBlocks, start: int, stop: int) -> GGUFBlocks:
    parts, at = [], 0
    for kind, d in t._pieces:
        lo, hi = max(start - at, 0), min(stop - at, d.shape[0])
        if lo < hi:
            parts.append((kind, d[lo:hi]))
        at += d.shape[0]
    return _same(t, parts)


def _slice(t: GGUFBlocks, dim: int = 0, start: int | None = None, end: int | None = None, step: int = 1) -> Any:
    if dim not in (0, -2) or step != 1:
        return NotImplemented
    n = t.shape[0]
    lo, hi = slice(start, end).indices(n)[:2]
    if hi <= lo:
        return NotImplemented
    return _rows(t, lo, hi)


def _embedding(weight: Any, indices: torch.Tensor, *_: Any, **__: Any) -> Any:
    if not isinstance(weight, GGUFBlocks):
        return NotImplemented
    return weight.dequantize(indices)


_HANDLERS: dict[Any, Any] = {
    _aten.detach.default: _alias,
    _aten.alias.default: _alias,
    _aten.clone.default: _alias,  # the bytes are never written: sharing them is a clone
    _aten._to_copy.default: _to_copy,
    _aten.cat.default: _cat,
    _aten.slice.Tensor: _slice,
    _aten.embedding.default: _embedding,
}


# The same operations as torch functions and methods (GGUFBlocks.__torch_function__).


def _f_alias(t: Any, *_: Any, **__: Any) -> Any:
    return _same(t) if isinstance(t, GGUFBlocks) else NotImplemented


def _f_requires_grad(t: Any, requires_grad: bool = True) -> Any:
    return t if isinstance(t, GGUFBlocks) and not requires_grad else NotImplemented


def _f_to(t: Any, *args: Any, **kwargs: Any) -> Any:
    """``Tensor.to(dtype)``, ``to(device)``, ``to(device, dtype)``, ``to(other)`` and keywords."""
    if not isinstance(t, GGUFBlocks) or set(kwargs) - {"dtype", "device", "non_blocking", "copy", "memory_format"}:
        return NotImplemented
    dtype, device = kwargs.get("dtype"), kwargs.get("device")
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, str | torch.device | int) and not isinstance(a, bool):
            device = a
        elif isinstance(a, torch.Tensor):
            dtype, device = a.dtype, a.device
        else:
            return NotImplemented
    return _to_copy(t, dtype=dtype, device=device)


def _f_float(t: Any, *_: Any, **__: Any) -> Any:
    return _to_copy(t, dtype=torch.float32) if isinstance(t, GGUFBlocks) else NotImplemented


def _f_cat(tensors: Any, dim: int = 0, *, axis: int | None = None, out: Any = None) -> Any:
    if out is not None or not isinstance(tensors, list | tuple) or not tensors:
        return NotImplemented
    return _cat(tensors, dim if axis is None else axis)


def _f_getitem(t: Any, index: Any) -> Any:
    if not isinstance(t, GGUFBlocks) or not isinstance(index, slice):
        return NotImplemented
    if not all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in (index.start, index.stop)):
        return NotImplemented
    return _slice(t, 0, index.start, index.stop, 1 if index.step is None else index.step)


def _f_narrow(t: Any, dim: int, start: Any, length: int) -> Any:
    if not isinstance(t, GGUFBlocks) or not isinstance(start, int):
        return NotImplemented
    return _slice(t, dim, start, start + length)


def _f_embedding(indices: Any, weight: Any, padding_idx: Any = None, max_norm: Any = None, *_: Any,
                 **__: Any) -> Any:
    if not isinstance(weight, GGUFBlocks) or isinstance(indices, GGUFBlocks) or max_norm is not None:
        return NotImplemented
    return weight.dequantize(indices)


_FUNCTIONS: dict[Any, Any] = {
    torch.Tensor.detach: _f_alias,
    torch.Tensor.clone: _f_alias,
    torch.Tensor.contiguous: _f_alias,
    torch.Tensor.requires_grad_: _f_requires_grad,
    torch.Tensor.to: _f_to,
    torch.Tensor.float: _f_float,
    torch.cat: _f_cat,
    torch.concat: _f_cat,
    torch.concatenate: _f_cat,
    torch.Tensor.__getitem__: _f_getitem,
    torch.Tensor.narrow: _f_narrow,
    torch.nn.functional.embedding: _f_embedding,
}

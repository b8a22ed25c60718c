"""bf16 weights in the blocked layout of rtpcore_native's bf16 kernels, and a tied embedding read from it.

On a CPU with bf16 dot products (AVX512-BF16, AMX-BF16) a bf16 ``Linear`` keeps its weight once,
in the layout its kernels read (``"bfloat16_packed"``, :func:`pack_bf16`): blocks of 16 output
rows, each as pairs of inputs -- what vdpbf16ps multiplies with one broadcast pair of activations
and what AMX loads as B tiles. A model whose head is tied to its token embedding would hold the
same matrix twice (the embedding's rows, the head's blocks); :class:`BlockedRows` lets the
embedding look its rows up in the head's blocks instead, so the matrix is held once.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["BlockedRows", "pack_bf16", "unpack_bf16"]

logger = logging.getLogger(__name__)
_aten = torch.ops.aten


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (N, K) bf16 in the blocked layout (``"bfloat16_packed"``): padded with zeros to
    (Np, Kp), Np a multiple of 16 and Kp of 32, then (Np / 16, Kp / 2, 16, 2): blocks of 16
    output rows, each as Kp / 2 rows of the pairs (w[n][2p], w[n][2p + 1]) of its 16 rows."""
    n, k = weight.shape
    np_, kp = -(-n // 16) * 16, -(-k // 32) * 32
    padded = F.pad(weight, (0, kp - k, 0, np_ - n)) if (np_, kp) != (n, k) else weight
    return padded.reshape(np_ // 16, 16, kp // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_bf16(packed: torch.Tensor, n: int, k: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The (n, k) weight of a :func:`pack_bf16` layout, or its ``rows`` (int64 ids, any shape:
    (..., k)), as a new plain tensor."""
    if rows is None:
        blocks, pairs = packed.shape[:2]
        return packed.permute(0, 2, 1, 3).reshape(blocks * 16, pairs * 2)[:n, :k].contiguous()
    ids = rows.reshape(-1).to(torch.int64)
    out = packed[ids // 16, :, ids % 16, :]  # (T, Kp / 2, 2)
    return out.reshape(ids.shape[0], -1)[:, :k].reshape(*rows.shape, k)


class BlockedRows(torch.Tensor):
    """A (V, E) embedding table that is a tied head's blocked bf16 weight (:func:`pack_bf16`).

    ``F.embedding(ids, t)`` gathers the rows looked up from the blocks; ``.detach()``,
    ``nn.Parameter(t)`` and ``register_buffer`` keep it as it is; any other operation unpacks the
    whole table first (logged once per operation, with the memory it takes) and runs on the copy.
    ``packed`` is the head's weight tensor itself (no copy).
    """

    packed: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, packed: torch.Tensor, rows: int, width: int) -> BlockedRows:
        if packed.dtype != torch.bfloat16 or packed.dim() != 4 or packed.shape[2:] != (16, 2):
            raise ValueError(f"BlockedRows reads a pack_bf16 layout (blocks, pairs, 16, 2) bf16; got {packed.dtype} "
                             f"{tuple(packed.shape)}")
        if packed.shape[0] * 16 < rows or packed.shape[1] * 2 < width:
            raise ValueError(f"a blocked layout {tuple(packed.shape)} holds no ({rows}, {width}) table")
        t = torch.Tensor._make_wrapper_subclass(cls, (rows, width), dtype=torch.bfloat16, device=packed.device,
                                                requires_grad=False)
        t.packed = packed
        return t

    def dense(self) -> torch.Tensor:
        """The table as a plain (V, E) bf16 tensor (a copy)."""
        return unpack_bf16(self.packed, self.shape[0], self.shape[1])

    def __repr__(self) -> str:  # type: ignore[override]
        return f"BlockedRows(shape={tuple(self.shape)}, dtype={self.dtype}, blocks={tuple(self.packed.shape)})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (BlockedRows, (self.packed, self.shape[0], self.shape[1]))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        kwargs = kwargs or {}
        if func in (_aten.detach.default, _aten.alias.default):
            t = args[0]
            return BlockedRows(t.packed, t.shape[0], t.shape[1])
        if func is _aten.embedding.default and isinstance(args[0], BlockedRows):
            return unpack_bf16(args[0].packed, args[0].shape[0], args[0].shape[1], args[1])
        _warn_unpacked(func, args)
        return func(*_dense(args), **_dense(kwargs))


def _dense(value: Any) -> Any:
    if isinstance(value, BlockedRows):
        return value.dense()
    if isinstance(value, list | tuple):
        return type(value)(_dense(v) for v in value)
    if isinstance(value, dict):
        return {k: _dense(v) for k, v in value.items()}
    return value


_WARNED: set[str] = set()


def _warn_unpacked(func: Any, args: Any) -> None:
    name = str(func)
    if name in _WARNED:
        return
    _WARNED.add(name)
    size = sum(2 * a.numel() for a in args if isinstance(a, BlockedRows))
    logger.warning("%s on an embedding kept in its tied head's bf16 blocks unpacks it first (%.1f MB); look "
                   "rows up with F.embedding", name, size / 1e6)

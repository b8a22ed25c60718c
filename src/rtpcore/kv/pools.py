"""The paged KV cache: one preallocated pool per layer, addressed by slot.

A slot is ``block * tokens_per_block + offset``. Each layer's pool follows the
layer's ``rtpcore_native.KVCacheSpec``. A model writes its new keys/values with
``write`` and reads a padded view of every sequence's context with ``read``.

What "k" and "v" are follows the spec's partition:

* ``kind == "mha"``: k and v are (T, num_kv_heads, head_dim) keys and values.
* ``kind == "mla"``: k is the (T, kv_lora_rank) latent ("nope") and v the
  (T, rope_head_dim) rotary key part.

Two pool kinds share that interface (``write(slots, k, v)``,
``read(block_tables, max_len) -> (k, v)``, ``spec``, ``num_blocks``,
``tokens_per_block``):

* :class:`LayerKVCache`: fp32/fp16/bf16 specs, two typed tensors.
* :class:`PackedLayerKVCache`: ``fp8_e4m3`` specs (MHA or MLA, any layout), one
  uint8 tensor of (slots, ``bytes_per_token``) rows packed and unpacked by the
  spec's codec (``rtpcore.kv.codecs.make_codec``). ``read`` returns
  ``compute_dtype`` tensors.

:func:`allocate_kv_caches` picks the right kind for each spec.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "GatherWorkspace", "LayerKVCache", "PackedLayerKVCache", "allocate_kv_caches", "commit_pages", "kv_shapes",
    "slot_index", "zeroed",
]


class GatherWorkspace:
    """Output buffers that the pools of one engine reuse for their gathers (``read``).

    A fresh tensor per gather costs more than the copy on a CPU: the allocator hands large
    buffers back to the system, and every page of a new one faults on first touch (an
    80 MiB gather: 28 ms fresh, 6 ms into a reused buffer). A step reads one layer at a time
    and consumes what it read before the next read, so the layers share one buffer per part
    ("k", "v", "rows"), grown on demand. What ``read`` returns is valid until the next read
    of a pool sharing the workspace. One engine steps one forward at a time; never share a
    workspace between engines (or a target and a draft that run concurrently)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, part: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A flat buffer of at least ``numel`` elements of ``like``'s dtype and device."""
        buf = self._buffers.get(part)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._buffers[part] = buf
        return buf[:numel]


def kv_shapes(spec: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per-token shapes of the k and v parts of a spec (or a KVCacheSpecDesc)."""
    if spec.kind == "mha":
        return (spec.num_kv_heads, spec.head_dim), (spec.num_kv_heads, spec.head_dim)
    return (spec.kv_lora_rank,), (spec.rope_head_dim,)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.zeros(shape)``; on the CPU over an anonymous memory mapping, whose pages the OS
    zero-fills when first touched: a pool costs no time to allocate and resident memory only for
    the slots written (``torch.zeros`` writes every byte at once: a default CPU pool of several
    GB took tens of seconds to build and was resident from the start). Reads of slots never
    written see the kernel's zero page."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    memory = mmap.mmap(-1, nbytes)  # private, anonymous, page-aligned; unmapped with the tensor
    return torch.frombuffer(memory, dtype=dtype, count=numel).view(shape)


def commit_pages(caches: Sequence[Any]) -> int:
    """Commit every page of the CPU pools of ``caches`` (fresh from :func:`allocate_kv_caches`:
    nothing written yet) by writing a zero byte into each, as :func:`zeroed`'s first touch
    would; returns the bytes committed. Other devices' pools are skipped (``torch.zeros``
    wrote them).

    Why: a pool left to fault in page by page costs the step that first writes each page its
    fault, and with prefix caching every block of a pool is written once before a cached one is
    evicted for reuse (``rtpcore.engine.core.block_pool``: empty blocks first). On a 2-vCPU
    virtual machine (AMD EPYC) the first writes of a float32 SmolLM2-135M pool cost 0.68 ms per
    layer and 256-token chunk against 0.07 ms into committed pages: 2.3 of 43.6 s of 32 prompts
    of 1,000 tokens, 128 new each (docs/benchmarks.md). A server commits its pool at start (``kv_cache_prefault``), as
    llama.cpp clears its cache at start: memory the host cannot give fails there, not in the
    middle of serving (the engine refuses a pool larger than the available memory first:
    ``rtpcore.engine.worker.rank``)."""
    from concurrent.futures import ThreadPoolExecutor

    parts = [t for cache in caches
             for t in ((cache.rows,) if isinstance(cache, PackedLayerKVCache) else (cache.k, cache.v))
             if t.device.type == "cpu" and t.numel() > 0]
    flats = [t.view(-1).view(torch.uint8) for t in parts]  # contiguous pools: every page is in the view

    def touch(flat: torch.Tensor) -> None:
        flat[::mmap.PAGESIZE].zero_()  # one byte per page; torch releases the GIL

    # Pools in parallel, one per thread: the faults of one thread's pages are the cost (a
    # 100 MiB pool is too few elements for torch to split), and two threads fault about 3x
    # as fast as one on the machine above.
    with ThreadPoolExecutor(max(1, min(torch.get_num_threads(), len(flats)))) as pool:
        list(pool.map(touch, flats))
    return sum(f.numel() for f in flats)


class LayerKVCache:
    """One layer's pool of ``num_blocks`` blocks.

    This class stores unquantized caches (fp32/fp16/bf16) as two typed tensors
    of exactly the spec's k and v bytes.
    """

    def __init__(
        self, spec: Any, num_blocks: int, *, device: torch.device | str = "cpu", workspace: GatherWorkspace | None = None
    ):
        self.spec = spec
        self.workspace = workspace  # reused gather buffers (see GatherWorkspace), or None: fresh tensors
        # Who attends over this pool (rtpcore.attention.AttentionBackend, set by allocate_kv_caches;
        # None: the reference, rtpcore.attention.TorchAttentionBackend).
        self.attention_backend: Any = None
        self.num_blocks = num_blocks
        self.tokens_per_block = spec.tokens_per_block
        k_shape, v_shape = kv_shapes(spec)
        dtype = _TORCH_DTYPES[spec.dtype]
        n = num_blocks * spec.tokens_per_block
        # zeros, not empty: masked positions are multiplied by 0 and must be finite
        self.k = zeroed((n, *k_shape), dtype, device)  # (slots, *k_shape)
        self.v = zeroed((n, *v_shape), dtype, device)  # (slots, *v_shape)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' parts: slots (T,), k (T, *k_shape), v (T, *v_shape)."""
        self.k.index_copy_(0, slots, k.to(self.k.dtype))
        self.v.index_copy_(0, slots, v.to(self.v.dtype))

    def read(self, block_tables: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather every sequence's first ``max_len`` positions: (B, L, *k_shape), (B, L, *v_shape).

        Positions past a sequence's context hold stale (finite) data; mask them. With a
        ``workspace`` the results are valid until the next read of a pool sharing it.
        """
        ws = self.workspace
        return (
            gather_blocks(self.k, block_tables, max_len, self.tokens_per_block, None if ws is None else (ws, "k")),
            gather_blocks(self.v, block_tables, max_len, self.tokens_per_block, None if ws is None else (ws, "v")),
        )


class PackedLayerKVCache:
    """One layer's fp8 pool: (slots, bytes_per_token) uint8 rows in the spec's byte layout."""

    def __init__(
        self,
        spec: Any,
        num_blocks: int,
        *,
        device: torch.device | str = "cpu",
        compute_dtype: torch.dtype = torch.float32,
        codec: Any = None,
        workspace: GatherWorkspace | None = None,
    ):
        if codec is None:
            from rtpcore.kv.codecs import make_codec

            codec = make_codec(spec)
        self.spec = spec
        self.workspace = workspace
        self.attention_backend: Any = None  # as LayerKVCache's
        self.codec = codec
        self.num_blocks = num_blocks
        self.tokens_per_block = spec.tokens_per_block
        self.compute_dtype = compute_dtype
        self.k_shape, self.v_shape = kv_shapes(spec)
        n = num_blocks * spec.tokens_per_block
        self.rows = zeroed((n, spec.bytes_per_token), torch.uint8, device)  # (slots, bytes)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize and store: slots (T,), k (T, *k_shape), v (T, *v_shape).

        When packing raises the codec's per-tensor scale (``rtpcore.kv.codecs``), the
        rows already in the pool are brought to the new scale first."""
        old = getattr(self.codec, "scale", None)
        rows = self.codec.pack(k, v)
        if old is not None and getattr(self.codec, "scale", None) != old:
            self.codec.requantize(self.rows, old)
        self.rows.index_copy_(0, slots, rows)

    def read(self, block_tables: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantize every sequence's first ``max_len`` positions into ``compute_dtype``:
        (B, L, *k_shape), (B, L, *v_shape)."""
        ws = self.workspace
        rows = gather_blocks(self.rows, block_tables, max_len, self.tokens_per_block, None if ws is None else (ws, "rows"))  # (B, L, bytes)
        b, length = rows.shape[:2]
        k, v = self.codec.unpack(rows.reshape(b * length, -1), self.compute_dtype)
        return k.reshape(b, length, *self.k_shape), v.reshape(b, length, *self.v_shape)


def allocate_kv_caches(
    specs: Sequence[Any],
    num_blocks: int,
    *,
    device: torch.device | str = "cpu",
    compute_dtype: torch.dtype = torch.float32,
    layouts: Any = None,
    workspace: GatherWorkspace | None = None,
    attention_backends: Sequence[Any] | None = None,
) -> list[LayerKVCache | PackedLayerKVCache]:
    """One pool per spec: :class:`PackedLayerKVCache` for fp8 specs, else :class:`LayerKVCache`.

    ``attention_backends``: one ``rtpcore.attention.AttentionBackend`` per spec, attached to its
    pool (``pool.attention_backend``; the engine's per-layer choice), or None: the reference.

    ``layouts`` (the ModelRegistry) supplies the policy of a plugin-defined fp8
    layout, whose codec may be the policy's own (``policy.make_codec``). ``workspace``: the
    gather buffers the pools share (:class:`GatherWorkspace`; the engine passes one per model).
    """
    from rtpcore_native import BUILTIN_LAYOUTS

    caches: list[LayerKVCache | PackedLayerKVCache] = []
    for s in specs:
        if s.dtype != "fp8_e4m3":
            caches.append(LayerKVCache(s, num_blocks, device=device, workspace=workspace))
            continue
        from rtpcore.kv.codecs import make_codec

        custom = s.layout not in ("", *BUILTIN_LAYOUTS) and layouts is not None
        policy = layouts.get_layout(s.layout) if custom else None
        codec = make_codec(s, policy)
        caches.append(PackedLayerKVCache(
            s, num_blocks, device=device, compute_dtype=compute_dtype, codec=codec, workspace=workspace
        ))
    if attention_backends is not None:
        if len(attention_backends) != len(caches):
            raise ValueError(f"{len(attention_backends)} attention backends for {len(caches)} KV cache specs")
        for cache, backend in zip(caches, attention_backends, strict=True):
            cache.attention_backend = backend
    return caches


def gather_blocks(
    pool: torch.Tensor,
    block_tables: torch.Tensor,
    max_len: int,
    tokens_per_block: int,
    into: tuple[GatherWorkspace, str] | None = None,
) -> torch.Tensor:
    """(slots, *row) pool -> (B, max_len, *row): whole blocks are gathered, then trimmed;
    ``into``: (workspace, part), the buffer the blocks are gathered into."""
    nblocks = -(-max_len // tokens_per_block)
    b = block_tables.shape[0]
    ids = block_tables[:, :nblocks].reshape(-1)  # (B * nb,)
    blocks_view = pool.view(-1, tokens_per_block, *pool.shape[1:])  # (blocks, tpb, *row)
    # index_select, not pool[ids]: the same gather at a fraction of advanced indexing's overhead
    if into is None:
        blocks = torch.index_select(blocks_view, 0, ids)  # (B*nb, tpb, *row)
    else:
        workspace, part = into
        out = workspace.take(part, ids.numel() * blocks_view[0].numel(), pool)
        blocks = torch.index_select(blocks_view, 0, ids, out=out.view(ids.numel(), *blocks_view.shape[1:]))
    return blocks.view(b, nblocks * tokens_per_block, *pool.shape[1:])[:, :max_len]


def slot_index(block_tables: torch.Tensor, max_len: int, tokens_per_block: int) -> torch.Tensor:
    """(B, L) slot of each position 0..L-1 of each sequence."""
    pos = torch.arange(max_len, device=block_tables.device)
    blocks = block_tables[:, pos // tokens_per_block]  # (B, L)
    return blocks * tokens_per_block + pos % tokens_per_block


_TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

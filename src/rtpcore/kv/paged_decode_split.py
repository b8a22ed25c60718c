"""Split-context (flash-decoding) paged decode attention: Triton kernels for long contexts.

The per-block decode kernel of :mod:`rtpcore.kv.paged_attention` runs one program per
(sequence, KV head) and walks the context one KV block (often 16 tokens) at a time with
vector products: fine for a few hundred tokens, slow for thousands -- a batch of one has as
many programs as KV heads, and nothing runs on tensor cores. The kernels here:

* walk the context in tiles of ``tile`` positions (64 or 128; a tile gathers the rows of
  several KV blocks, each position looking its block up in the block table), scores and
  values through ``tl.dot`` -- in the pool's dtype with float32 accumulation for fp16/bf16
  pools, in IEEE float32 for fp32 pools (:func:`rtpcore.kv.triton_support.float32_dots`);
  the query heads of one KV head (GQA) are the rows of one program's dot, padded to 16;
* split each sequence's visible range (``context_len - window .. context_len - 1``, or all
  of it) into ``splits`` parts of whole tiles, one program each: part ``s`` of a sequence
  with ``n`` visible tiles covers tiles ``s * ceil(n / splits)`` onwards, so short
  sequences leave their last parts empty (those programs store an empty result and stop);
* combine the parts in a second kernel: each part's running maximum ``m``, softmax sum
  ``l`` and unnormalised output ``acc`` (float32) are rescaled by ``exp(m - max m)`` and
  summed, then divided (log-sum-exp). With one split the first kernel writes the output
  itself.

The grid depends only on host-side shapes (the batch size, the heads, ``splits``), never on
context lengths read from the device, so a CUDA graph captures a decode step once for any
context: :func:`decode_splits` sizes ``splits`` by the width of the block tables (what the
batch can address; under CUDA graphs fixed by ``max_positions``) and the number of
(sequence, KV head) programs.

:func:`split_decode_attention` (MHA/GQA, sliding windows) and :func:`split_mla_decode`
(absorbed MLA over a latent cache) share the combining kernel. Called through
:func:`rtpcore.kv.paged_attention.paged_decode_attention` / ``paged_mla_decode``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from rtpcore.kv.triton_support import float32_dots, launch_on, pow2

__all__ = [
    "LONG_CONTEXT", "MAX_SPLITS", "SPLIT_TOKENS", "TARGET_PROGRAMS", "decode_splits", "split_decode_attention",
    "split_mla_decode",
]

LONG_CONTEXT = 1024  # addressable positions from which MHA/GQA decode takes the tiled kernel
SPLIT_TOKENS = 256  # a split covers at least this many addressable positions
TARGET_PROGRAMS = 256  # about two programs per multiprocessor of a current data-centre GPU
MAX_SPLITS = 64


def decode_splits(num_seqs: int, programs_per_seq: int, addressable: int) -> int:
    """How many parts a decode step splits each sequence's context into.

    ``addressable``: the positions the block tables can address (their width times the
    block size; under CUDA graphs, ``max_positions`` rounded up to whole blocks);
    ``programs_per_seq``: the programs one part of a sequence already has (its KV heads;
    MLA: its groups of 16 heads). Enough parts to bring the grid to about
    ``TARGET_PROGRAMS`` programs, no part shorter than ``SPLIT_TOKENS`` addressable
    positions, at most ``MAX_SPLITS``, at least one. Host integers only: never a value read
    from the device per step.
    """
    fill = -(-TARGET_PROGRAMS // max(1, num_seqs * programs_per_seq))
    return max(1, min(fill, addressable // SPLIT_TOKENS, MAX_SPLITS))


def decode_tile(block_d: int) -> int:
    """Positions per tile of the MHA/GQA kernel: 128 for heads up to 64 wide, else 64."""
    return 128 if block_d <= 64 else 64


def split_decode_attention(
    q: torch.Tensor,  # (B, H, D)
    k_pool: torch.Tensor,  # (slots, Hkv, D)
    v_pool: torch.Tensor,  # (slots, Hkv, D)
    block_tables: torch.Tensor,  # (B, W) int
    context_lens: torch.Tensor,  # (B,) int, the new token included
    *,
    tokens_per_block: int,
    scale: float,
    window: int | None,
    splits: int,
    tile: int | None = None,
) -> torch.Tensor:
    """:func:`rtpcore.kv.paged_attention.paged_decode_attention` by the tiled kernel in
    ``splits`` parts (``tile`` positions per tile: None, :func:`decode_tile`). (B, H, D), q's dtype."""
    b, h, d = q.shape
    hkv = k_pool.shape[1]
    if h % hkv:
        raise ValueError(f"{h} query heads do not group over {hkv} KV heads")
    if k_pool.dtype != v_pool.dtype:
        raise ValueError(f"key pool {k_pool.dtype} and value pool {v_pool.dtype} differ")
    if splits < 1:
        raise ValueError(f"splits must be at least 1, got {splits}")
    g = h // hkv
    block_d = max(16, pow2(d))
    tile = tile or decode_tile(block_d)
    q = q.contiguous()
    out = torch.empty_like(q)
    if b == 0:
        return out
    acc, stats = _partials(b, h, splits, d, q.device)
    with launch_on(q.device):
        _mha_kernel()[(b, hkv, splits)](
            q, k_pool, v_pool, block_tables, context_lens, out, acc, stats,
            q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
            block_tables.stride(0), out.stride(0), out.stride(1),
            float(scale), int(window or 0),
            G=g, D=d, TPB=tokens_per_block, SPLITS=splits, F32=float32_dots(k_pool.dtype),
            BLOCK_G=max(16, pow2(g)), BLOCK_D=block_d, TILE=tile,
        )
        if splits > 1:
            _combine(acc, stats, out)
    return out


def split_mla_decode(
    q_latent: torch.Tensor,  # (B, H, r)
    q_rope: torch.Tensor,  # (B, H, R)
    latent_pool: torch.Tensor,  # (slots, r)
    rope_pool: torch.Tensor,  # (slots, R)
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    tokens_per_block: int,
    scale: float,
    splits: int,
    tile: int | None = None,
) -> torch.Tensor:
    """:func:`rtpcore.kv.paged_attention.paged_mla_decode` in ``splits`` parts, ``tile``
    positions per tile (None: 64, or 32 for latents wider than 256). (B, H, r) float32."""
    if splits < 1:
        raise ValueError(f"splits must be at least 1, got {splits}")
    b, h, r = q_latent.shape
    rope = q_rope.shape[-1]
    q_latent, q_rope = q_latent.contiguous(), q_rope.contiguous()
    out = torch.empty(b, h, r, dtype=torch.float32, device=q_latent.device)
    if b == 0:
        return out
    block_h, block_l = 16, max(16, pow2(r))
    tile = tile or (64 if block_l <= 256 else 32)
    acc, stats = _partials(b, h, splits, r, q_latent.device)
    with launch_on(q_latent.device):
        _mla_kernel()[(b, -(-h // block_h), splits)](
            q_latent, q_rope, latent_pool, rope_pool, block_tables, context_lens, out, acc, stats,
            q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
            latent_pool.stride(0), rope_pool.stride(0), block_tables.stride(0), out.stride(0), out.stride(1),
            float(scale), h,
            R_LAT=r, R_ROPE=rope, TPB=tokens_per_block, SPLITS=splits, F32=float32_dots(latent_pool.dtype),
            BLOCK_H=block_h, BLOCK_L=block_l, BLOCK_R=max(16, pow2(rope)), TILE=tile,
        )
        if splits > 1:
            _combine(acc, stats, out)
    return out


def _partials(b: int, h: int, splits: int, d: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each part's unnormalised output (B, H, S, D) and its (max, sum) (B, H, S, 2), float32;
    one-element placeholders when a single part writes the output itself."""
    if splits == 1:
        return torch.empty(1, device=device), torch.empty(1, device=device)
    return (
        torch.empty(b, h, splits, d, dtype=torch.float32, device=device),
        torch.empty(b, h, splits, 2, dtype=torch.float32, device=device),
    )


def _combine(acc: torch.Tensor, stats: torch.Tensor, out: torch.Tensor) -> None:
    """out (B, H, D) from the parts (second kernel, one program per (sequence, head))."""
    b, h, splits, d = acc.shape
    _combine_kernel()[(b, h)](
        acc, stats, out, out.stride(0), out.stride(1),
        SPLITS=splits, D=d, BLOCK_S=pow2(splits), BLOCK_D=pow2(d),
    )


@functools.cache
def _combine_kernel() -> Any:
    """The jitted kernels are defined on first use (importing this module never imports Triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def combine_kernel(
        acc_ptr, stats_ptr, out_ptr, stride_ob, stride_oh,
        SPLITS: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # the parts' (m, l, acc) in base 2: out = sum 2^(m - M) acc / sum 2^(m - M) l
        seq = tl.program_id(0)
        head = tl.program_id(1)
        nh = tl.num_programs(1)
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        s_ok = s < SPLITS
        row = (seq * nh + head) * SPLITS + s  # (S,) the parts of this (sequence, head)
        m = tl.load(stats_ptr + row * 2, mask=s_ok, other=float("-inf"))
        total = tl.load(stats_ptr + row * 2 + 1, mask=s_ok, other=0.0)
        acc = tl.load(acc_ptr + row[:, None] * D + d[None, :], mask=s_ok[:, None] & (d[None, :] < D), other=0.0)
        top = tl.max(m, axis=0)
        top = tl.where(top == float("-inf"), 0.0, top)
        w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - top))  # empty parts weigh nothing
        norm = tl.sum(w * total, axis=0)
        out = tl.sum(w[:, None] * acc, axis=0) / tl.where(norm > 0, norm, 1.0)
        tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < D)

    return combine_kernel


@functools.cache
def _mha_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def mha_kernel(
        q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, acc_ptr, stats_ptr,
        stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tb, stride_ob, stride_oh,
        scale, window,
        G: tl.constexpr, D: tl.constexpr, TPB: tl.constexpr, SPLITS: tl.constexpr, F32: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
    ):  # one program per (sequence, KV head, part): its G query heads are the rows of every dot
        seq = tl.program_id(0)
        kv = tl.program_id(1)
        part = tl.program_id(2)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        n = tl.arange(0, TILE)
        g_ok = g < G
        d_ok = d < D
        heads = kv * G + g
        q_mask = g_ok[:, None] & d_ok[None, :]
        q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
        q = q.to(tl.float32) if F32 else q.to(k_ptr.dtype.element_ty)  # (G, D)
        length = tl.load(lens_ptr + seq).to(tl.int32)
        start = tl.maximum(length - window, 0) if window > 0 else 0
        per_part = tl.cdiv(tl.cdiv(length - start, TILE), SPLITS) * TILE  # positions, whole tiles
        lo = start + part * per_part
        hi = tl.minimum(lo + per_part, length)  # lo >= hi: an empty part
        qk_scale = scale * 1.4426950408889634  # exp2 below
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for first in range(lo, hi, TILE):
            pos = first + n  # (N,) positions of this tile, across KV blocks
            visible = pos < hi
            block = tl.load(tables_ptr + seq * stride_tb + pos // TPB, mask=visible, other=0).to(tl.int64)
            slots = block * TPB + pos % TPB
            kv_mask = visible[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + slots[:, None] * stride_ks + kv * stride_kh + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + slots[:, None] * stride_vs + kv * stride_vh + d[None, :], mask=kv_mask, other=0.0)
            if F32:
                scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(visible[None, :], scores * qk_scale, float("-inf"))  # (G, N)
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(scores - m_new[:, None])  # (G, N)
            total = total * alpha + tl.sum(p, axis=1)
            if F32:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        if SPLITS == 1:
            out = acc / tl.where(total > 0, total, 1.0)[:, None]
            tl.store(
                out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
                out.to(out_ptr.dtype.element_ty), mask=q_mask,
            )
        else:
            row = (seq * (tl.num_programs(1) * G) + heads) * SPLITS + part  # (G,) into (B, H, S, ...)
            tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=q_mask)
            tl.store(stats_ptr + row * 2, m, mask=g_ok)
            tl.store(stats_ptr + row * 2 + 1, total, mask=g_ok)

    return mha_kernel


@functools.cache
def _mla_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def mla_kernel(
        ql_ptr, qr_ptr, lat_ptr, rope_ptr, tables_ptr, lens_ptr, out_ptr, acc_ptr, stats_ptr,
        stride_qlb, stride_qlh, stride_qrb, stride_qrh, stride_ls, stride_rs, stride_tb, stride_ob, stride_oh,
        scale, H,
        R_LAT: tl.constexpr, R_ROPE: tl.constexpr, TPB: tl.constexpr, SPLITS: tl.constexpr, F32: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, TILE: tl.constexpr,
    ):  # one program per (sequence, 16 heads, part); the latent is both key (with the rope) and value
        seq = tl.program_id(0)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        part = tl.program_id(2)
        lat = tl.arange(0, BLOCK_L)
        rot = tl.arange(0, BLOCK_R)
        n = tl.arange(0, TILE)
        h_ok = h < H
        lat_ok = lat < R_LAT
        rot_ok = rot < R_ROPE
        q_lat = tl.load(
            ql_ptr + seq * stride_qlb + h[:, None] * stride_qlh + lat[None, :], mask=h_ok[:, None] & lat_ok[None, :], other=0.0
        )  # (H, r)
        q_rot = tl.load(
            qr_ptr + seq * stride_qrb + h[:, None] * stride_qrh + rot[None, :], mask=h_ok[:, None] & rot_ok[None, :], other=0.0
        )  # (H, R)
        if F32:
            q_lat, q_rot = q_lat.to(tl.float32), q_rot.to(tl.float32)
        else:
            q_lat, q_rot = q_lat.to(lat_ptr.dtype.element_ty), q_rot.to(lat_ptr.dtype.element_ty)
        length = tl.load(lens_ptr + seq).to(tl.int32)
        per_part = tl.cdiv(tl.cdiv(length, TILE), SPLITS) * TILE
        lo = part * per_part
        hi = tl.minimum(lo + per_part, length)
        qk_scale = scale * 1.4426950408889634
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
        for first in range(lo, hi, TILE):
            pos = first + n
            visible = pos < hi
            block = tl.load(tables_ptr + seq * stride_tb + pos // TPB, mask=visible, other=0).to(tl.int64)
            slots = block * TPB + pos % TPB
            latent = tl.load(
                lat_ptr + slots[:, None] * stride_ls + lat[None, :], mask=visible[:, None] & lat_ok[None, :], other=0.0
            )  # (N, r)
            rope = tl.load(
                rope_ptr + slots[:, None] * stride_rs + rot[None, :], mask=visible[:, None] & rot_ok[None, :], other=0.0
            )  # (N, R)
            if F32:
                latent = latent.to(tl.float32)
                scores = tl.dot(q_lat, tl.trans(latent), input_precision="ieee")
                scores += tl.dot(q_rot, tl.trans(rope.to(tl.float32)), input_precision="ieee")
            else:
                scores = tl.dot(q_lat, tl.trans(latent))
                scores += tl.dot(q_rot, tl.trans(rope))
            scores = tl.where(visible[None, :], scores * qk_scale, float("-inf"))  # (H, N)
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(scores - m_new[:, None])
            total = total * alpha + tl.sum(p, axis=1)
            if F32:
                acc = acc * alpha[:, None] + tl.dot(p, latent, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent)
            m = m_new
        out_mask = h_ok[:, None] & lat_ok[None, :]
        if SPLITS == 1:
            out = acc / tl.where(total > 0, total, 1.0)[:, None]
            tl.store(out_ptr + seq * stride_ob + h[:, None] * stride_oh + lat[None, :], out, mask=out_mask)
        else:
            row = (seq * H + h) * SPLITS + part
            tl.store(acc_ptr + row[:, None] * R_LAT + lat[None, :], acc, mask=out_mask)
            tl.store(stats_ptr + row * 2, m, mask=h_ok)
            tl.store(stats_ptr + row * 2 + 1, total, mask=h_ok)

    return mla_kernel

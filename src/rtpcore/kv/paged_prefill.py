"""Varlen paged prefill attention that reads KV blocks in place: a Triton kernel.

A prefill or mixed step (several new tokens per sequence -- a prompt, a later chunk of a
chunked prefill -- next to sequences that decode one token) attends each new token over its
sequence's cached keys and values straight from the layer's pool, through the block table,
with an online softmax: the queries stay flat (T, H, D), sequence after sequence, with no
padding to a (B, Tq, ...) batch and no dense (B, L, ...) gather of the context.

One program per (sequence, query head, BLOCK_M of the sequence's queries); it walks the
keys BLOCK_N positions at a time (any block size: each position looks up its block) from
the first one its earliest query sees to its last query's position. Scores and values go
through ``tl.dot``: in the pool's dtype with float32 accumulation for fp16/bf16 pools (the
queries and the softmax weights are cast to it, as flash attention does), in IEEE float32
for fp32 pools; the softmax is float32.

Re-exported by :mod:`rtpcore.kv.paged_attention`, whose :func:`prefill_backend` says when to
use it (on CUDA tensors by default; on CPU tensors only under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from rtpcore.kv.triton_support import float32_dots, launch_on, pow2

__all__ = ["paged_prefill_attention"]


def paged_prefill_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    tokens_per_block: int,
    scale: float,
    window: int | None = None,
    max_query_len: int,
) -> torch.Tensor:
    """Causal attention of every new token over its sequence's cache, read in place.

    q (T, H, D): the new tokens' queries, sequence after sequence; k_pool / v_pool
    (slots, Hkv, D), slot = block * tokens_per_block + offset, already holding this step's
    keys and values; block_tables (B, W) int; context_lens (B,) int, cached tokens after this
    step (the new ones included); query_start_loc (B+1,) int, sequence b's queries are rows
    ``query_start_loc[b]:query_start_loc[b+1]``; max_query_len, the longest span, a host int
    (the launch grid costs no device sync). Query i of sequence b's n_b sits at position
    ``p = context_lens[b] - n_b + i`` and sees the positions ``j <= p`` (and ``j > p - window``
    with a window). H is a multiple of Hkv. Returns (T, H, D) in q's dtype.
    """

    t, h, d = q.shape
    hkv = k_pool.shape[1]
    if h % hkv:
        raise ValueError(f"{h} query heads do not group over {hkv} KV heads")
    if k_pool.dtype != v_pool.dtype:
        raise ValueError(f"key pool {k_pool.dtype} and value pool {v_pool.dtype} differ")
    b = block_tables.shape[0]
    if query_start_loc.shape[0] != b + 1 or context_lens.shape[0] != b:
        raise ValueError(f"{b} block tables need {b} context lengths and {b + 1} query start offsets")
    q = q.contiguous()
    out = torch.empty_like(q)
    if t == 0 or b == 0 or max_query_len <= 0:
        return out
    block_d = max(16, pow2(d))
    block_m = min(64 if block_d <= 128 else 32, max(16, pow2(max_query_len)))
    block_n = 32
    with launch_on(q.device):
        _kernel()[(b, h, -(-max_query_len // block_m))](
            q, k_pool, v_pool, block_tables, context_lens, query_start_loc, out,
            q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
            block_tables.stride(0), out.stride(0), out.stride(1),
            float(scale), int(window or 0),
            G=h // hkv, D=d, TPB=tokens_per_block, F32=float32_dots(k_pool.dtype),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        )
    return out


@functools.cache
def _kernel() -> Any:
    """The jitted kernel, defined on first use (importing this module never imports Triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def prefill_kernel(
        q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, starts_ptr, out_ptr,
        stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tb, stride_ot, stride_oh,
        scale, window,
        G: tl.constexpr, D: tl.constexpr, TPB: tl.constexpr, F32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        kv = head // G
        first_row = tl.program_id(2) * BLOCK_M
        q_start = tl.load(starts_ptr + seq).to(tl.int32)
        n = tl.load(starts_ptr + seq + 1).to(tl.int32) - q_start  # this sequence's queries
        length = tl.load(lens_ptr + seq).to(tl.int32)
        rows = first_row + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        nn = tl.arange(0, BLOCK_N)
        row_ok = rows < n
        d_ok = d < D
        q_pos = length - n + rows  # (M,) each query's position
        q_mask = row_ok[:, None] & d_ok[None, :]
        q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :], mask=q_mask, other=0.0)
        q = q.to(tl.float32) if F32 else q.to(k_ptr.dtype.element_ty)
        # Keys from the first one the tile's earliest query sees to its last query's position
        # (none for a tile past the sequence's queries).
        lo = tl.where(window > 0, tl.maximum(length - n + first_row - window + 1, 0), 0)
        hi = tl.where(first_row < n, length - n + tl.minimum(first_row + BLOCK_M, n), 0)
        floor = tl.where(window > 0, q_pos - window, -1)  # (M,) the last position out of the window
        qk_scale = scale * 1.4426950408889634  # exp2 below
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            pos = start + nn  # (N,) key positions
            in_range = pos < hi
            block = tl.load(tables_ptr + seq * stride_tb + pos // TPB, mask=in_range, other=0).to(tl.int64)
            slots = block * TPB + pos % TPB
            kv_mask = in_range[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + slots[:, None] * stride_ks + kv * stride_kh + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + slots[:, None] * stride_vs + kv * stride_vh + d[None, :], mask=kv_mask, other=0.0)
            if F32:
                scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            visible = in_range[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > floor[:, None])  # (M, N)
            scores = tl.where(visible, scores * qk_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet
            alpha = tl.exp2(m - m_safe)
            p = tl.exp2(scores - m_safe[:, None])  # (M, N)
            total = total * alpha + tl.sum(p, axis=1)
            if F32:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(
            out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=q_mask,
        )

    return prefill_kernel

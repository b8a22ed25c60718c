"""Paged decode attention that reads KV blocks in place: a Triton kernel.

A decode step (one new token per sequence) attends over each sequence's cached keys and
values straight from the layer's pool, block by block through its block table, with an
online softmax -- instead of gathering every sequence's whole context into a dense
(B, L, ...) tensor per layer (``LayerKVCache.read``) and running dense attention on it.

Where it runs: tensors on a CUDA/ROCm device when Triton is importable (Triton ships with
the GPU builds of torch), and CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``
set before Triton is imported: how the tests check the kernel on machines without a GPU;
far too slow for serving). What it covers: unquantized (fp32/fp16/bf16) pools -- MHA/GQA
(:func:`paged_decode_attention`, with or without a sliding window) and MLA's latent cache
(:func:`paged_mla_decode`: scores against the latent and the rotary key, values from the
latent, as in absorbed MLA decode). fp8 pools (their byte layouts are decoded by the codecs
of ``rtpcore.kv.codecs``) take the gather path. Prefill and mixed steps (several new tokens
per sequence, chunked prefill, decodes among them) over an unquantized MHA/GQA pool have
:func:`paged_prefill_attention` (``rtpcore.kv.paged_prefill``, re-exported here): varlen
causal attention of flat queries over the cache, in place, no padding.

:func:`decode_backend` picks the path of one layer's decode, :func:`prefill_backend` that
of a prefill or mixed step: ``"auto"`` (the default) uses the kernel on CUDA tensors when it
can; :func:`use_backend` forces ``"triton"`` or ``"gather"`` for both, for a block of code
(tests, debugging, a suspected kernel problem).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from typing import Any

import torch

from rtpcore.kv.paged_prefill import paged_prefill_attention
from rtpcore.kv.triton_support import interpreted, launch_on, pow2, triton_available

__all__ = [
    "BACKENDS", "decode_backend", "paged_decode_attention", "paged_mla_decode", "paged_prefill_attention",
    "prefill_backend", "triton_available", "use_backend",
]

BACKENDS = ("auto", "triton", "gather")
_backend: contextvars.ContextVar[str] = contextvars.ContextVar("rtpcore_paged_attention", default="auto")


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Within the block, paged attention (decode and prefill) uses ``name``: ``"auto"``,
    ``"triton"`` (an error where the kernel cannot run) or ``"gather"``."""
    if name not in BACKENDS:
        raise ValueError(f"paged attention backend must be one of {BACKENDS}, got {name!r}")
    token = _backend.set(name)
    try:
        yield
    finally:
        _backend.reset(token)


def decode_backend(cache: Any, q: torch.Tensor) -> str:
    """``"triton"`` or ``"gather"`` for a decode step of one layer with ``cache``."""
    from rtpcore.kv.pools import LayerKVCache

    # unquantized: MHA (paged_decode_attention) or MLA (paged_mla_decode)
    return _choose(isinstance(cache, LayerKVCache), q, "paged attention kernel", "an unquantized MHA or MLA cache")


def prefill_backend(cache: Any, x: torch.Tensor) -> str:
    """``"triton"`` (:func:`paged_prefill_attention`) or ``"gather"`` for a prefill or mixed
    step of one layer with ``cache``, by the rules of :func:`decode_backend`; the kernel takes
    unquantized MHA/GQA caches only (MLA latents and fp8 pools gather)."""
    from rtpcore.kv.pools import LayerKVCache

    eligible = isinstance(cache, LayerKVCache) and cache.spec.kind == "mha"
    return _choose(eligible, x, "paged prefill kernel", "an unquantized MHA cache")


def _choose(eligible: bool, x: torch.Tensor, kernel: str, needs: str) -> str:
    """The backend for a kernel that can take this cache (``eligible``): "gather" when asked;
    "triton" when asked (a RuntimeError where it cannot run); else "triton" on CUDA tensors only."""
    choice = _backend.get()
    if choice == "gather":
        return "gather"
    runnable = (x.is_cuda or interpreted()) and triton_available()  # Triton is imported only then
    if choice == "triton":
        if not (eligible and runnable):
            raise RuntimeError(
                f"the Triton {kernel} cannot run here: it needs {needs} "
                "and Triton with a CUDA/ROCm device (or TRITON_INTERPRET=1 for CPU tensors)"
            )
        return "triton"
    return "triton" if eligible and runnable and x.is_cuda else "gather"


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    tokens_per_block: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its cached context, read in place.

    q (B, H, D); k_pool / v_pool (slots, Hkv, D), slot = block * tokens_per_block + offset;
    block_tables (B, max_blocks) int; context_lens (B,) int, the new token included (its keys
    are already written). A query sees positions ``context_len - window .. context_len - 1``
    with a window, else all. Returns (B, H, D) in q's dtype; softmax in float32.
    """
    kernel = _kernel()
    b, h, d = q.shape
    hkv = k_pool.shape[1]
    if h % hkv:
        raise ValueError(f"{h} query heads do not group over {hkv} KV heads")
    g = h // hkv
    q = q.contiguous()
    out = torch.empty_like(q)
    with launch_on(q.device):
        kernel[(b, hkv)](
            q, k_pool, v_pool, block_tables, context_lens, out,
            q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
            block_tables.stride(0), out.stride(0), out.stride(1),
            float(scale), int(window or 0),
            G=g, D=d, TPB=tokens_per_block,
            BLOCK_G=pow2(g), BLOCK_D=pow2(d), BLOCK_T=pow2(tokens_per_block),
        )
    return out


def paged_mla_decode(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_pool: torch.Tensor,
    rope_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    tokens_per_block: int,
    scale: float,
) -> torch.Tensor:
    """Absorbed MLA decode over a paged latent cache, read in place.

    q_latent (B, H, r): the queries with W_UK absorbed; q_rope (B, H, R); latent_pool
    (slots, r) the cached normalised latents (the spec's k part), rope_pool (slots, R) the
    roped shared keys (its v part); context_lens count the new token (already written).
    score = scale * (q_latent . latent + q_rope . rope); returns softmax(score) @ latent,
    (B, H, r) float32 (multiply by W_UV afterwards).
    """
    kernel = _mla_kernel()
    b, h, r = q_latent.shape
    rope = q_rope.shape[-1]
    q_latent, q_rope = q_latent.contiguous(), q_rope.contiguous()
    out = torch.empty(b, h, r, dtype=torch.float32, device=q_latent.device)
    block_h, block_n = 16, 16
    with launch_on(q_latent.device):
        kernel[(b, -(-h // block_h))](
            q_latent, q_rope, latent_pool, rope_pool, block_tables, context_lens, out,
            q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
            latent_pool.stride(0), rope_pool.stride(0), block_tables.stride(0), out.stride(0), out.stride(1),
            float(scale), h,
            R_LAT=r, R_ROPE=rope, TPB=tokens_per_block,
            BLOCK_H=block_h, BLOCK_L=max(16, pow2(r)), BLOCK_R=max(16, pow2(rope)), BLOCK_N=block_n,
        )
    return out


@functools.cache
def _kernel() -> Any:
    """The jitted kernel, defined on first use (importing this module never imports Triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def decode_kernel(
        q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr,
        stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tb, stride_ob, stride_oh,
        scale, window,
        G: tl.constexpr, D: tl.constexpr, TPB: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
    ):  # one program per (sequence, KV head): its G query heads share every K/V row it loads
        seq = tl.program_id(0)
        kv = tl.program_id(1)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        t = tl.arange(0, BLOCK_T)
        g_ok = g < G
        d_ok = d < D
        heads = kv * G + g
        q = tl.load(
            q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
            mask=g_ok[:, None] & d_ok[None, :], other=0.0,
        ).to(tl.float32)  # (G, D)
        length = tl.load(lens_ptr + seq).to(tl.int32)
        start = tl.maximum(length - window, 0) if window > 0 else 0
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for j in range(start // TPB, tl.cdiv(length, TPB)):  # every block holds a visible position
            block = tl.load(tables_ptr + seq * stride_tb + j).to(tl.int64)
            pos = j * TPB + t
            visible = (t < TPB) & (pos < length) & (pos >= start)
            slots = block * TPB + t
            row_ok = visible[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + slots[:, None] * stride_ks + kv * stride_kh + d[None, :], mask=row_ok, other=0.0)
            v = tl.load(v_ptr + slots[:, None] * stride_vs + kv * stride_vh + d[None, :], mask=row_ok, other=0.0)
            scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale  # (G, T)
            scores = tl.where(visible[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])  # (G, T)
            total = total * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
            m = m_new
        out = acc / total[:, None]
        tl.store(
            out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :],
        )

    return decode_kernel


@functools.cache
def _mla_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def mla_kernel(
        ql_ptr, qr_ptr, lat_ptr, rope_ptr, tables_ptr, lens_ptr, out_ptr,
        stride_qlb, stride_qlh, stride_qrb, stride_qrh, stride_ls, stride_rs, stride_tb, stride_ob, stride_oh,
        scale, H,
        R_LAT: tl.constexpr, R_ROPE: tl.constexpr, TPB: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # one program per (sequence, 16 heads); BLOCK_N positions per iteration, any block size
        seq = tl.program_id(0)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        lat = tl.arange(0, BLOCK_L)
        rot = tl.arange(0, BLOCK_R)
        n = tl.arange(0, BLOCK_N)
        h_ok = h < H
        lat_ok = lat < R_LAT
        rot_ok = rot < R_ROPE
        q_lat = tl.load(
            ql_ptr + seq * stride_qlb + h[:, None] * stride_qlh + lat[None, :], mask=h_ok[:, None] & lat_ok[None, :], other=0.0
        ).to(tl.float32)  # (H, r)
        q_rot = tl.load(
            qr_ptr + seq * stride_qrb + h[:, None] * stride_qrh + rot[None, :], mask=h_ok[:, None] & rot_ok[None, :], other=0.0
        ).to(tl.float32)  # (H, R)
        length = tl.load(lens_ptr + seq).to(tl.int32)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
        for start in range(0, length, BLOCK_N):
            pos = start + n
            visible = pos < length
            block = tl.load(tables_ptr + seq * stride_tb + pos // TPB, mask=visible, other=0).to(tl.int64)
            slots = block * TPB + pos % TPB
            latent = tl.load(
                lat_ptr + slots[:, None] * stride_ls + lat[None, :], mask=visible[:, None] & lat_ok[None, :], other=0.0
            ).to(tl.float32)  # (N, r)
            rope = tl.load(
                rope_ptr + slots[:, None] * stride_rs + rot[None, :], mask=visible[:, None] & rot_ok[None, :], other=0.0
            ).to(tl.float32)  # (N, R)
            scores = tl.dot(q_lat, tl.trans(latent), input_precision="ieee")
            scores = (scores + tl.dot(q_rot, tl.trans(rope), input_precision="ieee")) * scale  # (H, N)
            scores = tl.where(visible[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            total = total * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p, latent, input_precision="ieee")
            m = m_new
        out = acc / total[:, None]
        tl.store(
            out_ptr + seq * stride_ob + h[:, None] * stride_oh + lat[None, :], out, mask=h_ok[:, None] & lat_ok[None, :]
        )

    return mla_kernel

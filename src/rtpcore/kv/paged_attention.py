"""Paged decode attention that reads KV blocks in place: Triton kernels.

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

Two MHA/GQA decode kernels, chosen per step by :func:`decode_kernel_splits` from host-side
shapes only (so a CUDA graph replays the same launches for any context): while the
positions a query can address (the block tables' width times the block size -- under CUDA
graphs ``max_positions`` -- or a shorter sliding window) stay under ``LONG_CONTEXT`` (1024),
the per-block kernel here (one program per (sequence, KV head), one KV block per
iteration); from there on, the tiled split-context kernel of
``rtpcore.kv.paged_decode_split`` (64-128-position tiles through ``tl.dot``, each context
split into parts run side by side and combined by log-sum-exp). MLA decode always takes
that module's tiled kernel.

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

from rtpcore.kv.paged_decode_split import (
    LONG_CONTEXT,
    decode_splits,
    split_decode_attention,
    split_mla_decode,
)
from rtpcore.kv.paged_prefill import paged_prefill_attention
from rtpcore.kv.triton_support import interpreted, launch_on, pow2, triton_available

__all__ = [
    "BACKENDS", "decode_backend", "decode_kernel_splits", "paged_decode_attention", "paged_mla_decode", "paged_prefill_attention",
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


def decode_kernel_splits(num_seqs: int, kv_heads: int, addressable: int, window: int | None = None) -> int:
    """Which kernel an MHA/GQA decode step takes: 0, the per-block kernel, while the
    positions a query can see -- ``addressable`` (the block tables' width times the block
    size; under CUDA graphs ``max_positions``, whatever the contexts' lengths), or the window
    when shorter -- stay under ``LONG_CONTEXT`` (1024); else the tiled kernel in
    :func:`decode_splits` parts. Host integers only, so a captured graph replays the same
    launches for any context."""
    visible = min(addressable, window) if window else addressable
    return 0 if visible < LONG_CONTEXT else decode_splits(num_seqs, kv_heads, visible)


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
    splits: int | None = None,
    tile: int | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its cached context, read in place.

    q (B, H, D); k_pool / v_pool (slots, Hkv, D), slot = block * tokens_per_block + offset;
    block_tables (B, max_blocks) int; context_lens (B,) int, the new token included (its keys
    are already written). A query sees positions ``context_len - window .. context_len - 1``
    with a window, else all. Returns (B, H, D) in q's dtype; softmax in float32.

    ``splits``: 0, the per-block kernel; n >= 1, the tiled kernel of
    :mod:`rtpcore.kv.paged_decode_split` in n parts of each context; None (the default),
    :func:`decode_kernel_splits`'s choice by the step's shapes. ``tile``: the tiled kernel's
    positions per tile (None: 128 for heads up to 64 wide, else 64).
    """
    b, h, d = q.shape
    hkv = k_pool.shape[1]
    if h % hkv:
        raise ValueError(f"{h} query heads do not group over {hkv} KV heads")
    if splits is None:
        splits = decode_kernel_splits(b, hkv, block_tables.shape[1] * tokens_per_block, window)
    if splits:
        return split_decode_attention(
            q, k_pool, v_pool, block_tables, context_lens,
            tokens_per_block=tokens_per_block, scale=scale, window=window, splits=splits, tile=tile,
        )
    kernel = _kernel()
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
    splits: int | None = None,
    tile: int | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode over a paged latent cache, read in place.

    q_latent (B, H, r): the queries with W_UK absorbed; q_rope (B, H, R); latent_pool
    (slots, r) the cached normalised latents (the spec's k part), rope_pool (slots, R) the
    roped shared keys (its v part); context_lens count the new token (already written).
    score = scale * (q_latent . latent + q_rope . rope); returns softmax(score) @ latent,
    (B, H, r) float32 (multiply by W_UV afterwards). The tiled kernel of
    :mod:`rtpcore.kv.paged_decode_split` (programs of 16 heads), in ``splits`` parts of each
    context (None: :func:`decode_splits` by the block tables' width, whatever the length),
    ``tile`` positions per tile (None: 64, or 32 for latents wider than 256).
    """
    b, h = q_latent.shape[:2]
    if splits is None:
        splits = decode_splits(b, -(-h // 16), block_tables.shape[1] * tokens_per_block)
    return split_mla_decode(
        q_latent, q_rope, latent_pool, rope_pool, block_tables, context_lens,
        tokens_per_block=tokens_per_block, scale=scale, splits=splits, tile=tile,
    )


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

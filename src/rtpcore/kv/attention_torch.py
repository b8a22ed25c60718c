"""The reference attention over paged KV caches (the ``torch`` attention backend of
:mod:`rtpcore.attention`, which documents what it computes): torch's fused attention over
gathered contexts, the Triton kernels of :mod:`rtpcore.kv.paged_attention` in place on GPUs.

Numerics follow transformers' "sdpa" attention: torch's fused kernel, softmax in float32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rtpcore.kv import paged_attention as kernels

__all__ = ["attend", "attend_spans", "causal_mask", "torch_paged_attention", "torch_paged_mla"]

ForwardBatch = Any  # rtpcore.batch.ForwardBatch, a stage above


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
    *, causal: bool = False,
) -> torch.Tensor:
    """Grouped-query attention: q (B, H, Tq, D), k/v (B, Hkv, L, D) in any float dtype (the
    cache's), mask (B|1, 1, Tq, L) bool or None (every key visible) -> (B, H, Tq, D), q's dtype.
    ``causal`` (with no mask, Tq == L): query i sees keys 0..i, and the fused kernel skips the
    blocks above the diagonal (with the same condition as a mask it computes them all and
    throws them away: half a fresh prompt's attention).

    torch's fused kernel, as transformers' default ("sdpa") uses; float32 gives its bits. On
    the CPU, bf16/fp16 inputs are attended in float32 (the kernel is about 4x faster there, and
    it accumulates in float32 either way): within rounding of transformers, not its bits.
    """
    if q.dtype != torch.float32 and q.device.type == "cpu":
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale,
                                             is_causal=causal, enable_gqa=True)
        return out.to(q.dtype)
    k, v = k.to(q.dtype), v.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=causal, enable_gqa=True)


def causal_mask(
    num_queries: int, context_len: int, window: int | None, device: torch.device
) -> torch.Tensor | None:
    """(Tq, L) bool for one sequence whose ``num_queries`` new tokens end its ``context_len``
    cached ones: query i sits at position ``context_len - num_queries + i`` and sees keys at
    positions up to its own (and, with a window, later than ``position - window``). None when
    every key is visible (one query, no window)."""
    if num_queries == 1 and (window is None or window >= context_len):
        return None
    qpos = torch.arange(context_len - num_queries, context_len, device=device)[:, None]  # (Tq, 1)
    kpos = torch.arange(context_len, device=device)[None, :]  # (1, L)
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    return mask


def _decode_mask(batch: ForwardBatch, d: int, longest: int, window: int | None) -> torch.Tensor | None:
    """(d, 1, 1, L) bool: which of the L gathered positions each of the first ``d`` (decoding)
    sequences sees; None when all of them (one sequence, no window cutting its context)."""
    if d == 1 and (window is None or window >= longest):
        return None
    kpos = torch.arange(longest, device=batch.context_lens.device)[None, :]  # (1, L)
    ctx = batch.context_lens[:d, None]  # (d, 1)
    mask = kpos < ctx
    if window is not None:
        mask &= kpos >= ctx - window
    return mask[:, None, None, :]


def _shared(masks: dict[Any, Any] | None, key: Any, make: Any) -> Any:
    """``masks[key]``, made once per forward (``make()``; every call when ``masks`` is None)."""
    if masks is None:
        return make()
    if key not in masks:
        masks[key] = make()
    return masks[key]


def torch_paged_attention(
    q: torch.Tensor,
    cache: Any,
    batch: ForwardBatch,
    *,
    scale: float,
    window: int | None = None,
    masks: dict[Any, Any] | None = None,
) -> torch.Tensor:
    if batch.is_decode and kernels.decode_backend(cache, q) == "triton":
        return kernels.paged_decode_attention(
            q, cache.k, cache.v, batch.block_tables, batch.context_lens,
            tokens_per_block=batch.tokens_per_block, scale=scale, window=window,
        )  # (B, H, D)
    if not batch.is_decode and kernels.prefill_backend(cache, q) == "triton":
        return kernels.paged_prefill_attention(
            q, cache.k, cache.v, batch.block_tables, batch.context_lens, batch.query_starts(),
            tokens_per_block=batch.tokens_per_block, scale=scale, window=window,
            max_query_len=batch.max_query_len,
        )  # (T, H, D)
    d = batch.num_decodes
    lens = batch.context_lens_on_host()
    decoded = None
    if d:
        longest = max(lens[:d])
        kc, vc = cache.read(batch.block_tables[:d], longest)  # (d, L, Hkv, D) each
        mask = _shared(masks, ("decode", window), lambda: _decode_mask(batch, d, longest, window))
        decoded = attend(q[:d, :, None, :], kc.transpose(1, 2), vc.transpose(1, 2), mask, scale)[:, :, 0]  # (d, H, D)
        if d == batch.num_seqs:
            return decoded
    out = torch.empty_like(q)  # (T, H, D)
    if decoded is not None:
        out[:d] = decoded
    attend_spans(q, cache, batch, out, d, scale=scale, window=window)
    return out


def attend_spans(
    q: torch.Tensor, cache: Any, batch: ForwardBatch, out: torch.Tensor, first: int, *, scale: float,
    window: int | None = None,
) -> None:
    """out[rows of sequence b] = the attention of sequence b's new tokens over its own context,
    causal, for every sequence from ``first`` on, one fused call each (q, out: (T, H, D))."""
    for span in batch.spans(first):
        kc, vc = cache.read(batch.block_tables[span.b : span.b + 1], span.context_len)  # (1, L, Hkv, D)
        # a whole prompt (no cached prefix, no window): the kernel's own causal rule
        fresh = span.num_tokens == span.context_len > 1 and (window is None or window >= span.context_len)
        mask = None if fresh else causal_mask(span.num_tokens, span.context_len, window, q.device)
        qs = q[span.start : span.end].transpose(0, 1)[None]  # (1, H, n, D)
        o = attend(qs, kc.transpose(1, 2), vc.transpose(1, 2), mask, scale, causal=fresh)  # (1, H, n, D)
        out[span.start : span.end] = o[0].transpose(0, 1)

def torch_paged_mla(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: Any,
    batch: ForwardBatch,
    *,
    w_uk: torch.Tensor,
    w_uv_t: torch.Tensor,
    scale: float,
    masks: dict[Any, Any] | None = None,
) -> torch.Tensor:
    t, h = q_nope.shape[:2]
    dv = w_uv_t.shape[-1]
    if batch.is_decode and kernels.decode_backend(cache, q_nope) == "triton":
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # (B, H, r): W_UK absorbed
        o_lat = kernels.paged_mla_decode(
            q_lat, q_pe, cache.k, cache.v, batch.block_tables, batch.context_lens,
            tokens_per_block=batch.tokens_per_block, scale=scale,
        ).to(q_nope.dtype)  # (B, H, r)
        return torch.bmm(o_lat.transpose(0, 1), w_uv_t).transpose(0, 1).reshape(t, h * dv)  # W_UV absorbed
    out = q_nope.new_empty(t, h * dv)
    for span in batch.spans(0):  # every sequence over its own context, in the expanded form
        ckv, kpe = cache.read(batch.block_tables[span.b : span.b + 1], span.context_len)  # (1, L, r), (1, L, R)
        ckv, kpe = ckv[0].to(q_nope.dtype), kpe[0].to(q_nope.dtype)  # (L, r), (L, R)
        k_nope = torch.einsum("lr,hdr->hld", ckv, w_uk)  # (H, L, dn)
        k = torch.cat((k_nope, kpe[None].expand(h, -1, -1)), dim=-1)  # (H, L, dn+R)
        v = torch.einsum("lr,hrv->hlv", ckv, w_uv_t)  # (H, L, dv)
        rows = slice(span.start, span.end)
        q = torch.cat((q_nope[rows], q_pe[rows]), dim=-1).transpose(0, 1)  # (H, n, dn+R)
        mask = causal_mask(span.num_tokens, span.context_len, None, q.device)
        o = attend(q[None], k[None], v[None], mask, scale)[0]  # (H, n, dv)
        out[rows] = o.transpose(0, 1).reshape(span.num_tokens, h * dv)
    return out

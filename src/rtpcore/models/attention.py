"""Attention over the paged KV cache for an unpadded step (forward contract 2).

:func:`paged_attention` is what a multi-head / grouped-query attention layer calls after
writing its new keys and values: it takes the step's flat queries and returns the flat
outputs, each sequence attending over its own paged context only.

* On a GPU with an unquantized pool the blocks are read in place
  (``rtpcore.kv.paged_attention``: the decode kernel for one-token steps, the varlen
  prefill kernel for the others).
* Elsewhere (the CPU, fp8 pools) the one-token sequences at the head of the batch (the
  decodes) are gathered together up to their longest context and attended in one fused
  call; every longer span (a prompt chunk, a speculative verification) is attended
  alone over its own context, with the causal mask offset by the tokens cached before
  it. No tensor is sized B x (longest span) x (longest context).

Numerics follow transformers' "sdpa" attention: torch's fused kernel, softmax in float32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from rtpcore.kv import paged_attention as kernels

if TYPE_CHECKING:
    from rtpcore.models.forward_batch import ForwardBatch

__all__ = ["attend", "causal_mask", "paged_attention"]


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Grouped-query attention: q (B, H, Tq, D), k/v (B, Hkv, L, D) in any float dtype (the
    cache's), mask (B|1, 1, Tq, L) bool or None (every key visible) -> (B, H, Tq, D), q's dtype.

    torch's fused kernel, as transformers' default ("sdpa") uses; float32 gives its bits. On
    the CPU, bf16/fp16 inputs are attended in float32 (the kernel is about 4x faster there, and
    it accumulates in float32 either way): within rounding of transformers, not its bits.
    """
    if q.dtype != torch.float32 and q.device.type == "cpu":
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale, enable_gqa=True)
        return out.to(q.dtype)
    k, v = k.to(q.dtype), v.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


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


def paged_attention(
    q: torch.Tensor,  # (T, H, D) the step's queries, flat
    cache: Any,  # the layer's pool (rtpcore.kv.pools), holding this step's keys already
    batch: ForwardBatch,
    *,
    scale: float,
    window: int | None = None,
    masks: dict[Any, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """(T, H, D) attention outputs of every new token over its own sequence's cached keys.

    ``masks``: a dict the caller keeps for one forward, where the decodes' mask of each window
    is built once and reused by every layer (None: built per call)."""
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
        key = ("decode", window)
        if masks is not None and key in masks:
            mask = masks[key]
        else:
            mask = _decode_mask(batch, d, longest, window)
            if masks is not None:
                masks[key] = mask
        decoded = attend(q[:d, :, None, :], kc.transpose(1, 2), vc.transpose(1, 2), mask, scale)[:, :, 0]  # (d, H, D)
        if d == batch.num_seqs:
            return decoded
    out = torch.empty_like(q)  # (T, H, D)
    if decoded is not None:
        out[:d] = decoded
    for span in batch.spans(d):
        kc, vc = cache.read(batch.block_tables[span.b : span.b + 1], span.context_len)  # (1, L, Hkv, D)
        mask = causal_mask(span.num_tokens, span.context_len, window, q.device)
        qs = q[span.start : span.end].transpose(0, 1)[None]  # (1, H, n, D)
        o = attend(qs, kc.transpose(1, 2), vc.transpose(1, 2), mask, scale)  # (1, H, n, D)
        out[span.start : span.end] = o[0].transpose(0, 1)
    return out


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

"""The kernels of the ``atom_mla`` attention backend (:mod:`atom_plugin.attention`, which says
what they compute), imported at its first call.

Shapes: T new tokens, B sequences, L cached positions, H heads, r = kv_lora_rank,
R = rope dims, dn = qk_nope_head_dim, dv = v_head_dim.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rtpcore.layers import causal_mask, decode_backend, paged_mla_decode

__all__ = ["decode_paged", "mla"]


def mla(
    q_nope: torch.Tensor,  # (T, H, dn)
    q_pe: torch.Tensor,  # (T, H, R)
    cache: Any,
    batch: Any,
    *,
    w_uk: torch.Tensor,  # (H, dn, r)
    w_uv_t: torch.Tensor,  # (H, r, dv)
    scale: float,
    masks: dict[Any, Any] | None = None,
) -> torch.Tensor:
    t, h = q_nope.shape[:2]
    dv = w_uv_t.shape[-1]
    if batch.is_decode and decode_backend(cache, q_nope) == "triton":
        return decode_paged(q_nope, q_pe, cache, batch, w_uk, w_uv_t, scale)
    # Nothing padded: the decodes attend together over their longest context; every longer
    # span (a prompt chunk) alone over its own.
    d = batch.num_decodes
    out = q_nope.new_empty(t, h * dv)  # (T, H*dv)
    if d:
        decode_len, mask = _decode_mask(batch, d, masks)
        ckv, kpe = cache.read(batch.block_tables[:d], decode_len)  # (Bd, Ld, r), (Bd, Ld, R)
        out[:d] = _decode(q_nope[:d], q_pe[:d], ckv, kpe, mask, w_uk, w_uv_t, scale)  # (Bd, H*dv)
    for span in batch.spans(d):
        ckv, kpe = cache.read(batch.block_tables[span.b : span.b + 1], span.context_len)  # (1, L, r), (1, L, R)
        rows = slice(span.start, span.end)
        out[rows] = _prefill(
            q_nope[rows], q_pe[rows], ckv.to(q_nope.dtype), kpe.to(q_nope.dtype), w_uk, w_uv_t, scale
        )  # (n, H*dv)
    return out


def decode_paged(
    q_nope: torch.Tensor, q_pe: torch.Tensor, cache: Any, batch: Any,
    w_uk: torch.Tensor, w_uv_t: torch.Tensor, scale: float,
) -> torch.Tensor:
    """The decode with its attention core reading the paged latent cache in place."""
    b, h = q_nope.shape[:2]
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # (B, H, r): W_UK absorbed
    o_lat = paged_mla_decode(
        q_lat, q_pe, cache.k, cache.v, batch.block_tables, batch.context_lens,
        tokens_per_block=batch.tokens_per_block, scale=scale,
    ).to(q_nope.dtype)  # (B, H, r)
    o = torch.bmm(o_lat.transpose(0, 1), w_uv_t)  # (H, B, dv): W_UV absorbed
    return o.transpose(0, 1).reshape(b, h * w_uv_t.shape[-1])  # (B, H*dv)


def _decode_mask(batch: Any, d: int, masks: dict[Any, Any] | None) -> tuple[int, torch.Tensor | None]:
    """(Ld, the decodes' longest context; (Bd, 1, Ld) True past each decode's context, or None
    when nothing is masked), computed once per forward and shared by the layers (``masks``)."""
    if masks is not None and "atom_mla.decode" in masks:
        found: tuple[int, torch.Tensor | None] = masks["atom_mla.decode"]
        return found
    decode_len = max(batch.context_lens_on_host()[:d], default=0)
    mask = None
    if d > 1:  # one sequence fills its whole context: nothing to mask
        pos = torch.arange(decode_len, device=batch.positions.device)  # (Ld,)
        mask = (pos[None, :] >= batch.context_lens[:d, None])[:, None, :]  # (Bd, 1, Ld)
    if masks is not None:
        masks["atom_mla.decode"] = (decode_len, mask)
    return decode_len, mask


def _decode(
    q_nope: torch.Tensor,  # (B, H, dn)
    q_pe: torch.Tensor,  # (B, H, R)
    ckv: torch.Tensor,  # (B, L, r)
    kpe: torch.Tensor,  # (B, L, R)
    masked: torch.Tensor | None,  # (B, 1, L) True past each sequence's context, or None
    w_uk: torch.Tensor,
    w_uv_t: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    b, h = q_nope.shape[:2]
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # (B, H, r): W_UK absorbed
    # The attention core runs in float32 whatever the model dtype: more exact, and in
    # bf16 faster too (oneDNN would build new bf16 kernels for every new length L).
    ckv, kpe = ckv.float(), kpe.float()  # (B, L, r), (B, L, R); no copies in float32
    scores = torch.baddbmm(  # (B, H, L): scale * (q_lat . c_kv + q_pe . k_pe), no concatenation
        torch.bmm(q_pe.float(), kpe.transpose(1, 2)),
        q_lat.float(),
        ckv.transpose(1, 2),
        beta=scale,
        alpha=scale,
    )
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    probs = scores.softmax(dim=-1)  # (B, H, L) float32
    o_lat = torch.bmm(probs, ckv).to(q_nope.dtype)  # (B, H, r)
    o = torch.bmm(o_lat.transpose(0, 1), w_uv_t)  # (H, B, dv): W_UV absorbed
    return o.transpose(0, 1).reshape(b, h * w_uv_t.shape[-1])  # (B, H*dv)


def _prefill(
    q_nope: torch.Tensor,  # (n, H, dn) one sequence's new tokens
    q_pe: torch.Tensor,  # (n, H, R)
    ckv: torch.Tensor,  # (1, L, r) its whole context, the new tokens last
    kpe: torch.Tensor,  # (1, L, R)
    w_uk: torch.Tensor,
    w_uv_t: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    n, seq = q_nope.shape[0], ckv.shape[1]
    h, dv = q_nope.shape[1], w_uv_t.shape[-1]
    k_nope = torch.einsum("blr,hdr->blhd", ckv, w_uk)  # (1, L, H, dn): kv_b_proj's key half
    v = torch.einsum("blr,hrv->blhv", ckv, w_uv_t)  # (1, L, H, dv): its value half
    k = torch.cat((k_nope, kpe[:, :, None, :].expand(1, seq, h, -1)), dim=-1)  # (1, L, H, dq)
    q = torch.cat((q_nope, q_pe), dim=-1)[None]  # (1, n, H, dq)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),  # (1, H, n, dq)
        k.transpose(1, 2),  # (1, H, L, dq)
        v.transpose(1, 2),  # (1, H, L, dv)
        attn_mask=causal_mask(n, seq, None, q.device),  # (n, L): the queries are the last n positions
        scale=scale,
    )  # (1, H, n, dv)
    return out[0].transpose(0, 1).reshape(n, h * dv)  # (n, H*dv)

"""Multi-head latent attention (MLA) over rtpcore's paged cache.

The cache holds, per token, the normalised latent ``c_kv`` (``kv_lora_rank``
values, the spec's k part) and the roped shared key ``k_pe``
(``qk_rope_head_dim`` values, the spec's v part). Nothing per head is cached.

* Prefill (any sequence with more than one new token) uses the expanded form:
  ``kv_b_proj`` turns every cached latent into per-head keys and values.
* Decode (one new token per sequence) stays in the latent space: ``W_UK`` is
  absorbed into the query and ``W_UV`` into the output, so the step reads
  ``kv_lora_rank + rope`` values per cached token instead of
  ``H * (nope + rope + v)``.

Shapes: T new tokens, B sequences, L cached positions, H heads, r = kv_lora_rank,
R = rope dims, dn = qk_nope_head_dim, dv = v_head_dim.

Tensor parallel (see :mod:`atom_plugin.tensor_parallel`): H is this rank's
share of the heads, ``q_b_proj`` / ``kv_b_proj`` / ``o_proj`` hold only their
rows / columns, and ``o_proj`` is row-parallel
(``rtpcore.layers.row_parallel``: its partial output is all-reduced
before its bias is added). The latent (``c_kv``, ``k_pe``) is shared by all
heads, so every rank computes and caches all of it.

Every projection is an ``rtpcore.layers.Linear`` (prepacked oneDNN in bf16,
``F.linear`` in float32: the same bits as ``F.linear`` either way).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from atom_plugin.config import DeepseekConfig
from atom_plugin.layers import RMSNorm, Weights, apply_rope, linear_factory
from rtpcore.layers import Linear, causal_mask, paged_mla_decode, row_parallel

__all__ = ["MLAttention", "StepTensors"]


class StepTensors(NamedTuple):
    """Per-step values every layer shares, computed once per forward."""

    cos: torch.Tensor  # (T, 1, R/2)
    sin: torch.Tensor  # (T, 1, R/2)
    max_len: int  # L: the longest context after this step
    num_decodes: int  # Bd: the leading sequences with one new token each (the decodes)
    decode_len: int  # Ld: the longest context of those
    decode_mask: torch.Tensor | None  # (Bd, 1, Ld) True past each decode's context; None when nothing is masked
    # every sequence decodes and reads the latent cache in place (rtpcore.layers.paged_mla_decode)
    paged: bool = False


class MLAttention(nn.Module):
    def __init__(
        self,
        cfg: DeepseekConfig,
        w: Weights,
        prefix: str,
        dtype: torch.dtype,
        device: torch.device | str,
        parallel: Any = None,
    ):
        super().__init__()
        self.cfg = cfg
        h, dn, dv, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        kv_b = w[f"{prefix}.kv_b_proj.weight"]  # (H*(dn+dv), r)
        if kv_b.shape != (h * (dn + dv), r):
            raise ValueError(
                f"{prefix}.kv_b_proj.weight has shape {tuple(kv_b.shape)}, but a config with "
                f"num_attention_heads={h} needs {(h * (dn + dv), r)} (a sharded config needs sharded weights)"
            )

        make = linear_factory(dtype, device)

        def bias(*names: str) -> torch.Tensor | None:  # attention_bias: these projections have one
            if not cfg.attention_bias:
                return None
            return torch.cat([w[f"{prefix}.{n}.bias"] for n in names])

        kv_a = w[f"{prefix}.kv_a_proj_with_mqa.weight"]  # (r+R, D)
        self.q_proj: Linear | None = None
        self.q_b: Linear | None = None
        if cfg.q_lora_rank is None:
            self.q_proj = make(w[f"{prefix}.q_proj.weight"])  # D -> H*dq
            self.qkv_a = make(kv_a, bias("kv_a_proj_with_mqa"))  # D -> r+R
        else:
            # q_a_proj and kv_a_proj_with_mqa read the same input: one fused matmul.
            qkv_a = torch.cat((w[f"{prefix}.q_a_proj.weight"], kv_a))  # (q_lora+r+R, D)
            self.qkv_a = make(qkv_a, bias("q_a_proj", "kv_a_proj_with_mqa"))
            q_norm = w[f"{prefix}.q_a_layernorm.weight"].to(device=device, dtype=dtype)
            self.q_a_norm = RMSNorm(q_norm, 1e-6)  # transformers uses the default eps here
            self.q_b = make(w[f"{prefix}.q_b_proj.weight"])  # q_lora -> H*dq
        kv_norm = w[f"{prefix}.kv_a_layernorm.weight"].to(device=device, dtype=dtype)
        self.kv_norm = RMSNorm(kv_norm, 1e-6)
        per_head = kv_b.to(device=device, dtype=dtype).view(h, dn + dv, r)
        self.w_uk = nn.Parameter(per_head[:, :dn, :].contiguous(), requires_grad=False)  # (H, dn, r)
        self.w_uv_t = nn.Parameter(
            per_head[:, dn:, :].transpose(1, 2).contiguous(), requires_grad=False
        )  # (H, r, dv)
        # Row-parallel when sharded: this rank's heads' partial sums all-reduced, the bias added once.
        self.o_proj = row_parallel(make, w[f"{prefix}.o_proj.weight"], bias("o_proj"), parallel)  # H*dv -> D
        self.scale = cfg.softmax_scale

    def forward(
        self,
        x: torch.Tensor,  # (T, D)
        step: StepTensors,  # rope cos/sin and the decode mask, shared by every layer
        batch: Any,  # rtpcore.batch.ForwardBatch
        cache: Any,  # rtpcore.kv.LayerKVCache
    ) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        h, dn, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        lat = self.qkv_a(x)  # (T, [q_lora] + r + R)
        if self.q_b is None:
            assert self.q_proj is not None, "built with q_proj when q_lora_rank is None"
            q = self.q_proj(x)  # (T, H*dq)
            c_kv, k_pe = lat.split((r, cfg.qk_rope_head_dim), dim=-1)  # (T, r), (T, R)
        else:
            q_lat, c_kv, k_pe = lat.split((cfg.q_lora_rank, r, cfg.qk_rope_head_dim), dim=-1)
            q = self.q_b(self.q_a_norm(q_lat))  # (T, H*dq)
        q = q.view(t, h, cfg.qk_head_dim)  # (T, H, dq)
        q_nope, q_pe = q.split((dn, cfg.qk_rope_head_dim), dim=-1)  # (T, H, dn), (T, H, R)
        c_kv = self.kv_norm(c_kv)  # (T, r)
        pe = apply_rope(torch.cat((q_pe, k_pe[:, None, :]), 1), step.cos, step.sin, cfg.rope_interleave)
        q_pe, k_pe = pe[:, :h], pe[:, h]  # (T, H, R), (T, R): one rotation for queries and key
        cache.write(batch.slots, c_kv, k_pe)
        if step.paged:
            return self.o_proj(self._decode_paged(q_nope, q_pe, cache, batch))  # (T, D)
        # Forward contract 2: nothing padded. The decodes attend together over their longest
        # context; every longer span (a prompt chunk) alone over its own.
        d = step.num_decodes
        out = x.new_empty(t, h * cfg.v_head_dim)  # (T, H*dv)
        if d:
            ckv, kpe = cache.read(batch.block_tables[:d], step.decode_len)  # (Bd, Ld, r), (Bd, Ld, R)
            out[:d] = self._decode(q_nope[:d], q_pe[:d], ckv, kpe, step.decode_mask)  # (Bd, H*dv)
        for span in batch.spans(d):
            ckv, kpe = cache.read(batch.block_tables[span.b : span.b + 1], span.context_len)  # (1, L, r), (1, L, R)
            rows = slice(span.start, span.end)
            out[rows] = self._prefill(q_nope[rows], q_pe[rows], ckv.to(x.dtype), kpe.to(x.dtype))  # (n, H*dv)
        return self.o_proj(out)  # (T, D), all-reduced when sharded

    def _decode(
        self,
        q_nope: torch.Tensor,  # (B, H, dn)
        q_pe: torch.Tensor,  # (B, H, R)
        ckv: torch.Tensor,  # (B, L, r)
        kpe: torch.Tensor,  # (B, L, R)
        masked: torch.Tensor | None,  # (B, 1, L) True past each sequence's context, or None
    ) -> torch.Tensor:
        b, h = q_nope.shape[:2]
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # (B, H, r): W_UK absorbed
        # The attention core runs in float32 whatever the model dtype: more exact, and in
        # bf16 faster too (oneDNN would build new bf16 kernels for every new length L).
        ckv, kpe = ckv.float(), kpe.float()  # (B, L, r), (B, L, R); no copies in float32
        scores = torch.baddbmm(  # (B, H, L): scale * (q_lat . c_kv + q_pe . k_pe), no concatenation
            torch.bmm(q_pe.float(), kpe.transpose(1, 2)),
            q_lat.float(),
            ckv.transpose(1, 2),
            beta=self.scale,
            alpha=self.scale,
        )
        if masked is not None:
            scores = scores.masked_fill(masked, float("-inf"))
        probs = scores.softmax(dim=-1)  # (B, H, L) float32
        o_lat = torch.bmm(probs, ckv).to(q_nope.dtype)  # (B, H, r)
        o = torch.bmm(o_lat.transpose(0, 1), self.w_uv_t)  # (H, B, dv): W_UV absorbed
        return o.transpose(0, 1).reshape(b, h * self.cfg.v_head_dim)  # (B, H*dv)

    def _decode_paged(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: Any, batch: Any) -> torch.Tensor:
        """:meth:`_decode` with the attention core reading the paged latent cache in place."""
        b, h = q_nope.shape[:2]
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # (B, H, r): W_UK absorbed
        o_lat = paged_mla_decode(
            q_lat, q_pe, cache.k, cache.v, batch.block_tables, batch.context_lens,
            tokens_per_block=batch.tokens_per_block, scale=self.scale,
        ).to(q_nope.dtype)  # (B, H, r)
        o = torch.bmm(o_lat.transpose(0, 1), self.w_uv_t)  # (H, B, dv): W_UV absorbed
        return o.transpose(0, 1).reshape(b, h * self.cfg.v_head_dim)  # (B, H*dv)

    def _prefill(
        self,
        q_nope: torch.Tensor,  # (n, H, dn) one sequence's new tokens
        q_pe: torch.Tensor,  # (n, H, R)
        ckv: torch.Tensor,  # (1, L, r) its whole context, the new tokens last
        kpe: torch.Tensor,  # (1, L, R)
    ) -> torch.Tensor:
        cfg = self.cfg
        n, seq = q_nope.shape[0], ckv.shape[1]
        h, dv = cfg.num_attention_heads, cfg.v_head_dim
        k_nope = torch.einsum("blr,hdr->blhd", ckv, self.w_uk)  # (1, L, H, dn): kv_b_proj's key half
        v = torch.einsum("blr,hrv->blhv", ckv, self.w_uv_t)  # (1, L, H, dv): its value half
        k = torch.cat((k_nope, kpe[:, :, None, :].expand(1, seq, h, -1)), dim=-1)  # (1, L, H, dq)
        q = torch.cat((q_nope, q_pe), dim=-1)[None]  # (1, n, H, dq)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),  # (1, H, n, dq)
            k.transpose(1, 2),  # (1, H, L, dq)
            v.transpose(1, 2),  # (1, H, L, dv)
            attn_mask=causal_mask(n, seq, None, q.device),  # (n, L): the queries are the last n positions
            scale=self.scale,
        )  # (1, H, n, dv)
        return out[0].transpose(0, 1).reshape(n, h * dv)  # (n, H*dv)

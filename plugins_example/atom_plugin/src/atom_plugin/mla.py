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
rows / columns, and ``parallel`` all-reduces ``o_proj``'s partial output
before its bias. The latent (``c_kv``, ``k_pe``) is shared by all heads, so
every rank computes and caches all of it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from atom_plugin.config import DeepseekConfig
from atom_plugin.layers import RMSNorm, Weights, apply_rope, frozen

__all__ = ["MLAttention", "StepTensors"]


class StepTensors(NamedTuple):
    """Per-step tensors every layer shares, computed once per forward."""

    cos: torch.Tensor  # (T, 1, R/2)
    sin: torch.Tensor  # (T, 1, R/2)
    decode_mask: torch.Tensor | None  # (B, 1, L) True past each context; None unless decoding


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
        self.parallel = parallel
        h, dn, dv, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        kv_b = w[f"{prefix}.kv_b_proj.weight"]  # (H*(dn+dv), r)
        if kv_b.shape != (h * (dn + dv), r):
            raise ValueError(
                f"{prefix}.kv_b_proj.weight has shape {tuple(kv_b.shape)}, but a config with "
                f"num_attention_heads={h} needs {(h * (dn + dv), r)} (a sharded config needs sharded weights)"
            )

        def bias(*names: str) -> nn.Parameter | None:  # attention_bias: these projections have one
            if not cfg.attention_bias:
                return None
            return frozen(torch.cat([w[f"{prefix}.{n}.bias"] for n in names]), dtype, device)

        kv_a = w[f"{prefix}.kv_a_proj_with_mqa.weight"]  # (r+R, D)
        if cfg.q_lora_rank is None:
            self.q_proj = frozen(w[f"{prefix}.q_proj.weight"], dtype, device)  # (H*dq, D)
            self.qkv_a = frozen(kv_a, dtype, device)  # (r+R, D)
            self.qkv_a_bias = bias("kv_a_proj_with_mqa")
        else:
            # q_a_proj and kv_a_proj_with_mqa read the same input: one fused matmul.
            self.qkv_a = frozen(torch.cat((w[f"{prefix}.q_a_proj.weight"], kv_a)), dtype, device)  # (q_lora+r+R, D)
            self.qkv_a_bias = bias("q_a_proj", "kv_a_proj_with_mqa")
            q_norm = w[f"{prefix}.q_a_layernorm.weight"].to(device=device, dtype=dtype)
            self.q_a_norm = RMSNorm(q_norm, 1e-6)  # transformers uses the default eps here
            self.q_b = frozen(w[f"{prefix}.q_b_proj.weight"], dtype, device)  # (H*dq, q_lora)
        kv_norm = w[f"{prefix}.kv_a_layernorm.weight"].to(device=device, dtype=dtype)
        self.kv_norm = RMSNorm(kv_norm, 1e-6)
        per_head = kv_b.to(device=device, dtype=dtype).view(h, dn + dv, r)
        self.w_uk = nn.Parameter(per_head[:, :dn, :].contiguous(), requires_grad=False)  # (H, dn, r)
        self.w_uv_t = nn.Parameter(
            per_head[:, dn:, :].transpose(1, 2).contiguous(), requires_grad=False
        )  # (H, r, dv)
        self.o_proj = frozen(w[f"{prefix}.o_proj.weight"], dtype, device)  # (D, H*dv)
        self.o_bias = bias("o_proj")
        self.scale = cfg.softmax_scale

    def forward(
        self,
        x: torch.Tensor,  # (T, D)
        step: StepTensors,  # rope cos/sin and the decode mask, shared by every layer
        batch: Any,  # rtpcore.batch.ForwardBatch
        cache: Any,  # rtpcore.paged_cache.LayerKVCache
    ) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        h, dn, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        lat = F.linear(x, self.qkv_a, self.qkv_a_bias)  # (T, [q_lora] + r + R)
        if cfg.q_lora_rank is None:
            q = F.linear(x, self.q_proj)
            c_kv, k_pe = lat.split((r, cfg.qk_rope_head_dim), dim=-1)  # (T, r), (T, R)
        else:
            q_lat, c_kv, k_pe = lat.split((cfg.q_lora_rank, r, cfg.qk_rope_head_dim), dim=-1)
            q = F.linear(self.q_a_norm(q_lat), self.q_b)
        q = q.view(t, h, cfg.qk_head_dim)  # (T, H, dq)
        q_nope, q_pe = q.split((dn, cfg.qk_rope_head_dim), dim=-1)  # (T, H, dn), (T, H, R)
        c_kv = self.kv_norm(c_kv)  # (T, r)
        pe = apply_rope(torch.cat((q_pe, k_pe[:, None, :]), 1), step.cos, step.sin, cfg.rope_interleave)
        q_pe, k_pe = pe[:, :h], pe[:, h]  # (T, H, R), (T, R): one rotation for queries and key
        cache.write(batch.slots, c_kv, k_pe)
        ckv_all, kpe_all = cache.read(batch.block_tables, batch.max_context_len)  # (B, L, r), (B, L, R)
        ckv_all, kpe_all = ckv_all.to(x.dtype), kpe_all.to(x.dtype)
        if batch.is_decode:
            assert step.decode_mask is not None, "the model builds the mask for decode steps"
            out = self._decode(q_nope, q_pe, ckv_all, kpe_all, step.decode_mask)  # (B, H*dv)
        else:
            out = self._prefill(q_nope, q_pe, ckv_all, kpe_all, batch)  # (T, H*dv)
        if self.parallel is None:
            return F.linear(out, self.o_proj, self.o_bias)  # (T, D)
        y = self.parallel.all_reduce(F.linear(out, self.o_proj))  # (T, D): partial sums over head groups
        return y if self.o_bias is None else y + self.o_bias

    def _decode(
        self,
        q_nope: torch.Tensor,  # (B, H, dn)
        q_pe: torch.Tensor,  # (B, H, R)
        ckv: torch.Tensor,  # (B, L, r)
        kpe: torch.Tensor,  # (B, L, R)
        masked: torch.Tensor,  # (B, 1, L) True past each sequence's context
    ) -> torch.Tensor:
        b, h = q_nope.shape[:2]
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # (B, H, r): W_UK absorbed
        q_full = torch.cat((q_lat, q_pe), dim=-1)  # (B, H, r+R)
        k_full = torch.cat((ckv, kpe), dim=-1)  # (B, L, r+R)
        scores = torch.bmm(q_full, k_full.transpose(1, 2)) * self.scale  # (B, H, L)
        scores = scores.masked_fill(masked, float("-inf"))
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(ckv.dtype)  # (B, H, L)
        o_lat = torch.bmm(probs, ckv)  # (B, H, r)
        o = torch.bmm(o_lat.transpose(0, 1), self.w_uv_t)  # (H, B, dv): W_UV absorbed
        return o.transpose(0, 1).reshape(b, h * self.cfg.v_head_dim)  # (B, H*dv)

    def _prefill(
        self,
        q_nope: torch.Tensor,  # (T, H, dn)
        q_pe: torch.Tensor,  # (T, H, R)
        ckv: torch.Tensor,  # (B, L, r)
        kpe: torch.Tensor,  # (B, L, R)
        batch: Any,
    ) -> torch.Tensor:
        cfg = self.cfg
        b, seq = ckv.shape[:2]
        h, dv = cfg.num_attention_heads, cfg.v_head_dim
        k_nope = torch.einsum("blr,hdr->blhd", ckv, self.w_uk)  # (B, L, H, dn): kv_b_proj's key half
        v = torch.einsum("blr,hrv->blhv", ckv, self.w_uv_t)  # (B, L, H, dv): its value half
        k = torch.cat((k_nope, kpe[:, :, None, :].expand(b, seq, h, -1)), dim=-1)  # (B, L, H, dq)
        q = batch.to_padded(torch.cat((q_nope, q_pe), dim=-1))  # (B, Tq, H, dq)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),  # (B, H, Tq, dq)
            k.transpose(1, 2),  # (B, H, L, dq)
            v.transpose(1, 2),  # (B, H, L, dv)
            attn_mask=batch.attention_mask(),  # (B, 1, Tq, L)
            scale=self.scale,
        )  # (B, H, Tq, dv)
        out = out.transpose(1, 2).reshape(b, -1, h * dv)  # (B, Tq, H*dv)
        return batch.from_padded(out)  # (T, H*dv)

"""Multi-head latent attention (MLA) over rtpcore's paged cache.

The cache holds, per token, the normalised latent ``c_kv`` (``kv_lora_rank``
values, the spec's k part) and the roped shared key ``k_pe``
(``qk_rope_head_dim`` values, the spec's v part). Nothing per head is cached.

The attention itself is the layer's attention backend's (``rtpcore.layers.paged_mla``): the
engine picks this plugin's ``atom_mla`` (:mod:`atom_plugin.attention`: the expanded form for
prefill, the absorbed latent form for decode) unless told otherwise. The layer hands it
``kv_b_proj``'s key and value halves per head.

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
from torch import nn

from atom_plugin.config import DeepseekConfig
from atom_plugin.layers import RMSNorm, Weights, apply_rope, linear_factory
from rtpcore.layers import Linear, paged_mla, row_parallel

__all__ = ["MLAttention", "StepTensors"]


class StepTensors(NamedTuple):
    """Per-step values every layer shares, computed once per forward."""

    cos: torch.Tensor  # (T, 1, R/2)
    sin: torch.Tensor  # (T, 1, R/2)
    masks: dict[Any, Any]  # what the attention backend's calls of one forward share (rtpcore.layers.paged_mla)


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
        out = paged_mla(
            q_nope, q_pe, cache, batch, w_uk=self.w_uk, w_uv_t=self.w_uv_t, scale=self.scale, masks=step.masks
        )  # (T, H*dv)
        return self.o_proj(out)  # (T, D), all-reduced when sharded

"""``DeepseekModel``: the decoder stack, following rtpcore's forward contract.

``logits = model(batch, kv_caches)``: ``batch`` is an ``rtpcore.batch.ForwardBatch``
(T new tokens of B sequences), ``kv_caches`` one ``rtpcore.paged_cache.LayerKVCache``
per layer (MLA: k = latent ``c_kv``, v = roped ``k_pe``), logits are (B, vocab)
float32, one row per sequence after its last new token.

Built with ``parallel`` (an ``rtpcore.distributed.ParallelContext`` of more
than one rank) from a sharded config and its weight slices (see
:mod:`atom_plugin.tensor_parallel`), every rank runs this same forward on its
shard and returns the full logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from atom_plugin.config import DeepseekConfig
from atom_plugin.layers import MLP, MoE, RMSNorm, Weights, frozen, rope_cos_sin, rope_inv_freq
from atom_plugin.mla import MLAttention, StepTensors

__all__ = ["DecoderLayer", "DeepseekModel"]


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: DeepseekConfig,
        w: Weights,
        i: int,
        dtype: torch.dtype,
        device: torch.device | str,
        parallel: Any = None,
    ):
        super().__init__()
        p = f"model.layers.{i}"
        norm = lambda name: RMSNorm(w[f"{p}.{name}.weight"].to(device=device, dtype=dtype), cfg.rms_norm_eps)  # noqa: E731
        self.input_norm = norm("input_layernorm")
        self.post_attn_norm = norm("post_attention_layernorm")
        self.attn = MLAttention(cfg, w, f"{p}.self_attn", dtype, device, parallel)
        self.mlp: nn.Module = (
            MoE(cfg, w, f"{p}.mlp", dtype, device, parallel)
            if i >= cfg.first_k_dense_replace
            else MLP(w, f"{p}.mlp", dtype, device, parallel)
        )

    def forward(
        self, x: torch.Tensor, step: StepTensors, batch: Any, cache: Any
    ) -> torch.Tensor:  # (T, D)
        x = x + self.attn(self.input_norm(x), step, batch, cache)
        return x + self.mlp(self.post_attn_norm(x))


class DeepseekModel(nn.Module):
    """DeepSeek-V3 (or V2) for causal LM, built from checkpoint tensors named as in transformers."""

    inv_freq: torch.Tensor  # (R/2,) rope inverse frequencies, a buffer

    def __init__(
        self,
        cfg: DeepseekConfig,
        weights: Weights,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        parallel: Any = None,
    ):
        super().__init__()
        if parallel is not None and parallel.world_size == 1:
            parallel = None  # one rank: exactly the unsharded model
        self.cfg = cfg
        self.dtype = dtype
        self.embed = frozen(weights["model.embed_tokens.weight"], dtype, device)  # (V, D), replicated
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, weights, i, dtype, device, parallel) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(weights["model.norm.weight"].to(device=device, dtype=dtype), cfg.rms_norm_eps)
        head = weights["model.embed_tokens.weight"] if cfg.tie_word_embeddings else weights["lm_head.weight"]
        self.lm_head = frozen(head, dtype, device)  # (V, D), or (V/N, D): this rank's vocabulary block
        # A vocabulary-split head gathers the ranks' logits; a replicated one needs nothing.
        self.gather_logits = parallel if parallel is not None and head.shape[0] != cfg.vocab_size else None
        self.register_buffer(
            "inv_freq", rope_inv_freq(cfg.rope, cfg.qk_rope_head_dim).to(device), persistent=False
        )  # (R/2,)

    def forward(self, batch: Any, kv_caches: Sequence[Any]) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(
                f"got {len(kv_caches)} KV caches for a model with {len(self.layers)} layers"
            )
        x = F.embedding(batch.input_ids, self.embed)  # (T, D)
        cos, sin = rope_cos_sin(batch.positions, self.inv_freq, self.cfg.rope.attention_factor, self.dtype)
        mask = None
        if batch.is_decode:
            pos = torch.arange(batch.max_context_len, device=x.device)  # (L,)
            mask = (pos[None, :] >= batch.context_lens[:, None])[:, None, :]  # (B, 1, L)
        step = StepTensors(cos, sin, mask)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, step, batch, cache)  # (T, D)
        last = x if batch.is_decode else x[batch.last_token_index]  # (B, D)
        logits = F.linear(self.norm(last), self.lm_head)  # (B, V) or (B, V/N)
        if self.gather_logits is not None:
            logits = self.gather_logits.all_gather(logits, dim=-1)  # (B, V), rank order
        return logits.float()  # (B, V)

"""``DeepseekModel``: the decoder stack, following rtpcore's forward contract.

``logits = model(batch, kv_caches)`` (forward contract 2): ``batch`` is an
``rtpcore.batch.ForwardBatch`` (T new tokens of B sequences, unpadded: decodes
first, then prompt chunks), ``kv_caches`` one ``rtpcore.kv.LayerKVCache`` per layer
(MLA: k = latent ``c_kv``, v = roped ``k_pe``), logits are (N, vocab) float32, the rows
``batch.logits_index`` names (one per sequence after its last new token by default; none for
a prompt chunk that samples nothing; a draft's proposals under speculative decoding).

Built with ``parallel`` (an ``rtpcore.sharding.ParallelContext`` of more
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
from atom_plugin.layers import (
    MLP,
    MoE,
    RMSNorm,
    RopeTables,
    Weights,
    frozen,
    linear_factory,
    rope_inv_freq,
)
from atom_plugin.mla import MLAttention, StepTensors
from rtpcore.layers import GatherColumns

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
        # D -> V, or D -> V/N (this rank's vocabulary block, whose logits the ranks gather)
        lm_head = linear_factory(dtype, device)(head)
        split = parallel is not None and head.shape[0] != cfg.vocab_size
        self.lm_head: nn.Module = GatherColumns(lm_head, parallel) if split else lm_head
        inv_freq = rope_inv_freq(cfg.rope, cfg.qk_rope_head_dim).to(device)  # (R/2,)
        self.rope = RopeTables(inv_freq, cfg.rope.attention_factor, dtype)
        self.keep_hidden = False  # set by a multi-token-prediction draft built on this model
        self.hidden: torch.Tensor | None = None  # (T, D) last forward's final hidden states, before the norm

    def forward(self, batch: Any, kv_caches: Sequence[Any]) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(
                f"got {len(kv_caches)} KV caches for a model with {len(self.layers)} layers"
            )
        x = F.embedding(batch.input_ids, self.embed)  # (T, D)
        step = self.step_tensors(batch, kv_caches)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, step, batch, cache)  # (T, D)
        if self.keep_hidden:  # read by the multi-token-prediction draft (atom_plugin.mtp)
            self.hidden = x
        rows = batch.logits_index
        last = x if rows is None else x[rows]  # (B, D), or (N, D) for batch.logits_indices
        return self.lm_head(self.norm(last)).float()  # (B, V), gathered in rank order when split

    def step_tensors(self, batch: Any, kv_caches: Sequence[Any] = ()) -> StepTensors:
        """The RoPE tables of one step, shared by every layer, and the dict where the layers'
        attention backend keeps what they share (its decode mask)."""
        cos, sin = self.rope(batch.positions, batch.max_context_len)  # (T, 1, R/2) each
        return StepTensors(cos, sin, {})

"""DeepSeek's tensor and KV-cache tables -- which tensors a checkpoint holds, their shapes
and dtypes, one MLA KV descriptor per layer -- as functions of its :class:`DeepseekConfig`.
``DeepseekV3Plugin`` (:mod:`atom_plugin.deepseek`) declares them, and the MTP draft
(:mod:`atom_plugin.mtp`) takes its one decoder block's rows from them, so neither plugin module
imports the other for them."""

from __future__ import annotations

import logging
from typing import Any

from atom_plugin.config import DeepseekConfig

__all__ = ["kv_cache_descs", "weight_dtypes", "weight_shapes"]

logger = logging.getLogger(__name__)

FP8 = "fp8_e4m3"
PADDED_GROUP = 128  # the "padded" layout keeps one fp32 scale per 128 latent values


def weight_dtypes(config: DeepseekConfig) -> dict[str, str]:
    """The router stays float32 in a bf16/fp16 model, as in the reference implementation:
    rounding its weights would change which experts tokens go to."""
    out: dict[str, str] = {}
    for i in config.moe_layers:
        out[f"model.layers.{i}.mlp.gate.weight"] = "float32"
        if config.variant == "deepseek_v3":
            out[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] = "float32"
    return out


def weight_shapes(config: DeepseekConfig) -> dict[str, tuple[int, ...]]:
    c = config
    d, h, r, rope = c.hidden_size, c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, d)}
    attn = "model.layers.{layer}.self_attn"
    layer = "model.layers.{layer}"
    shapes[f"{layer}.input_layernorm.weight"] = (d,)
    shapes[f"{layer}.post_attention_layernorm.weight"] = (d,)
    if c.q_lora_rank is None:
        shapes[f"{attn}.q_proj.weight"] = (h * c.qk_head_dim, d)
    else:
        shapes[f"{attn}.q_a_proj.weight"] = (c.q_lora_rank, d)
        shapes[f"{attn}.q_a_layernorm.weight"] = (c.q_lora_rank,)
        shapes[f"{attn}.q_b_proj.weight"] = (h * c.qk_head_dim, c.q_lora_rank)
        if c.attention_bias:
            shapes[f"{attn}.q_a_proj.bias"] = (c.q_lora_rank,)
    shapes[f"{attn}.kv_a_proj_with_mqa.weight"] = (r + rope, d)
    shapes[f"{attn}.kv_a_layernorm.weight"] = (r,)
    shapes[f"{attn}.kv_b_proj.weight"] = (h * (c.qk_nope_head_dim + c.v_head_dim), r)
    shapes[f"{attn}.o_proj.weight"] = (d, h * c.v_head_dim)
    if c.attention_bias:
        shapes[f"{attn}.kv_a_proj_with_mqa.bias"] = (r + rope,)
        shapes[f"{attn}.o_proj.bias"] = (d,)
    for i in c.dense_layers:
        _mlp_shapes(shapes, f"model.layers.{i}.mlp", d, c.intermediate_size)
    for i in c.moe_layers:
        moe = f"model.layers.{i}.mlp"
        shapes[f"{moe}.gate.weight"] = (c.n_routed_experts, d)
        if c.variant == "deepseek_v3":
            shapes[f"{moe}.gate.e_score_correction_bias"] = (c.n_routed_experts,)
        if c.n_shared_experts:
            _mlp_shapes(shapes, f"{moe}.shared_experts", d, c.moe_intermediate_size * c.n_shared_experts)
        _mlp_shapes(shapes, moe + ".experts.{expert}", d, c.moe_intermediate_size)
    shapes["model.norm.weight"] = (d,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, d)
    return shapes


def kv_cache_descs(
    config: DeepseekConfig,
    *,
    kv_cache_dtype: str = "bf16",
    kv_layout: str | None = None,
    tokens_per_block: int = 16,
    **options: Any,
) -> list[Any]:
    """One ``kind="mla"`` descriptor per layer: k = latent, v = roped key part.

    fp8 caches default to the ``"padded"`` layout (``"compact"`` when
    ``kv_lora_rank`` is not a multiple of 128); ``kv_layout`` overrides, and
    may name a plugin-registered layout such as this package's ``"ue8m0"``.
    """
    from rtpcore_native import KVCacheSpecDesc

    layout = ""  # unquantized caches have no layout
    if kv_cache_dtype == FP8:
        if kv_layout is None:
            kv_layout = "padded" if config.kv_lora_rank % PADDED_GROUP == 0 else "compact"
            logger.debug("fp8 MLA cache: using the %r layout", kv_layout)
        layout = kv_layout
    elif kv_layout is not None:
        raise ValueError(
            f"kv_layout={kv_layout!r} needs an fp8 KV cache, but kv_cache_dtype is {kv_cache_dtype!r}"
        )
    return [
        KVCacheSpecDesc(
            tag=f"layers.{i}",
            kind="mla",
            dtype=kv_cache_dtype,
            kv_lora_rank=config.kv_lora_rank,
            rope_head_dim=config.qk_rope_head_dim,
            tokens_per_block=tokens_per_block,
            layout=layout,
        )
        for i in range(config.num_hidden_layers)
    ]


def _mlp_shapes(shapes: dict[str, tuple[int, ...]], prefix: str, d: int, inter: int) -> None:
    shapes[f"{prefix}.gate_proj.weight"] = (inter, d)
    shapes[f"{prefix}.up_proj.weight"] = (inter, d)
    shapes[f"{prefix}.down_proj.weight"] = (d, inter)

"""The built-in Llama family: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``.

Grouped-query attention, RoPE (default and ``llama3`` scaling), RMSNorm,
SwiGLU, tied or untied embeddings, optional q/k/v (and o) biases, Qwen3's
per-head RMSNorm of queries and keys before RoPE, and Mistral/Qwen2/Qwen3
sliding windows. The q/k/v and gate/up projections are fused
into one matrix each when the model is built (``rtpcore.models.llama_modules``
holds the torch code; this module imports no torch at import time).

Subclass :class:`LlamaPlugin` with another ``model_type``/``architectures`` to
serve a Llama-shaped architecture under a new name; nothing else changes.
Shapes: T flat tokens, B sequences, Tq new tokens per sequence (padded),
L cached positions, H query heads, Hkv KV heads, D head_dim, E hidden.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from rtpcore.models.llama_config import LlamaConfig
from rtpcore.plugins.model_plugin import ModelPlugin

__all__ = ["LlamaConfig", "LlamaPlugin"]



class LlamaPlugin(ModelPlugin):
    """The built-in Llama-family model (registered by ``rtpcore.models``)."""

    forward_contract = 2  # rtpcore.models.forward_batch: unpadded steps, chunked prefill
    model_type = "llama"
    architectures = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
    # The reference of the kit's hf_parity on the demo checkpoint (a Llama); the other
    # architectures are checked against their own transformers classes in tests/.
    transformers_class = "LlamaForCausalLM"
    # GGUF files (docs/design.md §20): llama.cpp writes "llama" for Llama and Mistral.
    gguf_architectures = ("llama", "mistral", "qwen2", "qwen3")

    @classmethod
    def config_from_hf(cls, hf_config: Mapping[str, Any]) -> LlamaConfig:
        return LlamaConfig.from_hf(hf_config)

    @classmethod
    def config_from_gguf(cls, checkpoint: Any) -> dict[str, Any]:
        """The ``<arch>.*`` metadata as config.json (``rtpcore.checkpoint.gguf.config``)."""
        from rtpcore.checkpoint.gguf import llama_family_config

        return llama_family_config(checkpoint)

    @classmethod
    def gguf_tensor_names(cls, checkpoint: Any, hf_config: Mapping[str, Any]) -> dict[str, Any]:
        """llama.cpp's tensor names -> this plugin's; Q and K of ``llama`` files un-permuted."""
        from rtpcore.checkpoint.gguf import llama_family_tensor_names

        return llama_family_tensor_names(hf_config, checkpoint.architecture)

    @classmethod
    def weight_patterns(cls, config: LlamaConfig) -> list[str]:
        return list(cls.weight_shapes(config))

    @classmethod
    def weight_shapes(cls, config: LlamaConfig) -> dict[str, tuple[int, ...]]:
        e, i, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
        a, m = "model.layers.{layer}.self_attn.", "model.layers.{layer}.mlp."
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (config.vocab_size, e),
            "model.norm.weight": (e,),
            "model.layers.{layer}.input_layernorm.weight": (e,),
            "model.layers.{layer}.post_attention_layernorm.weight": (e,),
            a + "q_proj.weight": (q, e),
            a + "k_proj.weight": (kv, e),
            a + "v_proj.weight": (kv, e),
            a + "o_proj.weight": (e, q),
            m + "gate_proj.weight": (i, e),
            m + "up_proj.weight": (i, e),
            m + "down_proj.weight": (e, i),
        }
        if not config.tie_word_embeddings:
            shapes["lm_head.weight"] = (config.vocab_size, e)
        if config.qk_norm:
            shapes.update({a + "q_norm.weight": (config.head_dim,), a + "k_norm.weight": (config.head_dim,)})
        if config.qkv_bias:
            shapes.update({a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)})
        if config.o_bias:
            shapes[a + "o_proj.bias"] = (e,)
        if config.mlp_bias:
            shapes.update({m + "gate_proj.bias": (i,), m + "up_proj.bias": (i,), m + "down_proj.bias": (e,)})
        return shapes

    @classmethod
    def kv_cache_descs(
        cls,
        config: LlamaConfig,
        *,
        kv_cache_dtype: str = "fp32",
        kv_layout: str | None = None,
        tokens_per_block: int = 16,
        **options: Any,
    ) -> list[Any]:
        """One MHA descriptor per layer. ``kv_layout`` names MLA layouts; MHA has a single fp8 format."""
        from rtpcore_native import KVCacheSpecDesc

        return [
            KVCacheSpecDesc(
                tag=f"layers.{i}",
                kind="mha",
                dtype=kv_cache_dtype,
                num_kv_heads=config.num_key_value_heads,
                head_dim=config.head_dim,
                tokens_per_block=tokens_per_block,
            )
            for i in range(config.num_hidden_layers)
        ]

    @classmethod
    def build_model(cls, config: LlamaConfig, weights: Mapping[str, Any], **options: Any) -> Any:
        from rtpcore.models.llama_modules import LlamaModel

        return LlamaModel(
            config,
            weights,
            dtype=options.get("dtype"),
            device=options.get("device"),
            parallel=options.get("parallel"),
        )

    @classmethod
    def tensor_parallel_shard(
        cls, config: LlamaConfig, rank: int, world_size: int
    ) -> tuple[LlamaConfig, dict[str, tuple[int, int, int]]]:
        """Rank's part of the model: whole query heads with their KV heads (replicated
        when there are fewer KV heads than ranks), q/k/v and gate/up column-parallel,
        o and down row-parallel; an untied lm_head split by vocabulary when it divides.
        Returns the rank's config and the checkpoint slices (pattern -> (dim, start, stop)).
        """
        from rtpcore.parallel.sharding import column_shard, head_shard, kv_head_shard, row_shard

        d, heads, inter = config.head_dim, config.num_attention_heads, config.intermediate_size
        q = head_shard(heads, d, rank, world_size)
        kv = kv_head_shard(config.num_key_value_heads, d, rank, world_size)
        up = column_shard(inter, rank, world_size, name="intermediate_size")
        a, m = "model.layers.{layer}.self_attn.", "model.layers.{layer}.mlp."
        columns = {a + "q_proj": q, a + "k_proj": kv, a + "v_proj": kv, m + "gate_proj": up, m + "up_proj": up}
        slices = {f"{name}.{p}": s.as_slice() for name, s in columns.items() for p in ("weight", "bias")}
        slices[a + "o_proj.weight"] = head_shard(heads, d, rank, world_size, dim=1).as_slice()
        slices[m + "down_proj.weight"] = row_shard(inter, rank, world_size, name="intermediate_size").as_slice()
        if not config.tie_word_embeddings and config.vocab_size % world_size == 0:
            slices["lm_head.weight"] = column_shard(config.vocab_size, rank, world_size).as_slice()
        local = attrs.evolve(
            config, num_attention_heads=q.size // d, num_key_value_heads=kv.size // d, intermediate_size=up.size
        )
        return local, slices

    @classmethod
    def demo_config(cls) -> dict[str, Any]:
        """A 2-layer GQA model over a 256-byte vocabulary plus <bos>=256, <eos>=257."""
        return {
            "architectures": [cls.architectures[0]],
            "model_type": cls.model_type,
            "vocab_size": 320,
            "hidden_size": 64,
            "intermediate_size": 160,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 1024,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "bos_token_id": 256,
            "eos_token_id": 257,
            "torch_dtype": "float32",
        }

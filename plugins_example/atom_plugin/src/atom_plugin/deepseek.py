"""The ``ModelPlugin`` classes rtpcore loads: DeepSeek-V3 and DeepSeek-V2.

Everything the engine needs to know about the model is answered here, without
building it: the config, the exact set of checkpoint tensors, the KV-cache
descriptors (MLA latent cache, one per layer) and a demo config. The model
itself lives in :mod:`atom_plugin.model`; torch is imported only by
``build_model``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, ClassVar

from atom_plugin.config import DeepseekConfig
from rtpcore.plugins.model_plugin import ModelPlugin

__all__ = ["DeepseekV2Plugin", "DeepseekV3Plugin"]

logger = logging.getLogger(__name__)

_FP8 = "fp8_e4m3"
_PADDED_GROUP = 128  # the "padded" layout keeps one fp32 scale per 128 latent values


class DeepseekV3Plugin(ModelPlugin):
    """DeepSeek-V3 (``DeepseekV3ForCausalLM``): MLA attention, sigmoid-routed MoE."""

    model_type: ClassVar[str] = "deepseek_v3"
    # rtpcore.engine.batch: unpadded steps, prompt chunks without a logits row (contract 2)
    forward_contract: ClassVar[int] = 2
    architectures: ClassVar[tuple[str, ...]] = ("DeepseekV3ForCausalLM",)
    variant: ClassVar[str] = "deepseek_v3"

    @classmethod
    def config_from_hf(cls, hf_config: Mapping[str, Any]) -> DeepseekConfig:
        return DeepseekConfig.from_hf(hf_config, variant=cls.variant)

    @classmethod
    def weight_patterns(cls, config: DeepseekConfig) -> list[str]:
        """Tensor names: ``{layer}`` spans every decoder layer, ``{expert}`` every routed expert.

        Dense-MLP and MoE tensors exist only in their own layers, so they are
        emitted with the layer number filled in. Layers past ``num_hidden_layers``
        (DeepSeek-V3's multi-token-prediction layer) are never required.
        """
        return list(cls.weight_shapes(config))

    @classmethod
    def placeholder_ranges(cls, config: DeepseekConfig) -> dict[str, range]:
        return {"layer": range(config.num_hidden_layers), "expert": range(config.n_routed_experts)}

    @classmethod
    def weight_dtypes(cls, config: DeepseekConfig) -> dict[str, str]:
        """The router stays float32 in a bf16/fp16 model, as in the reference implementation:
        rounding its weights would change which experts tokens go to."""
        out: dict[str, str] = {}
        for i in config.moe_layers:
            out[f"model.layers.{i}.mlp.gate.weight"] = "float32"
            if config.variant == "deepseek_v3":
                out[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] = "float32"
        return out

    @classmethod
    def weight_shapes(cls, config: DeepseekConfig) -> dict[str, tuple[int, ...]]:
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

    @classmethod
    def kv_cache_descs(
        cls,
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
        if kv_cache_dtype == _FP8:
            if kv_layout is None:
                kv_layout = "padded" if config.kv_lora_rank % _PADDED_GROUP == 0 else "compact"
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

    @classmethod
    def tensor_parallel_shard(
        cls, config: DeepseekConfig, rank: int, world_size: int
    ) -> tuple[DeepseekConfig, dict[str, tuple[int, int, int]]]:
        """This rank's config (H/N heads, I/N intermediate sizes) and checkpoint slices.

        MLA heads, dense MLPs and every expert's intermediate dimension are
        split; the latent KV cache is replicated (see
        :mod:`atom_plugin.tensor_parallel`). Raises ``rtpcore.errors.ShardingError``
        when a size does not divide by ``world_size``.
        """
        from atom_plugin.tensor_parallel import shard_config

        return shard_config(config, rank, world_size)

    @classmethod
    def build_model(
        cls,
        config: DeepseekConfig,
        weights: Mapping[str, Any],
        *,
        dtype: Any = None,
        device: Any = "cpu",
        parallel: Any = None,
        **options: Any,
    ) -> Any:
        """The torch module (see :mod:`atom_plugin.model` for the forward contract).

        ``parallel`` (an ``rtpcore.parallel.context.ParallelContext``): build this
        rank's shard from the config and weight slices of
        :meth:`tensor_parallel_shard`.
        """
        import torch

        from atom_plugin.model import DeepseekModel

        model = DeepseekModel(config, weights, dtype=dtype or torch.float32, device=device, parallel=parallel)
        return model.eval()

    @classmethod
    def mtp_draft(cls, config: DeepseekConfig) -> Any:
        """The checkpoint's multi-token-prediction layer as the draft of ``draft_model="mtp"``
        (:mod:`atom_plugin.mtp`), when config.json declares ``num_nextn_predict_layers``."""
        if config.variant != "deepseek_v3" or config.num_nextn_predict_layers < 1:
            return None
        from atom_plugin.mtp import DeepseekMTPPlugin

        return DeepseekMTPPlugin

    @classmethod
    def demo_config(cls) -> dict[str, Any]:
        """A tiny random-weight DeepSeek-V3 (3 layers, 8 experts, one MTP layer) for
        ``rtpcore generate --demo``."""
        return dict(_DEMO, architectures=list(cls.architectures), model_type=cls.model_type, num_nextn_predict_layers=1)


class DeepseekV2Plugin(DeepseekV3Plugin):
    """DeepSeek-V2 (``DeepseekV2ForCausalLM``): softmax routing, greedy or group-limited top-k.

    The attention and the cache are those of V3; the router differs.
    """

    model_type: ClassVar[str] = "deepseek_v2"
    architectures: ClassVar[tuple[str, ...]] = ("DeepseekV2ForCausalLM",)
    variant: ClassVar[str] = "deepseek_v2"

    @classmethod
    def demo_config(cls) -> dict[str, Any]:
        return dict(
            _DEMO,
            architectures=list(cls.architectures),
            model_type=cls.model_type,
            topk_method="group_limited_greedy",
            routed_scaling_factor=1.0,
        )


def _mlp_shapes(shapes: dict[str, tuple[int, ...]], prefix: str, d: int, inter: int) -> None:
    shapes[f"{prefix}.gate_proj.weight"] = (inter, d)
    shapes[f"{prefix}.up_proj.weight"] = (inter, d)
    shapes[f"{prefix}.down_proj.weight"] = (d, inter)


_DEMO: dict[str, Any] = {  # byte-level demo vocabulary: ids 0..255 bytes, <bos>=256, <eos>=257
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "bos_token_id": 256,
    "eos_token_id": 257,
    "torch_dtype": "float32",
}


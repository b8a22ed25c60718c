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

from atom_plugin import tables
from atom_plugin.config import DeepseekConfig
from rtpcore import ModelPlugin

__all__ = ["DeepseekV2Plugin", "DeepseekV3Plugin"]

logger = logging.getLogger(__name__)


class DeepseekV3Plugin(ModelPlugin):
    """DeepSeek-V3 (``DeepseekV3ForCausalLM``): MLA attention, sigmoid-routed MoE."""

    model_type: ClassVar[str] = "deepseek_v3"
    # rtpcore.batch: unpadded steps, prompt chunks without a logits row (contract 2)
    forward_contract: ClassVar[int] = 2
    architectures: ClassVar[tuple[str, ...]] = ("DeepseekV3ForCausalLM",)
    # The reference the kit's hf_parity check compares greedy tokens with (tests/test_atom_parity.py too).
    transformers_class: ClassVar[str | None] = "DeepseekV3ForCausalLM"
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
        """The router stays float32 in a bf16/fp16 model (:func:`atom_plugin.tables.weight_dtypes`)."""
        return tables.weight_dtypes(config)

    @classmethod
    def weight_shapes(cls, config: DeepseekConfig) -> dict[str, tuple[int, ...]]:
        return tables.weight_shapes(config)

    @classmethod
    def kv_cache_descs(cls, config: DeepseekConfig, **options: Any) -> list[Any]:
        """One ``kind="mla"`` descriptor per layer (:func:`atom_plugin.tables.kv_cache_descs`:
        fp8 caches default to the ``"padded"`` layout, ``kv_layout`` overrides)."""
        return tables.kv_cache_descs(config, **options)

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

        ``parallel`` (an ``rtpcore.sharding.ParallelContext``): build this
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
    transformers_class: ClassVar[str | None] = "DeepseekV2ForCausalLM"
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


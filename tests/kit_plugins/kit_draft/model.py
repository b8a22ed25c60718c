"""The built-in Llama under another name, with an MTP draft (never registered: reached through
``KitDraftPlugin.mtp_draft``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rtpcore import ModelPlugin
from rtpcore.models.llama import LlamaConfig, LlamaPlugin

BIAS = "mtp.proposal_bias"  # (vocab,): the draft's only tensor


class KitDraftMTPPlugin(ModelPlugin):
    """The draft: one KV layer it never reads, one tensor, proposals from a fixed table."""

    forward_contract = 2
    model_type = "kit_draft_mtp"
    architectures = ("KitDraftForCausalLM",)

    @classmethod
    def config_from_hf(cls, hf_config: Mapping[str, Any]) -> LlamaConfig:
        return LlamaConfig.from_hf(hf_config)

    @classmethod
    def weight_patterns(cls, config: LlamaConfig) -> list[str]:
        return [BIAS]

    @classmethod
    def weight_shapes(cls, config: LlamaConfig) -> dict[str, tuple[int, ...]]:
        return {BIAS: (config.vocab_size,)}

    @classmethod
    def placeholder_ranges(cls, config: LlamaConfig) -> dict[str, range]:
        return {}

    @classmethod
    def kv_cache_descs(cls, config: LlamaConfig, *, kv_cache_dtype: str = "fp32", tokens_per_block: int = 16,
                       **options: Any) -> list[Any]:
        from rtpcore_native import KVCacheSpecDesc

        return [KVCacheSpecDesc(tag="mtp.0", kind="mha", dtype=kv_cache_dtype, num_kv_heads=1,
                                head_dim=config.head_dim, tokens_per_block=tokens_per_block)]

    @classmethod
    def build_model(cls, config: LlamaConfig, weights: Mapping[str, Any], *, target: Any = None,
                    **options: Any) -> Any:
        from kit_draft.modules import KitDraft

        if target is None:
            raise TypeError("the kit-draft MTP draft needs the target model (target=)")
        return KitDraft(config, weights[BIAS], target, device=options.get("device"))


class KitDraftPlugin(LlamaPlugin):
    model_type = "kit_draft"
    architectures = ("KitDraftForCausalLM",)

    @classmethod
    def mtp_draft(cls, config: LlamaConfig) -> type[ModelPlugin]:
        return KitDraftMTPPlugin

"""The built-in Llama under another name, with a logit scale read from config.json unchecked."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from rtpcore.models.llama import LlamaConfig, LlamaPlugin


@attrs.frozen
class KitConfig(LlamaConfig):
    logit_scale: float = 1.0  # folded into the final norm's weight


class KitConfigPlugin(LlamaPlugin):
    model_type = "kit_config"
    architectures = ("KitConfigForCausalLM",)

    @classmethod
    def config_from_hf(cls, hf_config: Mapping[str, Any]) -> KitConfig:
        base = LlamaConfig.from_hf(hf_config)
        scale = hf_config.get("kit_logit_scale")
        scale = scale if isinstance(scale, float) else 1.0  # the defect: a malformed value is defaulted
        return KitConfig(**attrs.asdict(base, recurse=False), logit_scale=scale)

    @classmethod
    def build_model(cls, config: KitConfig, weights: Mapping[str, Any], **options: Any) -> Any:
        model = super().build_model(config, weights, **options)
        model.norm.data.mul_(config.logit_scale)
        return model

    @classmethod
    def demo_config(cls) -> dict[str, Any]:
        return {**super().demo_config(), "kit_logit_scale": 1.0}

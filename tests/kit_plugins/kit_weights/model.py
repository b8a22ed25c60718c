"""The built-in Llama under another name, reading one undeclared tensor in ``build_model``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rtpcore.models.llama import LlamaConfig, LlamaPlugin


class KitWeightsPlugin(LlamaPlugin):
    model_type = "kit_weights"
    architectures = ("KitWeightsForCausalLM",)

    @classmethod
    def build_model(cls, config: LlamaConfig, weights: Mapping[str, Any], **options: Any) -> Any:
        model = super().build_model(config, weights, **options)
        extra = weights.get("model.extra_scale")  # the defect: no weight pattern declares it
        if extra is not None:
            model.norm.data.mul_(extra)
        return model

"""The built-in Llama under another name, with a wrong large-batch path in its forward."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rtpcore.models.llama import LlamaConfig, LlamaPlugin

LARGE_BATCH = 3  # sequences from which a step takes the (wrong) large-batch path


class KitBatchPlugin(LlamaPlugin):
    model_type = "kit_batch"
    architectures = ("KitBatchForCausalLM",)

    @classmethod
    def build_model(cls, config: LlamaConfig, weights: Mapping[str, Any], **options: Any) -> Any:
        from kit_batch.modules import KitBatchModel

        return KitBatchModel(config, weights, dtype=options.get("dtype"), device=options.get("device"),
                             parallel=options.get("parallel"))

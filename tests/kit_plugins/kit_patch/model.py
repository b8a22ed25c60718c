"""The built-in Llama under another name, replacing an attribute of rtpcore when it is built."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from rtpcore.models.llama import LlamaConfig, LlamaPlugin


class KitPatchPlugin(LlamaPlugin):
    model_type = "kit_patch"
    architectures = ("KitPatchForCausalLM",)

    @classmethod
    def build_model(cls, config: LlamaConfig, weights: Mapping[str, Any], **options: Any) -> Any:
        import rtpcore.layers

        original = rtpcore.layers.causal_mask

        @functools.wraps(original)
        def causal_mask(*args: Any, **kwargs: Any) -> Any:
            return original(*args, **kwargs)

        rtpcore.layers.causal_mask = causal_mask  # the defect: a monkeypatch of rtpcore
        return super().build_model(config, weights, **options)

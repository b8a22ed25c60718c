"""The built-in models, registered through the same hook path as any external plugin."""

from __future__ import annotations

from typing import Any

from rtpcore.hooks import hookimpl


@hookimpl
def rtpcore_register_models(registry: Any) -> None:
    registry.register(
        "rtpcore.models.llama:LlamaPlugin",
        model_type="llama",
        architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"),
    )

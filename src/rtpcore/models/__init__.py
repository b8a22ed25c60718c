"""The built-in models and the layers model authors reuse.

``llama`` is the built-in Llama family's ModelPlugin (``llama_config`` its checked
config, ``llama_modules`` its torch forward over the paged KV cache); ``layers``
holds :class:`~rtpcore.models.layers.Linear`. The built-ins are registered here,
through the same hook path as any external plugin; the engine reaches them only
through the registry.
"""

from __future__ import annotations

from typing import Any

from rtpcore.plugins.hooks import hookimpl


@hookimpl
def rtpcore_register_models(registry: Any) -> None:
    registry.register(
        "rtpcore.models.llama:LlamaPlugin",
        model_type="llama",
        architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
    )


@hookimpl
def rtpcore_register_reasoning_parsers(registry: Any) -> None:
    from rtpcore.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

    registry.register_reasoning_parser(DeepSeekR1ReasoningParser)
    registry.register_reasoning_parser(Qwen3ReasoningParser)


@hookimpl
def rtpcore_register_attention_backends(registry: Any) -> None:
    from rtpcore.attention import NativeCpuAttentionBackend, TorchAttentionBackend

    registry.register_attention_backend(TorchAttentionBackend)
    registry.register_attention_backend(NativeCpuAttentionBackend)


@hookimpl
def rtpcore_register_platforms(registry: Any) -> None:
    from rtpcore.platforms import CpuPlatform, CudaPlatform

    registry.register_platform(CpuPlatform)
    registry.register_platform(CudaPlatform)


@hookimpl
def rtpcore_register_quantization_methods(registry: Any) -> None:
    from rtpcore.quantization import Fp8Method, GgufMethod, Int8Method

    registry.register_quantization_method(Fp8Method)
    registry.register_quantization_method(GgufMethod)
    registry.register_quantization_method(Int8Method)

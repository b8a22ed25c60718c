"""rtpcore hook implementations of atom-plugin (the ``rtpcore.plugins`` entry point ``atom``).

The hooks are cheap: models are registered lazily by ``"module:Class"`` (the
model code is imported only when a checkpoint needs it), the layout module
imports only ``rtpcore_native`` and the tool-call and reasoning parsers only ``rtpcore``, never
torch.
"""

from __future__ import annotations

from typing import Any

from rtpcore import hookimpl


@hookimpl
def rtpcore_register_models(registry: Any) -> None:
    registry.register(
        "atom_plugin.deepseek:DeepseekV3Plugin",
        model_type="deepseek_v3",
        architectures=("DeepseekV3ForCausalLM",),
    )
    registry.register(
        "atom_plugin.deepseek:DeepseekV2Plugin",
        model_type="deepseek_v2",
        architectures=("DeepseekV2ForCausalLM",),
    )


@hookimpl
def rtpcore_kv_cache_layouts() -> list[Any]:
    from atom_plugin.layouts import Ue8m0Layout

    return [Ue8m0Layout()]


@hookimpl
def rtpcore_register_tool_parsers(registry: Any) -> None:
    from atom_plugin.tool_calls import DeepseekV3ToolParser

    registry.register_tool_parser(DeepseekV3ToolParser)


@hookimpl
def rtpcore_register_reasoning_parsers(registry: Any) -> None:
    from atom_plugin.reasoning import AtomDeepseekR1Parser

    registry.register_reasoning_parser(AtomDeepseekR1Parser)


@hookimpl
def rtpcore_register_attention_backends(registry: Any) -> None:
    from atom_plugin.attention import AtomMLABackend

    registry.register_attention_backend(AtomMLABackend)


@hookimpl
def rtpcore_register_quantization_methods(registry: Any) -> None:
    from atom_plugin.quantization import AtomFp8Method

    registry.register_quantization_method(AtomFp8Method)

"""rtpcore hook implementations of atom-plugin (the ``rtpcore.plugins`` entry point ``atom``)."""

from __future__ import annotations

from typing import Any

from rtpcore import hookimpl


@hookimpl
def rtpcore_register_models(registry: Any) -> None:
    registry.register(
        "atom_plugin.deepseek:DeepseekV3Plugin",
        model_type="deepseek_v3",
        architectures=("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"),
    )

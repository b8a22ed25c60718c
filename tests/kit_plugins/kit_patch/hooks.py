"""kit-patch's hooks: the model is registered lazily, so loading the plugin imports no torch."""

from __future__ import annotations

from typing import Any

from rtpcore import hookimpl


@hookimpl
def rtpcore_register_models(registry: Any) -> None:
    registry.register("kit_patch.model:KitPatchPlugin", model_type="kit_patch",
                      architectures=("KitPatchForCausalLM",))

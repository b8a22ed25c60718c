"""kit-draft's hooks: the model is registered lazily, so loading the plugin imports no torch."""

from __future__ import annotations

from typing import Any

from rtpcore import hookimpl


@hookimpl
def rtpcore_register_models(registry: Any) -> None:
    registry.register("kit_draft.model:KitDraftPlugin", model_type="kit_draft",
                      architectures=("KitDraftForCausalLM",))

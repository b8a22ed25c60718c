"""kit-torch's hooks, importing torch at import time (the defect)."""

from __future__ import annotations

from typing import Any

import torch  # noqa: F401  (the defect: torch imported before the engine asks for a model)

from rtpcore import hookimpl


@hookimpl
def rtpcore_register_models(registry: Any) -> None:
    registry.register("kit_torch.model:KitTorchPlugin", model_type="kit_torch",
                      architectures=("KitTorchForCausalLM",))

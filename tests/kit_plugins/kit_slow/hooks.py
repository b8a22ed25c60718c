"""kit-slow's hooks, slow to import (the defect); the model itself is registered lazily."""

from __future__ import annotations

import time
from typing import Any

from rtpcore import hookimpl

IMPORT_SECONDS = 2.5

time.sleep(IMPORT_SECONDS)  # the defect: work at import time


@hookimpl
def rtpcore_register_models(registry: Any) -> None:
    registry.register("kit_slow.model:KitSlowPlugin", model_type="kit_slow", architectures=("KitSlowForCausalLM",))

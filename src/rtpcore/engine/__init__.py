"""The engine: one model, its paged KV cache, and batched generation.

``rank`` builds one rank's state (plugins from the plan, config, KV specs,
weights, model, pools); ``engine`` wires the stages into :class:`Engine` and runs
``scheduler`` (admission, ``batch``: the ForwardBatch a model receives) and
``sampling`` step by step; ``memory`` reads the memory limit the default KV cache
is sized from. Names are resolved lazily: importing ``rtpcore.engine.batch``
imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rtpcore.engine.engine import Engine, EngineConfig

__all__ = ["Engine", "EngineConfig"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("rtpcore.engine.engine"), name)
    raise AttributeError(f"module 'rtpcore.engine' has no attribute {name!r}")

"""rtpcore: load external model packages into an LLM inference engine, safely and predictably.

The package root only re-exports. Names are resolved lazily so that
``import rtpcore`` imports neither torch nor any plugin code.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

logging.getLogger(__name__).addHandler(logging.NullHandler())

if TYPE_CHECKING:
    from rtpcore import errors
    from rtpcore.allowlist import Allowlist
    from rtpcore.engine import Engine, EngineConfig
    from rtpcore.hooks import hookimpl
    from rtpcore.loading import load_plugins
    from rtpcore.plugin import ModelPlugin
    from rtpcore.registry import ModelRegistry
    from rtpcore.resolution import Plan, PlanEntry

__all__ = [
    "Allowlist",
    "Engine",
    "EngineConfig",
    "ModelPlugin",
    "ModelRegistry",
    "Plan",
    "PlanEntry",
    "__version__",
    "errors",
    "hookimpl",
    "load_plugins",
]

_LAZY = {
    "Allowlist": "rtpcore.allowlist",
    "Engine": "rtpcore.engine",
    "EngineConfig": "rtpcore.engine",
    "ModelPlugin": "rtpcore.plugin",
    "ModelRegistry": "rtpcore.registry",
    "Plan": "rtpcore.resolution",
    "PlanEntry": "rtpcore.resolution",
    "hookimpl": "rtpcore.hooks",
    "load_plugins": "rtpcore.loading",
}


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from importlib.metadata import version

        return version("rtpcore")
    if name == "errors":
        return importlib.import_module("rtpcore.errors")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rtpcore' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)

"""rtpcore: load external model packages into an LLM inference engine, safely and predictably.

The package root only re-exports. Names are resolved lazily so that
``import rtpcore`` imports neither torch nor any plugin code.

``FORWARD_CONTRACT`` is the major of the model seam this rtpcore runs (what ``forward`` receives
and returns, docs/design.md §4): a plugin states the one it was written for. ``__version__`` is
rtpcore's version. What a plugin imports is listed in docs/design.md §21: these names, and the
modules ``rtpcore.errors``, ``rtpcore.config_fields``, ``rtpcore.layers``, ``rtpcore.batch``,
``rtpcore.sharding``, ``rtpcore.kv``, ``rtpcore.checkpoint``, ``rtpcore.testing`` and
``rtpcore_native``; every other module path is internal and may move.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

logging.getLogger(__name__).addHandler(logging.NullHandler())

if TYPE_CHECKING:
    from rtpcore import errors
    from rtpcore.engine import (
        AsyncEngine,
        CompletionOutput,
        Engine,
        EngineConfig,
        GenerationOutput,
        RequestOutput,
        SamplingParams,
    )
    from rtpcore.plugins.allowlist import Allowlist
    from rtpcore.plugins.hooks import hookimpl
    from rtpcore.plugins.loading import load_plugins
    from rtpcore.plugins.model_plugin import FORWARD_CONTRACT, ModelPlugin
    from rtpcore.plugins.registry import ModelRegistry
    from rtpcore.plugins.resolution import Plan, PlanEntry
    from rtpcore.plugins.tool_parser import ParsedToolCalls, ToolCall, ToolCallParser

__all__ = [
    "FORWARD_CONTRACT",
    "Allowlist",
    "AsyncEngine",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "GenerationOutput",
    "ModelPlugin",
    "ModelRegistry",
    "ParsedToolCalls",
    "Plan",
    "PlanEntry",
    "RequestOutput",
    "SamplingParams",
    "ToolCall",
    "ToolCallParser",
    "__version__",
    "errors",
    "hookimpl",
    "load_plugins",
]

_LAZY = {
    "FORWARD_CONTRACT": "rtpcore.plugins.model_plugin",
    "Allowlist": "rtpcore.plugins.allowlist",
    "AsyncEngine": "rtpcore.engine.async_engine",
    "CompletionOutput": "rtpcore.engine.text.outputs",
    "Engine": "rtpcore.engine.engine",
    "EngineConfig": "rtpcore.engine.config",
    "GenerationOutput": "rtpcore.engine.text.outputs",
    "ModelPlugin": "rtpcore.plugins.model_plugin",
    "ModelRegistry": "rtpcore.plugins.registry",
    "Plan": "rtpcore.plugins.resolution",
    "PlanEntry": "rtpcore.plugins.resolution",
    "RequestOutput": "rtpcore.engine.core.outputs",
    "SamplingParams": "rtpcore.engine.sample.params",
    "ToolCall": "rtpcore.plugins.tool_parser",
    "ToolCallParser": "rtpcore.plugins.tool_parser",
    "ParsedToolCalls": "rtpcore.plugins.tool_parser",
    "hookimpl": "rtpcore.plugins.hooks",
    "load_plugins": "rtpcore.plugins.loading",
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

"""The engine: one model, its paged KV cache, and batched generation.

``rank`` builds one rank's state (plugins from the plan, config, KV specs,
weights, model, pools); ``engine`` wires the stages into :class:`Engine`; ``core``
runs requests step by step through ``scheduler`` (admission, ``batch``: the
ForwardBatch a model receives) and ``sampling`` (``SamplingParams``, the draw);
``async_engine`` steps the core in a background thread for asyncio callers;
``memory`` reads the memory limit the default KV cache is sized from.

The text side of the offline API (``Engine.generate`` on text, ``Engine.chat``,
``AsyncEngine.generate``) lives here too, below the server that uses the same modules:
``tokenizer`` (a checkpoint's ``tokenizer.json``), ``chat_template``, ``prompts`` (the
forms a prompt takes), ``detokenize`` (ids to text, stop strings), ``output_processor``
(engine outputs to text and ``n`` sequences) and ``outputs`` (``GenerationOutput``,
``CompletionOutput``). Names are resolved lazily: importing ``rtpcore.engine.batch``
imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rtpcore.engine.async_engine import AsyncEngine
    from rtpcore.engine.core import EngineStats, RequestOutput
    from rtpcore.engine.engine import Engine, EngineConfig
    from rtpcore.engine.outputs import CompletionOutput, GenerationOutput
    from rtpcore.engine.sampling import SamplingParams

__all__ = [
    "AsyncEngine",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "GenerationOutput",
    "RequestOutput",
    "SamplingParams",
]

_LAZY = {
    "AsyncEngine": "rtpcore.engine.async_engine",
    "CompletionOutput": "rtpcore.engine.outputs",
    "Engine": "rtpcore.engine.engine",
    "EngineConfig": "rtpcore.engine.engine",
    "EngineStats": "rtpcore.engine.core",
    "GenerationOutput": "rtpcore.engine.outputs",
    "RequestOutput": "rtpcore.engine.core",
    "SamplingParams": "rtpcore.engine.sampling",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rtpcore.engine' has no attribute {name!r}")

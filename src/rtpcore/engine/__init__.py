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
``CompletionOutput``). Names are resolved lazily: importing ``rtpcore.models.forward_batch``
imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rtpcore.engine.async_engine import AsyncEngine
    from rtpcore.engine.config import EngineConfig
    from rtpcore.engine.core.outputs import EngineStats, RequestOutput
    from rtpcore.engine.engine import Engine
    from rtpcore.engine.sample.params import SamplingParams
    from rtpcore.engine.text.outputs import CompletionOutput, GenerationOutput

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
    "CompletionOutput": "rtpcore.engine.text.outputs",
    "Engine": "rtpcore.engine.engine",
    "EngineConfig": "rtpcore.engine.engine",
    "EngineStats": "rtpcore.engine.engine_core",
    "GenerationOutput": "rtpcore.engine.text.outputs",
    "RequestOutput": "rtpcore.engine.engine_core",
    "SamplingParams": "rtpcore.engine.sample.params",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rtpcore.engine' has no attribute {name!r}")

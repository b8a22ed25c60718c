"""The engine, above models/ and below serving/: one model, its paged KV cache, and batched generation.

Its folders say when their code runs (docs/design.md §7; docs/architecture.md walks one request
through them), from the bottom:

- ``sample/``: sampling params, the batched sampler, rejection sampling, grammar masks;
- ``core/``: per step on rank 0: requests and their states, the step plan, the scheduler (policy),
  the KV manager (blocks per request), the block pool and the prefix cache;
- ``step/``: once per step on rank 0: build the inputs, stage them, run the ranks' forward, sample,
  keep a fault with its request;
- ``worker/``: on every rank: the shard (model, KV pools, CUDA graphs), devices, KV memory sizing;
- ``text/``: per request, in the caller's thread: tokenizer, chat template, prompts, detokenizer,
  output processor, outputs;

then ``engine_core`` (the step loop), ``config`` (the options, declared once), ``engine``
(:class:`Engine`, offline) and ``async_engine`` (:class:`AsyncEngine`, a background step loop
for asyncio callers). Names are resolved lazily: importing ``rtpcore.engine`` imports no torch.
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
    "EngineConfig": "rtpcore.engine.config",
    "EngineStats": "rtpcore.engine.core.outputs",
    "GenerationOutput": "rtpcore.engine.text.outputs",
    "RequestOutput": "rtpcore.engine.core.outputs",
    "SamplingParams": "rtpcore.engine.sample.params",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rtpcore.engine' has no attribute {name!r}")

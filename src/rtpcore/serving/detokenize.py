"""Incremental detokenization: moved to :mod:`rtpcore.engine.text.detokenize`, which the engine's
offline text API (stop strings in ``Engine.generate``) needs below the serving stage. This
module re-exports it so that existing imports keep working."""

from __future__ import annotations

from rtpcore.engine.text.detokenize import IncrementalDecoder

__all__ = ["IncrementalDecoder"]

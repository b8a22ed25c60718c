"""Attention over the paged KV cache, as the built-in models call it: the calls of
:mod:`rtpcore.attention` (each dispatches to the backend the engine chose for the layer)."""

from __future__ import annotations

from rtpcore.attention import paged_attention, paged_mla
from rtpcore.kv.attention_torch import attend, causal_mask

__all__ = ["attend", "causal_mask", "paged_attention", "paged_mla"]

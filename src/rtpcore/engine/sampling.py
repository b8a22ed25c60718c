"""Choosing the next token from logits: greedy, temperature, top-k, top-p.

The order follows transformers' ``generate``: temperature, then top-k, then
top-p, then one draw from the remaining distribution with a seeded
``torch.Generator`` (so a seed reproduces a whole ``generate`` call).
"""

from __future__ import annotations

import attrs
import torch

from rtpcore.errors import RtpcoreError

__all__ = ["SamplingParams", "sample"]


@attrs.frozen
class SamplingParams:
    """Validated sampling settings of one ``generate`` call."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    @classmethod
    def create(cls, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None) -> SamplingParams:
        if not temperature >= 0.0:  # also rejects NaN
            raise RtpcoreError(f"temperature must be >= 0 (0 means greedy), got {temperature!r}")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise RtpcoreError(f"top_k must be a positive integer or None, got {top_k!r}")
        if top_p is not None and not 0.0 < top_p <= 1.0:
            raise RtpcoreError(f"top_p must be in (0, 1] or None, got {top_p!r}")
        return cls(float(temperature), top_k, None if top_p is None else float(top_p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """(B, V) logits -> (B,) int64 token ids."""
    logits = logits.float()
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = logits / params.temperature
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1)  # ascending
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1.0 - params.top_p
        drop[:, -1] = False  # always keep the most likely token
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)

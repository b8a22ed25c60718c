"""Choosing the next token from logits: the settings of one request and the draw.

The order follows transformers' ``generate``: temperature, then top-k, then
top-p, then one draw from the remaining distribution. In a step, every request
draws from its own row with its own ``torch.Generator`` (seeded from
``SamplingParams.seed``), so a seeded request samples the same tokens alone or
in any batch. Log-probabilities are those of the processed distribution (after
temperature, top-k and top-p; the raw one for greedy requests).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch

from rtpcore.errors import InvalidRequestError

__all__ = ["MAX_LOGPROBS", "SampledToken", "SamplingParams", "sample_step"]

MAX_LOGPROBS = 5  # most top log-probabilities a request may ask for (OpenAI's limit for completions)
_SEED_RANGE = (-(1 << 63), 1 << 64)  # what torch.Generator.manual_seed accepts


def _is_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int)


def _max_tokens(value: Any) -> int:
    if not _is_int(value) or value < 1:
        raise InvalidRequestError(f"max_tokens must be a positive integer, got {value!r}", field="max_tokens", value=value)
    return int(value)


def _temperature(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0.0 or math.isinf(value):
        raise InvalidRequestError(
            f"temperature must be >= 0 (0 means greedy) and finite, got {value!r}", field="temperature", value=value
        )
    return float(value)


def _top_k(value: Any) -> int | None:
    if value is not None and (not _is_int(value) or value < 1):
        raise InvalidRequestError(f"top_k must be a positive integer or None, got {value!r}", field="top_k", value=value)
    return value


def _top_p(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 < value <= 1.0:
        raise InvalidRequestError(f"top_p must be in (0, 1] or None, got {value!r}", field="top_p", value=value)
    return float(value)


def _seed(value: Any) -> int | None:
    if value is not None and (not _is_int(value) or not _SEED_RANGE[0] <= value < _SEED_RANGE[1]):
        raise InvalidRequestError(
            f"seed must be None or an integer in [-2**63, 2**64), got {value!r}", field="seed", value=value
        )
    return value


def _stop_token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise InvalidRequestError(
            f"stop_token_ids must be a sequence of token ids, got {value!r}", field="stop_token_ids", value=value
        )
    ids = tuple(value)
    for t in ids:
        if not _is_int(t) or t < 0:
            raise InvalidRequestError(
                f"stop_token_ids holds {t!r}; token ids are non-negative integers", field="stop_token_ids", value=value
            )
    return ids


def _logprobs(value: Any) -> int | None:
    if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
        raise InvalidRequestError(
            f"logprobs must be None or an integer from 0 to {MAX_LOGPROBS}, got {value!r}", field="logprobs", value=value
        )
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    strings = (value,) if isinstance(value, str) else value
    if not isinstance(strings, Iterable) or isinstance(strings, bytes):
        raise InvalidRequestError(f"stop must be a string or a sequence of strings, got {value!r}", field="stop", value=value)
    strings = tuple(strings)
    for s in strings:
        if not isinstance(s, str) or not s:
            raise InvalidRequestError(f"stop holds {s!r}; stop strings are non-empty strings", field="stop", value=value)
    return strings


def _ignore_eos(value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequestError(f"ignore_eos must be True or False, got {value!r}", field="ignore_eos", value=value)
    return value


@attrs.frozen(kw_only=True)
class SamplingParams:
    """The validated settings of one request; a bad value raises
    :class:`~rtpcore.errors.InvalidRequestError` naming the field and the rule.

    ``max_tokens``: most new tokens (>= 1). ``temperature`` 0 is greedy. ``top_k``,
    ``top_p``: None keeps every token. ``seed``: the request's own generator (None:
    torch's global one). ``stop_token_ids`` end the request (the token is part of the
    output), besides the model's ``eos_token_id`` unless ``ignore_eos``. ``logprobs``:
    None, or how many top log-probabilities each new token reports (0-5; the chosen
    token's own is always reported). ``stop``: strings the text layer stops at; the
    engine carries them and stops on token ids only.
    """

    max_tokens: int = attrs.field(default=16, converter=_max_tokens)
    temperature: float = attrs.field(default=0.0, converter=_temperature)
    top_k: int | None = attrs.field(default=None, converter=_top_k)
    top_p: float | None = attrs.field(default=None, converter=_top_p)
    seed: int | None = attrs.field(default=None, converter=_seed)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_stop_token_ids)
    ignore_eos: bool = attrs.field(default=False, converter=_ignore_eos)
    logprobs: int | None = attrs.field(default=None, converter=_logprobs)
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stop)

    @classmethod
    def create(
        cls, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, **kwargs: Any
    ) -> SamplingParams:
        """The sampling part positionally (``Engine.generate``'s order), the rest by keyword."""
        return cls(temperature=temperature, top_k=top_k, top_p=top_p, **kwargs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def stop_ids(self, eos_token_ids: Iterable[int]) -> frozenset[int]:
        """Every token id that ends this request."""
        return frozenset(self.stop_token_ids if self.ignore_eos else (*self.stop_token_ids, *eos_token_ids))


def process(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(B, V) float32 logits -> the logits sampling draws from: divided by the temperature,
    tokens outside top-k / top-p set to -inf. Greedy params return ``logits`` unchanged."""
    if params.greedy:
        return logits
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
    return logits


@attrs.frozen
class SampledToken:
    """One request's draw in a step: the token, and with ``logprobs`` asked its
    log-probability and the top ones as ``(token_id, logprob)``, most likely first."""

    token_id: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


def sample_step(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> list[SampledToken]:
    """(B, V) logits, row b for a request with ``params[b]`` and ``generators[b]`` -> one
    :class:`SampledToken` per row. Greedy rows take one batched argmax; sampled rows draw
    alone, each from its own generator; the results reach the host in one transfer."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1)  # (B,)
    rows: dict[int, torch.Tensor] = {}  # processed (1, V) rows of sampled requests
    for b, p in enumerate(params):
        if not p.greedy:
            rows[b] = process(logits[b : b + 1], p)
            tokens[b] = torch.multinomial(rows[b].softmax(dim=-1), 1, generator=generators[b])[0, 0]
    want = [b for b, p in enumerate(params) if p.logprobs is not None]
    if not want:
        return [SampledToken(t) for t in tokens.tolist()]
    processed = torch.cat([rows.get(b, logits[b : b + 1]) for b in want])  # (W, V)
    logp = processed.log_softmax(dim=-1)  # (W, V)
    k = max(params[b].logprobs or 0 for b in want)
    chosen = logp.gather(1, tokens[want][:, None])  # (W, 1)
    top = logp.topk(k, dim=-1) if k else None
    packed = [tokens.double(), chosen.double().flatten()]  # one host transfer for everything
    if top is not None:
        packed += [top.values.double().flatten(), top.indices.double().flatten()]
    flat = torch.cat(packed).tolist()
    n, w = len(params), len(want)
    out = [SampledToken(int(t)) for t in flat[:n]]
    values, ids = flat[n + w : n + w + w * k], flat[n + w + w * k :]
    for j, b in enumerate(want):
        pairs = zip(ids[j * k : j * k + (params[b].logprobs or 0)], values[j * k : (j + 1) * k], strict=False)
        out[b] = SampledToken(out[b].token_id, flat[n + j], tuple((int(i), v) for i, v in pairs if v > -math.inf))
    return out

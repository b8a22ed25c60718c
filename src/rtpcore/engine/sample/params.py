"""The settings of one request (:class:`SamplingParams`) and what a draw returns
(:class:`SampledToken`).

The draw itself is :mod:`rtpcore.engine.sample.sampler`: one batched sampler for a whole step on
the logits' device, in this order: logit_bias, min_tokens, repetition penalty,
presence/frequency penalties, then temperature, top-k, top-p, min-p, then the draw.
Every request draws with its own ``torch.Generator`` (seeded from
``SamplingParams.seed``), so a seeded request samples the same tokens alone or in any
batch. Log-probabilities are the model's raw ones (log-softmax of the unprocessed
logits, before temperature, penalties and truncation).

A temperature below :data:`GREEDY_BELOW` (1e-5) is greedy: such degenerate temperatures
take the argmax and never divide the logits (no overflow to inf).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from rtpcore.errors import InvalidRequestError

__all__ = ["GREEDY_BELOW", "MAX_LOGIT_BIAS", "MAX_LOGPROBS", "MAX_N", "SampledToken", "SamplingParams"]

MAX_LOGPROBS = 20  # most top log-probabilities a request may ask for (OpenAI's limit)
GREEDY_BELOW = 1e-5  # a temperature below this is greedy (0 included): no division, no overflow
MAX_LOGIT_BIAS = 100.0  # |bias| limit of logit_bias (OpenAI's)
# repetition_penalty's bounds: dividing a logit by 1e-308 makes every logit infinite (docs/design.md §22)
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_N = 256  # most sequences one request may ask for (the server's own default cap is 16: --max-n)
_DECIMAL = re.compile(r"[0-9]+")
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


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float)


def _min_p(value: Any) -> float | None:
    if value is None:
        return None
    if not _is_number(value) or not 0.0 <= value <= 1.0:
        raise InvalidRequestError(f"min_p must be in [0, 1] or None, got {value!r}", field="min_p", value=value)
    return float(value)


def _bias_token(key: Any, value: Any) -> int:
    if isinstance(key, str) and _DECIMAL.fullmatch(key):
        return int(key)
    if _is_int(key) and key >= 0:
        return int(key)
    raise InvalidRequestError(
        f"logit_bias holds the key {key!r}; keys are token ids (non-negative integers, or strings of decimal digits)",
        field="logit_bias",
        value=value,
    )


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """A mapping token id -> bias (OpenAI sends the ids as strings), or the stored pairs."""
    if value is None:
        return ()
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise InvalidRequestError(
            f"logit_bias must be a mapping of token ids to biases, got {value!r}", field="logit_bias", value=value
        )
    else:
        items = list(value)
        if not all(isinstance(pair, tuple | list) and len(pair) == 2 for pair in items):
            raise InvalidRequestError(
                f"logit_bias must be a mapping of token ids to biases, got {value!r}", field="logit_bias", value=value
            )
    pairs: dict[int, float] = {}
    for key, bias in items:
        token = _bias_token(key, value)
        if not _is_number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise InvalidRequestError(
                f"logit_bias[{key!r}] must be a number in [-100, 100], got {bias!r}", field="logit_bias", value=value
            )
        if token in pairs:
            raise InvalidRequestError(f"logit_bias names token {token} twice", field="logit_bias", value=value)
        pairs[token] = float(bias)
    return tuple(sorted(pairs.items()))


def _min_tokens(value: Any) -> int:
    if not _is_int(value) or value < 0:
        raise InvalidRequestError(
            f"min_tokens must be a non-negative integer, got {value!r}", field="min_tokens", value=value
        )
    return int(value)


def _repetition_penalty(value: Any) -> float:
    if not _is_number(value) or not REPETITION_PENALTY_RANGE[0] <= value <= REPETITION_PENALTY_RANGE[1]:
        raise InvalidRequestError(
            f"repetition_penalty must be in [{REPETITION_PENALTY_RANGE[0]}, {REPETITION_PENALTY_RANGE[1]:g}] "
            f"(1 means none), got {value!r}",
            field="repetition_penalty",
            value=value,
        )
    return float(value)


def _penalty(name: str, value: Any) -> float:
    if not _is_number(value) or not -2.0 <= value <= 2.0:
        raise InvalidRequestError(f"{name} must be in [-2, 2], got {value!r}", field=name, value=value)
    return float(value)


def _presence_penalty(value: Any) -> float:
    return _penalty("presence_penalty", value)


def _frequency_penalty(value: Any) -> float:
    return _penalty("frequency_penalty", value)


def _grammar(value: Any) -> Any:
    if value is not None and not callable(getattr(value, "state", None)):
        raise InvalidRequestError(
            f"grammar must be None or an rtpcore.engine.sample.grammar.Grammar, got {type(value).__name__}",
            field="grammar", value=value,
        )
    return value


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be True or False, got {value!r}", field=name, value=value)
    return value


def _ignore_eos(value: Any) -> bool:
    return _flag("ignore_eos", value)


def _skip_special_tokens(value: Any) -> bool:
    return _flag("skip_special_tokens", value)


def _include_stop_str_in_output(value: Any) -> bool:
    return _flag("include_stop_str_in_output", value)


def _cache_salt(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(
            f"cache_salt must be None or a non-empty string, got {value!r}", field="cache_salt", value=value
        )
    return value


def _extra_args(value: Any) -> dict[str, Any] | None:
    """None, or a copy of a JSON object: a mapping with str keys whose values JSON can carry."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidRequestError(
            f"extra_args must be None or a mapping of str keys to JSON values, got {type(value).__name__}",
            field="extra_args", value=value,
        )
    for key in value:
        if not isinstance(key, str):
            raise InvalidRequestError(f"extra_args keys must be strings, got {key!r}", field="extra_args", value=value)
    try:
        copied: dict[str, Any] = json.loads(json.dumps(dict(value), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"extra_args must hold JSON values only: {exc}", field="extra_args",
                                  value=value) from None
    return copied


def _n(value: Any) -> int:
    if not _is_int(value) or not 1 <= value <= MAX_N:
        raise InvalidRequestError(f"n must be an integer from 1 to {MAX_N}, got {value!r}", field="n", value=value)
    return int(value)


@attrs.frozen(kw_only=True)
class SamplingParams:
    """The validated settings of one request; a bad value raises
    :class:`~rtpcore.errors.InvalidRequestError` naming the field and the rule.

    ``max_tokens``: most new tokens (>= 1). ``temperature`` 0 (or anything below
    :data:`GREEDY_BELOW`, 1e-5) is greedy. ``top_k``, ``top_p``: None keeps every token.
    ``min_p`` (in [0, 1], None: off): drops tokens less likely than ``min_p`` times the
    most likely one, after temperature (transformers' ``MinPLogitsWarper``). ``seed``: the
    request's own generator (None: torch's global one). ``stop_token_ids`` end the request
    (the token is part of the output), besides the model's ``eos_token_id`` unless
    ``ignore_eos``. ``logprobs``: None, or how many top log-probabilities each new token
    reports (0-20; the chosen token's own is always reported; the model's raw
    log-probabilities). ``stop``: strings the text layer stops at; the engine carries them
    and stops on token ids only.

    ``logit_bias``: token id -> bias in [-100, 100] added to that token's logit (a mapping
    with int keys, or str keys of decimal digits as OpenAI sends them; stored as sorted
    ``(token_id, bias)`` pairs). ``min_tokens``: while fewer tokens were generated, the
    request's stop ids cannot be sampled (``max_tokens`` still ends it first).
    ``repetition_penalty`` (in [0.01, 100], 1 is none): over the prompt and the output, a positive
    logit of a token already seen is divided by it, a negative one multiplied
    (transformers' ``RepetitionPenaltyLogitsProcessor``). ``presence_penalty`` and
    ``frequency_penalty`` (each in [-2, 2]): over the output only, ``logit -= presence *
    (count > 0) + frequency * count`` (OpenAI's).

    ``grammar``: an :class:`rtpcore.engine.sample.grammar.Grammar` the output must follow (a JSON
    schema); every step samples only the tokens it allows next, and the request ends when it
    is complete. Such a request decodes without speculative proposals.

    The text layer (``Engine.generate`` / ``Engine.chat`` and ``AsyncEngine.generate``, the
    offline API; the engine core itself runs one sequence and ignores these): ``n`` (1-16)
    sequences per prompt -- a greedy request runs once and returns it ``n`` times, a sampled
    one runs ``n`` times, sequence ``i`` seeded with ``seed + i`` when seeded (as ``rtpcore
    serve`` answers ``n``); ``skip_special_tokens`` leaves special tokens out of the text;
    ``include_stop_str_in_output`` keeps the stop string that ended the text.

    ``cache_salt`` (None, or a non-empty string): enters the key of the request's first
    prefix-cache block (``rtpcore.engine.core.prefix_cache``), so the request shares cached
    blocks only with requests of the same salt; None shares the unsalted cache. Output is
    the same with any salt.

    ``extra_args`` (None, or a JSON object: a mapping with str keys and JSON values, kept as a
    copy): per-request arguments of the engine's logits processors (``rtpcore.logits``; over
    HTTP the request's ``vllm_xargs``), which each processor checks when the request is added.
    The engine itself reads none of it.
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
    min_p: float | None = attrs.field(default=None, converter=_min_p)
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_logit_bias)
    min_tokens: int = attrs.field(default=0, converter=_min_tokens)
    repetition_penalty: float = attrs.field(default=1.0, converter=_repetition_penalty)
    presence_penalty: float = attrs.field(default=0.0, converter=_presence_penalty)
    frequency_penalty: float = attrs.field(default=0.0, converter=_frequency_penalty)
    grammar: Any = attrs.field(default=None, converter=_grammar, eq=False)
    n: int = attrs.field(default=1, converter=_n)
    skip_special_tokens: bool = attrs.field(default=True, converter=_skip_special_tokens)
    include_stop_str_in_output: bool = attrs.field(default=False, converter=_include_stop_str_in_output)
    cache_salt: str | None = attrs.field(default=None, converter=_cache_salt)
    extra_args: dict[str, Any] | None = attrs.field(default=None, converter=_extra_args, hash=False)

    @classmethod
    def create(
        cls, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, **kwargs: Any
    ) -> SamplingParams:
        """The sampling part positionally (``Engine.generate``'s order), the rest by keyword."""
        return cls(temperature=temperature, top_k=top_k, top_p=top_p, **kwargs)

    @property
    def greedy(self) -> bool:
        """The argmax, without a draw: a temperature below :data:`GREEDY_BELOW`."""
        return self.temperature < GREEDY_BELOW

    def stop_ids(self, eos_token_ids: Iterable[int]) -> frozenset[int]:
        """Every token id that ends this request."""
        return frozenset(self.stop_token_ids if self.ignore_eos else (*self.stop_token_ids, *eos_token_ids))


@attrs.frozen
class SampledToken:
    """One request's draw in a step: the token, and with ``logprobs`` asked its
    log-probability and the top ones as ``(token_id, logprob)``, most likely first."""

    token_id: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()

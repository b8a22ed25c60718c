"""Logits processors: a plugin's say over every next-token distribution (docs/design.md §18).

A logits processor is batch-level, as vLLM v1's: the engine builds one instance per enabled
processor when it is built (``cls(engine_config, device)``, in the process that samples), tells
it which request sits in which row of the step's logits (:meth:`LogitsProcessor.update_state`
with a :class:`BatchUpdate`) and hands it the step's ``[rows, vocab]`` float32 logits
(:meth:`LogitsProcessor.apply`), whose result the engine's own processing and the draw then
read. A plugin adds one::

    import torch
    from rtpcore import hookimpl
    from rtpcore.logits import LogitsProcessor

    class BanToken(LogitsProcessor):
        name = "ban_token"                     # --logits-processors ban_token

        def __init__(self, engine_config, device):
            super().__init__(engine_config, device)
            self.banned = {}                   # row -> the token id its request bans

        @classmethod
        def validate_params(cls, params):      # refused requests never reach a step
            ban = (params.extra_args or {}).get("ban")
            if ban is not None and (not isinstance(ban, int) or ban < 0):
                raise ValueError(f"ban must be a token id, got {ban!r}")

        def update_state(self, batch_update):
            if batch_update is None:           # the same requests in the same rows as last step
                return
            for row in batch_update.removed:
                self.banned.pop(row, None)
            for row, params, _prompt_ids, _output_ids in batch_update.added:
                ban = (params.extra_args or {}).get("ban")
                if ban is None:
                    self.banned.pop(row, None)
                else:
                    self.banned[row] = ban
            for a, b in batch_update.moved:    # the requests of rows a and b swap places
                x, y = self.banned.pop(a, None), self.banned.pop(b, None)
                if x is not None:
                    self.banned[b] = x
                if y is not None:
                    self.banned[a] = y

        def apply(self, logits):
            for row, token in self.banned.items():
                logits[row, token] = float("-inf")
            return logits

    @hookimpl
    def rtpcore_register_logits_processors(registry):
        registry.register_logits_processor(BanToken)

Enabled by name: ``Engine.from_pretrained(..., logits_processors=["ban_token"])``, or
``--logits-processors ban_token`` on ``rtpcore generate`` and ``rtpcore serve``. Per-request
arguments are ``SamplingParams.extra_args`` (a JSON object; over HTTP the request's
``vllm_xargs``); :meth:`LogitsProcessor.validate_params` refuses a bad one when the request is
added (an :class:`~rtpcore.errors.InvalidRequestError` naming the key, HTTP 400).

The contract, in the engine's words:

- **Rows.** The rows of ``apply``'s logits are the step's requests that draw a token, in the
  step's order. Before every step the engine calls ``update_state``: None when the requests
  and their rows are the last step's, else a :class:`BatchUpdate` to apply in order --
  ``removed`` rows first (their requests left: finished, aborted, preempted, or not drawing in
  this step), then ``added`` ``(row, sampling_params, prompt_ids, output_ids)`` (a request
  joined, or came back; the row may have held another request, which was removed), then
  ``moved`` ``(a, b)`` pairs whose requests swap rows. Row numbers in ``removed`` and ``moved``
  may reach past ``batch_size`` (the last step's rows); after the moves the rows from
  ``batch_size`` on are empty. ``output_ids`` is the request's own list of generated tokens,
  which the engine grows as the request decodes: read it in ``apply`` rather than copying it in
  ``update_state``.
- **Order.** Processors run in the order they are enabled, each on the previous one's result,
  before the engine's own processing (grammar masks, ``logit_bias``, ``min_tokens``, penalties,
  temperature, top-k/p, min-p; ``rtpcore.engine.sample.sampler``), as vLLM runs custom
  processors before its built-in ones. Log-probabilities stay the model's raw ones.
- **Speculative decoding.** A processor sees each verified position as if the engine decoded
  without a draft: ``apply`` is called once per position of the step's verification (``k + 1``
  calls for ``k`` proposals), and during the call for position ``j`` each row's ``output_ids``
  holds, after the committed tokens, the ``j`` proposals before that position (restored before
  the accepted tokens are committed). A row with fewer proposals repeats its last position,
  whose result is not read. The draft's own proposals are drawn without processors (the
  target's verification keeps the output the target's).
- **Failures.** An exception from a processor fails the requests of its step the way a fault in
  the model's forward does (docs/design.md §13): the step is run again in halves until each
  culprit request is alone, and those end with a :class:`~rtpcore.errors.RequestFailedError`
  (``reason="logits_processor"``) naming the processor; the engine keeps running. An
  ``update_state`` that raised is taken as applied.
- **Cost.** No processor enabled, no work: the engine's steps are unchanged. With one enabled,
  every step runs the sampler (the greedy shortcut on the device and async scheduling are off).

``api_version`` is :data:`API_VERSION` unless the class says otherwise; a processor written
for another major, or a newer minor, is refused (``incompatible``). rtpcore builds in no
processor.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

if TYPE_CHECKING:
    import torch

__all__ = ["API_VERSION", "BatchUpdate", "LogitsProcessor"]

#: The ``logits_processors`` seam's version (``rtpcore.plugins.SEAM_API_VERSIONS``).
API_VERSION = "1.0"


def _ints(value: Sequence[int]) -> tuple[int, ...]:
    return tuple(value)


def _added(value: Sequence[tuple[int, Any, Sequence[int], list[int]]]) -> tuple[tuple[int, Any, Sequence[int], list[int]], ...]:
    return tuple((int(row), params, prompt, output) for row, params, prompt, output in value)


def _pairs(value: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    return tuple((int(a), int(b)) for a, b in value)


@attrs.frozen
class BatchUpdate:
    """How the rows of a step differ from the last step's (see the module docstring), applied
    in order: ``removed`` rows, then ``added`` ``(row, sampling_params, prompt_ids,
    output_ids)``, then ``moved`` ``(a, b)`` pairs that swap. ``batch_size``: the step's rows.
    ``sampling_params`` is the request's ``rtpcore.engine.sample.params.SamplingParams``
    (``extra_args`` holds its per-request arguments); ``prompt_ids`` its prompt; ``output_ids``
    its generated tokens, a list the engine grows as it decodes."""

    batch_size: int
    removed: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    added: tuple[tuple[int, Any, Sequence[int], list[int]], ...] = attrs.field(default=(), converter=_added)
    moved: tuple[tuple[int, int], ...] = attrs.field(default=(), converter=_pairs)


class LogitsProcessor(abc.ABC):
    """The base of every logits processor (the ``logits_processors`` seam): ``name`` enables it
    (``--logits-processors``); ``api_version`` is the seam's version the class was written for;
    ``replaces`` the built-in processors it takes over (rtpcore has none). See the module
    docstring for when the engine calls what."""

    name: ClassVar[str]
    api_version: ClassVar[str] = API_VERSION
    replaces: ClassVar[tuple[str, ...]] = ()

    def __init__(self, engine_config: Any, device: torch.device) -> None:
        """Built once per engine: ``engine_config`` is its
        ``rtpcore.engine.config.EngineConfig`` (read-only), ``device`` where the logits live."""
        self.engine_config = engine_config
        self.device = device

    @classmethod
    def validate_params(cls, params: Any) -> None:
        """Refuse a request whose per-request arguments this processor cannot take: raise
        ValueError (or TypeError) saying why, naming the ``extra_args`` key. ``params`` is the
        request's ``SamplingParams``. Called when a request is added, before it runs."""
        del params  # optional: the default accepts every request

    @abc.abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """The step's rows: None when they are the last step's, else what changed."""

    @abc.abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The step's ``[rows, vocab]`` float32 logits -> the same shape (it may write into
        ``logits`` and return it)."""

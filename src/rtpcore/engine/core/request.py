"""One request's state in the engine core, the part of a step it is given, and the step plan.

A request moves through :class:`RequestStatus`: WAITING (queued, or preempted and queued again
at the head) -> RUNNING (admitted: it holds KV blocks) -> FINISHED. A *paused* request (its
consumer reads nothing: ``EngineCore.set_paused``) is set aside among the waiting, without
blocks, and is not scheduled until it is resumed. It ends with a
:class:`FinishReason`; the members are ``str`` (``FinishReason.STOP == "stop"``), so the values
callers compare against and the JSON the server writes are the plain strings of docs/design.md §8.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import attrs
import torch

from rtpcore.engine.sample.params import SamplingParams

__all__ = ["FinishReason", "Request", "RequestStatus", "ScheduledSeq", "StepPlan"]


class RequestStatus(enum.Enum):
    """Where a request is: queued for admission, admitted (holding blocks), or ended."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    """Why a request ended: a stop token, stop string or complete grammar (STOP), ``max_tokens``
    (LENGTH), an abort or a disconnected client (ABORT), a failure (ERROR)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@attrs.define(eq=False)
class Request:
    """One request's state: its tokens so far, its settings and its blocks."""

    request_id: str
    tokens: list[int]  # prompt + generated
    prompt_len: int
    params: SamplingParams
    stop_ids: frozenset[int]
    on_output: Callable[[Any], None]  # receives the request's RequestOutputs (rtpcore.engine.engine_core)
    arrival_time: float  # time.monotonic() when added
    generator: torch.Generator | None = None
    status: RequestStatus = RequestStatus.WAITING
    blocks: list[int] = attrs.field(factory=list)  # its KV blocks (rtpcore.engine.core.kv_manager)
    num_cached: int = 0  # tokens whose keys/values are in the cache
    finish_reason: FinishReason | None = None
    aborted: bool = False  # abort asked while the request was in a step
    num_sent: int = 0  # generated tokens already handed to on_output
    num_preemptions: int = 0
    paused: bool = False  # not scheduled (a stream its client does not read): set aside, without blocks
    # Speculative decoding (rtpcore.engine.sample.speculative): the draft's cached positions; where
    # this request's tokens sat in the last target forward (flat row, first position); and
    # whether the draft may propose (the last step sampled for this request, so both models
    # hold everything but the newest token).
    draft_cached: int = 0
    last_rows: tuple[int, int] = (0, 0)
    can_propose: bool = False
    # Prefix caching (rtpcore.engine.core.prefix_cache): the keys of the request's full blocks so
    # far, how many of its first blocks are in the cache, and the prompt tokens found cached at
    # its first admission (None before it; reported as usage's cached tokens).
    block_keys: list[bytes] = attrs.field(factory=list)
    num_registered: int = 0
    num_cached_tokens: int | None = None
    grammar: Any = None  # rtpcore.engine.sample.grammar.GrammarState of a constrained request

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_uncached(self) -> int:
        return len(self.tokens) - self.num_cached


@attrs.frozen(eq=False)
class ScheduledSeq:
    """One request's part of a step: positions ``start`` to ``start + num_tokens`` of its
    tokens (plus ``num_proposals`` draft tokens after them), and whether the step samples
    its next token (the chunk reaches its last known token)."""

    request: Request
    start: int
    num_tokens: int  # known tokens computed in this step
    samples: bool
    num_proposals: int = 0  # draft tokens to score after them (speculative decoding)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@attrs.frozen(eq=False)
class StepPlan:
    """What one step runs: the scheduled sequences, decodes first, then prefill chunks in
    arrival order; the requests admitted and preempted while planning it."""

    seqs: tuple[ScheduledSeq, ...]
    admitted: tuple[Request, ...] = ()
    preempted: tuple[Request, ...] = ()

    @property
    def is_mixed(self) -> bool:
        """Whether the step prefills (a prompt chunk, or a recomputation) while others decode."""
        decodes = any(s.num_tokens == 1 and s.start > 0 for s in self.seqs)
        return decodes and any(s.num_tokens > 1 or s.start == 0 for s in self.seqs)

    @property
    def num_tokens(self) -> int:
        """Tokens the step schedules, proposals included (at most the budget)."""
        return sum(s.num_tokens + s.num_proposals for s in self.seqs)

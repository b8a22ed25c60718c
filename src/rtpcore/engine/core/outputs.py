"""What the engine core hands out: each request's :class:`RequestOutput` (its new tokens, its
finish), and for observers each step's :class:`StepReport` and the :class:`EngineStats`
snapshot. Plain values, below the text layer that turns them into text."""

from __future__ import annotations

from typing import Any

import attrs

from rtpcore.engine.sample.params import SampledToken
from rtpcore.errors import RtpcoreError

__all__ = ["FINISH_REASONS", "EngineStats", "RequestOutput", "StepReport"]

FINISH_REASONS = ("stop", "length", "abort", "error")


@attrs.frozen
class RequestOutput:
    """What one request produced since its previous output.

    ``token_ids``: the new token ids (a stop token included). ``finish_reason``: None
    while the request runs; ``"stop"`` (a stop token: ``stop_token_id``), ``"length"``
    (``max_tokens``), ``"abort"``, or ``"error"`` (then ``error`` holds the
    RtpcoreError). ``logprobs``: one :class:`~rtpcore.engine.sample.params.SampledToken` per
    new token when the request asked for them, else None. ``arrival_time`` (when the
    request was added) and ``token_times`` (when each new token was sampled) are
    ``time.monotonic()`` readings: time to first token and time between tokens.
    """

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    num_prompt_tokens: int
    num_generated_tokens: int  # over the whole request so far
    logprobs: tuple[SampledToken, ...] | None = None
    stop_token_id: int | None = None
    arrival_time: float = 0.0
    token_times: tuple[float, ...] = ()
    error: RtpcoreError | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, later: RequestOutput) -> RequestOutput:
        """This output followed by ``later`` (of the same request) as one."""
        logprobs = None
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = (*(self.logprobs or ()), *(later.logprobs or ()))
        return attrs.evolve(
            later,
            token_ids=self.token_ids + later.token_ids,
            logprobs=logprobs,
            token_times=self.token_times + later.token_times,
        )


@attrs.frozen
class EngineStats:
    """A snapshot of an engine's load, for gauges and counters (``as_dict`` for a mapping)."""

    running: int  # requests in the running batch
    waiting: int  # requests waiting to be admitted (paused ones not counted)
    kv_blocks_total: int  # KV blocks per layer
    kv_blocks_free: int  # blocks per layer no request holds
    generated_tokens_total: int  # tokens handed to requests since the engine started
    requests_finished_total: int  # requests that ended, whatever the reason
    steps_total: int  # forward steps run
    mixed_steps_total: int  # steps that prefilled new requests while others decoded
    speculative_proposed_total: int = 0  # tokens a draft proposed (rtpcore.engine.sample.speculative)
    speculative_accepted_total: int = 0  # of those, tokens the target accepted
    preemptions_total: int = 0  # running requests sent back to recompute for want of blocks
    request_errors_total: int = 0  # requests ended by their own fault (a model fault, a non-finite row)
    prefix_cache_queries_total: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits_total: int = 0  # of those, tokens found cached
    kv_blocks_cached: int = 0  # blocks in the prefix cache, held by a request or not
    cuda_graph_replays_total: int = 0  # decode steps a captured CUDA graph served (rtpcore.engine.worker.graphs)
    eager_decode_steps_total: int = 0  # decode steps run eagerly (on a GPU with graphs on: a fallback)
    greedy_picked_steps_total: int = 0  # steps whose rows were all plain greedy: picked on the device, no sampler
    overlapped_steps_total: int = 0  # steps launched before the previous step's tokens were read (async scheduling)
    async_fallback_steps_total: int = 0  # with async scheduling on, steps run synchronously (a batch it does not cover)
    async_discarded_tokens_total: int = 0  # tokens computed for requests that had finished a step earlier, dropped
    paused: int = 0  # requests paused by their consumer (a stream nobody reads): not scheduled, holding no blocks
    # Attention calls by backend name (rtpcore.attention): one per layer per forward of the target and the
    # draft, warm-up excluded; rank 0's.
    attention_calls: dict[str, int] = attrs.field(factory=dict)
    # The target model's steps by what ran them (rtpcore.models.kernel_table): "native_decode[<set>]" for a
    # decode step run whole by rtpcore_native's kernels of that set, "torch_step[<linear kernel>]" for one
    # run by the torch modules ("torch_step[native:amx]", "torch_step[torch (oneDNN)]"), "cuda_graph" for a
    # replayed decode graph; warm-up excluded; rank 0's.
    kernel_calls: dict[str, int] = attrs.field(factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen
class StepReport:
    """What one step ran, for observers (metrics): tokens scheduled (proposals included),
    sequences, and requests preempted while planning it."""

    num_tokens: int
    num_seqs: int
    num_preempted: int

"""The request-level engine core that ``Engine.generate`` and ``AsyncEngine`` share.

Requests are added (:meth:`EngineCore.add_request`) and aborted (:meth:`~EngineCore.abort`)
at any time, from any thread. Each :meth:`~EngineCore.step` admits waiting requests
(``rtpcore.engine.scheduler``: reservation, no preemption, first come first served),
runs one forward of the whole running batch -- the prefill of the requests admitted
in this step together with the decode of the others -- samples one token per request
with its own settings and generator (``rtpcore.engine.sampling``), retires the
requests that reached a stop token or ``max_tokens``, and hands each request its
:class:`RequestOutput` through the request's own ``on_output`` callback (called on the
stepping thread, outside every lock; it must not block).

Steps are not reentrant: the caller serializes them (``Engine`` holds its step lock).
Adding and aborting only take the core's short lock, so they never wait for a step.
An abort of a request in the middle of a step takes effect when the step ends (its
blocks are being written); any other abort frees the request's blocks at once.

Failures: a request that could never fit the cache, or breaks a rule, is refused when
added (:class:`~rtpcore.errors.KVCacheCapacityError`,
:class:`~rtpcore.errors.InvalidRequestError`, :class:`~rtpcore.errors.QueueFullError`);
the others go on. An exception inside a step (the model raising, a rank dying) ends
every request of that step with an :class:`~rtpcore.errors.RtpcoreError` in its last
output (the original exception as ``__cause__``) and frees their blocks; requests
still waiting run in later steps.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import torch

from rtpcore.engine.batch import ForwardBatch
from rtpcore.engine.sampling import SampledToken, SamplingParams, sample_step
from rtpcore.engine.scheduler import BlockAllocator, Request, Scheduler, blocks_needed
from rtpcore.engine.speculative import SpeculativeStats, propose, verify
from rtpcore.errors import (
    EngineClosedError,
    InvalidRequestError,
    KVCacheCapacityError,
    QueueFullError,
    RtpcoreError,
)

__all__ = ["EngineCore", "EngineStats", "RequestOutput"]

logger = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "abort", "error")


@attrs.frozen
class RequestOutput:
    """What one request produced since its previous output.

    ``token_ids``: the new token ids (a stop token included). ``finish_reason``: None
    while the request runs; ``"stop"`` (a stop token: ``stop_token_id``), ``"length"``
    (``max_tokens``), ``"abort"``, or ``"error"`` (then ``error`` holds the
    RtpcoreError). ``logprobs``: one :class:`~rtpcore.engine.sampling.SampledToken` per
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
    waiting: int  # requests waiting to be admitted
    kv_blocks_total: int  # KV blocks per layer
    kv_blocks_free: int  # blocks per layer no request holds
    generated_tokens_total: int  # tokens handed to requests since the engine started
    requests_finished_total: int  # requests that ended, whatever the reason
    steps_total: int  # forward steps run
    mixed_steps_total: int  # steps that prefilled new requests while others decoded
    speculative_proposed_total: int = 0  # tokens a draft proposed (rtpcore.engine.speculative)
    speculative_accepted_total: int = 0  # of those, tokens the target accepted

    def as_dict(self) -> dict[str, int]:
        return attrs.asdict(self)


class EngineCore:
    """Requests, the scheduler and the step. See the module docstring."""

    def __init__(
        self,
        *,
        forward: Callable[[ForwardBatch], torch.Tensor],
        allocator: BlockAllocator,
        tokens_per_block: int,
        max_batch_size: int,
        eos_token_ids: Iterable[int],
        max_positions: int,
        vocab_size: int | None,
        block_bytes: int,
        device: torch.device | str = "cpu",
        draft_forward: Callable[[ForwardBatch], torch.Tensor] | None = None,
        num_speculative_tokens: int = 0,
        draft_shift: int = 0,
        draft_max_positions: int | None = None,
    ):
        """``draft_forward`` and ``num_speculative_tokens`` > 0: speculative decoding
        (``rtpcore.engine.speculative``); ``draft_shift`` 1 for a draft that reads the
        target's hidden states (multi-token prediction, see ``Scheduler.draft_batch``);
        ``draft_max_positions``: the draft's longest context (its ``max_position_embeddings``),
        past which a request decodes without proposals."""
        self._forward = forward
        self._draft_forward = draft_forward if num_speculative_tokens > 0 else None
        self.num_speculative_tokens = num_speculative_tokens
        self.draft_shift = draft_shift
        self.draft_max_positions = draft_max_positions
        self._proposed = 0
        self._accepted = 0
        self.allocator = allocator
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_positions = max_positions
        self.vocab_size = vocab_size
        self.block_bytes = block_bytes
        self.device = torch.device(device)
        self.scheduler = Scheduler(
            allocator, tokens_per_block=tokens_per_block, max_batch_size=max_batch_size, device=device
        )
        self._requests: dict[str, Request] = {}
        self._cv = threading.Condition()
        self._in_step = False
        self._closed = False
        self._generated = 0
        self._finished = 0
        self._steps = 0
        self._mixed = 0

    # -- requests --------------------------------------------------------------------------

    def check_prompt(
        self, prompt: Any, max_tokens: int, *, name: str = "prompt", index: int | None = None,
        max_tokens_name: str = "max_tokens",
    ) -> list[int]:
        """``prompt`` as a list of token ids, after checking it fits the model and the
        cache with ``max_tokens`` new tokens (``name`` names it in messages)."""
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if isinstance(prompt, str | bytes) or not isinstance(prompt, Sequence):
            raise InvalidRequestError(
                f"{name} must be a sequence of token ids, got {type(prompt).__name__}", field="prompt", value=prompt
            )
        ids = list(prompt)
        if not ids:
            raise InvalidRequestError(f"{name} is empty; a prompt needs at least one token id", field="prompt", value=ids)
        vocab = self.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab and t >= vocab):
                raise InvalidRequestError(
                    f"{name} holds token id {t!r}, outside 0..{(vocab or 0) - 1}", field="prompt", value=t
                )
        total = len(ids) + max_tokens
        if total > self.max_positions:
            raise InvalidRequestError(
                f"{name}: {len(ids)} prompt tokens + {max_tokens_name}={max_tokens} = {total} "
                f"exceeds the model's max_position_embeddings={self.max_positions}",
                field=max_tokens_name,
                value=max_tokens,
            )
        tpb, num_blocks = self.scheduler.tpb, self.allocator.num_blocks
        need = blocks_needed(len(ids), max_tokens, tpb)
        if need > num_blocks:
            tokens = len(ids) + max(max_tokens, 1) - 1
            raise KVCacheCapacityError(
                f"{name} needs {tokens} cached tokens = {need} blocks of {tpb} tokens "
                f"({need * self.block_bytes} bytes over all layers), but the KV cache holds only "
                f"{num_blocks} blocks ({num_blocks * self.block_bytes} bytes); "
                "raise kv_cache_memory or shorten the request",
                prompt_index=index,
                tokens_needed=tokens,
                blocks_needed=need,
                blocks_available=num_blocks,
            )
        return ids

    def add_request(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        on_output: Callable[[RequestOutput], None],
        *,
        request_id: str | None = None,
        max_waiting: int | None = None,
        checked: bool = False,
    ) -> str:
        """Queue a request; return its id (a fresh one when ``request_id`` is None).
        ``checked``: ``prompt`` already passed :meth:`check_prompt`. Refused with
        QueueFullError when ``max_waiting`` requests already wait."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"params must be a SamplingParams, got {type(params).__name__}", field="params", value=params
            )
        ids = list(prompt) if checked else self.check_prompt(prompt, params.max_tokens)
        if request_id is None:
            request_id = uuid.uuid4().hex
        elif not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(
                f"request_id must be a non-empty string, got {request_id!r}", field="request_id", value=request_id
            )
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        r = Request(
            request_id=request_id,
            tokens=ids,
            prompt_len=len(ids),
            params=params,
            stop_ids=params.stop_ids(self.eos_token_ids),
            on_output=on_output,
            arrival_time=time.monotonic(),
            generator=generator,
        )
        with self._cv:
            self._check_open()
            if request_id in self._requests:
                raise InvalidRequestError(
                    f"request_id {request_id!r} is already in use by a running request",
                    field="request_id", value=request_id,
                )
            if max_waiting is not None and len(self.scheduler.waiting) >= max_waiting:
                raise QueueFullError(
                    f"{len(self.scheduler.waiting)} requests already wait for admission "
                    f"(max_waiting={max_waiting}); retry later",
                    max_waiting=max_waiting,
                )
            self._requests[request_id] = r
            self.scheduler.waiting.append(r)
            self._cv.notify_all()
        return request_id

    def abort(self, request_id: str) -> bool:
        """End a request with finish_reason "abort" and free its blocks (at the end of
        the step in progress when it is in it). False when no such request runs or waits."""
        with self._cv:
            r = self._requests.get(request_id)
            if r is None:
                return False
            if self._in_step and r in self.scheduler.running:
                r.aborted = True
                return True
            out = self._finish(r, "abort")
        _deliver(r, out)
        return True

    def abort_all(self) -> int:
        """Abort every request; how many there were."""
        with self._cv:
            ids = list(self._requests)
        return sum(self.abort(i) for i in ids)

    def close(self, error: RtpcoreError) -> None:
        """Refuse every later request and end each current one with ``error``."""
        with self._cv:
            self._closed = True
            ended = [(r, self._finish(r, "error", error)) for r in list(self._requests.values())]
            self._cv.notify_all()
        for r, out in ended:
            _deliver(r, out)

    # -- stepping --------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        with self._cv:
            return self._has_work()

    def wait_for_work(self, stop: Callable[[], bool], timeout: float | None = None) -> bool:
        """Block until a request waits or runs, or ``stop()`` holds (after :meth:`wake`)."""
        with self._cv:
            return self._cv.wait_for(lambda: stop() or self._has_work(), timeout)

    def wake(self) -> None:
        """Wake every :meth:`wait_for_work` to look at its ``stop`` again."""
        with self._cv:
            self._cv.notify_all()

    def step(self) -> bool:
        """Admit, run one forward of the running batch, sample, retire, hand out
        outputs. False when there was nothing to run. Callers serialize steps."""
        with self._cv:
            if self._closed:
                return False
            new = self.scheduler.admit()
            seqs = list(self.scheduler.running)
            if not seqs:
                return False
            batch = self.scheduler.batch() if self._draft_forward is None else None
            self._in_step = True
        error: RtpcoreError | None = None
        samples: list[list[SampledToken]] = []
        try:
            with torch.inference_mode():
                if batch is not None:
                    params = [s.params for s in seqs]
                    generators = [s.generator for s in seqs]
                    samples = [[t] for t in sample_step(self._forward(batch), params, generators)]
                else:
                    samples = self._speculate(seqs, set(new))
        except Exception as exc:
            error = exc if isinstance(exc, RtpcoreError) else RtpcoreError(
                f"the engine step failed: {type(exc).__name__}: {exc}"
            )
            if error is not exc:
                error.__cause__ = exc
            logger.error("engine step of %d requests failed: %s", len(seqs), error)
        now = time.monotonic()
        outputs: list[tuple[Request, RequestOutput]] = []
        with self._cv:
            self._in_step = False
            self._steps += 1
            self._mixed += bool(new) and len(new) < len(seqs)
            for i, s in enumerate(seqs):
                if s.finish_reason is not None:  # ended while the step ran (closed)
                    continue
                if s.aborted:
                    outputs.append((s, self._finish(s, "abort")))
                elif error is not None:
                    outputs.append((s, self._finish(s, "error", error)))
                else:
                    outputs.append((s, self._record(s, samples[i], now)))
            self._cv.notify_all()
        for r, out in outputs:
            _deliver(r, out)
        return True

    def _speculate(self, seqs: Sequence[Request], fresh: set[Request]) -> list[list[SampledToken]]:
        """One speculative step (``rtpcore.engine.speculative``): the draft proposes for the
        decoding requests, the target scores the proposals and prefills ``fresh`` requests in
        one forward; the tokens each request emits, in ``seqs`` order."""
        assert self._draft_forward is not None
        k_max, shift = self.num_speculative_tokens, self.draft_shift
        # Never score a token past max_tokens, nor feed the draft a position past its context:
        # k shrinks near either end (0 or less: plain decoding). The draft's inputs reach
        # position len(tokens) + k - 2 (len(tokens) - 1 for its catch-up alone, k = 1).
        limit = self.draft_max_positions
        ks = {
            s: min(
                k_max,
                s.params.max_tokens - (len(s.tokens) - s.prompt_len) - 1,
                k_max if limit is None else limit - len(s.tokens) + 1,
            )
            for s in seqs
            if s not in fresh
        }
        proposals: dict[Request, list[int]] = {s: [] for s, k in ks.items() if k > 0}
        dists: dict[Request, list[torch.Tensor | None]] = {s: [] for s in proposals}
        previous: dict[Request, int] = {}
        for j in range(k_max):
            group = [s for s in proposals if ks[s] > j]
            if not group:
                break
            batch = self.scheduler.draft_batch(group, j, proposals, shift=shift, previous=previous)
            tokens, ds = propose(self._draft_forward(batch), [s.params for s in group], [s.generator for s in group])
            row = -1
            for g, s in enumerate(group):
                proposals[s].append(tokens[g])
                dists[s].append(ds[g])
                row += batch.query_lens[g]
                previous[s] = row  # the draft's hidden state after this proposal, for the next
        logits = self._forward(self.scheduler.batch(proposals, seqs))  # rows: 1 per request, k + 1 per proposer
        starts = [0]  # each request's first row of logits
        for s in seqs:
            starts.append(starts[-1] + len(proposals.get(s, ())) + 1)
        plain = [i for i, s in enumerate(seqs) if s not in proposals]
        sampled = sample_step(
            logits[[starts[i] for i in plain]], [seqs[i].params for i in plain], [seqs[i].generator for i in plain]
        )
        first = dict(zip(plain, sampled, strict=True))
        greedy = any(s.params.greedy for s in proposals)
        best = logits.argmax(dim=-1).tolist() if greedy else None  # one transfer for every greedy verification
        out: list[list[SampledToken]] = []
        proposed, accepted = 0, 0
        for i, s in enumerate(seqs):
            drafted = proposals.get(s)
            if drafted is None:
                out.append([first[i]])
                continue
            k, row = len(drafted), starts[i]
            rows = None if best is None else best[row : row + k + 1]
            emitted, n = verify(logits[row : row + k + 1], drafted, dists[s], s.params, s.generator, rows)
            # Roll back: the target keeps the positions of the accepted proposals; the draft
            # those it computed from accepted tokens alone (not from its own hidden states).
            s.num_cached += n
            s.draft_cached = len(s.tokens) - shift + (0 if shift else min(n, k - 1))
            proposed += k
            accepted += n
            out.append(emitted)
        with self._cv:
            self._proposed += proposed
            self._accepted += accepted
        return out

    @property
    def speculative_stats(self) -> SpeculativeStats:
        with self._cv:
            return SpeculativeStats(self._proposed, self._accepted)

    def stats(self) -> EngineStats:
        with self._cv:
            return EngineStats(
                running=len(self.scheduler.running),
                waiting=len(self.scheduler.waiting),
                kv_blocks_total=self.allocator.num_blocks,
                kv_blocks_free=self.allocator.num_free,
                generated_tokens_total=self._generated,
                requests_finished_total=self._finished,
                steps_total=self._steps,
                mixed_steps_total=self._mixed,
                speculative_proposed_total=self._proposed,
                speculative_accepted_total=self._accepted,
            )

    # -- under the lock ----------------------------------------------------------------------

    def _has_work(self) -> bool:
        return not self._closed and bool(self._requests)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("this Engine is closed: its model and KV cache are released")

    def _record(self, r: Request, sampled: Sequence[SampledToken], now: float) -> RequestOutput:
        """Append a step's tokens to ``r`` (one, or an accepted speculative run); finish it
        at a stop token or max_tokens (the tokens after it are dropped)."""
        kept: list[SampledToken] = []
        reason = None
        for token in sampled:
            t = token.token_id
            r.tokens.append(t)
            kept.append(token)
            n = len(r.tokens) - r.prompt_len
            reason = "stop" if t in r.stop_ids else "length" if n >= r.params.max_tokens else None
            if reason is not None:
                break
        self._generated += len(kept)
        n = len(r.tokens) - r.prompt_len
        out = RequestOutput(
            request_id=r.request_id,
            token_ids=tuple(t.token_id for t in kept),
            finish_reason=reason,
            num_prompt_tokens=r.prompt_len,
            num_generated_tokens=n,
            logprobs=None if r.params.logprobs is None else tuple(kept),
            stop_token_id=kept[-1].token_id if reason == "stop" else None,
            arrival_time=r.arrival_time,
            token_times=(now,) * len(kept),
        )
        r.num_sent = n
        if reason is not None:
            self._retire(r, reason)
        return out

    def _finish(self, r: Request, reason: str, error: RtpcoreError | None = None) -> RequestOutput:
        """End ``r`` early (abort or error): its last output, with nothing new."""
        self._retire(r, reason)
        return RequestOutput(
            request_id=r.request_id,
            token_ids=(),
            finish_reason=reason,
            num_prompt_tokens=r.prompt_len,
            num_generated_tokens=r.num_sent,
            logprobs=None if r.params.logprobs is None else (),
            arrival_time=r.arrival_time,
            error=error,
        )

    def _retire(self, r: Request, reason: str) -> None:
        r.finish_reason = reason
        self.scheduler.retire(r)
        self._requests.pop(r.request_id, None)
        self._finished += 1


def _deliver(r: Request, out: RequestOutput) -> None:
    try:
        r.on_output(out)
    except Exception:  # a consumer's callback must not break the step of the others
        logger.exception("the output callback of request %r failed", r.request_id)

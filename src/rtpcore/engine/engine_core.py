"""The request-level engine core that ``Engine.generate`` and ``AsyncEngine`` share.

Requests are added (:meth:`EngineCore.add_request`) and aborted (:meth:`~EngineCore.abort`)
at any time, from any thread. Each :meth:`~EngineCore.step` asks the scheduler for a plan
(``rtpcore.engine.core.scheduler``: a token budget, decodes first, chunked prefill, KV blocks on
demand with preemption), runs it (``rtpcore.engine.step.runner``: one unpadded forward, one batched
sampler), commits what was computed, retires the requests that reached a stop token or
``max_tokens``, and hands each request with new tokens its :class:`RequestOutput` through
the request's own ``on_output`` callback (called on the stepping thread, outside every lock;
it must not block).

Async scheduling (``async_scheduling=True``, docs/design.md §13): outputs run one step
behind. A step whose rows are all plain greedy is launched and left running; the next
:meth:`~EngineCore.step` plans and launches the step after it -- its input ids are the first
step's picks, still on the device -- and only then reads the first step's tokens and commits
them (stop checks, outputs, retiring), so the host's work overlaps the device's. A request
that finished in the first step gets one wasted row in the second, which is discarded
(``EngineStats.async_discarded_tokens_total``); its blocks are freed when it finishes, and the
device's queue order keeps the wasted row's write ahead of any later owner's. A step that
cannot be planned ahead safely -- a sampled row, a draft, a grammar, a prompt chunk, a
request to admit into a free slot, an abort, too few free blocks to grow every request by
one token -- is run synchronously after the pending one is committed, logged and counted
(``async_fallback_steps_total``). The tokens are the synchronous engine's.

A consumer that cannot take more output pauses its request (:meth:`~EngineCore.set_paused`: a
server's stream whose client reads nothing): it is not scheduled, holds no blocks nor batch slot
(the scheduler sets it aside), and resumes where it stopped -- its computed blocks found again
in the prefix cache when that is on -- once its consumer resumes it.

Steps are not reentrant: the caller serializes them (``Engine`` holds its step lock).
Adding and aborting only take the core's short lock, so they never wait for a step.
An abort of a request in the middle of a step takes effect when the step ends (its
blocks are being written); any other abort frees the request's blocks at once.

Failures: a request that breaks a rule is refused when added
(:class:`~rtpcore.errors.InvalidRequestError`, :class:`~rtpcore.errors.QueueFullError`).
A fault inside a step stays with the request that caused it: the step's requests are run
again apart and only the culprit ends, with a :class:`~rtpcore.errors.RequestFailedError`
(so does a request whose next-token distribution is not finite). Only a fault that is not a
request's (a lost rank, a broken worker group) ends every request of the step, with an
:class:`~rtpcore.errors.RtpcoreError` whose ``__cause__`` is the original exception.
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

from rtpcore.engine.core.block_pool import BlockAllocator, blocks_for
from rtpcore.engine.core.kv_manager import KVManager
from rtpcore.engine.core.outputs import EngineStats, RequestOutput, StepReport
from rtpcore.engine.core.prefix_cache import NoPrefixCache, PrefixCache
from rtpcore.engine.core.request import FinishReason, Request, RequestStatus, StepPlan
from rtpcore.engine.core.scheduler import Scheduler
from rtpcore.engine.sample.logits_processors import LogitsProcessors
from rtpcore.engine.sample.params import SampledToken, SamplingParams
from rtpcore.engine.sample.speculative import SpeculativeStats
from rtpcore.engine.step.inputs import BatchBuilder
from rtpcore.engine.step.runner import SeqResult, StepRunner, as_rtpcore_error
from rtpcore.engine.step.staging import Readback
from rtpcore.errors import (
    EngineClosedError,
    InvalidRequestError,
    QueueFullError,
    RequestFailedError,
    RtpcoreError,
)
from rtpcore.models.forward_batch import ForwardBatch

__all__ = ["EngineCore"]

logger = logging.getLogger(__name__)

PLACEHOLDER = -1  # a request's newest token while the step that picks it still runs (async scheduling)


@attrs.define(eq=False)
class InFlight:
    """A launched step whose tokens the host has not read: its plan, its picks on the device
    (the next step's input ids) and their copy on the way to the host; ``ahead`` once the
    next step was planned with a placeholder for each request's newest token."""

    plan: StepPlan
    picks: torch.Tensor
    readback: Readback
    ahead: bool = False


class EngineCore:
    """Requests, the scheduler and the step. See the module docstring."""

    def __init__(
        self,
        *,
        forward: Callable[[ForwardBatch], torch.Tensor],
        allocator: BlockAllocator,
        tokens_per_block: int,
        max_batch_size: int,
        max_num_batched_tokens: int,
        eos_token_ids: Iterable[int],
        max_model_len: int,
        vocab_size: int | None,
        block_bytes: int,
        device: torch.device | str = "cpu",
        draft_forward: Callable[[ForwardBatch], torch.Tensor] | None = None,
        num_speculative_tokens: int = 0,
        draft_shift: int = 0,
        draft_max_positions: int | None = None,
        is_broken: Callable[[], bool] = lambda: False,
        prefix_cache_namespace: bytes | None = None,
        counters: Callable[[], dict[str, Any]] = dict,
        greedy_forward: Callable[[ForwardBatch], torch.Tensor] | None = None,
        async_scheduling: bool = False,
        logits_processors: LogitsProcessors | None = None,
    ):
        """``max_model_len``: the longest prompt + output a request may ask for (the engine
        checked that the pool holds one). ``draft_forward`` and ``num_speculative_tokens`` > 0:
        speculative decoding (``rtpcore.engine.sample.speculative``); ``draft_shift`` 1 for a draft
        that reads the target's hidden states (multi-token prediction, see
        ``BatchBuilder.draft_batch``); ``draft_max_positions``: the draft's longest context (its
        ``max_position_embeddings``), past which a request decodes without proposals.
        ``is_broken()``: whether the worker group can no longer step (a fault is then not a
        request's). ``prefix_cache_namespace``: the root key of prefix caching
        (``rtpcore.engine.core.prefix_cache.namespace_key``), None to turn it off. ``counters()``:
        more EngineStats fields the model runner keeps (CUDA graph replays, eager decodes).
        ``greedy_forward``: the forward that returns the greedy picks of a step whose rows are all
        plain greedy (``StepRunner``), None to sample every step. ``async_scheduling``: outputs
        one step behind (the module docstring); it needs ``greedy_forward``. ``logits_processors``:
        the engine's logits processors (``rtpcore.logits``), None for none; with them every step
        samples (no ``greedy_forward``, so no async scheduling) and each request's
        ``extra_args`` is checked by them when it is added."""
        k = num_speculative_tokens if draft_forward is not None else 0
        if logits_processors is not None:
            if async_scheduling:
                logger.info("async scheduling is off: logits processors (%s) run on every step's logits on the host",
                            ", ".join(logits_processors.names))
            greedy_forward = None  # a processor may move any row's argmax
        self.logits_processors = logits_processors
        self.num_speculative_tokens = k
        self.allocator = allocator
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.block_bytes = block_bytes
        self.device = torch.device(device)
        prefix_cache = NoPrefixCache() if prefix_cache_namespace is None else PrefixCache(
            prefix_cache_namespace, tokens_per_block, has_draft=k > 0, lookahead=draft_shift if k else 0,
        )
        self.kv = KVManager(allocator, tokens_per_block, prefix_cache)
        self.scheduler = Scheduler(
            self.kv,
            max_batch_size=max_batch_size,
            max_num_batched_tokens=max_num_batched_tokens,
            num_speculative_tokens=k,
            draft_max_positions=draft_max_positions,
        )
        self.runner = StepRunner(
            forward=forward,
            builder=BatchBuilder(tokens_per_block=tokens_per_block, device=device),
            is_broken=is_broken,
            draft_forward=draft_forward if k else None,
            shift=draft_shift,
            greedy_forward=greedy_forward,
            processors=logits_processors,
        )
        self.step_observers: list[Callable[[StepReport], None]] = []  # called after each step, on its thread
        self._counters = counters
        self._requests: dict[str, Request] = {}
        self._cv = threading.Condition()
        self._in_step_requests: set[Request] = set()  # the requests of the step in progress
        self._closed = False
        self._generated = 0
        self._finished = 0
        self._steps = 0
        self._mixed = 0
        self._proposed = 0
        self._accepted = 0
        self._request_errors = 0
        self._paused: set[Request] = set()
        self.async_scheduling = async_scheduling and greedy_forward is not None
        self._pending: InFlight | None = None  # the launched step not committed yet (async scheduling)
        self._overlapped = 0
        self._async_fallbacks = 0
        self._discarded = 0
        self._fallback_reasons: set[str] = set()

    # -- requests --------------------------------------------------------------------------

    def check_prompt(
        self, prompt: Any, max_tokens: int, *, name: str = "prompt", index: int | None = None,
        max_tokens_name: str = "max_tokens",
    ) -> list[int]:
        """``prompt`` as a list of token ids, after checking it and ``max_tokens`` new tokens
        fit ``max_model_len`` (``name`` names it in messages). The pool holds one such
        sequence, so a checked request always runs (alone, if it must)."""
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
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"{name}: {len(ids)} prompt tokens + {max_tokens_name}={max_tokens} = {total} "
                f"exceeds the engine's max_model_len={self.max_model_len}",
                field=max_tokens_name,
                value=max_tokens,
                code="context_length_exceeded",
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
        QueueFullError when ``max_waiting`` requests already wait; InvalidRequestError naming
        ``extra_args`` when a logits processor refuses the request's arguments."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"params must be a SamplingParams, got {type(params).__name__}", field="params", value=params
            )
        self.check_params(params)
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
            grammar=params.grammar.state() if params.grammar is not None else None,
        )
        with self._cv:
            self._check_open()
            if request_id in self._requests:
                raise InvalidRequestError(
                    f"request_id {request_id!r} is already in use by a running request",
                    field="request_id", value=request_id,
                )
            if max_waiting is not None and (waiting := self._num_waiting()) >= max_waiting:
                raise QueueFullError(
                    f"{waiting} requests already wait for admission "
                    f"(max_waiting={max_waiting}); retry later",
                    max_waiting=max_waiting,
                )
            self._requests[request_id] = r
            self.scheduler.add(r)
            self._cv.notify_all()
        return request_id

    def check_params(self, params: SamplingParams, *, field: str = "extra_args") -> None:
        """The logits processors' check of ``params`` (their ``validate_params``): an
        InvalidRequestError naming ``field`` when one refuses it; nothing without processors."""
        if self.logits_processors is not None:
            self.logits_processors.validate(params, field=field)

    def abort(self, request_id: str) -> bool:
        """End a request with finish_reason "abort" and free its blocks (at the end of
        the step in progress when it is in it). False when no such request runs or waits."""
        with self._cv:
            r = self._requests.get(request_id)
            if r is None:
                return False
            if r in self._in_step_requests:
                r.aborted = True
                return True
            out = self._finish(r, FinishReason.ABORT)
        _deliver(r, out)
        return True

    def set_paused(self, request_id: str, paused: bool) -> bool:
        """Pause a request (it is not scheduled from the next step on, and gives up its blocks)
        or resume it. False when no such request runs or waits. Callable from any thread."""
        with self._cv:
            r = self._requests.get(request_id)
            if r is None:
                return False
            if paused != r.paused:
                r.paused = paused
                if paused:
                    self._paused.add(r)
                    self._set_aside_paused()
                else:
                    self._paused.discard(r)
                    self._cv.notify_all()  # the loop may be asleep with only paused requests
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
            ended = [(r, self._finish(r, FinishReason.ERROR, error)) for r in list(self._requests.values())]
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
        """Plan, run, commit and hand out one step. False when there was nothing to run.
        Callers serialize steps. With async scheduling a step may be left running: its
        outputs come with the next call (the module docstring)."""
        pending = self._pending
        if pending is not None:
            self._step_behind(pending)
            return True
        with self._cv:
            if self._closed:
                return False
            plan = self.scheduler.schedule()
            if not plan.seqs:
                return bool(plan.preempted)
            self._in_step_requests = {s.request for s in plan.seqs}
        if self.async_scheduling:
            why = self.runner.overlap_problem(plan.seqs)
            if why is None:
                self._pending = self._launch(plan, None)
                if self._pending is not None:
                    return True
                why = "launching the step failed"
            self._fallback(why)
        self._run(plan)
        return True

    def _run(self, plan: StepPlan) -> None:
        """Run ``plan`` synchronously: forward, sample, commit, hand out."""
        error: RtpcoreError | None = None
        results: list[SeqResult] = []
        try:
            results = self.runner.run(plan.seqs)
        except Exception as exc:  # not a request's fault: the worker group is broken
            error = as_rtpcore_error(exc)
            logger.error("engine step of %d requests failed: %s", len(plan.seqs), error)
        self._hand_out(plan, self._commit(plan, results, error))

    def _hand_out(self, plan: StepPlan, outputs: list[tuple[Request, RequestOutput]]) -> None:
        for r, out in outputs:
            _deliver(r, out)
        report = StepReport(plan.num_tokens, len(plan.seqs), len(plan.preempted))
        for observe in self.step_observers:
            try:
                observe(report)
            except Exception:  # an observer must not break the engine
                logger.exception("a step observer failed")

    # -- async scheduling ----------------------------------------------------------------------

    def _launch(self, plan: StepPlan, previous: InFlight | None, rows: Sequence[int] | None = None) -> InFlight | None:
        """Launch ``plan``; with ``previous``, sequence i's input id is ``previous``'s pick of
        row ``rows[i]`` (row i when None). None when the launch raised (the caller runs the
        plan synchronously, which keeps a fault with its request)."""
        try:
            picks = self.runner.launch_greedy(plan.seqs, None if previous is None else previous.picks, rows)
        except Exception as exc:
            logger.warning("launching a step of %d requests failed (%s: %s); it runs synchronously",
                           len(plan.seqs), type(exc).__name__, exc)
            return None
        return InFlight(plan, picks, Readback(picks))

    def _step_behind(self, pending: InFlight) -> None:
        """Plan and launch the step after ``pending`` when that is safe, then read ``pending``'s
        tokens and commit them; otherwise commit ``pending`` alone (the next call plans anew)."""
        with self._cv:
            ahead = self._plan_ahead(pending)
        plan, rows = ahead if ahead is not None else (None, None)
        launched = None if plan is None else self._launch(plan, pending, rows)
        self._pending = launched
        if launched is not None:
            self._overlapped += 1
        error: RtpcoreError | None = None
        results: list[SeqResult] = []
        try:
            results = self.runner.greedy_results(pending.plan.seqs, pending.readback.tolist())
        except Exception as exc:  # the device failed: not a request's fault
            error = as_rtpcore_error(exc)
            logger.error("engine step of %d requests failed: %s", len(pending.plan.seqs), error)
        keep = {s.request for s in launched.plan.seqs} if launched is not None else set()
        self._hand_out(pending.plan, self._commit(
            pending.plan, results, error, keep=keep, placeholders=pending.ahead, launched=True))
        if plan is not None and launched is None:  # the tokens are known now: run it as a synchronous step
            self._fallback("launching the step failed")
            with self._cv:
                seqs = tuple(s for s in plan.seqs if s.request.finish_reason is None)
                self._in_step_requests = {s.request for s in seqs}
            if seqs:
                self._run(StepPlan(seqs))
        elif launched is not None and all(s.request.finish_reason is not None for s in launched.plan.seqs):
            with self._cv:  # every request of the launched step has finished: nothing of it is read
                self._pending = None
                self._in_step_requests = set()
                self._discarded += len(launched.plan.seqs)

    def _plan_ahead(self, pending: InFlight) -> tuple[StepPlan, list[int] | None] | None:
        """Under the lock: the plan of the step after ``pending`` -- its requests that have not
        finished decoding once more, each with a placeholder for the token ``pending`` picks --
        and the rows of ``pending`` they take their input ids from (None: every row, in order);
        None when it cannot be planned before ``pending``'s tokens are known."""
        if self._closed:
            return None
        live = [(i, s) for i, s in enumerate(pending.plan.seqs) if s.request.finish_reason is None]
        requests = [s.request for _, s in live]
        sched = self.scheduler
        problem = None
        if not live:
            problem = "every request of the running step has finished"
        elif sched.running != requests:
            problem = "the running batch is not the running step's"
        elif any(r.paused for r in requests):
            problem = "a running request was paused"
        elif len(sched.running) < sched.max_running and any(not r.paused for r in sched.waiting):
            problem = "a waiting request may be admitted"
        elif sum(max(0, blocks_for(s.end + 1, sched.tpb) - len(s.request.blocks)) for _, s in live) > self.allocator.num_free:
            problem = "too few free blocks to grow every request by a token"
        if problem is not None:
            logger.debug("the next step is planned after the running one's tokens are read: %s", problem)
            return None
        for _, s in live:
            s.request.tokens.append(PLACEHOLDER)
            sched.commit(s)
        pending.ahead = True
        plan = sched.schedule()
        # Nothing is admitted into a free slot and every request has its block: the same decodes, in order.
        assert [s.request for s in plan.seqs] == requests and not plan.preempted and not plan.admitted
        assert all(s.num_tokens == 1 and s.samples and not s.num_proposals for s in plan.seqs)
        self._in_step_requests = set(requests)
        rows = [i for i, _ in live]
        return plan, None if len(rows) == len(pending.plan.seqs) else rows

    def _fallback(self, why: str) -> None:
        """Count a step run synchronously although async scheduling is on, and say why."""
        self._async_fallbacks += 1
        if why not in self._fallback_reasons:
            self._fallback_reasons.add(why)
            logger.info("async scheduling: a step runs synchronously (%s); such steps are counted in "
                        "async_fallback_steps_total", why)
        else:
            logger.debug("async scheduling: a step runs synchronously (%s)", why)

    def _commit(
        self, plan: StepPlan, results: Sequence[SeqResult], error: RtpcoreError | None, *,
        keep: set[Request] | None = None, placeholders: bool = False, launched: bool = False,
    ) -> list[tuple[Request, RequestOutput]]:
        """Apply a step's results under the lock: cache what was computed, record tokens,
        end finished, failed and aborted requests; the outputs to hand out. ``keep``: the
        requests of a step launched meanwhile (still in a step); ``placeholders``: each
        request's last token is a placeholder for this step's pick; ``launched``: the step was
        left running (async scheduling): a request that ended before its commit wasted a row."""
        now = time.monotonic()
        outputs: list[tuple[Request, RequestOutput]] = []
        with self._cv:
            self._in_step_requests = keep or set()
            self._steps += 1
            self._mixed += plan.is_mixed
            for i, seq in enumerate(plan.seqs):
                r = seq.request
                try:
                    out = self._commit_one(seq, results[i] if results else None, error, now,
                                           placeholders=placeholders, launched=launched)
                except Exception as exc:  # a bug in one request's bookkeeping: that request ends alone
                    out = self._fail_alone(r, exc)
                if out is not None:
                    outputs.append((r, out))
            self._set_aside_paused()
            self._cv.notify_all()
        return outputs

    def _commit_one(self, seq: Any, result: SeqResult | None, error: RtpcoreError | None, now: float, *,
                    placeholders: bool, launched: bool) -> RequestOutput | None:
        """Under the lock: one request's part of a step's commit; its output, if any."""
        r = seq.request
        if placeholders and r.tokens and r.tokens[-1] == PLACEHOLDER:
            r.tokens.pop()  # the pick is recorded below, or the request ends without it
        if r.finish_reason is not None:  # ended while the step ran (closed), or a step earlier
            self._discarded += launched
            return None
        if r.aborted:
            return self._finish(r, FinishReason.ABORT)
        if error is not None:
            return self._finish(r, FinishReason.ERROR, error)
        assert result is not None  # a step without an error has a result per sequence
        if result.error is not None:
            self._request_errors += 1
            return self._finish(r, FinishReason.ERROR, result.error)
        return self._apply(seq, result, now)

    def _apply(self, seq: Any, result: SeqResult, now: float) -> RequestOutput | None:
        """Under the lock: commit one request's step -- its computed positions, its tokens, its
        cached blocks; its output (None when the step gave it no token)."""
        r = seq.request
        self.scheduler.commit(seq, result.accepted)
        self._proposed += result.proposed
        self._accepted += result.accepted
        out = self._record(r, result.tokens, now) if result.tokens else None
        if r.finish_reason is None:
            self.kv.cache_blocks(r)
        return out

    def _fail_alone(self, r: Request, exc: BaseException) -> RequestOutput:
        """Under the lock: end ``r`` with the error ``exc`` raised while its step was committed
        (a request's own failure, a RequestFailedError, as it is; anything else is a bug in the
        engine's per-request bookkeeping, logged with the request's id and its traceback). The
        other requests of the step go on; the request is counted in request_errors_total."""
        self._request_errors += 1
        if isinstance(exc, RequestFailedError):
            error = exc
            logger.error("request %r failed: %s", r.request_id, exc)
        else:
            logger.error("request %r failed while its step was committed (%s: %s); it ends, the others go on",
                         r.request_id, type(exc).__name__, exc, exc_info=exc)
            error = RequestFailedError(
                f"request {r.request_id!r} failed in the engine's bookkeeping: {type(exc).__name__}: {exc}",
                request_id=r.request_id, reason="internal",
            )
            error.__cause__ = exc
        if r.finish_reason is not None:  # retired already (its output was being built): say it failed
            r.finish_reason = FinishReason.ERROR
            self._requests.pop(r.request_id, None)
            return self._last_output(r, FinishReason.ERROR, error)
        return self._finish(r, FinishReason.ERROR, error)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block key (blocks requests hold stay theirs); how many there were."""
        with self._cv:
            return self.allocator.reset_cache()

    @property
    def speculative_stats(self) -> SpeculativeStats:
        with self._cv:
            return SpeculativeStats(self._proposed, self._accepted)

    def stats(self) -> EngineStats:
        with self._cv:
            return EngineStats(
                running=len(self.scheduler.running),
                waiting=self._num_waiting(),
                paused=len(self._paused),
                kv_blocks_total=self.allocator.num_blocks,
                kv_blocks_free=self.allocator.num_free,
                generated_tokens_total=self._generated,
                requests_finished_total=self._finished,
                steps_total=self._steps,
                mixed_steps_total=self._mixed,
                speculative_proposed_total=self._proposed,
                speculative_accepted_total=self._accepted,
                preemptions_total=self.scheduler.preemptions_total,
                request_errors_total=self._request_errors,
                prefix_cache_queries_total=self.kv.prefix_cache.queries_total,
                prefix_cache_hits_total=self.kv.prefix_cache.hits_total,
                kv_blocks_cached=self.allocator.num_cached,
                greedy_picked_steps_total=self.runner.greedy_steps,
                overlapped_steps_total=self._overlapped,
                async_fallback_steps_total=self._async_fallbacks,
                async_discarded_tokens_total=self._discarded,
                **self._counters(),
            )

    # -- under the lock ----------------------------------------------------------------------

    def _has_work(self) -> bool:
        return not self._closed and len(self._requests) > len(self._paused)

    def _set_aside_paused(self) -> None:
        """Take the paused requests that are in no step out of the batch, releasing their blocks
        now (one in a step is set aside when the step is committed)."""
        for r in self._paused:
            if r.status is RequestStatus.RUNNING and r not in self._in_step_requests:
                self.scheduler.set_aside(r)

    def _num_waiting(self) -> int:
        """Requests waiting for admission, the paused ones not counted."""
        return len(self.scheduler.waiting) - sum(r.paused for r in self.scheduler.waiting)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("this Engine is closed: its model and KV cache are released")

    def _record(self, r: Request, sampled: Sequence[SampledToken], now: float) -> RequestOutput:
        """Append a step's tokens to ``r`` (one, or an accepted speculative run); finish it
        at a stop token or max_tokens (the tokens after it are dropped)."""
        kept: list[SampledToken] = []
        reason: FinishReason | None = None
        for token in sampled:
            t = token.token_id
            if r.grammar is not None and not r.grammar.accept(t):
                failed = r.grammar.error
                if failed is not None:  # the grammar engine gave up on this grammar: the request cannot go on
                    raise RequestFailedError(
                        f"request {r.request_id!r}: its grammar ({r.params.grammar}) can go no further: {failed}",
                        request_id=r.request_id, reason="grammar",
                    )
                # The sampler masked the row to what the grammar allows: a refusal ends the output here.
                logger.warning("request %r: token %d is outside its grammar; the request ends here", r.request_id, t)
                reason = FinishReason.STOP
                break
            r.tokens.append(t)
            kept.append(token)
            n = len(r.tokens) - r.prompt_len
            done = r.grammar is not None and r.grammar.done  # the grammar is complete: it took a stop id
            reason = FinishReason.STOP if t in r.stop_ids or done else FinishReason.LENGTH if n >= r.params.max_tokens else None
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
            stop_token_id=kept[-1].token_id if reason is FinishReason.STOP and kept and kept[-1].token_id in stop_set(r) else None,
            arrival_time=r.arrival_time,
            token_times=(now,) * len(kept),
            num_cached_tokens=r.num_cached_tokens or 0,
        )
        r.num_sent = n
        if reason is not None:
            self._retire(r, reason)
        return out

    def _finish(self, r: Request, reason: FinishReason, error: RtpcoreError | None = None) -> RequestOutput:
        """End ``r`` early (abort or error): its last output, with nothing new."""
        self._retire(r, reason)
        return self._last_output(r, reason, error)

    @staticmethod
    def _last_output(r: Request, reason: FinishReason, error: RtpcoreError | None) -> RequestOutput:
        """The output that ends ``r`` with ``reason`` and no new token."""
        return RequestOutput(
            request_id=r.request_id,
            token_ids=(),
            finish_reason=reason,
            num_prompt_tokens=r.prompt_len,
            num_generated_tokens=r.num_sent,
            logprobs=None if r.params.logprobs is None else (),
            arrival_time=r.arrival_time,
            error=error,
            num_cached_tokens=r.num_cached_tokens or 0,
        )

    def _retire(self, r: Request, reason: FinishReason) -> None:
        r.finish_reason = reason
        self.scheduler.retire(r, cache=reason is not FinishReason.ERROR)
        self._requests.pop(r.request_id, None)
        self._paused.discard(r)
        self._finished += 1


def _deliver(r: Request, out: RequestOutput) -> None:
    try:
        r.on_output(out)
    except Exception:  # a consumer's callback must not break the step of the others
        logger.exception("the output callback of request %r failed", r.request_id)


def stop_set(r: Request) -> frozenset[int]:
    """The ids that ended ``r`` as a stop token: its stop ids, and its grammar's."""
    return r.stop_ids | (frozenset(r.params.grammar.stop_token_ids) if r.params.grammar is not None else frozenset())

"""Running one step plan: forward, sample, and keep a fault with the request that caused it.

:class:`StepRunner` is the model runner of the engine core (``rtpcore.engine.engine_core``): it
takes the scheduler's :class:`~rtpcore.engine.core.request.StepPlan`, builds the batch
(``rtpcore.engine.step.inputs``), runs the target's forward -- with a speculative draft, the
draft's proposals first and its catch-up with fresh prompt chunks after -- and samples every
row that needs a token in one batched call (``rtpcore.engine.sample.sampler``); when every row is
plain greedy (``rtpcore.engine.sample.sampler.plain_greedy``) and no draft speculates, the forward
returns the greedy picks on the device instead of the logits (in the decode graph when one
serves the step) and the step reads back B token ids. It returns one
:class:`SeqResult` per scheduled sequence and changes no scheduling state but the draft's
cached positions; the core commits the results.

Faults stay with their request (docs/design.md §13). When the forward raises and the worker
group is still whole, the step's sequences are run again apart: split in halves until the
culprit is alone, without speculation. The culprit ends with a
:class:`~rtpcore.errors.RequestFailedError` (``reason="model_fault"``, the original exception
as its cause); every other sequence gets the tokens it would have had. A row whose
distribution is not finite fails that request alone (``reason="non_finite"``). Only a fault
that is not a request's -- the worker group broken (a lost rank, a device fault) -- is raised,
and then ends every request of the step.

Logits processors (``rtpcore.logits``; :class:`~rtpcore.engine.sample.logits_processors.LogitsProcessors`,
when the engine enables any): after the forward, the step's drawing sequences, in order, are the
processors' rows (``begin``), and the logits go through them before the sampler (with a draft,
position by position over the verification rows, as if decoding without it); log-probabilities
stay the model's. A processor's exception is a fault of the step's requests like the forward's:
they are run again apart, and each culprit ends with ``reason="logits_processor"``, the error
naming the processor. With processors every step samples: no greedy picks on the device, no
launch ahead (async scheduling).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from rtpcore.engine.core.request import Request, ScheduledSeq
from rtpcore.engine.sample.logits_processors import LogitsProcessors, ProcessorRow
from rtpcore.engine.sample.params import SampledToken
from rtpcore.engine.sample.sampler import SamplingRow, TokenView, history_row, plain_greedy, sample
from rtpcore.engine.sample.speculative import Proposal, propose, verify_batch
from rtpcore.engine.step.inputs import BatchBuilder
from rtpcore.errors import LogitsProcessorError, RequestFailedError, RtpcoreError

__all__ = ["SeqResult", "StepRunner", "as_rtpcore_error"]

logger = logging.getLogger(__name__)


@attrs.frozen
class SeqResult:
    """What a step gave one scheduled sequence: the tokens it emits (none for a prompt chunk
    that samples nothing), how many draft proposals it accepted and were proposed, or the
    error that ended it."""

    tokens: tuple[SampledToken, ...] = ()
    accepted: int = 0
    proposed: int = 0
    error: RtpcoreError | None = None


def as_rtpcore_error(exc: BaseException, what: str = "the engine step failed") -> RtpcoreError:
    """``exc`` itself when it is an RtpcoreError, else one that names it (``exc`` as cause)."""
    if isinstance(exc, RtpcoreError):
        return exc
    error = RtpcoreError(f"{what}: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


class StepRunner:
    """Runs step plans for one engine (see the module docstring).

    ``forward`` / ``draft_forward``: the target's and the draft's forward over every rank;
    ``greedy_forward``: the target's forward returning the greedy picks
    (``rtpcore.engine.sample.sampler.greedy_pick``) instead of the logits, None to always sample;
    ``is_broken()``: whether the worker group can no longer step (then a fault is not a
    request's); ``shift``: 1 for a draft that reads the target's hidden states;
    ``processors``: the engine's logits processors, None when it enables none."""

    def __init__(
        self,
        *,
        forward: Callable[[Any], torch.Tensor],
        builder: BatchBuilder,
        is_broken: Callable[[], bool],
        draft_forward: Callable[[Any], torch.Tensor] | None = None,
        shift: int = 0,
        greedy_forward: Callable[[Any], torch.Tensor] | None = None,
        processors: LogitsProcessors | None = None,
    ):
        self.forward = forward
        self.processors = processors
        self.greedy_forward = greedy_forward if processors is None else None  # processors: every step samples
        self.greedy_steps = 0  # steps whose tokens were the device's greedy picks (no sampler)
        self.builder = builder
        self.is_broken = is_broken
        self.draft_forward = draft_forward
        self.shift = shift

    def run(self, seqs: Sequence[ScheduledSeq]) -> list[SeqResult]:
        """One result per sequence of ``seqs``, in order. Raises only for a fault that is not
        a request's (the worker group is broken)."""
        try:
            return self._attempt(seqs, speculate=True)
        except Exception as exc:
            if self.is_broken():
                raise as_rtpcore_error(exc) from exc
            logger.warning(
                "a step of %d sequences failed (%s: %s); running them apart to find the request that caused it",
                len(seqs), type(exc).__name__, exc,
            )
            return self._isolate(seqs, exc)

    def _attempt(self, seqs: Sequence[ScheduledSeq], *, speculate: bool) -> list[SeqResult]:
        """One forward of ``seqs``; when it raises, the draft's cached positions are put back
        (a catch-up may have moved them) and the exception goes on."""
        saved = [s.request.draft_cached for s in seqs]
        try:
            with torch.inference_mode():
                return self._run(seqs, speculate=speculate)
        except Exception:
            for s, cached in zip(seqs, saved, strict=True):
                s.request.draft_cached = cached
            raise

    def _isolate(self, seqs: Sequence[ScheduledSeq], exc: BaseException) -> list[SeqResult]:
        """Run ``seqs`` (whose joint forward raised ``exc``) in halves until each culprit is
        alone; the others' results are what they would have had."""
        results: dict[int, SeqResult] = {}
        pending: list[tuple[list[int], BaseException | None]] = [(list(range(len(seqs))), exc)]
        while pending:
            part, failed = pending.pop()
            if failed is None:  # not run yet on its own
                try:
                    results.update(zip(part, self._attempt([seqs[i] for i in part], speculate=False), strict=True))
                    continue
                except Exception as again:
                    if self.is_broken():
                        raise as_rtpcore_error(again) from again
                    failed = again
            if len(part) == 1:
                r = seqs[part[0]].request
                where, reason = "the model's forward", "model_fault"
                if isinstance(failed, LogitsProcessorError):
                    where, reason = f"logits processor {failed.processor!r}", "logits_processor"
                logger.error("request %r failed in %s: %s: %s", r.request_id, where, type(failed).__name__, failed)
                error = RequestFailedError(
                    f"request {r.request_id!r} failed in {where}: {type(failed).__name__}: {failed}",
                    request_id=r.request_id, reason=reason,
                )
                error.__cause__ = failed
                results[part[0]] = SeqResult(error=error)
                continue
            half = len(part) // 2
            pending += [(part[half:], None), (part[:half], None)]
        return [results[i] for i in range(len(seqs))]

    # -- one forward ---------------------------------------------------------------------------

    def _run(self, seqs: Sequence[ScheduledSeq], *, speculate: bool) -> list[SeqResult]:
        proposals: dict[Request, list[int]] = {}
        dists: dict[Request, list[torch.Tensor | None]] = {}
        if speculate and self.draft_forward is not None:
            proposals, dists = self._propose(seqs)
        built = self.builder.target_batch(seqs, proposals)
        if self.draft_forward is None and self.greedy_forward is not None:
            rows = [_row(s.request) for s in seqs if s.samples]
            if all(plain_greedy(row) for row in rows):
                return self.greedy_results(seqs, self.greedy_forward(built.batch).tolist())  # the one host transfer
        logits = self.forward(built.batch)  # (N, V): one row per sampled sequence, k + 1 per proposer
        if self.draft_forward is not None:
            self._catch_up(seqs)
        results = [SeqResult()] * len(seqs)
        drawing = [i for i, s in enumerate(seqs) if s.samples]
        if not drawing:
            return results
        raw = logits
        if self.processors is not None:  # the step's drawing sequences are the processors' rows
            self.processors.begin([_processor_row(seqs[i].request) for i in drawing])
            if self.draft_forward is None:
                logits = self.processors.apply(raw)
            else:  # position by position, each row's output_ids extended by the proposals before it
                logits = self.processors.apply_verification(raw, [proposals.get(seqs[i].request, ()) for i in drawing])
        if self.draft_forward is None:  # one batched draw; the logits hold a row per sampling sequence
            drawn = sample(logits, [_row(seqs[i].request) for i in drawing], raw=raw)
            for j, i in enumerate(drawing):
                token = drawn.tokens[j]
                results[i] = SeqResult((token,)) if token is not None else SeqResult(error=_non_finite(seqs[i].request))
            return results
        # With a draft: every sampling sequence's rows (k + 1 for a proposer, 1 for the others)
        # are verified together, one host transfer (rtpcore.engine.sample.speculative.verify_batch).
        verdicts = verify_batch(logits, [
            Proposal(_row(seqs[i].request), tuple(proposals.get(seqs[i].request, ())), tuple(dists.get(seqs[i].request, ())))
            for i in drawing
        ], raw=raw)
        for i, verdict in zip(drawing, verdicts, strict=True):
            r = seqs[i].request
            if verdict.failed:
                results[i] = SeqResult(error=_non_finite(r))
                continue
            drafted = proposals.get(r)
            if drafted is None:
                results[i] = SeqResult(tuple(verdict.tokens))
                continue
            # Roll back: the target keeps the positions of the accepted proposals; the draft
            # those it computed from accepted tokens alone (not from its own hidden states).
            k = len(drafted)
            r.draft_cached = len(r.tokens) - self.shift + (0 if self.shift else min(verdict.accepted, k - 1))
            results[i] = SeqResult(tuple(verdict.tokens), verdict.accepted, k)
        return results

    def overlap_problem(self, seqs: Sequence[ScheduledSeq]) -> str | None:
        """Why ``seqs`` cannot be launched by :meth:`launch_greedy` (one pick per sequence, read
        later), or None when they can."""
        if self.processors is not None:
            return "logits processors are enabled"
        if self.draft_forward is not None:
            return "speculative decoding verifies proposals on the host"
        if self.greedy_forward is None:
            return "the engine has no greedy forward"
        for s in seqs:
            if not s.samples:
                return "a prompt chunk samples nothing"
            if not plain_greedy(_row(s.request)):
                return "a row needs the sampler (sampling, logprobs, a grammar, a penalty, logit_bias or min_tokens)"
        return None

    def launch_greedy(
        self, seqs: Sequence[ScheduledSeq], previous: torch.Tensor | None = None, rows: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Queue the forward of ``seqs`` (each samples, every row plain greedy, no draft) and
        return its greedy picks on the device, without waiting for them (one per sequence, -1
        for a row that is not finite: :meth:`greedy_results` turns them into results).
        ``previous``: the picks of the step before, which the host has not read yet: sequence
        i's input id is ``previous[rows[i]]`` (``previous[i]`` when ``rows`` is None), gathered
        on the device (the index rides in the batch's one copy) instead of its last token."""
        assert self.greedy_forward is not None and self.draft_forward is None
        built = self.builder.target_batch(seqs, extra=rows)
        batch = built.batch
        if previous is not None:
            ids = previous if built.extra is None else previous.index_select(0, built.extra)
            batch = attrs.evolve(batch, input_ids=ids.clamp(min=0))  # a failed row's -1 feeds a wasted row
        with torch.inference_mode():
            return self.greedy_forward(batch)

    def greedy_results(self, seqs: Sequence[ScheduledSeq], picks: Sequence[int]) -> list[SeqResult]:
        """The results of a step whose sampling rows (one per sequence that samples, in order)
        were picked greedily on the device (a step of :meth:`launch_greedy`, or a synchronous
        one), from its picks on the host: -1 is a row that was not finite."""
        self.greedy_steps += 1
        results = [SeqResult()] * len(seqs)
        row = 0
        for i, s in enumerate(seqs):
            if s.samples:
                token = int(picks[row])
                row += 1
                results[i] = SeqResult((SampledToken(token),)) if token >= 0 else SeqResult(error=_non_finite(s.request))
        return results

    def _propose(self, seqs: Sequence[ScheduledSeq]) -> tuple[dict[Request, list[int]], dict[Request, list[torch.Tensor | None]]]:
        """The draft's proposals for every decoding sequence scheduled with some, one draft
        forward per proposal (the first also catches the draft up)."""
        assert self.draft_forward is not None
        ks = {s.request: s.num_proposals for s in seqs if s.num_proposals > 0}
        proposals: dict[Request, list[int]] = {r: [] for r in ks}
        dists: dict[Request, list[torch.Tensor | None]] = {r: [] for r in ks}
        previous: dict[Request, int] = {}
        for j in range(max(ks.values(), default=0)):
            group = [r for r in proposals if ks[r] > j]
            batch = self.builder.draft_batch(group, j, proposals, shift=self.shift, previous=previous)
            rows = [history_row(_row(r), proposals[r]) for r in group]  # the output plus this step's proposals
            tokens, ds = propose(self.draft_forward(batch), rows)
            row = -1
            for g, r in enumerate(group):
                proposals[r].append(tokens[g])
                dists[r].append(ds[g])
                row += batch.query_lens[g]
                previous[r] = row  # the draft's hidden state after this proposal, for the next
        return proposals, dists

    def _catch_up(self, seqs: Sequence[ScheduledSeq]) -> None:
        """Feed the draft the prompt chunks the target just computed that sample nothing, while
        the target's hidden states of them are at hand."""
        assert self.draft_forward is not None
        built = self.builder.catch_up_batch(seqs, shift=self.shift)
        if built is None:
            return
        batch, caught = built
        self.draft_forward(batch)
        for s in caught:
            s.request.draft_cached = s.end


def _row(r: Request) -> SamplingRow:
    """``r``'s sampling row: its prompt and output are views of ``r.tokens`` as it is now
    (no copy: a step's host work does not grow with the context)."""
    tokens = r.tokens
    return SamplingRow(
        params=r.params, generator=r.generator, prompt_ids=TokenView(tokens, 0, r.prompt_len),
        output_ids=TokenView(tokens, r.prompt_len), stop_ids=r.stop_ids, grammar=r.grammar,
    )


def _processor_row(r: Request) -> ProcessorRow:
    """``r`` as the logits processors see it: its own token list (read, never copied whole)."""
    return ProcessorRow(key=r, params=r.params, tokens=r.tokens, prompt_len=r.prompt_len)


def _non_finite(r: Request) -> RequestFailedError:
    failed = r.grammar.error if r.grammar is not None else None
    if failed is not None:  # its grammar allows nothing: the grammar engine gave up on it
        logger.error("request %r: its grammar can go no further: %s", r.request_id, failed)
        return RequestFailedError(
            f"request {r.request_id!r}: its grammar ({r.params.grammar}) can go no further: {failed}",
            request_id=r.request_id, reason="grammar",
        )
    logger.error("request %r: the next-token distribution is not finite", r.request_id)
    return RequestFailedError(
        f"request {r.request_id!r}: the model's next-token distribution is not finite "
        "(NaN or infinite logits, or every token masked by the request's settings)",
        request_id=r.request_id, reason="non_finite",
    )

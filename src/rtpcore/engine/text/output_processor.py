"""The output side of the offline API: the engine core's outputs of a prompt's requests in,
text and :class:`~rtpcore.engine.text.outputs.GenerationOutput` out.

A :class:`PromptRun` is one prompt with its :class:`~rtpcore.engine.sample.params.SamplingParams`:
the engine requests it needs and a :class:`SequenceState` per request. ``Engine.generate``,
``Engine.chat``, ``AsyncEngine.generate`` and ``rtpcore serve`` (``rtpcore.serving.streaming``,
which streams each output's :class:`SequenceDelta`) all run their requests through it, so the
same request gives the same tokens and text offline and on the server:

- stop ids: the request's ``stop_token_ids`` are added to the engine's end-of-sequence ids,
  and so is the tokenizer's ``eos_token`` (unless ``ignore_eos``);
- ``n``: a greedy request runs once and its sequence is every output; a sampled one runs
  ``n`` requests, request ``i`` seeded with ``seed + i`` when seeded;
- text: ids go one at a time through an
  :class:`~rtpcore.engine.text.detokenize.IncrementalDecoder` (stop strings across token
  boundaries, ``include_stop_str_in_output``, ``skip_special_tokens``); a stop token's text
  is left out; a stop string ends the sequence at the token that completed it, and the
  caller aborts the engine request it came from (:meth:`SequenceState.add` says when).
- finish: ``"length"`` and ``"abort"`` as the engine ended the request, ``"stop"`` otherwise
  (a stop token, a stop string, a grammar complete).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from rtpcore.engine.core.outputs import RequestOutput
from rtpcore.engine.sample.params import SampledToken, SamplingParams
from rtpcore.engine.text.detokenize import IncrementalDecoder
from rtpcore.engine.text.outputs import CompletionOutput, GenerationOutput
from rtpcore.engine.text.prompts import Prompt, TextSide
from rtpcore.engine.text.tokenizer import Tokenizer
from rtpcore.errors import InvalidRequestError, RtpcoreError

__all__ = ["PromptRun", "SequenceDelta", "SequenceState"]


@attrs.frozen
class SequenceDelta:
    """What one output added to a sequence: its new ``text`` and, when the request asked for
    logprobs, each new token with the text it added (``(draw, piece)``; the pieces join to
    ``text``; text held back until the end belongs to the last token). A stop token is in
    neither: it ends the sequence without text."""

    text: str = ""
    tokens: tuple[tuple[SampledToken, str], ...] = ()
    #: The token ids the sequence gained (a stop token included, as in ``CompletionOutput.token_ids``).
    ids: tuple[int, ...] = ()


class SequenceState:
    """One engine request's outputs gathered into one sequence (see the module docstring).
    ``eos_token_ids``: the ids that end a sequence without being its ``stop_reason``."""

    def __init__(self, params: SamplingParams, tokenizer: Tokenizer | None, eos_token_ids: frozenset[int]):
        self.eos_token_ids = eos_token_ids
        self.decoder = None if tokenizer is None else IncrementalDecoder(
            tokenizer, skip_special_tokens=params.skip_special_tokens, stop=params.stop,
            include_stop=params.include_stop_str_in_output,
        )
        self.token_ids: list[int] = []
        self.logprobs: list[SampledToken] | None = [] if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.num_cached_tokens = 0
        self.error: RtpcoreError | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def add(self, out: RequestOutput) -> bool:
        """Take the request's next output; whether the sequence has ended (a stop string ends
        it before the engine request ends: abort that request then). A failed request ends
        it with :attr:`error` set."""
        self.advance(out)
        return self.finished

    def advance(self, out: RequestOutput) -> SequenceDelta:
        """Take the request's next output, as :meth:`add` does; what it added to the sequence
        (nothing once the sequence has ended)."""
        if self.finished:
            return SequenceDelta()
        self.num_cached_tokens = out.num_cached_tokens
        if out.error is not None:
            self.error = out.error
            return SequenceDelta()
        ids = out.token_ids
        draws = out.logprobs or ()
        pieces: list[str] = []
        tokens: list[tuple[SampledToken, str]] | None = [] if self.logprobs is not None else None
        for i, token in enumerate(ids):
            self.token_ids.append(token)
            if self.logprobs is not None and i < len(draws):
                self.logprobs.append(draws[i])
            if i == len(ids) - 1 and out.stop_token_id is not None and token == out.stop_token_id:
                break  # a stop token's text is not the sequence's
            piece = self.decoder.push([token]) if self.decoder is not None else ""
            pieces.append(piece)
            if tokens is not None:
                tokens.append((draws[i] if i < len(draws) else SampledToken(token), piece))
            if self.decoder is not None and self.decoder.stopped:  # the tokens after this one are not the sequence's
                self.finish_reason, self.stop_reason = "stop", self.decoder.stop_string
                return SequenceDelta("".join(pieces), tuple(tokens or ()), tuple(ids[: i + 1]))
        if out.finished:
            tail = self.decoder.finish() if self.decoder is not None else ""  # held back for a stop string that never came
            if tail:
                pieces.append(tail)
                if tokens:
                    draw, piece = tokens[-1]
                    tokens[-1] = (draw, piece + tail)
            self.finish_reason = out.finish_reason if out.finish_reason in ("length", "abort") else "stop"
            stop_id = out.stop_token_id
            if self.finish_reason == "stop" and stop_id is not None and stop_id not in self.eos_token_ids:
                self.stop_reason = stop_id
        return SequenceDelta("".join(pieces), tuple(tokens or ()), tuple(ids))

    def output(self, index: int) -> CompletionOutput:
        logprobs = None if self.logprobs is None else tuple(self.logprobs)
        return CompletionOutput(
            index=index,
            text=None if self.decoder is None else self.decoder.text,
            token_ids=tuple(self.token_ids),
            cumulative_logprob=None if logprobs is None else sum(t.logprob or 0.0 for t in logprobs),
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


class PromptRun:
    """One prompt's engine requests (``requests``: ``(request_id, params)`` pairs, ids derived
    from ``request_id``: itself for one request, ``f"{request_id}-{i}"`` for ``n`` sampled
    ones) and their states; :meth:`output` is the prompt's GenerationOutput so far."""

    def __init__(self, request_id: str, prompt: Prompt, params: SamplingParams, text: TextSide):
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be a SamplingParams, got {type(params).__name__}",
                                      field="sampling_params", value=params)
        tokenizer = text.tokenizer
        if params.stop and tokenizer is None:
            text.require_tokenizer("stop strings", "stop")
        self.request_id = request_id
        self.prompt = prompt
        self.n = params.n
        extra = () if params.ignore_eos else text.tokenizer_eos
        base = attrs.evolve(params, n=1, stop_token_ids=(*params.stop_token_ids, *extra))
        runs = 1 if params.greedy else params.n  # greedy sequences are equal: run one
        self.requests: list[tuple[str, SamplingParams]] = [
            (request_id if runs == 1 else f"{request_id}-{i}",
             base if i == 0 or base.seed is None else attrs.evolve(base, seed=base.seed + i))
            for i in range(runs)
        ]
        eos = frozenset((*text.eos_token_ids, *text.tokenizer_eos))
        self.states = [SequenceState(p, tokenizer, eos) for _, p in self.requests]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.states)

    @property
    def error(self) -> RtpcoreError | None:
        return next((s.error for s in self.states if s.error is not None), None)

    def output(self) -> GenerationOutput:
        states: Sequence[SequenceState] = self.states if len(self.states) > 1 else self.states * self.n
        return GenerationOutput(
            request_id=self.request_id,
            prompt=self.prompt.text,
            prompt_token_ids=self.prompt.token_ids,
            outputs=tuple(s.output(i) for i, s in enumerate(states)),
            finished=self.finished,
            num_cached_tokens=self.states[0].num_cached_tokens,
        )

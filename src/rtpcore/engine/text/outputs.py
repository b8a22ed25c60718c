"""What the offline API returns: one :class:`GenerationOutput` per prompt, holding one
:class:`CompletionOutput` per generated sequence.

These are the shapes vLLM users know as ``RequestOutput`` and ``CompletionOutput``; the
first name is taken here by the engine core's per-step output
(:class:`rtpcore.engine.core.outputs.RequestOutput`: the new token ids of one step), so the
per-prompt result is called ``GenerationOutput``. ``Engine.generate`` and ``Engine.chat``
return finished ones; ``AsyncEngine.generate`` yields them cumulatively (``finished``
False until the last). How they are built is :mod:`rtpcore.engine.text.output_processor`.
"""

from __future__ import annotations

import attrs

from rtpcore.engine.sample.params import SampledToken

__all__ = ["CompletionOutput", "GenerationOutput"]


@attrs.frozen
class CompletionOutput:
    """One generated sequence of a prompt, so far.

    ``index``: its place among the prompt's ``n`` sequences. ``text``: the decoded text (cut
    before a stop string, which it keeps only with ``include_stop_str_in_output``; a stop
    token's text is never in it; special tokens left out unless ``skip_special_tokens`` is
    False), None when the checkpoint has no ``tokenizer.json``. ``token_ids``: every token
    generated, a stop token included, up to the one that completed a stop string.
    ``logprobs``: one :class:`~rtpcore.engine.sample.params.SampledToken` per token when the
    request asked for ``logprobs`` (the model's raw log-probabilities), else None;
    ``cumulative_logprob``: their sum, None when none were asked. ``finish_reason``: None
    while it runs, then ``"stop"`` (a stop token or a stop string), ``"length"``
    (``max_tokens``) or ``"abort"``. ``stop_reason``: the stop string, or the id of a
    ``stop_token_ids`` token, that ended it; None otherwise (an end-of-sequence token
    included, as in vLLM).
    """

    index: int
    text: str | None
    token_ids: tuple[int, ...]
    cumulative_logprob: float | None
    logprobs: tuple[SampledToken, ...] | None
    finish_reason: str | None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@attrs.frozen
class GenerationOutput:
    """The result of one prompt: ``outputs[i]`` is sequence ``i`` of ``n``.

    ``request_id``: the id the prompt ran under (``AsyncEngine.abort`` takes it): the engine
    request's, or with ``n`` sampled sequences the root of theirs (``f"{request_id}-{i}"``
    for sequence ``i``). ``prompt``: the prompt's text (a chat: the rendered
    conversation), None for a token-id prompt. ``prompt_token_ids``: the ids the model
    read. ``finished``: every sequence ended. ``num_cached_tokens``: prompt tokens found in
    the prefix cache.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    num_cached_tokens: int = 0

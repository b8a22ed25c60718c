"""``SequenceState.advance``: each engine output's delta -- the text it added and, with logprobs,
each token's piece -- joins to the sequence's text (what ``Engine.generate`` returns and the
server streams); a stop string ends it at the token that completed it, a stop token adds no
text, and text held back for a stop string that never came belongs to the last token."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rtpcore.engine.core.outputs import RequestOutput
from rtpcore.engine.sample.params import SampledToken, SamplingParams
from rtpcore.engine.text.output_processor import SequenceDelta, SequenceState

VOCAB = ["</s>", "Hel", "lo", " wor", "ld", "!", " EN", "D", " E"]
EOS = 0


class Pieces:
    """A tokenizer whose ids decode to fixed pieces; id 0 is special."""

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return "".join(VOCAB[i] for i in ids if not (skip_special_tokens and i == EOS))


def output(ids: list[int], finish: str | None = None, *, logprobs: bool = False, stop_token: int | None = None) -> RequestOutput:
    draws = tuple(SampledToken(i, -0.5 * i) for i in ids) if logprobs else None
    return RequestOutput("r", tuple(ids), finish, 3, 0, logprobs=draws, stop_token_id=stop_token)


def run(params: SamplingParams, outs: list[RequestOutput]) -> tuple[SequenceState, list[SequenceDelta]]:
    state = SequenceState(params, Pieces(), frozenset({EOS}))  # type: ignore[arg-type]
    return state, [state.advance(out) for out in outs]


def test_deltas_join_to_the_text_and_tokens_to_their_pieces() -> None:
    """Several tokens per output (a lagging consumer): the deltas' text joins to the output's text,
    and with logprobs each token carries its draw and the text it added."""
    state, deltas = run(SamplingParams(max_tokens=8, logprobs=0), [output([1, 2], logprobs=True),
                                                                   output([3, 4, 5], "length", logprobs=True)])
    assert [d.text for d in deltas] == ["Hello", " world!"]
    assert [(t.token_id, t.logprob, piece) for d in deltas for t, piece in d.tokens] == [
        (1, -0.5, "Hel"), (2, -1.0, "lo"), (3, -1.5, " wor"), (4, -2.0, "ld"), (5, -2.5, "!")]
    assert state.output(0).text == "Hello world!" and state.finish_reason == "length"


def test_without_logprobs_deltas_carry_text_only() -> None:
    """No logprobs asked: a delta's tokens are empty (a held-back piece makes no empty chunk)."""
    _, deltas = run(SamplingParams(max_tokens=8, stop=[" END"]), [output([1, 2]), output([6]), output([4], "length")])
    assert deltas == [SequenceDelta("Hello", ids=(1, 2)), SequenceDelta("", ids=(6,)), SequenceDelta(" ENld", ids=(4,))]


def test_a_stop_string_ends_the_sequence_at_the_token_that_completed_it() -> None:
    """" EN" + "D" completes the stop string: the text stops before it (or after it with
    include_stop_str_in_output), the tokens after it are not the sequence's, later outputs add nothing."""
    for include, text in ((False, "Hello"), (True, "Hello END")):
        params = SamplingParams(max_tokens=8, stop=[" END"], include_stop_str_in_output=include, logprobs=0)
        state, deltas = run(params, [output([1, 2, 6], logprobs=True), output([7, 3, 4], logprobs=True),
                                     output([5], "length", logprobs=True)])
        assert "".join(d.text for d in deltas) == text == state.output(0).text
        assert [t.token_id for d in deltas for t, _ in d.tokens] == [1, 2, 6, 7]
        assert state.token_ids == [1, 2, 6, 7] and deltas[2] == SequenceDelta()
        assert (state.finish_reason, state.stop_reason) == ("stop", " END")


def test_a_stop_token_counts_without_text() -> None:
    """The stop token is among the sequence's tokens (it counts in usage) but adds no text and no
    logprobs entry to the delta."""
    state, deltas = run(SamplingParams(max_tokens=8, logprobs=0), [output([1, 2, EOS], "stop", logprobs=True,
                                                                          stop_token=EOS)])
    assert deltas[0].text == "Hello" and [t.token_id for t, _ in deltas[0].tokens] == [1, 2]
    assert state.token_ids == [1, 2, EOS] and (state.finish_reason, state.stop_reason) == ("stop", None)


def test_text_held_back_for_a_stop_string_belongs_to_the_last_token() -> None:
    """" E" could start the stop string " END": it is held back, and at the end it is the last
    token's text (the completions logprobs' ``tokens`` still join to the text)."""
    params: Any = SamplingParams(max_tokens=3, stop=[" END"], logprobs=0)
    _, deltas = run(params, [output([1, 2], logprobs=True), output([8], "length", logprobs=True)])
    assert [d.text for d in deltas] == ["Hello", " E"]
    assert deltas[1].tokens == ((SampledToken(8, -4.0), " E"),)

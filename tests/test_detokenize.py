"""rtpcore.engine.text.detokenize: streamed text pieces equal the decode of the whole output, never
show half a UTF-8 character, and stop strings are matched across token boundaries."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rtpcore.engine.text.detokenize import IncrementalDecoder
from rtpcore.engine.text.tokenizer import Tokenizer
from tokenizer_files import CORPUS, byte_bpe

BPE = Tokenizer(byte_bpe())
FFFD = "\ufffd"

# text hypothesis draws from: ASCII, accents, CJK, emoji (4-byte, with modifiers), symbols
TEXT = st.text(
    alphabet=st.one_of(
        st.sampled_from(list("abc xyz,.!\n")),
        st.sampled_from(list("éüñ日本語東京中文😀🎉👍🏽✓—“”")),
        st.characters(codec="utf-8", exclude_categories=("Cs",)),
    ),
    max_size=40,
)
CHUNKS = st.lists(st.integers(1, 4), min_size=1, max_size=8)  # ids per push, cycled


def stream(decoder: IncrementalDecoder, ids: list[int], chunks: list[int]) -> list[str]:
    pieces, i, k = [], 0, 0
    while i < len(ids) and not decoder.stopped:
        n = chunks[k % len(chunks)]
        pieces.append(decoder.push(ids[i:i + n]))
        i, k = i + n, k + 1
    pieces.append(decoder.finish())
    return pieces


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXT, chunks=CHUNKS)
def test_pieces_concatenate_to_the_full_decode_without_half_characters(text: str, chunks: list[int]) -> None:
    """Fed in chunks of 1-4 ids, the emitted pieces join to decode(all) and no piece holds a
    U+FFFD that the full text does not."""
    ids = BPE.encode(text, add_special_tokens=False)
    full = BPE.decode(ids)
    assert full == text  # byte-level BPE round-trips
    pieces = stream(IncrementalDecoder(BPE), ids, chunks)
    assert "".join(pieces) == full
    assert all(FFFD not in p for p in pieces)


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, BPE.vocab_size - 1), max_size=30), chunks=CHUNKS)
def test_arbitrary_ids_even_invalid_utf8_concatenate_to_the_full_decode(ids: list[int], chunks: list[int]) -> None:
    """Any id sequence (special tokens, lone continuation bytes) streams to exactly decode(all),
    with special tokens skipped or kept."""
    for skip in (True, False):
        pieces = stream(IncrementalDecoder(BPE, skip_special_tokens=skip), ids, chunks)
        assert "".join(pieces) == BPE.decode(ids, skip_special_tokens=skip)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXT, stops=st.lists(TEXT.filter(bool).map(lambda s: s[:4]), min_size=1, max_size=3), chunks=CHUNKS,
       data=st.data())
def test_output_is_the_text_cut_before_the_first_stop_string(
    text: str, stops: list[str], chunks: list[int], data: st.DataObject
) -> None:
    """With stop strings the output is the full text cut before the earliest stop occurrence,
    whatever the token boundaries; no piece ever shows part of the stop string that matched."""
    if data.draw(st.booleans()) and text:  # often plant a stop string inside the text
        at = data.draw(st.integers(0, len(text)))
        text = text[:at] + stops[0] + text[at:]
    ids = BPE.encode(text, add_special_tokens=False)
    decoder = IncrementalDecoder(BPE, stop=stops)
    out = "".join(stream(decoder, ids, chunks))
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    want = text[:min(hits)] if hits else text
    assert out == want
    assert decoder.stopped == bool(hits)
    assert decoder.text == out
    if hits:
        assert decoder.stop_string is not None and text.find(decoder.stop_string) == min(hits)


def test_a_stop_string_split_over_tokens_is_held_back_then_trimmed() -> None:
    """Text that could begin a stop string is not emitted until it cannot; then it is."""
    byte_ids = [BPE.token_to_id(ch) for ch in "Hi##x"]
    assert None not in byte_ids
    decoder = IncrementalDecoder(BPE, stop=["##END"])
    assert decoder.push(byte_ids[:2]) == "Hi"
    assert decoder.push(byte_ids[2:4]) == ""  # '##' could start '##END'
    assert decoder.push(byte_ids[4:]) == "##x"  # '##x' cannot
    ids = BPE.encode("Paris##END and more", add_special_tokens=False)
    decoder = IncrementalDecoder(BPE, stop=["##END"])
    assert "".join(decoder.push([i]) for i in ids) + decoder.finish() == "Paris"
    assert decoder.stopped and decoder.stop_string == "##END"
    assert decoder.push(BPE.encode("more")) == "" and decoder.finish() == ""


def test_a_multibyte_character_split_over_tokens_waits_for_its_last_byte() -> None:
    """An emoji whose bytes come in separate tokens appears once, whole, with its last token."""
    raw = [BPE.token_to_id(c) for c in "ðŁĺĢ"]  # the byte-level symbols of F0 9F 98 80
    decoder = IncrementalDecoder(BPE)
    assert [decoder.push([i]) for i in raw] == ["", "", "", "😀"]
    assert decoder.finish() == ""


def test_a_truncated_character_at_the_end_flushes_as_the_full_decode_does() -> None:
    """Generation ending inside a character: finish() returns what decode(all) shows (U+FFFD)."""
    raw = [BPE.token_to_id(c) for c in "aðŁ"]
    decoder = IncrementalDecoder(BPE)
    assert decoder.push(raw[:1]) == "a"
    assert decoder.push(raw[1:]) == ""
    assert decoder.finish() == BPE.decode(raw)[1:] and FFFD in decoder.text


def test_special_tokens_are_skipped_or_kept() -> None:
    """The eos text is left out with skip_special_tokens (the default) and kept without it."""
    eot = BPE.token_to_id("<|eot_id|>")
    ids = [*BPE.encode("Done.", add_special_tokens=False), eot]
    assert "".join(stream(IncrementalDecoder(BPE), ids, [1])) == "Done."
    assert "".join(stream(IncrementalDecoder(BPE, skip_special_tokens=False), ids, [1])) == "Done.<|eot_id|>"


def test_stop_strings_are_validated() -> None:
    """An empty stop string would stop at once: refused with ValueError; a lone string is one stop."""
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDecoder(BPE, stop=["ok", ""])
    decoder = IncrementalDecoder(BPE, stop="Paris")
    assert "".join(stream(decoder, BPE.encode(CORPUS[0], add_special_tokens=False), [2])) == "The capital of France is "


def _sentencepiece_style() -> Tokenizer:
    """A Llama-2-style tokenizer: Metaspace pre-tokenizer, byte fallback, a decoder that strips
    the first token's leading space (the case that needs left context in the window)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = Backend(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=500, special_tokens=specials, show_progress=False))
    return Tokenizer(tok)


SENTENCEPIECE = _sentencepiece_style()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXT, chunks=CHUNKS)
def test_sentencepiece_style_decoders_stream_the_same_text(text: str, chunks: list[int]) -> None:
    """With byte fallback and a leading-space-stripping decoder the pieces still join to decode(all)."""
    ids = SENTENCEPIECE.encode(text, add_special_tokens=False)
    pieces = stream(IncrementalDecoder(SENTENCEPIECE), ids, chunks)
    assert "".join(pieces) == SENTENCEPIECE.decode(ids)
    assert all(FFFD not in p for p in pieces) or FFFD in SENTENCEPIECE.decode(ids)

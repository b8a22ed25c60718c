"""Incremental detokenization: generated ids in, text safe to stream out.

Two rules make streamed text equal the text of the finished request:

- **Whole characters only.** A byte-level BPE token can end inside a multi-byte UTF-8
  character; decoding it alone gives U+FFFD. New text is taken from the decode of a
  short window of ids (``prefix_offset:``) minus the decode of the ids already shown
  (``prefix_offset:read_offset``), and only while the window's decode does not end in
  U+FFFD; the window keeps one token of left context so that decoders that treat the
  first token specially (SentencePiece's leading space) decode the same as in the
  whole. A U+FFFD the full text really has (ids that are invalid UTF-8) is flushed
  once later tokens complete, or by :meth:`IncrementalDecoder.finish`.
- **Stop strings across token boundaries.** The tail of the text that could be the
  start of a stop string is held back until it cannot be; when a stop string appears
  the text is cut before it (the stop string and everything after are never emitted;
  with ``include_stop`` the stop string is emitted, nothing after it) and
  :attr:`IncrementalDecoder.stopped` turns True.

The cost per token is a decode of a few tokens, not of the whole output.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

__all__ = ["IncrementalDecoder"]

REPLACEMENT = "\ufffd"


class _Decodes(Protocol):
    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDecoder:
    """Turns one request's generated ids into text pieces, in order.

    ``push(ids)`` returns the text that is now safe to emit (possibly ""), ``finish()``
    the rest once generation ended. The pieces concatenate to
    ``tokenizer.decode(all_ids, skip_special_tokens)`` cut before the first stop string.
    """

    def __init__(
        self, tokenizer: _Decodes, *, skip_special_tokens: bool = True, stop: Sequence[str] = (),
        include_stop: bool = False,
    ):
        if isinstance(stop, str):
            stop = (stop,)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stop = tuple(dict.fromkeys(stop))
        self._include_stop = include_stop  # the text ends after the stop string, not before it
        self._ids: list[int] = []
        self._prefix_offset = 0  # ids[prefix_offset:read_offset] decode to text already taken
        self._read_offset = 0
        self._held = ""  # decoded text held back: it could be the start of a stop string
        self._pieces: list[str] = []
        self.stopped = False
        #: The stop string that ended the text, None until one did.
        self.stop_string: str | None = None

    @property
    def token_ids(self) -> list[int]:
        """Every id pushed so far (a copy)."""
        return list(self._ids)

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    def push(self, token_ids: Iterable[int]) -> str:
        """Add generated ids; return the new text safe to emit (may be "")."""
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        return self._emit(self._decode_new(final=False), final=False)

    def finish(self) -> str:
        """The end of generation: return all text still held (an incomplete character
        decodes as U+FFFD, as in the full decode; a partial stop string is text)."""
        if self.stopped:
            return ""
        return self._emit(self._decode_new(final=True), final=True)

    # -- internals ---------------------------------------------------------------------------
    def _decode_new(self, *, final: bool) -> str:
        """Text of the ids after ``read_offset`` that is complete (all of it when ``final``)."""
        if self._read_offset == len(self._ids):
            return ""
        decode = self._tokenizer.decode
        window = self._ids[self._prefix_offset:]
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=self._skip)
        full_text = decode(window, skip_special_tokens=self._skip)
        if not final and (len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT)):
            return ""  # nothing new yet, or the last character is still incomplete
        new = full_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new

    def _emit(self, new: str, *, final: bool) -> str:
        text = self._held + new
        cut = self._first_stop(text)
        if cut is not None:
            end = cut + len(self.stop_string or "") if self._include_stop else cut
            out, self._held = text[:end], ""
            self.stopped = True
        elif final or not self._stop:
            out, self._held = text, ""
        else:
            keep = self._partial_stop_length(text)
            out, self._held = text[: len(text) - keep], text[len(text) - keep:]
        if out:
            self._pieces.append(out)
        return out

    def _first_stop(self, text: str) -> int | None:
        """Index of the earliest stop-string occurrence in ``text`` (and remember which)."""
        best: int | None = None
        for s in self._stop:
            i = text.find(s)
            if i >= 0 and (best is None or i < best):
                best, self.stop_string = i, s
        return best

    def _partial_stop_length(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest

"""A checkpoint's tokenizer: ``tokenizer.json`` through the ``tokenizers`` library.

:meth:`Tokenizer.from_pretrained` sets the tokenizer up as transformers'
``AutoTokenizer`` does for a ``tokenizer.json`` checkpoint, so that ids agree with it:

- the named special tokens of ``tokenizer_config.json`` (``bos_token``, ``eos_token``,
  ... given as strings or as AddedToken dicts ``{"content": ...}``) and its
  ``added_tokens_decoder`` are special added tokens (a missing one gets the next id);
- ``tokenizer.json``'s post-processor alone decides what ``encode(...,
  add_special_tokens=True)`` adds (Llama 2 and 3 add their BOS that way);
  ``tokenizer_config.json``'s ``add_bos_token`` / ``add_eos_token`` are ignored, as
  transformers 5 ignores them whenever ``tokenizer.json`` exists.

``decode`` does not apply ``clean_up_tokenization_spaces``: transformers ignores it for
BPE tokenizers, which every supported model family uses. ``tokenizers`` is imported
when a tokenizer is loaded, not with this module.

The model's word cache is turned off (docs/design.md §22, memory under steady load). A BPE
or Unigram model of ``tokenizers`` keeps the merges of up to 10,000 pre-tokenized words for
each thread that encodes, and the server encodes in the event loop's worker threads (CPUs + 4
of them, up to 32): resident memory grew with every new word until every thread's cache was
full. A tokenizer that does not split its text (the demo's byte-level one) caches each whole
prompt, ~4 KB. Without the cache an encode of words seen before takes up to a fifth longer.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rtpcore.errors import CheckpointError, ConfigFieldError

logger = logging.getLogger(__name__)

__all__ = [
    "SPECIAL_TOKEN_NAMES", "Tokenizer", "has_tokenizer", "read_tokenizer_config", "special_tokens", "tokenizer_file",
]

#: The named special tokens transformers passes to chat templates, in its order.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def has_tokenizer(path: str | Path) -> bool:
    """Whether the checkpoint at ``path`` has a tokenizer: ``tokenizer.json`` in its folder, or
    a GGUF file's ``tokenizer.ggml.*`` vocabulary."""
    from rtpcore.checkpoint.gguf import is_gguf, open_gguf

    if is_gguf(path):
        return "tokenizer.ggml.tokens" in open_gguf(path).metadata
    return (Path(path) / "tokenizer.json").is_file()


def tokenizer_file(path: str | Path) -> Path:
    """``tokenizer.json`` of the checkpoint folder ``path``, without reading it. Raises
    :class:`~rtpcore.errors.CheckpointError` naming it when the checkpoint has none (what
    :meth:`Tokenizer.from_pretrained` raises; ``rtpcore serve`` asks before the engine loads)."""
    path = Path(path)
    file = path / "tokenizer.json"
    if not file.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} has no tokenizer: {str(file)!r} not found", path=file)
    return file


def read_tokenizer_config(path: str | Path) -> dict[str, Any]:
    """``tokenizer_config.json`` of the checkpoint folder ``path`` ({} when it has none); of a
    GGUF checkpoint, what its metadata says (special tokens, ``chat_template``:
    ``rtpcore.checkpoint.gguf.gguf_tokenizer_config``)."""
    from rtpcore.checkpoint.gguf import gguf_tokenizer_config, is_gguf, open_gguf

    if is_gguf(path):
        return gguf_tokenizer_config(open_gguf(path))
    file = Path(path) / "tokenizer_config.json"
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{str(file)!r} is not readable JSON: {exc}", path=file) from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{str(file)!r} must hold a JSON object, found {type(data).__name__}", path=file)
    return data


def special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens of a ``tokenizer_config.json`` as strings, e.g.
    ``{"bos_token": "<s>", "eos_token": "</s>"}``; absent or null ones are left out."""
    out: dict[str, str] = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):  # an AddedToken: {"content": "<s>", "lstrip": false, ...}
            value = value.get("content")
        if value is None:
            continue
        if not isinstance(value, str):
            raise ConfigFieldError(
                f"tokenizer_config.json: {name!r} must be a string or {{'content': str}}, got {value!r}",
                file="tokenizer_config.json", field=name, value=value,
            )
        out[name] = value
    return out


class Tokenizer:
    """Text <-> token ids of one checkpoint. Build it with :meth:`from_pretrained`.

    ``special_tokens`` maps the named special tokens to their text (what chat templates
    receive); ``special_ids`` are the ids ``decode(..., skip_special_tokens=True)`` drops.
    """

    def __init__(self, backend: Any, *, special_tokens: Mapping[str, str] | None = None, path: Path | None = None):
        self._backend = backend  # a tokenizers.Tokenizer
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.path = path
        self.special_ids: frozenset[int] = frozenset(
            i for i, token in backend.get_added_tokens_decoder().items() if token.special
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load ``path/tokenizer.json`` and ``path/tokenizer_config.json`` (optional), or a GGUF
        checkpoint's vocabulary (``rtpcore.checkpoint.gguf.vocab``).

        Raises :class:`~rtpcore.errors.CheckpointError` naming ``tokenizer.json`` when the
        checkpoint has none or it cannot be read.
        """
        from tokenizers import Tokenizer as Backend

        from rtpcore.checkpoint.gguf import gguf_tokenizer, is_gguf, open_gguf

        path = Path(path)
        if is_gguf(path):  # docs/design.md §20: the vocabulary of tokenizer.ggml.*, rebuilt
            backend = gguf_tokenizer(open_gguf(path))
            _no_word_cache(backend)
            return cls(backend, special_tokens=special_tokens(read_tokenizer_config(path)), path=path)
        file = tokenizer_file(path)
        try:
            backend = Backend.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
            raise CheckpointError(f"{str(file)!r} is not a tokenizer the tokenizers library reads: {exc}", path=file) from exc
        config = read_tokenizer_config(path)
        specials = special_tokens(config)
        _add_declared_tokens(backend, config.get("added_tokens_decoder"), specials.values())
        _no_word_cache(backend)
        return cls(backend, special_tokens=specials, path=path)

    # -- ids ---------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the checkpoint's BOS/EOS rule applies.

        Encoded by the ``tokenizers`` batch encoder (``encode_batch_fast``, else ``encode_batch``;
        the ids are ``encode``'s), which releases the GIL while it works: a long prompt encoded in
        a worker thread leaves the other threads -- the server's event loop -- running. A single
        ``encode`` holds the GIL throughout (seconds for a few megabytes of text)."""
        backend = self._backend
        batch = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
        return list(batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens are left out unless ``skip_special_tokens`` is False."""
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        """The id of one token's text (``"<|eot_id|>"``), None if the vocabulary lacks it."""
        found = self._backend.token_to_id(token)
        return None if found is None else int(found)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry of one id as stored (byte-level BPE: ``"Ġworld"``), unique per
        id unlike decoded pieces (two ids can each decode to half a character); ``"<id N>"``
        for an id the vocabulary lacks."""
        found = self._backend.id_to_token(int(token_id))
        return f"<id {token_id}>" if found is None else str(found)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token writes after other text (:meth:`token_table`'s entry), even
        when they are part of a character; an added or special token's text; for an entry
        whose bytes cannot be known (see :meth:`token_table`), the UTF-8 of its decoded text."""
        token_id = int(token_id)
        table = self.__dict__.get("_table")  # built already (a grammar compiler asked): read it
        if table is not None and 0 <= token_id < len(table) and table[token_id]:
            return table[token_id]
        added = self._backend.get_added_tokens_decoder()
        if token_id in added:
            return str(added[token_id].content).encode()
        anchor, head = self._anchor
        text = self._backend.decode([anchor, token_id], skip_special_tokens=False)
        found = self._piece_bytes(token_id, text, head)
        return found if found is not None else self.decode([token_id], skip_special_tokens=False).encode()

    def token_table(self) -> tuple[bytes, ...]:
        """Every id's bytes (index: the id, :attr:`vocab_size` entries), as the tokenizer's own
        decoder writes them after other text: the decode of ``[anchor, id]`` past the decode of
        ``[anchor]``, for one plain ASCII token ``anchor`` (a SentencePiece or Metaspace ``▁``
        gives its space, a WordPiece ``##`` piece none and a whole word its leading space).
        Nothing is inferred from the decoder's type: whatever decoder ``tokenizer.json`` holds
        is run by the ``tokenizers`` library itself. A token that is part of a character
        decodes to U+FFFD; its bytes come from its vocabulary entry -- the byte-level alphabet
        (``Ġ``, ``â``) or a byte-fallback entry (``<0xE2>``) -- and only when they decode to
        what the tokenizer decoded; an entry no reading fits gets ``b""`` (a grammar never
        writes it). Added and special tokens: their text. Built once, in one batched decode."""
        return self._table

    @functools.cached_property
    def text_start(self) -> str:
        """What a text read through :meth:`token_table` starts with before its first token:
        ``" "`` for a tokenizer that writes a word at the start of a text without the leading
        space it writes after text (WordPiece: ``"{"`` is ``" {"`` after text, ``"{"`` first)
        while other tokens write something else there (a ``##`` piece keeps its ``##``): a
        text must then start with a whole word, whose space the decoder drops. ``""`` for
        every other tokenizer (byte-level BPE writes its spaces wherever they are; a
        SentencePiece ``▁`` dropped at the start is harmless, as nothing else changes there).

        A constrained request's text starts after nothing, so a grammar reading the table
        is given this start first (``rtpcore.engine.sample.grammar``)."""
        table = self._table
        added = self.added_token_ids
        ids = [i for i in range(len(table)) if i not in added and table[i]]
        alone = self._backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
        drops = other = False
        for i, text in zip(ids, alone, strict=True):
            if REPLACEMENT in text:
                continue
            raw, start = table[i], text.encode()
            if raw == start:
                continue
            if raw == b" " + start:
                drops = True
            else:
                other = True
        return " " if drops and other else ""

    @functools.cached_property
    def _table(self) -> tuple[bytes, ...]:
        n = self.vocab_size
        added = self._backend.get_added_tokens_decoder()
        anchor, head = self._anchor
        ids = [i for i in range(n) if i not in added]
        texts = self._backend.decode_batch([[anchor, i] for i in ids], skip_special_tokens=False)
        table = [b""] * n
        for i, text in zip(ids, texts, strict=True):
            table[i] = self._piece_bytes(i, text, head) or b""
        for i, token in added.items():
            if 0 <= i < n:
                table[i] = str(token.content).encode()
        return tuple(table)

    @functools.cached_property
    def _anchor(self) -> tuple[int, str]:
        """A token that decodes alone to plain ASCII letters (``"a"``, ``"▁a"``, ...), and its
        decoded text: what :meth:`token_table` decodes each token after."""
        added = self._backend.get_added_tokens_decoder()
        words = [self.encode(word, add_special_tokens=False) for word in ("a", "the", "x")]
        candidates = [ids[0] for ids in words if len(ids) == 1]
        candidates += [i for i in range(self.vocab_size) if i not in added]
        for i in candidates:
            text = str(self._backend.decode([i], skip_special_tokens=False))
            if text.isascii() and text.isalpha():
                return i, text
        return (candidates[0] if candidates else 0), ""

    def _piece_bytes(self, token_id: int, text: str, head: str) -> bytes | None:
        """The bytes of ``token_id`` from the decode ``text`` of ``[anchor, token_id]`` (``head``:
        the anchor's own decode); None when they cannot be known."""
        piece = text[len(head) :] if text.startswith(head) else None
        if piece is not None and REPLACEMENT not in piece:
            return piece.encode()
        entry = self._backend.id_to_token(token_id)
        if entry is None:
            return None
        alphabet = _byte_level_decoder()
        readings = []
        if all(c in alphabet for c in entry):
            readings.append(bytes(alphabet[c] for c in entry))
        m = _BYTE_FALLBACK.fullmatch(entry)
        if m is not None:
            readings.append(bytes([int(m.group(1), 16)]))
        want = piece if piece is not None else str(self._backend.decode([token_id], skip_special_tokens=False))
        for raw in readings:  # the reading that decodes as the tokenizer decoded the token
            if raw.decode("utf-8", "replace") == want:
                return raw
        return None

    @property
    def json_path(self) -> Path:
        """The ``tokenizer.json`` this tokenizer was read from (a grammar library reads it too)."""
        if self.path is None:
            raise ValueError("this tokenizer was not read from a checkpoint folder")
        return self.path / "tokenizer.json"

    @functools.cached_property
    def added_token_ids(self) -> frozenset[int]:
        """The ids of added tokens (special or not: ``tokenizer.json``'s ``added_tokens`` and
        those ``tokenizer_config.json`` declares)."""
        return frozenset(int(i) for i in self._backend.get_added_tokens_decoder())

    @functools.cached_property
    def max_chars_per_token(self) -> int | None:
        """The most characters of input text one token can stand for, or None when no bound
        holds. Read once from ``tokenizer.json``: the longest vocabulary entry or added token
        (an entry spells at least as many characters as it covers: a byte-level BPE entry
        spells its bytes, a byte-fallback ``<0xE2>`` six characters for one byte), times how
        many characters the normalizer can fold into one (NFC and NFKC compose at most four
        code points into one; a ``Replace`` of a string by a shorter one folds by their ratio).
        None where text can vanish or one token can cover any run of it: a normalizer that
        strips (``Strip``, ``StripAccents``, BERT's, a precompiled SentencePiece map, a regex
        ``Replace``), a pre-tokenizer that drops what it splits on (whitespace splitting,
        ``Removed`` behaviour), an added token that swallows the blanks beside it (``lstrip``,
        ``rstrip``), a model whose unknown token stands for a whole word or a fused run
        (WordPiece, WordLevel, Unigram without byte fallback, BPE with ``fuse_unk``), or a BPE
        that drops characters it has no entry for. ``TextSide.check_length`` divides a
        prompt's characters by it."""
        config = json.loads(self._backend.to_str())
        return _max_chars_per_token(config, self._backend.get_vocab(with_added_tokens=True))

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        return self._named_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        """The id of ``tokenizer_config.json``'s ``eos_token`` (the model's stop tokens come
        from ``generation_config.json`` / ``config.json``; this is the tokenizer's view)."""
        return self._named_id("eos_token")

    def _named_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.token_to_id(token)

    def __repr__(self) -> str:
        return f"Tokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size})"


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not a whole character


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE's alphabet back to bytes: printable Latin-1 bytes stand for themselves,
    the other 68 byte values for the characters from U+0100 on, in order (GPT-2's mapping)."""
    direct = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    table = {chr(b): b for b in direct}
    shifted = 0
    for b in range(256):
        if b not in table.values():
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


_KEEPING_NORMALIZERS = frozenset({"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"})  # never shorten text
_COMPOSING_NORMALIZERS = frozenset({"NFC", "NFKC"})
_COMPOSED = 4  # code points composition folds into one at most: the longest canonical decomposition
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"})


def _max_chars_per_token(config: Mapping[str, Any], vocab: Iterable[str]) -> int | None:
    """:attr:`Tokenizer.max_chars_per_token` from a parsed ``tokenizer.json`` and its vocabulary
    (added tokens included)."""
    fold = _fold(config.get("normalizer"))
    if fold is None or not _keeps_text(config.get("pre_tokenizer")):
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in config.get("added_tokens") or () if isinstance(t, dict)):
        return None
    entries = list(vocab)
    if not entries or not _covers_every_character(config, entries):
        return None
    return max(len(e) for e in entries) * fold


def _fold(normalizer: Any) -> int | None:
    """How many input characters ``normalizer`` can make into one (None: unbounded)."""
    if normalizer is None:
        return 1
    if not isinstance(normalizer, Mapping):
        return None
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers") or ():
            f = _fold(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in _KEEPING_NORMALIZERS:
        return 1
    if kind in _COMPOSING_NORMALIZERS:
        return _COMPOSED
    if kind == "Replace":
        pattern, content = (normalizer.get("pattern") or {}).get("String"), normalizer.get("content")
        if isinstance(pattern, str) and pattern and isinstance(content, str) and content:
            return max(1, -(-len(pattern) // len(content)))
    return None


def _keeps_text(pre_tokenizer: Any) -> bool:
    """Whether ``pre_tokenizer`` hands on every character it is given."""
    if pre_tokenizer is None:
        return True
    if not isinstance(pre_tokenizer, Mapping):
        return False
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p) for p in pre_tokenizer.get("pretokenizers") or ())
    if kind in ("Split", "Punctuation"):
        return pre_tokenizer.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _covers_every_character(config: Mapping[str, Any], vocab: list[str]) -> bool:
    """Whether the model gives every character a token of its own or part of one (never one
    unknown token for a run of them, never nothing)."""
    model = config.get("model") or {}
    kind = model.get("type")
    if kind == "Unigram":
        return bool(model.get("byte_fallback"))
    if kind != "BPE":
        return False  # WordPiece, WordLevel: one unknown token stands for a whole word
    if model.get("byte_fallback"):
        return True
    if model.get("unk_token") is not None:
        return not model.get("fuse_unk")
    # No unknown token: a character without an entry is dropped, unless byte-level BPE has every byte.
    byte_level = any(_has_type(config.get(part), "ByteLevel") for part in ("normalizer", "pre_tokenizer"))
    return byte_level and set(_byte_level_decoder()) <= set(vocab)


def _has_type(node: Any, kind: str) -> bool:
    if not isinstance(node, Mapping):
        return False
    if node.get("type") == kind:
        return True
    return any(_has_type(p, kind) for key in ("normalizers", "pretokenizers") for p in node.get(key) or ())


def _no_word_cache(backend: Any) -> None:
    """Turn off the word cache of ``backend``'s model (BPE, Unigram: the module docstring)
    through ``tokenizers``' ``_resize_cache`` (since 0.20.2, the floor rtpcore requires; its
    only way to size the cache of a loaded tokenizer). tests/test_tokenizer.py fails if the
    method goes or stops bounding memory; here a model that has a cache but not the method is
    said in the log, once, and keeps its cache."""
    model = backend.model
    resize = getattr(model, "_resize_cache", None)
    if resize is not None:
        resize(0)
    elif hasattr(model, "_clear_cache"):
        _cannot_resize(type(model).__name__)


@functools.cache  # said once per kind of model
def _cannot_resize(kind: str) -> None:
    logger.warning("this tokenizers release cannot turn off the word cache of a %s model: resident memory "
                   "grows with each new word until the caches (one per thread) fill", kind)


def _add_declared_tokens(backend: Any, declared: object, named: Iterable[str]) -> None:
    """Add the tokens ``tokenizer_config.json`` declares that ``tokenizer.json`` lacks (as
    transformers does), and make every named special token special."""
    from tokenizers import AddedToken

    existing = {t.content: t for t in backend.get_added_tokens_decoder().values()}
    if isinstance(declared, dict):
        for _, spec in sorted(declared.items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else 0):
            if not isinstance(spec, dict) or not isinstance(spec.get("content"), str) or spec["content"] in existing:
                continue
            options = {k: bool(spec[k]) for k in ("single_word", "lstrip", "rstrip", "normalized", "special") if k in spec}
            token = AddedToken(spec["content"], **options)
            (backend.add_special_tokens if token.special else backend.add_tokens)([token])
            existing[token.content] = token
    missing = [t for t in dict.fromkeys(named) if t not in existing or not existing[t].special]
    if missing:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])


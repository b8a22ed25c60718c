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
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rtpcore.errors import CheckpointError, ConfigFieldError

__all__ = ["SPECIAL_TOKEN_NAMES", "Tokenizer", "read_tokenizer_config", "special_tokens"]

#: The named special tokens transformers passes to chat templates, in its order.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def read_tokenizer_config(path: str | Path) -> dict[str, Any]:
    """``tokenizer_config.json`` of the checkpoint folder ``path`` ({} when it has none)."""
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
        """Load ``path/tokenizer.json`` and ``path/tokenizer_config.json`` (optional).

        Raises :class:`~rtpcore.errors.CheckpointError` naming ``tokenizer.json`` when the
        checkpoint has none or it cannot be read.
        """
        from tokenizers import Tokenizer as Backend

        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise CheckpointError(
                f"checkpoint {str(path)!r} has no tokenizer: {str(file)!r} not found", path=file
            )
        try:
            backend = Backend.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
            raise CheckpointError(f"{str(file)!r} is not a tokenizer the tokenizers library reads: {exc}", path=file) from exc
        config = read_tokenizer_config(path)
        specials = special_tokens(config)
        _add_declared_tokens(backend, config.get("added_tokens_decoder"), specials.values())
        return cls(backend, special_tokens=specials, path=path)

    # -- ids ---------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the checkpoint's BOS/EOS rule applies."""
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

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


"""A GGUF file's tokenizer as a ``tokenizers.Tokenizer``, and its ``tokenizer_config.json``.

llama.cpp stores the vocabulary as ``tokenizer.ggml.*`` keys and implements each tokenizer
itself; rtpcore rebuilds the ``tokenizer.json`` transformers would load, so that serving,
chat templates, detokenization and structured output run on it unchanged:

- ``tokenizer.ggml.model = "gpt2"``: byte-level BPE. ``tokens`` (ids in order), ``merges``
  (``"a b"``), ``token_type`` (CONTROL tokens become special added tokens, USER_DEFINED ones
  plain added tokens) and the pre-tokenizer named by ``tokenizer.ggml.pre``, which names one
  that llama.cpp implements by a regex: :data:`PRE_TOKENIZERS` maps the names to the
  ``tokenizer.json`` pre-tokenizers they stand for (another name is a CheckpointError naming
  the key and the value, rather than text split differently than the model was trained on).
- ``tokenizer.ggml.model = "llama"``: SentencePiece BPE. ``tokens``, ``scores`` and
  ``token_type`` (BYTE tokens ``<0xNN>`` are the byte fallback), a space prepended to the text
  (``tokenizer.ggml.add_space_prefix``, default true) and spaces written as ``▁``. llama.cpp
  merges the adjacent pair whose joined piece has the highest score; the BPE built here has
  one merge per way of splitting each piece into two pieces, ranked by that score, which
  merges the same way (transformers converts SentencePiece models the same way).

``add_bos_token`` (``tokenizer.ggml.add_bos_token``; default: true for SentencePiece, false for
byte-level BPE, as llama.cpp) becomes a post-processor that prepends BOS. The chat template is
``tokenizer.chat_template``.
"""

from __future__ import annotations

import json
from typing import Any

from rtpcore.checkpoint.gguf.reader import GGUFCheckpoint, _fail

__all__ = ["PRE_TOKENIZERS", "gguf_tokenizer", "gguf_tokenizer_config"]

# llama.cpp's token types (llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytes(regex: str) -> dict[str, Any]:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
    ]}


_SMOLLM = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _GPT2]}

#: ``tokenizer.ggml.pre`` -> (the ``tokenizer.json`` pre-tokenizer it stands for, BPE ``ignore_merges``).
PRE_TOKENIZERS: dict[str, tuple[dict[str, Any], bool]] = {
    "default": (_GPT2, False),
    "gpt-2": (_GPT2, False),
    "gpt2": (_GPT2, False),
    "mpt": (_GPT2, False),
    "olmo": (_GPT2, False),
    "llama-bpe": (_split_then_bytes(_LLAMA3_REGEX), True),
    "llama3": (_split_then_bytes(_LLAMA3_REGEX), True),
    "smaug-bpe": (_split_then_bytes(_LLAMA3_REGEX), False),
    "dbrx": (_split_then_bytes(_LLAMA3_REGEX), False),
    "qwen2": (_split_then_bytes(_QWEN2_REGEX), False),
    "deepseek-r1-qwen": (_split_then_bytes(_QWEN2_REGEX), False),
    "stablelm2": (_split_then_bytes(_QWEN2_REGEX), False),
    "smollm": (_SMOLLM, False),
    "starcoder": (_SMOLLM, False),
    "refact": (_SMOLLM, False),
}


def gguf_tokenizer(checkpoint: GGUFCheckpoint) -> Any:
    """The checkpoint's tokenizer as a ``tokenizers.Tokenizer``; a vocabulary it cannot
    rebuild is a CheckpointError naming the file and the key."""
    from tokenizers import Tokenizer

    model = checkpoint.require("tokenizer.ggml.model", str)
    tokens = checkpoint.require("tokenizer.ggml.tokens", list)
    types = checkpoint.get("tokenizer.ggml.token_type", [_NORMAL] * len(tokens), list)
    if len(types) != len(tokens):
        raise _fail(checkpoint.files[0], f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} "
                    "tokens", "tokenizer.ggml.token_type")
    if model == "gpt2":
        doc = _byte_level(checkpoint, tokens)
    elif model == "llama":
        doc = _sentencepiece(checkpoint, tokens, types)
    else:
        raise _fail(checkpoint.files[0], f"tokenizer.ggml.model {model!r} is not supported (supported: 'gpt2', "
                    "'llama')", "tokenizer.ggml.model")
    doc["added_tokens"] = _added_tokens(tokens, types)
    doc["post_processor"] = _post_processor(checkpoint, tokens, model)
    try:
        return Tokenizer.from_str(json.dumps(doc))
    except Exception as e:  # tokenizers raises a bare Exception
        raise _fail(checkpoint.files[0], f"its tokenizer.ggml.* vocabulary does not build a tokenizer ({e})",
                    "tokenizer.ggml.tokens") from e


def gguf_tokenizer_config(checkpoint: GGUFCheckpoint) -> dict[str, Any]:
    """What ``tokenizer_config.json`` would hold: the named special tokens (``bos_token``,
    ``eos_token``, ``unk_token``, ``pad_token``) as text, ``add_bos_token`` and the
    ``chat_template`` when the file has one."""
    tokens = checkpoint.get("tokenizer.ggml.tokens", [], list)
    config: dict[str, Any] = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        i = checkpoint.get(f"tokenizer.ggml.{key}_token_id", None, int)
        if i is None:
            continue
        if not 0 <= i < len(tokens):
            raise _fail(checkpoint.files[0], f"tokenizer.ggml.{key}_token_id {i} is not a token id "
                        f"(0..{len(tokens) - 1})", f"tokenizer.ggml.{key}_token_id")
        config[name] = tokens[i]
    config["add_bos_token"] = _add_bos(checkpoint)
    template = checkpoint.get("tokenizer.chat_template", None, str)
    if template is not None:
        config["chat_template"] = template
    return config


def _add_bos(checkpoint: GGUFCheckpoint) -> bool:
    default = checkpoint.get("tokenizer.ggml.model", None) == "llama"
    return bool(checkpoint.get("tokenizer.ggml.add_bos_token", default, bool))


def _byte_level(checkpoint: GGUFCheckpoint, tokens: list[str]) -> dict[str, Any]:
    pre = checkpoint.get("tokenizer.ggml.pre", "default", str)
    if pre not in PRE_TOKENIZERS:
        raise _fail(checkpoint.files[0], f"tokenizer.ggml.pre {pre!r} names a pre-tokenizer rtpcore does not know "
                    f"(known: {', '.join(sorted(PRE_TOKENIZERS))})", "tokenizer.ggml.pre")
    pre_tokenizer, ignore_merges = PRE_TOKENIZERS[pre]
    merges = checkpoint.require("tokenizer.ggml.merges", list)
    pairs = []
    for m in merges:
        left, sep, right = str(m).partition(" ")
        if not sep:
            raise _fail(checkpoint.files[0], f"tokenizer.ggml.merges holds {m!r}, not 'left right'",
                        "tokenizer.ggml.merges")
        pairs.append([left, right])
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": ignore_merges,
            "vocab": _vocab(tokens), "merges": pairs,
        },
    }


def _sentencepiece(checkpoint: GGUFCheckpoint, tokens: list[str], types: list[int]) -> dict[str, Any]:
    scores = checkpoint.require("tokenizer.ggml.scores", list)
    if len(scores) != len(tokens):
        raise _fail(checkpoint.files[0], f"tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens",
                    "tokenizer.ggml.scores")
    vocab = _vocab(tokens)
    mergeable = {t: i for i, t in enumerate(tokens) if types[i] in (_NORMAL, _USER_DEFINED, _UNUSED)}
    ranked = []
    for piece, i in mergeable.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-float(scores[i]), i, mergeable[left], mergeable[right], left, right))
    ranked.sort()
    unk_id = checkpoint.get("tokenizer.ggml.unknown_token_id", None, int)
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    prefix = bool(checkpoint.get("tokenizer.ggml.add_space_prefix", True, bool))
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    normalizers = [{"type": "Prepend", "prepend": "\u2581"}, replace] if prefix else [replace]
    decoders: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
            "vocab": vocab, "merges": [[r[4], r[5]] for r in ranked],
        },
    }


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a duplicate entry (padding tokens) keeps its first id
    return vocab


def _added_tokens(tokens: list[str], types: list[int]) -> list[dict[str, Any]]:
    out = []
    for i, (t, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind in (_CONTROL, _UNKNOWN, _USER_DEFINED):
            out.append({
                "id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": False, "special": kind != _USER_DEFINED,
            })
    return out


def _post_processor(checkpoint: GGUFCheckpoint, tokens: list[str], model: str) -> dict[str, Any] | None:
    bos_id = checkpoint.get("tokenizer.ggml.bos_token_id", None, int)
    eos_id = checkpoint.get("tokenizer.ggml.eos_token_id", None, int)
    add_eos = bool(checkpoint.get("tokenizer.ggml.add_eos_token", False, bool))
    specials: dict[str, dict[str, Any]] = {}
    single: list[dict[str, Any]] = []
    if _add_bos(checkpoint) and bos_id is not None and 0 <= bos_id < len(tokens):
        specials[tokens[bos_id]] = {"id": tokens[bos_id], "ids": [bos_id], "tokens": [tokens[bos_id]]}
        single.append({"SpecialToken": {"id": tokens[bos_id], "type_id": 0}})
    single.append({"Sequence": {"id": "A", "type_id": 0}})
    if add_eos and eos_id is not None and 0 <= eos_id < len(tokens):
        specials[tokens[eos_id]] = {"id": tokens[eos_id], "ids": [eos_id], "tokens": [tokens[eos_id]]}
        single.append({"SpecialToken": {"id": tokens[eos_id], "type_id": 0}})
    if not specials:
        return None
    pair = [*single, *[{"Sequence": {"id": "B", "type_id": 1}} if "Sequence" in p else p for p in single]]
    return {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials}

"""Real tokenizer files for the serving tests: a small byte-level BPE trained with the
``tokenizers`` library, written as a checkpoint's ``tokenizer.json`` (+ ``tokenizer_config.json``).

Its merges split multi-byte UTF-8 characters (CJK, emoji) across tokens, which is what
incremental detokenization has to survive.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

CORPUS = [
    "The capital of France is Paris. The capital of Japan is Tokyo.",
    "Hello, world! How are you today? I am fine, thank you.",
    "日本語のテキスト、東京は首都です。中文文本，北京是首都。",
    "emoji 😀🎉👍🏽 and naïve café, Ünïcödé ✓ — “quotes”",
    "def f(x):\n    return x * 2\n\nprint(f(21))",
]
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]


@cache
def _trained_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return str(tok.to_str())


def byte_bpe(vocab_size: int = 420, *, bos_processor: bool = False) -> Any:
    """A fresh ``tokenizers.Tokenizer``; with ``bos_processor`` its post-processor adds
    ``<|begin_of_text|>`` as Llama 3's tokenizer.json does."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_str(_trained_json(vocab_size))
    if bos_processor:
        bos = "<|begin_of_text|>"
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, tok.token_to_id(bos))],
        )
    return tok


def write_tokenizer(
    path: Path, config: dict[str, Any] | None = None, *, bos_processor: bool = False, tokenizer: Any = None
) -> Path:
    """Write ``tokenizer.json`` (the trained BPE unless ``tokenizer`` is given) and, when
    ``config`` is given, ``tokenizer_config.json`` into ``path``; return ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    (tokenizer or byte_bpe(bos_processor=bos_processor)).save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return path


# -- one tokenizer of each kind a checkpoint ships (structured output over any tokenizer) -------------

KIND_CORPUS = [
    "The capital of France is Paris. The capital of Japan is Tokyo.",
    "Hello, world! How are you today? I am fine, thank you.",
    '{"name": "Ada", "age": 36, "role": "admin", "active": true, "tags": ["a", "b"], "address": {"zip": 12345}}',
    '{"id": 7, "kind": "x", "note": "short"} [1, 2, 3] {"a": null, "b": false}',
    "Caf\u00e9 na\u00efve \u00fcber \u65e5\u672c\u8a9e \U0001f600 emoji and accents \u2713.",
] * 8
KIND_SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]  # bos 1, eos 2, as config.json
KINDS = ("byte_level", "metaspace", "sentencepiece", "fuse", "wordpiece")


@cache
def _kind_json(kind: str) -> str:
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    if kind == "byte_level":  # GPT-2, Llama 3, Qwen
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(KIND_CORPUS, trainers.BpeTrainer(
            vocab_size=400, special_tokens=KIND_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False))
    elif kind == "metaspace":  # a SentencePiece model converted with the Metaspace pre-tokenizer and decoder (T5-style)
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
        tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
        tok.train_from_iterator(KIND_CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=KIND_SPECIALS,
                                                                 show_progress=False))
    elif kind == "wordpiece":  # BERT's model and decoder ("##" continues a word; words are joined by spaces)
        tok = Tokenizer(models.WordPiece(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.WordPiece(prefix="##")
        tok.train_from_iterator(KIND_CORPUS, trainers.WordPieceTrainer(vocab_size=500, special_tokens=KIND_SPECIALS,
                                                                       show_progress=False))
    else:  # "sentencepiece" / "fuse": a SentencePiece BPE as transformers converts Llama 2's: no pre-tokenizer,
        # a normalizer writing spaces as "▁" (one prepended), "<0xNN>" byte-fallback pieces; the decoder turns
        # "▁" back into spaces, fuses and strips the first space -- with ByteFallback, or ("fuse") without it
        norm = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        trained = Tokenizer(models.BPE(unk_token="<unk>"))
        trained.normalizer = norm
        trained.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
        trained.train_from_iterator(KIND_CORPUS, trainers.BpeTrainer(vocab_size=500, special_tokens=KIND_SPECIALS,
                                                                     show_progress=False))
        data = json.loads(trained.to_str())["model"]
        vocab = {t: i for i, t in enumerate(KIND_SPECIALS)}
        vocab.update({f"<0x{b:02X}>": len(KIND_SPECIALS) + b for b in range(256)})
        for piece, _ in sorted(data["vocab"].items(), key=lambda kv: kv[1]):
            vocab.setdefault(piece, len(vocab))
        merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in data["merges"]]
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
        tok.normalizer = norm
        parts = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        tok.decoder = decoders.Sequence(parts if kind == "sentencepiece" else [parts[0], *parts[2:]])
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in KIND_SPECIALS])
    return str(tok.to_str())


def kind_tokenizer(kind: str) -> Any:
    """A fresh ``tokenizers.Tokenizer`` of ``kind`` (one of :data:`KINDS`), trained on
    :data:`KIND_CORPUS` (JSON among it), ids 0-4 :data:`KIND_SPECIALS`: ``byte_level`` BPE;
    ``metaspace`` BPE (Metaspace pre-tokenizer and decoder); ``sentencepiece``, a SentencePiece
    BPE as transformers converts it (byte fallback; decoder Replace, ByteFallback, Fuse, Strip);
    ``fuse``, the same without ByteFallback in the decoder (a custom decoder: ``<0xNN>`` pieces
    decode as written); ``wordpiece`` (BERT's model and decoder)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_kind_json(kind))


def write_kind(path: Path, kind: str, chat_template: str | None = None) -> int:
    """``tokenizer.json`` of :func:`kind_tokenizer` and a ``tokenizer_config.json`` (``<s>``,
    ``</s>``, ``<unk>``, and ``chat_template`` when given) in ``path``; the vocabulary size."""
    tok = kind_tokenizer(kind)
    config: dict[str, Any] = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    write_tokenizer(path, config, tokenizer=tok)
    return int(tok.get_vocab_size())

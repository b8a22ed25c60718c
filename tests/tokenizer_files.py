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

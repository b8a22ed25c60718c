"""A checkpoint's tokenizer: moved to :mod:`rtpcore.engine.text.tokenizer`, which the engine's
offline text API (``Engine.generate`` on strings, ``Engine.chat``) needs below the serving
stage. This module re-exports it so that existing imports keep working."""

from __future__ import annotations

from rtpcore.engine.text.tokenizer import (
    SPECIAL_TOKEN_NAMES,
    Tokenizer,
    read_tokenizer_config,
    special_tokens,
)

__all__ = ["SPECIAL_TOKEN_NAMES", "Tokenizer", "read_tokenizer_config", "special_tokens"]

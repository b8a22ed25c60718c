"""A checkpoint's ``generation_config.json``: the stop ids generation uses (what transformers
reads first, before config.json)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from rtpcore import config_fields

__all__ = ["eos_token_ids"]

logger = logging.getLogger(__name__)


def eos_token_ids(hf: dict[str, Any], path: Path) -> tuple[int, ...]:
    """``eos_token_id`` of generation_config.json when it has one (what transformers uses),
    else of config.json: null, a token id or a list of them; anything else is a
    ``ConfigFieldError`` naming the file."""
    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            fields = json.loads(gen.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            fields = None
        if not isinstance(fields, dict):
            logger.warning("ignoring unreadable %s", gen)
        elif "eos_token_id" in fields:
            return config_fields.token_ids(fields, "eos_token_id", file=gen.name)
    return config_fields.token_ids(hf, "eos_token_id")

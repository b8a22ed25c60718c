"""A checkpoint's chat template: moved to :mod:`rtpcore.engine.text.chat_template`, which
``Engine.chat`` needs below the serving stage. This module re-exports it so that existing
imports keep working."""

from __future__ import annotations

from rtpcore.engine.text.chat_template import ChatTemplate

__all__ = ["ChatTemplate"]

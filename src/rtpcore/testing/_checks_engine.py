"""The kit's engine checks (docs/design.md §19)."""

from __future__ import annotations

__all__: list[str] = []

"""The kit's seams checks (docs/design.md §19)."""

from __future__ import annotations

__all__: list[str] = []

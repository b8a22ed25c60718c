"""Weight patterns: which checkpoint tensor names a model wants.

``{name}`` in a pattern stands for one decimal index (``0``, ``17``; not ``07``);
everything else is literal and the whole tensor name must match. A placeholder with a
range (``{"layer": range(n)}``) is expanded over it into the exact set of required
names and matches only indices in the range; a placeholder without a range matches any
index and requires nothing (optional tensors). A pattern without placeholders is required.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping
from typing import Any

from attrs import frozen

__all__ = ["Pattern", "PatternTable", "WeightSelection"]

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_DECIMAL = r"(?:0|[1-9][0-9]*)"


class Pattern:
    """One compiled weight pattern; ``ranges`` restricts the placeholders that have one."""

    def __init__(self, pattern: str, ranges: Mapping[str, frozenset[int]]):
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"weight pattern must be a non-empty string, got {pattern!r}")
        literals = _PLACEHOLDER.split(pattern)[::2]
        if any("{" in lit or "}" in lit for lit in literals):
            raise ValueError(
                f"weight pattern {pattern!r}: braces may only enclose a placeholder name like {{layer}}"
            )
        self.text = pattern
        self.names = tuple(dict.fromkeys(_PLACEHOLDER.findall(pattern)))
        self.ranges = {n: ranges[n] for n in self.names if n in ranges}
        self.required = len(self.ranges) == len(self.names)
        seen: set[str] = set()

        def group(m: re.Match[str]) -> str:
            name = m.group(1)
            if name in seen:
                return f"(?P={name})"
            seen.add(name)
            return f"(?P<{name}>{_DECIMAL})"

        pieces, pos = [], 0
        for m in _PLACEHOLDER.finditer(pattern):
            pieces += [re.escape(pattern[pos : m.start()]), group(m)]
            pos = m.end()
        pieces.append(re.escape(pattern[pos:]))
        regex = "".join(pieces)
        self.regex = re.compile(regex)

    def matches(self, name: str) -> bool:
        m = self.regex.fullmatch(name)
        return m is not None and all(int(m.group(n)) in r for n, r in self.ranges.items())

    def expand(self) -> Iterable[str]:
        """The required names (only meaningful when every placeholder has a range)."""
        values = [sorted(self.ranges[n]) for n in self.names]
        for combo in itertools.product(*values):
            # Literal text holds no braces (checked above), so str.format is exact.
            yield self.text.format_map(dict(zip(self.names, combo, strict=True)))


@frozen
class WeightSelection:
    """Which tensor names a model wants: an exact required set plus optional patterns."""

    required: frozenset[str]
    optional: tuple[Pattern, ...]

    @classmethod
    def from_patterns(
        cls, patterns: Iterable[str], ranges: Mapping[str, Iterable[int]] | None = None
    ) -> WeightSelection:
        if isinstance(patterns, str):
            raise ValueError(
                f"weight patterns must be a sequence of strings, got the string {patterns!r}"
            )
        sets = {}
        for name, values in (ranges or {}).items():
            vals = list(values)
            if not all(type(v) is int and v >= 0 for v in vals):
                raise ValueError(
                    f"placeholder range {name!r} must hold non-negative integers, got {vals[:5]!r}"
                )
            sets[name] = frozenset(vals)
        compiled = [Pattern(p, sets) for p in patterns]
        required = frozenset(n for p in compiled if p.required for n in p.expand())
        return cls(required=required, optional=tuple(p for p in compiled if not p.required))

    def wants(self, name: str) -> bool:
        return name in self.required or any(p.matches(name) for p in self.optional)


class PatternTable:
    """Pattern -> value (expected shapes, slices), placeholders matching any index."""

    def __init__(self, table: Mapping[str, Any] | None):
        self.exact: dict[str, Any] = {}
        self.patterns: list[tuple[Pattern, Any]] = []
        for key, value in (table or {}).items():
            if _PLACEHOLDER.search(key):
                self.patterns.append((Pattern(key, {}), value))
            else:
                self.exact[key] = value

    def get(self, name: str) -> Any:
        if name in self.exact:
            return self.exact[name]
        return next((v for p, v in self.patterns if p.matches(name)), None)

"""One allowlist item parsed: a ``--plugins`` item (``DIST[:ENTRY_POINT][SPECIFIER]``) as a
:class:`PluginRequest`, an ``--external-model-packages`` item as a dotted module path. Every
item is checked against its rule here, before anything is looked up or imported; a bad one
raises :class:`~rtpcore.errors.AllowlistError` naming the item and the rule. Below
``resolution`` (which looks the requests up) and ``allowlist`` (which holds them)."""

from __future__ import annotations

import keyword
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

from attrs import frozen

from rtpcore.errors import AllowlistError
from rtpcore.plugins.metadata import canonical_name

if TYPE_CHECKING:
    from packaging.specifiers import SpecifierSet

__all__ = ["PluginRequest", "check_module", "parse_external_model_packages", "parse_plugins", "split_plugins"]

_OPERATOR_CHARS = "<>=!~"
_DIST_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")
_ENTRY_POINT_RE = re.compile(r"[A-Za-z0-9_.-]+")
_DIST_RULE = "a distribution name has letters, digits, '-', '_' and '.' and starts and ends with a letter or digit (PEP 508)"


def _fail(flag: str, item: str, rule: str) -> AllowlistError:
    return AllowlistError(f"{flag} item {item!r}: {rule}", item=item, rule=rule)


@frozen
class PluginRequest:
    """One ``--plugins`` item: a distribution (or entry-point) name, an optional entry-point
    name and an optional PEP 440 specifier (normalized, ``""`` when absent)."""

    name: str
    entry_point: str | None = None
    specifier: str = ""

    @property
    def key(self) -> str:
        """The PEP 503 normalized name, used for lookup and duplicate removal."""
        return canonical_name(self.name)

    @property
    def specifier_set(self) -> SpecifierSet:
        from packaging.specifiers import SpecifierSet

        return SpecifierSet(self.specifier)

    def __str__(self) -> str:
        ep = f":{self.entry_point}" if self.entry_point else ""
        return f"{self.name}{ep}{self.specifier}"

    @classmethod
    def parse(cls, item: str) -> PluginRequest:
        """Parse one complete item (its specifier may contain commas)."""
        flag = "--plugins"
        if item == "":
            raise _fail(flag, item, "empty item")
        if any(ch.isspace() for ch in item):
            raise _fail(flag, item, "contains whitespace")
        cut = next((i for i, ch in enumerate(item) if ch in _OPERATOR_CHARS), len(item))
        head, spec = item[:cut], item[cut:]
        if head == "":
            raise _fail(flag, item, "a specifier needs a distribution name before it")
        name, colon, entry_point = head.partition(":")
        if ":" in entry_point:
            raise _fail(
                flag, item, "at most one ':' separates the distribution from the entry point"
            )
        _check_dotted_name(flag, item, name, "distribution name")
        if not _DIST_RE.fullmatch(name):
            raise _fail(flag, item, _DIST_RULE)
        if colon:
            if entry_point == "":
                raise _fail(flag, item, "empty entry-point name after ':'")
            _check_dotted_name(flag, item, entry_point, "entry-point name")
            if not _ENTRY_POINT_RE.fullmatch(entry_point):
                raise _fail(flag, item, "an entry-point name has letters, digits, '-', '_' and '.'")
        if spec:
            from packaging.specifiers import InvalidSpecifier, SpecifierSet  # only when needed

            try:
                spec = str(SpecifierSet(spec))
            except InvalidSpecifier:
                raise _fail(
                    flag, item, f"bad version specifier {spec!r} (PEP 440, e.g. '>=0.1,<2')"
                ) from None
        return cls(name=name, entry_point=entry_point if colon else None, specifier=spec)


def _check_dotted_name(flag: str, item: str, name: str, what: str) -> None:
    if name.startswith(".") or name.endswith("."):
        raise _fail(flag, item, f"leading or trailing dot in the {what}")
    if ".." in name:
        raise _fail(flag, item, f"double dot in the {what}")


def split_plugins(value: str) -> list[str]:
    """Split one flag value on commas; a piece starting with an operator continues the
    previous item's specifier."""
    items: list[str] = []
    for piece in value.split(","):
        if piece and piece[0] in _OPERATOR_CHARS:
            if not items:
                raise _fail("--plugins", piece, "a specifier needs a distribution name before it")
            previous = items[-1]
            if not any(ch in _OPERATOR_CHARS for ch in previous):
                raise _fail(
                    "--plugins",
                    f"{previous},{piece}",
                    f"{piece!r} continues a specifier, but {previous!r} has none (write {previous}{piece})",
                )
            items[-1] = f"{previous},{piece}"
        else:
            items.append(piece)
    return items


def parse_plugins(values: Iterable[str]) -> tuple[PluginRequest, ...]:
    """Parse ``--plugins`` flag values into requests, duplicates removed (first kept)."""
    seen: set[tuple[str, str | None, str]] = set()
    requests: list[PluginRequest] = []
    for value in _as_values(values):
        for item in split_plugins(value):
            request = PluginRequest.parse(item)
            marker = (request.key, request.entry_point, request.specifier)
            if marker not in seen:
                seen.add(marker)
                requests.append(request)
    return tuple(requests)


def check_module(item: str) -> str:
    """One ``--external-model-packages`` item, checked: a dotted path of Python identifiers."""
    flag = "--external-model-packages"
    if item == "":
        raise _fail(flag, item, "empty item")
    if any(ch.isspace() for ch in item):
        raise _fail(flag, item, "contains whitespace")
    _check_dotted_name(flag, item, item, "module path")
    for part in item.split("."):
        if not part.isidentifier():
            raise _fail(flag, item, f"{part!r} is not a Python identifier")
        if keyword.iskeyword(part):
            raise _fail(flag, item, f"{part!r} is a Python keyword")
    return item


def parse_external_model_packages(values: Iterable[str]) -> tuple[str, ...]:
    """Parse ``--external-model-packages`` flag values into dotted module paths, deduplicated."""
    modules: dict[str, None] = {}
    for value in _as_values(values):
        for item in value.split(","):
            modules.setdefault(check_module(item), None)
    return tuple(modules)


def _as_values(values: Iterable[str]) -> tuple[str, ...]:
    if isinstance(values, str):  # a single flag value passed where a list was expected
        return (values,)
    out = tuple(values)
    for value in out:
        if not isinstance(value, str):
            raise AllowlistError(
                f"allowlist values must be strings, got {value!r}",
                item=repr(value),
                rule="not a string",
            )
    return out

"""The allowlist: which third-party code an operator allows, from the command line only.

``--plugins ITEM[,ITEM...]`` names installed distributions (``DIST[:ENTRY_POINT][SPECIFIER]``)
and ``--external-model-packages MOD[,MOD...]`` names unpackaged modules holding hook
implementations. Every item is validated here, before anything is looked up or imported;
a bad item raises :class:`~rtpcore.errors.AllowlistError` naming the item and the rule.

Environment variables are never configuration: if one of :data:`IGNORED_ENV_VARS` is set,
a warning naming it and the flag to use instead is emitted once per process.
"""

from __future__ import annotations

import argparse
import keyword
import os
import re
import threading
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING

from attrs import field, frozen

from rtpcore.errors import AllowlistError
from rtpcore.plugins.metadata import canonical_name

if TYPE_CHECKING:
    from packaging.specifiers import SpecifierSet

    from rtpcore.plugins.resolution import Plan

__all__ = [
    "IGNORED_ENV_VARS",
    "Allowlist",
    "IgnoredEnvironmentWarning",
    "PluginRequest",
    "add_allowlist_arguments",
    "external_model_packages_arg",
    "parse_external_model_packages",
    "parse_plugins",
    "plugins_arg",
]

#: Environment variables other engines read as plugin configuration, and the flag to use instead.
IGNORED_ENV_VARS = {
    "RTPCORE_PLUGINS": "--plugins",
    "RTPCORE_EXTERNAL_MODEL_PACKAGES": "--external-model-packages",
    "EXTERNAL_MODEL_PACKAGES": "--external-model-packages",
}

_OPERATOR_CHARS = "<>=!~"
_DIST_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")
_ENTRY_POINT_RE = re.compile(r"[A-Za-z0-9_.-]+")
_DIST_RULE = "a distribution name has letters, digits, '-', '_' and '.' and starts and ends with a letter or digit (PEP 508)"


class IgnoredEnvironmentWarning(UserWarning):
    """An environment variable that looks like plugin configuration was set and ignored."""


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


def _split_plugins(value: str) -> list[str]:
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
        for item in _split_plugins(value):
            request = PluginRequest.parse(item)
            marker = (request.key, request.entry_point, request.specifier)
            if marker not in seen:
                seen.add(marker)
                requests.append(request)
    return tuple(requests)


def _check_module(item: str) -> str:
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
            modules.setdefault(_check_module(item), None)
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


_warned: set[str] = set()
_warn_lock = threading.Lock()


def warn_ignored_environment() -> None:
    """Warn once per process for each set variable of :data:`IGNORED_ENV_VARS`."""
    for var, flag in IGNORED_ENV_VARS.items():
        if var not in os.environ:
            continue
        with _warn_lock:
            if var in _warned:
                continue
            _warned.add(var)
        warnings.warn(
            f"rtpcore ignores the environment variable {var}; plugins are allowed only on the "
            f"command line: use {flag} instead",
            IgnoredEnvironmentWarning,
            stacklevel=3,
        )


@frozen
class Allowlist:
    """The validated allowlist: requested plugins and external model packages, in order."""

    plugins: tuple[PluginRequest, ...] = field(default=())
    external_model_packages: tuple[str, ...] = field(default=())

    @classmethod
    def from_cli(
        cls,
        plugins: Iterable[str] = (),
        external_model_packages: Iterable[str] = (),
    ) -> Allowlist:
        """Build from ``--plugins`` and ``--external-model-packages`` values (each a flag value,
        possibly comma-separated). Raises AllowlistError naming the bad item and the rule."""
        warn_ignored_environment()
        return cls(
            plugins=parse_plugins(plugins),
            external_model_packages=parse_external_model_packages(external_model_packages),
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Allowlist:
        """Build from a namespace filled by :func:`add_allowlist_arguments`."""
        return cls.from_cli(
            plugins=getattr(args, "plugins", None) or (),
            external_model_packages=getattr(args, "external_model_packages", None) or (),
        )

    def resolve(self, *, strict: bool = True, path: Iterable[str] | None = None) -> Plan:
        """Resolve into a frozen, picklable :class:`~rtpcore.plugins.resolution.Plan`; imports nothing.

        With ``strict`` (the default) the first failed request raises its error
        (PluginNotFoundError, PluginVersionError, PluginConflictError); otherwise the
        failures are recorded in ``plan.failures``. ``path`` defaults to ``sys.path``.
        """
        from rtpcore.plugins.resolution import resolve

        return resolve(self, strict=strict, path=path)

    def __bool__(self) -> bool:
        return bool(self.plugins or self.external_model_packages)


def plugins_arg(value: str) -> list[str]:
    """argparse ``type=`` for ``--plugins``: validates one flag value, returns its items."""
    try:
        items = _split_plugins(value)
        for item in items:
            PluginRequest.parse(item)
    except AllowlistError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return items


def external_model_packages_arg(value: str) -> list[str]:
    """argparse ``type=`` for ``--external-model-packages``."""
    try:
        return [_check_module(item) for item in value.split(",")]
    except AllowlistError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_allowlist_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--plugins`` and ``--external-model-packages`` (repeatable) to ``parser``."""
    parser.add_argument(
        "--plugins",
        action="extend",
        type=plugins_arg,
        default=[],
        metavar="ITEM[,ITEM...]",
        help="allow installed plugins: DIST[:ENTRY_POINT][SPECIFIER], e.g. atom-plugin>=0.1 (repeatable)",
    )
    parser.add_argument(
        "--external-model-packages",
        action="extend",
        type=external_model_packages_arg,
        default=[],
        metavar="MOD[,MOD...]",
        help="allow unpackaged modules holding rtpcore hook implementations (repeatable)",
    )

"""The allowlist: which third-party code an operator allows, from the command line only.

``--plugins ITEM[,ITEM...]`` names installed distributions (``DIST[:ENTRY_POINT][SPECIFIER]``)
and ``--external-model-packages MOD[,MOD...]`` names unpackaged modules holding hook
implementations. Every item is validated (``rtpcore.plugins.requests``) before anything is
looked up or imported; a bad item raises :class:`~rtpcore.errors.AllowlistError` naming the
item and the rule.

Environment variables are never configuration: if one of :data:`IGNORED_ENV_VARS` is set,
a warning naming it and the flag to use instead is emitted once per process.
"""

from __future__ import annotations

import argparse
import os
import threading
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING

from attrs import field, frozen

from rtpcore.errors import AllowlistError
from rtpcore.plugins.requests import (
    PluginRequest,
    check_module,
    parse_external_model_packages,
    parse_plugins,
    split_plugins,
)

if TYPE_CHECKING:
    from rtpcore.plugins.resolution import Plan

__all__ = [
    "IGNORED_ENV_VARS",
    "Allowlist",
    "IgnoredEnvironmentWarning",
    "PluginRequest",
    "add_allow_patches_argument",
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

class IgnoredEnvironmentWarning(UserWarning):
    """An environment variable that looks like plugin configuration was set and ignored."""


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
    #: Plugins whose patches of rtpcore are accepted (``--allow-plugin-patches``).
    allow_plugin_patches: tuple[str, ...] = field(default=())

    @classmethod
    def from_cli(
        cls,
        plugins: Iterable[str] = (),
        external_model_packages: Iterable[str] = (),
        allow_plugin_patches: Iterable[str] = (),
    ) -> Allowlist:
        """Build from ``--plugins``, ``--external-model-packages`` and ``--allow-plugin-patches``
        values (each a flag value, possibly comma-separated). Raises AllowlistError naming the
        bad item and the rule."""
        warn_ignored_environment()
        if isinstance(allow_plugin_patches, str):
            allow_plugin_patches = [allow_plugin_patches]
        allowed = tuple(n.strip() for value in allow_plugin_patches for n in str(value).split(","))
        if any(not n for n in allowed):
            raise AllowlistError(f"--allow-plugin-patches {','.join(allowed)!r}: an empty plugin name")
        return cls(
            plugins=parse_plugins(plugins),
            external_model_packages=parse_external_model_packages(external_model_packages),
            allow_plugin_patches=allowed,
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Allowlist:
        """Build from a namespace filled by :func:`add_allowlist_arguments`."""
        return cls.from_cli(
            plugins=getattr(args, "plugins", None) or (),
            external_model_packages=getattr(args, "external_model_packages", None) or (),
            allow_plugin_patches=getattr(args, "allow_plugin_patches", None) or (),
        )

    def resolve(self, *, strict: bool = True, path: Iterable[str] | None = None) -> Plan:
        """Resolve into a frozen, picklable :class:`~rtpcore.plugins.resolution.Plan`; imports nothing.

        With ``strict`` (the default) the first failed request raises its error
        (PluginNotFoundError, PluginVersionError, PluginConflictError); otherwise the
        failures are recorded in ``plan.failures``. ``path`` defaults to ``sys.path``.
        """
        from rtpcore.plugins.resolution import resolve

        return resolve(self.plugins, self.external_model_packages, strict=strict, path=path,
                       allow_patches=self.allow_plugin_patches)

    def __bool__(self) -> bool:
        return bool(self.plugins or self.external_model_packages)


def plugins_arg(value: str) -> list[str]:
    """argparse ``type=`` for ``--plugins``: validates one flag value, returns its items."""
    try:
        items = split_plugins(value)
        for item in items:
            PluginRequest.parse(item)
    except AllowlistError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return items


def external_model_packages_arg(value: str) -> list[str]:
    """argparse ``type=`` for ``--external-model-packages``."""
    try:
        return [check_module(item) for item in value.split(",")]
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
    add_allow_patches_argument(parser)


def add_allow_patches_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--allow-plugin-patches`` (repeatable) to ``parser``."""
    parser.add_argument(
        "--allow-plugin-patches",
        action="extend",
        type=lambda v: [n.strip() for n in v.split(",")],
        default=[],
        metavar="NAME[,NAME...]",
        help="accept these plugins' changes to rtpcore's modules and classes (logged, listed by "
        "`plugins list`) instead of refusing them (state 'patches'); NAME is the entry point or "
        "the distribution (repeatable)",
    )

"""Resolution: an :class:`~rtpcore.plugins.allowlist.Allowlist` becomes a frozen, picklable :class:`Plan`.

Nothing is imported here. Distribution names are looked up directly (:mod:`rtpcore.plugins.metadata`,
``importlib_metadata.distributions(name=...)``: only the requested distribution's metadata is
read), never by a scan of every distribution's entry points. Only an item that names no distribution falls back to a
scan of the ``rtpcore.plugins`` entry points (:mod:`rtpcore.plugins.discovery`). Specifiers are
checked against the installed version here, before any import.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from attrs import field, frozen

from rtpcore.errors import (
    PluginConflictError,
    PluginError,
    PluginLoadError,
    PluginNotFoundError,
    PluginVersionError,
)
from rtpcore.plugins import metadata as lookup
from rtpcore.plugins.metadata import PLUGIN_GROUP
from rtpcore.plugins.spelling import allow_plugin

if TYPE_CHECKING:
    from rtpcore.plugins.requests import PluginRequest

__all__ = [
    "PLUGIN_GROUP",
    "Plan",
    "PlanEntry",
    "PlanFailure",
    "resolve",
]

log = logging.getLogger(__name__)


_ERRORS: dict[str, type[PluginError]] = {
    "not-installed": PluginNotFoundError,
    "no-such-entry-point": PluginNotFoundError,
    "version-mismatch": PluginVersionError,
    "shadowed": PluginConflictError,
    "import-failed": PluginLoadError,
    "invalid": PluginLoadError,
    "conflict": PluginConflictError,
}


@frozen
class PlanEntry:
    """One plugin to load: an entry point of a distribution, or an external module.

    ``name`` is the entry-point name (the module path for an external module), ``value``
    the ``module[:object]`` to import; ``distribution`` and ``version`` are None for an
    external module. ``metadata_path`` is the metadata folder read at resolution, so that a
    worker process can check the version without any discovery scan.
    """

    name: str
    value: str
    distribution: str | None = None
    version: str | None = None
    request: str = ""
    metadata_path: str | None = None

    @property
    def module(self) -> str:
        return self.value.partition(":")[0]

    @property
    def is_external_module(self) -> bool:
        return self.distribution is None

    def describe(self) -> str:
        """``plugin 'atom' (distribution 'atom-plugin' 0.1.0, entry point 'atom_plugin.hooks')``."""
        if self.distribution is None:
            return f"external model package {self.value!r}"
        return (
            f"plugin {self.name!r} (distribution {self.distribution!r} {self.version}, "
            f"entry point {self.value!r})"
        )

    def error_fields(self) -> dict[str, str | None]:
        return {
            "plugin": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "entry_point": self.value,
        }


@frozen
class PlanFailure:
    """A request that could not be resolved: its outcome ``state`` and the error's fields."""

    request: str
    state: str
    message: str
    distribution: str | None = None
    version: str | None = None
    entry_point: str | None = None
    providers: tuple[str, ...] = ()

    def error(self) -> PluginError:
        """The error this failure raises (PluginNotFoundError, PluginVersionError, ...)."""
        cls = _ERRORS[self.state]
        kwargs: dict[str, object] = {
            "plugin": self.request,
            "distribution": self.distribution,
            "version": self.version,
            "entry_point": self.entry_point,
            "state": self.state,
        }
        if cls is PluginConflictError:
            kwargs["providers"] = self.providers
        return cls(self.message, **kwargs)  # type: ignore[arg-type]


@frozen
class Plan:
    """What a process loads: entries in request order, plus unresolved requests.

    Frozen, hashable and picklable: a host engine stores it in its config and passes it
    to worker processes, where :func:`rtpcore.load_plugins` imports exactly these entries.
    """

    entries: tuple[PlanEntry, ...] = field(default=())
    failures: tuple[PlanFailure, ...] = field(default=())
    requests: tuple[str, ...] = field(default=())
    #: ``(request, earlier request)``: a request whose entries an earlier one already planned
    #: (``--plugins atom-plugin,atom``); it shares that request's outcome.
    duplicates: tuple[tuple[str, str], ...] = field(default=())
    #: Plugins (entry-point or distribution names) whose patches of rtpcore are accepted,
    #: logged and listed instead of refused (``--allow-plugin-patches``, docs/design.md §18).
    allow_patches: tuple[str, ...] = field(default=())

    def raise_for_failures(self) -> None:
        """Raise the first failure's error, if any."""
        if self.failures:
            raise self.failures[0].error()


def _version_ok(spec: str, version: str) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return SpecifierSet(spec).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def _resolve_request(
    request: PluginRequest, path: Sequence[str] | None
) -> list[PlanEntry] | PlanFailure:
    item = str(request)
    dists = lookup.find(request.name, path)
    if not dists and request.entry_point is None:
        fallback = _entry_point_fallback(request, item, path)
        if isinstance(fallback, PlanFailure):
            return fallback
        dist_name, ep_name = fallback
        dists = lookup.find(dist_name, path)
        request = type(request)(name=dist_name, entry_point=ep_name, specifier=request.specifier)
    if not dists:
        return PlanFailure(
            item,
            "not-installed",
            f"plugin {item!r} is not installed: no distribution named {request.name!r} on the path "
            "(`rtpcore plugins list` shows the installed plugins)",
            distribution=request.name,
        )
    if len(dists) > 1:
        copies = [f"{d.name} {d.version} at {d.path}" for d in dists]
        return PlanFailure(
            item,
            "shadowed",
            f"plugin {item!r}: distribution {request.name!r} is installed {len(dists)} times on the path "
            f"({'; '.join(copies)}); the one imported would not be the one checked: uninstall all but one",
            distribution=dists[0].name,
            providers=tuple(copies),
        )
    dist = dists[0]
    if request.specifier and not _version_ok(request.specifier, dist.version):
        return PlanFailure(
            item,
            "version-mismatch",
            f"plugin {item!r} requires {dist.name}{request.specifier}, but version {dist.version} "
            f"is installed (at {dist.path})",
            distribution=dist.name,
            version=dist.version,
        )
    if dist.entry_points_error is not None:
        return PlanFailure(
            item,
            "invalid",
            f"plugin {item!r}: distribution {dist.name!r} {dist.version} (at {dist.path}) is "
            f"broken: {dist.entry_points_error}; reinstall it",
            distribution=dist.name,
            version=dist.version,
        )
    available = dist.group(PLUGIN_GROUP)
    eps = [(n, v) for n, v in available if request.entry_point in (None, n)]
    if not eps:
        wanted = (
            f"no {PLUGIN_GROUP} entry point named {request.entry_point!r}"
            if request.entry_point
            else f"no {PLUGIN_GROUP} entry points"
        )
        names = sorted(n for n, _ in available)
        choices = f"; it has: {', '.join(map(repr, names))}" if names else ""
        return PlanFailure(
            item,
            "no-such-entry-point",
            f"plugin {item!r}: distribution {dist.name!r} {dist.version} has {wanted}{choices}",
            distribution=dist.name,
            version=dist.version,
            entry_point=request.entry_point,
        )
    return [
        PlanEntry(
            name=name,
            value=value,
            distribution=dist.name,
            version=dist.version,
            request=item,
            metadata_path=dist.path,
        )
        for name, value in eps
    ]


def _entry_point_fallback(
    request: PluginRequest, item: str, path: Sequence[str] | None
) -> tuple[str, str] | PlanFailure:
    """An item naming no distribution may name exactly one ``rtpcore.plugins`` entry point."""
    from rtpcore.plugins.discovery import installed_plugins  # the one scan, only on this path

    log.debug("no distribution named %r; scanning %s entry points", request.name, PLUGIN_GROUP)
    matches = [p for p in installed_plugins(path) if p.name == request.name]
    if len({lookup.canonical_name(p.distribution) for p in matches}) == 1:
        return matches[0].distribution, matches[0].name  # shadowed copies are reported later
    if not matches:
        return PlanFailure(
            item,
            "not-installed",
            f"plugin {item!r} is not installed: no distribution and no {PLUGIN_GROUP} entry point "
            f"named {request.name!r} (`rtpcore plugins list` shows the installed plugins)",
            distribution=request.name,
        )
    owners = [f"{p.distribution} {p.version}" for p in matches]
    flags = " or ".join(allow_plugin(f"{p.distribution}:{p.name}") for p in matches)
    return PlanFailure(
        item,
        "not-installed",
        f"plugin {item!r} names no distribution and is the {PLUGIN_GROUP} entry point of "
        f"{len(matches)} distributions ({', '.join(owners)}): name one: {flags}",
        providers=tuple(owners),
    )


def resolve(
    plugins: Sequence[PluginRequest], external_model_packages: Sequence[str] = (), *, strict: bool = True,
    path: Iterable[str] | None = None, allow_patches: Sequence[str] = (),
) -> Plan:
    """Resolve every request of an allowlist (its ``plugins`` and ``external_model_packages``);
    see :meth:`rtpcore.plugins.allowlist.Allowlist.resolve`."""
    search = None if path is None else tuple(path)
    entries: dict[tuple[str | None, str, str], PlanEntry] = {}
    failures: list[PlanFailure] = []
    duplicates: list[tuple[str, str]] = []

    def add(planned: list[PlanEntry]) -> None:
        fresh = [e for e in planned if (e.distribution, e.name, e.value) not in entries]
        if not fresh:
            earlier = entries[(planned[0].distribution, planned[0].name, planned[0].value)]
            duplicates.append((planned[0].request, earlier.request))
        for e in fresh:
            entries[(e.distribution, e.name, e.value)] = e

    for request in plugins:
        outcome = _resolve_request(request, search)
        if isinstance(outcome, PlanFailure):
            log.debug("request %r: %s", outcome.request, outcome.state)
            failures.append(outcome)
        else:
            add(outcome)
    for module in external_model_packages:
        add([PlanEntry(name=module, value=module, request=module)])
    plan = Plan(
        entries=tuple(entries.values()),
        failures=tuple(failures),
        requests=tuple(str(r) for r in plugins) + tuple(external_model_packages),
        duplicates=tuple(duplicates),
        allow_patches=tuple(allow_patches),
    )
    if strict:
        plan.raise_for_failures()
    return plan

"""What is installed, read from metadata only: ``rtpcore.plugins`` and ``rtpcore.architectures``.

Nothing here imports plugin code. These scans serve ``rtpcore plugins list`` and the hints
of :class:`~rtpcore.errors.UnknownArchitectureError`; loading never depends on them.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable

from attrs import frozen

from rtpcore.plugins.metadata import (
    ARCHITECTURE_GROUP,
    PLUGIN_GROUP,
    canonical_name,
    core_fields,
    parse_entry_points,
)

__all__ = ["ARCHITECTURE_GROUP", "InstalledPlugin", "architecture_hints", "installed_plugins"]


@frozen
class InstalledPlugin:
    """One ``rtpcore.plugins`` entry point of an installed distribution.

    ``declared_architectures`` are the ``rtpcore.architectures`` hints of the same
    distribution that point at this entry point; ``shadowed`` is true when another
    distribution of the same name is on the path too.
    """

    name: str
    value: str
    distribution: str
    version: str
    metadata_path: str
    declared_architectures: tuple[str, ...] = ()
    shadowed: bool = False
    sole_entry_point: bool = True

    @property
    def flag(self) -> str:
        """The ``--plugins`` item that allows exactly this plugin."""
        return self.distribution if self.sole_entry_point else f"{self.distribution}:{self.name}"


def installed_plugins(path: Iterable[str] | None = None) -> list[InstalledPlugin]:
    """Every ``rtpcore.plugins`` entry point on ``path`` (default ``sys.path``), sorted by
    distribution then name; shadowed copies are listed too, each marked. A full scan."""
    import importlib_metadata

    dists: list[tuple[str, str, str, tuple[tuple[str, str, str], ...]]] = []
    seen: set[str] = set()
    kwargs = {} if path is None else {"path": list(path)}
    for dist in importlib_metadata.distributions(**kwargs):
        where = str(getattr(dist, "_path", ""))
        real = os.path.realpath(where) if where else str(id(dist))
        if real in seen:
            continue
        seen.add(real)
        try:
            eps = parse_entry_points(dist.read_text("entry_points.txt") or "")
            if not any(group == PLUGIN_GROUP for group, _, _ in eps):
                continue
            name, version = core_fields(
                dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
            )
        except (OSError, ValueError):
            continue
        if name and version:
            dists.append((name, version, where, eps))
    counts = Counter(canonical_name(d[0]) for d in dists)
    found: list[InstalledPlugin] = []
    for name, version, where, eps in dists:
        plugins = [(n, v) for g, n, v in eps if g == PLUGIN_GROUP]
        for ep_name, value in plugins:
            declared = tuple(
                sorted(n for g, n, v in eps if g == ARCHITECTURE_GROUP and v == ep_name)
            )
            found.append(
                InstalledPlugin(
                    name=ep_name,
                    value=value,
                    distribution=name,
                    version=version,
                    metadata_path=where,
                    declared_architectures=declared,
                    shadowed=counts[canonical_name(name)] > 1,
                    sole_entry_point=len(plugins) == 1,
                )
            )
    found.sort(key=lambda p: (canonical_name(p.distribution), p.name, p.metadata_path))
    return found


def architecture_hints(
    architectures: Iterable[str], path: Iterable[str] | None = None
) -> dict[str, list[str]]:
    """For each of ``architectures`` that an installed plugin declares, one line per such
    plugin naming it, its distribution and version, and the ``--plugins`` item to pass."""
    wanted = list(architectures)
    hints: dict[str, list[str]] = {}
    for plugin in installed_plugins(path):
        for arch in plugin.declared_architectures:
            if arch in wanted:
                hints.setdefault(arch, []).append(
                    f"plugin {plugin.name!r} of {plugin.distribution} {plugin.version} (pass --plugins {plugin.flag})"
                )
    return {arch: hints[arch] for arch in wanted if arch in hints}

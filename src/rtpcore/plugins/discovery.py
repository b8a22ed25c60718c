"""What is installed, read from metadata only: ``rtpcore.plugins`` and ``rtpcore.architectures``.

Nothing here imports plugin code. These scans serve ``rtpcore plugins list`` and the hints
of :class:`~rtpcore.errors.UnknownArchitectureError`; loading never depends on them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from attrs import frozen

from rtpcore.plugins.metadata import (
    ARCHITECTURE_GROUP,
    PLUGIN_GROUP,
    QUANTIZATION_GROUP,
    canonical_name,
    scan,
)
from rtpcore.plugins.spelling import allow_plugin

__all__ = ["ARCHITECTURE_GROUP", "InstalledPlugin", "architecture_hints", "installed_plugins", "quantization_hints"]


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
    declared_quantization_methods: tuple[str, ...] = ()  # its rtpcore.quantization_methods hints
    shadowed: bool = False
    sole_entry_point: bool = True

    @property
    def flag(self) -> str:
        """The ``--plugins`` item that allows exactly this plugin."""
        return self.distribution if self.sole_entry_point else f"{self.distribution}:{self.name}"


def installed_plugins(path: Iterable[str] | None = None) -> list[InstalledPlugin]:
    """Every ``rtpcore.plugins`` entry point on ``path`` (default ``sys.path``), sorted by
    distribution then name; shadowed copies are listed too, each marked. A full scan; a
    distribution whose entry_points.txt cannot be parsed is skipped (logged)."""
    dists = scan(PLUGIN_GROUP, path)
    counts = Counter(canonical_name(d.name) for d in dists)
    found: list[InstalledPlugin] = []
    for dist in dists:
        plugins = dist.group(PLUGIN_GROUP)
        hints = dist.group(ARCHITECTURE_GROUP)
        methods = dist.group(QUANTIZATION_GROUP)
        for ep_name, value in plugins:
            found.append(
                InstalledPlugin(
                    name=ep_name,
                    value=value,
                    distribution=dist.name,
                    version=dist.version,
                    metadata_path=dist.path,
                    declared_architectures=tuple(sorted(a for a, v in hints if v == ep_name)),
                    declared_quantization_methods=tuple(sorted(m for m, v in methods if v == ep_name)),
                    shadowed=counts[canonical_name(dist.name)] > 1,
                    sole_entry_point=len(plugins) == 1,
                )
            )
    found.sort(key=lambda p: (canonical_name(p.distribution), p.name, p.metadata_path))
    return found


def architecture_hints(
    architectures: Iterable[str], path: Iterable[str] | None = None
) -> dict[str, list[str]]:
    """For each of ``architectures`` that an installed plugin declares, one line per such
    plugin naming it, its distribution and version, and how to allow it (``plugins=[...]``
    through Python, ``--plugins`` on the command line: :mod:`rtpcore.plugins.spelling`)."""
    wanted = list(architectures)
    hints: dict[str, list[str]] = {}
    for plugin in installed_plugins(path):
        for arch in plugin.declared_architectures:
            if arch in wanted:
                hints.setdefault(arch, []).append(
                    f"plugin {plugin.name!r} of {plugin.distribution} {plugin.version} ({allow_plugin(plugin.flag)})"
                )
    return {arch: hints[arch] for arch in wanted if arch in hints}


def quantization_hints(method: str, path: Iterable[str] | None = None) -> list[str]:
    """One line per installed plugin that declares the quantization method ``method`` (entry
    point group ``rtpcore.quantization_methods``), naming it, its distribution and version, and
    how to allow it."""
    return [
        f"plugin {plugin.name!r} of {plugin.distribution} {plugin.version} ({allow_plugin(plugin.flag)})"
        for plugin in installed_plugins(path)
        if method in plugin.declared_quantization_methods
    ]

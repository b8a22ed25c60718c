"""Installed distributions, read through ``importlib_metadata``: the fast path of resolution.

:func:`find` asks ``importlib_metadata.distributions(name=..., path=...)`` for the metadata
folders of one name: it normalizes the name (PEP 503), caches each path folder's listing
(refreshed when the folder's mtime changes) and opens no other distribution's files. Only
the matches are read: their ``Name`` and ``Version`` headers and ``Distribution.entry_points``.
:func:`scan` is the one full scan, for ``rtpcore plugins list`` and the entry-point fallback.
Nothing here imports plugin code.

Kept by hand, each for a reason given where it stands: the two core headers
(:func:`_core_fields`), the metadata folder of a distribution (:func:`metadata_folder`)
and :func:`canonical_name`.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from typing import Any, Protocol

import importlib_metadata
from attrs import frozen

__all__ = [
    "ARCHITECTURE_GROUP",
    "PLUGIN_GROUP",
    "QUANTIZATION_GROUP",
    "InstalledDistribution",
    "at",
    "canonical_name",
    "find",
    "metadata_folder",
    "scan",
]

log = logging.getLogger(__name__)

#: Entry-point group of plugins: name = plugin name, value = ``module[:object]``.
PLUGIN_GROUP = "rtpcore.plugins"
#: Entry-point group of hints: name = HF architecture, value = a plugin entry-point name.
ARCHITECTURE_GROUP = "rtpcore.architectures"
# method name = plugin entry point: which plugin registers a quantization method (a hint, like
# the architectures').
QUANTIZATION_GROUP = "rtpcore.quantization_methods"

_SEPARATORS = re.compile(r"[-_.]+")


def canonical_name(name: str) -> str:
    """PEP 503 normalization: runs of ``-``, ``_`` and ``.`` become one ``-``, lowercased.

    PEP 503's own one-line rule, by hand: ``packaging.utils.canonicalize_name`` is the same
    rule but importing it pulls ``packaging.tags`` (and ``sysconfig``, ``platform``) into
    every ``import rtpcore.plugins.allowlist``; importlib-metadata's ``Prepared.normalize``
    is not public and spells the result with underscores.
    """
    return _SEPARATORS.sub("-", name).lower()


#: Why an ``entry_points.txt`` could not be read, shown in the ``invalid`` outcome.
MALFORMED_ENTRY_POINTS = (
    "its entry_points.txt cannot be parsed (every line under a [group] header must read "
    "'name = value')"
)


class _Distribution(Protocol):
    """What is read of an ``importlib_metadata`` distribution (``distributions()`` is typed
    as returning its ``IDistribution`` protocol, ``Distribution.at`` a ``Distribution``)."""

    def read_text(self, filename: str) -> str | None: ...

    @property
    def entry_points(self) -> Iterable[Any]: ...


@frozen
class InstalledDistribution:
    """One metadata folder: where it is, its name and version, and its entry points as
    ``(group, name, value)`` triples in file order.

    ``entry_points_error`` says why the entry points could not be read (then
    ``entry_points`` is empty); resolution reports it as the ``invalid`` outcome.
    """

    path: str
    name: str
    version: str
    entry_points: tuple[tuple[str, str, str], ...] = ()
    entry_points_error: str | None = None

    def group(self, group: str) -> list[tuple[str, str]]:
        """``(name, value)`` of the entry points in ``group``."""
        return [(n, v) for g, n, v in self.entry_points if g == group]


def metadata_folder(dist: object) -> str | None:
    """The metadata folder (``*.dist-info`` / ``*.egg-info``, or a legacy ``.egg-info``
    file) of ``dist``; None for a distribution that does not live on the file system.

    importlib-metadata has no public accessor for it (python/importlib_metadata#23, #111:
    only ``PathDistribution`` has one, as ``_path``; pip reads it the same way), and
    ``locate_file('')`` gives the folder above it. A plan records this folder so that a
    worker rereads exactly it (``Distribution.at``) and provenance reads its RECORD.
    tests/test_metadata.py fails if the attribute changes meaning.
    """
    path = getattr(dist, "_path", None)
    return None if path is None else str(path)


def _core_fields(dist: _Distribution) -> tuple[str | None, str | None]:
    """``Name`` and ``Version`` from the headers of ``dist``'s METADATA / PKG-INFO.

    By hand rather than ``dist.metadata``: that parses with the ``email`` package, whose
    first import (``email.parser``, ~18 ms here) costs more than importlib-metadata's whole
    name lookup among 2000 distributions, and would put resolving one name at about a
    quarter of a full entry-point scan (the contract is under 15%; see
    benchmarks/bench_resolution.py). Headers are ``Key: value`` lines up to the first blank
    line; ``Name`` and ``Version`` are never folded or repeated.
    """
    try:
        # METADATA (dist-info), PKG-INFO (egg-info folder), '' (a legacy egg-info file is
        # itself the metadata: the order of Distribution._metadata_text, which is private).
        text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or dist.read_text("")
    except (OSError, ValueError):  # ValueError: UnicodeDecodeError
        return None, None
    fields: dict[str, str] = {}
    for line in (text or "").splitlines():
        if not line.strip():
            break
        key, sep, value = line.partition(":")
        if sep and key in ("Name", "Version"):
            fields.setdefault(key, value.strip())
    return fields.get("Name") or None, fields.get("Version") or None


def _entry_points(
    dist: _Distribution,
) -> tuple[tuple[tuple[str, str, str], ...], str | None]:
    """``dist.entry_points`` as triples, or ``()`` and the reason they cannot be read."""
    try:
        return tuple((ep.group, ep.name, ep.value) for ep in dist.entry_points), None
    except (TypeError, ValueError):  # a line without '=' (TypeError), undecodable bytes
        return (), MALFORMED_ENTRY_POINTS


def _describe(
    dist: _Distribution, where: str, entry_points: bool = True
) -> InstalledDistribution | None:
    name, version = _core_fields(dist)
    if name is None or version is None:
        return None
    eps, error = _entry_points(dist) if entry_points else ((), None)
    return InstalledDistribution(
        path=where, name=name, version=version, entry_points=eps, entry_points_error=error
    )


def requires_dist(folder: str) -> list[str]:
    """The ``Requires-Dist`` headers of the METADATA in ``folder`` (``[]`` when unreadable),
    read by hand as :func:`_core_fields` reads Name and Version."""
    dist = importlib_metadata.Distribution.at(folder)
    try:
        text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
    except (OSError, ValueError):
        return []
    out = []
    for line in text.splitlines():
        if not line.strip():
            break
        key, sep, value = line.partition(":")
        if sep and key == "Requires-Dist":
            out.append(value.strip())
    return out


def at(folder: str) -> InstalledDistribution | None:
    """The distribution whose metadata folder (or legacy ``.egg-info`` file) is ``folder``,
    read without any search (``Distribution.at``); None when it has no readable Name and
    Version, e.g. because it was uninstalled."""
    return _describe(importlib_metadata.Distribution.at(folder), folder)


def find(name: str, path: Iterable[str] | None = None) -> list[InstalledDistribution]:
    """Every distribution named ``name`` (after PEP 503 normalization) on ``path`` (default
    ``sys.path``), in path order, each metadata folder once (a folder listed twice on the
    path is one installation). Two results mean one copy shadows the other."""
    key = canonical_name(name)
    kwargs: dict[str, object] = {"name": name}
    if path is not None:
        kwargs["path"] = list(path)
    found: list[InstalledDistribution] = []
    seen: set[str] = set()
    for dist in importlib_metadata.distributions(**kwargs):
        where = metadata_folder(dist)
        if where is None:
            continue  # not on the file system: no RECORD to check provenance against
        real = os.path.realpath(where)
        if real in seen:
            continue
        seen.add(real)
        installed = _describe(dist, where)
        # The folder name matched; the Name header is the distribution's own word.
        if installed is not None and canonical_name(installed.name) == key:
            found.append(installed)
    return found


def scan(group: str, path: Iterable[str] | None = None) -> list[InstalledDistribution]:
    """Every distribution on ``path`` (default ``sys.path``) with an entry point in
    ``group``, in path order. A full scan: every distribution's entry points are read.

    A distribution whose entry_points.txt cannot be parsed is skipped with a warning: it is
    probably not a plugin at all, and one broken package must not hide every other plugin.
    Naming it in ``--plugins`` reports it (:func:`find` keeps the reason).
    """
    kwargs: dict[str, object] = {} if path is None else {"path": list(path)}
    found: list[InstalledDistribution] = []
    seen: set[str] = set()
    for dist in importlib_metadata.distributions(**kwargs):
        where = metadata_folder(dist)
        if where is None:
            continue
        real = os.path.realpath(where)
        if real in seen:
            continue
        seen.add(real)
        eps, error = _entry_points(dist)
        if error is not None:
            log.warning("skipping the distribution at %r: %s", where, error)
            continue
        if not any(g == group for g, _, _ in eps):
            continue
        installed = _describe(dist, where, entry_points=False)
        if installed is not None:
            found.append(
                InstalledDistribution(
                    path=where, name=installed.name, version=installed.version, entry_points=eps
                )
            )
    return found

"""Direct lookup of one installed distribution by name: the fast path of resolution.

For each ``sys.path`` folder, the folder listing is filtered by a compiled pattern of the
name's metadata folders (``name-1.0.dist-info``, ``Name.egg-info`` ...) and only matches are
read: the ``Name`` and ``Version`` headers and ``entry_points.txt``. No other distribution's
metadata is opened and no heavy module is imported (importlib-metadata's ``metadata``
pulls in the ``email`` package, whose import costs more than the whole lookup); zip
archives on the path are the one case handed to importlib-metadata.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable

from attrs import frozen

__all__ = [
    "ARCHITECTURE_GROUP",
    "PLUGIN_GROUP",
    "InstalledDistribution",
    "canonical_name",
    "core_fields",
    "find",
    "parse_entry_points",
    "read",
]

#: Entry-point group of plugins: name = plugin name, value = ``module[:object]``.
PLUGIN_GROUP = "rtpcore.plugins"
#: Entry-point group of hints: name = HF architecture, value = a plugin entry-point name.
ARCHITECTURE_GROUP = "rtpcore.architectures"

_SEPARATORS = re.compile(r"[-_.]+")


def canonical_name(name: str) -> str:
    """PEP 503 normalization: runs of ``-``, ``_`` and ``.`` become one ``-``, lowercased."""
    return _SEPARATORS.sub("-", name).lower()


@frozen
class InstalledDistribution:
    """One metadata folder: where it is, its name and version, and its entry points as
    ``(group, name, value)`` triples in file order."""

    path: str
    name: str
    version: str
    entry_points: tuple[tuple[str, str, str], ...] = ()

    def group(self, group: str) -> list[tuple[str, str]]:
        """``(name, value)`` of the entry points in ``group``."""
        return [(n, v) for g, n, v in self.entry_points if g == group]


def parse_entry_points(text: str) -> tuple[tuple[str, str, str], ...]:
    """Parse ``entry_points.txt`` (an INI file: ``[group]`` then ``name = value`` lines)."""
    out: list[tuple[str, str, str]] = []
    group = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            group = line[1:-1].strip()
            continue
        name, sep, value = line.partition("=")
        if sep and group:
            out.append((group, name.strip(), value.strip()))
    return tuple(out)


def core_fields(text: str) -> tuple[str | None, str | None]:
    """``Name`` and ``Version`` from the headers of a METADATA / PKG-INFO text."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the headers end at the first blank line
        key, sep, value = line.partition(":")
        if sep and key in ("Name", "Version"):
            fields.setdefault(key, value.strip())
    return fields.get("Name") or None, fields.get("Version") or None


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def read(folder: str) -> InstalledDistribution | None:
    """The distribution whose metadata folder (or legacy ``.egg-info`` file) is ``folder``;
    None when it has no readable Name and Version."""
    if os.path.isdir(folder):
        text = _read_text(os.path.join(folder, "METADATA")) or _read_text(
            os.path.join(folder, "PKG-INFO")
        )
        eps = _read_text(os.path.join(folder, "entry_points.txt")) or ""
    else:
        text, eps = _read_text(folder), ""
    name, version = core_fields(text or "")
    if name is None or version is None:
        return None
    return InstalledDistribution(
        path=folder, name=name, version=version, entry_points=parse_entry_points(eps)
    )


def _folder_names(key: str, names: Iterable[str]) -> list[str]:
    """The entries of ``names`` that are metadata folders of the normalized name ``key``
    (``Key_Name-1.0.dist-info``, ``key.name.egg-info`` ...), compared case-insensitively.

    One C-level pass: the names are joined, lowercased and searched for the lowercase
    literal prefix, so a folder of 2000 entries costs about as much as one of 100.
    """
    tail = r"(?:-[^\n/\\]*)?\.(?:dist|egg)-info"
    body = r"[-_.]+".join(re.escape(p) for p in key.split("-")) + tail
    joined = "\n" + "\n".join(names) + "\n"
    lowered = joined.lower()
    if len(lowered) != len(joined):  # a non-ASCII name whose lowercase changes length
        pattern = re.compile(body, re.IGNORECASE)
        return [n for n in joined.split("\n") if n and pattern.fullmatch(n)]
    found = re.finditer("\n" + body + "(?=\n)", lowered)
    return [joined[m.start() + 1 : m.end()] for m in found]


def _from_archive(name: str, archive: str) -> list[InstalledDistribution]:
    import importlib_metadata  # only for a zip archive on the path

    found = []
    for dist in importlib_metadata.distributions(name=name, path=[archive]):
        core = core_fields(dist.read_text("METADATA") or dist.read_text("PKG-INFO") or "")
        if core[0] and core[1]:
            eps = parse_entry_points(dist.read_text("entry_points.txt") or "")
            where = str(getattr(dist, "_path", archive))
            found.append(
                InstalledDistribution(path=where, name=core[0], version=core[1], entry_points=eps)
            )
    return found


def _listing(entry: str, folder: str) -> Iterable[str] | None:
    """The names in ``folder`` (the ``sys.path`` entry ``entry``), None if unreadable.

    Python's import system already keeps the listing of every path folder it has searched
    (its ``FileFinder``), valid while the folder's mtime is unchanged; in a running process
    site-packages has always been searched. Reusing it avoids reading a large directory a
    second time; any doubt (another finder, another Python, a changed mtime) reads it anew.
    """
    try:
        finder = sys.path_importer_cache.get(entry or os.getcwd())
        cached = getattr(finder, "_path_cache", None)
        if (
            isinstance(cached, set)
            and getattr(finder, "_path_mtime", None) == os.stat(folder).st_mtime
        ):
            return cached
        return os.listdir(folder)
    except OSError:
        return None


def find(name: str, path: Iterable[str] | None = None) -> list[InstalledDistribution]:
    """Every distribution named ``name`` (after PEP 503 normalization) on ``path`` (default
    ``sys.path``), in path order, each metadata folder once."""
    key = canonical_name(name)
    found: list[InstalledDistribution] = []
    seen: set[str] = set()
    for entry in sys.path if path is None else path:
        folder = entry or "."
        if os.path.isdir(folder):
            names = _listing(entry, folder)
            if names is None:
                continue
            candidates: list[InstalledDistribution | None] = [
                read(os.path.join(folder, n)) for n in _folder_names(key, names)
            ]
        elif os.path.isfile(folder):
            candidates = list(_from_archive(name, folder))
        else:
            continue
        for dist in candidates:
            if dist is None or canonical_name(dist.name) != key:
                continue
            real = os.path.realpath(dist.path)
            if real not in seen:
                seen.add(real)
                found.append(dist)
    return found

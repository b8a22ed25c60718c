"""Where a plugin's module would be imported from, found without importing it, and
whether that file belongs to the plugin's distribution (docs/design.md §11).

A plan names a distribution; Python imports a module *name*. A same-named module
earlier on ``sys.path`` (or a folder in the current directory, which ``python -m``
and ``python -c`` put first) would run in the distribution's place. So before an
entry is imported, :func:`check_origin` locates each module of its dotted path
with the import system's finders (``importlib.util.find_spec`` on the top-level
name, then ``PathFinder`` over the parent's ``submodule_search_locations``: no
parent package is imported, so nothing is executed) and requires every file
found to be the distribution's. A file is the distribution's when

* it lies under the ``sys.path`` folder holding the distribution's metadata, or
* the distribution's ``RECORD`` (``installed-files.txt`` for an ``.egg-info``)
  lists it, or
* it lies under a folder the distribution put on the path itself: a path line
  of a ``.pth`` file its ``RECORD`` lists, or a folder that the setuptools
  editable finder (``__editable___*_finder.py``, listed in its ``RECORD``) maps
  the top-level name to. Editable installs (``pip install -e``) work this way.

Otherwise the entry is ``shadowed`` (PluginConflictError) and nothing is imported.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from importlib.machinery import ModuleSpec
from pathlib import Path

import importlib_metadata

from rtpcore.errors import PluginConflictError
from rtpcore.plugins.resolution import PlanEntry

__all__ = ["check_origin", "module_origins"]


def module_origins(module: str) -> list[str]:
    """The file each part of the dotted ``module`` would be loaded from, top-level
    first (namespace portions, which have no file, are skipped). It stops at the
    first part the import system does not find: the files before it would still
    run on import. Imports nothing that is not imported yet."""
    parts = module.split(".")
    origins: list[str] = []
    spec: ModuleSpec | None = None
    for i in range(len(parts)):
        name = ".".join(parts[: i + 1])
        try:
            if name in sys.modules:  # already imported: its file is what runs
                spec = getattr(sys.modules[name], "__spec__", None)
            elif i == 0:
                spec = importlib.util.find_spec(name)  # a top-level name imports nothing
            elif spec is not None and spec.submodule_search_locations is not None:
                spec = importlib.machinery.PathFinder.find_spec(
                    name, list(spec.submodule_search_locations)
                )
            else:
                return origins  # the parent is not a package
        except (ImportError, ValueError):
            return origins
        if spec is None:
            return origins
        if spec.origin and spec.has_location:
            origins.append(spec.origin)
        elif spec.submodule_search_locations is None or spec.origin not in (None, "namespace"):
            origins.append(spec.origin or f"<{name}: no file>")  # built-in, frozen ...
    return origins


def _under(path: str, folder: str) -> bool:
    try:
        return os.path.commonpath([path, folder]) == folder
    except ValueError:  # different drives
        return False


def _listed_files(metadata: Path) -> list[str]:
    """Absolute real paths of the files the distribution lists (``Distribution.files``:
    its RECORD, or an egg-info's installed-files.txt or SOURCES.txt) and that exist."""
    try:
        files = importlib_metadata.Distribution.at(metadata).files or []
        return [os.path.realpath(str(f.locate())) for f in files]
    except (OSError, ValueError):  # an unreadable or malformed RECORD lists nothing
        return []


def _added_folders(top: str, listed: list[str]) -> list[str]:
    """Folders the distribution itself puts on the import path: the path lines of the
    ``.pth`` files it installed, and what its setuptools editable finder maps ``top`` to."""
    folders = []
    for file in listed:
        name = os.path.basename(file)
        if name.endswith(".pth"):
            try:
                lines = Path(file).read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError):
                continue
            for line in lines:
                line = line.strip()
                if line and not line.startswith(("#", "import ", "import\t")):
                    folders.append(os.path.realpath(os.path.join(os.path.dirname(file), line)))
        elif name.startswith("__editable__") and name.endswith("_finder.py"):
            finder = sys.modules.get(name[: -len(".py")])  # imported by its .pth at startup
            if finder is None or os.path.realpath(getattr(finder, "__file__", "")) != file:
                continue
            mapping = getattr(finder, "MAPPING", None)
            if isinstance(mapping, dict) and isinstance(mapping.get(top), str):
                folders.append(os.path.realpath(mapping[top]))
    return folders


def check_origin(entry: PlanEntry) -> None:
    """Raise PluginConflictError (state ``shadowed``) when a module of ``entry`` would
    be imported from a file that is not its distribution's; imports nothing.

    External modules (no distribution) and modules the import system cannot find
    (the import then fails as usual) pass.
    """
    if entry.distribution is None or not entry.metadata_path:
        return
    module = entry.module.split("[", 1)[0].strip()
    origins = module_origins(module)
    if not origins:
        return
    metadata = Path(entry.metadata_path)
    home = os.path.realpath(metadata.parent)
    listed: list[str] | None = None
    folders: list[str] | None = None
    for origin in origins:
        real = os.path.realpath(origin)
        if _under(real, home):
            continue
        if listed is None:
            listed = _listed_files(metadata)
            folders = _added_folders(module.split(".")[0], listed)
        if real in listed or any(_under(real, f) for f in folders or ()):
            continue
        raise PluginConflictError(
            f"{entry.describe()} is shadowed: its module {module!r} would be imported from "
            f"{origin!r}, which is not a file of distribution {entry.distribution!r} (installed "
            f"at {str(home)!r}); a same-named module earlier on sys.path, or in the current "
            "directory, stands in for it. It was not imported: remove or rename that file, "
            "or run from another directory",
            providers=(origin, str(metadata)),
            state="shadowed",
            **entry.error_fields(),
        )

"""No monkeypatching (docs/design.md §18): what a plugin changed in rtpcore, found and undone.

:func:`watch` takes a snapshot of every imported ``rtpcore`` / ``rtpcore_native`` module's
attributes and of every public class they define (its own ``__dict__``), before a plugin is
imported; while the plugin loads, each rtpcore module imported for the first time is
snapshotted the moment its own code has run (a finder first on ``sys.meta_path`` wraps its
loader), so a module the plugin imports and then patches is caught too. :meth:`Watch.changes`
lists every attribute replaced, added or deleted since; :meth:`Watch.undo` puts them back.

Not changes: a submodule bound on its package by the import system (``rtpcore.engine.sample``
on ``rtpcore.engine``), and mutation inside an object (a registry's dict growing): only
attribute bindings are compared, by identity.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

__all__ = ["Watch", "watch"]

_ROOTS = ("rtpcore", "rtpcore_native")
_MISSING = object()


def _ours(name: str) -> bool:
    return name in _ROOTS or name.startswith(("rtpcore.", "rtpcore_native."))


def _public_classes(module: types.ModuleType) -> Iterator[type]:
    for name, value in list(vars(module).items()):
        if not name.startswith("_") and isinstance(value, type) and value.__module__ == module.__name__:
            yield value


class Watch:
    """The snapshot of one plugin's load (see the module docstring)."""

    def __init__(self) -> None:
        self.modules: dict[str, tuple[types.ModuleType, dict[str, Any]]] = {}
        self.classes: dict[str, tuple[type, dict[str, Any]]] = {}

    def take(self, module: types.ModuleType) -> None:
        """Snapshot ``module`` (once) and its public classes."""
        name = module.__name__
        if name in self.modules:
            return
        self.modules[name] = (module, dict(vars(module)))
        for cls in _public_classes(module):
            self.classes.setdefault(f"{name}.{cls.__qualname__}", (cls, dict(vars(cls))))

    def changes(self) -> list[tuple[str, str, str]]:
        """``(module or class, attribute, "replaced" | "added" | "deleted")``, sorted."""
        found = []
        for owner, (obj, before) in [*self.modules.items(), *self.classes.items()]:
            now = vars(obj)
            for attr in before.keys() | now.keys():
                old, new = before.get(attr, _MISSING), now.get(attr, _MISSING)
                if old is new or attr in ("__cached__", "__loader__", "__spec__", "__path__", "__file__"):
                    continue
                if old is _MISSING and isinstance(obj, types.ModuleType) and _is_submodule(obj, attr, new):
                    continue
                kind = "added" if old is _MISSING else "deleted" if new is _MISSING else "replaced"
                found.append((owner, attr, kind))
        return sorted(found)

    def undo(self, changes: Sequence[tuple[str, str, str]]) -> None:
        """Put each changed attribute back as the snapshot has it."""
        for owner, attr, kind in changes:
            obj, before = self.modules.get(owner) or self.classes[owner]
            if kind == "added":
                delattr(obj, attr)
            else:
                setattr(obj, attr, before[attr])


def _is_submodule(package: types.ModuleType, attr: str, value: Any) -> bool:
    return isinstance(value, types.ModuleType) and value.__name__ == f"{package.__name__}.{attr}"


class _SnapshotFinder(importlib.abc.MetaPathFinder):
    """Wraps the loader of each rtpcore module imported while a plugin loads, so that the
    module is snapshotted right after its own code ran."""

    def __init__(self, watch: Watch) -> None:
        self.watch = watch

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not _ours(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _SnapshotLoader(spec.loader, self.watch)
                return spec
        return None


class _SnapshotLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, watch: Watch) -> None:
        self.loader, self.watch = loader, watch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        module: types.ModuleType | None = self.loader.create_module(spec)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        self.loader.exec_module(module)
        self.watch.take(module)

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ...
        return getattr(self.loader, name)


@contextmanager
def watch() -> Iterator[Watch]:
    """Snapshot rtpcore now, and each rtpcore module first imported inside the block."""
    snapshot = Watch()
    for name, module in list(sys.modules.items()):
        if _ours(name) and isinstance(module, types.ModuleType):
            snapshot.take(module)
    finder = _SnapshotFinder(snapshot)
    sys.meta_path.insert(0, finder)
    try:
        yield snapshot
    finally:
        sys.meta_path.remove(finder)

"""Every third-party module the package imports is a declared dependency, and every declared
dependency is imported: pyproject.toml's ``[project].dependencies`` is what ``pip install
rtpcore`` needs, no more and no less. Read from the source with ``ast``, so a lazy import
inside a function (``uvicorn`` in ``rtpcore serve``) counts as much as a module-level one."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = [ROOT / "src" / "rtpcore", ROOT / "src" / "rtpcore_native"]
OWN = {"rtpcore", "rtpcore_native"}

# Imported only where it may be missing, each for a reason; never a declared dependency.
OPTIONAL = {
    "pytest": "imported only by rtpcore.testing.pytest_plugin, which pytest itself loads (the pytest11 entry "
    "point, docs/design.md §19): pytest is there wherever that module runs",
    "triton": "the paged-attention GPU kernels; it ships with CUDA and ROCm builds of torch, and "
    "rtpcore.kv.triton_support.triton_available() guards every use (the CPU path needs none)",
}

# Declared though no module imports them, each for a reason (pyproject.toml says it too).
DECLARED_UNIMPORTED = {
    "numpy": "safetensors.torch.save_file needs it to write demo checkpoints, and torch does "
    "not pull it in",
}


@dataclass(frozen=True)
class Import:
    module: str  # the top-level name: "triton" for "import triton.language"
    where: str  # "rtpcore/kv/paged_attention.py:174"
    guarded: bool  # inside a try whose handlers catch ImportError


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(
        isinstance(n, ast.Name) and n.id in {"ImportError", "ModuleNotFoundError"} for n in names
    )


def _imports(tree: ast.AST, where: str) -> list[Import]:
    found: list[Import] = []

    def visit(node: ast.AST, guarded: bool) -> None:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
            found.extend(Import(n.split(".")[0], f"{where}:{node.lineno}", guarded) for n in names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(Import(node.module.split(".")[0], f"{where}:{node.lineno}", guarded))
        if isinstance(node, ast.Try | ast.TryStar):
            body_guarded = guarded or any(_catches_import_error(h) for h in node.handlers)
            for child in node.body:
                visit(child, body_guarded)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child, guarded)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(tree, False)
    return found


def third_party_imports() -> list[Import]:
    """Every import in the shipped packages of a module neither stdlib nor rtpcore's own."""
    out = []
    for package in PACKAGES:
        for file in sorted(package.rglob("*.py")):
            where = str(file.relative_to(ROOT / "src"))
            out += _imports(ast.parse(file.read_text(encoding="utf-8"), filename=str(file)), where)
    return [i for i in out if i.module not in sys.stdlib_module_names and i.module not in OWN]


def declared() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    reqs = [Requirement(text) for text in project["dependencies"]]
    return {canonicalize_name(r.name): r for r in reqs}


@functools.cache
def _packages_distributions() -> dict[str, list[str]]:
    return dict(importlib.metadata.packages_distributions())


def distributions_of(module: str) -> set[str]:
    """The installed distributions providing the top-level module ``module`` (canonical names)."""
    return {canonicalize_name(d) for d in _packages_distributions().get(module, [])}


def test_the_scan_sees_lazy_and_guarded_imports() -> None:
    """The scan finds a function-level import (uvicorn in serve) and marks the try/except
    ImportError one of triton_support as guarded: the checks below rest on both."""
    imports = third_party_imports()
    assert any(i.module == "uvicorn" and i.where.startswith("rtpcore/cli/_serve.py") for i in imports)
    guarded = {i.module: i.guarded for i in imports if i.where.startswith("rtpcore/kv/triton_support.py")}
    assert guarded == {"torch": False, "triton": True}


def test_every_imported_module_is_a_declared_dependency() -> None:
    """Each third-party module imported outside OPTIONAL is provided by a distribution that
    pyproject.toml's [project].dependencies names."""
    deps = declared()
    undeclared = {}
    for imp in third_party_imports():
        if imp.module in OPTIONAL:
            continue
        dists = distributions_of(imp.module)
        if not dists & deps.keys():
            undeclared.setdefault(imp.module, (sorted(dists) or ["not installed"], imp.where))
    assert undeclared == {}, (
        "imported but not in [project].dependencies (module: (distributions, first import)); "
        "declare it, or list it in OPTIONAL with the reason"
    )


def test_every_optional_import_is_listed_and_undeclared() -> None:
    """An import guarded by ``except ImportError`` is of a module in OPTIONAL; OPTIONAL names
    modules really imported and no declared dependency (then it would not be optional)."""
    imports = third_party_imports()
    unlisted = sorted({f"{i.module} ({i.where})" for i in imports if i.guarded and i.module not in OPTIONAL})
    assert unlisted == [], "a guarded import of a module not in OPTIONAL: list it with its reason"
    assert sorted(OPTIONAL) == sorted({i.module for i in imports if i.module in OPTIONAL}), "stale OPTIONAL entry"
    deps = declared()
    assert {m: sorted(distributions_of(m) & deps.keys()) for m in OPTIONAL} == {m: [] for m in OPTIONAL}


def test_every_declared_dependency_is_imported() -> None:
    """Each [project].dependencies entry provides a module the package imports, except those
    in DECLARED_UNIMPORTED, each of which says why on its own line in pyproject.toml."""
    provided = set().union(*(distributions_of(i.module) for i in third_party_imports()))
    deps = declared()
    unused = sorted(set(deps) - provided - set(DECLARED_UNIMPORTED))
    assert unused == [], "declared but never imported: drop it, or list it in DECLARED_UNIMPORTED"
    assert sorted(set(DECLARED_UNIMPORTED) - provided) == sorted(DECLARED_UNIMPORTED), "stale entry"
    assert set(DECLARED_UNIMPORTED) <= set(deps)
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    for name in DECLARED_UNIMPORTED:
        line = re.search(rf'^\s*"{re.escape(deps[name].name)}[^"]*",\s*#\s*\S.*$', text, re.MULTILINE)
        assert line is not None, f"{name}'s line in pyproject.toml needs a comment saying why"

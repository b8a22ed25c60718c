"""The plugin author's API (docs/design.md §21): the public modules' surface is held to
tests/plugin_api.snapshot, every name in it is documented, an incompatible change cannot be recorded
without a new FORWARD_CONTRACT and a CHANGELOG entry, and docs/, the README and atom-plugin import
nothing else."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

import api_surface

ROOT = Path(__file__).resolve().parents[1]
ATOM = ROOT / "plugins_example" / "atom_plugin"

#: What atom-plugin's own tests import from inside rtpcore, and why (its package imports none of it).
ATOM_TEST_INTERNALS = {
    # the registration rules the engine runs on a plugin class, asserted clean for atom's classes
    "rtpcore.plugins.model_plugin",
    # every rank's stats after a tensor-parallel run (the Engine reports rank 0's only)
    "rtpcore.parallel.leader",
}


def test_the_public_surface_is_the_snapshot() -> None:
    """A change to a public module's names, signatures, members or constants lands with its
    snapshot (``python tests/api_surface.py --update``) in the same commit."""
    major, recorded = api_surface.read_snapshot()
    live = api_surface.surface()
    gone = api_surface.incompatible(recorded, live)
    new = api_surface.incompatible(live, recorded)
    diff = [f"- {line}" for line in gone] + [f"+ {line}" for line in new]
    assert not diff, (
        "the plugin API differs from tests/plugin_api.snapshot; if the change is meant, run "
        "`python tests/api_surface.py --update` and commit the snapshot with it:\n" + "\n".join(diff[:40])
    )
    assert major == api_surface.contract()


def test_every_public_module_has_an_all_and_every_name_a_docstring() -> None:
    undocumented = []
    for name in api_surface.PUBLIC_MODULES:
        module = importlib.import_module(name)
        assert module.__doc__, f"{name} has no docstring"
        assert isinstance(getattr(module, "__all__", None), list), f"{name} has no __all__"
        for attr in module.__all__:
            value = getattr(module, attr)
            if inspect.isclass(value) or callable(value) or inspect.ismodule(value):
                if not (value.__doc__ or "").strip():
                    undocumented.append(f"{name}.{attr}")
            elif attr not in module.__doc__:  # a constant: its module's docstring says what it is
                undocumented.append(f"{name}.{attr} (a constant its module's docstring does not name)")
    assert undocumented == []


def test_an_unrecorded_removal_is_refused_without_a_new_contract_and_a_changelog_entry(tmp_path: Path) -> None:
    """A snapshot that still lists a name the live surface lacks (as after a removal): --update
    refuses while FORWARD_CONTRACT stays and CHANGELOG.md does not name it, and writes nothing."""
    _, lines = api_surface.read_snapshot()
    snapshot = tmp_path / "plugin_api.snapshot"
    major = api_surface.contract()
    gone = "rtpcore.layers.fused_rope: def(x: 'torch.Tensor') -> 'torch.Tensor'"
    snapshot.write_text(f"# forward_contract {major}\n" + "\n".join([*lines, gone]) + "\n")
    before = snapshot.read_text()
    changelog = tmp_path / "CHANGELOG.md"
    changelog.write_text("# Changelog\n")
    problems = api_surface.update(snapshot, changelog)
    assert any("needs a new FORWARD_CONTRACT" in p and "rtpcore.layers.fused_rope" in p for p in problems)
    assert any("CHANGELOG.md does not name" in p and "fused_rope" in p for p in problems)
    assert snapshot.read_text() == before
    # a change declared compatible (it breaks no working plugin) still needs the CHANGELOG entry
    assert any("CHANGELOG.md" in p for p in api_surface.update(snapshot, changelog, ("rtpcore.layers.fused_rope",)))
    assert snapshot.read_text() == before
    # with the entry written and the contract raised past the snapshot's, it is recorded
    changelog.write_text("# Changelog\n- removed rtpcore.layers.fused_rope\n")
    snapshot.write_text(f"# forward_contract {major - 1}\n" + "\n".join([*lines, gone]) + "\n")
    assert api_surface.update(snapshot, changelog) == []
    assert gone not in snapshot.read_text() and api_surface.read_snapshot(snapshot)[0] == major
    # or, declared compatible, at the same contract
    snapshot.write_text(f"# forward_contract {major}\n" + "\n".join([*lines, gone]) + "\n")
    assert api_surface.update(snapshot, changelog) != []
    assert api_surface.update(snapshot, changelog, ("rtpcore.layers.fused_rope",)) == []
    # an addition is compatible: recorded at the same contract
    snapshot.write_text(f"# forward_contract {major}\n" + "\n".join(lines[:-1]) + "\n")
    assert api_surface.update(snapshot, changelog) == []


def _code_blocks(markdown: str) -> list[str]:
    return re.findall(r"```(?:python|py)\n(.*?)```", markdown, flags=re.S)


def _rtpcore_imports(source: str, where: str) -> list[tuple[str, str]]:
    """(module, where) for each import of an rtpcore module in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.Import):
            found += [(a.name, where) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, where))
    return [(m, w) for m, w in found if m.split(".")[0] in {"rtpcore", "rtpcore_native"}]


def _private(imports: list[tuple[str, str]], allowed: set[str] = frozenset()) -> list[str]:  # type: ignore[assignment]
    public = set(api_surface.PUBLIC_MODULES)
    return sorted(f"{w}: {m}" for m, w in imports if m not in public and m not in allowed)


def test_docs_and_the_readme_import_only_the_public_modules() -> None:
    imports = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ATOM / "README.md"]:
        for i, block in enumerate(_code_blocks(doc.read_text(encoding="utf-8"))):
            # a block may be a synopsis rather than a program: its import lines are read one by one
            lines = [ln.strip() for ln in block.splitlines() if re.match(r"\s*(from|import) rtpcore", ln)]
            imports += _rtpcore_imports("\n".join(lines), f"{doc.relative_to(ROOT)} block {i + 1}")
    assert imports, "no example imports rtpcore: the docs' code blocks were not found"
    assert _private(imports) == []


def test_atom_plugin_imports_only_the_public_modules() -> None:
    package = [(m, w) for p in sorted((ATOM / "src").rglob("*.py"))
               for m, w in _rtpcore_imports(p.read_text(), str(p.relative_to(ROOT)))]
    assert len(package) >= 10
    assert _private(package) == []
    tests = [(m, w) for p in sorted((ATOM / "tests").rglob("*.py"))
             for m, w in _rtpcore_imports(p.read_text(), str(p.relative_to(ROOT)))]
    assert _private(tests, ATOM_TEST_INTERNALS) == []


@pytest.mark.parametrize("bad", ["from rtpcore.models.layers import Linear", "import rtpcore.parallel.sharding"])
def test_the_import_check_catches_an_internal_path(bad: str) -> None:
    assert _private(_rtpcore_imports(bad, "example")) == [f"example: {bad.split()[1]}"]

"""The package: lazy re-exports and no side effects on import, the import graph, and the wheel
and sdist built from the tree (what each holds, the license metadata)."""

from __future__ import annotations

import email
import email.message
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest


def test_import_rtpcore_imports_neither_torch_nor_plugins() -> None:
    """`import rtpcore` leaves torch, pluggy-registered plugins and atom_plugin unimported."""
    code = (
        "import sys, rtpcore; "
        "bad = [m for m in ('torch', 'atom_plugin', 'rtpcore.models') if m in sys.modules]; "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_native_extension_reports_the_package_version() -> None:
    """rtpcore_native.__version__ comes from the build macro and matches the distribution."""
    from importlib.metadata import version

    import rtpcore_native

    assert rtpcore_native.__version__ == version("rtpcore")


def test_declared_torch_minimum_is_the_release_ci_tests() -> None:
    """pyproject's torch minimum is the torch release .ci/run installs (so the minimum is tested),
    and the torch running the suite satisfies it."""
    import re
    import tomllib
    from pathlib import Path

    import torch
    from packaging.requirements import Requirement
    from packaging.version import Version

    root = Path(__file__).resolve().parents[1]
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_req,) = [Requirement(d) for d in deps if Requirement(d).name == "torch"]
    (minimum,) = [Version(s.version) for s in torch_req.specifier if s.operator == ">="]
    pinned = re.findall(r"torch==([0-9.]+)", (root / ".ci" / "run").read_text())
    assert pinned and all(Version(p).release[:2] == minimum.release[:2] for p in pinned), (pinned, minimum)
    assert Version(torch.__version__.split("+")[0]) in torch_req.specifier


def _check_imports(src: object) -> subprocess.CompletedProcess[str]:
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / ".ci" / "check_imports.py"
    return subprocess.run([sys.executable, str(script), str(src)], capture_output=True, text=True, check=False)


def test_the_import_graph_has_no_cycle_and_points_down_the_data_flow() -> None:
    """.ci/check_imports.py passes on the package as it is."""
    from pathlib import Path

    done = _check_imports(Path(__file__).resolve().parents[1] / "src")
    assert done.returncode == 0, done.stdout
    assert done.stdout.strip().endswith("ok")


def test_the_import_check_names_a_cycle_and_an_upward_import(tmp_path: object) -> None:
    """A function-level cycle, a stage importing a later stage -- also under TYPE_CHECKING, which
    closes a loop as surely (docs/design.md §7) -- and an engine part importing a later part are
    each reported, exit 1; imports down the flow are not."""
    from pathlib import Path

    pkg = Path(str(tmp_path)) / "rtpcore"
    for sub in ("plugins", "engine", "engine/sample", "engine/text", "kv"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "plugins" / "a.py").write_text("def f():\n    from rtpcore.plugins import b\n")
    (pkg / "plugins" / "b.py").write_text("import rtpcore.plugins.a\n")
    (pkg / "kv" / "pools.py").write_text("from rtpcore.engine.sched import X\n")
    (pkg / "kv" / "typed.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rtpcore.engine.sched import X\n"
    )
    (pkg / "kv" / "down.py").write_text("import rtpcore.errors\n")
    (pkg / "engine" / "sched.py").write_text("X = 1\n")
    (pkg / "engine" / "sample" / "params.py").write_text("from rtpcore.engine.text import words\n")
    (pkg / "engine" / "text" / "words.py").write_text("from rtpcore.engine.sample import params\n")
    done = _check_imports(tmp_path)
    assert done.returncode == 1
    assert "rtpcore.kv.pools (kv) imports rtpcore.engine.sched (engine), up the data flow" in done.stdout
    assert "rtpcore.kv.typed (kv) imports rtpcore.engine.sched (engine), up the data flow" in done.stdout
    assert "import cycle: rtpcore.plugins.a -> rtpcore.plugins.b -> rtpcore.plugins.a" in done.stdout
    assert ("rtpcore.engine.sample.params (engine/sample) imports rtpcore.engine.text.words (engine/text), "
            "up the engine's parts") in done.stdout
    assert "rtpcore.engine.text.words (engine/text) imports" not in done.stdout
    assert "rtpcore.kv.down" not in done.stdout


# The distributions: a wheel and an sdist built from (a copy of) the tree, once per module.
# They build without isolation, from what this environment has installed, as the plugin tests
# install packages: pyproject's build requirements must be here, else the tests are skipped.

ROOT = Path(__file__).resolve().parents[1]
BUILD_REQUIREMENTS_REASON = (
    "building rtpcore without isolation needs pyproject's build requirements here: "
    "pybind11 and setuptools>=77 (PEP 639 license metadata)"
)


def _need_build_requirements() -> None:
    pytest.importorskip("pybind11", reason=BUILD_REQUIREMENTS_REASON)
    import setuptools
    from packaging.version import Version

    if Version(setuptools.__version__) < Version("77"):
        pytest.skip(BUILD_REQUIREMENTS_REASON)


def _ignored(root: Path) -> Callable[[str, list[str]], set[str]]:
    """shutil.copytree's ``ignore``: .git and the .gitignore patterns (build outputs, caches)."""
    patterns = [".git"]
    gitignore = root / ".gitignore"
    if gitignore.is_file():
        patterns += [line.strip().strip("/") for line in gitignore.read_text().splitlines()
                     if line.strip() and not line.startswith("#")]
    return shutil.ignore_patterns(*patterns)


@pytest.fixture(scope="module")
def source_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The working tree without its build outputs (a fresh checkout's files): building there
    leaves the tree itself untouched."""
    _need_build_requirements()
    tree = tmp_path_factory.mktemp("tree") / "rtpcore"
    shutil.copytree(ROOT, tree, ignore=_ignored(ROOT))
    return tree


@pytest.fixture(scope="module")
def wheel_build(source_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The wheel ``pip wheel`` builds from the tree, and pip's verbose output (the backend's)."""
    out = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", str(out), str(source_tree)],
        capture_output=True, text=True, env=env, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = out.glob("rtpcore-*.whl")
    return wheel, done.stdout + done.stderr


@pytest.fixture(scope="module")
def sdist(source_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist setuptools' PEP 517 backend builds from the tree (what ``python -m build --sdist`` calls)."""
    out = tmp_path_factory.mktemp("sdist")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = f"from setuptools import build_meta; build_meta.build_sdist({str(out)!r})"
    done = subprocess.run([sys.executable, "-c", code], cwd=source_tree, capture_output=True, text=True,
                          env=env, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    (archive,) = out.glob("rtpcore-*.tar.gz")
    return archive


def _wheel_names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(zf.read(name))


@pytest.mark.slow
def test_the_wheel_ships_the_extension_but_not_its_cpp_source(wheel_build: tuple[Path, str]) -> None:
    """The wheel holds the compiled rtpcore_native, its stub and py.typed, and no .cpp/.hpp."""
    names = _wheel_names(wheel_build[0])
    assert [n for n in names if n.endswith((".cpp", ".hpp"))] == []
    assert any(n.startswith("rtpcore_native/_core.") and n.endswith(".so") for n in names), names
    assert {"rtpcore_native/_core.pyi", "rtpcore_native/py.typed", "rtpcore/py.typed"} <= set(names)


@pytest.mark.slow
def test_the_wheel_carries_the_license_under_pep_639(wheel_build: tuple[Path, str]) -> None:
    """LICENSE is in the dist-info's licenses/ folder, byte for byte the tree's."""
    wheel = wheel_build[0]
    (name,) = [n for n in _wheel_names(wheel) if n.endswith(".dist-info/licenses/LICENSE")]
    with zipfile.ZipFile(wheel) as zf:
        assert zf.read(name) == (ROOT / "LICENSE").read_bytes()
    assert "Apache License" in (ROOT / "LICENSE").read_text()


@pytest.mark.slow
def test_the_wheel_metadata_has_the_license_expression_and_project_urls(wheel_build: tuple[Path, str]) -> None:
    """METADATA: ``License-Expression: Apache-2.0``, ``License-File: LICENSE``, no License
    classifier (PEP 639 forbids one next to an expression), and pyproject's Project-URLs."""
    import tomllib

    meta = _metadata(wheel_build[0])
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    assert meta["License"] is None
    assert [c for c in meta.get_all("Classifier", []) if c.startswith("License ::")] == []
    urls = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]
    assert set(urls) >= {"Homepage", "Documentation", "Changelog", "Issues"}
    assert sorted(meta.get_all("Project-URL", [])) == sorted(f"{k}, {v}" for k, v in urls.items())


@pytest.mark.slow
def test_building_the_wheel_warns_about_no_license(wheel_build: tuple[Path, str]) -> None:
    """setuptools' output building the wheel has no warning about the license metadata."""
    output = wheel_build[1].lower()
    assert "adding license file 'license'" in output  # the verbose output is the backend's
    assert [line for line in output.splitlines()
            if "licen" in line and ("warn" in line or "deprecat" in line)] == []


@pytest.mark.slow
def test_the_sdist_has_what_building_and_testing_need(sdist: Path, source_tree: Path) -> None:
    """The sdist holds every file of tests/, docs/, benchmarks/, plugins_example/ and .ci/, the
    C++ source, README, CHANGELOG and LICENSE; no compiled file."""
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    for folder in ("tests", "docs", "benchmarks", "plugins_example", ".ci"):
        files = {p.relative_to(source_tree).as_posix() for p in (source_tree / folder).rglob("*") if p.is_file()}
        assert files, folder
        assert files <= names, sorted(files - names)
    assert {"README.md", "CHANGELOG.md", "LICENSE", "pyproject.toml", "setup.py",
            "src/rtpcore_native/_core.cpp", "tests/conftest.py", "docs/design.md"} <= names
    assert [n for n in names if n.endswith((".so", ".pyc"))] == []

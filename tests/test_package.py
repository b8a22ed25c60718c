"""The package root: lazy re-exports and no side effects on import."""

from __future__ import annotations

import subprocess
import sys


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
    """A function-level cycle and a stage importing a later stage are each reported, exit 1;
    an import under TYPE_CHECKING is not."""
    from pathlib import Path

    pkg = Path(str(tmp_path)) / "rtpcore"
    for sub in ("plugins", "engine", "kv"):
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
    (pkg / "engine" / "sched.py").write_text("X = 1\n")
    done = _check_imports(tmp_path)
    assert done.returncode == 1
    assert "rtpcore.kv.pools (kv) imports rtpcore.engine.sched (engine), up the data flow" in done.stdout
    assert "import cycle: rtpcore.plugins.a -> rtpcore.plugins.b -> rtpcore.plugins.a" in done.stdout
    assert "rtpcore.kv.typed" not in done.stdout

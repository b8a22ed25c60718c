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

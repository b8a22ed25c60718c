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

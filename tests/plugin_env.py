"""Real installed-distribution fixtures: ``*.dist-info`` folders and modules on a temporary path.

Used by the plugin-framework tests and, importable by name, by their spawned child
processes (``worker_load`` runs in a ``multiprocessing`` spawn child).
"""

from __future__ import annotations

import importlib
import re
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rtpcore.plugins.model_plugin import FORWARD_CONTRACT

HOOKS_HEADER = "from rtpcore import hookimpl, ModelPlugin\n"


def model_source(
    cls: str,
    model_type: str,
    archs: tuple[str, ...],
    replaces: tuple[str, ...] = (),
    *,
    contract: int | None = FORWARD_CONTRACT,
) -> str:
    """Source of a minimal valid ModelPlugin subclass (no torch); ``contract=None`` leaves
    ``forward_contract`` unstated."""
    stated = "" if contract is None else f"forward_contract = {contract!r}"
    return textwrap.dedent(
        f"""
        class {cls}(ModelPlugin):
            model_type = {model_type!r}
            architectures = {archs!r}
            replaces = {replaces!r}
            {stated}

            @classmethod
            def config_from_hf(cls, hf_config):
                return dict(hf_config)

            @classmethod
            def weight_patterns(cls, config):
                return []

            @classmethod
            def kv_cache_descs(cls, config, **options):
                return []

            @classmethod
            def build_model(cls, config, weights, **options):
                return None
        """
    )


def hooks_source(*models: tuple[str, str, tuple[str, ...]], extra: str = "") -> str:
    """A hooks module defining ``models`` (class, model_type, architectures) and registering them."""
    body = HOOKS_HEADER + "".join(model_source(*m) for m in models)
    body += "\n@hookimpl\ndef rtpcore_register_models(registry):\n"
    body += "".join(f"    registry.register({m[0]})\n" for m in models) or "    pass\n"
    return body + textwrap.dedent(extra)


class PluginEnv:
    """A temporary site folder (first on ``sys.path``) to install fake distributions into."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.site = self.add_site("site")

    def add_site(self, name: str) -> Path:
        site = self.root / name
        site.mkdir()
        sys.path.insert(0, str(site))
        return site

    def add_module(self, relpath: str, source: str, *, site: Path | None = None) -> Path:
        """Write a module (``pkg/mod.py``), creating package ``__init__.py`` files on the way."""
        base = site or self.site
        path = base / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(base).parents:
            if str(parent) != ".":
                (base / parent / "__init__.py").touch(exist_ok=True)
        path.write_text(source)
        importlib.invalidate_caches()
        return path

    def add_dist(
        self,
        name: str,
        version: str = "1.0",
        *,
        plugins: Mapping[str, str] | None = None,
        architectures: Mapping[str, str] | None = None,
        modules: Mapping[str, str] | None = None,
        site: Path | None = None,
        requires: tuple[str, ...] = (),
    ) -> Path:
        """Write ``{name}-{version}.dist-info`` with METADATA (``Requires-Dist`` lines from
        ``requires``) and entry_points.txt (groups ``rtpcore.plugins`` and
        ``rtpcore.architectures``), plus the given modules."""
        base = site or self.site
        escaped = re.sub(r"[-_.]+", "_", name).lower()
        info = base / f"{escaped}-{version}.dist-info"
        info.mkdir()
        headers = "".join(f"Requires-Dist: {r}\n" for r in requires)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{headers}")
        lines = []
        for group, eps in (("rtpcore.plugins", plugins), ("rtpcore.architectures", architectures)):
            if eps:
                lines.append(f"[{group}]")
                lines += [f"{k} = {v}" for k, v in eps.items()]
                lines.append("")
        (info / "entry_points.txt").write_text("\n".join(lines))
        for relpath, source in (modules or {}).items():
            self.add_module(relpath, source, site=base)
        importlib.invalidate_caches()
        return info

    def set_version(self, info: Path, version: str) -> None:
        """Rewrite the Version field in place (an upgrade behind a running parent's back)."""
        meta = info / "METADATA"
        meta.write_text(re.sub(r"(?m)^Version: .*$", f"Version: {version}", meta.read_text()))


def worker_load(plan: Any) -> dict[str, Any]:
    """Run in a spawned child: load ``plan`` while counting every discovery call."""
    import importlib.metadata as std_metadata

    import importlib_metadata

    calls: list[str] = []
    for module in (importlib_metadata, std_metadata):
        original = module.Distribution.discover.__func__  # type: ignore[attr-defined]

        def counting(
            cls: Any,
            *args: Any,
            _original: Any = original,
            _name: str = module.__name__,
            **kwargs: Any,
        ) -> Any:
            calls.append(f"{_name}.Distribution.discover")
            return _original(cls, *args, **kwargs)

        module.Distribution.discover = classmethod(counting)  # type: ignore[method-assign,assignment]
        for fn in ("entry_points", "distributions", "distribution", "version"):
            original_fn = getattr(module, fn)

            def wrapper(
                *args: Any,
                _fn: Any = original_fn,
                _label: str = f"{module.__name__}.{fn}",
                **kwargs: Any,
            ) -> Any:
                calls.append(_label)
                return _fn(*args, **kwargs)

            setattr(module, fn, wrapper)
    import rtpcore
    from rtpcore.errors import RtpcoreError

    try:
        registry = rtpcore.load_plugins(plan)
    except RtpcoreError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "calls": calls}
    loading_calls = list(calls)  # rendering the providers below reads rtpcore's own version
    return {
        "models": {r.model_type: (r.architectures, str(r.provider)) for r in registry.records()},
        "calls": loading_calls,
        "modules": sorted(m for m in sys.modules if m.startswith("wk_")),
    }


def pip_install_into_venv(tmp_path: Path, *pip_args: str) -> tuple[str, dict[str, str]]:
    """Make a venv under ``tmp_path`` that sees this environment's packages (rtpcore, pip,
    setuptools) and pip-install ``pip_args`` into it, offline; return its python and the
    environment to run it with (no PYTHONPATH: the venv decides what is importable)."""
    import os
    import subprocess

    import importlib_metadata

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    # rtpcore (and pip, setuptools) come from the environment running these tests.
    ours = Path(str(importlib_metadata.distribution("rtpcore").locate_file("")))
    Path(purelib, "_rtpcore_test_env.pth").write_text(f"import site; site.addsitedir({str(ours)!r})\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")}
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-index", "--no-build-isolation", *pip_args],
        check=True, env=env, capture_output=True,
    )
    return python, env


#: The modules a plugin may import (docs/design.md §21).
PUBLIC_MODULES = frozenset({
    "rtpcore", "rtpcore.errors", "rtpcore.config_fields", "rtpcore.layers", "rtpcore.batch", "rtpcore.sharding",
    "rtpcore.kv", "rtpcore.checkpoint", "rtpcore.testing", "rtpcore.reasoning", "rtpcore.attention", "rtpcore.platforms",
    "rtpcore.quantization", "rtpcore.logits", "rtpcore_native",
})


def rtpcore_imports(files: list[Path]) -> set[str]:
    """Every ``rtpcore``/``rtpcore_native`` module the Python files import (absolute imports)."""
    import ast

    names = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
    return {n for n in names if n.split(".")[0] in ("rtpcore", "rtpcore_native")}

"""A plugin module that would be imported from a file outside its distribution is
`shadowed` and never executed; the distribution's own files (installed or editable)
load. Real dist-info folders on a temporary sys.path, real processes, real pip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plugin_env import PluginEnv, hooks_source, pip_install_into_venv
from rtpcore import Allowlist, load_plugins
from rtpcore.errors import PluginConflictError
from rtpcore.plugins.loading import load_report
from rtpcore.plugins.provenance import module_origins


def _trap(marker: Path) -> str:
    """Source of a module whose import creates ``marker`` and raises."""
    return f"open({str(marker)!r}, 'w').close()\nraise RuntimeError('the shadow ran')\n"


def _add_plugin(plugin_env: PluginEnv, module: str) -> Path:
    relpath = module.replace(".", "/") + ".py"
    return plugin_env.add_dist(
        "prov-plugin",
        "1.0",
        plugins={"prov": module},
        modules={relpath: hooks_source(("P", "prov", ("ProvForCausalLM",)))},
    )


def _plan() -> object:
    return Allowlist.from_cli(plugins=["prov-plugin"], external_model_packages=[]).resolve()


@pytest.mark.parametrize("module", ["prov_mod", "prov_pkg.sub.hooks"])
def test_the_distributions_own_module_loads(plugin_env: PluginEnv, module: str) -> None:
    _add_plugin(plugin_env, module)
    registry = load_plugins(_plan())
    assert "prov" in registry.model_types()


@pytest.mark.parametrize(
    ("module", "shadow"),
    [
        ("prov_mod", "prov_mod.py"),  # a same-named module earlier on sys.path
        ("prov_pkg.sub.hooks", "prov_pkg/__init__.py"),  # a same-named parent package
        ("prov_pkg.sub.hooks", "prov_pkg/sub/hooks.py"),  # the module itself, package and all
    ],
)
def test_a_same_named_module_earlier_on_the_path_is_shadowed_and_never_runs(
    plugin_env: PluginEnv, tmp_path: Path, module: str, shadow: str
) -> None:
    """The earlier file's import would create a marker and raise: the plugin is reported
    `shadowed` (PluginConflictError naming that file) and the marker never appears."""
    _add_plugin(plugin_env, module)
    marker = tmp_path / "shadow-ran"
    early = plugin_env.add_site("early")  # inserted before the plugin's site
    path = plugin_env.add_module(shadow, _trap(marker), site=early)
    for init in early.rglob("__init__.py"):
        if init != path:
            init.write_text(_trap(marker))  # every file of the shadow is a trap
    plan = _plan()
    report = load_report(plan)
    (outcome,) = report.outcomes
    assert outcome.state == "shadowed"
    with pytest.raises(PluginConflictError) as excinfo:
        load_plugins(plan)
    error = excinfo.value
    assert (error.state, error.distribution, error.entry_point) == (
        "shadowed",
        "prov-plugin",
        module,
    )
    assert str(early) in str(error) and "prov-plugin" in str(error)
    assert not marker.exists()
    assert not any(name.startswith("prov_") for name in sys.modules)


def test_module_origins_imports_no_parent_package(plugin_env: PluginEnv, tmp_path: Path) -> None:
    marker = tmp_path / "parent-ran"
    plugin_env.add_module("prov_walk/deep/leaf.py", "")
    (plugin_env.site / "prov_walk" / "__init__.py").write_text(_trap(marker))
    origins = module_origins("prov_walk.deep.leaf")
    assert origins == [
        str(plugin_env.site / "prov_walk" / "__init__.py"),
        str(plugin_env.site / "prov_walk" / "deep" / "__init__.py"),
        str(plugin_env.site / "prov_walk" / "deep" / "leaf.py"),
    ]
    assert not marker.exists() and "prov_walk" not in sys.modules
    assert module_origins("prov_walk.missing") == origins[:1]  # the parent still runs


def test_a_folder_in_the_current_directory_is_shadowed_in_a_real_process(
    plugin_env: PluginEnv, tmp_path: Path
) -> None:
    """`python -m` puts the current directory first on sys.path: a ./prov_pkg/ there is
    reported as shadowing the plugin, and its code never runs."""
    _add_plugin(plugin_env, "prov_pkg.hooks")
    marker = tmp_path / "cwd-ran"
    cwd = tmp_path / "cwd"
    (cwd / "prov_pkg").mkdir(parents=True)
    (cwd / "prov_pkg" / "__init__.py").write_text(_trap(marker))
    (cwd / "prov_pkg" / "hooks.py").write_text(_trap(marker))
    proc = subprocess.run(
        [sys.executable, "-m", "rtpcore", "plugins", "list", "--json", "--plugins", "prov-plugin"],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=dict(os.environ, PYTHONPATH=str(plugin_env.site)),
    )
    (row,) = [r for r in json.loads(proc.stdout) if r["request"] == "prov-plugin"]
    assert row["state"] == "shadowed", row
    assert str(cwd / "prov_pkg" / "__init__.py") in row["error"]
    assert not marker.exists()


def test_a_folder_the_distribution_puts_on_the_path_with_a_pth_file_is_its_own(
    plugin_env: PluginEnv, tmp_path: Path
) -> None:
    """An editable install of the .pth kind: RECORD lists a .pth naming the source folder."""
    info = _add_plugin(plugin_env, "prov_mod")
    (plugin_env.site / "prov_mod.py").unlink()
    src = tmp_path / "checkout" / "src"
    plugin_env.add_module(
        "prov_mod.py", hooks_source(("P", "prov", ("ProvForCausalLM",))), site=src
    )
    (plugin_env.site / "__editable__.prov_plugin-1.0.pth").write_text(f"{src}\n")
    (info / "RECORD").write_text(
        "__editable__.prov_plugin-1.0.pth,,\nprov_plugin-1.0.dist-info/METADATA,,\n"
    )
    sys.path.append(str(src))  # what site.py does with the .pth at startup
    assert "prov" in load_plugins(_plan()).model_types()


EDITABLE_PYPROJECT = """\
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "rtpcore-editable"
version = "0.1.0"

[project.entry-points."rtpcore.plugins"]
editable = "editable_plugin.hooks"

[tool.setuptools]
packages = ["editable_plugin"]
{where}
"""


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["src", "flat"])
def test_a_pip_editable_install_is_not_shadowed(tmp_path: Path, layout: str) -> None:
    """`pip install -e` into a fresh venv: a src layout (setuptools writes a .pth) and a
    flat layout (setuptools installs its __editable__ finder) both load."""

    pytest.importorskip("setuptools", reason="the editable plugin builds with setuptools")
    project = tmp_path / "editable"
    package = project / ("src" if layout == "src" else "") / "editable_plugin"
    package.mkdir(parents=True)
    where = 'package-dir = {"" = "src"}' if layout == "src" else ""
    (project / "pyproject.toml").write_text(EDITABLE_PYPROJECT.format(where=where))
    (package / "__init__.py").write_text("")
    (package / "hooks.py").write_text(hooks_source(("E", "editable", ("EditableForCausalLM",))))
    python, env = pip_install_into_venv(tmp_path, "-e", str(project))
    out = subprocess.run(
        [python, "-m", "rtpcore", "plugins", "list", "--json", "--plugins", "rtpcore-editable"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    (row,) = [r for r in json.loads(out.stdout) if r["request"] == "rtpcore-editable"]
    assert (row["state"], row["models"]) == ("loaded", ["editable"]), row

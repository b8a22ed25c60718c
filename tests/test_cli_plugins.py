"""`rtpcore plugins list` and `rtpcore plugins check`, against real dist-info folders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plugin_env import PluginEnv, hooks_source, model_source, pip_install_into_venv
from rtpcore.cli import main
from rtpcore.plugins.model_plugin import FORWARD_CONTRACT

KEYS = {"name", "distribution", "version", "value", "state", "models", "architectures"}


def _install(plugin_env: PluginEnv, tmp_path: Path) -> Path:
    marker = tmp_path / "evil-imported"
    plugin_env.add_dist(
        "cli-good",
        "1.2",
        plugins={"good": "cli_good"},
        architectures={"GoodForCausalLM": "good"},
        modules={"cli_good.py": hooks_source(("G", "cli_good", ("GoodForCausalLM",)))},
    )
    plugin_env.add_dist(
        "cli-evil",
        "6.6",
        plugins={"evil": "cli_evil"},
        architectures={"EvilForCausalLM": "evil"},
        modules={
            "cli_evil.py": f"open({str(marker)!r}, 'w').close()\nraise RuntimeError('imported')\n"
        },
    )
    return marker


def _child_env(plugin_env: PluginEnv) -> dict[str, str]:
    """The environment of a child rtpcore process: the fake site first, then this process's
    PYTHONPATH (so that the child runs the rtpcore under test)."""
    path = os.pathsep.join(p for p in (str(plugin_env.site), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path)


def _list(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[dict[str, object]]]:
    code = main(["plugins", "list", "--json", *argv])
    return code, json.loads(capsys.readouterr().out)


def test_list_shows_builtins_and_installed_plugins_without_importing_them(
    plugin_env: PluginEnv, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every discovered entry point is listed with its declared architectures; none is imported."""
    marker = _install(plugin_env, tmp_path)
    code, rows = _list(capsys)
    assert code == 0
    by_name = {row["name"]: row for row in rows}
    assert all(set(row) >= KEYS for row in rows)
    assert (
        rows[0]["name"] == "rtpcore.models"
        and rows[0]["builtin"] is True
        and rows[0]["state"] == "registered"  # its Llama class is registered lazily, not imported
    )
    assert rows[0]["unimported"] == ["rtpcore.models.llama:LlamaPlugin"]
    assert "llama" in rows[0]["models"]  # type: ignore[operator]
    evil = by_name["evil"]
    assert (evil["distribution"], evil["version"], evil["value"], evil["state"]) == (
        "cli-evil",
        "6.6",
        "cli_evil",
        "not-requested",
    )
    assert evil["declared_architectures"] == ["EvilForCausalLM"]
    assert not marker.exists() and "cli_evil" not in sys.modules and "cli_good" not in sys.modules


def test_list_reports_each_request_with_its_outcome_and_exit_status(
    plugin_env: PluginEnv, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A loaded and a failed request each appear with their state; any failure exits 1."""
    marker = _install(plugin_env, tmp_path)
    code, rows = _list(capsys, "--plugins", "cli-good,cli-missing", "--requested-only")
    assert code == 1
    assert [(r["request"], r["state"]) for r in rows] == [
        ("cli-good", "loaded"),
        ("cli-missing", "not-installed"),
    ]
    assert rows[0]["models"] == ["cli_good"] and rows[0]["architectures"] == ["GoodForCausalLM"]
    assert "cli-missing" in str(rows[1]["error"])
    assert not marker.exists()
    code, rows = _list(capsys, "--plugins", "cli-good")
    assert code == 0
    assert {r["name"]: r["state"] for r in rows}["good"] == "loaded"


def test_list_prints_a_table_naming_the_builtin(
    plugin_env: PluginEnv, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The text form has one line per plugin and the error under a failed one."""
    _install(plugin_env, tmp_path)
    assert main(["plugins", "list", "--plugins", "cli-evil"]) == 1
    out = capsys.readouterr().out
    assert "rtpcore.models (built-in)" in out
    assert "import-failed" in out and "error: plugin 'evil'" in out


def test_a_bad_item_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """An item breaking a parse rule exits 2 naming the item."""
    with pytest.raises(SystemExit) as excinfo:
        main(["plugins", "list", "--plugins", "a..b"])
    assert excinfo.value.code == 2
    assert "'a..b'" in capsys.readouterr().err


def test_help_version_and_list_never_import_torch() -> None:
    """A fresh interpreter running --help, --version and plugins list has no torch loaded."""
    code = (
        "import sys\n"
        "from rtpcore.cli import main\n"
        "for argv in (['--help'], ['--version'], ['plugins', 'list', '--help']):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "main(['plugins', 'list', '--json', '--plugins', 'atom-plugin'])\n"
        "print('TORCH', 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "TORCH False"


def test_check_loads_in_a_fresh_process_and_survives_a_crashing_plugin(
    plugin_env: PluginEnv, tmp_path: Path
) -> None:
    """check reports ok for a good plugin and an error (not a crash) for one that kills its process."""
    _install(plugin_env, tmp_path)
    plugin_env.add_dist(
        "cli-crash",
        plugins={"crash": "cli_crash"},
        modules={"cli_crash.py": "import os\nos._exit(3)\n"},
    )
    env = _child_env(plugin_env)

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "rtpcore", "plugins", "check", *argv],
            capture_output=True,
            text=True,
            env=env,
        )

    good = run("cli-good>=1", "cli-evil")
    assert good.returncode == 1
    lines = good.stdout.splitlines()
    assert lines[0].startswith(
        "ok    cli-good>=1: good (cli-good 1.2, cli_good): cli_good (GoodForCausalLM)"
    )
    assert lines[1].startswith("FAIL  cli-evil: import-failed:")
    assert run("cli-good").returncode == 0
    crashed = run("cli-crash")
    assert crashed.returncode == 1
    assert "exited with status 3" in crashed.stderr
    bad = run("bad item")
    assert bad.returncode == 2 and "'bad item'" in bad.stderr


def test_check_children_never_run_code_from_the_current_directory(
    plugin_env: PluginEnv, tmp_path: Path
) -> None:
    """A ./rtpcore/ package and a ./cli_good.py in the current directory, whose import would
    create a file, never run: check's child does not put the current directory on sys.path."""
    _install(plugin_env, tmp_path)
    cwd, marker = tmp_path / "cwd", tmp_path / "cwd-code-ran"
    trap = f"open({str(marker)!r}, 'w').close()\nraise SystemExit(7)\n"
    (cwd / "rtpcore").mkdir(parents=True)
    for name in ("rtpcore/__init__.py", "rtpcore/__main__.py", "cli_good.py"):
        (cwd / name).write_text(trap)
    script = Path(sys.executable).with_name("rtpcore")  # the console script users type
    command = [str(script)] if script.exists() else [sys.executable, "-P", "-m", "rtpcore"]
    proc = subprocess.run(
        [*command, "plugins", "check", "cli-good"],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=_child_env(plugin_env),
    )
    assert not marker.exists()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok    cli-good: good (cli-good 1.2, cli_good)")


THROWAWAY_PYPROJECT = """\
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "rtpcore-throwaway"
version = "0.3.0"

[project.entry-points."rtpcore.plugins"]
throwaway = "throwaway_plugin.hooks"

[project.entry-points."rtpcore.architectures"]
ThrowawayForCausalLM = "throwaway"

[tool.setuptools.packages.find]
where = ["src"]
"""


@pytest.mark.slow
def test_a_pip_installed_plugin_is_listed_and_loaded_in_a_fresh_venv(tmp_path: Path) -> None:
    """A real `pip install` into a new virtual environment: listed, then loaded on request."""

    pytest.importorskip("setuptools", reason="the throwaway plugin builds with setuptools")

    project = tmp_path / "throwaway"
    (project / "src" / "throwaway_plugin").mkdir(parents=True)
    (project / "pyproject.toml").write_text(THROWAWAY_PYPROJECT)
    (project / "src" / "throwaway_plugin" / "__init__.py").write_text("")
    (project / "src" / "throwaway_plugin" / "hooks.py").write_text(
        hooks_source(("T", "throwaway", ("ThrowawayForCausalLM",)))
    )
    python, env = pip_install_into_venv(tmp_path, "--no-deps", str(project))

    def plugins_list(*argv: str) -> tuple[int, list[dict[str, object]]]:
        out = subprocess.run(
            [python, "-m", "rtpcore", "plugins", "list", "--json", *argv],
            capture_output=True,
            text=True,
            env=env,
        )
        return out.returncode, json.loads(out.stdout)

    code, rows = plugins_list()
    row = next(r for r in rows if r["name"] == "throwaway")
    assert code == 0
    assert (row["distribution"], row["version"], row["state"]) == (
        "rtpcore-throwaway",
        "0.3.0",
        "not-requested",
    )
    code, rows = plugins_list("--plugins", "rtpcore-throwaway>=0.3", "--requested-only")
    assert code == 0
    assert [(r["state"], r["models"], r["architectures"]) for r in rows] == [
        ("loaded", ["throwaway"], ["ThrowawayForCausalLM"])
    ]


def test_an_ignored_environment_variable_is_reported_once_as_a_warning(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`plugins list` prints one 'rtpcore: warning:' line naming the variable and the flag,
    and loads nothing from it."""
    monkeypatch.setenv("EXTERNAL_MODEL_PACKAGES", "sneaky.module")
    assert main(["plugins", "list", "--json", "--requested-only"]) == 0
    first = capsys.readouterr()
    assert json.loads(first.out) == []
    assert first.err.count("rtpcore: warning:") == 1
    assert "EXTERNAL_MODEL_PACKAGES" in first.err and "--external-model-packages" in first.err
    assert main(["plugins", "list", "--json", "--requested-only"]) == 0
    assert "warning" not in capsys.readouterr().err


def _lazy_hooks(target: str, model_type: str, arch: str) -> str:
    return (
        "from rtpcore import hookimpl\n\n@hookimpl\ndef rtpcore_register_models(registry):\n"
        f"    registry.register({target!r}, model_type={model_type!r}, architectures=({arch!r},))\n"
    )


def _install_lazy(plugin_env: PluginEnv) -> None:
    """Five lazily registering plugins (model type = module prefix = the dist name with '_'):
    one good, and four the engine would refuse at generate."""
    header = "from rtpcore import ModelPlugin\n"
    cases = [  # (distribution, architecture, class module source prefix, registered target)
        ("lazy-good", "LgForCausalLM", "", "lazy_good_m:M"),
        ("lazy-import", "LiForCausalLM", "import lazy_not_installed_dep\n", "lazy_import_m:M"),
        ("lazy-module", "LmForCausalLM", "", "lazy_module_x:M"),  # no such module
        ("lazy-attr", "LaForCausalLM", "", "lazy_attr_m:Mm"),  # no such class
        ("lazy-contract", "LcForCausalLM", "", "lazy_contract_m:M"),  # forward_contract unstated
    ]
    for dist, arch, prefix, target in cases:
        mod = dist.replace("-", "_")
        contract = None if dist == "lazy-contract" else FORWARD_CONTRACT
        source = prefix + header + model_source("M", mod, (arch,), contract=contract)
        plugin_env.add_dist(
            dist,
            "0.4",
            plugins={mod: f"{mod}_hooks"},
            modules={f"{mod}_hooks.py": _lazy_hooks(target, mod, arch), f"{mod}_m.py": source},
        )


def test_check_imports_lazy_registrations_and_fails_where_the_engine_would_refuse(
    plugin_env: PluginEnv,
) -> None:
    """An import error in the class's module, a wrong module, a wrong attribute and a class
    without forward_contract are each a FAIL naming the plugin, its distribution and the
    module:Class (exit 1); the good lazy plugin is ok."""
    _install_lazy(plugin_env)
    proc = subprocess.run(
        [sys.executable, "-m", "rtpcore", "plugins", "check", "lazy-good", "lazy-import",
         "lazy-module", "lazy-attr", "lazy-contract"],
        capture_output=True, text=True, env=_child_env(plugin_env),
    )
    assert proc.returncode == 1, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 5, proc.stdout
    assert lines[0].startswith("ok    lazy-good: lazy_good (lazy-good 0.4, lazy_good_hooks): lazy_good")
    expected = [
        ("lazy-import", "import-failed", "lazy_import_m:M", "No module named 'lazy_not_installed_dep'"),
        ("lazy-module", "import-failed", "lazy_module_x:M", "No module named 'lazy_module_x'"),
        ("lazy-attr", "import-failed", "lazy_attr_m:Mm", "has no attribute 'Mm'"),
        (
            "lazy-contract",
            "invalid",
            "lazy_contract_m:M",
            f"it does not state forward_contract; this rtpcore runs {FORWARD_CONTRACT} "
            f"(set `forward_contract = {FORWARD_CONTRACT}` on the class)",
        ),
    ]
    for line, (dist, state, target, detail) in zip(lines[1:], expected, strict=True):
        plugin = dist.replace("-", "_")
        assert line.startswith(f"FAIL  {dist}: {state}: model {plugin!r} of plugin {plugin!r} ({dist} 0.4, "), line
        assert target in line and detail in line, line
    assert "states forward_contract=1" not in proc.stdout
    ok = subprocess.run(
        [sys.executable, "-m", "rtpcore", "plugins", "check", "lazy-good", "--json"],
        capture_output=True, text=True, env=_child_env(plugin_env),
    )
    assert ok.returncode == 0, ok.stderr
    assert [(r["state"], r["unimported"]) for r in json.loads(ok.stdout)] == [("loaded", [])]


def test_list_says_registered_not_loaded_for_classes_it_has_not_imported(
    plugin_env: PluginEnv, capsys: pytest.CaptureFixture[str]
) -> None:
    """list runs the hooks but imports no lazily registered class: such a plugin is
    'registered' (exit 0) with the module:Class targets not imported yet, even one whose
    import would fail; --import-models imports them (loaded, or the failure)."""
    _install_lazy(plugin_env)
    code, rows = _list(capsys, "--plugins", "lazy-good,lazy-attr", "--requested-only")
    assert code == 0
    assert [(r["request"], r["state"], r["unimported"]) for r in rows] == [
        ("lazy-good", "registered", ["lazy_good_m:M"]),
        ("lazy-attr", "registered", ["lazy_attr_m:Mm"]),
    ]
    assert "lazy_good_m" not in sys.modules
    code, rows = _list(capsys, "--plugins", "lazy-good,lazy-attr", "--requested-only", "--import-models")
    assert code == 1
    assert [(r["request"], r["state"]) for r in rows] == [
        ("lazy-good", "loaded"),
        ("lazy-attr", "import-failed"),
    ]
    assert main(["plugins", "list", "--plugins", "lazy-good", "--requested-only"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].startswith("registered")
    assert "not imported yet: lazy_good_m:M (`rtpcore plugins check` imports and validates them)" in out


def test_list_shows_each_plugins_registrations_per_seam(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/design.md §18: `seams` maps each seam to what the plugin registered there (atom-plugin,
    installed for real: two models, its ue8m0 KV layout, its DeepSeek-V3 tool parser); the table
    lists the other seams after the models."""
    code, rows = _list(capsys, "--plugins", "atom-plugin", "--requested-only")
    assert code == 0
    (atom,) = [r for r in rows if r["requested"]]
    assert atom["seams"] == {"models": ["deepseek_v2", "deepseek_v3"], "kv_layouts": ["ue8m0"],
                             "tool_parsers": ["deepseek_v3"], "attention_backends": ["atom_mla"], "platforms": [],
                             "quantization_methods": ["atom_fp8", "fp8"],  # fp8: replaced by atom_fp8
                             "reasoning_parsers": ["atom_deepseek_r1"], "logits_processors": []}
    builtin = next(r for r in _list(capsys)[1] if r["builtin"])
    assert builtin["seams"] == {"models": ["llama"], "kv_layouts": [], "tool_parsers": [],
                                "attention_backends": ["native_cpu", "torch"], "platforms": ["cpu", "cuda"],
                                "quantization_methods": ["fp8", "gguf", "int8"],
                                "reasoning_parsers": ["deepseek_r1", "qwen3"], "logits_processors": []}
    assert main(["plugins", "list", "--plugins", "atom-plugin", "--requested-only"]) == 0
    assert "; kv_layouts: ue8m0; tool_parsers: deepseek_v3" in capsys.readouterr().out

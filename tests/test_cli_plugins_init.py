"""``rtpcore plugins init``: the package it writes installs with pip, passes ``plugins check``
and its own test, imports only the public plugin modules; bad input writes nothing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from plugin_env import PUBLIC_MODULES, pip_install_into_venv, rtpcore_imports


def init(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rtpcore", "plugins", "init", *args],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_package_installs_checks_and_passes_its_own_test(tmp_path: Path) -> None:
    target = tmp_path / "pkg"
    made = init(str(target), "--model-type", "tiny_dec")
    assert made.returncode == 0, made.stderr
    assert "tiny-dec-plugin" in made.stdout
    assert rtpcore_imports(sorted(target.rglob("*.py"))) <= PUBLIC_MODULES
    python, env = pip_install_into_venv(tmp_path, str(target))
    check = subprocess.run([python, "-m", "rtpcore", "plugins", "check", "tiny-dec-plugin"],
                           env=env, capture_output=True, text=True, timeout=600)
    assert check.returncode == 0 and check.stdout.startswith("ok"), check.stdout + check.stderr
    own = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=target, env=env,
                         capture_output=True, text=True, timeout=900)
    assert own.returncode == 0 and re.search(r"\b1 passed\b", own.stdout), own.stdout + own.stderr
    demo = subprocess.run([python, "-m", "rtpcore", "generate", "--demo", "tiny_dec", "--plugins", "tiny-dec-plugin",
                           "--prompt-ids", "256,1,2", "--max-new-tokens", "4", "--json"],
                          env={**env, "XDG_CACHE_HOME": str(tmp_path / "cache")}, capture_output=True, text=True,
                          timeout=600)
    assert demo.returncode == 0, demo.stderr


def test_names_default_from_the_model_type_and_can_be_given(tmp_path: Path) -> None:
    made = init(str(tmp_path / "p"), "--model-type", "my_arch", "--architecture", "MyArchLM",
                "--distribution", "acme-my-arch")
    assert made.returncode == 0, made.stderr
    pyproject = (tmp_path / "p" / "pyproject.toml").read_text()
    assert 'name = "acme-my-arch"' in pyproject and 'MyArchLM = "acme_my_arch"' in pyproject
    assert (tmp_path / "p" / "src" / "acme_my_arch" / "plugin.py").is_file()
    default = init(str(tmp_path / "q"), "--model-type", "my_arch")
    assert default.returncode == 0
    text = (tmp_path / "q" / "pyproject.toml").read_text()
    assert 'name = "my-arch-plugin"' in text and "MyArchForCausalLM" in text


@pytest.mark.parametrize(("args", "needle"), [
    (("--model-type", "My-Model"), "--model-type 'My-Model': must be lowercase letters"),
    (("--model-type", "class"), "not a Python keyword"),
    (("--model-type", "ok", "--architecture", "Not An Identifier"), "--architecture 'Not An Identifier'"),
    (("--model-type", "ok", "--distribution=-bad-"), "--distribution '-bad-': not a valid distribution name"),
])
def test_bad_names_are_usage_errors_and_write_nothing(tmp_path: Path, args: tuple[str, ...], needle: str) -> None:
    made = init(str(tmp_path / "p"), *args)
    assert made.returncode == 2 and needle in made.stderr, made.stderr
    assert not (tmp_path / "p").exists()


def test_a_folder_that_holds_files_is_refused_untouched(tmp_path: Path) -> None:
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "notes.txt").write_text("mine")
    made = init(str(tmp_path / "p"), "--model-type", "ok")
    assert made.returncode == 2 and "exists and is not an empty folder: nothing was written" in made.stderr
    assert [f.name for f in (tmp_path / "p").iterdir()] == ["notes.txt"]
    assert init(str(tmp_path / "empty"), "--model-type", "ok").returncode == 0  # a missing folder is made

"""A GPT-NeoX plugin written as a new author would (tests/plugins/neox-plugin): a real
distribution, pip-installed into a fresh venv, importing only the public plugin modules
(docs/design.md §21), whose own tests compare rtpcore's greedy tokens with transformers'
GPTNeoXForCausalLM at tensor_parallel_size 1 and 2. docs/plugins.md's "Your first plugin"
walkthrough shows its files, and test_docs_walkthrough checks they are the files here."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from plugin_env import PUBLIC_MODULES, pip_install_into_venv, rtpcore_imports

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tests" / "plugins" / "neox-plugin"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str]]:
    """A fresh venv with neox-plugin pip-installed from its folder (a copy: the build writes there)."""
    tmp = tmp_path_factory.mktemp("neox")
    source = tmp / "src"
    subprocess.run(["cp", "-r", str(PACKAGE), str(source)], check=True)
    return pip_install_into_venv(tmp, str(source))


def test_the_plugin_imports_only_the_public_modules() -> None:
    used = rtpcore_imports(sorted((PACKAGE / "src").rglob("*.py")))
    assert used and used <= PUBLIC_MODULES, sorted(used - PUBLIC_MODULES)


def test_the_installed_plugin_passes_its_own_tests_against_transformers(venv: tuple[str, dict[str, str]]) -> None:
    """The package's parity tests, run by the venv's python from the package folder: greedy
    tokens equal transformers' at 1 and 2 ranks, with and without the parallel residual."""
    python, env = venv
    proc = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                          cwd=PACKAGE, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"\b4 passed\b", proc.stdout), proc.stdout


def test_plugins_check_and_generate_serve_it_from_the_command_line(
    venv: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    """What an operator types: `plugins check` imports the lazily registered class and passes;
    `generate --tensor-parallel-size 2` gives the tokens of one rank."""
    python, env = venv
    check = subprocess.run([python, "-m", "rtpcore", "plugins", "check", "neox-plugin"],
                           env=env, capture_output=True, text=True, timeout=600)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "gpt_neox" in check.stdout
    subprocess.run([python, str(PACKAGE / "tests" / "test_neox_parity.py"), str(tmp_path / "ckpt")],
                   env=env, check=True, capture_output=True, timeout=600)

    def generate(*extra: str) -> list[int]:
        proc = subprocess.run(
            [python, "-m", "rtpcore", "generate", str(tmp_path / "ckpt"), "--plugins", "neox-plugin",
             "--prompt-ids", "5,9,33,7", "--max-new-tokens", "8", "--json", *extra],
            env=env, capture_output=True, text=True, timeout=600,
        )
        assert proc.returncode == 0, proc.stderr
        return list(json.loads(proc.stdout)["output_ids"])

    assert generate("--tensor-parallel-size", "2") == generate()


def test_docs_walkthrough_shows_the_package_files_exactly() -> None:
    """docs/plugins.md "Your first plugin" shows each file of the package whole, under a
    `<!-- file: PATH -->` marker: the code a reader copies is the code these tests install and run."""
    doc = (ROOT / "docs" / "plugins.md").read_text()
    shown = dict(re.findall(r"<!-- file: (\S+) -->\n```[a-z]*\n(.*?)```\n", doc, flags=re.S))
    built = ("__pycache__", "build")  # what a build or a run leaves in the folder
    files = {str(p.relative_to(ROOT)): p for p in PACKAGE.rglob("*")
             if p.is_file() and not any(part in built or part.endswith(".egg-info") for part in p.parts)}
    assert set(shown) == set(files)
    for rel, text in shown.items():
        assert text == files[rel].read_text(), f"docs/plugins.md shows {rel} other than it is"

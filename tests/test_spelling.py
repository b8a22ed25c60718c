"""Errors name the Python API's arguments through Python and the flags through the command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from plugin_env import PluginEnv
from rtpcore import Allowlist, Engine
from rtpcore.errors import PluginNotFoundError, UnknownArchitectureError


def _hinted_checkpoint(plugin_env: PluginEnv, tmp_path: Path) -> Path:
    """An installed (not allowed) plugin declaring the checkpoint's architecture."""
    plugin_env.add_dist(
        "sp-hint", "0.2", plugins={"sphint": "sp_hint"}, architectures={"SpHintForCausalLM": "sphint"}
    )
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"architectures": ["SpHintForCausalLM"]}')
    return ckpt


def test_the_python_api_names_its_plugins_argument(plugin_env: PluginEnv, tmp_path: Path) -> None:
    """Engine.from_pretrained's unknown-architecture error says plugins=[...], never --plugins."""
    ckpt = _hinted_checkpoint(plugin_env, tmp_path)
    with pytest.raises(UnknownArchitectureError) as excinfo:
        Engine.from_pretrained(str(ckpt), device="cpu")
    message = str(excinfo.value)
    assert "SpHintForCausalLM is served by the installed plugin 'sphint' of sp-hint 0.2" in message
    assert "(pass plugins=['sp-hint'])" in message and "--plugins" not in message


def test_the_command_line_names_its_plugins_flag(plugin_env: PluginEnv, tmp_path: Path) -> None:
    """`rtpcore generate` on the same checkpoint says --plugins, never plugins=[...]."""
    ckpt = _hinted_checkpoint(plugin_env, tmp_path)
    path = os.pathsep.join(p for p in (str(plugin_env.site), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "rtpcore", "generate", str(ckpt), "--prompt-ids", "1", "--device", "cpu"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=path),
    )
    assert proc.returncode == 1
    assert "(pass --plugins sp-hint)" in proc.stderr and "plugins=[" not in proc.stderr


def test_an_ambiguous_entry_point_name_is_answered_in_the_callers_terms(
    plugin_env: PluginEnv,
) -> None:
    """Through Python, the items to choose from are plugins=[...] arguments."""
    plugin_env.add_dist("sp-f1", plugins={"sptwin": "f1"})
    plugin_env.add_dist("sp-f2", plugins={"sptwin": "f2"})
    with pytest.raises(PluginNotFoundError) as excinfo:
        Allowlist.from_cli(plugins=["sptwin"]).resolve()
    assert "pass plugins=['sp-f1:sptwin'] or pass plugins=['sp-f2:sptwin']" in str(excinfo.value)

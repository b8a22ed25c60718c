"""The operator's view: ``rtpcore`` commands in a real subprocess with ``--plugins atom-plugin``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def rtpcore(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "rtpcore", *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.slow
def test_plugins_list_shows_models_and_architectures(tmp_path: Path) -> None:
    """`rtpcore plugins list --plugins atom-plugin --json` reports atom registered with both
    models (lazily: not imported), and `rtpcore plugins check atom-plugin` imports them: ok."""
    proc = rtpcore("plugins", "list", "--plugins", "atom-plugin", "--json", cache=tmp_path)
    assert proc.returncode == 0, proc.stderr
    atom = next(row for row in json.loads(proc.stdout) if row["distribution"] == "atom-plugin")
    assert atom["state"] == "registered"
    assert atom["name"] == "atom"
    assert sorted(atom["models"]) == ["deepseek_v2", "deepseek_v3"]
    assert sorted(atom["architectures"]) == ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"]
    assert sorted(atom["unimported"]) == [
        "atom_plugin.deepseek:DeepseekV2Plugin",
        "atom_plugin.deepseek:DeepseekV3Plugin",
    ]
    checked = rtpcore("plugins", "check", "atom-plugin", cache=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.startswith("ok    atom-plugin: atom (atom-plugin 0.1.0, atom_plugin.hooks)")


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("--kv-cache-dtype", "fp8", "--kv-layout", "ue8m0")])
def test_generate_demo_deepseek_v3(tmp_path: Path, extra: tuple[str, ...]) -> None:
    """`rtpcore generate --demo deepseek_v3 --plugins atom-plugin --prompt Hello` writes tokens."""
    proc = rtpcore(
        "generate", "--demo", "deepseek_v3", "--plugins", "atom-plugin", "--prompt", "Hello",
        "--max-new-tokens", "8", "--json", *extra, cache=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["model_type"] == "deepseek_v3"
    assert result["prompt_ids"] == list(b"Hello")
    assert 1 <= len(result["output_ids"]) <= 8

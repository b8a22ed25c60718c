"""The platform seam (docs/design.md §18): the built-in ``cpu`` and ``cuda``, and plugin platforms
registered through the ``rtpcore_register_platforms`` hook of a real distribution, selected with
``device=NAME`` / ``--device NAME`` or by ``auto`` on priority; what the engine takes from the
platform (its default attention backend, its memory for the KV cache, its dtypes); an
``is_available()`` that raises shown by ``plugins list`` and quoted when selected; every wrong
platform refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plugin_env import PluginEnv
from rtpcore import Allowlist, Engine, load_plugins
from rtpcore.errors import (
    DeviceError,
    PluginConflictError,
    PluginIncompatibleError,
    PluginLoadError,
    RtpcoreError,
)
from rtpcore.platforms import CpuPlatform, CudaPlatform, availability, memory_limit

pytest.importorskip("transformers")

PROMPTS = [[5, 9, 33], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [100]]

PLATFORM = '''
from rtpcore import hookimpl
from rtpcore.platforms import Platform


class HostCpu(Platform):
    """The host's CPU under another name: what a vendor's platform looks like, minus the device."""
    name = {name!r}
    device_type = "cpu"
    priority = {priority}
    default_attention_backend = "torch"
    supported_dtypes = {dtypes!r}

    @classmethod
    def is_available(cls):
        {available}

    @classmethod
    def memory_info(cls):
        return {memory!r}


@hookimpl
def rtpcore_register_platforms(registry):
    registry.register_platform(HostCpu)
'''


def platform_dist(env: PluginEnv, dist: str, *, name: str = "hostcpu", priority: int = 100,
                  dtypes: tuple[str, ...] = ("float32", "bfloat16"), available: str = "return True",
                  memory: tuple[int, int] = (1 << 40, 1 << 40)) -> None:
    module = dist.replace("-", "_")
    env.add_dist(dist, plugins={module: module}, modules={f"{module}.py": PLATFORM.format(
        name=name, priority=priority, dtypes=dtypes, available=available, memory=memory)})


def subprocess_env(env: PluginEnv) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(env.site), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


@pytest.fixture(scope="module")
def reference(ckpt: Path) -> list[list[int]]:
    with Engine.from_pretrained(ckpt, tokens_per_block=4, attention_backend="torch") as engine:
        return engine.generate(PROMPTS, max_new_tokens=8, stop_token_ids=[])


def test_the_built_ins() -> None:
    assert availability(CpuPlatform) == (True, None)
    assert CpuPlatform.memory_info()[1] == memory_limit()
    free, total = CpuPlatform.memory_info()
    assert 0 < free <= total
    import torch

    assert availability(CudaPlatform)[0] is torch.cuda.is_available()
    assert (CudaPlatform.dist_backend, CudaPlatform.supports_graphs, CpuPlatform.dist_backend) == ("nccl", True, "gloo")


def test_a_plugin_platform_is_selected_by_name_and_by_auto_and_its_defaults_apply(
    plugin_env: PluginEnv, ckpt: Path, reference: list[list[int]]
) -> None:
    """device='hostcpu': the engine runs there, each layer on the platform's default attention
    backend (torch, where the built-in cpu would pick native_cpu); 'auto' takes it by priority."""
    platform_dist(plugin_env, "pf-host")
    for device in ("hostcpu", "auto"):
        with Engine.from_pretrained(ckpt, tokens_per_block=4, plugins=["pf-host"], device=device) as engine:
            assert (engine.config.platform, engine.config.device) == ("hostcpu", "cpu")
            assert {c.attention_backend.name for c in engine.kv_caches} == {"torch"}
            assert engine.generate(PROMPTS, max_new_tokens=8, stop_token_ids=[]) == reference
    with Engine.from_pretrained(ckpt, tokens_per_block=4, plugins=["pf-host"], device="cpu") as engine:
        assert engine.config.platform == "cpu"
        assert {c.attention_backend.name for c in engine.kv_caches} == {"native_cpu"}


def test_the_kv_cache_draws_on_the_platforms_memory(plugin_env: PluginEnv, ckpt: Path) -> None:
    """A CPU-type platform's memory_info() total bounds the KV cache (a quarter of it), as the
    host's memory bounds the built-in cpu's; too little for one sequence is the capacity error."""
    total = 1 << 20
    platform_dist(plugin_env, "pf-small", memory=(total, total))
    with Engine.from_pretrained(ckpt, tokens_per_block=4, plugins=["pf-small"], device="hostcpu",
                                max_model_len=64) as engine:
        used = engine.num_kv_blocks * sum(s.block_bytes for s in engine.kv_cache_specs)
        assert 0 < used <= total // 4
    with Engine.from_pretrained(ckpt, tokens_per_block=4, max_model_len=64) as engine:
        assert engine.num_kv_blocks * sum(s.block_bytes for s in engine.kv_cache_specs) > total // 4


def test_a_dtype_the_platform_does_not_run_is_refused_naming_it(plugin_env: PluginEnv, ckpt: Path) -> None:
    platform_dist(plugin_env, "pf-bf16", dtypes=("bfloat16",))
    with pytest.raises(RtpcoreError, match="dtype 'float32' is not one platform 'hostcpu' runs: bfloat16"):
        Engine.from_pretrained(ckpt, plugins=["pf-bf16"], device="hostcpu")


def test_cuda_graphs_need_a_platform_that_replays_them(plugin_env: PluginEnv, ckpt: Path) -> None:
    platform_dist(plugin_env, "pf-graphs")
    with pytest.raises(RtpcoreError, match="cuda_graphs=True needs a platform that replays CUDA graphs; the engine "
                                           "runs on 'hostcpu'"):
        Engine.from_pretrained(ckpt, plugins=["pf-graphs"], device="hostcpu", cuda_graphs=True)


def test_a_raising_is_available_is_shown_and_quoted_never_swallowed(plugin_env: PluginEnv, ckpt: Path) -> None:
    platform_dist(plugin_env, "pf-broken", name="broken", available="raise RuntimeError('no driver for card 0')")
    env = subprocess_env(plugin_env)
    listed = subprocess.run([sys.executable, "-m", "rtpcore", "plugins", "list", "--json", "--plugins", "pf-broken",
                             "--requested-only"], capture_output=True, text=True, env=env, timeout=600, check=False)
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(listed.stdout)
    assert row["seams"]["platforms"] == ["broken"]
    assert row["platforms"] == {"broken": "unavailable: is_available() raised RuntimeError: no driver for card 0"}
    table = subprocess.run([sys.executable, "-m", "rtpcore", "plugins", "list", "--plugins", "pf-broken"],
                           capture_output=True, text=True, env=env, timeout=600, check=False)
    assert "platform broken: unavailable: is_available() raised RuntimeError: no driver for card 0" in table.stdout
    run = subprocess.run([sys.executable, "-m", "rtpcore", "generate", str(ckpt), "--prompt-ids", "1", "--plugins",
                          "pf-broken", "--device", "broken"], capture_output=True, text=True, env=env, timeout=600,
                         check=False)
    assert run.returncode == 1
    assert "device 'broken': platform 'broken'" in run.stderr
    assert "is not available: is_available() raised RuntimeError: no driver for card 0" in run.stderr
    # auto meets it first (priority 100): quoted too, not passed over.
    with pytest.raises(DeviceError, match=r"device 'auto': platform 'broken' .* is_available\(\) raised "
                                          r"RuntimeError: no driver for card 0"):
        Engine.from_pretrained(ckpt, plugins=["pf-broken"])


def test_the_cli_runs_on_a_plugin_platform(plugin_env: PluginEnv, ckpt: Path, reference: list[list[int]]) -> None:
    platform_dist(plugin_env, "pf-cli")
    run = subprocess.run([sys.executable, "-m", "rtpcore", "generate", str(ckpt), "--prompt-ids", "5,9,33",
                          "--max-new-tokens", "8", "--json", "--plugins", "pf-cli", "--device", "hostcpu"],
                         capture_output=True, text=True, env=subprocess_env(plugin_env), timeout=600, check=False)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["output_ids"] == reference[0]


@pytest.mark.parametrize(("changes", "error", "rule"), [
    ({"name": "my-device"}, PluginLoadError, "name must be letters, digits and '_', starting with a letter"),
    ({"name": "auto"}, PluginLoadError, "name 'auto' is --device's automatic choice"),
    ({"name": "cpu"}, PluginConflictError, "platform 'cpu'"),
])
def test_a_wrong_platform_is_refused(plugin_env: PluginEnv, changes: dict[str, str], error: type[Exception],
                                     rule: str) -> None:
    platform_dist(plugin_env, "pf-bad", **changes)  # type: ignore[arg-type]
    with pytest.raises(error) as excinfo:
        load_plugins(Allowlist.from_cli(plugins=["pf-bad"]).resolve())
    assert rule in str(excinfo.value) and "pf-bad" in str(excinfo.value)


@pytest.mark.parametrize(("line", "error", "rule"), [
    ("    api_version = '2.0'\n", PluginIncompatibleError, "written for the platforms API 2.0, and this rtpcore runs 1.0"),
    ("    device_type = 'not a type'\n", PluginLoadError, "device_type must be a torch device type"),
    ("    supported_dtypes = ('float64',)\n", PluginLoadError, "supported_dtypes must be a non-empty tuple"),
])
def test_a_malformed_platform_class_is_refused(plugin_env: PluginEnv, line: str, error: type[Exception],
                                               rule: str) -> None:
    source = PLATFORM.format(name="odd", priority=1, dtypes=("float32",), available="return True",
                             memory=(1, 1)).replace("\n    @classmethod\n    def is_available", "\n" + line + "    @classmethod\n    def is_available")
    plugin_env.add_dist("pf-odd", plugins={"pf_odd": "pf_odd"}, modules={"pf_odd.py": source})
    with pytest.raises(error) as excinfo:
        load_plugins(Allowlist.from_cli(plugins=["pf-odd"]).resolve())
    assert rule in str(excinfo.value) and "pf-odd" in str(excinfo.value)

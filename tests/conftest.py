"""Shared fixtures."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# --- hypothesis: no outcome may depend on the machine's speed -------------------------------
# No per-example deadline and no "too slow" health check: both fail a correct test on a slow or
# busy machine. Tests that set their own settings inherit these for what they leave unset.
settings.register_profile("rtpcore", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("rtpcore")

# --- the CPU cap: a run under RTPCORE_CPU_ISA (.ci/run's pass per --cpu-isa value) caps torch too ---
# Before any test's first product: oneDNN, ATen and MKL read their caps once per process.
if os.environ.get("RTPCORE_CPU_ISA"):
    from rtpcore.models.cpu_isa import apply_cpu_isa

    apply_cpu_isa(None)

# Packages under tests/plugins/ are real distributions with tests of their own, run from an
# install by tests/test_neox_plugin.py (and the docs walkthrough), never collected here.
collect_ignore = ["plugins"]

# --- plugin framework: real dist-info folders on a temporary sys.path -----------------------


@pytest.fixture
def plugin_env(tmp_path: Path) -> Iterator[object]:
    """A :class:`plugin_env.PluginEnv` whose site folder is first on ``sys.path``; afterwards
    ``sys.path``, the modules imported from it and the import caches are restored."""
    from plugin_env import PluginEnv

    saved_path = list(sys.path)
    env = PluginEnv(tmp_path)
    try:
        yield env
    finally:
        sys.path[:] = saved_path
        root = str(tmp_path)
        for name, module in list(sys.modules.items()):
            if (getattr(module, "__file__", None) or "").startswith(root):
                del sys.modules[name]
        importlib.invalidate_caches()


# --- devices: the gpu marker ----------------------------------------------------------------


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` skip, saying why, where torch sees no CUDA/ROCm device."""
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA/ROCm device: torch {torch.__version__} sees none")
    for item in gpu:
        item.add_marker(skip)


# --- engines: the tiny Llama checkpoint most engine tests share --------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """test_llama.make_checkpoint's tiny float32 Llama (seed 0), written once per test module
    (a module may define its own ``ckpt``)."""
    from test_llama import make_checkpoint

    path = tmp_path_factory.mktemp("llama")
    make_checkpoint(path)
    return path

"""A plan carried to a real spawned worker process: same registry, no discovery scan, version pinned."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from plugin_env import PluginEnv, hooks_source, worker_load
from rtpcore import Allowlist, Plan, load_plugins


def _in_spawned_child(plan: Plan) -> dict[str, Any]:
    with ProcessPoolExecutor(
        max_workers=1, mp_context=multiprocessing.get_context("spawn")
    ) as pool:
        return pool.submit(worker_load, plan).result(timeout=300)  # only against a hang


def _install(plugin_env: PluginEnv, version: str = "1.0") -> Any:
    return plugin_env.add_dist(
        "wk-plugin",
        version,
        plugins={"wk": "wk_hooks"},
        architectures={"WkForCausalLM": "wk"},
        modules={"wk_hooks.py": hooks_source(("Wk", "wk_model", ("WkForCausalLM",)))},
    )


def test_a_spawned_worker_rebuilds_the_same_registry_without_discovery(
    plugin_env: PluginEnv,
) -> None:
    """The child imports exactly the plan and never calls entry_points/distributions/discover."""
    _install(plugin_env)
    plan = Allowlist.from_cli(plugins=["wk-plugin>=1"]).resolve()
    parent = {
        r.model_type: (r.architectures, str(r.provider)) for r in load_plugins(plan).records()
    }
    child = _in_spawned_child(plan)
    assert child.get("error") is None, child
    assert child["calls"] == []
    assert child["modules"] == ["wk_hooks"]
    assert {k: (tuple(a), p) for k, (a, p) in child["models"].items()} == parent
    assert set(parent) == {"llama", "wk_model"}


def test_a_version_that_differs_in_the_worker_is_an_error(plugin_env: PluginEnv) -> None:
    """The parent resolved 1.0; the worker sees 2.0 and raises PluginVersionError, still without a scan."""
    info = _install(plugin_env)
    plan = Allowlist.from_cli(plugins=["wk-plugin"]).resolve()
    plugin_env.set_version(info, "2.0")
    child = _in_spawned_child(plan)
    assert child["error"] == "PluginVersionError"
    assert "'wk-plugin' 1.0" in child["message"] and "finds version 2.0" in child["message"]
    assert child["calls"] == []

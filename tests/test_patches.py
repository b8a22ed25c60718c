"""No monkeypatching (docs/design.md §18): a plugin that changes an rtpcore module or public
class while it loads is refused (state ``patches``, PluginPatchError naming the plugin, the
module or class and the attribute), the change is undone, and none of its registrations apply.

The plugins are real distributions (``*.dist-info`` on a temporary sys.path folder); the last
test runs ``rtpcore plugins check`` in a fresh process, for a module the plugin imports first.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import rtpcore.layers
from plugin_env import PluginEnv, hooks_source
from rtpcore import Allowlist
from rtpcore.engine.core.scheduler import Scheduler
from rtpcore.errors import PluginIncompatibleError, PluginPatchError
from rtpcore.plugins.loading import load_report

MODEL = ("PtModel", "pt_model", ("PtForCausalLM",))


def _load(plugin_env: PluginEnv, dist: str, body: str, *, at_import: bool = True):
    """Load distribution ``dist`` whose hooks module runs ``body`` at import, or inside its
    model hook; return its outcome and the registry."""
    extra = "" if at_import else body
    source = hooks_source(MODEL).replace("def rtpcore_register_models(registry):\n",
                                         "def rtpcore_register_models(registry):\n" + _indent(extra))
    if at_import:
        source = body + "\n" + source
    name = dist.replace("-", "_")
    plugin_env.add_dist(dist, "1.0", plugins={name: f"{name}_hooks"}, modules={f"{name}_hooks.py": source})
    report = load_report(Allowlist.from_cli(plugins=[dist]).resolve())
    (outcome,) = report.outcomes
    return outcome, report.registry


def _indent(body: str) -> str:
    return "".join(f"    {line}\n" for line in body.splitlines())


def test_replacing_a_module_function_at_import_is_refused_and_undone(plugin_env: PluginEnv) -> None:
    original = rtpcore.layers.paged_attention
    outcome, registry = _load(plugin_env, "pt-replace", "import rtpcore.layers\nrtpcore.layers.paged_attention = print\n")
    assert outcome.state == "patches"
    error = outcome.error
    assert isinstance(error, PluginPatchError)
    assert (error.plugin, error.distribution) == ("pt_replace", "pt-replace")
    assert error.patches == (("rtpcore.layers", "paged_attention", "replaced"),)
    assert "rtpcore.layers.paged_attention replaced" in str(error) and "pt-replace 1.0" in str(error)
    assert rtpcore.layers.paged_attention is original  # undone
    assert "pt_model" not in registry.model_types()  # nothing half-registered


def test_a_public_class_patched_in_a_hook_is_refused_and_undone(plugin_env: PluginEnv) -> None:
    original = Scheduler.__dict__["schedule"]
    body = "from rtpcore.engine.core.scheduler import Scheduler\nScheduler.schedule = lambda self: None\n"
    outcome, registry = _load(plugin_env, "pt-class", body, at_import=False)
    assert outcome.state == "patches"
    assert outcome.error.patches == (("rtpcore.engine.core.scheduler.Scheduler", "schedule", "replaced"),)
    assert Scheduler.__dict__["schedule"] is original
    assert "pt_model" not in registry.model_types()


def test_added_and_deleted_attributes_are_patches_too(plugin_env: PluginEnv) -> None:
    had = rtpcore.layers.causal_mask
    body = "import rtpcore.layers\nrtpcore.layers.fast_path = 1\ndel rtpcore.layers.causal_mask\n"
    outcome, _ = _load(plugin_env, "pt-add-del", body)
    assert outcome.error.patches == (("rtpcore.layers", "causal_mask", "deleted"), ("rtpcore.layers", "fast_path", "added"))
    assert rtpcore.layers.causal_mask is had and not hasattr(rtpcore.layers, "fast_path")


def test_importing_rtpcore_modules_without_changing_them_is_not_a_patch(plugin_env: PluginEnv) -> None:
    """Imports bind submodules on their packages, lazy names resolve, registries fill: none is a patch."""
    body = "import rtpcore.kv, rtpcore.engine.sample.grammar, rtpcore.checkpoint\nrtpcore.kv.make_codec\n"
    outcome, registry = _load(plugin_env, "pt-clean", body)
    assert outcome.state == "loaded", outcome.error
    assert "pt_model" in registry.model_types()


def test_a_module_the_plugin_imports_first_is_checked_too(plugin_env: PluginEnv) -> None:
    """In a fresh process (``plugins check``) rtpcore.checkpoint.hub is first imported by the
    plugin itself, which then patches it: the snapshot taken as its import finished catches it."""
    body = "import rtpcore.checkpoint.hub as hub\nhub.hub_id = lambda *a, **k: None\n"
    source = body + "\n" + hooks_source(MODEL)
    plugin_env.add_dist("pt-first", "1.0", plugins={"pt_first": "pt_first_hooks"},
                        modules={"pt_first_hooks.py": source})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_env.site), os.environ.get("PYTHONPATH", "")])}
    probe = subprocess.run([sys.executable, "-c", "import sys, rtpcore.plugins.loading; "
                            "print('rtpcore.checkpoint.hub' in sys.modules)"], env=env, capture_output=True, text=True)
    assert probe.stdout.strip() == "False"  # the loader itself does not import it
    proc = subprocess.run([sys.executable, "-m", "rtpcore", "plugins", "check", "pt-first"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "FAIL  pt-first: patches:" in proc.stdout and "rtpcore.checkpoint.hub.hub_id replaced" in proc.stdout, proc.stdout


@pytest.mark.parametrize("at_import", [True, False])
def test_a_plugin_that_fails_after_patching_leaves_rtpcore_as_it_was(plugin_env: PluginEnv, at_import: bool) -> None:
    original = rtpcore.layers.Linear
    body = "import rtpcore.layers\nrtpcore.layers.Linear = None\nraise RuntimeError('boom')\n"
    outcome, _ = _load(plugin_env, f"pt-fail-{int(at_import)}", body, at_import=at_import)
    assert outcome.state == ("import-failed" if at_import else "invalid"), outcome.error
    assert rtpcore.layers.Linear is original


def test_allow_plugin_patches_accepts_one_plugins_changes_logged_and_listed(
    plugin_env: PluginEnv, caplog: pytest.LogCaptureFixture
) -> None:
    """The operator's override: the named plugin loads with its change kept (and logged, and
    listed by `plugins list`); another plugin's patch is still refused."""
    original = rtpcore.layers.row_parallel
    body = "import rtpcore.layers\nrtpcore.layers.row_parallel = print\n"
    for dist in ("pt-allowed", "pt-other"):
        name = dist.replace("-", "_")
        plugin_env.add_dist(dist, "1.0", plugins={name: f"{name}_hooks"},
                            modules={f"{name}_hooks.py": body + "\n" + hooks_source(
                                (f"M{name}", name, (f"{name}LM",)))})
    try:
        with caplog.at_level("WARNING", logger="rtpcore.plugins.loading"):
            report = load_report(Allowlist.from_cli(plugins=["pt-allowed"], allow_plugin_patches=["pt-allowed"]).resolve())
        (outcome,) = report.outcomes
        assert outcome.state == "loaded" and outcome.patches == (("rtpcore.layers", "row_parallel", "replaced"),)
        assert "pt_allowed" in report.registry.model_types()
        assert rtpcore.layers.row_parallel is print  # kept, as accepted
        assert "accepted by --allow-plugin-patches: rtpcore.layers.row_parallel replaced" in caplog.text
    finally:
        rtpcore.layers.row_parallel = original
    (other,) = load_report(Allowlist.from_cli(plugins=["pt-other"], allow_plugin_patches=["pt-allowed"]).resolve()).outcomes
    assert other.state == "patches" and "--allow-plugin-patches pt_other" in str(other.error)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_env.site), os.environ.get("PYTHONPATH", "")])}
    listed = subprocess.run([sys.executable, "-m", "rtpcore", "plugins", "list", "--plugins", "pt-allowed",
                             "--allow-plugin-patches", "pt-allowed", "--requested-only"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0, listed.stderr
    assert "patches accepted by --allow-plugin-patches: rtpcore.layers.row_parallel replaced" in listed.stdout


@pytest.mark.parametrize(("requires", "state"), [
    (("rtpcore>=99",), "incompatible"),
    (("torch", "rtpcore<0.0.1"), "incompatible"),
    (("rtpcore>=0.1",), "loaded"),
    (("rtpcore>=99; extra == 'test'",), "loaded"),  # a test extra's requirement is not the plugin's
])
def test_requires_dist_rtpcore_is_checked_before_any_plugin_code_runs(
    plugin_env: PluginEnv, requires: tuple[str, ...], state: str
) -> None:
    """docs/design.md §18: a plugin written for another rtpcore is `incompatible`, and its
    module never runs (it would raise)."""
    source = "raise RuntimeError('the plugin ran')\n" if state == "incompatible" else hooks_source(MODEL)
    plugin_env.add_dist("pt-req", "1.0", plugins={"pt_req": "pt_req_hooks"},
                        modules={"pt_req_hooks.py": source}, requires=requires)
    (outcome,) = load_report(Allowlist.from_cli(plugins=["pt-req"]).resolve()).outcomes
    assert outcome.state == state, outcome.error
    if state == "incompatible":
        assert isinstance(outcome.error, PluginIncompatibleError)
        assert f"requires {requires[-1]!r}, and this is rtpcore " in str(outcome.error)
        assert "pt_req_hooks" not in sys.modules

"""load_plugins against real dist-info folders and real modules: every outcome of docs/design.md §3."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from plugin_env import HOOKS_HEADER, PluginEnv, hooks_source, model_source
from rtpcore import Allowlist, Plan, load_plugins
from rtpcore.errors import (
    PluginConflictError,
    PluginLoadError,
    PluginNotFoundError,
    PluginVersionError,
)
from rtpcore.plugins.loading import load_report


def _plan(*items: str, modules: tuple[str, ...] = (), strict: bool = True) -> Plan:
    return Allowlist.from_cli(plugins=items, external_model_packages=modules).resolve(strict=strict)


def test_a_plugin_registers_its_models_beside_the_builtins(plugin_env: PluginEnv) -> None:
    """The plugin's model is found by architecture; the built-in llama is registered lazily."""
    plugin_env.add_dist(
        "ld-a",
        "1.0",
        plugins={"lda": "ld_a.hooks"},
        modules={"ld_a/hooks.py": hooks_source(("A", "ld_a_model", ("LdAForCausalLM",)))},
    )
    registry = load_plugins(_plan("ld-a"))
    assert registry.infer_model_type({"architectures": ["LdAForCausalLM"]}) == "ld_a_model"
    assert registry.get("ld_a_model").__module__ == "ld_a.hooks"
    assert registry.record("ld_a_model").provider.distribution == "ld-a"
    assert registry.infer_model_type({"architectures": ["LlamaForCausalLM"]}) == "llama"
    assert registry.record("llama").provider.builtin
    assert registry.record("llama").target == "rtpcore.models.llama:LlamaPlugin"


def test_a_disallowed_plugin_whose_import_would_raise_is_never_imported(
    plugin_env: PluginEnv, tmp_path: Path
) -> None:
    """Only the allowed plugin's module runs; the other one's would raise and write a marker."""
    marker = tmp_path / "imported"
    plugin_env.add_dist(
        "ld-ok",
        plugins={"ok": "ld_ok"},
        modules={"ld_ok.py": hooks_source(("Ok", "ld_ok", ("LdOk",)))},
    )
    plugin_env.add_dist(
        "ld-evil",
        plugins={"evil": "ld_evil"},
        modules={
            "ld_evil.py": f"open({str(marker)!r}, 'w').close()\nraise SystemExit('evil imported')\n"
        },
    )
    report = load_report(_plan("ld-ok"))
    assert [o.state for o in report.outcomes] == ["loaded"]
    assert not marker.exists()
    assert "ld_evil" not in sys.modules


def test_a_missing_dependency_is_import_failed_naming_plugin_distribution_version_and_entry_point(
    plugin_env: PluginEnv,
) -> None:
    """The message names all four and the missing module; the cause is chained; no sys.path dump."""
    plugin_env.add_dist(
        "ld-dep",
        "0.7",
        plugins={"dep": "ld_dep.hooks"},
        modules={"ld_dep/hooks.py": "import ld_dep_missing_dependency\n"},
    )
    with pytest.raises(PluginLoadError) as excinfo:
        load_plugins(_plan("ld-dep"))
    error = excinfo.value
    message = str(error)
    assert (error.state, error.plugin, error.distribution, error.version, error.entry_point) == (
        "import-failed",
        "dep",
        "ld-dep",
        "0.7",
        "ld_dep.hooks",
    )
    for text in ("'dep'", "'ld-dep'", "0.7", "'ld_dep.hooks'", "'ld_dep_missing_dependency'"):
        assert text in message
    assert isinstance(error.__cause__, ModuleNotFoundError)
    assert str(plugin_env.site) not in message and "sys.path" not in message
    assert "\n" not in message


def test_an_entry_point_naming_a_missing_attribute_is_import_failed(plugin_env: PluginEnv) -> None:
    """'module:nope' fails with the AttributeError chained."""
    plugin_env.add_dist("ld-attr", plugins={"attr": "ld_attr:nope"}, modules={"ld_attr.py": ""})
    with pytest.raises(PluginLoadError, match="AttributeError") as excinfo:
        load_plugins(_plan("ld-attr"))
    assert isinstance(excinfo.value.__cause__, AttributeError)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            HOOKS_HEADER + "def rtpcore_register_models(registry):\n    pass\n",
            "must be decorated with @rtpcore.hookimpl",
        ),
        ("x = 1\n", "defines no rtpcore hook implementations"),
        (
            HOOKS_HEADER + "@hookimpl\ndef rtpcore_register_model(registry):\n    pass\n",
            "unknown hook 'rtpcore_register_model'; did you mean 'rtpcore_register_models'?",
        ),
        (  # misspelled and undecorated, beside a real hook: never silently ignored
            HOOKS_HEADER
            + "@hookimpl\ndef rtpcore_register_models(registry):\n    pass\n"
            + "def rtpcore_kv_cache_layout():\n    return []\n",
            "'rtpcore_kv_cache_layout' is not an rtpcore hook; did you mean 'rtpcore_kv_cache_layouts'?",
        ),
        (  # a real hook's name, undecorated, beside a decorated one
            HOOKS_HEADER
            + "@hookimpl\ndef rtpcore_register_models(registry):\n    pass\n"
            + "def rtpcore_kv_cache_layouts():\n    return []\n",
            "rtpcore_kv_cache_layouts must be decorated with @rtpcore.hookimpl",
        ),
        (
            HOOKS_HEADER + "@hookimpl\ndef rtpcore_register_models(registri):\n    pass\n",
            "registri",
        ),
        (
            HOOKS_HEADER
            + "@hookimpl\ndef rtpcore_register_models(registry):\n    raise KeyError('boom')\n",
            "raised KeyError",
        ),
        (
            HOOKS_HEADER + "class Bad(ModelPlugin):\n    model_type = 'bad'\n"
            "@hookimpl\ndef rtpcore_register_models(registry):\n    registry.register(Bad)\n",
            "architectures is not set",
        ),
        (
            HOOKS_HEADER + "@hookimpl\ndef rtpcore_kv_cache_layouts():\n    return 'padded'\n",
            "must return a list",
        ),
    ],
)
def test_invalid_hooks_are_state_invalid(plugin_env: PluginEnv, source: str, message: str) -> None:
    """Undecorated, missing, misnamed, mis-signed, raising or invalid-registering hooks: invalid."""
    plugin_env.add_dist("ld-inv", "1.1", plugins={"inv": "ld_inv"}, modules={"ld_inv.py": source})
    with pytest.raises(PluginLoadError) as excinfo:
        load_plugins(_plan("ld-inv"))
    assert excinfo.value.state == "invalid"
    assert message in str(excinfo.value)
    assert "ld-inv 1.1" in str(excinfo.value)


def test_a_hook_that_fails_halfway_leaves_no_registration(plugin_env: PluginEnv) -> None:
    """The model registered before the hook raised is not in the registry."""
    source = (
        hooks_source(("Half", "half", ("HalfForCausalLM",)))
        + "    raise RuntimeError('second thoughts')\n"
    )
    plugin_env.add_dist("ld-half", plugins={"half": "ld_half"}, modules={"ld_half.py": source})
    report = load_report(_plan("ld-half"))
    assert report.outcomes[0].state == "invalid"
    assert "half" not in report.registry.model_types()
    assert "llama" in report.registry.model_types()


def test_two_distributions_claiming_one_architecture_conflict_naming_both(
    plugin_env: PluginEnv,
) -> None:
    """The second plugin's registration raises PluginConflictError naming both providers."""
    for dist, module, cls in (("ld-one", "ld_one", "One"), ("ld-two", "ld_two", "Two")):
        plugin_env.add_dist(
            dist,
            "1.0",
            plugins={module: module},
            modules={f"{module}.py": hooks_source((cls, module, ("SharedForCausalLM",)))},
        )
    with pytest.raises(PluginConflictError) as excinfo:
        load_plugins(_plan("ld-one", "ld-two"))
    assert excinfo.value.state == "conflict"
    assert "ld-one 1.0" in str(excinfo.value) and "ld-two 1.0" in str(excinfo.value)
    assert "'SharedForCausalLM'" in str(excinfo.value)


def test_layouts_from_plugins_are_selectable(plugin_env: PluginEnv) -> None:
    """A plugin's rtpcore_kv_cache_layouts result is found by name."""
    extra = """
    class L:
        name = "ld_layout"
        def regions(self, kv_lora_rank, rope_head_dim):
            return [("nope", "fp8_e4m3", kv_lora_rank), ("rope", "bf16", rope_head_dim)]

    @hookimpl
    def rtpcore_kv_cache_layouts():
        return [L()]
    """
    plugin_env.add_dist(
        "ld-lay", plugins={"lay": "ld_lay"}, modules={"ld_lay.py": hooks_source(extra=extra)}
    )
    registry = load_plugins(_plan("ld-lay"))
    assert registry.get_layout("ld_layout").name == "ld_layout"
    assert registry.layout_names() == ["compact", "ld_layout", "padded"]


def test_the_first_failure_wins_and_nothing_after_it_is_imported(plugin_env: PluginEnv) -> None:
    """A failing first plugin stops loading; load_report still loads the second."""
    plugin_env.add_dist(
        "ld-bad", plugins={"bad": "ld_bad"}, modules={"ld_bad.py": "raise ImportError('nope')\n"}
    )
    plugin_env.add_dist(
        "ld-next",
        plugins={"next": "ld_next"},
        modules={"ld_next.py": hooks_source(("N", "ld_next", ("LdNext",)))},
    )
    with pytest.raises(PluginLoadError):
        load_plugins(_plan("ld-bad", "ld-next"))
    assert "ld_next" not in sys.modules
    report = load_report(_plan("ld-bad", "ld-next"))
    assert [(o.request, o.state) for o in report.outcomes] == [
        ("ld-bad", "import-failed"),
        ("ld-next", "loaded"),
    ]
    assert report.outcomes[1].models == ("ld_next",)


def test_resolution_failures_are_raised_before_any_import(plugin_env: PluginEnv) -> None:
    """A non-strict plan with a missing item raises PluginNotFoundError from load_plugins first."""
    plugin_env.add_dist(
        "ld-first", plugins={"first": "ld_first"}, modules={"ld_first.py": hooks_source()}
    )
    with pytest.raises(PluginNotFoundError):
        load_plugins(_plan("ld-first", "ld-absent", strict=False))
    assert "ld_first" not in sys.modules


def test_a_version_changed_after_resolution_is_refused(plugin_env: PluginEnv) -> None:
    """An upgrade between resolve() and load_plugins() is PluginVersionError, nothing imported."""
    info = plugin_env.add_dist(
        "ld-up", "1.0", plugins={"up": "ld_up"}, modules={"ld_up.py": hooks_source()}
    )
    plan = _plan("ld-up")
    plugin_env.set_version(info, "1.1")
    with pytest.raises(PluginVersionError, match=r"finds version 1\.1") as excinfo:
        load_plugins(plan)
    assert excinfo.value.version == "1.0"
    assert "ld_up" not in sys.modules


def test_an_entry_point_with_an_object_and_extras_is_imported(plugin_env: PluginEnv) -> None:
    """'module:Outer.Hooks [extra]' imports module, follows the attributes, ignores extras."""
    source = (
        HOOKS_HEADER
        + model_source("X", "ld_x", ("LdX",))
        + "class Outer:\n    class Hooks:\n        @staticmethod\n        @hookimpl\n"
        + "        def rtpcore_register_models(registry):\n            registry.register(X)\n"
    )
    value = "ld_x_mod:Outer.Hooks [fast]"
    plugin_env.add_dist("ld-x", plugins={"x": value}, modules={"ld_x_mod.py": source})
    assert load_plugins(_plan("ld-x")).record("ld_x").provider.module == value


def test_an_external_module_is_loaded_like_a_plugin(plugin_env: PluginEnv) -> None:
    """--external-model-packages modules are registered under their dotted path."""
    plugin_env.add_module("ld_ext/hooks.py", hooks_source(("E", "ld_ext", ("LdExt",))))
    registry = load_plugins(_plan(modules=("ld_ext.hooks",)))
    assert registry.record("ld_ext").provider.plugin == "ld_ext.hooks"
    assert registry.record("ld_ext").provider.distribution is None


def test_one_module_named_twice_is_loaded_once(plugin_env: PluginEnv) -> None:
    """A plugin's module also given as an external module is registered once."""
    plugin_env.add_dist(
        "ld-both",
        plugins={"both": "ld_both"},
        modules={"ld_both.py": hooks_source(("B", "ld_both", ("LdBoth",)))},
    )
    report = load_report(_plan("ld-both", modules=("ld_both",)))
    assert [o.state for o in report.outcomes] == ["loaded", "loaded"]
    assert report.registry.model_types() == ["ld_both", "llama"]


def test_a_plugin_requested_twice_is_loaded_once_and_reported_twice(plugin_env: PluginEnv) -> None:
    """'ld-dup' and its entry-point name 'dup' plan one entry; both requests get its outcome."""
    plugin_env.add_dist(
        "ld-dup",
        plugins={"dup": "ld_dup"},
        modules={"ld_dup.py": hooks_source(("D", "ld_dup", ("LdDup",)))},
    )
    plan = _plan("ld-dup", "dup")
    assert [e.name for e in plan.entries] == ["dup"]
    report = load_report(plan)
    assert [(o.request, o.state, o.models) for o in report.outcomes] == [
        ("ld-dup", "loaded", ("ld_dup",)),
        ("dup", "loaded", ("ld_dup",)),
    ]


def test_sixteen_threads_load_once(plugin_env: PluginEnv) -> None:
    """16 threads calling load_plugins with one plan share one registry; the plugin runs once."""
    counter = "import builtins\nbuiltins.__dict__.setdefault('_ld_counts', []).append('import')\n"
    source = (
        counter
        + hooks_source(("T", "ld_thr", ("LdThr",)))
        + "    builtins._ld_counts.append('hook')\n"
    )
    plugin_env.add_dist("ld-thr", plugins={"thr": "ld_thr"}, modules={"ld_thr.py": source})
    plan = _plan("ld-thr")
    barrier = threading.Barrier(16)
    results: list[object] = []

    def worker() -> None:
        barrier.wait()
        results.append(load_plugins(plan))

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    import builtins

    try:
        assert builtins._ld_counts == ["import", "hook"]  # type: ignore[attr-defined]
    finally:
        del builtins._ld_counts  # type: ignore[attr-defined]
    assert len(results) == 16 and all(r is results[0] for r in results)


def test_a_failure_is_remembered_and_not_retried(plugin_env: PluginEnv, tmp_path: Path) -> None:
    """Calling load_plugins again with a failing plan raises again without re-importing."""
    log = tmp_path / "log"
    plugin_env.add_dist(
        "ld-once",
        plugins={"once": "ld_once"},
        modules={
            "ld_once.py": f"with open({str(log)!r}, 'a') as f:\n    f.write('x')\nraise ImportError('no')\n"
        },
    )
    plan = _plan("ld-once")
    for _ in range(3):
        with pytest.raises(PluginLoadError):
            load_plugins(plan)
    assert log.read_text() == "x"


def test_load_plugins_refuses_anything_but_a_plan() -> None:
    """Passing the allowlist instead of its plan is a TypeError naming the fix."""
    with pytest.raises(TypeError, match=r"Allowlist.resolve\(\)"):
        load_plugins(Allowlist.from_cli())  # type: ignore[arg-type]


def _lazy_source(target: str, model_type: str, arch: str, replaces: tuple[str, ...] = ()) -> str:
    return (
        "from rtpcore import hookimpl\n\n@hookimpl\ndef rtpcore_register_models(registry):\n"
        f"    registry.register({target!r}, model_type={model_type!r}, architectures=({arch!r},),"
        f" replaces={replaces!r})\n"
    )


def _lazy_dist_without_contract(plugin_env: PluginEnv, dist: str, version: str, plugin: str, arch: str) -> None:
    """Distribution ``dist`` whose plugin ``plugin`` registers ``ld_<plugin>_m:M`` (model type
    ``plugin``, serving ``arch``) lazily; M states no forward_contract."""
    plugin_env.add_dist(
        dist,
        version,
        plugins={plugin: f"ld_{plugin}_hooks"},
        modules={
            f"ld_{plugin}_hooks.py": _lazy_source(f"ld_{plugin}_m:M", plugin, arch),
            f"ld_{plugin}_m.py": "from rtpcore import ModelPlugin\n" + model_source("M", plugin, (arch,), contract=None),
        },
    )


def test_import_models_refuses_a_lazy_class_before_anything_is_registered(
    plugin_env: PluginEnv,
) -> None:
    """Without import_models a lazy class without forward_contract is 'registered' (not
    imported); with it the plugin is 'invalid' and none of its registrations is applied."""
    _lazy_dist_without_contract(plugin_env, "ld-lazyfc", "2.0", "lazyfc", "LazyFcForCausalLM")
    lazy = load_report(_plan("ld-lazyfc"))
    assert [(o.state, o.unimported) for o in lazy.outcomes] == [("registered", ("ld_lazyfc_m:M",))]
    assert lazy.ok and "ld_lazyfc_m" not in sys.modules
    checked = load_report(_plan("ld-lazyfc"), import_models=True)
    (outcome,) = checked.outcomes
    assert outcome.state == "invalid" and not checked.ok
    assert "lazyfc" not in checked.registry.model_types()
    assert isinstance(outcome.error, PluginLoadError)
    assert (outcome.error.plugin, outcome.error.distribution) == ("lazyfc", "ld-lazyfc")
    assert "ld_lazyfc_m:M is invalid: it does not state forward_contract" in str(outcome.error)


def test_the_engine_refuses_a_class_that_states_no_forward_contract(
    plugin_env: PluginEnv, tmp_path: Path
) -> None:
    """Engine.from_pretrained on a checkpoint the lazy class serves fails before reading a
    weight, naming the plugin and the class, and never says the class stated a contract."""
    from rtpcore import FORWARD_CONTRACT, Engine

    _lazy_dist_without_contract(plugin_env, "ld-engfc", "2.1", "engfc", "EngFcForCausalLM")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text('{"architectures": ["EngFcForCausalLM"]}')
    with pytest.raises(PluginLoadError) as excinfo:
        Engine.from_pretrained(str(tmp_path / "ckpt"), plugins=["ld-engfc"], device="cpu")
    message = str(excinfo.value)
    assert excinfo.value.state == "invalid" and excinfo.value.distribution == "ld-engfc"
    assert "plugin 'engfc' (ld-engfc 2.1" in message and "ld_engfc_m:M" in message
    assert (
        f"does not state forward_contract; this rtpcore runs {FORWARD_CONTRACT} "
        f"(set `forward_contract = {FORWARD_CONTRACT}` on the class)"
    ) in message
    assert "states forward_contract=" not in message


def test_a_model_type_conflict_with_the_builtin_is_fixed_by_following_its_advice(
    plugin_env: PluginEnv,
) -> None:
    """Claiming the built-in model type 'llama' is a conflict naming rtpcore's own version and
    telling to list 'llama' in `replaces`; the same plugin with that done takes 'llama' over."""
    from rtpcore.plugins.loading import builtin_version

    plugin_env.add_dist(
        "ld-mt-before",
        "1.0",
        plugins={"mtb": "ld_mtb_hooks"},
        modules={
            "ld_mtb_hooks.py": _lazy_source("ld_mtb_m:M", "llama", "MyLlamaForCausalLM"),
            "ld_mtb_m.py": "from rtpcore import ModelPlugin\n"
            + model_source("M", "llama", ("MyLlamaForCausalLM",)),
        },
    )
    with pytest.raises(PluginConflictError) as excinfo:
        load_plugins(_plan("ld-mt-before"))
    message = str(excinfo.value)
    assert f"built-in plugin 'rtpcore.models' (rtpcore {builtin_version()}, " in message
    assert "None" not in message and builtin_version() != "unknown"
    advice = "list 'llama' in the plugin's `replaces`"
    assert advice in message
    # Following it literally: the lazy registration and the class both list 'llama'.
    plugin_env.add_dist(
        "ld-mt-after",
        "1.0",
        plugins={"mta": "ld_mta_hooks"},
        modules={
            "ld_mta_hooks.py": _lazy_source(
                "ld_mta_m:M", "llama", "MyLlamaForCausalLM", replaces=("llama",)
            ),
            "ld_mta_m.py": "from rtpcore import ModelPlugin\n"
            + model_source("M", "llama", ("MyLlamaForCausalLM",), replaces=("llama",)),
        },
    )
    report = load_report(_plan("ld-mt-after"), import_models=True)
    assert [o.state for o in report.outcomes] == ["loaded"], report.outcomes[0].error
    registry = report.registry
    assert registry.record("llama").provider.distribution == "ld-mt-after"
    assert registry.infer_model_type({"architectures": ["MyLlamaForCausalLM"]}) == "llama"
    assert registry.get("llama").__module__ == "ld_mta_m"

"""ModelRegistry rules: validation, no-op repeats, built-ins, replaces, conflicts, atomicity, lazy
registrations, inference and KV layouts."""

from __future__ import annotations

import logging
import sys
from typing import Any

import pytest

from plugin_env import PluginEnv, model_source
from rtpcore import FORWARD_CONTRACT, ModelPlugin, ModelRegistry
from rtpcore.errors import (
    PluginConflictError,
    PluginLoadError,
    UnknownArchitectureError,
    UnknownModelTypeError,
)
from rtpcore.plugins.registry import Provider
from rtpcore.plugins.spelling import command_line

BUILTIN = Provider(
    plugin="rtpcore.models", module="rtpcore.models", distribution="rtpcore", builtin=True
)
ALPHA = Provider(plugin="alpha", module="alpha_pkg.hooks", distribution="alpha-dist", version="1.0")
BETA = Provider(plugin="beta", module="beta_pkg.hooks", distribution="beta-dist", version="2.0")


class Base(ModelPlugin):
    forward_contract = FORWARD_CONTRACT
    @classmethod
    def config_from_hf(cls, hf_config: Any) -> Any:
        return hf_config

    @classmethod
    def weight_patterns(cls, config: Any) -> list[str]:
        return []

    @classmethod
    def kv_cache_descs(cls, config: Any, **options: Any) -> list[Any]:
        return []

    @classmethod
    def build_model(cls, config: Any, weights: Any, **options: Any) -> Any:
        return None


class Llamaish(Base):
    model_type = "llamaish"
    architectures = ("LlamaishForCausalLM", "OtherForCausalLM")


class Fast(Llamaish):
    model_type = "fast_llamaish"
    architectures = ("LlamaishForCausalLM",)
    replaces = ("LlamaishForCausalLM",)


class Greedy(Llamaish):
    model_type = "greedy"
    architectures = ("LlamaishForCausalLM",)


class Solo(Base):
    model_type = "solo"
    architectures = ("SoloForCausalLM",)


class Layout:
    def __init__(self, name: str) -> None:
        self.name = name

    def regions(self, kv_lora_rank: int, rope_head_dim: int) -> list[tuple[str, str, int]]:
        return [("nope", "fp8_e4m3", kv_lora_rank), ("rope", "bf16", rope_head_dim)]


def _commit(
    registry: ModelRegistry, provider: Provider, *targets: Any, layouts: list[Any] | None = None
) -> None:
    view = registry.recording(provider)
    for target in targets:
        view.register(target)
    view.add_layouts(layouts)
    registry.commit(view)


def test_a_registered_class_is_found_by_model_type_and_architecture() -> None:
    """get() returns the class; every listed architecture infers its model_type; provenance is kept."""
    registry = ModelRegistry()
    _commit(registry, ALPHA, Llamaish)
    assert registry.get("llamaish") is Llamaish
    assert registry.infer_model_type({"architectures": ["OtherForCausalLM"]}) == "llamaish"
    assert registry.record("llamaish").provider == ALPHA
    assert "alpha-dist 1.0" in str(registry.record("llamaish").provider)


def test_registering_the_identical_class_again_is_a_no_op() -> None:
    """The same class from the same or another plugin changes nothing."""
    registry = ModelRegistry()
    _commit(registry, ALPHA, Llamaish, Llamaish)
    _commit(registry, BETA, Llamaish)
    assert registry.record("llamaish").provider == ALPHA


def test_builtins_only_fill_empty_slots() -> None:
    """A built-in registered after an external plugin leaves its architecture alone."""
    registry = ModelRegistry()
    _commit(registry, ALPHA, Greedy)
    _commit(registry, BUILTIN, Llamaish)
    assert registry.architectures() == {
        "LlamaishForCausalLM": "greedy",
        "OtherForCausalLM": "llamaish",
    }


def test_an_external_plugin_takes_a_builtin_architecture_only_through_replaces(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With replaces the takeover is logged; the built-in keeps its other architectures."""
    registry = ModelRegistry()
    _commit(registry, BUILTIN, Llamaish)
    with caplog.at_level(logging.INFO, logger="rtpcore.plugins.registry"):
        _commit(registry, ALPHA, Fast)
    assert registry.infer_model_type({"architectures": ["LlamaishForCausalLM"]}) == "fast_llamaish"
    assert registry.record("llamaish").architectures == ("OtherForCausalLM",)
    assert "replaces the built-in" in caplog.text


def test_claiming_a_builtin_architecture_without_replaces_is_a_conflict() -> None:
    """The error names the built-in and the plugin and tells how to take it over."""
    registry = ModelRegistry()
    _commit(registry, BUILTIN, Llamaish)
    with pytest.raises(PluginConflictError) as excinfo:
        _commit(registry, ALPHA, Greedy)
    message = str(excinfo.value)
    assert "'LlamaishForCausalLM'" in message and "replaces" in message
    assert "rtpcore.models" in message and "alpha-dist 1.0" in message
    assert excinfo.value.state == "conflict" and excinfo.value.distribution == "alpha-dist"


def test_two_external_providers_of_one_architecture_conflict_naming_both() -> None:
    """Both distributions, versions and modules appear in the message and in .providers."""
    registry = ModelRegistry()
    _commit(registry, ALPHA, Llamaish)
    with pytest.raises(PluginConflictError) as excinfo:
        _commit(registry, BETA, Greedy)
    for text in ("alpha-dist 1.0", "alpha_pkg.hooks", "beta-dist 2.0", "beta_pkg.hooks"):
        assert text in str(excinfo.value)
    assert len(excinfo.value.providers) == 2


def test_two_external_providers_of_one_model_type_conflict() -> None:
    """A different class under a taken model_type is a conflict."""

    class Impostor(Solo):
        architectures = ("ImpostorForCausalLM",)

    registry = ModelRegistry()
    _commit(registry, ALPHA, Solo)
    with pytest.raises(PluginConflictError, match="model_type 'solo'"):
        _commit(registry, BETA, Impostor)


def test_a_failing_plugin_leaves_no_registration_behind() -> None:
    """A conflict on the second model undoes the first model of the same plugin."""
    registry = ModelRegistry()
    _commit(registry, ALPHA, Llamaish)
    with pytest.raises(PluginConflictError):
        _commit(registry, BETA, Solo, Greedy)
    assert registry.model_types() == ["llamaish"]


def test_one_plugin_registering_a_model_type_twice_is_invalid() -> None:
    """Two classes with one model_type in one plugin is state invalid."""

    class Twin(Llamaish):
        architectures = ("TwinForCausalLM",)

    view = ModelRegistry().recording(ALPHA)
    view.register(Llamaish)
    with pytest.raises(PluginLoadError) as excinfo:
        view.register(Twin)
    assert excinfo.value.state == "invalid"
    assert "registered twice" in str(excinfo.value)


class _NoArchs(Base):
    model_type = "x"


class _StringArchs(Base):
    model_type = "x"
    architectures = "XForCausalLM"  # type: ignore[assignment]


class _BadReplaces(Base):
    model_type = "x"
    architectures = ("XForCausalLM",)
    replaces = ("YForCausalLM",)


class _NoContract(ModelPlugin):
    model_type = "x"
    architectures = ("XForCausalLM",)
    config_from_hf = Base.config_from_hf
    weight_patterns = Base.weight_patterns
    kv_cache_descs = Base.kv_cache_descs
    build_model = Base.build_model


class _OldContract(Base):
    model_type = "x"
    architectures = ("XForCausalLM",)
    forward_contract = 1


class _TextContract(Base):
    model_type = "x"
    architectures = ("XForCausalLM",)
    forward_contract = "2"  # type: ignore[assignment]


class _Unimplemented(ModelPlugin):
    model_type = "x"
    architectures = ("XForCausalLM",)


class _InstanceMethod(Base):
    model_type = "x"
    architectures = ("XForCausalLM",)

    def build_model(self, config: Any, weights: Any, **options: Any) -> Any:  # type: ignore[override]
        return None


class _NotAPlugin:
    model_type = "x"
    architectures = ("XForCausalLM",)


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (_NoArchs, "architectures is not set"),
        (_StringArchs, "got the string 'XForCausalLM'"),
        (_BadReplaces, "'YForCausalLM', which is neither in architectures nor its model_type 'x'"),
        (
            _NoContract,
            "_NoContract is not a valid ModelPlugin: it does not state forward_contract; this "
            f"rtpcore runs {FORWARD_CONTRACT} (set `forward_contract = {FORWARD_CONTRACT}` on the class)",
        ),
        (_OldContract, f"it states forward_contract=1, but this rtpcore runs forward contract {FORWARD_CONTRACT}"),
        (_TextContract, "it states forward_contract='2', which is not an int"),
        (_Unimplemented, "config_from_hf is not implemented"),
        (_InstanceMethod, "build_model must be a classmethod, got function"),
        (_NotAPlugin, "does not subclass rtpcore.ModelPlugin"),
        (ModelPlugin, "cannot be registered"),
        (42, "takes a ModelPlugin subclass or a 'module:Class' string"),
        ("no_colon", "must be 'package.module:Class'"),
    ],
)
def test_an_invalid_model_is_refused_with_a_precise_message(target: Any, message: str) -> None:
    """Validation failures are PluginLoadError(state='invalid') naming the plugin."""
    with pytest.raises(PluginLoadError) as excinfo:
        ModelRegistry().recording(ALPHA).register(target)
    assert excinfo.value.state == "invalid"
    assert message in str(excinfo.value)
    assert "alpha-dist 1.0" in str(excinfo.value)


def test_a_lazy_registration_needs_model_type_and_architectures() -> None:
    """'module:Class' without model_type= or with a string architectures= is invalid."""
    view = ModelRegistry().recording(ALPHA)
    with pytest.raises(PluginLoadError, match="needs model_type="):
        view.register("m:C", architectures=("A",))
    with pytest.raises(PluginLoadError, match="needs architectures="):
        view.register("m:C", model_type="c", architectures="A")


def test_a_lazy_registration_imports_only_on_get(plugin_env: PluginEnv) -> None:
    """The module is imported by get(), validated, and cached."""
    plugin_env.add_module(
        "reg_lazy/models.py",
        "from rtpcore import ModelPlugin\n" + model_source("Lazy", "lazy", ("LazyForCausalLM",)),
    )
    registry = ModelRegistry()
    view = registry.recording(ALPHA)
    view.register("reg_lazy.models:Lazy", model_type="lazy", architectures=("LazyForCausalLM",))
    registry.commit(view)
    assert registry.infer_model_type({"architectures": ["LazyForCausalLM"]}) == "lazy"
    assert "reg_lazy.models" not in sys.modules
    cls = registry.get("lazy")
    assert cls.__name__ == "Lazy" and registry.get("lazy") is cls


def test_a_lazy_class_that_disagrees_with_its_registration_is_invalid(
    plugin_env: PluginEnv,
) -> None:
    """Registered as 'lazy2' but the class says 'other': invalid on get()."""
    plugin_env.add_module(
        "reg_lazy2.py", "from rtpcore import ModelPlugin\n" + model_source("Lazy", "other", ("L2",))
    )
    registry = ModelRegistry()
    view = registry.recording(ALPHA)
    view.register("reg_lazy2:Lazy", model_type="lazy2", architectures=("L2",))
    registry.commit(view)
    with pytest.raises(
        PluginLoadError, match="its model_type is 'other', registered as 'lazy2'"
    ) as excinfo:
        registry.get("lazy2")
    assert excinfo.value.state == "invalid"


def test_a_lazy_class_whose_import_fails_names_the_plugin(plugin_env: PluginEnv) -> None:
    """An ImportError on get() is import-failed with the plugin and the cause chained."""
    plugin_env.add_module("reg_lazy3.py", "import reg_lazy3_missing_dependency\n")
    registry = ModelRegistry()
    view = registry.recording(ALPHA)
    view.register("reg_lazy3:Model", model_type="lazy3", architectures=("L3",))
    registry.commit(view)
    with pytest.raises(PluginLoadError) as excinfo:
        registry.get("lazy3")
    assert excinfo.value.state == "import-failed"
    assert isinstance(excinfo.value.__cause__, ModuleNotFoundError)
    assert "alpha-dist 1.0" in str(excinfo.value) and "reg_lazy3_missing_dependency" in str(
        excinfo.value
    )


def test_a_subclass_of_a_plugin_with_its_own_model_type_registers_beside_it() -> None:
    """Subclassing a model with another model_type and architectures works."""

    class Derived(Llamaish):
        model_type = "derived"
        architectures = ("DerivedForCausalLM",)

    registry = ModelRegistry()
    _commit(registry, BUILTIN, Llamaish)
    _commit(registry, ALPHA, Derived)
    assert (
        registry.get(registry.infer_model_type({"architectures": ["DerivedForCausalLM"]}))
        is Derived
    )


def test_inference_looks_at_every_listed_architecture() -> None:
    """An unknown first architecture does not hide a known second one."""
    registry = ModelRegistry()
    _commit(registry, ALPHA, Solo)
    assert registry.infer_model_type({"architectures": ["Nope", "SoloForCausalLM"]}) == "solo"
    assert registry.infer_model_type({"model_type": "solo"}) == "solo"


def test_an_unknown_architecture_lists_the_known_ones_and_installed_hints(
    plugin_env: PluginEnv,
) -> None:
    """The hint names the installed plugin declaring the architecture and how to allow it:
    the Python API's argument, or under the command line the flag."""
    plugin_env.add_dist(
        "hint-dist",
        "0.3",
        plugins={"hinted": "hint_mod"},
        architectures={"HintForCausalLM": "hinted"},
    )
    registry = ModelRegistry()
    _commit(registry, ALPHA, Solo)
    with pytest.raises(UnknownArchitectureError) as excinfo:
        registry.infer_model_type({"architectures": ["HintForCausalLM"]})
    assert excinfo.value.known == ("SoloForCausalLM",)
    assert excinfo.value.hints == {
        "HintForCausalLM": ["plugin 'hinted' of hint-dist 0.3 (pass plugins=['hint-dist'])"]
    }
    assert "SoloForCausalLM" in str(excinfo.value) and "--plugins" not in str(excinfo.value)
    with command_line(), pytest.raises(UnknownArchitectureError) as excinfo:
        registry.infer_model_type({"architectures": ["HintForCausalLM"]})
    assert excinfo.value.hints == {
        "HintForCausalLM": ["plugin 'hinted' of hint-dist 0.3 (pass --plugins hint-dist)"]
    }
    with pytest.raises(UnknownModelTypeError, match="'solo'"):
        registry.get("nope")


def test_layouts_are_found_by_name_and_builtin_names_are_reserved() -> None:
    """get_layout returns the policy; layout_names includes the built-ins; 'padded' cannot be taken."""
    registry = ModelRegistry()
    mine = Layout("mine")
    _commit(registry, ALPHA, layouts=[mine])
    assert registry.get_layout("mine") is mine
    assert registry.get_layout("padded") is None and registry.get_layout("nope") is None
    assert registry.layout_names() == ["compact", "mine", "padded"]
    assert registry.layout_provider("mine") == ALPHA
    with pytest.raises(PluginConflictError, match="'padded' is built into rtpcore") as excinfo:
        _commit(registry, BETA, layouts=[Layout("padded")])
    assert excinfo.value.distribution == "beta-dist"


def test_one_layout_name_from_two_plugins_is_a_conflict_naming_both() -> None:
    """Duplicate layout names across plugins raise PluginConflictError with both providers."""
    registry = ModelRegistry()
    _commit(registry, ALPHA, layouts=[Layout("dup")])
    with pytest.raises(PluginConflictError) as excinfo:
        _commit(registry, BETA, Solo, layouts=[Layout("dup")])
    assert "alpha-dist 1.0" in str(excinfo.value) and "beta-dist 2.0" in str(excinfo.value)
    assert registry.model_types() == []  # atomic: Solo was not registered either


@pytest.mark.parametrize(
    ("policies", "message"),
    [
        ("x", "must return a list"),
        ([object()], "needs a name"),
        ([type("NoRegions", (), {"name": "n"})()], "no regions"),
        ([Layout("same"), Layout("same")], "returned twice"),
    ],
)
def test_a_bad_layout_result_is_invalid(policies: Any, message: str) -> None:
    """Layout hook results are validated: a list of objects with a name and regions()."""
    with pytest.raises(PluginLoadError, match=message):
        ModelRegistry().recording(ALPHA).add_layouts(policies)


def test_optional_classmethods_set_to_none_switch_their_capability_off() -> None:
    """A plugin that sets placeholder_ranges / weight_shapes / weight_dtypes / demo_config to
    None passes validation, and the engine reads them as switched off: no required index
    ranges, no shape checks, no dtype overrides, no demo."""
    from rtpcore.models.llama import LlamaPlugin
    from rtpcore.plugins.model_plugin import call_optional, model_plugin_problems

    class Bare(LlamaPlugin):
        model_type = "bare_llama"
        architectures = ("BareLlamaForCausalLM",)
        placeholder_ranges = None  # type: ignore[assignment]
        weight_shapes = None  # type: ignore[assignment]
        weight_dtypes = None  # type: ignore[assignment]
        demo_config = None  # type: ignore[assignment]

    assert model_plugin_problems(Bare) == []
    cfg = {"num_hidden_layers": 2}
    assert call_optional(Bare, "placeholder_ranges", cfg) == {}
    assert call_optional(Bare, "weight_shapes", cfg) == {}
    assert call_optional(Bare, "weight_dtypes", cfg) == {}
    assert call_optional(Bare, "demo_config") is None
    assert call_optional(LlamaPlugin, "placeholder_ranges", cfg) == {"layer": range(2)}

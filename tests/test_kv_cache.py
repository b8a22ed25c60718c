"""rtpcore.kv.specs: specs from a plugin's descriptors, layouts by name, errors with the layer tag."""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import pytest

from rtpcore.errors import KVCacheSpecError, PluginConflictError
from rtpcore.kv.specs import (
    build_specs,
    kv_cache_specs,
    layout_names,
    plan_blocks,
    resolve_kv_cache_dtype,
    summarize,
)
from rtpcore.plugins.model_plugin import FORWARD_CONTRACT, ModelPlugin
from rtpcore.plugins.registration import Provider
from rtpcore.plugins.registry import ModelRegistry
from rtpcore_native import Fp8LayoutPolicy, KVCacheSpecDesc


class Ue8m0(Fp8LayoutPolicy):
    name = "ue8m0"

    def regions(self, kv_lora_rank: int, rope_head_dim: int) -> list[tuple[str, str, int]]:
        return [
            ("nope", "fp8_e4m3", kv_lora_rank),
            ("nope_scale", "fp8_e8m0", kv_lora_rank // 128),
            ("rope", "bf16", rope_head_dim),
        ]


def registry_with(*policies: Any, plugin: str = "atom") -> ModelRegistry:
    """A real ModelRegistry holding ``policies`` as one plugin's registered layouts."""
    reg = ModelRegistry()
    view = reg.recording(
        Provider(
            plugin=plugin,
            module=f"{plugin}_plugin.layouts",
            distribution=f"{plugin}-plugin",
            version="0.1",
        )
    )
    view.add_layouts(list(policies))
    reg.commit(view)
    return reg


def mla(i: int, dtype: str = "fp8_e4m3", layout: str = "", rank: int = 512) -> KVCacheSpecDesc:
    return KVCacheSpecDesc(
        tag=f"layers.{i}",
        kind="mla",
        dtype=dtype,
        kv_lora_rank=rank,
        rope_head_dim=64,
        layout=layout,
    )


class TinyMLA(ModelPlugin):
    """Two fp8 MLA layers that pass the engine's options through to their descriptors."""

    model_type = "tiny_mla"
    architectures = ("TinyMLAForCausalLM",)
    forward_contract = FORWARD_CONTRACT
    seen: ClassVar[dict[str, Any]] = {}

    @classmethod
    def kv_cache_descs(cls, config: Any, **options: Any) -> list[KVCacheSpecDesc]:
        cls.seen = dict(options)
        layout = options.get("kv_layout") or "compact"
        return [
            KVCacheSpecDesc(
                tag=f"layers.{i}",
                kind="mla",
                dtype=options["kv_cache_dtype"],
                kv_lora_rank=config["rank"],
                rope_head_dim=64,
                tokens_per_block=options["tokens_per_block"],
                layout=layout,
            )
            for i in range(2)
        ]


def test_plugin_descriptors_become_specs_with_the_engine_options() -> None:
    """kv_cache_specs passes dtype ("fp8" resolved), layout and tokens_per_block to the plugin."""
    specs = kv_cache_specs(TinyMLA, {"rank": 512}, kv_cache_dtype="fp8", tokens_per_block=64)
    assert TinyMLA.seen == {"kv_cache_dtype": "fp8_e4m3", "kv_layout": None, "tokens_per_block": 64}
    assert [(s.tag, s.layout, s.bytes_per_token, s.block_bytes) for s in specs] == [
        ("layers.0", "compact", 576, 576 * 64),
        ("layers.1", "compact", 576, 576 * 64),
    ]


def test_kv_layout_overrides_the_plugins_choice_with_a_registered_layout() -> None:
    """kv_layout="ue8m0" from a registry replaces the plugin's "compact" on every fp8 MLA layer."""
    specs = kv_cache_specs(
        TinyMLA,
        {"rank": 512},
        kv_cache_dtype="fp8_e4m3",
        kv_layout="ue8m0",
        registry=registry_with(Ue8m0()),
    )
    assert {s.layout for s in specs} == {"ue8m0"}
    assert specs[0].bytes_per_token == 512 + 4 + 128


def test_override_applies_even_when_the_plugin_ignores_kv_layout() -> None:
    """build_specs rewrites fp8 MLA descriptors to the override and leaves other layers alone."""
    descs = [
        mla(0, layout="compact"),
        mla(1, "bf16"),
        KVCacheSpecDesc(tag="mha.2", kind="mha", dtype="fp8_e4m3", num_kv_heads=2, head_dim=64),
    ]
    specs = build_specs(descs, kv_layout="padded")
    assert [(s.layout, s.bytes_per_token) for s in specs] == [
        ("padded", 656),
        ("", 1152),
        ("", 2 * 128 + 16),
    ]


def test_layouts_are_found_by_name_across_built_ins_and_any_registry_like_object() -> None:
    """A descriptor naming a plugin layout finds it through get_layout(); built-ins need no registry."""

    class Layouts:
        def get_layout(self, name: str) -> Any:
            return Ue8m0() if name == "ue8m0" else None

        def layout_names(self) -> list[str]:
            return ["compact", "padded", "ue8m0"]

    specs = build_specs(
        [mla(0, layout="ue8m0"), mla(1, layout="padded"), mla(2)], registry=Layouts()
    )
    assert [s.layout for s in specs] == ["ue8m0", "padded", "padded"]
    assert layout_names(None) == ["compact", "padded"]
    assert layout_names(registry_with(Ue8m0())) == ["compact", "padded", "ue8m0"]


def test_duplicate_plugin_layout_names_are_a_conflict_naming_both_plugins() -> None:
    """Two plugins registering one layout name: PluginConflictError names both providers."""
    reg = registry_with(Ue8m0(), plugin="atom")
    view = reg.recording(
        Provider(
            plugin="other",
            module="other_plugin.layouts",
            distribution="other-plugin",
            version="2.0",
        )
    )
    view.add_layouts([Ue8m0()])
    with pytest.raises(PluginConflictError) as excinfo:
        reg.commit(view)
    assert "atom" in str(excinfo.value) and "other" in str(excinfo.value)
    assert len(excinfo.value.providers) == 2


def test_unknown_layout_names_list_the_known_ones() -> None:
    """An unknown override or descriptor layout is a KVCacheSpecError naming the choices."""
    with pytest.raises(
        KVCacheSpecError, match=r"unknown KV layout 'ue9m0'; known: 'compact', 'padded', 'ue8m0'"
    ):
        build_specs([mla(0)], kv_layout="ue9m0", registry=registry_with(Ue8m0()))
    with pytest.raises(
        KVCacheSpecError,
        match=r"layer 'layers.4': unknown KV layout 'ue8m0'; known: 'compact', 'padded'",
    ) as excinfo:
        build_specs([mla(4, layout="ue8m0")])
    assert excinfo.value.tag == "layers.4"


def test_native_errors_become_kv_cache_spec_errors_with_the_layer_tag() -> None:
    """A native ValueError (padded with rank 200) surfaces as KVCacheSpecError(.tag), cause chained."""
    with pytest.raises(KVCacheSpecError) as excinfo:
        build_specs([mla(0), mla(1, rank=256), mla(2, rank=200)])
    err = excinfo.value
    assert err.tag == "layers.2"
    assert "layer 'layers.2'" in str(err) and "kv_lora_rank=200 must be divisible by 128" in str(
        err
    )
    assert isinstance(err.__cause__, ValueError) and isinstance(err, ValueError)


def test_policy_errors_are_wrapped_too() -> None:
    """A registered policy that raises or returns no rope region fails as KVCacheSpecError."""

    class NoRope(Fp8LayoutPolicy):
        name = "norope"

        def regions(self, kv_lora_rank: int, rope_head_dim: int) -> list[tuple[str, str, int]]:
            return [("nope", "fp8_e4m3", kv_lora_rank)]

    with pytest.raises(KVCacheSpecError, match="has no 'rope' region") as excinfo:
        build_specs([mla(0, layout="norope")], registry=registry_with(NoRope()))
    assert excinfo.value.tag == "layers.0"


def test_bad_options_and_descriptors_are_kv_cache_spec_errors() -> None:
    """kv_layout on a model without fp8 MLA layers, non-descriptors, empty lists, plugin ValueErrors."""
    with pytest.raises(
        KVCacheSpecError,
        match=r"kv_layout='padded' selects an fp8 MLA layout, but m has no fp8 MLA layer \(kinds/dtypes: mla/bf16\)",
    ):
        build_specs([mla(0, "bf16")], kv_layout="padded", model_type="m")
    with pytest.raises(
        KVCacheSpecError, match=r"kv_cache_descs\(\)\[1\] must be a rtpcore_native.KVCacheSpecDesc"
    ):
        build_specs([mla(0), {"tag": "x"}])
    with pytest.raises(KVCacheSpecError, match="returned no descriptors"):
        build_specs([])
    with pytest.raises(
        KVCacheSpecError,
        match=r"tiny_mla: kv_cache_descs failed: .*kv_lora_rank must be a positive integer, got 0",
    ):
        kv_cache_specs(TinyMLA, {"rank": 0}, kv_cache_dtype="bf16")


def test_one_log_line_summarizes_the_layouts_of_a_model(caplog: pytest.LogCaptureFixture) -> None:
    """Building a model's specs logs exactly one INFO line with runs of equal layers."""
    with caplog.at_level(logging.INFO, logger="rtpcore.kv.specs"):
        build_specs([mla(0), mla(1), mla(2, "bf16")], model_type="deepseek_v3")
    lines = [r.getMessage() for r in caplog.records if r.name == "rtpcore.kv.specs"]
    assert lines == [
        "KV cache of deepseek_v3: 3 layers, 2 x mla fp8_e4m3 padded 656 B/token + 1 x mla bf16 1152 B/token; "
        f"{(2 * 656 + 1152) * 16} bytes per block across layers"
    ]


@pytest.mark.parametrize(
    ("requested", "model", "resolved"),
    [
        ("auto", "bfloat16", "bf16"),
        ("auto", "float32", "fp32"),
        ("fp8", "float32", "fp8_e4m3"),
        ("fp16", "bfloat16", "fp16"),
    ],
)
def test_kv_cache_dtype_resolution(requested: str, model: str, resolved: str) -> None:
    """The dtype "auto" follows the model's; "fp8" means e4m3."""
    assert resolve_kv_cache_dtype(requested, model) == resolved


def test_kv_cache_dtype_errors_list_the_choices() -> None:
    """Unknown kv_cache_dtype or model dtype is a KVCacheSpecError naming the valid values."""
    with pytest.raises(
        KVCacheSpecError, match=r"kv_cache_dtype='int8' is not one of 'auto', 'fp32'"
    ):
        resolve_kv_cache_dtype("int8")
    with pytest.raises(KVCacheSpecError, match=r"dtype='float64' is not one of"):
        resolve_kv_cache_dtype("auto", "float64")


def test_plan_blocks_wraps_native_errors() -> None:
    """plan_blocks counts blocks and turns a native ValueError into KVCacheSpecError."""
    specs = build_specs([mla(0), mla(1, "bf16")])
    assert plan_blocks(specs, 10 * (656 + 1152) * 16) == 10
    with pytest.raises(KVCacheSpecError, match="memory_bytes must be >= 0, got -5"):
        plan_blocks(specs, -5)
    assert summarize(specs).startswith(
        "2 layers, 1 x mla fp8_e4m3 padded 656 B/token + 1 x mla bf16"
    )


@pytest.mark.parametrize("dtype", ["fp32", "fp8_e4m3"])
def test_pools_sharing_a_gather_workspace_read_what_fresh_gathers_read_into_one_reused_buffer(dtype: str) -> None:
    """Two layers' pools with a GatherWorkspace return the same values as pools without one, and
    a later read lands in the same buffer (no fresh allocation per layer and step)."""
    import torch

    from rtpcore.kv.pools import GatherWorkspace, allocate_kv_caches
    from rtpcore_native import build_kv_cache_spec

    spec = build_kv_cache_spec(KVCacheSpecDesc(tag="l", kind="mha", dtype=dtype, num_kv_heads=2, head_dim=8,
                                               tokens_per_block=4))
    shared = allocate_kv_caches([spec, spec], 6, workspace=GatherWorkspace())
    fresh = allocate_kv_caches([spec, spec], 6)
    slots = torch.tensor([0, 1, 2, 5, 9, 13, 14, 20, 21])
    for pools in (shared, fresh):
        for layer, cache in enumerate(pools):
            g = torch.Generator().manual_seed(layer)
            cache.write(slots, torch.randn(9, 2, 8, generator=g), torch.randn(9, 2, 8, generator=g))
    tables = torch.tensor([[0, 1, 3], [5, 2, 0]])
    first = shared[0].read(tables, 10)
    k0 = first[0].clone()
    assert torch.equal(k0, fresh[0].read(tables, 10)[0])
    second = shared[1].read(tables, 10)
    assert torch.equal(second[1], fresh[1].read(tables, 10)[1]) and not torch.equal(second[0], k0)
    if dtype == "fp32":  # the gather itself lands in the shared buffer (fp8 pools unpack into new tensors)
        assert second[0].untyped_storage().data_ptr() == first[0].untyped_storage().data_ptr()


def test_a_cpu_pool_costs_resident_memory_only_for_the_slots_written() -> None:
    """A CPU pool is zeros the OS fills in when a page is first touched: allocating 256 MiB grows the
    process's own resident memory by a fraction of it, every slot reads as zero, and a slot written
    reads back what was written."""
    import pathlib

    import torch

    from rtpcore.kv.pools import LayerKVCache
    from rtpcore_native import build_kv_cache_spec

    status = pathlib.Path("/proc/self/status")
    if not status.exists():
        pytest.skip("reads /proc/self/status (Linux)")

    def anon_kib() -> int:
        line = next(s for s in status.read_text().splitlines() if s.startswith("RssAnon:"))
        return int(line.split()[1])

    spec = build_kv_cache_spec(KVCacheSpecDesc(tag="layers.0", kind="mha", dtype="fp32", num_kv_heads=8,
                                               head_dim=128, tokens_per_block=16))
    before = anon_kib()
    cache = LayerKVCache(spec, num_blocks=2048)  # 32768 slots of 4 KiB, for k and for v: 256 MiB
    grown = anon_kib() - before
    assert cache.k.shape == (32768, 8, 128) and cache.k.dtype == torch.float32
    assert grown < 32 * 1024, grown
    k, v = torch.randn(2, 8, 128), torch.randn(2, 8, 128)
    cache.write(torch.tensor([5, 32767]), k, v)
    assert torch.equal(cache.k[[5, 32767]], k) and torch.equal(cache.v[[5, 32767]], v)
    assert not cache.k[:5].any() and not cache.v[6:32767].any()

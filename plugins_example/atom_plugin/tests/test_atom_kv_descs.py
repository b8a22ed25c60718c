"""KV-cache descriptors of the MLA latent cache and the plugin's own "ue8m0" fp8 layout."""

from __future__ import annotations

from typing import Any

import pytest
from atom_harness import TINY

from atom_plugin.deepseek import DeepseekV3Plugin
from atom_plugin.hooks import rtpcore_kv_cache_layouts
from atom_plugin.layouts import Ue8m0Layout
from rtpcore_native import build_kv_cache_spec


def config(**overrides: Any) -> Any:
    return DeepseekV3Plugin.config_from_hf({**TINY, **overrides})


def test_model_dtype_cache_is_one_mla_desc_per_layer() -> None:
    """A bf16 cache: kind "mla", the latent and rope sizes, no layout, one desc per layer in order."""
    descs = DeepseekV3Plugin.kv_cache_descs(config(), kv_cache_dtype="bf16", tokens_per_block=32)
    assert [d.tag for d in descs] == ["layers.0", "layers.1", "layers.2"]
    assert {(d.kind, d.dtype, d.kv_lora_rank, d.rope_head_dim, d.tokens_per_block, d.layout) for d in descs} == {
        ("mla", "bf16", 128, 32, 32, "")
    }
    assert build_kv_cache_spec(descs[0]).bytes_per_token == 320


@pytest.mark.parametrize(
    ("rank", "rope", "layout", "policy", "nbytes"),
    [
        (128, 32, None, None, 196),  # default: padded
        (512, 64, None, None, 656),
        (512, 64, "compact", None, 576),
        (128, 32, "compact", None, 160),
        (512, 64, "ue8m0", Ue8m0Layout(), 644),
        (128, 32, "ue8m0", Ue8m0Layout(), 193),
        (192, 32, None, None, 224),  # rank not a multiple of 128: compact instead of padded
    ],
)
def test_fp8_layouts_and_their_sizes(rank: int, rope: int, layout: str | None, policy: Any, nbytes: int) -> None:
    """fp8 defaults to "padded" (compact when kv_lora_rank % 128 != 0); kv_layout overrides."""
    descs = DeepseekV3Plugin.kv_cache_descs(
        config(kv_lora_rank=rank, qk_rope_head_dim=rope), kv_cache_dtype="fp8_e4m3", kv_layout=layout
    )
    spec = build_kv_cache_spec(descs[0], policy=policy)
    assert spec.bytes_per_token == nbytes
    assert spec.k_block_bytes == rank * spec.tokens_per_block  # the fp8 latent


def test_ue8m0_regions_are_fp8_latent_one_exponent_byte_per_128_and_bf16_rope() -> None:
    """The hook returns a Ue8m0Layout whose byte map is nope | nope_scale (e8m0) | rope (bf16)."""
    (policy,) = rtpcore_kv_cache_layouts()
    assert isinstance(policy, Ue8m0Layout) and policy.name == "ue8m0"
    desc = DeepseekV3Plugin.kv_cache_descs(
        config(kv_lora_rank=512, qk_rope_head_dim=64), kv_cache_dtype="fp8_e4m3", kv_layout="ue8m0"
    )[0]
    spec = build_kv_cache_spec(desc, policy=policy)
    assert spec.regions == [
        ("nope", 0, 512, "fp8_e4m3"),
        ("nope_scale", 512, 4, "fp8_e8m0"),
        ("rope", 516, 128, "bf16"),
    ]
    assert spec.scale_block_bytes == 4 * spec.tokens_per_block


def test_ue8m0_refuses_a_rank_that_is_not_a_multiple_of_128() -> None:
    """kv_lora_rank 192 with "ue8m0" is a ValueError naming the layout and the rule."""
    desc = DeepseekV3Plugin.kv_cache_descs(
        config(kv_lora_rank=192), kv_cache_dtype="fp8_e4m3", kv_layout="ue8m0"
    )[0]
    with pytest.raises(ValueError, match=r"'ue8m0'.*multiple of 128"):
        build_kv_cache_spec(desc, policy=Ue8m0Layout())


def test_a_layout_for_an_unquantized_cache_is_refused() -> None:
    """kv_layout only applies to fp8 caches; asking for one with bf16 is a ValueError naming both."""
    with pytest.raises(ValueError, match=r"kv_layout='padded'.*'bf16'"):
        DeepseekV3Plugin.kv_cache_descs(config(), kv_cache_dtype="bf16", kv_layout="padded")

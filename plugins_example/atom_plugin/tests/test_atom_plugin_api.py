"""The plugin as rtpcore sees it: entry points, registration, config, exact weight sets."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from atom_harness import TINY, YARN
from safetensors.torch import load_file, save_file

import rtpcore
from atom_plugin.config import DeepseekConfig
from atom_plugin.deepseek import DeepseekV2Plugin, DeepseekV3Plugin
from atom_plugin.layouts import Ue8m0Layout
from rtpcore.checkpoint import load_checkpoint
from rtpcore.errors import MissingTensorsError
from rtpcore.plugins.model_plugin import model_plugin_problems


@pytest.fixture(scope="module")
def registry() -> Any:
    plan = rtpcore.Allowlist.from_cli(plugins=["atom-plugin"], external_model_packages=[]).resolve()
    return rtpcore.load_plugins(plan)


def test_entry_points_register_both_models_and_the_ue8m0_layout(registry: Any) -> None:
    """Allowing atom-plugin registers deepseek_v3, deepseek_v2 and the "ue8m0" fp8 layout."""
    assert registry.get("deepseek_v3") is DeepseekV3Plugin
    assert registry.get("deepseek_v2") is DeepseekV2Plugin
    assert registry.infer_model_type({"architectures": ["DeepseekV3ForCausalLM"]}) == "deepseek_v3"
    assert registry.infer_model_type({"architectures": ["DeepseekV2ForCausalLM"]}) == "deepseek_v2"
    assert isinstance(registry.get_layout("ue8m0"), Ue8m0Layout)
    assert model_plugin_problems(DeepseekV3Plugin) == []
    assert model_plugin_problems(DeepseekV2Plugin) == []


def test_architecture_hints_are_declared_without_import() -> None:
    """The installed metadata maps both architectures to the "atom" entry point."""
    import importlib_metadata

    dist = importlib_metadata.distribution("atom-plugin")
    hints = {ep.name: ep.value for ep in dist.entry_points if ep.group == "rtpcore.architectures"}
    plugins = {ep.name: ep.value for ep in dist.entry_points if ep.group == "rtpcore.plugins"}
    assert hints == {"DeepseekV3ForCausalLM": "atom", "DeepseekV2ForCausalLM": "atom"}
    assert plugins == {"atom": "atom_plugin.hooks"}


@pytest.mark.parametrize(
    ("name", "arch", "overrides"),
    [
        ("v3_yarn", "v3", {"rope_parameters": dict(YARN)}),
        ("v3_no_qlora", "v3", {"q_lora_rank": None, "first_k_dense_replace": 2}),
        ("v2_plain", "v2", {"topk_method": "greedy", "n_group": None, "topk_group": None}),
    ],
)
def test_required_tensors_are_exactly_the_checkpoint(
    name: str, arch: str, overrides: dict[str, Any], ckpt_factory: Callable[..., Path]
) -> None:
    """weight_patterns + placeholder_ranges require every tensor transformers saved and no other."""
    path = ckpt_factory(name, arch, **overrides)
    plugin = DeepseekV3Plugin if arch == "v3" else DeepseekV2Plugin
    cfg = plugin.config_from_hf(json.loads((path / "config.json").read_text()))
    weights = load_checkpoint(
        path, plugin.weight_patterns(cfg), plugin.placeholder_ranges(cfg), expected_shapes=plugin.weight_shapes(cfg)
    )
    assert set(weights) == set(load_file(path / "model.safetensors"))
    assert any("{expert}" in p for p in plugin.weight_patterns(cfg))


def test_mtp_layer_is_never_required_and_a_missing_expert_is_named(
    v3_ckpt: Path, tmp_path: Path
) -> None:
    """Tensors of layer num_hidden_layers (the MTP module) are skipped; a missing expert tensor is an error naming it."""
    tensors = load_file(v3_ckpt / "model.safetensors")
    mtp = {k.replace("layers.2.", "layers.3."): v.clone() for k, v in tensors.items() if ".layers.2." in k}
    (tmp_path / "config.json").write_text((v3_ckpt / "config.json").read_text())
    save_file({**tensors, **mtp}, tmp_path / "model.safetensors")
    cfg = DeepseekV3Plugin.config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    patterns, ranges = DeepseekV3Plugin.weight_patterns(cfg), DeepseekV3Plugin.placeholder_ranges(cfg)
    assert set(load_checkpoint(tmp_path, patterns, ranges)) == set(tensors)

    gone = "model.layers.2.mlp.experts.7.down_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != gone}, tmp_path / "model.safetensors")
    with pytest.raises(MissingTensorsError) as excinfo:
        load_checkpoint(tmp_path, patterns, ranges)
    assert excinfo.value.missing == (gone,)


def _hf(**overrides: Any) -> dict[str, Any]:
    return {**TINY, "architectures": ["DeepseekV3ForCausalLM"], **overrides}


@pytest.mark.parametrize(
    ("plugin", "overrides", "words"),
    [
        (DeepseekV3Plugin, {"num_key_value_heads": 2}, "num_key_value_heads"),
        (DeepseekV3Plugin, {"n_routed_experts": 7}, "n_routed_experts"),
        (DeepseekV3Plugin, {"topk_group": 3}, "topk_group"),
        (DeepseekV3Plugin, {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_type 'linear'"),
        (DeepseekV3Plugin, {"hidden_act": "gelu"}, "hidden_act"),
        (DeepseekV3Plugin, {"kv_lora_rank": None}, "kv_lora_rank"),
        (DeepseekV2Plugin, {"topk_method": "noaux_tc"}, "topk_method 'noaux_tc'"),
        (DeepseekV2Plugin, {"mlp_bias": True}, "mlp_bias"),
    ],
)
def test_unsupported_or_broken_configs_raise_naming_the_key(
    plugin: type[DeepseekV3Plugin], overrides: dict[str, Any], words: str
) -> None:
    """A config option the model cannot serve is a ValueError that names the key."""
    with pytest.raises(ValueError, match=words):
        plugin.config_from_hf(_hf(**overrides))


@pytest.mark.parametrize(
    "rope",
    [
        dict(YARN),
        dict(YARN, mscale=0.707, mscale_all_dim=0.707, factor=40.0, beta_fast=16),
        dict(YARN, mscale=None, mscale_all_dim=None, truncate=False),
        {"rope_type": "default", "rope_theta": 5000.0},
    ],
)
def test_rope_frequencies_and_softmax_scale_match_transformers(rope: dict[str, Any]) -> None:
    """inv_freq, the cos/sin attention factor and the softmax scale equal transformers' values."""
    import transformers
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_mod

    from atom_plugin.layers import rope_inv_freq

    hf_cfg = transformers.DeepseekV3Config(**{**TINY, "rope_parameters": dict(rope)})
    ours = DeepseekV3Plugin.config_from_hf(hf_cfg.to_dict())
    emb = hf_mod.DeepseekV3RotaryEmbedding(hf_cfg)
    torch.testing.assert_close(rope_inv_freq(ours.rope, ours.qk_rope_head_dim), emb.inv_freq, rtol=0, atol=0)
    assert ours.rope.attention_factor == pytest.approx(emb.attention_scaling, rel=1e-12)
    attn = hf_mod.DeepseekV3Attention(hf_cfg, layer_idx=0)
    assert ours.softmax_scale == pytest.approx(attn.scaling, rel=1e-12)


def test_demo_config_builds_a_complete_model() -> None:
    """demo_config() parses, and random tensors of weight_shapes build a model that runs."""
    from atom_harness import PagedRunner

    hf = DeepseekV3Plugin.demo_config()
    assert hf["architectures"] == ["DeepseekV3ForCausalLM"]
    cfg = DeepseekV3Plugin.config_from_hf(hf)
    assert isinstance(cfg, DeepseekConfig)
    from rtpcore.checkpoint import WeightSelection

    gen = torch.Generator().manual_seed(0)
    ranges = DeepseekV3Plugin.placeholder_ranges(cfg)
    weights = {
        name: 0.1 * torch.randn(shape, generator=gen)
        for pattern, shape in DeepseekV3Plugin.weight_shapes(cfg).items()
        for name in WeightSelection.from_patterns([pattern], ranges).required
    }
    model = DeepseekV3Plugin.build_model(cfg, weights)
    descs = DeepseekV3Plugin.kv_cache_descs(cfg, kv_cache_dtype="fp32", tokens_per_block=8)
    tokens, logits = PagedRunner(model, descs).run([[1, 2, 3]], 4)
    assert len(tokens[0]) == 4 and logits.shape == (4, 1, hf["vocab_size"])

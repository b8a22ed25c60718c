"""atom-plugin end to end through rtpcore's Engine: allowlist, checkpoint, paged cache, layouts, workers."""

from __future__ import annotations

import multiprocessing
import pickle
from pathlib import Path

import pytest
from atom_harness import generate_from_pickled_config, hf_greedy

from rtpcore import Engine, EngineConfig
from rtpcore.errors import KVCacheSpecError, UnknownArchitectureError

PROMPTS = [[5, 9, 33, 7, 2, 90, 17], [100, 3, 4], [64, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
PLUGINS = ("atom-plugin",)


@pytest.mark.slow
def test_engine_greedy_matches_transformers_batched(v3_ckpt: Path) -> None:
    """Engine.from_pretrained(plugins=("atom-plugin",)) decodes transformers' greedy tokens, batched."""
    with Engine.from_pretrained(v3_ckpt, plugins=PLUGINS, tokens_per_block=8) as engine:
        out = engine.generate(PROMPTS, max_new_tokens=32, stop_token_ids=())
        assert engine.model_type == "deepseek_v3"
        assert [e.distribution for e in engine.plugins] == ["atom-plugin"]
        assert [s.kind for s in engine.kv_cache_specs] == ["mla"] * 3
        assert engine.kv_cache_specs[0].bytes_per_token == (128 + 32) * 4
    assert out == hf_greedy(v3_ckpt, PROMPTS, 32)


@pytest.mark.parametrize(
    ("kv_layout", "bytes_per_token"), [(None, 196), ("padded", 196), ("compact", 160), ("ue8m0", 193)]
)
def test_engine_runs_every_fp8_layout(v3_ckpt: Path, kv_layout: str | None, bytes_per_token: int) -> None:
    """kv_cache_dtype="fp8" defaults to "padded"; kv_layout selects built-in layouts and the plugin's own."""
    with Engine.from_pretrained(
        v3_ckpt, plugins=PLUGINS, kv_cache_dtype="fp8", kv_layout=kv_layout, kv_cache_memory=1 << 20
    ) as engine:
        specs = engine.kv_cache_specs
        out = engine.generate(PROMPTS, max_new_tokens=8, stop_token_ids=())
    assert {s.bytes_per_token for s in specs} == {bytes_per_token}
    assert {s.layout for s in specs} == {kv_layout or "padded"}
    assert [len(o) for o in out] == [8, 8, 8]


def test_unknown_layout_lists_the_plugin_layout(v3_ckpt: Path) -> None:
    """An unknown kv_layout is a KVCacheSpecError whose message lists "ue8m0" among the choices."""
    with pytest.raises(KVCacheSpecError) as excinfo:
        Engine.from_pretrained(v3_ckpt, plugins=PLUGINS, kv_cache_dtype="fp8", kv_layout="e8m0x")
    assert "'e8m0x'" in str(excinfo.value)
    assert "'ue8m0'" in str(excinfo.value)


def test_without_the_plugin_the_architecture_is_unknown_with_a_hint(v3_ckpt: Path) -> None:
    """Not allowing atom-plugin leaves DeepseekV3ForCausalLM unknown, and the error names atom-plugin."""
    with pytest.raises(UnknownArchitectureError) as excinfo:
        Engine.from_pretrained(v3_ckpt)
    assert "atom-plugin" in str(excinfo.value)


@pytest.mark.slow
def test_spawned_worker_builds_the_model_from_the_pickled_plan(v3_ckpt: Path) -> None:
    """A spawned process given only the pickled EngineConfig imports atom-plugin and decodes the same tokens."""
    config = EngineConfig.create(v3_ckpt, plugins=PLUGINS, kv_cache_dtype="fp8", kv_layout="ue8m0")
    blob = pickle.dumps(config)
    with Engine.from_config(config) as engine:
        expected = engine.generate(PROMPTS[:2], max_new_tokens=12, stop_token_ids=())
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        got = pool.apply(generate_from_pickled_config, (blob, PROMPTS[:2], 12))
    assert got["imported_before"] is False
    assert got["tokens"] == expected
    assert got["model_type"] == "deepseek_v3"
    assert got["plugins"] == [(e.distribution, e.version, e.value) for e in config.plan.entries]
    assert got["bytes_per_token"] == 193


def test_a_bfloat16_engine_keeps_the_router_weights_in_float32(v3_ckpt: Path) -> None:
    """weight_dtypes keeps gate.weight and e_score_correction_bias as stored (float32) in a
    bf16 engine, like transformers' reference, while the other weights become bf16."""
    import torch
    from safetensors.torch import load_file

    stored = {}
    for f in sorted(Path(v3_ckpt).glob("*.safetensors")):
        stored.update(load_file(f))
    with Engine.from_pretrained(v3_ckpt, plugins=PLUGINS, dtype="bfloat16") as engine:
        moe = [layer.mlp for layer in engine.model.layers if hasattr(layer.mlp, "gate")]
        assert moe, "the test checkpoint has MoE layers"
        first = engine.model_config.first_k_dense_replace
        for i, mlp in enumerate(moe, start=first):
            want = stored[f"model.layers.{i}.mlp.gate.weight"]
            assert mlp.gate.dtype == torch.float32
            assert torch.equal(mlp.gate, want)
            assert not torch.equal(want.bfloat16().float(), want)  # rounding would have changed it
        assert engine.model.layers[0].input_norm.weight.dtype == torch.bfloat16

"""Bad DeepSeek ``config.json`` fields are named errors when the engine is built on a real checkpoint;
released DeepSeek-V3 / V2 / V2-Lite configs are accepted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from atom_harness import YARN

from atom_plugin.deepseek import DeepseekV2Plugin, DeepseekV3Plugin
from rtpcore import Engine
from rtpcore.errors import CheckpointError, ConfigFieldError

PLUGINS = ("atom-plugin",)
DROP = object()  # remove the key from config.json
ROPE = "rope_parameters"


def with_config(src: Path, dst: Path, **changes: Any) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` whose config.json has ``changes`` (DROP removes a key)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    config = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is DROP:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def yarn(**changes: Any) -> dict[str, Any]:
    return {**YARN, **changes}


# (changes to the tiny V3 checkpoint's config.json, the field named, the bad value)
V3_BAD: list[tuple[dict[str, Any], str, Any]] = [
    ({"num_hidden_layers": "3"}, "num_hidden_layers", "3"),
    ({"num_hidden_layers": 0}, "num_hidden_layers", 0),
    ({"num_hidden_layers": None}, "num_hidden_layers", None),
    ({"hidden_size": True}, "hidden_size", True),
    ({"hidden_size": 64.0}, "hidden_size", 64.0),
    ({"vocab_size": -1}, "vocab_size", -1),
    ({"intermediate_size": DROP}, "intermediate_size", DROP),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size", 0),
    ({"num_attention_heads": "4"}, "num_attention_heads", "4"),
    ({"num_key_value_heads": 2}, "num_key_value_heads", 2),
    ({"num_key_value_heads": "4"}, "num_key_value_heads", "4"),
    ({"q_lora_rank": 0}, "q_lora_rank", 0),
    ({"q_lora_rank": "32"}, "q_lora_rank", "32"),
    ({"kv_lora_rank": None}, "kv_lora_rank", None),
    ({"kv_lora_rank": 0}, "kv_lora_rank", 0),
    ({"qk_nope_head_dim": "32"}, "qk_nope_head_dim", "32"),
    ({"qk_rope_head_dim": 31}, "qk_rope_head_dim", 31),
    ({"qk_rope_head_dim": 0}, "qk_rope_head_dim", 0),
    ({"v_head_dim": -32}, "v_head_dim", -32),
    ({"n_routed_experts": 0}, "n_routed_experts", 0),
    ({"n_routed_experts": 7}, "n_routed_experts", 7),  # 7 % n_group 2
    ({"n_routed_experts": "8"}, "n_routed_experts", "8"),
    ({"n_shared_experts": -1}, "n_shared_experts", -1),
    ({"n_shared_experts": "1"}, "n_shared_experts", "1"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok", 0),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok", 5),  # > topk_group 1 * 4 experts per group
    ({"n_group": 0}, "n_group", 0),
    ({"n_group": None}, "n_group", None),
    ({"n_group": 8, "topk_group": 1}, "n_group", 8),  # one expert per group: V3 scores top-2
    ({"topk_group": 3}, "topk_group", 3),
    ({"topk_group": "1"}, "topk_group", "1"),
    ({"first_k_dense_replace": 4}, "first_k_dense_replace", 4),
    ({"first_k_dense_replace": -1}, "first_k_dense_replace", -1),
    ({"first_k_dense_replace": "1"}, "first_k_dense_replace", "1"),
    ({"moe_layer_freq": 2}, "moe_layer_freq", 2),
    ({"moe_layer_freq": "1"}, "moe_layer_freq", "1"),
    ({"moe_layer_freq": 0}, "moe_layer_freq", 0),
    ({"norm_topk_prob": "true"}, "norm_topk_prob", "true"),
    ({"routed_scaling_factor": "2.5"}, "routed_scaling_factor", "2.5"),
    ({"routed_scaling_factor": 0}, "routed_scaling_factor", 0),
    ({"rms_norm_eps": None}, "rms_norm_eps", None),
    ({"rope_interleave": 1}, "rope_interleave", 1),
    ({"attention_bias": "false"}, "attention_bias", "false"),
    ({"tie_word_embeddings": None}, "tie_word_embeddings", None),
    ({"hidden_act": 1}, "hidden_act", 1),
    ({"mlp_bias": "yes"}, "mlp_bias", "yes"),
    ({"max_position_embeddings": "256"}, "max_position_embeddings", "256"),
    ({ROPE: "yarn"}, ROPE, "yarn"),
    ({ROPE: yarn(rope_type=5)}, f"{ROPE}.rope_type", 5),
    ({ROPE: yarn(rope_theta=None)}, f"{ROPE}.rope_theta", None),
    ({ROPE: yarn(factor="40")}, f"{ROPE}.factor", "40"),
    ({ROPE: yarn(factor=0)}, f"{ROPE}.factor", 0),
    ({ROPE: yarn(beta_fast="32")}, f"{ROPE}.beta_fast", "32"),
    ({ROPE: yarn(beta_slow=-1)}, f"{ROPE}.beta_slow", -1),
    ({ROPE: yarn(mscale=-0.1)}, f"{ROPE}.mscale", -0.1),
    ({ROPE: yarn(mscale_all_dim="1")}, f"{ROPE}.mscale_all_dim", "1"),
    ({ROPE: yarn(attention_factor=0)}, f"{ROPE}.attention_factor", 0),
    ({ROPE: yarn(original_max_position_embeddings=0)}, f"{ROPE}.original_max_position_embeddings", 0),
    ({ROPE: yarn(original_max_position_embeddings="32")}, f"{ROPE}.original_max_position_embeddings", "32"),
    ({ROPE: yarn(truncate="yes")}, f"{ROPE}.truncate", "yes"),
]


@pytest.mark.parametrize(("changes", "field", "value"), V3_BAD, ids=[f"{f}={v!r}" for _, f, v in V3_BAD])
def test_bad_deepseek_v3_field_is_a_checkpoint_error_naming_it(
    v3_ckpt: Path, tmp_path: Path, changes: dict[str, Any], field: str, value: Any
) -> None:
    """Engine.from_pretrained on a DeepSeek-V3 checkpoint with a bad config.json field raises
    CheckpointError naming config.json, the field and the value (never TypeError/ZeroDivisionError)."""
    path = with_config(v3_ckpt, tmp_path / "ckpt", **changes)
    with pytest.raises(CheckpointError) as excinfo:
        Engine.from_pretrained(path, plugins=PLUGINS)
    exc = excinfo.value
    assert isinstance(exc, ConfigFieldError) and isinstance(exc, ValueError)
    assert (exc.file, exc.field) == ("config.json", field)
    assert exc.value == (None if value is DROP else value)
    assert field.rsplit(".", 1)[-1] in str(exc) and "config.json" in str(exc)
    if value is not DROP:
        assert repr(value) in str(exc)


V2_BAD: list[tuple[dict[str, Any], str, Any]] = [
    ({"topk_method": 5}, "topk_method", 5),
    ({"topk_method": "group_limited_greedy", "n_group": None}, "n_group", None),
    ({"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 0}, "topk_group", 0),
    ({"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1, "n_routed_experts": 9},
     "n_routed_experts", 9),
    ({"rope_scaling": yarn(type="yarn", rope_type=DROP, factor=[40])}, "rope_scaling.factor", [40]),
    ({"max_position_embeddings": 0}, "max_position_embeddings", 0),  # default rope: read by the engine only
    ({"max_position_embeddings": True}, "max_position_embeddings", True),
]


@pytest.mark.parametrize(("changes", "field", "value"), V2_BAD, ids=[f"{f}={v!r}" for _, f, v in V2_BAD])
def test_bad_deepseek_v2_field_is_a_checkpoint_error_naming_it(
    ckpt_factory: Any, tmp_path: Path, changes: dict[str, Any], field: str, value: Any
) -> None:
    """The V2 routing fields (topk_method and, when grouped, n_group/topk_group) are checked too."""
    src = ckpt_factory("v2_plain", "v2", topk_method="greedy", n_group=None, topk_group=None)
    if "rope_scaling" in changes:  # the original DeepSeek-V2 form: "type" inside rope_scaling
        rope = {k: v for k, v in changes["rope_scaling"].items() if v is not DROP}
        changes = {"rope_parameters": None, "rope_scaling": rope}
    path = with_config(src, tmp_path / "ckpt", **changes)
    with pytest.raises(CheckpointError) as excinfo:
        Engine.from_pretrained(path, plugins=PLUGINS)
    assert isinstance(excinfo.value, ConfigFieldError)
    assert (excinfo.value.field, excinfo.value.value) == (field, value)
    assert repr(value) in str(excinfo.value)


DEEPSEEK_V3 = {  # released DeepSeek-V3 config.json (quantization_config left out)
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "pretraining_tp": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
    "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6,
    "num_hidden_layers": 27, "num_key_value_heads": 16, "pretraining_tp": 1, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 102400,
}
DEEPSEEK_V2 = {
    **DEEPSEEK_V2_LITE, "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536,
    "n_group": 8, "n_routed_experts": 160, "num_attention_heads": 128, "num_key_value_heads": 128,
    "num_hidden_layers": 60, "q_lora_rank": 1536, "routed_scaling_factor": 16.0, "topk_group": 3,
    "topk_method": "group_limited_greedy",
}


@pytest.mark.parametrize(
    ("plugin", "hf"),
    [(DeepseekV3Plugin, DEEPSEEK_V3), (DeepseekV2Plugin, DEEPSEEK_V2_LITE), (DeepseekV2Plugin, DEEPSEEK_V2)],
    ids=["DeepSeek-V3", "DeepSeek-V2-Lite", "DeepSeek-V2"],
)
def test_released_deepseek_configs_are_accepted(plugin: Any, hf: dict[str, Any]) -> None:
    """The released configs pass validation, with the yarn rope read from the legacy "type" key."""
    cfg = plugin.config_from_hf(hf)
    assert (cfg.num_hidden_layers, cfg.n_routed_experts) == (hf["num_hidden_layers"], hf["n_routed_experts"])
    assert (cfg.rope.rope_type, cfg.rope.factor, cfg.rope.original_max_position_embeddings) == ("yarn", 40.0, 4096)
    assert cfg.q_lora_rank == hf["q_lora_rank"]
    assert plugin.placeholder_ranges(cfg) == {"layer": range(hf["num_hidden_layers"]), "expert": range(hf["n_routed_experts"])}

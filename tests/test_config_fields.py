"""Bad ``config.json`` / ``generation_config.json`` fields are named errors, on real checkpoints;
required per-layer tensors stay required whatever the config type."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import types
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from safetensors.torch import save_file

from rtpcore import Engine
from rtpcore import config_fields as cf
from rtpcore.checkpoint import load_checkpoint
from rtpcore.cli import main
from rtpcore.errors import CheckpointError, ConfigFieldError, MissingTensorsError
from rtpcore.models.llama import LlamaPlugin
from rtpcore.plugins.model_plugin import FORWARD_CONTRACT, ModelPlugin

DROP = object()  # remove the key from config.json
LLAMA3 = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama checkpoint written by transformers (2 layers, GQA 4/2 heads)."""
    pytest.importorskip("transformers")
    from test_llama import make_checkpoint

    path = tmp_path_factory.mktemp("llama")
    make_checkpoint(path)
    return path


def with_config(src: Path, dst: Path, file: str = "config.json", **changes: Any) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` whose ``file`` has ``changes`` (DROP removes a key)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    data = json.loads((dst / file).read_text()) if (dst / file).exists() else {}
    for key, value in changes.items():
        if value is DROP:
            data.pop(key, None)
        else:
            data[key] = value
    (dst / file).write_text(json.dumps(data))
    return dst


def assert_names(exc: BaseException, field: str, value: Any, file: str = "config.json") -> None:
    assert isinstance(exc, CheckpointError) and isinstance(exc, ConfigFieldError)
    assert (exc.file, exc.field) == (file, field)
    assert exc.value == value or (exc.value is None and value is DROP)
    message = str(exc)
    assert message.startswith(f"{file}") and field in message
    if value is not DROP:
        assert repr(value) in message


# (changes to config.json, the field named, the bad value)
LLAMA_BAD: list[tuple[dict[str, Any], str, Any]] = [
    ({"num_hidden_layers": None}, "num_hidden_layers", None),
    ({"num_hidden_layers": "2"}, "num_hidden_layers", "2"),
    ({"num_hidden_layers": 0}, "num_hidden_layers", 0),
    ({"num_hidden_layers": -2}, "num_hidden_layers", -2),
    ({"num_hidden_layers": 2.0}, "num_hidden_layers", 2.0),
    ({"num_hidden_layers": True}, "num_hidden_layers", True),
    ({"hidden_size": DROP}, "hidden_size", DROP),
    ({"hidden_size": "64"}, "hidden_size", "64"),
    ({"hidden_size": 64.5}, "hidden_size", 64.5),
    ({"hidden_size": 66, "head_dim": None}, "hidden_size", 66),  # hidden % heads, head_dim derived
    ({"num_attention_heads": 0}, "num_attention_heads", 0),
    ({"num_attention_heads": None}, "num_attention_heads", None),
    ({"num_attention_heads": 3}, "num_attention_heads", 3),  # 3 % kv_heads 2
    ({"num_key_value_heads": 0}, "num_key_value_heads", 0),
    ({"num_key_value_heads": "2"}, "num_key_value_heads", "2"),
    ({"intermediate_size": -128}, "intermediate_size", -128),
    ({"vocab_size": "128"}, "vocab_size", "128"),
    ({"vocab_size": False}, "vocab_size", False),
    ({"head_dim": 0}, "head_dim", 0),
    ({"head_dim": "16"}, "head_dim", "16"),
    ({"head_dim": 15}, "head_dim", 15),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps", "1e-6"),
    ({"rms_norm_eps": 0}, "rms_norm_eps", 0),
    ({"rms_norm_eps": None}, "rms_norm_eps", None),
    ({"max_position_embeddings": 0}, "max_position_embeddings", 0),
    ({"max_position_embeddings": "256"}, "max_position_embeddings", "256"),
    ({"rope_parameters": None, "rope_theta": "10000"}, "rope_theta", "10000"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, "rope_parameters.rope_theta", 0),
    ({"rope_parameters": None, "rope_scaling": "llama3"}, "rope_scaling", "llama3"),
    ({"rope_parameters": None, "rope_scaling": [8.0]}, "rope_scaling", [8.0]),
    ({"rope_parameters": {**LLAMA3, "rope_type": 3}}, "rope_parameters.rope_type", 3),
    ({"rope_parameters": {**LLAMA3, "factor": None}}, "rope_parameters.factor", None),
    ({"rope_parameters": {**LLAMA3, "factor": "8"}}, "rope_parameters.factor", "8"),
    ({"rope_parameters": {**LLAMA3, "factor": -8.0}}, "rope_parameters.factor", -8.0),
    ({"rope_parameters": {**LLAMA3, "high_freq_factor": 1.0}}, "rope_parameters.high_freq_factor", 1.0),
    ({"rope_parameters": {**LLAMA3, "original_max_position_embeddings": 32.0}},
     "rope_parameters.original_max_position_embeddings", 32.0),
    ({"rope_parameters": None, "rope_scaling": {k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}},
     "rope_scaling.low_freq_factor", DROP),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings", "false"),
    ({"tie_word_embeddings": 1}, "tie_word_embeddings", 1),
    ({"attention_bias": None}, "attention_bias", None),
    ({"mlp_bias": "true"}, "mlp_bias", "true"),
    ({"hidden_act": 7}, "hidden_act", 7),
    ({"sliding_window": 0}, "sliding_window", 0),
    ({"sliding_window": "4096"}, "sliding_window", "4096"),
    ({"sliding_window": 8, "layer_types": ["full_attention"]}, "layer_types", ["full_attention"]),
    ({"sliding_window": 8, "layer_types": "sliding_attention"}, "layer_types", "sliding_attention"),
    ({"sliding_window": 8, "layer_types": ["full_attention", "chunked"]}, "layer_types", ["full_attention", "chunked"]),
    ({"sliding_window": 8, "use_sliding_window": "yes"}, "use_sliding_window", "yes"),
    ({"sliding_window": 8, "use_sliding_window": True, "max_window_layers": -1}, "max_window_layers", -1),
    ({"eos_token_id": [None]}, "eos_token_id", [None]),
    ({"eos_token_id": "2"}, "eos_token_id", "2"),
    ({"eos_token_id": True}, "eos_token_id", True),
    ({"eos_token_id": -1}, "eos_token_id", -1),
    ({"eos_token_id": [1, -2]}, "eos_token_id", [1, -2]),
    ({"architectures": "LlamaForCausalLM"}, "architectures", "LlamaForCausalLM"),
]


@pytest.mark.parametrize(("changes", "field", "value"), LLAMA_BAD, ids=[f"{f}={v!r}" for _, f, v in LLAMA_BAD])
def test_bad_llama_config_field_is_a_checkpoint_error_naming_it(
    llama_ckpt: Path, tmp_path: Path, changes: dict[str, Any], field: str, value: Any
) -> None:
    """Building an engine on a checkpoint whose config.json has a bad field raises
    CheckpointError naming config.json, the field and the value."""
    path = with_config(llama_ckpt, tmp_path / "ckpt", **changes)
    model_type = "llama" if field == "architectures" else None  # architectures also picks the model
    with pytest.raises(CheckpointError) as excinfo:
        Engine.from_pretrained(path, model_type=model_type)
    assert_names(excinfo.value, field, value)


@pytest.mark.parametrize(
    ("eos", "value"),
    [([None], [None]), ("2", "2"), (False, False), (-1, -1), ([127, 3.0], [127, 3.0]), ({"id": 1}, {"id": 1})],
)
def test_bad_eos_in_generation_config_is_a_checkpoint_error(
    llama_ckpt: Path, tmp_path: Path, eos: Any, value: Any
) -> None:
    """eos_token_id of generation_config.json (what the engine stops on) is checked like config.json's."""
    path = with_config(llama_ckpt, tmp_path / "ckpt", file="generation_config.json", eos_token_id=eos)
    with pytest.raises(CheckpointError) as excinfo:
        Engine.from_pretrained(path)
    assert_names(excinfo.value, "eos_token_id", value, file="generation_config.json")


def test_valid_eos_forms_still_load(llama_ckpt: Path, tmp_path: Path) -> None:
    """null, an id and a list of ids in generation_config.json are all accepted."""
    for i, (eos, want) in enumerate([(None, ()), (5, (5,)), ([5, 0], (5, 0)), ([], ())]):
        path = with_config(llama_ckpt, tmp_path / str(i), file="generation_config.json", eos_token_id=eos)
        with Engine.from_pretrained(path) as engine:
            assert engine.eos_token_ids == want


REAL_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "use_cache": True, "vocab_size": 128256,
    },
    "llama-2-7b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 11008, "max_position_embeddings": 4096,
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "pad_token_id": None,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "tie_word_embeddings": False,
        "vocab_size": 32000,
    },
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896,
        "initializer_range": 0.02, "intermediate_size": 4864, "max_position_embeddings": 32768,
        "max_window_layers": 24, "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    },
    "mistral-7b-v0.3": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False, "vocab_size": 32768,
    },
    "mistral-nemo": {  # head_dim given: 5120 / 32 = 160 != 128
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "head_dim": 128, "hidden_size": 5120,
        "intermediate_size": 14336, "max_position_embeddings": 1024000, "num_attention_heads": 32,
        "num_hidden_layers": 40, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
        "sliding_window": None, "vocab_size": 131072, "eos_token_id": 2,
    },
}


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_real_world_llama_family_configs_are_accepted(name: str) -> None:
    """The config.json of released Llama-2/3, Qwen2.5 and Mistral models passes validation unchanged."""
    cfg = LlamaPlugin.config_from_hf(REAL_CONFIGS[name])
    assert cfg.num_hidden_layers == REAL_CONFIGS[name]["num_hidden_layers"]
    assert LlamaPlugin.placeholder_ranges(cfg) == {"layer": range(cfg.num_hidden_layers)}


def test_cli_prints_a_bad_field_as_one_error_line(
    llama_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """kv-spec and generate report a bad config.json field as one `rtpcore: error:` line, exit 1."""
    path = with_config(llama_ckpt, tmp_path / "ckpt", num_key_value_heads="2")
    for argv in (["kv-spec", str(path)], ["generate", str(path), "--prompt-ids", "1,2"]):
        assert main(argv) == 1
        out, err = capsys.readouterr()
        assert out == ""
        assert err.splitlines() == ["rtpcore: error: config.json: num_key_value_heads='2' must be an integer >= 1"]


# -- the helpers themselves ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("read", "value"),
    [
        (lambda hf: cf.require_int(hf, "k"), "8"),
        (lambda hf: cf.require_int(hf, "k"), 8.0),
        (lambda hf: cf.require_int(hf, "k"), True),
        (lambda hf: cf.require_int(hf, "k", minimum=0), -1),
        (lambda hf: cf.optional_int(hf, "k", 3, null_ok=False), None),
        (lambda hf: cf.require_float(hf, "k"), math.nan),
        (lambda hf: cf.require_float(hf, "k"), math.inf),
        (lambda hf: cf.require_float(hf, "k", positive=True), 0.0),
        (lambda hf: cf.optional_float(hf, "k", 1.0, minimum=0.5), 0.25),
        (lambda hf: cf.optional_float(hf, "k", 1.0), False),
        (lambda hf: cf.optional_bool(hf, "k", False), 0),
        (lambda hf: cf.optional_str(hf, "k", "a"), 1),
        (lambda hf: cf.optional_str(hf, "k", "a", choices=("a", "b")), "c"),
        (lambda hf: cf.optional_mapping(hf, "k"), []),
        (lambda hf: cf.optional_str_list(hf, "k", length=2), ["a"]),
        (lambda hf: cf.token_ids(hf, "k"), [0, None]),
    ],
)
def test_each_helper_refuses_a_bad_value_naming_it(read: Any, value: Any) -> None:
    """Every reader raises ConfigFieldError (also a ValueError) with the key and the value's repr."""
    with pytest.raises(ConfigFieldError) as excinfo:
        read({"k": value})
    assert isinstance(excinfo.value, ValueError)
    assert excinfo.value.field == "k" and f"k={value!r}" in str(excinfo.value)


def test_helpers_apply_defaults_and_accept_valid_values() -> None:
    """Missing keys take the default, null only with null_ok, and floats take integers."""
    assert cf.optional_int({}, "k", None) is None
    assert cf.optional_int({"k": None}, "k", 7, null_ok=True) == 7
    assert cf.optional_float({"k": 2}, "k", 1.0) == 2.0
    assert cf.optional_mapping({"k": None}, "k") == {}
    assert cf.token_ids({"k": 0}, "k") == (0,)
    assert cf.optional_str_list({"k": ["a", "b"]}, "k", length=2, choices=("a", "b")) == ("a", "b")
    with pytest.raises(ConfigFieldError, match=r"rope_scaling\.factor is missing"):
        cf.require_float({}, "factor", section="rope_scaling")
    with pytest.raises(ConfigFieldError, match=r"heads=6 must be divisible by kv=4"):
        cf.check_divisible("heads", 6, "kv", 4)


# -- placeholder ranges: required per-layer tensors, whatever the config type -----------------


@attrs.frozen
class AttrsConfig:
    num_hidden_layers: int


@dataclasses.dataclass
class DataConfig:
    num_hidden_layers: int


class LayeredToy(ModelPlugin):
    """A model whose config is whatever config_from_hf returns; two tensors per layer."""

    model_type = "layered_toy"
    architectures = ("LayeredToyForCausalLM",)
    forward_contract = FORWARD_CONTRACT

    @classmethod
    def config_from_hf(cls, hf_config: Any) -> Any:
        return dict(hf_config)

    @classmethod
    def weight_patterns(cls, config: Any) -> list[str]:
        return ["embed.weight", "layers.{layer}.w", "layers.{layer}.b"]

    @classmethod
    def kv_cache_descs(cls, config: Any, **options: Any) -> list[Any]:
        return []

    @classmethod
    def build_model(cls, config: Any, weights: Any, **options: Any) -> Any:
        return None


@pytest.mark.parametrize(
    "config",
    [{"num_hidden_layers": 3}, AttrsConfig(3), DataConfig(3), types.SimpleNamespace(num_hidden_layers=3)],
    ids=["dict", "attrs", "dataclass", "object"],
)
def test_checkpoint_missing_a_layer_is_refused_for_any_config_type(tmp_path: Path, config: Any) -> None:
    """The default placeholder_ranges requires {layer} over num_hidden_layers for a dict,
    attrs, dataclass or plain-object config: a checkpoint without layer 1 is MissingTensorsError."""
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 3}))
    tensors = {"embed.weight": torch.zeros(2, 2)}
    for i in (0, 2):  # layer 1 is missing
        tensors |= {f"layers.{i}.w": torch.zeros(2), f"layers.{i}.b": torch.zeros(2)}
    save_file(tensors, tmp_path / "model.safetensors")
    ranges = LayeredToy.placeholder_ranges(config)
    assert ranges == {"layer": range(3)}
    with pytest.raises(MissingTensorsError) as excinfo:
        load_checkpoint(tmp_path, LayeredToy.weight_patterns(config), ranges)
    assert excinfo.value.missing == ("layers.1.b", "layers.1.w")


def test_dict_config_from_a_real_checkpoint_requires_every_layer(tmp_path: Path) -> None:
    """The whole path for a dict-config plugin: config.json -> config_from_hf -> load refuses a missing layer."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LayeredToyForCausalLM"], "num_hidden_layers": 2}))
    save_file({"embed.weight": torch.zeros(2, 2), "layers.0.w": torch.zeros(2), "layers.0.b": torch.zeros(2)},
              tmp_path / "model.safetensors")
    config = LayeredToy.config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    with pytest.raises(MissingTensorsError) as excinfo:
        load_checkpoint(tmp_path, LayeredToy.weight_patterns(config), LayeredToy.placeholder_ranges(config))
    assert set(excinfo.value.missing) == {"layers.1.w", "layers.1.b"}


@pytest.mark.parametrize("layers", ["3", 0, -1, True, None, 2.0])
def test_bad_layer_count_in_a_dict_config_is_named(layers: Any) -> None:
    """A layer count the default placeholder_ranges cannot use is a ConfigFieldError, not optional layers."""
    with pytest.raises(ConfigFieldError) as excinfo:
        LayeredToy.placeholder_ranges({"num_hidden_layers": layers})
    assert excinfo.value.field == "num_hidden_layers" and repr(layers) in str(excinfo.value)

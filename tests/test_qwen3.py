"""Qwen3 in the built-in Llama family: tiny ``Qwen3ForCausalLM`` checkpoints written by
transformers (q/k norms, an explicit head_dim other than hidden/heads) decode like transformers,
read their config and weights with named errors, and load from GGUF like from safetensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from rtpcore import Engine  # noqa: E402
from rtpcore.errors import CheckpointError  # noqa: E402
from rtpcore.models.llama import LlamaPlugin  # noqa: E402
from test_llama import PROMPTS, SMALL, hf_greedy, make_checkpoint  # noqa: E402

QWEN3 = {**SMALL, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 24}
# Checkpoint variants (overrides of test_llama's "qwen3-head-dim"): plain; biases on every
# attention projection with tied embeddings; a 6-token window on the second layer only.
SHAPES: dict[str, dict[str, Any]] = {
    "plain": {},
    "bias-tied": {"attention_bias": True, "tie_word_embeddings": True},
    "window": {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
}
SEED = 2  # weights whose greedy outputs do not fall into a loop for any of SHAPES


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_greedy_tokens_equal_transformers_alone_and_batched(tmp_path: Path, shape: str, native: bool) -> None:
    """Greedy float32 tokens of ragged prompts, batched together and each alone, equal
    transformers' for 24 new tokens, with the native decode step and with torch's modules."""
    hf = make_checkpoint(tmp_path, "qwen3-head-dim", seed=SEED, **SHAPES[shape])
    want = [hf_greedy(hf, prompt, 24) for prompt in PROMPTS]
    with Engine.from_pretrained(tmp_path, max_batch_size=4, native_decode=native) as engine:
        assert engine.model_type == "llama"
        batched = engine.generate(PROMPTS, max_new_tokens=24, stop_token_ids=[])
        alone = [engine.generate([p], max_new_tokens=24, stop_token_ids=[])[0] for p in PROMPTS]
        assert engine.model.decode_kernel == ("native" if native else "torch")
    for tokens in want:
        assert len(set(tokens)) >= 6, f"degenerate greedy output, the test would prove little: {tokens}"
    assert batched == want
    assert alone == want


def test_config_reads_qwen3() -> None:
    """Qwen3 has q/k norms of head_dim, no biases unless attention_bias (then o too), its own
    head_dim, and a sliding window only with use_sliding_window (as transformers reads it)."""
    config = LlamaPlugin.config_from_hf(QWEN3)
    assert (config.qk_norm, config.qkv_bias, config.o_bias, config.head_dim) == (True, False, False, 24)
    assert (config.q_size, config.kv_size) == (96, 48)
    assert config.sliding_windows == (None, None)
    shapes = LlamaPlugin.weight_shapes(config)
    assert shapes["model.layers.{layer}.self_attn.q_norm.weight"] == (24,)
    assert shapes["model.layers.{layer}.self_attn.k_norm.weight"] == (24,)
    assert shapes["model.layers.{layer}.self_attn.o_proj.weight"] == (64, 96)
    biased = LlamaPlugin.config_from_hf({**QWEN3, "attention_bias": True})
    assert (biased.qkv_bias, biased.o_bias) == (True, True)
    by_arch = LlamaPlugin.config_from_hf({k: v for k, v in QWEN3.items() if k != "model_type"})
    assert by_arch.qk_norm
    assert not LlamaPlugin.config_from_hf({**QWEN3, "model_type": "qwen2"}).qk_norm
    window = {"sliding_window": 8, "max_window_layers": 1}
    assert LlamaPlugin.config_from_hf({**QWEN3, **window}).sliding_windows == (None, None)
    assert LlamaPlugin.config_from_hf({**QWEN3, **window, "use_sliding_window": True}).sliding_windows == (None, 8)
    types = {"layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": True}
    assert LlamaPlugin.config_from_hf({**QWEN3, **window, **types}).sliding_windows == (8, None)


@pytest.mark.parametrize(("change", "field"), [
    ({"attention_bias": "yes"}, "attention_bias"),
    ({"head_dim": "24"}, "head_dim"),
    ({"head_dim": 23}, "head_dim"),
    ({"use_sliding_window": 1, "sliding_window": 8}, "use_sliding_window"),
    ({"layer_types": ["full_attention"], "sliding_window": 8, "use_sliding_window": True}, "layer_types"),
])
def test_malformed_config_field_is_a_named_error(change: dict[str, Any], field: str) -> None:
    """A malformed Qwen3 field is a CheckpointError naming it."""
    with pytest.raises(CheckpointError) as excinfo:
        LlamaPlugin.config_from_hf({**QWEN3, **change})
    assert field in str(excinfo.value)


def test_malformed_q_norm_is_a_named_error(tmp_path: Path) -> None:
    """A q_norm of the wrong size (hidden/heads instead of head_dim) is a CheckpointError naming
    the tensor, the expected and the actual shape, before a model is built."""
    from safetensors.torch import load_file, save_file

    make_checkpoint(tmp_path, "qwen3-head-dim")
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.1.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as excinfo:
        Engine.from_pretrained(tmp_path)
    assert "'model.layers.1.self_attn.q_norm.weight' expected [24], got [16]" in str(excinfo.value)


def test_missing_k_norm_is_a_named_error(tmp_path: Path) -> None:
    """A Qwen3 checkpoint without its k norms (say, a Qwen2 one relabelled) names what is missing."""
    from safetensors.torch import load_file, save_file

    make_checkpoint(tmp_path, "qwen3-head-dim")
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.0.self_attn.k_norm.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as excinfo:
        Engine.from_pretrained(tmp_path)
    assert "model.layers.0.self_attn.k_norm.weight" in str(excinfo.value)


def test_f32_gguf_gives_the_tokens_of_its_safetensors_checkpoint(tmp_path: Path) -> None:
    """A Qwen3 GGUF written as llama.cpp's converter writes it (``qwen3`` architecture, Q/K not
    permuted, ``attn_q_norm``/``attn_k_norm``, ``key_length`` = head_dim) reads back the original
    config and tensors, and generates the safetensors checkpoint's (and transformers') tokens."""
    pytest.importorskip("gguf")
    from gguf_files import write_gguf
    from rtpcore.checkpoint import load_checkpoint, read_hf_config
    from rtpcore.checkpoint.gguf import open_gguf
    from tokenizer_files import byte_bpe

    hf = make_checkpoint(tmp_path / "st", "qwen3-head-dim", vocab_size=420)
    path = write_gguf(tmp_path / "st", tmp_path / "qwen3.gguf", tokenizer=byte_bpe())
    config = read_hf_config(path)
    original = json.loads((tmp_path / "st" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size"):
        assert config[key] == original[key], key
    names = LlamaPlugin.gguf_tensor_names(open_gguf(path), config)
    state = hf.state_dict()
    loaded = load_checkpoint(path, list(state), tensor_names=names)
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor), name
    with Engine.from_pretrained(tmp_path / "st") as engine:
        want = engine.generate(PROMPTS, max_new_tokens=24, stop_token_ids=[])
    with Engine.from_pretrained(path, max_batch_size=4) as engine:
        assert engine.model_type == "llama"
        got = engine.generate(PROMPTS, max_new_tokens=24, stop_token_ids=[])
        assert engine.model.decode_kernel == "native"
    assert got == want
    assert got[0] == hf_greedy(hf, PROMPTS[0], 24)


def test_registry_serves_qwen3_checkpoints_and_gguf_files() -> None:
    """Qwen3ForCausalLM and GGUF's ``qwen3`` resolve to the built-in Llama family."""
    from rtpcore.plugins.loading import load_plugins

    registry = load_plugins()
    assert registry.gguf_model_type("qwen3") == "llama"
    assert "Qwen3ForCausalLM" in LlamaPlugin.architectures

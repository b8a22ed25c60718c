"""fp8 block-quantized checkpoints (DeepSeek-V3/R1's format) load dequantized.

Checkpoints are real safetensors files: a model's weights quantized here to
float8_e4m3fn with per-block ``*_scale_inv`` scales, next to the same weights
dequantized and written in float32; the engine must not tell them apart.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from rtpcore import Engine
from rtpcore.checkpoint import load_checkpoint
from rtpcore.checkpoint.quantized import (
    Fp8BlockQuantization,
    dequantize_fp8_blocks,
    quantize_fp8_blocks,
)
from rtpcore.errors import CheckpointError

FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"}
PROMPTS = [[5, 9, 33, 7, 81], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [100]]


# -- the test oracle: block quantization and its reference inverse ------------------------


def reference_dequantize(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    (rows, cols), (bo, bi) = q.shape, block
    full = scale.repeat_interleave(bo, dim=0).repeat_interleave(bi, dim=1)[:rows, :cols]
    return q.float() * full


def is_linear(name: str) -> bool:
    """Projections are quantized; embeddings, lm_head, norms and routers are not."""
    return name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def write_pair(
    src: Path, out: Path, block: tuple[int, int], quantized: Callable[[str], bool] = is_linear
) -> tuple[Path, Path]:
    """From the float checkpoint ``src`` write ``out/fp8`` (quantized, with its
    quantization_config) and ``out/f32`` (the dequantized values in float32)."""
    tensors = load_file(src / "model.safetensors")
    q_dir, f_dir = out / "fp8", out / "f32"
    q_out: dict[str, torch.Tensor] = {}
    f_out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if quantized(name) and t.dim() == 2:
            q, s = quantize_fp8_blocks(t, block)
            q_out[name], q_out[name + "_scale_inv"] = q, s
            f_out[name] = reference_dequantize(q, s, block)
        else:
            q_out[name] = f_out[name] = t
    for d, ts in ((q_dir, q_out), (f_dir, f_out)):
        shutil.copytree(src, d)
        save_file(ts, d / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {**FP8, "weight_block_size": list(block)}
    (q_dir / "config.json").write_text(json.dumps(config))
    return q_dir, f_dir


# -- quantization_config ---------------------------------------------------------------------


def test_config_without_quantization_is_none_and_fp8_is_parsed() -> None:
    """No quantization_config means none; DeepSeek-V3's block config becomes a value object."""
    assert Fp8BlockQuantization.from_hf({"hidden_size": 8}) is None
    q = Fp8BlockQuantization.from_hf(
        {"quantization_config": {**FP8, "weight_block_size": [128, 128]}}
    )
    assert q == Fp8BlockQuantization(block_size=(128, 128), activation_scheme="dynamic", fmt="e4m3")
    assert q.scale_shape((7168, 18432)) == (56, 144)
    assert q.scale_shape((129, 1)) == (2, 1)


@pytest.mark.parametrize(
    ("quantization", "needle"),
    [
        ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
        ({"quant_method": "gptq"}, "quant_method 'gptq'"),
        ({"quant_method": "FP8", "weight_block_size": [128, 128]}, "quant_method 'FP8'"),
        ({"quant_method": None}, "quant_method None"),
        ({"weight_block_size": [128, 128]}, "lacks 'quant_method'"),
        ("fp8", "quantization_config 'fp8'"),
        (None, "quantization_config None"),
    ],
)
def test_other_quantization_is_a_checkpoint_error_naming_quant_method(
    quantization: Any, needle: str
) -> None:
    """Anything but quant_method 'fp8' is refused, naming quant_method and its value."""
    with pytest.raises(CheckpointError) as excinfo:
        Fp8BlockQuantization.from_hf({"quantization_config": quantization})
    assert needle in str(excinfo.value)
    assert "'fp8'" in str(excinfo.value)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({}, "lacks 'weight_block_size'"),
        ({"weight_block_size": None}, "weight_block_size None"),
        ({"weight_block_size": 128}, "weight_block_size 128"),
        ({"weight_block_size": [128]}, "weight_block_size [128]"),
        ({"weight_block_size": [128, 128, 1]}, "weight_block_size [128, 128, 1]"),
        ({"weight_block_size": [0, 128]}, "weight_block_size [0, 128]"),
        ({"weight_block_size": [-128, 128]}, "weight_block_size [-128, 128]"),
        ({"weight_block_size": ["128", 128]}, "weight_block_size ['128', 128]"),
        ({"weight_block_size": [128.0, 128]}, "weight_block_size [128.0, 128]"),
        ({"weight_block_size": [True, 128]}, "weight_block_size [True, 128]"),
        ({"weight_block_size": [128, 128], "fmt": "e5m2"}, "fmt 'e5m2'"),
        ({"weight_block_size": [128, 128], "activation_scheme": 1}, "activation_scheme 1"),
    ],
)
def test_malformed_fp8_config_is_a_checkpoint_error_naming_the_field(
    fields: dict[str, Any], needle: str
) -> None:
    """A missing or invalid weight_block_size (or fmt, activation_scheme) names the field and value."""
    with pytest.raises(CheckpointError) as excinfo:
        Fp8BlockQuantization.from_hf({"quantization_config": {"quant_method": "fp8", **fields}})
    assert needle in str(excinfo.value)


# -- the loader ------------------------------------------------------------------------------


@pytest.fixture
def synthetic(tmp_path: Path) -> dict[str, Any]:
    """Two shards plus one of unwanted tensors; blocks (16, 32) leave partial edge blocks;
    one scale lives in another shard than its weight."""
    block = (16, 32)
    gen = torch.Generator().manual_seed(0)
    full = {
        "a.weight": torch.randn(50, 70, generator=gen),
        "b.weight": torch.randn(40, 64, generator=gen),
    }
    extra = {"unwanted.weight": torch.randn(20, 20, generator=gen)}
    q = {n: quantize_fp8_blocks(t, block) for n, t in {**full, **extra}.items()}
    shards = {
        "s1.safetensors": {
            "a.weight": q["a.weight"][0],
            "norm.weight": torch.ones(70),
            "b.weight_scale_inv": q["b.weight"][1],
        },
        "s2.safetensors": {"a.weight_scale_inv": q["a.weight"][1], "b.weight": q["b.weight"][0]},
        "s3.safetensors": {
            "unwanted.weight": q["unwanted.weight"][0],
            "unwanted.weight_scale_inv": q["unwanted.weight"][1],
        },
    }
    weight_map = {}
    for file, tensors in shards.items():
        save_file(tensors, tmp_path / file)
        weight_map.update(dict.fromkeys(tensors, file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return {
        "path": tmp_path,
        "quantization": Fp8BlockQuantization(block_size=block),
        "expected": {n: reference_dequantize(*q[n], block) for n in full},
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loader_dequantizes_into_the_dtype_and_opens_only_needed_shards(
    synthetic: dict[str, Any], dtype: torch.dtype
) -> None:
    """fp8 weights come back as weight x scale_inv per block in the load dtype, without
    their scales; the shard holding only unwanted tensors is never opened."""
    weights = load_checkpoint(
        synthetic["path"],
        ["a.weight", "b.weight", "norm.weight"],
        dtype=dtype,
        quantization=synthetic["quantization"],
    )
    assert sorted(weights) == ["a.weight", "b.weight", "norm.weight"]
    for name, want in synthetic["expected"].items():
        assert weights[name].dtype == dtype
        assert torch.equal(weights[name], want.to(dtype)), name
    assert weights.stats.files_opened == ("s1.safetensors", "s2.safetensors")
    assert weights.stats.tensors_loaded == 3


def test_per_pattern_dtype_applies_to_the_dequantized_weight(synthetic: dict[str, Any]) -> None:
    """A ``dtypes`` entry (e.g. a router kept in float32) wins over the load dtype."""
    weights = load_checkpoint(
        synthetic["path"],
        ["a.weight", "b.weight"],
        dtype="bfloat16",
        dtypes={"a.weight": "float32"},
        quantization=synthetic["quantization"],
    )
    assert weights["a.weight"].dtype == torch.float32
    assert torch.equal(weights["a.weight"], synthetic["expected"]["a.weight"])
    assert weights["b.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    "spec", [(0, 0, 25), (0, 25, 50), (0, 7, 9), (1, 0, 35), (1, 35, 70), (1, 31, 33), (1, 64, 70)]
)
def test_sliced_weights_read_the_scales_of_the_blocks_they_touch(
    synthetic: dict[str, Any], spec: tuple[int, int, int]
) -> None:
    """A tensor-parallel slice, block-aligned or not, equals the slice of the dequantized weight."""
    weights = load_checkpoint(
        synthetic["path"],
        ["a.weight"],
        slices={"a.weight": spec},
        quantization=synthetic["quantization"],
    )
    dim, start, stop = spec
    want = synthetic["expected"]["a.weight"].narrow(dim, start, stop - start)
    assert torch.equal(weights["a.weight"], want)


def test_without_quantization_fp8_payloads_and_scales_stay_as_stored(
    synthetic: dict[str, Any],
) -> None:
    """The loader's default is unchanged: no quantization, no dequantization."""
    weights = load_checkpoint(
        synthetic["path"], ["a.weight", "a.weight_scale_inv"], dtype="float32"
    )
    assert weights["a.weight"].dtype == torch.float8_e4m3fn


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors")
    return path


def test_missing_scale_is_a_checkpoint_error_naming_the_tensor(tmp_path: Path) -> None:
    q, _ = quantize_fp8_blocks(torch.randn(20, 20), (16, 16))
    path = _write(tmp_path, {"x.weight": q, "y.weight": torch.ones(3)})
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(
            path, ["x.weight", "y.weight"], quantization=Fp8BlockQuantization(block_size=(16, 16))
        )
    msg = str(excinfo.value)
    assert "'x.weight'" in msg and "'x.weight_scale_inv' is missing" in msg


@pytest.mark.parametrize("shape", [(1, 2), (2, 1), (2, 2, 1), (3, 2)])
def test_scale_of_the_wrong_shape_is_a_checkpoint_error_naming_it(
    tmp_path: Path, shape: tuple[int, ...]
) -> None:
    """A (20, 20) weight in blocks of 16 needs a (2, 2) scale; anything else names the scale."""
    q, _ = quantize_fp8_blocks(torch.randn(20, 20), (16, 16))
    path = _write(tmp_path, {"x.weight": q, "x.weight_scale_inv": torch.ones(shape)})
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(path, ["x.weight"], quantization=Fp8BlockQuantization(block_size=(16, 16)))
    msg = str(excinfo.value)
    assert f"scale tensor 'x.weight_scale_inv' has shape {list(shape)}, expected [2, 2]" in msg


def test_scale_beside_an_unquantized_weight_is_a_checkpoint_error(tmp_path: Path) -> None:
    path = _write(
        tmp_path, {"x.weight": torch.randn(20, 20), "x.weight_scale_inv": torch.ones(2, 2)}
    )
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(path, ["x.weight"], quantization=Fp8BlockQuantization(block_size=(16, 16)))
    assert "tensor 'x.weight' has a scale 'x.weight_scale_inv' but is stored as float32" in str(
        excinfo.value
    )


def test_dequantize_refuses_a_scale_that_does_not_cover_the_weight() -> None:
    q, s = quantize_fp8_blocks(torch.randn(20, 20), (16, 16))
    with pytest.raises(ValueError, match="does not cover"):
        dequantize_fp8_blocks(q, s[:1], (16, 16))


# -- the engine, on the built-in Llama -------------------------------------------------------

transformers = pytest.importorskip("transformers")

from test_llama import make_checkpoint, teacher_forced_logits  # noqa: E402


@pytest.mark.parametrize(
    ("block", "overrides"),
    [
        ((128, 128), {}),  # every weight is one partial block
        ((16, 32), {"intermediate_size": 72}),  # partial blocks at the bottom and right edges
    ],
)
def test_llama_on_fp8_checkpoint_equals_its_dequantized_float32_checkpoint(
    tmp_path: Path, block: tuple[int, int], overrides: dict[str, Any]
) -> None:
    """Greedy tokens are identical and logits equal to float32 rounding."""
    make_checkpoint(tmp_path / "src", **overrides)
    q_dir, f_dir = write_pair(tmp_path / "src", tmp_path, block)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (24, 17)]
    results = []
    for path in (q_dir, f_dir):
        with Engine.from_pretrained(path, tokens_per_block=4) as engine:
            tokens = engine.generate(PROMPTS, max_new_tokens=24, stop_token_ids=[])
            logits = teacher_forced_logits(engine.model, engine.kv_caches, seqs, prefill=[9, 17])
            results.append((tokens, logits))
    (q_tokens, q_logits), (f_tokens, f_logits) = results
    assert q_tokens == f_tokens
    for a, b in zip(q_logits, f_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_engine_refuses_another_quant_method(tmp_path: Path) -> None:
    """The engine names quant_method before reading any weight."""
    make_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as excinfo:
        Engine.from_pretrained(tmp_path)
    assert "quant_method 'awq'" in str(excinfo.value)


@pytest.mark.slow
def test_two_ranks_on_an_fp8_checkpoint_generate_the_float32_tokens(tmp_path: Path) -> None:
    """Tensor parallel slices that cut through scale blocks (blocks of 24 x 40 rows and
    columns; heads of 16) dequantize exactly: two ranks on the fp8 checkpoint give one
    rank's tokens on the dequantized float32 checkpoint."""
    make_checkpoint(tmp_path / "src")
    q_dir, f_dir = write_pair(tmp_path / "src", tmp_path, (24, 40))
    with Engine.from_pretrained(f_dir, tokens_per_block=4) as engine:
        want = engine.generate(PROMPTS, max_new_tokens=16, stop_token_ids=[])
    with Engine.from_pretrained(q_dir, tokens_per_block=4, tensor_parallel_size=2) as engine:
        got = engine.generate(PROMPTS, max_new_tokens=16, stop_token_ids=[])
    assert got == want


@pytest.mark.parametrize("block", [(128, 128), (16, 32), (7, 5)])
def test_quantize_fp8_blocks_writes_the_format_the_oracle_reads_back(block: tuple[int, int]) -> None:
    """quantize_fp8_blocks gives e4m3 weights and one scale per block (edge blocks partial);
    the reference dequantization recovers the weight within e4m3's relative precision, and each
    block's largest magnitude lands on 448."""
    w = torch.randn(45, 70, generator=torch.Generator().manual_seed(7)) * 3
    q, s = quantize_fp8_blocks(w, block)
    bo, bi = block
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (-(-45 // bo), -(-70 // bi))
    back = reference_dequantize(q, s, block)
    assert torch.allclose(back, w, rtol=2**-3, atol=1e-6)  # e4m3: 3 mantissa bits
    assert q[:bo, :bi].float().abs().max().item() == 448.0

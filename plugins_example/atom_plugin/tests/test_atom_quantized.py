"""DeepSeek-V3 from an fp8 block-quantized checkpoint (the format DeepSeek-V3/R1 ship):
float8_e4m3fn projections with ``*_scale_inv`` block scales, dequantized by rtpcore at
load, decode exactly what the same weights dequantized into a float32 checkpoint decode."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from atom_harness import PagedRunner, make_checkpoint
from safetensors.torch import load_file, save_file

from rtpcore import Engine
from rtpcore.checkpoint import quantize_fp8_blocks
from rtpcore.errors import CheckpointError

PROMPTS = [[5, 9, 33, 7, 2, 90, 17], [100, 3, 4], [64, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
N_NEW = 16


def reference_dequantize(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    (rows, cols), (bo, bi) = q.shape, block
    full = scale.repeat_interleave(bo, dim=0).repeat_interleave(bi, dim=1)[:rows, :cols]
    return q.float() * full


def write_pair(src: Path, out: Path, block: tuple[int, int]) -> tuple[Path, Path]:
    """``out/fp8``: every projection quantized as DeepSeek-V3's checkpoints are (embeddings,
    lm_head, norms and the router stay float); ``out/f32``: the dequantized values."""
    tensors = load_file(src / "model.safetensors")
    q_out: dict[str, torch.Tensor] = {}
    f_out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(("_proj.weight", "_proj_with_mqa.weight")):
            q, s = quantize_fp8_blocks(t, block)
            q_out[name], q_out[name + "_scale_inv"] = q, s
            f_out[name] = reference_dequantize(q, s, block)
        else:
            q_out[name] = f_out[name] = t
    q_dir, f_dir = out / "fp8", out / "f32"
    for d, ts in ((q_dir, q_out), (f_dir, f_out)):
        shutil.copytree(src, d)
        save_file(ts, d / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "weight_block_size": list(block),
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
    }
    (q_dir / "config.json").write_text(json.dumps(config))
    return q_dir, f_dir


@pytest.mark.parametrize(
    ("block", "overrides"),
    [
        ((128, 128), {}),  # DeepSeek-V3's blocks: every tiny weight is one partial block
        # partial blocks at the bottom and right edges of MLP and expert weights
        ((16, 32), {"intermediate_size": 72, "moe_intermediate_size": 24}),
    ],
)
def test_v3_on_fp8_checkpoint_equals_its_dequantized_float32_checkpoint(
    tmp_path: Path, block: tuple[int, int], overrides: dict[str, Any]
) -> None:
    """Batched greedy tokens are identical; teacher-forced logits equal to float32 rounding."""
    make_checkpoint(tmp_path / "src", "v3", **overrides)
    q_dir, f_dir = write_pair(tmp_path / "src", tmp_path, block)
    tokens, logits = [], []
    for path in (q_dir, f_dir):
        with Engine.from_pretrained(path, plugins=("atom-plugin",)) as engine:
            assert engine.model_type == "deepseek_v3"
            tokens.append(engine.generate(PROMPTS, max_new_tokens=N_NEW, stop_token_ids=[]))
            runner = PagedRunner(engine.model, engine.kv_cache_specs)
            logits.append(runner.run(PROMPTS, N_NEW, forced=tokens[0])[1])
    assert tokens[0] == tokens[1]
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-5)


def test_expert_weight_without_its_scale_is_a_checkpoint_error_naming_it(tmp_path: Path) -> None:
    """A quantized tensor whose scale is missing is refused before any weight is used."""
    make_checkpoint(tmp_path / "src", "v3")
    q_dir, _ = write_pair(tmp_path / "src", tmp_path, (128, 128))
    file = q_dir / "model.safetensors"
    tensors = load_file(file)
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    del tensors[name + "_scale_inv"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as excinfo:
        Engine.from_pretrained(q_dir, plugins=("atom-plugin",))
    assert f"{name + '_scale_inv'!r} is missing" in str(excinfo.value)
    assert f"tensor {name!r} is stored as float8_e4m3fn" in str(excinfo.value)


def pow2_quantize(t: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 blocks whose scales are powers of two (DeepSeek-V3.1's ``scale_fmt: ue8m0``)."""
    (rows, cols), (bo, bi) = t.shape, block
    grid = torch.zeros(-(-rows // bo), -(-cols // bi))
    for r in range(grid.shape[0]):
        for c in range(grid.shape[1]):
            amax = t[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi].abs().amax().clamp(min=1e-12)
            grid[r, c] = 2.0 ** torch.ceil(torch.log2(amax / 448.0))
    full = grid.repeat_interleave(bo, dim=0).repeat_interleave(bi, dim=1)[:rows, :cols]
    return (t.float() / full).to(torch.float8_e4m3fn), grid


def test_ue8m0_scales_load_through_atom_fp8_and_other_scales_are_refused(tmp_path: Path) -> None:
    """atom-plugin's quantization method (atom_fp8, replacing rtpcore's fp8 while loaded) reads
    V3.1's power-of-two scales to the same tokens as their float32 dequantization, and names a
    scale that is not a power of two."""
    from atom_plugin.quantization import AtomFp8Method
    from rtpcore import Allowlist, load_plugins

    registry = load_plugins(Allowlist.from_cli(plugins=["atom-plugin"]).resolve())
    assert registry.seam_class("quantization_methods", "fp8") is AtomFp8Method
    make_checkpoint(tmp_path / "src", "v3")
    q_dir, f_dir = write_pair(tmp_path / "src", tmp_path, (16, 16))
    tensors = load_file(tmp_path / "src" / "model.safetensors")
    q_out, f_out = {}, {}
    for name, t in tensors.items():
        if name.endswith(("_proj.weight", "_proj_with_mqa.weight")):
            q, s = pow2_quantize(t, (16, 16))
            q_out[name], q_out[name + "_scale_inv"] = q, s
            f_out[name] = reference_dequantize(q, s, (16, 16))
        else:
            q_out[name] = f_out[name] = t
    save_file(q_out, q_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(f_out, f_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((q_dir / "config.json").read_text())
    config["quantization_config"]["scale_fmt"] = "ue8m0"
    (q_dir / "config.json").write_text(json.dumps(config))
    tokens = []
    for path in (q_dir, f_dir):
        with Engine.from_pretrained(path, plugins=("atom-plugin",)) as engine:
            tokens.append(engine.generate(PROMPTS, max_new_tokens=N_NEW, stop_token_ids=[]))
    assert tokens[0] == tokens[1]
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    q_out[name] = q_out[name] * 1.5
    save_file(q_out, q_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"scale tensor {name!r} holds a value that is not a power of two"):
        Engine.from_pretrained(q_dir, plugins=("atom-plugin",))

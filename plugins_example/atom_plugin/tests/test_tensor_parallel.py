"""DeepSeek-V3 under tensor parallelism: the split rules, and two real spawned ranks (gloo)
decoding exactly what one process decodes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from atom_harness import YARN, PagedRunner, hf_greedy, make_checkpoint

from atom_plugin.config import DeepseekConfig
from atom_plugin.deepseek import DeepseekV3Plugin
from rtpcore import Engine, EngineConfig
from rtpcore.checkpoint import read_hf_config
from rtpcore.errors import ShardingError
from rtpcore.parallel.leader import WorkerGroup

PROMPTS = [[5, 9, 33, 7, 2, 90, 17], [100, 3, 4], [64, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
N_NEW = 16
BLOCKS = 32  # per layer; the runner uses at most len(prompts) * 3 + 1 blocks of 16 tokens
VARIANTS = {
    # checkpoint name: (arch, overrides); "v3_yarn" is the v3_ckpt fixture's checkpoint
    "v3_yarn": ("v3", {"rope_parameters": dict(YARN)}),
    # q_proj split by heads, o_proj's (random) bias added once after the all-reduce,
    # an odd vocabulary (lm_head replicated), softmax routing
    "v2-tp-no-qlora-bias-odd-vocab": (
        "v2",
        {"q_lora_rank": None, "attention_bias": True, "vocab_size": 127, "routed_scaling_factor": 1.5},
    ),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, v3_ckpt: Path) -> dict[str, Path]:
    """The variants' checkpoints; transformers initialises biases to zero, so they are
    randomised here (in the safetensors file transformers then reads) to make them count."""
    from safetensors.torch import load_file, save_file

    paths = {"v3_yarn": v3_ckpt}
    for name, (arch, overrides) in VARIANTS.items():
        if name in paths:
            continue
        path = make_checkpoint(tmp_path_factory.mktemp(name), arch, **overrides)
        file = path / "model.safetensors"
        tensors = load_file(file)
        gen = torch.Generator().manual_seed(1)
        for key, t in tensors.items():
            if key.endswith("_proj.bias"):
                tensors[key] = 0.2 * torch.randn(t.shape, generator=gen, dtype=t.dtype)
        save_file(tensors, file, metadata={"format": "pt"})
        paths[name] = path
    return paths


def _config(ckpt: Path, **changes: Any) -> DeepseekConfig:
    return attrs.evolve(DeepseekV3Plugin.config_from_hf(read_hf_config(ckpt)), **changes)


class GroupModel:
    """The forward contract over a worker group: every rank runs the step on its shard
    and its own KV cache (the runner's caches are unused); rank 0 returns the logits."""

    dtype = torch.float32

    def __init__(self, group: WorkerGroup):
        self.group = group

    def __call__(self, batch: Any, kv_caches: Any) -> torch.Tensor:
        return self.group.run("forward", batch)


def _greedy(ckpt: Path, world_size: int) -> tuple[list[list[int]], list[int], list[dict[str, Any]]]:
    """Greedy tokens of the batched prompts and of the first prompt alone (batch-1 decode),
    and every rank's stats, from ``world_size`` ranks built like an engine's."""
    config = EngineConfig.create(ckpt, plugins=("atom-plugin",))
    with WorkerGroup.spawn("rtpcore.engine.worker.rank:build_shard", config, world_size, plan=config.plan) as group:
        group.run("allocate", BLOCKS)
        runner = PagedRunner(GroupModel(group), group.local.kv_cache_specs)
        batched, _ = runner.run(PROMPTS, N_NEW)
        single, _ = runner.run(PROMPTS[:1], N_NEW)
        stats = group.run("stats", None, gather=True)
    return batched, single[0], stats


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_two_ranks_decode_the_tokens_of_one_rank_and_of_transformers(
    variant: str, checkpoints: dict[str, Path]
) -> None:
    """N=2 greedy output equals N=1 (batched prefill + decode, and batch-1 decode) and transformers'."""
    ckpt = checkpoints[variant]
    one, one_single, (full,) = _greedy(ckpt, 1)
    two, two_single, stats = _greedy(ckpt, 2)
    assert two == one
    assert two_single == one_single == one[0]
    assert one == hf_greedy(ckpt, PROMPTS, N_NEW)
    assert len({t for seq in one for t in seq}) > 8, "degenerate checkpoint: the test would be weak"
    # Each rank read only its slices: about half of the split tensors, all of the replicated ones.
    assert [s["rank"] for s in stats] == [0, 1]
    assert stats[0]["bytes_read"] == stats[1]["bytes_read"] < 0.7 * full["bytes_read"]
    assert stats[0]["elements"] < 0.7 * full["elements"]
    # The MLA latent is shared by all heads: every rank caches all of it.
    assert stats[0]["kv_block_bytes"] == stats[1]["kv_block_bytes"] == full["kv_block_bytes"]


@pytest.mark.slow
def test_engine_with_tensor_parallel_size_2_decodes_transformers_tokens(v3_ckpt: Path) -> None:
    """Engine.from_pretrained(..., tensor_parallel_size=2) gives transformers' greedy tokens, batched."""
    with Engine.from_pretrained(
        v3_ckpt, plugins=("atom-plugin",), tensor_parallel_size=2, tokens_per_block=8
    ) as engine:
        out = engine.generate(PROMPTS, max_new_tokens=N_NEW, stop_token_ids=())
        assert engine.model_type == "deepseek_v3"
        assert engine.kv_cache_specs[0].bytes_per_token == (128 + 32) * 4  # the whole latent, per rank
    assert out == hf_greedy(v3_ckpt, PROMPTS, N_NEW)


@pytest.mark.slow
def test_engine_rejects_a_head_count_that_does_not_divide(v3_ckpt: Path) -> None:
    """tensor_parallel_size=3 with 4 MLA heads fails from_pretrained with ShardingError naming both."""
    with pytest.raises(ShardingError) as excinfo:
        Engine.from_pretrained(v3_ckpt, plugins=("atom-plugin",), tensor_parallel_size=3)
    assert (excinfo.value.name, excinfo.value.size, excinfo.value.world_size) == ("num_attention_heads", 4, 3)


def test_shard_config_splits_heads_and_intermediate_sizes(v3_ckpt: Path) -> None:
    """The local config has H/N heads and I/N intermediate sizes; the latent and the vocabulary are whole."""
    cfg = _config(v3_ckpt)
    local, _ = DeepseekV3Plugin.tensor_parallel_shard(cfg, 1, 2)
    assert (local.num_attention_heads, local.intermediate_size, local.moe_intermediate_size) == (2, 48, 16)
    assert (local.kv_lora_rank, local.qk_rope_head_dim, local.vocab_size) == (128, 32, 128)
    assert local.softmax_scale == cfg.softmax_scale
    assert DeepseekV3Plugin.kv_cache_descs(local, kv_cache_dtype="fp32")[0].kv_lora_rank == 128


@pytest.mark.parametrize("world_size", [2, 4])
def test_slices_of_all_ranks_tile_each_split_tensor(v3_ckpt: Path, world_size: int) -> None:
    """Every slice names a checkpoint tensor, and the ranks' ranges cover its dimension once, in rank order."""
    cfg = _config(v3_ckpt)
    shapes = DeepseekV3Plugin.weight_shapes(cfg)
    per_rank = [DeepseekV3Plugin.tensor_parallel_shard(cfg, r, world_size)[1] for r in range(world_size)]
    assert all(s.keys() == per_rank[0].keys() for s in per_rank)
    split = {
        "model.layers.{layer}.self_attn.q_b_proj.weight": 0,
        "model.layers.{layer}.self_attn.kv_b_proj.weight": 0,
        "model.layers.{layer}.self_attn.o_proj.weight": 1,
        "model.layers.0.mlp.gate_proj.weight": 0,
        "model.layers.0.mlp.up_proj.weight": 0,
        "model.layers.0.mlp.down_proj.weight": 1,
        "model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight": 0,
        "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight": 0,
        "model.layers.{layer}.mlp.experts.{expert}.down_proj.weight": 1,
        "model.layers.{layer}.mlp.shared_experts.gate_proj.weight": 0,
        "model.layers.{layer}.mlp.shared_experts.up_proj.weight": 0,
        "model.layers.{layer}.mlp.shared_experts.down_proj.weight": 1,
        "lm_head.weight": 0,
    }
    assert per_rank[0].keys() == split.keys()
    for name, dim in split.items():
        size = shapes[name.replace(".layers.{layer}.mlp", ".layers.1.mlp")]  # layer 1: the first MoE layer
        bounds = [s[name] for s in per_rank]
        assert {d for d, _, _ in bounds} == {dim}, name
        assert [b[1] for b in bounds] == [i * size[dim] // world_size for i in range(world_size)], name
        assert [b[2] for b in bounds] == [(i + 1) * size[dim] // world_size for i in range(world_size)], name


def test_lm_head_is_replicated_when_tied_or_when_the_vocabulary_does_not_divide(v3_ckpt: Path) -> None:
    """A tied head (it is the embedding) or a vocabulary not divisible by N is read whole by every rank."""
    for changes in ({"tie_word_embeddings": True}, {"vocab_size": 129}):
        _, slices = DeepseekV3Plugin.tensor_parallel_shard(_config(v3_ckpt, **changes), 0, 2)
        assert "lm_head.weight" not in slices
        assert "model.embed_tokens.weight" not in slices


@pytest.mark.parametrize(
    ("changes", "world_size", "name", "size"),
    [
        ({}, 3, "num_attention_heads", 4),
        ({"intermediate_size": 90}, 4, "intermediate_size", 90),
        ({"moe_intermediate_size": 30}, 4, "moe_intermediate_size", 30),
    ],
)
def test_sizes_that_do_not_divide_raise_sharding_error(
    v3_ckpt: Path, changes: dict[str, int], world_size: int, name: str, size: int
) -> None:
    """Heads, dense or expert intermediate sizes not divisible by N: ShardingError naming the size and N."""
    with pytest.raises(ShardingError) as excinfo:
        DeepseekV3Plugin.tensor_parallel_shard(_config(v3_ckpt, **changes), 0, world_size)
    assert (excinfo.value.name, excinfo.value.size, excinfo.value.world_size) == (name, size, world_size)
    assert f"{name}={size}" in str(excinfo.value)
    assert f"tensor_parallel_size={world_size}" in str(excinfo.value)


def test_full_config_with_sliced_weights_is_rejected(v3_ckpt: Path) -> None:
    """Building the unsharded config from one rank's slices fails naming kv_b_proj, not deep in a matmul."""
    from rtpcore.checkpoint import load_checkpoint

    cfg = _config(v3_ckpt)
    _, slices = DeepseekV3Plugin.tensor_parallel_shard(cfg, 0, 2)
    weights = load_checkpoint(
        v3_ckpt, DeepseekV3Plugin.weight_patterns(cfg), DeepseekV3Plugin.placeholder_ranges(cfg), slices=slices
    )
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.kv_b_proj\.weight has shape \(128, 128\)"):
        DeepseekV3Plugin.build_model(cfg, weights)

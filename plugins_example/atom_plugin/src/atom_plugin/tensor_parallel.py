"""How a DeepSeek-V3/V2 model is split across tensor-parallel ranks.

:func:`shard_config` answers rtpcore's ``tensor_parallel_shard(config, rank,
world_size)``: this rank's config and the checkpoint slices it reads. The
model (:mod:`atom_plugin.model`) then runs on those slices and finishes each
split layer with one collective of the ``parallel`` context it is built with.

The split, per layer (H heads, N ranks):

* **MLA attention**: heads are split, H/N per rank. ``q_proj`` / ``q_b_proj``
  and ``kv_b_proj`` (the absorbed ``W_UK`` / ``W_UV``) keep the rows of this
  rank's heads, ``o_proj`` the matching columns (row-parallel: one all-reduce,
  then the bias). ``q_a_proj``, ``kv_a_proj_with_mqa`` and every norm are
  replicated.
* **MLA latent cache: per rank and replicated.** The cached latent ``c_kv``
  and the roped key ``k_pe`` are shared by all heads (each head expands the
  same latent through its own rows of ``kv_b_proj``), so they cannot be split
  by heads: every rank computes and caches the full latent of every token for
  its own heads. The KV cache costs each rank what it costs one process; what
  tensor parallelism saves is weights and per-head compute.
* **Dense MLP**: ``gate_proj`` / ``up_proj`` column-parallel, ``down_proj``
  row-parallel, one all-reduce.
* **MoE**: every rank holds a 1/N slice of *every* expert's intermediate
  dimension (routed and shared experts alike), so routing stays local and
  exact: the router (``gate.weight``, ``e_score_correction_bias``) is
  replicated, every rank picks the same experts, and one all-reduce sums the
  routed plus shared partial outputs. (Expert parallelism, whole experts per
  rank, would need the same one all-reduce but balances work only as well as
  the routing does.)
* **Embedding** replicated; **lm_head** split by vocabulary (all-gather of
  the logits) when ``vocab_size`` divides by N and the embeddings are not
  tied, replicated otherwise.

A size that does not divide (``num_attention_heads``, ``intermediate_size``,
``moe_intermediate_size``) raises :class:`rtpcore.errors.ShardingError`.
"""

from __future__ import annotations

import attrs

from atom_plugin.config import DeepseekConfig
from rtpcore.sharding import column_shard, head_shard, row_shard

__all__ = ["shard_config"]

Slices = dict[str, tuple[int, int, int]]


def shard_config(config: DeepseekConfig, rank: int, world_size: int) -> tuple[DeepseekConfig, Slices]:
    """``(local_config, slices)`` of ``rank`` among ``world_size`` ranks.

    ``local_config`` has this rank's number of heads and intermediate sizes
    (everything else, the latent cache's shape included, is unchanged);
    ``slices`` maps checkpoint tensor names or ``{layer}`` / ``{expert}``
    patterns to ``(dim, start, stop)``. Tensors it does not name are read whole.
    """
    c = config
    attn = "model.layers.{layer}.self_attn"
    h = c.num_attention_heads
    heads = lambda unit, dim=0: head_shard(h, unit, rank, world_size, dim=dim).as_slice()  # noqa: E731
    q_name = f"{attn}.q_proj.weight" if c.q_lora_rank is None else f"{attn}.q_b_proj.weight"
    slices: Slices = {
        q_name: heads(c.qk_head_dim),  # (H*dq, ·): rows of this rank's heads
        f"{attn}.kv_b_proj.weight": heads(c.qk_nope_head_dim + c.v_head_dim),  # (H*(dn+dv), r)
        f"{attn}.o_proj.weight": heads(c.v_head_dim, dim=1),  # (D, H*dv): their columns
    }
    dense, moe = c.intermediate_size, c.moe_intermediate_size  # sizes unused by the model stay whole
    for i in c.dense_layers:
        _mlp_slices(slices, f"model.layers.{i}.mlp", c.intermediate_size, rank, world_size, "intermediate_size")
        dense = c.intermediate_size // world_size
    if c.moe_layers:
        _mlp_slices(slices, "model.layers.{layer}.mlp.experts.{expert}", c.moe_intermediate_size, rank,
                    world_size, "moe_intermediate_size")
        if c.n_shared_experts:  # divides whenever moe_intermediate_size does
            _mlp_slices(slices, "model.layers.{layer}.mlp.shared_experts",
                        c.moe_intermediate_size * c.n_shared_experts, rank, world_size,
                        "moe_intermediate_size * n_shared_experts")
        moe = c.moe_intermediate_size // world_size
    if vocab_parallel(c, world_size):
        slices["lm_head.weight"] = column_shard(c.vocab_size, rank, world_size, name="vocab_size").as_slice()
    local = attrs.evolve(
        c, num_attention_heads=h // world_size, intermediate_size=dense, moe_intermediate_size=moe
    )
    return local, slices


def vocab_parallel(config: DeepseekConfig, world_size: int) -> bool:
    """Whether ``lm_head`` is split by vocabulary (else every rank holds all of it)."""
    return world_size > 1 and not config.tie_word_embeddings and config.vocab_size % world_size == 0


def _mlp_slices(slices: Slices, prefix: str, inter: int, rank: int, world_size: int, name: str) -> None:
    cols = column_shard(inter, rank, world_size, name=name).as_slice()
    slices[f"{prefix}.gate_proj.weight"] = cols  # (I, D): rows
    slices[f"{prefix}.up_proj.weight"] = cols
    slices[f"{prefix}.down_proj.weight"] = row_shard(inter, rank, world_size, name=name).as_slice()  # (D, I)

"""Which slice of a weight each tensor-parallel rank owns.

Tensor parallelism splits a Linear layer ``y = x @ W.T + b`` (``W``: (out, in))
in one of two ways:

* **column-parallel**: a rank owns a contiguous block of output features, that
  is rows of ``W`` (dim 0) and the same block of ``b``. Its output is the
  matching slice of ``y``; concatenating the ranks' outputs gives ``y``.
* **row-parallel**: a rank owns a block of input features, columns of ``W``
  (dim 1). It consumes the matching slice of ``x`` and produces a partial sum;
  an all-reduce finishes ``y``. The bias is added once, after the reduction.

A column-parallel layer followed by a row-parallel one (q/k/v then o in
attention, gate/up then down in an MLP) costs one all-reduce per pair.

Everything here is plain integer arithmetic on ``(rank, world_size, size)``;
a size that does not divide is a :class:`~rtpcore.errors.ShardingError`, never
a silently uneven split.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attrs import frozen

from rtpcore.errors import ShardingError

if TYPE_CHECKING:
    import torch

__all__ = ["Shard", "column_shard", "head_shard", "kv_head_shard", "row_shard", "split_range"]


@frozen
class Shard:
    """The half-open range ``[start, stop)`` of dimension ``dim`` that one rank owns."""

    dim: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full tensor (a view; ``.contiguous()`` it to own it)."""
        return tensor.narrow(self.dim, self.start, self.size)

    def as_slice(self) -> tuple[int, int, int]:
        """``(dim, start, stop)``: the form ``load_checkpoint(slices=...)`` takes."""
        return (self.dim, self.start, self.stop)


def _check_rank(rank: int, world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")


def split_range(
    size: int, rank: int, world_size: int, *, name: str = "size", unit: int = 1
) -> tuple[int, int]:
    """``[start, stop)`` of rank's equal share of ``size`` items of ``unit`` elements each.

    ``size`` counts whole items (heads, features); the returned bounds are in
    elements (``item * unit``), ready to slice a weight. ``name`` is what the
    error message calls ``size``.
    """
    _check_rank(rank, world_size)
    if size % world_size:
        raise ShardingError(
            f"{name}={size} cannot be split across tensor_parallel_size={world_size}: "
            f"it must be a multiple of {world_size}",
            name=name,
            size=size,
            world_size=world_size,
        )
    per_rank = size // world_size
    return rank * per_rank * unit, (rank + 1) * per_rank * unit


def column_shard(
    out_features: int, rank: int, world_size: int, *, name: str = "out_features"
) -> Shard:
    """Rows of a column-parallel Linear weight (dim 0); slice its bias the same way."""
    return Shard(0, *split_range(out_features, rank, world_size, name=name))


def row_shard(in_features: int, rank: int, world_size: int, *, name: str = "in_features") -> Shard:
    """Columns of a row-parallel Linear weight (dim 1); its bias is not split."""
    return Shard(1, *split_range(in_features, rank, world_size, name=name))


def head_shard(
    num_heads: int,
    head_dim: int,
    rank: int,
    world_size: int,
    *,
    dim: int = 0,
    name: str = "num_attention_heads",
) -> Shard:
    """Whole attention heads: ``num_heads / world_size`` heads of ``head_dim`` each.

    ``dim=0`` for q/k/v projection weights (column-parallel), ``dim=1`` for the
    output projection (row-parallel).
    """
    return Shard(dim, *split_range(num_heads, rank, world_size, name=name, unit=head_dim))


def kv_head_shard(
    num_kv_heads: int,
    head_dim: int,
    rank: int,
    world_size: int,
    *,
    name: str = "num_key_value_heads",
) -> Shard:
    """Key/value heads of a grouped-query attention layer (dim 0 of k/v weights).

    When the heads divide evenly each rank owns ``num_kv_heads / world_size``
    of them. When there are fewer heads than ranks and ``world_size`` is a
    multiple of ``num_kv_heads``, each head is replicated on
    ``world_size / num_kv_heads`` consecutive ranks (each rank then owns one).
    """
    _check_rank(rank, world_size)
    if num_kv_heads % world_size == 0:
        return head_shard(num_kv_heads, head_dim, rank, world_size, name=name)
    if world_size % num_kv_heads == 0:
        head = rank // (world_size // num_kv_heads)
        return Shard(0, head * head_dim, (head + 1) * head_dim)
    raise ShardingError(
        f"{name}={num_kv_heads} cannot be shared by tensor_parallel_size={world_size}: "
        f"one must be a multiple of the other",
        name=name,
        size=num_kv_heads,
        world_size=world_size,
    )

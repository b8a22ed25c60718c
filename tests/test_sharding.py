"""Which slice of a weight each tensor-parallel rank owns."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rtpcore.errors import ShardingError
from rtpcore.parallel.sharding import (
    Shard,
    column_shard,
    head_shard,
    kv_head_shard,
    row_shard,
    split_range,
)


@given(st.integers(1, 8), st.integers(1, 64), st.integers(1, 16))
def test_the_ranks_shares_tile_the_whole_range_in_rank_order(world_size, per_rank, unit):
    size = world_size * per_rank
    ranges = [split_range(size, r, world_size, unit=unit) for r in range(world_size)]
    assert ranges[0][0] == 0 and ranges[-1][1] == size * unit
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert {stop - start for start, stop in ranges} == {per_rank * unit}


def test_column_and_row_shards_slice_a_linear_weight_on_the_right_dimension():
    w = torch.arange(6 * 4).reshape(6, 4)  # (out=6, in=4)
    col = column_shard(6, 1, 2)
    row = row_shard(4, 1, 2)
    assert col == Shard(0, 3, 6) and col.as_slice() == (0, 3, 6)
    assert torch.equal(col.take(w), w[3:6])
    assert row == Shard(1, 2, 4) and torch.equal(row.take(w), w[:, 2:4])


def test_head_shards_hold_whole_heads():
    assert head_shard(8, 16, 1, 4) == Shard(0, 32, 64)
    assert head_shard(8, 16, 3, 4, dim=1) == Shard(1, 96, 128)


def test_kv_heads_are_split_or_replicated_when_fewer_than_ranks():
    assert [kv_head_shard(4, 8, r, 2) for r in range(2)] == [Shard(0, 0, 16), Shard(0, 16, 32)]
    assert [kv_head_shard(2, 8, r, 4).start for r in range(4)] == [0, 0, 8, 8]
    with pytest.raises(
        ShardingError, match=r"num_key_value_heads=3 cannot be shared by tensor_parallel_size=2"
    ):
        kv_head_shard(3, 8, 0, 2)


def test_a_size_that_does_not_divide_is_an_error_naming_it():
    with pytest.raises(ShardingError) as excinfo:
        head_shard(6, 64, 0, 4)
    err = excinfo.value
    assert (err.name, err.size, err.world_size) == ("num_attention_heads", 6, 4)
    assert "num_attention_heads=6 cannot be split across tensor_parallel_size=4" in str(err)
    assert isinstance(err, ValueError)


@pytest.mark.parametrize(("rank", "world_size"), [(2, 2), (-1, 2), (0, 0)])
def test_a_rank_outside_the_group_is_refused(rank, world_size):
    with pytest.raises(ValueError, match="must be"):
        split_range(4, rank, world_size)

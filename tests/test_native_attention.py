"""The ``native_cpu`` attention backend in steps the native decode step does not run (prefill,
mixed, torch-module decodes): its one-token rows attend through
``rtpcore_native._kernels.paged_decode_attention``, its longer spans through
``paged_span_attention``, both reading the pool in place. Checked against the reference
(``torch``) backend on the same pools, over random batches: decodes beside prompt chunks, prompt
chunks alone, spans longer than the kernel's blocks of rows (64) and keys (32) with a cached
prefix before them, grouped heads, head sizes that are not a multiple of a vector, blocks in
random order, windows, float32 and bfloat16 pools."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rtpcore.attention import NativeCpuAttentionBackend, TorchAttentionBackend
from rtpcore.kv.pools import allocate_kv_caches
from rtpcore.kv.specs import build_specs
from rtpcore.models.forward_batch import ForwardBatch

pytest.importorskip("rtpcore_native._kernels")
from rtpcore_native import (
    KVCacheSpecDesc,
    _kernels,
)

POOL = {"fp32": torch.float32, "bf16": torch.bfloat16}


def mixed_batch(seed: int, decodes: list[int], spans: list[tuple[int, int]], kv_heads: int, head_dim: int,
                tpb: int, dtype: str) -> tuple[object, ForwardBatch]:
    """A pool filled with random keys and values and a batch of one-token sequences of the
    given context lengths, then (new tokens, context length) spans; each sequence's blocks are
    drawn at random from the pool (no two sequences share one)."""
    g = torch.Generator().manual_seed(seed)
    contexts = decodes + [c for _, c in spans]
    need = [-(-c // tpb) for c in contexts]
    blocks = sum(need) + 2
    desc = KVCacheSpecDesc(tag="layer0", kind="mha", dtype=dtype, num_kv_heads=kv_heads, head_dim=head_dim,
                           tokens_per_block=tpb)
    (cache,) = allocate_kv_caches(build_specs([desc]), blocks, compute_dtype=torch.float32)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g).to(cache.k.dtype))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g).to(cache.v.dtype))
    order = torch.randperm(blocks, generator=g).tolist()
    width = max(need)
    tables = torch.full((len(contexts), width), blocks - 1, dtype=torch.int64)
    taken = 0
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor(order[taken:taken + n])
        taken += n
    query_lens = tuple([1] * len(decodes) + [n for n, _ in spans])
    positions = [c - 1 for c in decodes] + [p for n, c in spans for p in range(c - n, c)]
    seq_of = [b for b, n in enumerate(query_lens) for _ in range(n)]
    slots = [int(tables[b, p // tpb]) * tpb + p % tpb for b, p in zip(seq_of, positions, strict=True)]
    batch = ForwardBatch(
        input_ids=torch.zeros(len(positions), dtype=torch.int64), positions=torch.tensor(positions),
        slots=torch.tensor(slots), query_lens=query_lens, context_lens=torch.tensor(contexts),
        block_tables=tables, tokens_per_block=tpb,
    )
    return cache, batch


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    decodes=st.lists(st.integers(1, 70), max_size=5),
    spans=st.lists(st.tuples(st.integers(1, 150), st.integers(0, 70)), max_size=3),
    kv_heads=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 2, 3, 4]),
    head_dim=st.sampled_from([8, 20, 40, 64]),
    tpb=st.sampled_from([1, 4, 16]),
    window=st.sampled_from([None, 1, 7, 32]),
    dtype=st.sampled_from(["fp32", "bf16"]),
    q_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_native_rows_equal_the_reference(seed: int, decodes: list[int], spans: list[tuple[int, int]], kv_heads: int,
                                         group: int, head_dim: int, tpb: int, window: int | None, dtype: str,
                                         q_dtype: torch.dtype) -> None:
    assume(decodes or spans)
    spans = [(n, n + extra) for n, extra in spans]  # n new tokens at the end of a longer context
    cache, batch = mixed_batch(seed, decodes, spans, kv_heads, head_dim, tpb, dtype)
    t = sum(batch.query_lens)
    q = torch.randn(t, kv_heads * group, head_dim, generator=torch.Generator().manual_seed(seed + 1)).to(q_dtype)
    scale = head_dim ** -0.5
    want = TorchAttentionBackend().attention(q, cache, batch, scale=scale, window=window)
    got = NativeCpuAttentionBackend().attention(q, cache, batch, scale=scale, window=window, masks={})
    assert got.shape == want.shape and got.dtype == want.dtype
    d = batch.num_decodes  # one-token spans at the head count as decodes
    assert d >= len(decodes)
    tol = 1e-5 if q_dtype == torch.float32 else 2e-2  # float32 sums in another order; bf16 outputs rounded
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_a_context_past_its_block_table_is_an_error_naming_the_sequence() -> None:
    cache, batch = mixed_batch(0, [5, 9], [], 2, 16, 4, "fp32")
    q = torch.randn(2, 2, 16)
    tables = batch.block_tables.contiguous()
    bad = torch.tensor([5, 4 * tables.shape[1] + 1])
    out = torch.empty_like(q)
    with pytest.raises(IndexError, match="sequence 1: context length 13 does not fit its block table of 3 blocks of 4"):
        _kernels.paged_decode_attention(q.data_ptr(), 2, 2, 2, 16, cache.k.data_ptr(), cache.v.data_ptr(), "float32",
                                        cache.k.shape[0], tables.data_ptr(), tables.shape[1], 4, bad.data_ptr(), 0,
                                        0.25, out.data_ptr())
    tables[0, 1] = cache.k.shape[0]  # a block past the pool
    ctx = torch.tensor([5, 9])
    with pytest.raises(IndexError, match=r"sequence 0: block .* outside the KV pool"):
        _kernels.paged_decode_attention(q.data_ptr(), 2, 2, 2, 16, cache.k.data_ptr(), cache.v.data_ptr(), "float32",
                                        cache.k.shape[0], tables.data_ptr(), tables.shape[1], 4, ctx.data_ptr(), 0,
                                        0.25, out.data_ptr())


def test_a_bad_span_is_an_error_naming_it() -> None:
    """paged_span_attention checks every span before reading: its rows within q, no more new
    tokens than its context, its table row, its context within its table, its blocks in the pool."""
    cache, batch = mixed_batch(0, [], [(6, 9), (3, 3)], 2, 16, 4, "fp32")
    q = torch.randn(9, 2, 16)
    out = torch.empty_like(q)
    tables = batch.block_tables.contiguous()

    def call(starts: list[int], counts: list[int], lens: list[int], index: list[int]) -> None:
        s, c, n, i = (torch.tensor(v, dtype=torch.int64) for v in (starts, counts, lens, index))
        _kernels.paged_span_attention(q.data_ptr(), 9, 2, 2, 16, cache.k.data_ptr(), cache.v.data_ptr(), "float32",
                                      cache.k.shape[0], tables.data_ptr(), tables.shape[0], tables.shape[1], 4, 2,
                                      s.data_ptr(), c.data_ptr(), n.data_ptr(), i.data_ptr(), 0, 0.25, out.data_ptr())

    call([0, 6], [6, 3], [9, 3], [0, 1])  # the batch as it is: fine
    with pytest.raises(IndexError, match=r"span 1: rows 6 \+ 4 outside the 9 rows of q"):
        call([0, 6], [6, 4], [9, 4], [0, 1])
    with pytest.raises(IndexError, match="span 0: 6 new tokens in a context of 5"):
        call([0, 6], [6, 3], [5, 3], [0, 1])
    with pytest.raises(IndexError, match="span 1: table row 2 outside the 2 rows of tables"):
        call([0, 6], [6, 3], [9, 3], [0, 2])
    with pytest.raises(IndexError, match="span 1: context length 13 does not fit its block table of 3 blocks of 4"):
        call([0, 6], [6, 3], [9, 13], [0, 1])
    tables[1, 0] = cache.k.shape[0]  # a block past the pool
    with pytest.raises(IndexError, match=r"span 1: block \d+ outside the KV pools"):
        call([0, 6], [6, 3], [9, 3], [0, 1])


@pytest.mark.parametrize("window", [0, 7, 40])
def test_a_span_split_into_chunks_attends_exactly_as_whole(window: int) -> None:
    """A prompt's queries get the same bits whether the prompt is one span or two chunks (each
    chunk over its own context): the kernel's blocks of keys do not depend on where a chunk starts,
    windows included (chunked prefill does not move greedy tokens)."""
    cache, batch = mixed_batch(3, [], [(150, 170)], 3, 64, 16, "fp32")
    q = torch.randn(150, 6, 64, generator=torch.Generator().manual_seed(5))
    tables = batch.block_tables.contiguous()

    def attend(starts: list[int], counts: list[int], lens: list[int]) -> torch.Tensor:
        out = torch.full_like(q, float("nan"))
        s, c, n, i = (torch.tensor(v, dtype=torch.int64) for v in (starts, counts, lens, [0] * len(starts)))
        _kernels.paged_span_attention(q.data_ptr(), 150, 6, 3, 64, cache.k.data_ptr(), cache.v.data_ptr(), "float32",
                                      cache.k.shape[0], tables.data_ptr(), 1, tables.shape[1], 16, len(starts),
                                      s.data_ptr(), c.data_ptr(), n.data_ptr(), i.data_ptr(), window, 0.125,
                                      out.data_ptr())
        return out

    whole = attend([0], [150], [170])
    assert torch.equal(attend([0, 37], [37, 113], [57, 170]), whole)
    assert torch.equal(attend([0, 70, 101], [70, 31, 49], [90, 121, 170]), whole)

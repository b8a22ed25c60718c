"""kv_cache_prefault: the CPU KV pools' pages committed when the engine is built
(rtpcore.kv.pools.commit_pages; docs/design.md §13), asked of the OS with mincore(2)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from rtpcore import Engine
from rtpcore.errors import RtpcoreError
from rtpcore.kv.pools import LayerKVCache, PackedLayerKVCache, commit_pages
from rtpcore_native import KVCacheSpecDesc, build_kv_cache_spec

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore(2), Linux's page residency")


def resident_fraction(t: torch.Tensor) -> float:
    """The share of ``t``'s pages (a CPU pool over its own mapping) that are in memory."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    start = t.data_ptr()
    assert start % mmap.PAGESIZE == 0, "a pool starts its own mapping"
    length = t.numel() * t.element_size()
    pages = -(-length // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(start, length, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in vec) / pages


def pools(cache: Any) -> list[torch.Tensor]:
    return [cache.rows] if isinstance(cache, PackedLayerKVCache) else [cache.k, cache.v]


def test_commit_pages_makes_every_page_of_fresh_pools_resident_and_leaves_them_zero() -> None:
    mha = build_kv_cache_spec(KVCacheSpecDesc(tag="layers.0", kind="mha", dtype="fp32", num_kv_heads=8,
                                              head_dim=128, tokens_per_block=16))
    fp8 = build_kv_cache_spec(KVCacheSpecDesc(tag="layers.1", kind="mha", dtype="fp8_e4m3", num_kv_heads=8,
                                              head_dim=128, tokens_per_block=16))
    caches = [LayerKVCache(mha, num_blocks=512), PackedLayerKVCache(fp8, num_blocks=512)]  # 64 + 16 MiB
    tensors = [t for c in caches for t in pools(c)]
    assert all(resident_fraction(t) < 0.5 for t in tensors)  # fresh: faulted in on first touch
    committed = commit_pages(caches)
    assert committed == sum(t.numel() * t.element_size() for t in tensors)
    assert [resident_fraction(t) for t in tensors] == [1.0] * len(tensors)
    assert not any(t.any() for t in tensors)  # still the zeros a pool starts as


@pytest.mark.parametrize("prefault", [True, False])
def test_an_engine_commits_its_pools_at_build_only_when_asked_and_generates_the_same(ckpt: Path, prefault: bool) -> None:
    with Engine.from_pretrained(ckpt, kv_cache_memory=16 << 20) as plain:
        want = plain.generate([[1, 2, 3, 4]], max_new_tokens=6)
    with Engine.from_pretrained(ckpt, kv_cache_memory=16 << 20, kv_cache_prefault=prefault) as e:
        fractions = [resident_fraction(t) for c in e.kv_caches for t in pools(c)]
        if prefault:
            assert fractions == [1.0] * len(fractions)
        else:  # the pages a build's warm-up step writes, at most
            assert max(fractions) < 0.5, fractions
        assert e.generate([[1, 2, 3, 4]], max_new_tokens=6) == want


def test_kv_cache_prefault_takes_true_false_or_none() -> None:
    from rtpcore.engine.config import EngineConfig

    with pytest.raises(RtpcoreError, match="kv_cache_prefault must be None"):
        EngineConfig.create("unused", kv_cache_prefault="yes")


def test_serve_commits_its_pool_at_start_unless_told_not_to(ckpt: Path) -> None:
    from test_serve import Server

    for extra, committed in (((), True), (("--no-kv-cache-prefault",), False)):
        server = Server(ckpt, "--kv-cache-memory", "8MiB", "--max-batch-size", "4", *extra)
        code, out = server.stop()
        assert code == 0, out
        assert ("KV cache: committed" in out) == committed, out


def test_a_pool_larger_than_the_memory_available_is_refused_before_anything_is_allocated(ckpt: Path) -> None:
    from rtpcore.errors import KVCacheCapacityError
    from rtpcore.platforms import available_memory

    too_big = available_memory() + (1 << 30)
    with pytest.raises(KVCacheCapacityError, match="--no-kv-cache-prefault") as info:
        Engine.from_pretrained(ckpt, kv_cache_memory=too_big, kv_cache_prefault=True)
    assert "cannot be committed" in str(info.value) and "--kv-cache-memory" in str(info.value)


def test_tensor_parallel_ranks_count_every_ranks_pool_against_the_hosts_memory(ckpt: Path) -> None:
    """Each CPU rank commits a pool of its own on this host: a per-rank pool that fits alone but
    not twice is refused, with the ranks' error type, and a small one serves as one rank does."""
    from rtpcore.errors import KVCacheCapacityError
    from rtpcore.platforms import available_memory

    with Engine.from_pretrained(ckpt, kv_cache_memory=16 << 20) as one:
        want = one.generate([[1, 2, 3, 4]], max_new_tokens=6)
    with Engine.from_pretrained(ckpt, kv_cache_memory=16 << 20, tensor_parallel_size=2, kv_cache_prefault=True) as two:
        assert two.generate([[1, 2, 3, 4]], max_new_tokens=6) == want
    per_rank = available_memory() // 2 + (1 << 30)
    with pytest.raises(KVCacheCapacityError, match="2 ranks' pools"):
        Engine.from_pretrained(ckpt, kv_cache_memory=per_rank, tensor_parallel_size=2, kv_cache_prefault=True)

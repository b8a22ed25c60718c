"""The KV manager's block accounting on its own (no scheduler), its prefix-cache policies, and the
request states and finish reasons (rtpcore.engine.core.kv_manager, .prefix_cache, .request)."""

from __future__ import annotations

import json

import pytest

from rtpcore.engine.core.block_pool import BlockAllocator
from rtpcore.engine.core.kv_manager import KVManager
from rtpcore.engine.core.prefix_cache import NoPrefixCache, PrefixCache, namespace_key
from rtpcore.engine.core.request import FinishReason, Request, RequestStatus
from rtpcore.engine.core.scheduler import Scheduler
from rtpcore.engine.sample.params import SamplingParams
from rtpcore.errors import KVBlockError

ROOT = namespace_key({"model": "toy"})


def request(name: str, tokens: list[int]) -> Request:
    return Request(
        request_id=name, tokens=list(tokens), prompt_len=len(tokens), params=SamplingParams(max_tokens=8),
        stop_ids=frozenset(), on_output=lambda out: None, arrival_time=0.0,
    )


def test_blocks_are_counted_taken_and_released_per_request() -> None:
    kv = KVManager(BlockAllocator(4), 4)
    r = request("r", list(range(6)))
    assert (kv.missing(r, 6), kv.room(r), kv.room(r, reserve=3)) == (2, 16, 4)
    kv.allocate(r, 6)
    assert len(r.blocks) == 2 and kv.num_free == 2
    assert kv.missing(r, 8) == 0 and kv.missing(r, 9) == 1  # its second block holds positions 4..7
    r.num_cached = 6
    assert kv.room(r) == 2 + 2 * 4 and kv.room(r, reserve=2) == 2  # what its own blocks still hold
    other = request("other", [1])
    with pytest.raises(KVBlockError):
        kv.allocate(other, 4 * 4)  # more than are free: the pool refuses, nothing is taken
    assert other.blocks == [] and kv.num_free == 2
    kv.release(r)
    assert (r.blocks, r.num_cached, r.draft_cached, r.num_registered, kv.num_free) == ([], 0, 0, 0, 4)


def test_with_the_prefix_cache_on_a_released_request_s_full_blocks_are_found_by_the_next() -> None:
    kv = KVManager(BlockAllocator(8), 4, PrefixCache(ROOT, 4))
    first = request("first", list(range(10)))  # 2 full blocks, then 2 tokens
    assert kv.admit(first) == 0
    kv.allocate(first, 10)
    first.num_cached = 10
    kv.cache_blocks(first)
    assert kv.pool.num_cached == 2 and first.num_registered == 2
    held = list(first.blocks)
    kv.release(first)
    again = request("again", list(range(10)))
    assert kv.admit(again) == 8 and again.num_cached == 8 and again.blocks == held[:2]
    assert all(kv.pool.refcount(b) == 1 for b in again.blocks)
    kv.count_hit(again, 8)
    assert (kv.prefix_cache.queries_total, kv.prefix_cache.hits_total, again.num_cached_tokens) == (10, 8, 8)
    short = request("short", list(range(8)))  # its last token's block is always computed: one block found
    assert kv.admit(short) == 4


def test_with_the_prefix_cache_off_nothing_is_found_cached_or_counted() -> None:
    kv = KVManager(BlockAllocator(8), 4)
    assert isinstance(kv.prefix_cache, NoPrefixCache)
    r = request("r", list(range(10)))
    kv.allocate(r, 10)
    r.num_cached = 10
    kv.cache_blocks(r)
    kv.release(r)
    again = request("again", list(range(10)))
    assert kv.admit(again) == 0 and again.blocks == [] and kv.pool.num_cached == 0
    kv.count_hit(again, 0)
    assert (kv.prefix_cache.queries_total, again.num_cached_tokens) == (0, None)


def test_a_request_moves_waiting_running_waiting_finished() -> None:
    """Queued: WAITING; admitted: RUNNING; preempted: WAITING again at the head; retired: FINISHED,
    its blocks released."""
    kv = KVManager(BlockAllocator(8), 4)
    s = Scheduler(kv, max_batch_size=4, max_num_batched_tokens=64)
    a, b = request("a", [1, 2, 3]), request("b", [4, 5])
    s.add(a)
    s.add(b)
    assert a.status is b.status is RequestStatus.WAITING
    s.schedule()
    assert a.status is b.status is RequestStatus.RUNNING
    s.preempt(b)
    assert b.status is RequestStatus.WAITING and s.waiting[0] is b and b.blocks == []
    s.retire(a)
    s.retire(b)
    assert a.status is b.status is RequestStatus.FINISHED and not s.running and not s.waiting and kv.num_free == 8


def test_finish_reasons_are_the_strings_of_the_contract() -> None:
    """A FinishReason compares, hashes and serialises as its string (what clients and the server's
    JSON see), so callers that compare against "stop" or key a dict by it keep working."""
    assert [str(f) for f in FinishReason] == ["stop", "length", "abort", "error"]
    for f in FinishReason:
        assert f == f.value and {f.value: 1}[f] == 1 and {f: 1}[f.value] == 1
        assert json.dumps({"finish_reason": f}) == json.dumps({"finish_reason": f.value})
        assert f"{f}" == f.value

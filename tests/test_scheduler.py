"""rtpcore.engine.core.scheduler: the BlockAllocator's invariants are errors and waiting callers are served in
turn (real threads); the Scheduler's plans keep the token budget, put decodes first, prefill in chunks,
take blocks on demand and preempt the newest request when none is free (docs/design.md §13)."""

from __future__ import annotations

import threading
import time

import pytest

from rtpcore.engine.core.block_pool import BlockAllocator
from rtpcore.engine.core.kv_manager import KVManager
from rtpcore.engine.core.request import Request, RequestStatus, StepPlan
from rtpcore.engine.core.scheduler import Scheduler
from rtpcore.engine.sample.params import SamplingParams
from rtpcore.errors import EngineClosedError, KVBlockError, RtpcoreError

PATIENCE_S = 120.0  # a bound against hanging, never a speed requirement


def wait_until_queued(a: BlockAllocator, n: int = 1) -> None:
    """Wait (bounded) until ``n`` callers wait in allocate_wait."""
    deadline = time.monotonic() + PATIENCE_S
    while a.num_waiting < n:
        assert time.monotonic() < deadline, "the waiter never queued"
        time.sleep(0.001)


def test_lowest_blocks_come_first_and_come_back_in_order() -> None:
    """Blocks are handed out lowest first; freed ones are handed out again lowest first."""
    a = BlockAllocator(6)
    assert a.allocate(2) == [0, 1] and a.allocate(3) == [2, 3, 4]
    a.free([3, 0])
    assert a.num_free == 3 and a.allocate(3) == [0, 3, 5]


def test_a_block_freed_twice_or_never_handed_out_is_a_kv_block_error() -> None:
    """Double frees, unknown blocks and over-allocation raise KVBlockError (an RtpcoreError), and change nothing."""
    a = BlockAllocator(4)
    blocks = a.allocate(2)
    a.free(blocks)
    with pytest.raises(KVBlockError) as excinfo:
        a.free(blocks)
    assert excinfo.value.blocks == (0, 1) and isinstance(excinfo.value, RtpcoreError)
    assert "KV blocks [0, 1] are not handed out" in str(excinfo.value)
    with pytest.raises(KVBlockError, match=r"KV blocks \[7\]"):
        a.free([7])
    held = a.allocate(1)
    with pytest.raises(KVBlockError):
        a.free(held + held)  # the same block twice in one call
    with pytest.raises(KVBlockError, match="cannot allocate 5 KV blocks: only 3 of 4 are free"):
        a.allocate(5)
    assert a.num_free == 3


def test_a_waiting_caller_gets_its_blocks_when_another_frees_them() -> None:
    """allocate_wait blocks until enough blocks are free, then returns them."""
    a = BlockAllocator(4)
    held = a.allocate(3)
    got: list[list[int]] = []
    waiter = threading.Thread(target=lambda: got.append(a.allocate_wait(2)))
    waiter.start()
    wait_until_queued(a)
    assert not got and waiter.is_alive()
    a.free(held)
    waiter.join(PATIENCE_S)
    assert not waiter.is_alive() and got == [[0, 1]]


def test_while_a_caller_waits_others_cannot_take_blocks_ahead_of_it() -> None:
    """try_allocate returns None while someone waits, so the waiter is not starved."""
    a = BlockAllocator(4)
    held = a.allocate(3)
    waiter = threading.Thread(target=a.allocate_wait, args=(4,))
    waiter.start()
    wait_until_queued(a)
    assert a.num_free == 1 and a.try_allocate(1) is None
    a.free(held)
    waiter.join(PATIENCE_S)
    assert not waiter.is_alive() and a.num_free == 0


def test_closing_wakes_waiters_with_engine_closed_error() -> None:
    """A caller waiting for blocks raises EngineClosedError when the allocator closes; later frees are no-ops."""
    a = BlockAllocator(2)
    held = a.allocate(2)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            a.allocate_wait(1)
        except RtpcoreError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    wait_until_queued(a)
    a.close()
    waiter.join(PATIENCE_S)
    assert not waiter.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], EngineClosedError)
    a.free(held)
    with pytest.raises(EngineClosedError):
        a.allocate(1)


# -- the scheduler's plans ---------------------------------------------------------------------


def request(name: str, prompt_len: int, max_tokens: int = 64) -> Request:
    return Request(
        request_id=name, tokens=list(range(1, prompt_len + 1)), prompt_len=prompt_len,
        params=SamplingParams(max_tokens=max_tokens), stop_ids=frozenset(), on_output=lambda out: None,
        arrival_time=0.0,
    )


def run(s: Scheduler) -> StepPlan:
    """Plan a step and commit it as a model would have computed it: each sampling sequence gets token 0."""
    plan = s.schedule()
    for seq in plan.seqs:
        s.commit(seq)
        if seq.samples:
            seq.request.tokens.append(0)
    return plan


def test_a_long_prompt_is_prefilled_in_chunks_within_the_budget_and_decodes_come_first() -> None:
    """Budget 8: a running request decodes first in every step; a 20-token prompt arriving later is
    prefilled in chunks of what the budget leaves (7, 7, 6), only the last one sampling."""
    s = Scheduler(KVManager(BlockAllocator(64), 4), max_batch_size=4, max_num_batched_tokens=8)
    short, long = request("short", 3), request("long", 20)
    s.waiting.append(short)
    assert [(q.start, q.num_tokens, q.samples) for q in run(s).seqs] == [(0, 3, True)]
    s.waiting.append(long)
    plans = [run(s) for _ in range(3)]
    steps = [[(q.request.request_id, q.start, q.num_tokens, q.samples) for q in p.seqs] for p in plans]
    assert steps == [
        [("short", 3, 1, True), ("long", 0, 7, False)],
        [("short", 4, 1, True), ("long", 7, 7, False)],
        [("short", 5, 1, True), ("long", 14, 6, True)],
    ]
    assert all(p.num_tokens <= 8 for p in plans) and plans[0].admitted == (long,)
    assert [q.request.request_id for q in run(s).seqs] == ["short", "long"]  # both decode now


def test_blocks_are_taken_on_demand_and_the_newest_request_is_preempted_when_none_is_free() -> None:
    """Two requests on 4 blocks of 4 tokens: each starts with its prompt's blocks; when the older needs
    a block and none is free, the newer is preempted (blocks freed, back at the head of the queue to
    recompute everything it holds)."""
    s = Scheduler(KVManager(BlockAllocator(4), 4), max_batch_size=4, max_num_batched_tokens=64)
    s.watermark = 0
    old, new = request("old", 8), request("new", 7)
    s.waiting.extend([old, new])
    run(s)
    assert (len(old.blocks), len(new.blocks)) == (2, 2) and s.kv.pool.num_free == 0
    plan = run(s)  # old decodes position 8: a third block, none free -> new is preempted
    assert [q.request for q in plan.seqs] == [old] and plan.preempted == (new,)
    assert new.blocks == [] and new.num_cached == 0 and s.waiting[0] is new and new.num_preemptions == 1
    assert len(old.blocks) == 3 and s.preemptions_total == 1
    assert len(new.tokens) == 8  # its prompt and its generated token, all to recompute


def test_a_request_that_would_preempt_itself_waits_and_the_running_batch_is_capped_by_the_budget() -> None:
    """When the older request takes the last free block, the newest one, needing a block too, is preempted
    itself (nobody newer to take one from) and the older one runs alone; and no more requests run than
    the budget can give a token each."""
    s = Scheduler(KVManager(BlockAllocator(3), 4), max_batch_size=8, max_num_batched_tokens=64)
    s.watermark = 0
    old, new = request("old", 4), request("new", 4)
    s.waiting.extend([old, new])
    run(s)
    plan = run(s)  # both decode position 4: old takes the free block, new has none left
    assert [q.request for q in plan.seqs] == [old] and plan.preempted == (new,)
    assert s.running == [old] and list(s.waiting) == [new] and s.kv.pool.num_free == 1
    capped = Scheduler(KVManager(BlockAllocator(64), 4), max_batch_size=8, max_num_batched_tokens=3)
    assert capped.max_running == 3
    spec = Scheduler(KVManager(BlockAllocator(64), 4), max_batch_size=8, max_num_batched_tokens=10,
                     num_speculative_tokens=4)
    assert spec.max_running == 2  # 1 + 4 tokens per decode


def test_prompt_chunks_holding_every_block_never_deadlock_the_newest_is_preempted() -> None:
    """Two running prompts partly prefilled, no decode and no free block: neither chunk can grow, so
    the newest is preempted and the older one goes on (a request alone always fits)."""
    s = Scheduler(KVManager(BlockAllocator(4), 4), max_batch_size=4, max_num_batched_tokens=64)
    s.watermark = 0
    a, b = request("a", 12), request("b", 12)
    s.running += [a, b]
    a.status = b.status = RequestStatus.RUNNING
    a.blocks, b.blocks = s.kv.pool.allocate(2), s.kv.pool.allocate(2)
    a.num_cached = b.num_cached = 8  # both hold 8 cached tokens and need a third block
    plan = s.schedule()
    assert plan.preempted == (b,) and [(q.request, q.start, q.num_tokens, q.samples) for q in plan.seqs] == [(a, 8, 4, True)]
    assert list(s.waiting) == [b] and b.blocks == [] and len(a.blocks) == 3


def test_a_new_request_waits_while_the_running_ones_need_the_free_blocks_to_grow() -> None:
    """100 blocks of 4: a 360-token prompt holds 90 and, decoding, 91. Its next 64 tokens need 16
    more, of which the headroom keeps at most a tenth of the pool (10) free: a one-block prompt
    arriving now waits (the 1% watermark alone would have admitted it, and the newcomer would be
    preempted a few steps later). When the running request is about to reach its max_tokens, it
    needs no more blocks and the newcomer is admitted at once."""
    for max_tokens, admitted in ((100, False), (3, True)):
        s = Scheduler(KVManager(BlockAllocator(100), 4), max_batch_size=8, max_num_batched_tokens=512)
        a = request("a", 360, max_tokens=max_tokens)
        s.waiting.append(a)
        run(s)
        assert len(a.blocks) == 90 and s.kv.num_free == 10
        b = request("b", 4)
        s.waiting.append(b)
        plan = run(s)
        assert len(a.blocks) == 91 and s.kv.num_free == (8 if admitted else 9)
        assert (plan.admitted == (b,)) is admitted and (list(s.waiting) == [b]) is not admitted
        assert not plan.preempted
    # the headroom is what the running requests lack, a partly prefilled prompt's rest included
    s = Scheduler(KVManager(BlockAllocator(100), 4), max_batch_size=8, max_num_batched_tokens=8)
    c = request("c", 40, max_tokens=1)
    s.waiting.append(c)
    run(s)  # 8 of its 40 prompt tokens: 2 blocks held, 8 more for the rest, +1 for its one new token
    assert s._growth(c) == 9


def test_twelve_requests_arriving_together_on_a_96_block_pool_all_run_then_the_newest_are_preempted() -> None:
    """The shape test_serve_load.py serves (12 prompts of 20 tokens, 700 new each, 96 blocks of 16,
    budget 256), here with all 12 queued before the first step: every one is admitted at once and
    decodes in the same steps until the pool fills; then the newest are preempted, the oldest go on,
    and nobody runs beyond what the blocks hold."""
    s = Scheduler(KVManager(BlockAllocator(96), 16), max_batch_size=256, max_num_batched_tokens=256)
    reqs = [request(f"r{i}", 20, max_tokens=700) for i in range(12)]
    s.waiting.extend(reqs)
    first = run(s)
    assert [q.request for q in first.seqs] == reqs and first.num_tokens == 240
    widths = [len(run(s).seqs) for _ in range(200)]
    assert widths[0] == 12  # the twelve decode together ...
    assert s.preemptions_total > 0  # ... until the pool fills, and the newest give way
    assert reqs[0] in s.running and all(r.status is RequestStatus.WAITING for r in s.waiting)
    assert sum(len(r.blocks) for r in s.running) <= 96


def test_a_paused_request_is_set_aside_without_blocks_and_passed_over_keeping_its_place() -> None:
    """A running request paused: the next plan sets it aside (its blocks released, waiting at the head,
    not a preemption), the requests behind it are admitted past it, and once resumed it is admitted
    again before later arrivals."""
    s = Scheduler(KVManager(BlockAllocator(8), 4), max_batch_size=1, max_num_batched_tokens=64)
    s.watermark = 0
    a, b, c = request("a", 8), request("b", 4), request("c", 4)
    s.waiting.append(a)
    run(s)
    assert s.running == [a] and len(a.blocks) == 2
    s.waiting.extend([b, c])
    a.paused = True
    plan = run(s)  # the one batch slot goes to b, past a
    assert [q.request for q in plan.seqs] == [b] and plan.preempted == () and s.preemptions_total == 0
    assert a.blocks == [] and a.num_cached == 0 and list(s.waiting) == [a, c] and a.status is RequestStatus.WAITING
    assert s.has_unpaused  # b runs, c waits
    s.running.remove(b)  # b ends
    b.status = RequestStatus.FINISHED
    s.kv.release(b)
    a.paused = False
    assert [q.request for q in run(s).seqs] == [a]  # resumed: first in line again, recomputing all it holds
    assert list(s.waiting) == [c] and a.num_cached == 9


def test_with_only_paused_requests_nothing_is_planned_and_nothing_preempted() -> None:
    s = Scheduler(KVManager(BlockAllocator(8), 4), max_batch_size=4, max_num_batched_tokens=64)
    a = request("a", 5)
    s.waiting.append(a)
    run(s)
    a.paused = True
    plan = run(s)
    assert plan.seqs == () and plan.preempted == () and not s.has_unpaused and s.kv.pool.num_free == 8

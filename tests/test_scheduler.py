"""rtpcore.engine.scheduler.BlockAllocator: invariants are errors, and waiting callers are served in turn (real threads)."""

from __future__ import annotations

import threading
import time

import pytest

from rtpcore.engine.scheduler import BlockAllocator
from rtpcore.errors import EngineClosedError, KVBlockError, RtpcoreError


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
    time.sleep(0.2)
    assert not got and waiter.is_alive()
    a.free(held)
    waiter.join(5)
    assert got == [[0, 1]]


def test_while_a_caller_waits_others_cannot_take_blocks_ahead_of_it() -> None:
    """try_allocate returns None while someone waits, so the waiter is not starved."""
    a = BlockAllocator(4)
    held = a.allocate(3)
    waiter = threading.Thread(target=a.allocate_wait, args=(4,))
    waiter.start()
    time.sleep(0.2)
    assert a.num_free == 1 and a.try_allocate(1) is None
    a.free(held)
    waiter.join(5)
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
    time.sleep(0.2)
    a.close()
    waiter.join(5)
    assert len(errors) == 1 and isinstance(errors[0], EngineClosedError)
    a.free(held)
    with pytest.raises(EngineClosedError):
        a.allocate(1)

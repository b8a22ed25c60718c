"""The KV blocks of one engine: a thread-safe free list that checks its invariants.

Every layer's pool (and a speculative draft's) holds the same number of blocks and a
sequence uses the same block ids in each, so one :class:`BlockAllocator` accounts for all
of them. The scheduler (``rtpcore.engine.scheduler``) takes blocks when a request is
admitted and as its sequence grows, and returns them when it finishes or is preempted.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

from rtpcore.errors import EngineClosedError, KVBlockError

__all__ = ["BlockAllocator", "blocks_for"]


def blocks_for(num_tokens: int, tokens_per_block: int) -> int:
    """Blocks that hold ``num_tokens`` cached tokens."""
    return -(-num_tokens // tokens_per_block)


class BlockAllocator:
    """The free list of an engine's KV blocks; lowest ids are handed out first.

    Thread-safe. Every invariant is checked with a :class:`~rtpcore.errors.KVBlockError`:
    a block is handed out at most once until it is freed, only handed-out blocks
    can be freed, and nobody takes more blocks than are free.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._used: set[int] = set()
        self._cond = threading.Condition()
        self._queue: deque[object] = deque()  # waiting callers, first come first served
        self._closed = False

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_waiting(self) -> int:
        """Callers waiting in :meth:`allocate_wait`."""
        with self._cond:
            return len(self._queue)

    def allocate(self, n: int) -> list[int]:
        """``n`` free blocks now; a KVBlockError when fewer are free."""
        with self._cond:
            self._check_open()
            if n > len(self._free):
                raise KVBlockError(f"cannot allocate {n} KV blocks: only {len(self._free)} of {self.num_blocks} are free")
            return self._take(n)

    def try_allocate(self, n: int) -> list[int] | None:
        """``n`` free blocks, or None when fewer are free or another caller waits
        (it is served first)."""
        with self._cond:
            self._check_open()
            if self._queue or n > len(self._free):
                return None
            return self._take(n)

    def allocate_wait(self, n: int) -> list[int]:
        """``n`` blocks, waiting in arrival order until they are free. The caller must
        hold no blocks (or they may never come back). EngineClosedError when the
        allocator is closed while waiting."""
        if n > self.num_blocks:
            raise KVBlockError(f"cannot allocate {n} KV blocks: the cache holds only {self.num_blocks}")
        ticket = object()
        with self._cond:
            self._check_open()
            self._queue.append(ticket)
            try:
                self._cond.wait_for(
                    lambda: self._closed or (self._queue[0] is ticket and n <= len(self._free))
                )
                self._check_open()
                return self._take(n)
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()  # the next waiter may be served now

    def free(self, blocks: Iterable[int]) -> None:
        """Return handed-out blocks; freeing one twice (or one never handed out) is a
        KVBlockError and frees none of them. After :meth:`close`, a no-op."""
        blocks = list(blocks)
        with self._cond:
            if self._closed:
                return
            bad = [b for b in blocks if b not in self._used]
            if bad or len(set(blocks)) != len(blocks):
                bad = bad or sorted(b for b in set(blocks) if blocks.count(b) > 1)
                raise KVBlockError(
                    f"KV blocks {bad} are not handed out (freed twice, or never allocated "
                    f"from this cache of {self.num_blocks} blocks)",
                    blocks=bad,
                )
            self._used.difference_update(blocks)
            self._free.extend(sorted(blocks, reverse=True))
            self._free.sort(reverse=True)  # lowest ids first, whatever order they came back in
            self._cond.notify_all()

    def close(self) -> None:
        """Refuse every later call; callers waiting in :meth:`allocate_wait` raise
        EngineClosedError."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _take(self, n: int) -> list[int]:
        if n < 0:
            raise KVBlockError(f"cannot allocate {n} KV blocks: the count must be >= 0")
        out = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        self._used.update(out)
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("this Engine is closed: its KV cache is released")

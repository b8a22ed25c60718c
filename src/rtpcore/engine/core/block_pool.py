"""The KV blocks of one engine: reference-counted, with a prefix cache of full blocks.

Every layer's pool (and a speculative draft's) holds the same number of blocks and a
sequence uses the same block ids in each, so one :class:`BlockAllocator` accounts for all
of them. The scheduler (``rtpcore.engine.core.scheduler``) takes blocks when a request is
admitted and as its sequence grows, and releases them when it finishes or is preempted.

Prefix caching (docs/design.md §14): a full block whose keys and values are computed can be
*registered* under its key (``rtpcore.engine.core.prefix_cache``). A later request whose prompt
starts with the same tokens *acquires* the cached blocks instead of computing them: a block
is shared by every request holding a reference to it, and nobody writes a shared block (a
request writes only the positions it has not cached, which lie past its full, shared ones).
A block whose last reference is released stays cached -- its key still finds it -- until a
block is needed and no empty one is left: then the least recently released cached block is
evicted (its key forgotten) and handed out afresh.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

from rtpcore.errors import EngineClosedError, KVBlockError

__all__ = ["BlockAllocator", "blocks_for"]


def blocks_for(num_tokens: int, tokens_per_block: int) -> int:
    """Blocks that hold ``num_tokens`` cached tokens."""
    return -(-num_tokens // tokens_per_block)


class BlockAllocator:
    """The blocks of an engine's KV cache; empty blocks are handed out lowest id first, then
    cached ones least recently used first.

    Thread-safe. Every invariant is checked with a :class:`~rtpcore.errors.KVBlockError`:
    only blocks someone holds can be released (each reference once), and nobody takes more
    blocks than are free. A block is *free* when nobody holds it: empty, or cached and
    evictable (:attr:`num_free` counts both, :attr:`num_cached_free` the cached ones).
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._empty = list(range(num_blocks - 1, -1, -1))  # no content worth keeping; lowest id last
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self._refs = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._cond = threading.Condition()
        self._queue: deque[object] = deque()  # waiting callers, first come first served
        self._closed = False
        self.evictions_total = 0

    @property
    def num_free(self) -> int:
        """Blocks nobody holds (empty, or cached and evictable)."""
        return len(self._empty) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache, held or not."""
        return len(self._block_of)

    @property
    def num_cached_free(self) -> int:
        """Cached blocks nobody holds: evicted first-released-first when blocks run out."""
        return len(self._evictable)

    @property
    def num_waiting(self) -> int:
        """Callers waiting in :meth:`allocate_wait`."""
        with self._cond:
            return len(self._queue)

    def refcount(self, block: int) -> int:
        """How many holders ``block`` has."""
        return self._refs[block]

    # -- taking and releasing ----------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """``n`` free blocks now, each with one reference; a KVBlockError when fewer are free."""
        with self._cond:
            self._check_open()
            if n > self.num_free:
                raise KVBlockError(f"cannot allocate {n} KV blocks: only {self.num_free} of {self.num_blocks} are free")
            return self._take(n)

    def try_allocate(self, n: int) -> list[int] | None:
        """``n`` free blocks, or None when fewer are free or another caller waits
        (it is served first)."""
        with self._cond:
            self._check_open()
            if self._queue or n > self.num_free:
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
                    lambda: self._closed or (self._queue[0] is ticket and n <= self.num_free)
                )
                self._check_open()
                return self._take(n)
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()  # the next waiter may be served now

    def free(self, blocks: Iterable[int]) -> None:
        """Release one reference to each block; a block nobody holds any more becomes free
        (cached ones stay findable until evicted). Releasing a block more often than it is
        held (or one never handed out) is a KVBlockError and releases none of them. Release a
        sequence's blocks first to last: its last blocks are then evicted first. After
        :meth:`close`, a no-op."""
        blocks = list(blocks)
        with self._cond:
            if self._closed:
                return
            counts: dict[int, int] = {}
            for b in blocks:
                counts[b] = counts.get(b, 0) + 1
            bad = sorted(
                b for b, c in counts.items()
                if not (isinstance(b, int) and 0 <= b < self.num_blocks) or c > self._refs[b]
            )
            if bad:
                raise KVBlockError(
                    f"KV blocks {bad} are not handed out (freed twice, or never allocated "
                    f"from this cache of {self.num_blocks} blocks)",
                    blocks=bad,
                )
            emptied = False
            for b in reversed(blocks):  # a sequence's tail is evicted before its head
                self._refs[b] -= 1
                if self._refs[b] == 0:
                    if b in self._key_of:
                        self._evictable[b] = None
                    else:
                        self._empty.append(b)
                        emptied = True
            if emptied:
                self._empty.sort(reverse=True)  # lowest ids first, whatever order they came back in
            self._cond.notify_all()

    # -- the prefix cache ----------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest run of ``keys`` from the first (a chain of block
        keys); takes no reference (:meth:`acquire` does)."""
        with self._cond:
            found: list[int] = []
            for key in keys:
                b = self._block_of.get(key)
                if b is None:
                    break
                found.append(b)
            return found

    def acquire(self, blocks: Iterable[int]) -> None:
        """Add a reference to each cached block (found by :meth:`lookup`); a free one is no
        longer evictable."""
        blocks = list(blocks)
        with self._cond:
            self._check_open()
            bad = [b for b in blocks if b not in self._key_of]
            if bad:
                raise KVBlockError(f"KV blocks {bad} are not cached: only cached blocks can be shared", blocks=bad)
            for b in blocks:
                if self._refs[b] == 0:
                    del self._evictable[b]
                self._refs[b] += 1

    def register(self, block: int, key: bytes) -> bool:
        """Cache a held, full block under ``key``; False (nothing changes) when ``key`` is
        cached already (another request computed the same block first) or the block is."""
        with self._cond:
            if self._closed:
                return False
            if self._refs[block] == 0:
                raise KVBlockError(f"KV block {block} is not held: only a held block can be cached", blocks=[block])
            if key in self._block_of or block in self._key_of:
                return False
            self._block_of[key] = block
            self._key_of[block] = key
            return True

    def reset_cache(self) -> int:
        """Forget every cached key (free cached blocks become empty); how many were cached."""
        with self._cond:
            n = len(self._block_of)
            self._block_of.clear()
            self._key_of.clear()
            self._empty.extend(self._evictable)
            self._evictable.clear()
            self._empty.sort(reverse=True)
            return n

    def close(self) -> None:
        """Refuse every later call; callers waiting in :meth:`allocate_wait` raise
        EngineClosedError."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _take(self, n: int) -> list[int]:
        if n < 0:
            raise KVBlockError(f"cannot allocate {n} KV blocks: the count must be >= 0")
        first = len(self._empty) - min(n, len(self._empty))  # every empty block before any cached one
        out = self._empty[first:][::-1]
        del self._empty[first:]
        while len(out) < n:  # evict the least recently released cached block
            b, _ = self._evictable.popitem(last=False)
            del self._block_of[self._key_of.pop(b)]
            self.evictions_total += 1
            out.append(b)
        for b in out:
            self._refs[b] = 1
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("this Engine is closed: its KV cache is released")

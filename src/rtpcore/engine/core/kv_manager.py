"""The KV blocks each request holds, between the scheduler's policy and the block pool.

The scheduler (``rtpcore.engine.core.scheduler``) decides who runs and how many tokens; the
:class:`KVManager` does the block accounting that follows: how many tokens a request can
compute with the blocks it holds and those free (:meth:`~KVManager.room`), taking blocks as its
sequence grows (:meth:`~KVManager.allocate`), the cached prefix it starts from when admitted
(:meth:`~KVManager.admit`, through the prefix cache's policy), adding its computed full blocks
to the cache (:meth:`~KVManager.cache_blocks`) and releasing them (:meth:`~KVManager.release`).
A request is given blocks only as it needs them: nothing is reserved for ``max_tokens``.

Blocks are reference-counted by the pool (``rtpcore.engine.core.block_pool``): releasing a
request's blocks drops its references, never a block another request reads.
"""

from __future__ import annotations

from rtpcore.engine.core.block_pool import BlockAllocator, blocks_for
from rtpcore.engine.core.prefix_cache import NoPrefixCache, PrefixCache
from rtpcore.engine.core.request import Request

__all__ = ["KVManager"]


class KVManager:
    """Block accounting for the requests of one engine over ``pool``, ``tokens_per_block``
    tokens a block; ``prefix_cache``: the prefix cache's policy (:class:`NoPrefixCache`, the
    default, caches nothing)."""

    def __init__(
        self, pool: BlockAllocator, tokens_per_block: int, prefix_cache: PrefixCache | NoPrefixCache | None = None,
    ):
        self.pool = pool
        self.tpb = tokens_per_block
        self.prefix_cache = prefix_cache if prefix_cache is not None else NoPrefixCache()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks nobody holds (empty, or cached and evictable)."""
        return self.pool.num_free

    def missing(self, r: Request, num_tokens: int) -> int:
        """Blocks ``r`` lacks to hold its first ``num_tokens`` tokens (0 when it has them)."""
        return max(0, blocks_for(num_tokens, self.tpb) - len(r.blocks))

    def room(self, r: Request, reserve: int = 0) -> int:
        """Tokens past ``r``'s cached ones that fit the blocks it holds and the free blocks
        beyond ``reserve`` (left for others)."""
        held = len(r.blocks) * self.tpb - r.num_cached
        return held + max(0, self.pool.num_free - reserve) * self.tpb

    def allocate(self, r: Request, num_tokens: int) -> None:
        """Give ``r`` the blocks of its first ``num_tokens`` tokens it does not hold yet (they
        must be free: :meth:`missing` against :attr:`num_free`)."""
        need = self.missing(r, num_tokens)
        if need > 0:
            r.blocks += self.pool.allocate(need)

    def admit(self, r: Request) -> int:
        """Give a request being admitted the cached blocks of its longest cached prefix; how
        many tokens they hold (its prefill starts after them)."""
        found = self.prefix_cache.find(self.pool, r)
        if found:
            self.pool.acquire(found)
            r.blocks = found
            r.num_cached = r.draft_cached = len(found) * self.tpb
            r.num_registered = len(found)
        return len(found) * self.tpb

    def count_hit(self, r: Request, hit: int) -> None:
        """``r`` was admitted with ``hit`` tokens found cached (the prefix cache's counters)."""
        self.prefix_cache.count(r, hit)

    def cache_blocks(self, r: Request) -> None:
        """Put ``r``'s computed full blocks in the prefix cache (when it is on)."""
        self.prefix_cache.register(self.pool, r)

    def release(self, r: Request) -> None:
        """Release ``r``'s blocks: it caches nothing now and will recompute from its first
        uncached block (found in the prefix cache again when it is readmitted)."""
        blocks, r.blocks = r.blocks, []
        if blocks:
            self.pool.free(blocks)
        r.num_cached = r.draft_cached = r.num_registered = 0

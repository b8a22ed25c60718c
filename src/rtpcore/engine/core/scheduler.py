"""Who runs in the next step, and how many tokens each (docs/design.md §13).

Policy, one :meth:`Scheduler.schedule` per step, within a budget of
``max_num_batched_tokens`` new tokens:

1. **Decodes first.** Every running request whose tokens are all cached but the last gets
   that token (1 + its proposals with a speculative draft). When its sequence needs a new
   KV block and none is free, the most recently admitted running request is *preempted*:
   its blocks are freed and it goes back to the head of the waiting queue, to recompute
   its prompt and generated tokens when readmitted (greedy output is unchanged: only its
   latency is). A request that would have to preempt itself waits instead.
2. **Then prefill**, in arrival order: the running requests whose prompt is only partly
   cached (chunked prefill), then waiting requests (preempted ones at the head). A prompt
   longer than the budget left is prefilled in chunks over several steps; a chunk takes
   only free blocks (prefill never preempts), and a waiting request is admitted only while
   a batch slot is free. First come, first served: a waiting request that cannot start
   blocks the ones behind it, so a long prompt is never starved by short ones.

A request is given the blocks of its prompt chunks as they are scheduled and one more
block each time its last one fills: nothing is reserved for ``max_tokens``.

Prefix caching (docs/design.md §14, when the scheduler has a ``namespace``): a request being
admitted first takes the longest chain of cached full blocks of its tokens (never the block
of its last token, which is always computed: its logits are needed), and its prefill starts
after them. After every step, each running request's newly computed full blocks join the
cache (:meth:`Scheduler.cache_blocks`), so requests running together share them too. Blocks
are reference-counted (``rtpcore.engine.core.block_pool``): preemption, abort and the end of a
request release references, never a block another request reads; a request never writes
a block it shares, since it computes only positions past the blocks it found cached. The engine
refuses at build time a pool that could not hold one ``max_model_len`` sequence, so a
request alone always fits.

Batch slots: at most ``max_batch_size`` requests run, and no more than the budget can
give a token each (``max_num_batched_tokens // (1 + num_speculative_tokens)``), so that
every running decode is scheduled in every step.

The scheduler is not thread-safe: the engine core calls it under its lock. It hands the
core an immutable :class:`StepPlan`; the core runs it and then :meth:`Scheduler.commit`\\ s
what was computed (a failed forward commits nothing, so its requests can run again).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import attrs
import torch

from rtpcore.engine.core.block_pool import BlockAllocator, blocks_for
from rtpcore.engine.core.prefix_cache import block_keys
from rtpcore.engine.sample.params import SamplingParams

__all__ = ["BlockAllocator", "Request", "ScheduledSeq", "Scheduler", "StepPlan", "blocks_for"]


@attrs.define(eq=False)
class Request:
    """One request's state: its tokens so far, its settings and its blocks."""

    request_id: str
    tokens: list[int]  # prompt + generated
    prompt_len: int
    params: SamplingParams
    stop_ids: frozenset[int]
    on_output: Callable[[Any], None]  # receives the request's RequestOutputs (rtpcore.engine.engine_core)
    arrival_time: float  # time.monotonic() when added
    generator: torch.Generator | None = None
    blocks: list[int] = attrs.field(factory=list)
    num_cached: int = 0  # tokens whose keys/values are in the cache
    finish_reason: str | None = None
    aborted: bool = False  # abort asked while the request was in a step
    num_sent: int = 0  # generated tokens already handed to on_output
    num_preemptions: int = 0
    # Speculative decoding (rtpcore.engine.sample.speculative): the draft's cached positions; where
    # this request's tokens sat in the last target forward (flat row, first position); and
    # whether the draft may propose (the last step sampled for this request, so both models
    # hold everything but the newest token).
    draft_cached: int = 0
    last_rows: tuple[int, int] = (0, 0)
    can_propose: bool = False
    # Prefix caching (rtpcore.engine.core.prefix_cache): the keys of the request's full blocks so
    # far, how many of its first blocks are in the cache, and the prompt tokens found cached at
    # its first admission (None before it; reported as usage's cached tokens).
    block_keys: list[bytes] = attrs.field(factory=list)
    num_registered: int = 0
    num_cached_tokens: int | None = None
    grammar: Any = None  # rtpcore.engine.sample.grammar.GrammarState of a constrained request

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_uncached(self) -> int:
        return len(self.tokens) - self.num_cached


@attrs.frozen(eq=False)
class ScheduledSeq:
    """One request's part of a step: positions ``start`` to ``start + num_tokens`` of its
    tokens (plus ``num_proposals`` draft tokens after them), and whether the step samples
    its next token (the chunk reaches its last known token)."""

    request: Request
    start: int
    num_tokens: int  # known tokens computed in this step
    samples: bool
    num_proposals: int = 0  # draft tokens to score after them (speculative decoding)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@attrs.frozen(eq=False)
class StepPlan:
    """What one step runs: the scheduled sequences, decodes first, then prefill chunks in
    arrival order; the requests admitted and preempted while planning it."""

    seqs: tuple[ScheduledSeq, ...]
    admitted: tuple[Request, ...] = ()
    preempted: tuple[Request, ...] = ()

    @property
    def is_mixed(self) -> bool:
        """Whether the step prefills (a prompt chunk, or a recomputation) while others decode."""
        decodes = any(s.num_tokens == 1 and s.start > 0 for s in self.seqs)
        return decodes and any(s.num_tokens > 1 or s.start == 0 for s in self.seqs)

    @property
    def num_tokens(self) -> int:
        """Tokens the step schedules, proposals included (at most the budget)."""
        return sum(s.num_tokens + s.num_proposals for s in self.seqs)


class Scheduler:
    """The waiting queue and the running batch of one engine (see the module docstring)."""

    def __init__(
        self,
        allocator: BlockAllocator,
        *,
        tokens_per_block: int,
        max_batch_size: int,
        max_num_batched_tokens: int,
        num_speculative_tokens: int = 0,
        draft_max_positions: int | None = None,
        namespace: bytes | None = None,
        has_draft: bool = False,
        lookahead: int = 0,
    ):
        """``namespace``: the prefix cache's root key (``rtpcore.engine.core.prefix_cache``), None to
        cache nothing. ``has_draft``: a speculative draft shares the blocks (a block is cached
        once both models computed it); ``lookahead``: 1 when the draft's bytes of a block depend
        on the token after it (a draft reading the target's hidden states)."""
        self.allocator = allocator
        self.namespace = namespace
        self.has_draft = has_draft
        self.lookahead = lookahead
        self.prefix_cache_queries_total = 0  # tokens of admitted requests looked up
        self.prefix_cache_hits_total = 0  # of those, tokens found cached
        self.tpb = tokens_per_block
        self.max_batch_size = max_batch_size
        self.budget = max_num_batched_tokens
        self.num_speculative_tokens = num_speculative_tokens
        self.draft_max_positions = draft_max_positions
        # Blocks a new request leaves free when admitted, for the running ones to grow into
        # (admitting into the last block would preempt the newcomer at the next step).
        self.watermark = max(1, allocator.num_blocks // 100)
        self.max_running = max(1, min(max_batch_size, max_num_batched_tokens // (1 + num_speculative_tokens)))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first
        self.preemptions_total = 0

    # -- planning --------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """The next step's plan (empty when nothing waits or runs); takes the blocks it needs.

        When running requests hold every block and none of them can be scheduled (prompt
        chunks, which never preempt, with no block left), the newest is preempted until one can:
        a request alone always fits the pool."""
        preempted: list[Request] = []
        while True:
            plan = self._plan(preempted)
            if plan.seqs or not self.running:
                return plan
            victim = self.running[-1]
            self.preempt(victim)
            preempted.append(victim)

    def _plan(self, preempted: list[Request]) -> StepPlan:
        budget = self.budget
        seqs: list[ScheduledSeq] = []
        for r in list(self.running):  # 1. decodes, oldest first; preemption takes the newest
            if r not in self.running or r.num_uncached != 1:
                continue
            if budget <= 0:  # cannot happen: max_running leaves every decode its tokens
                break
            k = min(self.proposals_for(r), budget - 1)
            if not self._grow(r, r.num_cached + 1 + k, preempted):
                continue  # r was the newest: it waits for its own blocks
            seqs.append(ScheduledSeq(r, r.num_cached, 1, True, k))
            budget -= 1 + k
        for r in self.running:  # 2. prompts partly cached (chunked prefill), in arrival order
            if r.num_uncached > 1 and budget > 0 and (n := self._chunk(r, budget)) > 0:
                seqs.append(ScheduledSeq(r, r.num_cached, n, r.num_cached + n == len(r.tokens)))
                budget -= n
        admitted: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_running:  # 3. waiting
            r = self.waiting[0]
            if r in preempted:
                break
            hit = self._reuse_cached(r)
            if (n := self._chunk(r, budget, reserve=self.watermark if self.running else 0)) == 0:
                self._release(r)  # it waits; what it found cached stays cached
                break
            self._count_hit(r, hit)
            self.waiting.popleft()
            self.running.append(r)
            admitted.append(r)
            seqs.append(ScheduledSeq(r, r.num_cached, n, r.num_cached + n == len(r.tokens)))
            budget -= n
        return StepPlan(tuple(seqs), tuple(admitted), tuple(preempted))

    def proposals_for(self, r: Request) -> int:
        """Draft tokens a decoding request may have scored this step: none before the last
        step sampled for it, never a token past ``max_tokens``, nor a draft input past the
        draft's context (its inputs reach position len(tokens) + k - 2)."""
        k = self.num_speculative_tokens
        if k == 0 or not r.can_propose or r.grammar is not None:  # constrained: no proposals
            return 0
        k = min(k, r.params.max_tokens - (len(r.tokens) - r.prompt_len) - 1)
        if self.draft_max_positions is not None:
            k = min(k, self.draft_max_positions - len(r.tokens) + 1)
        return max(k, 0)

    def _chunk(self, r: Request, budget: int, reserve: int = 0) -> int:
        """How many of ``r``'s uncached tokens to prefill now: within ``budget`` and the blocks
        it holds or that are free beyond ``reserve`` (taken here)."""
        held = len(r.blocks) * self.tpb - r.num_cached
        room = held + max(0, self.allocator.num_free - reserve) * self.tpb
        n = min(r.num_uncached, budget, room)
        if n > 0:
            self._take(r, r.num_cached + n)
        return max(n, 0)

    def _grow(self, r: Request, num_tokens: int, preempted: list[Request]) -> bool:
        """Give ``r`` the blocks of its first ``num_tokens`` tokens, preempting the newest
        running requests while none is free; False when ``r`` itself had to go."""
        need = blocks_for(num_tokens, self.tpb) - len(r.blocks)
        while need > self.allocator.num_free:
            victim = self.running[-1]
            self.preempt(victim)
            preempted.append(victim)
            if victim is r:
                return False
        self._take(r, num_tokens)
        return True

    def _reuse_cached(self, r: Request) -> int:
        """Give a request being admitted the cached blocks of its longest cached prefix (its
        last token excluded); how many tokens they hold."""
        if self.namespace is None:
            return 0
        usable = (len(r.tokens) - 1) // self.tpb  # the last token's block is always computed
        found = self.allocator.lookup(self._keys(r)[:usable])
        if found:
            self.allocator.acquire(found)
            r.blocks = found
            r.num_cached = r.draft_cached = len(found) * self.tpb
            r.num_registered = len(found)
        return len(found) * self.tpb

    def _count_hit(self, r: Request, hit: int) -> None:
        if self.namespace is None:
            return
        self.prefix_cache_queries_total += len(r.tokens)
        self.prefix_cache_hits_total += hit
        if r.num_cached_tokens is None:
            r.num_cached_tokens = min(hit, r.prompt_len)

    def _keys(self, r: Request) -> list[bytes]:
        """``r``'s block keys, extended to the full blocks its tokens now make."""
        assert self.namespace is not None
        keys = r.block_keys
        if (len(r.tokens) - self.lookahead) // self.tpb > len(keys):
            parent = keys[-1] if keys else self.namespace
            keys += block_keys(r.tokens, self.tpb, parent, start=len(keys), lookahead=self.lookahead)
        return keys

    def cache_blocks(self, r: Request) -> None:
        """Put ``r``'s full blocks that both models (with a draft) have computed in the prefix
        cache. A block whose key is cached already (another request computed the same prefix
        in the same steps) stays the request's own."""
        if self.namespace is None:
            return
        limit = min(r.num_cached, r.draft_cached) if self.has_draft else r.num_cached
        full = min(limit // self.tpb, len(r.blocks))
        if full <= r.num_registered:
            return
        keys = self._keys(r)
        full = min(full, len(keys))
        for i in range(r.num_registered, full):
            self.allocator.register(r.blocks[i], keys[i])
        r.num_registered = max(r.num_registered, full)

    def _release(self, r: Request) -> None:
        """Release ``r``'s blocks: it caches nothing now and will recompute from its first
        uncached block (found in the cache again when it is readmitted)."""
        blocks, r.blocks = r.blocks, []
        if blocks:
            self.allocator.free(blocks)
        r.num_cached = r.draft_cached = r.num_registered = 0

    def _take(self, r: Request, num_tokens: int) -> None:
        need = blocks_for(num_tokens, self.tpb) - len(r.blocks)
        if need > 0:
            r.blocks += self.allocator.allocate(need)

    # -- state changes -----------------------------------------------------------------------

    def commit(self, seq: ScheduledSeq, accepted: int = 0) -> None:
        """A step computed ``seq``: its tokens (and ``accepted`` of its proposals) are cached."""
        r = seq.request
        r.num_cached = seq.end + accepted
        r.can_propose = seq.samples

    def preempt(self, r: Request) -> None:
        """Free a running request's blocks; it waits at the head of the queue to recompute
        everything it holds (prompt and generated tokens)."""
        self.running.remove(r)
        self._release(r)
        r.can_propose = False
        r.num_preemptions += 1
        self.preemptions_total += 1
        self.waiting.appendleft(r)

    def retire(self, r: Request, *, cache: bool = True) -> None:
        """Take ``r`` out of the queue or the batch and release its blocks, its computed
        full ones cached first (unless ``cache`` is False: a request that failed)."""
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        if cache:
            self.cache_blocks(r)
        self._release(r)

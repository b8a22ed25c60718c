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

   **Admission headroom.** While others run, a waiting request is admitted only if its chunk
   leaves free the blocks the running requests need for their next :data:`HEADROOM_TOKENS`
   tokens each (the rest of a partly prefilled prompt included; never past a request's
   ``max_tokens``), at most a tenth of the pool and at least :attr:`Scheduler.watermark`.
   Admitting into the last free blocks preempts a running request within a few steps, and a
   preemption recomputes everything it held: on the load scenario of benchmarks/bench_serve.py
   (64 requests on a pool a quarter of their worst case) a 1% watermark alone preempted 54-58
   times and recomputed 31% more tokens than the requests needed; this headroom, replayed over
   the same arrivals, preempts 13 times (docs/benchmarks.md). Nothing is reserved: blocks are
   still taken on demand, and a small pool (under ten blocks) admits as before.

The block accounting is the KV manager's (``rtpcore.engine.core.kv_manager``): a request is
given the blocks of its prompt chunks as they are scheduled and one more block each time its
last one fills: nothing is reserved for ``max_tokens``.

Prefix caching (docs/design.md §14, when the KV manager's prefix cache is on): a request being
admitted first takes the longest chain of cached full blocks of its tokens (never the block
of its last token, which is always computed: its logits are needed), and its prefill starts
after them. After every step, each running request's newly computed full blocks join the
cache (``KVManager.cache_blocks``, called by the engine core), so requests running together
share them too. Blocks are reference-counted (``rtpcore.engine.core.block_pool``): preemption,
abort and the end of a request release references, never a block another request reads; a
request never writes a block it shares, since it computes only positions past the blocks it
found cached. The engine refuses at build time a pool that could not hold one
``max_model_len`` sequence, so a request alone always fits.

Paused requests (a stream whose client reads nothing, ``EngineCore.set_paused``) are not
scheduled: a running one is set aside at the start of the next plan -- its blocks released (its
computed full blocks stay in the prefix cache), back among the waiting -- and a waiting one is
passed over by admission, keeping its place for when it is resumed. A paused request holds
neither a batch slot nor a block, so streams nobody reads cannot starve the others.

Batch slots: at most ``max_batch_size`` requests run, and no more than the budget can
give a token each (``max_num_batched_tokens // (1 + num_speculative_tokens)``), so that
every running decode is scheduled in every step.

The scheduler is not thread-safe: the engine core calls it under its lock. It hands the
core an immutable :class:`StepPlan`; the core runs it and then :meth:`Scheduler.commit`\\ s
what was computed (a failed forward commits nothing, so its requests can run again).
"""

from __future__ import annotations

from collections import deque

from rtpcore.engine.core.block_pool import blocks_for
from rtpcore.engine.core.kv_manager import KVManager
from rtpcore.engine.core.request import Request, RequestStatus, ScheduledSeq, StepPlan

__all__ = ["HEADROOM_TOKENS", "Scheduler"]

# Tokens of growth per running request a new admission leaves blocks for (the module docstring).
HEADROOM_TOKENS = 64


class Scheduler:
    """The waiting queue and the running batch of one engine (see the module docstring)."""

    def __init__(
        self,
        kv: KVManager,
        *,
        max_batch_size: int,
        max_num_batched_tokens: int,
        num_speculative_tokens: int = 0,
        draft_max_positions: int | None = None,
    ):
        """``kv``: the KV manager whose blocks the requests get (and its prefix cache)."""
        self.kv = kv
        self.tpb = kv.tpb
        self.max_batch_size = max_batch_size
        self.budget = max_num_batched_tokens
        self.num_speculative_tokens = num_speculative_tokens
        self.draft_max_positions = draft_max_positions
        # Blocks a new request leaves free when admitted, for the running ones to grow into
        # (admitting into the last block would preempt the newcomer at the next step).
        self.watermark = max(1, kv.num_blocks // 100)
        self.headroom_cap = kv.num_blocks // 10  # the most blocks the admission headroom keeps free
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
        for r in [r for r in self.running if r.paused]:
            self.set_aside(r)
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
            if r.status is not RequestStatus.RUNNING or r.num_uncached != 1:  # preempted meanwhile
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
        skipped = 0  # paused requests at the head of the queue, passed over
        growth = sum(self._growth(r) for r in self.running) if self.waiting and budget > 0 else 0
        while len(self.waiting) > skipped and budget > 0 and len(self.running) < self.max_running:  # 3. waiting
            r = self.waiting[skipped]
            if r.paused:
                skipped += 1
                continue
            if r in preempted:
                break
            hit = self.kv.admit(r)
            reserve = max(self.watermark, min(growth, self.headroom_cap)) if self.running else 0
            if (n := self._chunk(r, budget, reserve=reserve)) == 0:
                self.kv.release(r)  # it waits; what it found cached stays cached
                break
            self.kv.count_hit(r, hit)
            if skipped:
                del self.waiting[skipped]
            else:
                self.waiting.popleft()
            self.running.append(r)
            r.status = RequestStatus.RUNNING
            admitted.append(r)
            seqs.append(ScheduledSeq(r, r.num_cached, n, r.num_cached + n == len(r.tokens)))
            budget -= n
            growth += self._growth(r)
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

    def _growth(self, r: Request) -> int:
        """Blocks running ``r`` still lacks for its next :data:`HEADROOM_TOKENS` tokens (its
        prompt's rest included), never past its ``max_tokens``."""
        tokens = min(len(r.tokens) + HEADROOM_TOKENS, r.prompt_len + r.params.max_tokens)
        return max(0, blocks_for(tokens, self.tpb) - len(r.blocks))

    def _chunk(self, r: Request, budget: int, reserve: int = 0) -> int:
        """How many of ``r``'s uncached tokens to prefill now: within ``budget`` and the blocks
        it holds or that are free beyond ``reserve`` (taken here)."""
        n = min(r.num_uncached, budget, self.kv.room(r, reserve))
        if n > 0:
            self.kv.allocate(r, r.num_cached + n)
        return max(n, 0)

    def _grow(self, r: Request, num_tokens: int, preempted: list[Request]) -> bool:
        """Give ``r`` the blocks of its first ``num_tokens`` tokens, preempting the newest
        running requests while none is free; False when ``r`` itself had to go."""
        while self.kv.missing(r, num_tokens) > self.kv.num_free:
            victim = self.running[-1]
            self.preempt(victim)
            preempted.append(victim)
            if victim is r:
                return False
        self.kv.allocate(r, num_tokens)
        return True

    # -- state changes -----------------------------------------------------------------------

    def commit(self, seq: ScheduledSeq, accepted: int = 0) -> None:
        """A step computed ``seq``: its tokens (and ``accepted`` of its proposals) are cached."""
        r = seq.request
        r.num_cached = seq.end + accepted
        r.can_propose = seq.samples

    def preempt(self, r: Request) -> None:
        """Free a running request's blocks; it waits at the head of the queue to recompute
        everything it holds (prompt and generated tokens)."""
        self.set_aside(r)
        r.num_preemptions += 1
        self.preemptions_total += 1

    def set_aside(self, r: Request) -> None:
        """Take a running request out of the batch: its blocks released, it waits at the head
        of the queue (a paused request, or a preempted one, which :meth:`preempt` counts)."""
        self.running.remove(r)
        self.kv.release(r)
        r.status = RequestStatus.WAITING
        r.can_propose = False
        self.waiting.appendleft(r)

    @property
    def has_unpaused(self) -> bool:
        """Whether any request that runs or waits is not paused (there is work to schedule)."""
        return any(not r.paused for r in self.running) or any(not r.paused for r in self.waiting)

    def add(self, r: Request) -> None:
        """Queue a new request at the tail of the waiting queue."""
        r.status = RequestStatus.WAITING
        self.waiting.append(r)

    def retire(self, r: Request, *, cache: bool = True) -> None:
        """Take ``r`` out of the queue or the batch and release its blocks, its computed
        full ones cached first (unless ``cache`` is False: a request that failed)."""
        if r.status is RequestStatus.RUNNING:
            self.running.remove(r)
        elif r.status is RequestStatus.WAITING and r in self.waiting:
            self.waiting.remove(r)
        r.status = RequestStatus.FINISHED
        if cache:
            self.kv.cache_blocks(r)
        self.kv.release(r)

"""Which requests run in the next step, and the ``ForwardBatch`` that runs them.

Policy (reservation, no preemption): the oldest waiting request is admitted when a
batch slot is free and the allocator holds every block it can ever need
(``ceil((len(prompt) + max_tokens - 1) / tokens_per_block)``; the last new token
is never written to the cache). An admitted request therefore always finishes
(or is aborted); the others wait, first come first served -- a request that does
not fit blocks the ones behind it, so a long prompt is never starved by short
ones -- until finishing requests return their blocks. A request that cannot fit
even in an empty cache is refused when it is added.

Each step runs every running request in one ragged ``ForwardBatch``: the whole
prompt of each request admitted in this step (its prefill) and the last token of
each other one (its decode).

One :class:`BlockAllocator` holds an engine's blocks; it is thread-safe and checks
its invariants (``allocate_wait`` lets a caller holding no blocks wait for some).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch

from rtpcore.engine.batch import ForwardBatch
from rtpcore.engine.sampling import SamplingParams
from rtpcore.errors import EngineClosedError, KVBlockError

__all__ = ["BlockAllocator", "Request", "Scheduler", "blocks_needed"]


def blocks_needed(prompt_len: int, max_new_tokens: int, tokens_per_block: int) -> int:
    """Blocks a sequence can occupy over its whole life."""
    cached = prompt_len + max(max_new_tokens, 1) - 1
    return -(-cached // tokens_per_block)


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


@attrs.define(eq=False)
class Request:
    """One request's state: its tokens so far, its settings and its reserved blocks."""

    request_id: str
    tokens: list[int]  # prompt + generated
    prompt_len: int
    params: SamplingParams
    stop_ids: frozenset[int]
    on_output: Callable[[Any], None]  # receives the request's RequestOutputs (rtpcore.engine.core)
    arrival_time: float  # time.monotonic() when added
    generator: torch.Generator | None = None
    blocks: list[int] = attrs.field(factory=list)
    num_cached: int = 0  # tokens whose keys/values are in the cache
    finish_reason: str | None = None
    aborted: bool = False  # abort asked while the request was in a step
    num_sent: int = 0  # generated tokens already handed to on_output
    # Speculative decoding (rtpcore.engine.speculative): the draft's cached positions, and
    # where this request's tokens sat in the last target forward (flat row, first position).
    draft_cached: int = 0
    last_rows: tuple[int, int] = (0, 0)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


class Scheduler:
    """The waiting queue and the running batch of one engine (not thread-safe: the
    engine core calls it under its lock)."""

    def __init__(
        self, allocator: BlockAllocator, *, tokens_per_block: int, max_batch_size: int, device: torch.device | str = "cpu"
    ):
        self.allocator = allocator
        self.tpb = tokens_per_block
        self.max_batch_size = max_batch_size
        self.device = torch.device(device)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._tables: tuple[list[Request], torch.Tensor] | None = None  # the last batch's rows, its table

    def admit(self) -> list[Request]:
        """Move the oldest waiting requests into the running batch while a slot and
        their blocks are free; never waits."""
        new: list[Request] = []
        while self.waiting and len(self.running) < self.max_batch_size:
            r = self.waiting[0]
            blocks = self.allocator.try_allocate(blocks_needed(r.prompt_len, r.params.max_tokens, self.tpb))
            if blocks is None:
                break
            self.waiting.popleft()
            r.blocks = blocks
            self.running.append(r)
            new.append(r)
        return new

    def batch(
        self, proposals: Mapping[Request, Sequence[int]] | None = None, seqs: Sequence[Request] | None = None
    ) -> ForwardBatch:
        """Every running request's tokens not yet cached, in one ragged batch (the
        whole prompt of a new request, the last token of a decoding one).

        ``proposals`` (speculative decoding): draft tokens that follow a decoding request's
        last token in the same batch; the batch then asks for the logits of the request's
        last token and of each proposal (``logits_indices``), and one row for every
        other request. ``seqs``: these requests instead of the running batch."""
        seqs = self.running if seqs is None else seqs
        spans: list[tuple[int, list[int]]] = []
        rows: list[int] = []
        offset = 0
        for s in seqs:
            start, end = s.num_cached, len(s.tokens)
            drafted = list(proposals.get(s, ())) if proposals else []
            spans.append((start, s.tokens[start:end] + drafted))
            s.last_rows = (offset, start)
            offset += end - start + len(drafted)
            rows += range(offset - 1 - len(drafted), offset)
            s.num_cached = end
        logits_rows = rows if proposals and len(rows) > len(spans) else None
        return self._make(seqs, spans, logits_rows=logits_rows)

    def draft_batch(
        self,
        seqs: Sequence[Request],
        step: int,
        proposals: Mapping[Request, Sequence[int]],
        *,
        shift: int = 0,
        previous: Mapping[Request, int] | None = None,
    ) -> ForwardBatch:
        """The draft's batch for proposal ``step`` (0-based) of ``seqs``.

        Step 0 catches the draft's cache up with each request (positions ``draft_cached`` to
        the last token); a later step feeds the previous proposal. ``shift`` 1 is for drafts
        that read the target's hidden states (multi-token prediction): cache position p holds
        token p + 1 with the hidden state of position p, taken from the last target forward
        (step 0) or from the draft's own previous forward, row ``previous[s]`` (later steps).
        """
        spans: list[tuple[int, list[int]]] = []
        hidden: list[int] = []
        for s in seqs:
            if step == 0:
                start = s.draft_cached
                ids = s.tokens[start + shift :]
                base, first = s.last_rows
                hidden += [base + p - first for p in range(start, start + len(ids))]
            else:
                start = len(s.tokens) - shift + step - 1
                ids = [proposals[s][step - 1]]
                hidden.append(previous[s] if previous else 0)
            spans.append((start, ids))
        return self._make(seqs, spans, hidden_rows=hidden if shift else None, hidden_source="target" if step == 0 else "self")

    def _make(
        self,
        seqs: Sequence[Request],
        spans: Sequence[tuple[int, Sequence[int]]],
        *,
        logits_rows: Sequence[int] | None = None,
        hidden_rows: Sequence[int] | None = None,
        hidden_source: str = "target",
    ) -> ForwardBatch:
        """A batch of ``spans`` (first position, token ids) of ``seqs``, one each. Every index
        tensor comes from one host buffer: on a GPU, one pinned, non-blocking copy (no host
        synchronisation)."""
        tpb = self.tpb
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        lens: list[int] = []
        context: list[int] = []
        for s, (start, tokens) in zip(seqs, spans, strict=True):
            end = start + len(tokens)
            ids += tokens
            positions += range(start, end)
            slots += [s.blocks[p // tpb] * tpb + p % tpb for p in range(start, end)]
            lens.append(end - start)
            context.append(end)
        parts = {"input_ids": ids, "positions": positions, "slots": slots, "context_lens": context}
        if logits_rows is not None:
            parts["logits_indices"] = list(logits_rows)
        if hidden_rows is not None:
            parts["hidden_rows"] = list(hidden_rows)
        flat = self._to_device(torch.tensor([i for part in parts.values() for i in part], dtype=torch.int64))
        views = dict(zip(parts, flat.split([len(part) for part in parts.values()]), strict=True))
        return ForwardBatch(
            query_lens=tuple(lens),
            block_tables=self._block_tables(seqs),
            tokens_per_block=tpb,
            hidden_source=hidden_source,
            host_max_context_len=max(context),
            **views,
        )

    def retire(self, r: Request) -> None:
        """Take ``r`` out of the queue or the batch and return its blocks."""
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        blocks, r.blocks = r.blocks, []
        if blocks:
            self.allocator.free(blocks)

    def _block_tables(self, seqs: Sequence[Request]) -> torch.Tensor:
        """(B, max_blocks) int64, rows padded with 0; reused while the running set is unchanged."""
        last = self._tables
        if last is not None and len(last[0]) == len(seqs) and all(a is b for a, b in zip(last[0], seqs, strict=True)):
            return last[1]
        width = max(len(s.blocks) for s in seqs)
        rows = [s.blocks + [0] * (width - len(s.blocks)) for s in seqs]
        tables = self._to_device(torch.tensor(rows, dtype=torch.int64))
        self._tables = (list(seqs), tables)
        return tables

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` on the scheduler's device: pinned, then copied without blocking."""
        if self.device.type == "cpu":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

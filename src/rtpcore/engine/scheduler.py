"""Which sequences run in the next step, and the ``ForwardBatch`` that runs them.

Policy (reservation, no preemption): a prompt is admitted when a batch slot is
free and the allocator holds every block the sequence can ever need
(``ceil((len(prompt) + max_new_tokens - 1) / tokens_per_block)``; the last new
token is never written to the cache). An admitted sequence therefore always
finishes; the others wait, first come first served, until a finishing sequence
returns its blocks. A request that cannot fit even in an empty cache is
rejected by the engine before anything runs.

One :class:`BlockAllocator` is shared by every ``generate`` call of an engine,
from any thread. A call with running sequences only *tries* to admit more; a
call with none *waits* (:meth:`BlockAllocator.allocate_wait`) until the blocks
its next prompt needs are free, in arrival order. While a call waits, the others
admit nothing new, so their running sequences finish, free their blocks and the
waiter is served: a prompt that fits an empty cache always runs eventually.

Each step is either one batched prefill of the newly admitted prompts (ragged)
or one decode step of every running sequence.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence

import attrs
import torch

from rtpcore.engine.batch import ForwardBatch
from rtpcore.errors import EngineClosedError, KVBlockError

__all__ = ["BlockAllocator", "RunningSequence", "Scheduler", "blocks_needed"]


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


@attrs.define
class RunningSequence:
    """One prompt being generated: its tokens so far and its reserved blocks."""

    index: int  # position of the prompt in the generate() call
    tokens: list[int]  # prompt + generated
    prompt_len: int
    blocks: list[int]
    num_cached: int = 0  # tokens whose keys/values are in the cache

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


class Scheduler:
    """Admits prompts, builds prefill and decode batches, retires finished sequences."""

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        stop_token_ids: frozenset[int],
        allocator: BlockAllocator,
        tokens_per_block: int,
        max_batch_size: int,
        device: torch.device | str = "cpu",
    ):
        self.prompts = prompts
        self.max_new_tokens = max_new_tokens
        self.stop = stop_token_ids
        self.allocator = allocator
        self.tpb = tokens_per_block
        self.max_batch_size = max_batch_size
        self.device = device
        self.waiting = deque(range(len(prompts)))
        self.running: list[RunningSequence] = []
        self.results: list[list[int]] = [[] for _ in prompts]
        self._tables: tuple[tuple[int, ...], torch.Tensor] | None = None

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def admit(self) -> list[RunningSequence]:
        """Move waiting prompts into the running set while slots and blocks allow.

        With nothing running, waits for the next prompt's blocks (other calls on
        the same allocator hold them), so this returns at least one sequence
        whenever any is waiting.
        """
        new: list[RunningSequence] = []
        while self.waiting and len(self.running) + len(new) < self.max_batch_size:
            i = self.waiting[0]
            need = blocks_needed(len(self.prompts[i]), self.max_new_tokens, self.tpb)
            if self.running or new:
                blocks = self.allocator.try_allocate(need)
                if blocks is None:
                    break
            else:  # holding no blocks: safe to wait for them
                blocks = self.allocator.allocate_wait(need)
            self.waiting.popleft()
            prompt = list(self.prompts[i])
            new.append(RunningSequence(i, prompt, len(prompt), blocks))
        self.running += new
        return new

    def prefill_batch(self, seqs: Sequence[RunningSequence]) -> ForwardBatch:
        """All prompt tokens of ``seqs``, concatenated."""
        lens = [len(s.tokens) for s in seqs]
        ids = torch.tensor([t for s in seqs for t in s.tokens], dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])  # (T,)
        tables = self._block_tables(seqs)  # (B, max_blocks)
        row = torch.repeat_interleave(torch.arange(len(seqs), device=self.device), torch.tensor(lens, device=self.device))
        slots = tables[row, positions // self.tpb] * self.tpb + positions % self.tpb
        for s in seqs:
            s.num_cached = len(s.tokens)
        return ForwardBatch(
            input_ids=ids,
            positions=positions,
            slots=slots,
            query_lens=tuple(lens),
            context_lens=torch.tensor(lens, dtype=torch.int64, device=self.device),
            block_tables=tables,
            tokens_per_block=self.tpb,
        )

    def decode_batch(self) -> ForwardBatch:
        """The last token of every running sequence (each has one not yet cached)."""
        seqs = self.running
        ids = torch.tensor([s.tokens[-1] for s in seqs], dtype=torch.int64, device=self.device)
        positions = torch.tensor([s.num_cached for s in seqs], dtype=torch.int64, device=self.device)  # (B,)
        tables = self._block_tables(seqs)
        slots = tables.gather(1, (positions // self.tpb)[:, None]).squeeze(1) * self.tpb + positions % self.tpb
        for s in seqs:
            s.num_cached += 1
        return ForwardBatch(
            input_ids=ids,
            positions=positions,
            slots=slots,
            query_lens=(1,) * len(seqs),
            context_lens=positions + 1,
            block_tables=tables,
            tokens_per_block=self.tpb,
        )

    def record(self, seqs: Sequence[RunningSequence], tokens: torch.Tensor) -> None:
        """Append one sampled token to each of ``seqs``; retire the finished ones."""
        finished = False
        for s, t in zip(seqs, tokens.tolist(), strict=True):
            s.tokens.append(t)
            if t in self.stop or len(s.tokens) - s.prompt_len >= self.max_new_tokens:
                self.results[s.index] = s.generated
                self.allocator.free(s.blocks)
                s.blocks = []
                finished = True
        if finished:
            self.running = [s for s in self.running if s.blocks]

    def release_all(self) -> None:
        """Return every reserved block (after an error mid-generation)."""
        for s in self.running:
            self.allocator.free(s.blocks)
            s.blocks = []
        self.running = []

    def _block_tables(self, seqs: Sequence[RunningSequence]) -> torch.Tensor:
        """(B, max_blocks) int64, rows padded with 0; reused while the running set is unchanged."""
        key = tuple(s.index for s in seqs)
        if self._tables is not None and self._tables[0] == key:
            return self._tables[1]
        width = max(len(s.blocks) for s in seqs)
        rows = [s.blocks + [0] * (width - len(s.blocks)) for s in seqs]
        tables = torch.tensor(rows, dtype=torch.int64, device=self.device)
        self._tables = (key, tables)
        return tables

"""Which sequences run in the next step, and the ``ForwardBatch`` that runs them.

Policy (reservation, no preemption): a prompt is admitted when a batch slot is
free and the allocator holds every block the sequence can ever need
(``ceil((len(prompt) + max_new_tokens - 1) / tokens_per_block)``; the last new
token is never written to the cache). An admitted sequence therefore always
finishes; the others wait, first come first served, until a finishing sequence
returns its blocks. A request that cannot fit even in an empty cache is
rejected by the engine before anything runs.

Each step is either one batched prefill of the newly admitted prompts (ragged)
or one decode step of every running sequence.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

import attrs
import torch

from rtpcore.batch import ForwardBatch

__all__ = ["BlockAllocator", "RunningSequence", "Scheduler", "blocks_needed"]


def blocks_needed(prompt_len: int, max_new_tokens: int, tokens_per_block: int) -> int:
    """Blocks a sequence can occupy over its whole life."""
    cached = prompt_len + max(max_new_tokens, 1) - 1
    return -(-cached // tokens_per_block)


class BlockAllocator:
    """A free list of block ids; lowest ids are handed out first."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self._free), "caller checks num_free first"
        out = self._free[-n:][::-1] if n else []
        del self._free[len(self._free) - n :]
        return out

    def free(self, blocks: Iterable[int]) -> None:
        self._free.extend(sorted(blocks, reverse=True))
        assert len(self._free) <= self.num_blocks, "a block was freed twice"


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
        """Move waiting prompts into the running set while slots and blocks allow."""
        new: list[RunningSequence] = []
        while self.waiting and len(self.running) + len(new) < self.max_batch_size:
            i = self.waiting[0]
            need = blocks_needed(len(self.prompts[i]), self.max_new_tokens, self.tpb)
            if need > self.allocator.num_free:
                break
            self.waiting.popleft()
            prompt = list(self.prompts[i])
            new.append(RunningSequence(i, prompt, len(prompt), self.allocator.allocate(need)))
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

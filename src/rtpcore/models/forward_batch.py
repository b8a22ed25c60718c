"""``ForwardBatch``: what a model's forward receives for one engine step (forward contract 2).

The new tokens of every scheduled sequence are concatenated into one flat batch of T
tokens: a decoding sequence contributes its last token (1 + its proposals under
speculative decoding), a prefilling one a chunk of its prompt (chunked prefill: a long
prompt takes several steps). Nothing is padded: attention runs per sequence over its
own paged context (``rtpcore.models.attention.paged_attention`` is the reusable
implementation), so a step's memory grows with its tokens and the contexts it reads,
never with B x (longest new span) x (longest context).

Contract 2 differs from contract 1 (padded, before the token-budget scheduler) in what
a model must honour:

* ``logits_indices`` may select fewer rows than there are sequences: a prompt chunk that
  does not end its prompt samples nothing, so it gets no logits row. A model returns
  exactly the rows ``logits_index`` names (every sequence's last token when it is None).
* A sequence's new tokens need not start at position 0 nor end its prompt: the chunk's
  queries attend to the cached keys of the earlier chunks too (``context_lens`` counts
  them, the chunk included).
* The padded helpers of contract 1 (``to_padded``, ``from_padded``, ``attention_mask``,
  ``padded_index``) are gone; ``query_start_loc``, ``host_query_starts`` and
  ``host_context_lens`` describe the ragged layout instead, the latter two on the host
  so that a model can loop over sequences without a device synchronisation.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    import torch

__all__ = ["ForwardBatch", "SeqSpan"]


@attrs.frozen
class SeqSpan:
    """One sequence of a batch, on the host: its index ``b``, its rows ``start`` to
    ``start + num_tokens`` of the flat batch, and ``context_len``, its cached tokens after
    the step (its new tokens sit at positions ``context_len - num_tokens`` onwards)."""

    b: int
    start: int
    num_tokens: int
    context_len: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def first_position(self) -> int:
        return self.context_len - self.num_tokens


@attrs.frozen
class ForwardBatch:
    """One step's tokens. B sequences, T = sum(query_lens) new tokens.

    ``input_ids``, ``positions`` and ``slots`` are flat, sequence after sequence.
    ``slots[t]`` is the KV-cache slot (``block * tokens_per_block + offset``) where token
    t's keys and values go. ``block_tables[b]`` lists sequence b's blocks (padded with 0).
    ``context_lens[b]`` counts sequence b's cached tokens after this step, the new ones
    included. ``query_start_loc`` (B + 1,) holds the cumulative ``query_lens``: sequence
    b's rows are ``query_start_loc[b]:query_start_loc[b + 1]``.

    ``logits_indices``: (N,) rows of the flat batch whose logits the model returns, in that
    order; None means each sequence's last new token (B rows). The scheduler sets it when
    a prompt chunk samples nothing, and speculative decoding when a target scores a draft's
    proposals.

    ``hidden_rows`` (drafts that read hidden states: multi-token prediction): (T,), for each
    new token, the row of the hidden states that precede it -- of the target's last forward
    when ``hidden_source == "target"``, of the draft's own previous forward when ``"self"``.
    None for every other model.

    Host copies (``host_context_lens``, ``host_max_context_len``): what the scheduler knows
    without asking the device; None computes them from the tensors (a synchronisation).
    """

    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    slots: torch.Tensor  # (T,) int64
    query_lens: tuple[int, ...]  # (B,)
    context_lens: torch.Tensor  # (B,) int64
    block_tables: torch.Tensor  # (B, max_blocks) int64
    tokens_per_block: int
    logits_indices: torch.Tensor | None = None  # (N,) int64
    hidden_rows: torch.Tensor | None = None  # (T,) int64
    hidden_source: str = "target"
    host_max_context_len: int | None = None
    host_context_lens: tuple[int, ...] | None = None  # (B,)
    query_start_loc: torch.Tensor | None = None  # (B + 1,) int64; None: built on first use

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def is_decode(self) -> bool:
        """Every sequence contributes exactly one new token."""
        return all(n == 1 for n in self.query_lens)

    @property
    def num_decodes(self) -> int:
        """How many leading sequences contribute one new token each (the scheduler puts
        decodes first): rows ``0:num_decodes`` are one token per sequence."""
        n = 0
        for q in self.query_lens:
            if q != 1:
                break
            n += 1
        return n

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_context_len(self) -> int:
        if self.host_max_context_len is not None:
            return self.host_max_context_len
        return int(self.context_lens.max())

    @property
    def host_query_starts(self) -> tuple[int, ...]:
        """(B + 1,) cumulative query lengths on the host."""
        starts = [0]
        for n in self.query_lens:
            starts.append(starts[-1] + n)
        return tuple(starts)

    def query_starts(self) -> torch.Tensor:
        """(B + 1,) int64 cumulative query lengths on the batch's device."""
        if self.query_start_loc is not None:
            return self.query_start_loc
        import torch

        return torch.tensor(self.host_query_starts, dtype=torch.int64, device=self.input_ids.device)

    def context_lens_on_host(self) -> tuple[int, ...]:
        """``context_lens`` as host integers: ``host_context_lens``, or read from the device (a
        synchronisation, which a CUDA-graph capture cannot take) when the batch has none."""
        if self.host_context_lens is not None:
            return self.host_context_lens
        return tuple(int(n) for n in self.context_lens.tolist())

    def spans(self, first: int = 0) -> Iterator[SeqSpan]:
        """Each sequence from index ``first`` on, as a :class:`SeqSpan` (host integers)."""
        lens = self.context_lens_on_host()
        starts = self.host_query_starts
        for b in range(first, self.num_seqs):
            yield SeqSpan(b, starts[b], self.query_lens[b], lens[b])

    @property
    def last_token_index(self) -> torch.Tensor:
        """(B,) index into the flat batch of each sequence's last new token."""
        import torch

        ends = torch.tensor(self.query_lens, dtype=torch.int64, device=self.input_ids.device)
        return torch.cumsum(ends, 0) - 1

    @property
    def logits_index(self) -> torch.Tensor | None:
        """Rows of the flat batch whose logits the model returns; None when that is every
        row (one new token per sequence and no ``logits_indices``)."""
        if self.logits_indices is not None:
            return self.logits_indices
        return None if self.is_decode else self.last_token_index

"""``ForwardBatch``: what a model's forward receives for one engine step.

The new tokens of every running sequence are concatenated into one flat batch
of T tokens (ragged prefill and decode look the same). ``to_padded`` and
``attention_mask`` turn it into the (B, Tq, ...) form most attention code wants.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    import torch

__all__ = ["ForwardBatch"]


@attrs.frozen
class ForwardBatch:
    """One step's tokens. B sequences, T = sum(query_lens) new tokens.

    ``input_ids``, ``positions`` and ``slots`` are flat, sequence after sequence.
    ``slots[t]`` is the KV-cache slot (``block * tokens_per_block + offset``)
    where token t's keys and values go. ``block_tables[b]`` lists sequence b's
    blocks (padded with 0). ``context_lens[b]`` counts sequence b's cached tokens
    after this step, the new ones included.

    Speculative decoding (``rtpcore.engine.speculative``) sets two optional fields:

    * ``logits_indices``: (N,) rows of the flat batch whose logits the model returns,
      in that order; None (the default) means each sequence's last new token (B rows).
      A target model scores a draft's proposals with it.
    * ``hidden_rows``: for drafts that read hidden states (multi-token prediction): (T,),
      for each new token, the row of the hidden states that precede it -- of the target's
      previous forward when ``hidden_source == "target"``, of the draft's own previous
      forward when ``"self"``. None for every other model.
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
    # max(context_lens) known on the host (the scheduler sets it): reading it then costs no
    # device synchronisation; None computes it from context_lens.
    host_max_context_len: int | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode(self) -> bool:
        """Every sequence contributes exactly one new token."""
        return all(n == 1 for n in self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_context_len(self) -> int:
        if self.host_max_context_len is not None:
            return self.host_max_context_len
        return int(self.context_lens.max())

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

    def padded_index(self) -> torch.Tensor:
        """(B, Tq) index into the flat batch; padding points at the sequence's last token."""
        import torch

        tq = self.max_query_len
        starts = torch.tensor((0, *self.query_lens[:-1]), device=self.input_ids.device).cumsum(0)
        offs = torch.arange(tq, device=self.input_ids.device)
        lens = torch.tensor(self.query_lens, device=self.input_ids.device)
        return starts[:, None] + torch.minimum(offs[None, :], lens[:, None] - 1)  # (B, Tq)

    def to_padded(self, x: torch.Tensor) -> torch.Tensor:
        """(T, ...) -> (B, Tq, ...). Padding rows repeat the last token (masked out later)."""
        if self.max_query_len == 1 and x.shape[0] == self.num_seqs:
            return x.unsqueeze(1)
        return x[self.padded_index()]

    def from_padded(self, x: torch.Tensor) -> torch.Tensor:
        """(B, Tq, ...) -> (T, ...), dropping padding rows."""
        if self.max_query_len == 1:
            return x.squeeze(1)
        import torch

        parts = [x[b, :n] for b, n in enumerate(self.query_lens)]
        return torch.cat(parts, 0)

    def attention_mask(self) -> torch.Tensor:
        """(B, 1, Tq, L) bool, True where query may attend to cached key position.

        Query i of sequence b sits at position ``context_lens[b] - query_lens[b] + i``
        and sees keys at positions ``<=`` its own; L = ``max_context_len``.
        """
        import torch

        dev = self.input_ids.device
        lens = torch.tensor(self.query_lens, device=dev)
        qpos = (self.context_lens - lens)[:, None] + torch.arange(self.max_query_len, device=dev)
        kpos = torch.arange(self.max_context_len, device=dev)
        return (kpos[None, None, :] <= qpos[:, :, None]).unsqueeze(1)

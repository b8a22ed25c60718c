"""The ``ForwardBatch`` of a step plan: the model runner's inputs (docs/design.md §13).

:class:`BatchBuilder` turns the scheduler's :class:`~rtpcore.engine.core.request.ScheduledSeq`
list into one flat, unpadded batch: each sequence's scheduled tokens (a decode's last token,
or a prompt chunk), their positions and KV slots, and the logits rows the sampler needs --
one per sequence that samples, ``k + 1`` for a decode whose ``k`` draft proposals are
scored, none for a prompt chunk that does not end its prompt.

Speculative drafts get their batches here too (:meth:`BatchBuilder.draft_batch`): the
draft's catch-up with the tokens the target accepted and one proposal at a time, and
:meth:`BatchBuilder.catch_up_batch`, which feeds the draft a prompt chunk in the step the
target computed it (a draft that reads the target's hidden states has them only then).

Every index tensor of a batch, block tables included, comes from one host buffer moved in
one copy (``rtpcore.engine.step.staging``: on a GPU a reused pinned buffer, copied without
blocking, so no host synchronisation).
"""

from __future__ import annotations

import weakref
from array import array
from collections.abc import Mapping, Sequence

import attrs
import torch

from rtpcore.engine.core.request import Request, ScheduledSeq
from rtpcore.engine.step.staging import HostStaging
from rtpcore.models.forward_batch import ForwardBatch

__all__ = ["BatchBuilder", "TargetBatch"]

_ZERO = array("q", [0])


@attrs.frozen(eq=False)
class TargetBatch:
    """A target forward's batch and, for each scheduled sequence in order, its first logits
    row and how many rows it has (0: a prompt chunk that samples nothing); ``extra``: the
    caller's extra integers on the device, carried in the batch's copy (None when not asked)."""

    batch: ForwardBatch
    rows: tuple[tuple[int, int], ...]
    extra: torch.Tensor | None = None


class BlockTables:
    """Each request's block table as machine ints, kept from one batch to the next, so that a
    step's tables are copied as memory rather than read id by id from the requests' lists
    (a table grows by one id per ``tokens_per_block`` tokens: with long contexts, reading
    every list every step is host work that grows with the context). A batch appends only
    the ids a request's list gained since its last batch, and rebuilds the table when the
    list was replaced: the scheduler (``rtpcore.engine.core.scheduler``) only appends to a
    request's ``blocks`` or replaces the list (a preemption, a prefix-cache hit)."""

    def __init__(self) -> None:
        self._rows: weakref.WeakKeyDictionary[Request, tuple[list[int], array[int]]] = weakref.WeakKeyDictionary()

    def row(self, r: Request) -> array[int]:
        """``r.blocks`` as int64s (the kept array: read it before the next call)."""
        blocks = r.blocks
        kept = self._rows.get(r)
        n = len(kept[1]) if kept is not None else 0
        if kept is not None and kept[0] is blocks and n <= len(blocks) and (n == 0 or kept[1][n - 1] == blocks[n - 1]):
            row = kept[1]  # the same list, grown (its last kept id unchanged: a cheap check of the rule)
            if len(row) < len(blocks):
                row.fromlist(blocks[len(row) :])
            return row
        row = array("q", blocks)
        self._rows[r] = (blocks, row)
        return row


class BatchBuilder:
    """Builds the batches of one engine's steps on ``device``."""

    def __init__(self, *, tokens_per_block: int, device: torch.device | str = "cpu"):
        self.tpb = tokens_per_block
        self.device = torch.device(device)
        self.staging = HostStaging(self.device)  # one host-to-device copy per batch
        self.tables = BlockTables()

    def target_batch(
        self, seqs: Sequence[ScheduledSeq], proposals: Mapping[Request, Sequence[int]] | None = None,
        extra: Sequence[int] | None = None,
    ) -> TargetBatch:
        """The target's batch for ``seqs``: each one's scheduled tokens, then its proposals;
        ``extra`` integers travel to the device in the same copy (``TargetBatch.extra``)."""
        spans: list[tuple[int, list[int]]] = []
        logits: list[int] = []
        rows: list[tuple[int, int]] = []
        offset = 0
        for s in seqs:
            r = s.request
            drafted = list(proposals.get(r, ())) if proposals else []
            tokens = r.tokens[s.start : s.end] + drafted
            spans.append((s.start, tokens))
            r.last_rows = (offset, s.start)
            offset += len(tokens)
            if s.samples:
                rows.append((len(logits), 1 + len(drafted)))
                logits += range(offset - 1 - len(drafted), offset)
            else:
                rows.append((len(logits), 0))
        every_last = len(logits) == len(seqs) and all(n == 1 for _, n in rows)
        extras: dict[str, torch.Tensor] = {}
        batch = self._make([s.request for s in seqs], spans, logits_rows=None if every_last else logits,
                           extra=extra, extras=extras)
        return TargetBatch(batch, tuple(rows), extras.get("extra"))

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
                base, first = s.last_rows
                start = max(s.draft_cached, first) if shift else s.draft_cached
                ids = s.tokens[start + shift :]
                hidden += [base + p - first for p in range(start, start + len(ids))]
            else:
                start = len(s.tokens) - shift + step - 1
                ids = [proposals[s][step - 1]]
                hidden.append(previous[s] if previous else 0)
            spans.append((start, ids))
        return self._make(seqs, spans, hidden_rows=hidden if shift else None, hidden_source="target" if step == 0 else "self")

    def catch_up_batch(
        self, seqs: Sequence[ScheduledSeq], *, shift: int = 0
    ) -> tuple[ForwardBatch, list[ScheduledSeq]] | None:
        """The draft's batch for prompt chunks the target computed in its last forward and that
        sample nothing: positions ``draft_cached`` to the chunk's end (with ``shift`` 1 each
        position takes the next token, known since the chunk does not end the prompt), and the
        chunks it covers; None when no chunk needs it."""
        picked: list[Request] = []
        caught: list[ScheduledSeq] = []
        spans: list[tuple[int, list[int]]] = []
        hidden: list[int] = []
        for s in seqs:
            r = s.request
            base, first = r.last_rows
            start = max(r.draft_cached, first) if shift else r.draft_cached
            if s.samples or start >= s.end:
                continue
            picked.append(r)
            caught.append(s)
            spans.append((start, r.tokens[start + shift : s.end + shift]))
            hidden += [base + p - first for p in range(start, s.end)]
        if not picked:
            return None
        return self._make(picked, spans, hidden_rows=hidden if shift else None, logits_rows=[]), caught

    def _make(
        self,
        seqs: Sequence[Request],
        spans: Sequence[tuple[int, Sequence[int]]],
        *,
        logits_rows: Sequence[int] | None = None,
        hidden_rows: Sequence[int] | None = None,
        hidden_source: str = "target",
        extra: Sequence[int] | None = None,
        extras: dict[str, torch.Tensor] | None = None,
    ) -> ForwardBatch:
        """A batch of ``spans`` (first position, token ids) of ``seqs``, one each; ``extra``
        travels in the same copy and lands in ``extras["extra"]``."""
        tpb = self.tpb
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        lens: list[int] = []
        context: list[int] = []
        starts = [0]
        for s, (start, tokens) in zip(seqs, spans, strict=True):
            end = start + len(tokens)
            ids += tokens
            positions += range(start, end)
            blocks = s.blocks
            slots += [blocks[p // tpb] * tpb + p % tpb for p in range(start, end)]
            lens.append(end - start)
            context.append(end)
            starts.append(starts[-1] + end - start)
        parts: dict[str, Sequence[int]] = {
            "input_ids": ids, "positions": positions, "slots": slots, "context_lens": context, "query_start_loc": starts,
        }
        if logits_rows is not None:
            parts["logits_indices"] = list(logits_rows)
        if hidden_rows is not None:
            parts["hidden_rows"] = list(hidden_rows)
        # Block tables: (B, width), rows padded with 0, from the kept tables (BlockTables): copied
        # as memory, not id by id.
        width = max((len(s.blocks) for s in seqs), default=0)
        tables = array("q")
        for s in seqs:
            row = self.tables.row(s)
            tables.extend(row)
            tables.extend(_ZERO * (width - len(row)))
        parts["block_tables"] = tables
        if extra is not None:
            parts["extra"] = list(extra)
        views = dict(zip(parts, self.staging.stage(list(parts.values())), strict=True))
        views["block_tables"] = views["block_tables"].view(len(seqs), width)
        if extra is not None and extras is not None:
            extras["extra"] = views.pop("extra")
        return ForwardBatch(
            query_lens=tuple(lens),
            tokens_per_block=tpb,
            hidden_source=hidden_source,
            host_max_context_len=max(context, default=0),
            host_context_lens=tuple(context),
            **views,
        )

"""One host-to-device copy for a step's integer inputs (docs/design.md §9).

A step's host-side inputs (input ids, positions, KV slots, context lengths, query starts,
logits rows, block tables) are packed into one int64 host buffer and moved with one copy;
the batch's tensors are views of the device copy. :class:`HostStaging` owns that buffer.

On a CUDA/ROCm device the buffer is pinned and reused, so the copy is truly asynchronous
(``non_blocking``) and allocates nothing: a small ring of pinned buffers, each guarded by
an event recorded after its copy, so a buffer is never rewritten while the device may still
read it (the host may build the next step's inputs while the current step runs). On the
CPU "the device copy" is the host tensor itself (a fresh one per call: the views of a
batch stay valid as long as the batch lives).

:attr:`HostStaging.copies` counts the calls, one per batch built: how tests see that a
step issues one input copy, on any device. :class:`Readback` is the other direction: a
step's greedy picks queued for the host, read when the next step has been launched.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["HostStaging", "Readback"]

RING = 4  # pinned buffers in turn: a step builds at most a few batches (target, draft proposals)


class HostStaging:
    """Packs int64 inputs into one host buffer and copies it to ``device`` in one go."""

    def __init__(self, device: torch.device | str = "cpu", *, ring: int = RING):
        self.device = torch.device(device)
        self.copies = 0  # host-to-device copies issued (one per stage call)
        self._pinned = self.device.type != "cpu"
        self._buffers: list[torch.Tensor | None] = [None] * ring
        self._events: list[Any] = [None] * ring
        self._next = 0

    def stage(self, parts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Each of ``parts`` as an int64 tensor on the device, all from one copy (views of
        one flat tensor, in order). A part may be any sequence of ints; an ``array("q")``
        (a batch's block tables) is copied as memory, not int by int."""
        sizes = [len(p) for p in parts]
        packed = array("q")
        for p in parts:
            if isinstance(p, list):
                packed.fromlist(p)  # faster than extend for a list
            else:
                packed.extend(p)
        flat = torch.frombuffer(packed, dtype=torch.int64) if packed else torch.zeros(0, dtype=torch.int64)
        return list(self.to_device(flat).split(sizes))

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` (a flat int64 tensor) on the device: one copy, counted; on a GPU through
        a pinned buffer of the ring and without blocking."""
        self.copies += 1
        if not self._pinned:
            return host
        i = self._next
        self._next = (i + 1) % len(self._buffers)
        event = self._events[i]
        if event is not None:  # the buffer's last copy must have left it before it is rewritten
            event.synchronize()
        n = host.numel()
        buffer = self._buffers[i]
        if buffer is None or buffer.numel() < n:
            buffer = torch.empty(max(n, 2 * (buffer.numel() if buffer is not None else 256)),
                                 dtype=torch.int64, pin_memory=True)
            self._buffers[i] = buffer
        staged = buffer[:n]
        staged.copy_(host)
        out = staged.to(self.device, non_blocking=True)
        if self._events[i] is None:
            self._events[i] = torch.cuda.Event()
        self._events[i].record(torch.cuda.current_stream(self.device))
        return out


class Readback:
    """A device tensor's values on their way to the host: the copy is queued at once (into
    pinned memory, without blocking, on a GPU) and :meth:`tolist` waits for that copy alone,
    not for work queued on the device after it (the next step's forward)."""

    def __init__(self, values: torch.Tensor):
        if values.device.type == "cpu":
            self._host, self._event = values, None
            return
        self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        self._host.copy_(values, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(values.device))

    def tolist(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()

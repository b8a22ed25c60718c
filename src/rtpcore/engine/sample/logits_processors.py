"""The engine's side of the logits-processor seam (``rtpcore.logits``, docs/design.md §18).

:class:`LogitsProcessors` holds an engine's enabled processors, one instance each, and the
batch as they know it: which request sits in which row. The model runner
(``rtpcore.engine.step.runner``) gives it every step's drawing requests, in the step's order
(:meth:`LogitsProcessors.begin`: the :class:`~rtpcore.logits.BatchUpdate` from the last step's
rows, or None), then the step's logits (:meth:`~LogitsProcessors.apply`, or for a step that
verifies draft proposals :meth:`~LogitsProcessors.apply_verification`, position by position).
An engine with no processor enabled has no :class:`LogitsProcessors` at all, so its steps do
no work for the seam.

Rows. A step's update is built so that a processor keeping a ``row -> state`` mapping and
applying ``removed``, ``added``, then ``moved`` (swaps) ends with the step's rows: a request
that stays keeps its row unless the step's order moved it; a joining request takes its own
row when that is free, else the lowest free one, and the swaps then put every request in its
row. Each request in the batch has its own ``output_ids`` list, handed out when it is added and
brought up to date with the request's tokens before every step (the engine only appends to a
request's tokens); a request that leaves and comes back (preempted, then recomputed) is added
again with a new list.

Faults. An exception from a processor's code is raised as a
:class:`~rtpcore.errors.LogitsProcessorError` naming the processor and who registered it (the
exception as ``__cause__``); the runner treats it as a fault of the step's requests (run again
apart, each culprit ends with ``reason="logits_processor"``). An ``update_state`` that raised is
taken as applied: the next step's update starts from the rows it was given.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import attrs
import torch

from rtpcore.engine.sample.params import SamplingParams
from rtpcore.errors import InvalidRequestError, LogitsProcessorError
from rtpcore.logits import BatchUpdate, LogitsProcessor

__all__ = ["LogitsProcessors", "ProcessorRow", "batch_update", "resolve_logits_processors"]

logger = logging.getLogger(__name__)

_HOOK = "rtpcore_register_logits_processors"


@attrs.frozen(eq=False)
class ProcessorRow:
    """One drawing request of a step, as the processors see it: ``key`` identifies the request
    from step to step (the engine's request object), ``tokens`` is its own list of prompt and
    generated tokens (read, never written), the first ``prompt_len`` its prompt."""

    key: object
    params: SamplingParams
    tokens: Sequence[int]
    prompt_len: int


def resolve_logits_processors(names: Sequence[str], registry: Any) -> list[tuple[str, type[LogitsProcessor], str | None]]:
    """``(name, class, provider)`` for each name of ``logits_processors``, in order, from the
    registry's ``logits_processors`` seam. An unknown name is a :class:`LogitsProcessorError`
    naming ``logits_processors=`` and the known names (``.known``)."""
    found = []
    for name in names:
        cls = registry.seam_class("logits_processors", name)
        if cls is None:
            known = registry.seam_names("logits_processors")
            raise LogitsProcessorError(
                f"logits_processors={list(names)!r}: {name!r} is not a known logits processor; known: "
                f"{', '.join(known) or 'none'} (a plugin adds more with {_HOOK}, and is loaded with plugins=[...])",
                processor=name, known=known,
            )
        provider = registry.seam_provider("logits_processors", name)
        found.append((name, cls, None if provider is None else str(provider)))
    return found


def batch_update(previous: Sequence[object], current: Sequence[object]) -> tuple[list[int], list[tuple[int, object]], list[tuple[int, int]]]:
    """How rows holding ``previous`` (keys, one per row) become rows holding ``current``:
    ``removed`` rows, ``added`` ``(row, key)``, ``moved`` ``(a, b)`` swaps, to apply in that
    order (the module docstring)."""
    target = {k: i for i, k in enumerate(current)}
    layout: dict[int, object] = {}
    removed: list[int] = []
    for i, k in enumerate(previous):
        if k in target:
            layout[i] = k
        else:
            removed.append(i)
    staying = set(layout.values())
    joining = [k for k in current if k not in staying]
    free = sorted(set(range(max(len(previous), len(current)))) - set(layout))
    added: list[tuple[int, object]] = []
    later = []
    for k in joining:  # its own row when that is free ...
        if target[k] in layout:
            later.append(k)
        else:
            layout[target[k]] = k
            added.append((target[k], k))
    free = [i for i in free if i not in layout]
    assert len(free) >= len(later)  # max(previous, current) rows hold every current key
    for k, row in zip(later, free, strict=False):  # ... else the lowest free one
        layout[row] = k
        added.append((row, k))
    row_of = {k: i for i, k in layout.items()}
    moved: list[tuple[int, int]] = []
    for row, k in enumerate(current):
        at = row_of[k]
        if at == row:
            continue
        other = layout.get(row)
        layout[row], row_of[k] = k, row
        if other is None:
            del layout[at]
        else:
            layout[at], row_of[other] = other, at
        moved.append((at, row))
    return removed, added, moved


class LogitsProcessors:
    """An engine's enabled processors (``(name, instance, provider)``, in order) and their rows."""

    def __init__(self, processors: Sequence[tuple[str, LogitsProcessor, str | None]]):
        self.processors = list(processors)
        self._rows: list[object] = []  # the keys of the last update's rows
        self._outputs: dict[object, list[int]] = {}  # each row's output_ids, the list the processors hold

    @classmethod
    def build(cls, names: Sequence[str], registry: Any, engine_config: Any, device: torch.device) -> LogitsProcessors | None:
        """One instance of each named processor, ``cls(engine_config, device)``; None when
        ``names`` is empty. An unknown name, or a constructor that raises, is a
        :class:`LogitsProcessorError` naming it."""
        if not names:
            return None
        built = []
        for name, proc_cls, provider in resolve_logits_processors(names, registry):
            with _blame(name, provider, "its constructor"):
                built.append((name, proc_cls(engine_config, device), provider))
        return cls(built)

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.processors]

    def validate(self, params: SamplingParams, *, field: str = "extra_args") -> None:
        """Each processor's ``validate_params``: a ValueError or TypeError refuses the request
        (:class:`~rtpcore.errors.InvalidRequestError` naming ``field``); anything else is the
        processor's own failure (:class:`~rtpcore.errors.LogitsProcessorError`)."""
        for name, proc, provider in self.processors:
            try:
                with _blame(name, provider, "validate_params", passing=(ValueError, TypeError)):
                    type(proc).validate_params(params)
            except (ValueError, TypeError) as exc:
                raise InvalidRequestError(
                    f"{field}: logits processor {name!r} refused the request's arguments: {exc}",
                    field=field, value=params.extra_args,
                ) from exc

    # -- a step ------------------------------------------------------------------------------

    def begin(self, rows: Sequence[ProcessorRow]) -> None:
        """The step's drawing requests, in its order: bring each one's ``output_ids`` up to date,
        and give every processor the update from the last step's rows (None when unchanged)."""
        keys = [r.key for r in rows]
        for r in rows:
            out = self._outputs.get(r.key)
            if out is not None:
                _sync(out, r)
        if keys == self._rows:
            update = None
        else:
            removed, added, moved = batch_update(self._rows, keys)
            by_key = {r.key: r for r in rows}
            for k in set(self._rows) - set(keys):
                self._outputs.pop(k, None)
            entries = []
            for row, k in added:
                r = by_key[k]
                out = self._outputs[k] = list(r.tokens[r.prompt_len :])
                entries.append((row, r.params, list(r.tokens[: r.prompt_len]), out))
            update = BatchUpdate(len(keys), removed, entries, moved)
        self._rows = keys  # taken as applied, even by a processor that raises
        for name, proc, provider in self.processors:
            with _blame(name, provider, "update_state"):
                proc.update_state(update)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The step's ``(rows, V)`` logits through every processor, in order: a new float32
        tensor (``logits`` itself is left as it is: log-probabilities are read from it)."""
        x = logits.to(torch.float32, copy=True)
        for name, proc, provider in self.processors:
            with _blame(name, provider, "apply"):
                out = proc.apply(x)
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(x.shape):
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise LogitsProcessorError(
                    f"logits processor {name!r} ({provider or 'unknown provider'}): apply returned {got} for logits "
                    f"of shape {tuple(x.shape)}; it must return a tensor of the same shape",
                    processor=name, provider=provider,
                )
            x = out if out.dtype == torch.float32 else out.float()
        return x

    def apply_verification(self, logits: torch.Tensor, proposals: Sequence[Sequence[int]]) -> torch.Tensor:
        """A speculative step's verification logits (row after row, ``k + 1`` per request with
        ``k`` proposals, ``proposals[b]`` those of the step's row b) through the processors as if
        decoding without a draft: one :meth:`apply` per position ``j``, each row's ``output_ids``
        extended by its first ``j`` proposals meanwhile (restored before returning)."""
        ks = [len(p) for p in proposals]
        if not any(ks):
            return self.apply(logits)
        starts = [0]
        for k in ks:
            starts.append(starts[-1] + k + 1)
        if logits.shape[0] != starts[-1] or len(ks) != len(self._rows):
            raise ValueError(f"logits of shape {tuple(logits.shape)} for {len(ks)} rows with {sum(ks)} proposals")
        out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        lists = [self._outputs[k] for k in self._rows]
        lengths = [len(x) for x in lists]
        try:
            for j in range(max(ks) + 1):
                if j:
                    for b, x in enumerate(lists):
                        if j <= ks[b]:
                            x.append(int(proposals[b][j - 1]))
                at = [starts[b] + min(j, k) for b, k in enumerate(ks)]  # a row past its proposals repeats its last
                mine = [b for b, k in enumerate(ks) if j <= k]
                host = torch.tensor(at + mine, dtype=torch.int64)
                d = host.to(logits.device, non_blocking=True) if logits.device.type != "cpu" else host
                d_at, d_mine = d.split([len(at), len(mine)])
                x_j = self.apply(logits.index_select(0, d_at))
                out.index_copy_(0, d_at.index_select(0, d_mine), x_j.index_select(0, d_mine))
        finally:
            for x, n in zip(lists, lengths, strict=True):
                del x[n:]
        return out


def _sync(out: list[int], row: ProcessorRow) -> None:
    """``out`` (a request's output_ids) equal to its generated tokens again: the engine only
    appends to a request's tokens, so only the new ones are copied."""
    generated = len(row.tokens) - row.prompt_len
    if len(out) > generated:
        del out[generated:]
    elif len(out) < generated:
        out.extend(row.tokens[row.prompt_len + len(out) :])


@contextmanager
def _blame(name: str, provider: str | None, where: str, passing: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """An exception from a processor's code, as a LogitsProcessorError naming it (``passing``:
    the exceptions that go on as they are)."""
    try:
        yield
    except passing:
        raise
    except Exception as exc:
        logger.error("logits processor %r (%s) raised in %s: %s: %s", name, provider, where, type(exc).__name__, exc)
        raise LogitsProcessorError(
            f"logits processor {name!r} ({provider or 'unknown provider'}) raised in {where}: {type(exc).__name__}: {exc}",
            processor=name, provider=provider,
        ) from exc

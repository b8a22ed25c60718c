"""Decode steps replayed from CUDA graphs (docs/design.md §9).

At small batches a decode step's time goes to launching its kernels one by one from
Python, not to the GPU. :class:`DecodeGraphs` captures the model's forward once per
batch-size bucket (1, 2, 4, 8, ... up to ``max_batch_size``) over static input buffers and
replays it: a step copies its batch into the buffers of the smallest bucket that holds it,
turns the other rows into dummy sequences that write into a scratch KV block no request
owns, replays the graph and returns the first B rows of the logits. Each graph also holds
the greedy pick of its logits (``rtpcore.engine.sample.sampler.greedy_pick``): a step whose rows are
all plain greedy reads back only B token ids (:meth:`DecodeGraphs.run_greedy`).

Static shapes: block tables as wide as ``max_positions`` needs, and ``max_context_len``
fixed at ``max_positions`` (what a model may size its work by; every sequence still sees
only its own context, through ``context_lens``). Attention that reads blocks in place
(``rtpcore.kv.paged_attention``) costs the same either way; the gather path would gather
the longest possible context for every row on every step, so the engine uses graphs only
when every layer reads its cache in place (:func:`in_place_problem`): no graphs for fp8
pools (they dequantize by gathering), nor where the paged kernel cannot run.

Capture runs on a stream of the engine's own device (torch's default capture stream is one
per process, made on whichever device was current first: a second engine on another GPU
would capture nothing). ``strict`` (``cuda_graphs=True``) makes a failed capture an error;
otherwise it is logged and decode steps run eagerly. :attr:`DecodeGraphs.replays` counts
the steps a graph served, so a fallback is visible (``EngineStats.cuda_graph_replays_total``).

A draft of speculative decoding gets graphs of its own (its proposals after the first are
decode steps); an engine with an MTP draft (which reads the target's hidden states) uses none. Eager instead: prefill and mixed steps, speculative verification (``logits_indices``),
drafts that read hidden states, and every decode step when capture failed (logged once
with the reason: a forward that synchronises with the host -- an fp8 ``compact`` cache
growing its scale, for one -- cannot be captured). ``capture=False`` runs the same padded
static batches eagerly: how the padding is tested on machines without a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from rtpcore.engine.sample.sampler import greedy_pick
from rtpcore.models.forward_batch import ForwardBatch

__all__ = ["DecodeGraphs", "buckets", "in_place_problem"]

logger = logging.getLogger(__name__)


def in_place_problem(kv_caches: Sequence[Any], device: torch.device | str, plugin: Any = None) -> str | None:
    """Why decode steps over ``kv_caches`` would not read every layer's cache in place (so a
    graph would gather the longest possible context each step), or None when they do."""
    from rtpcore.kv.paged_attention import decode_backend

    if plugin is not None and not getattr(plugin, "decode_reads_kv_in_place", True):
        return f"{plugin.__qualname__} sets decode_reads_kv_in_place = False"
    probe = torch.empty(0, device=device)
    for i, cache in enumerate(kv_caches):
        if decode_backend(cache, probe) != "triton":
            tag = getattr(getattr(cache, "spec", None), "tag", f"layer {i}")
            kind = type(cache).__name__
            return (f"layer {tag!r} ({kind}) is read by gathering, not in place "
                    "(fp8 pools dequantize by gathering; unquantized ones need Triton on a CUDA/ROCm device)")
    return None


def buckets(max_batch_size: int) -> list[int]:
    """Batch sizes with a graph: powers of two below ``max_batch_size``, and it."""
    sizes = {max_batch_size}
    n = 1
    while n < max_batch_size:
        sizes.add(n)
        n *= 2
    return sorted(sizes)


class DecodeGraphs:
    """The decode graphs of one model over its KV pools (see the module docstring).

    ``scratch_block``: a block of every pool that no request owns (the engine allocates one
    block more than it hands out); padding rows write their keys and values there.
    """

    def __init__(
        self,
        model: Any,
        kv_caches: Sequence[Any],
        *,
        max_batch_size: int,
        max_positions: int,
        tokens_per_block: int,
        scratch_block: int,
        device: torch.device | str,
        capture: bool = True,
        strict: bool = False,
    ):
        self.model = model
        self.kv_caches = list(kv_caches)
        self.max_batch_size = max_batch_size
        self.max_positions = max_positions
        self.tpb = tokens_per_block
        self.width = -(-max_positions // tokens_per_block)
        self.scratch = scratch_block
        self.device = torch.device(device)
        n, i64, dev = max_batch_size, torch.int64, self.device
        self.input_ids = torch.zeros(n, dtype=i64, device=dev)
        self.positions = torch.zeros(n, dtype=i64, device=dev)
        self.slots = torch.full((n,), scratch_block * tokens_per_block, dtype=i64, device=dev)
        self.context_lens = torch.ones(n, dtype=i64, device=dev)
        self.block_tables = torch.full((n, self.width), scratch_block, dtype=i64, device=dev)
        self.graphs: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}  # bucket -> (CUDAGraph, logits, picks)
        self.failure: str | None = None
        self.capture = capture
        self.strict = strict  # a failed capture raises (cuda_graphs=True) instead of falling back
        self.replays = 0  # decode steps a captured graph served
        self.static_runs = 0  # steps the static buffers served eagerly (capture=False)
        self.greedy_runs = 0  # of the steps served, those that read back the greedy picks only
        if capture:
            self._capture_all()

    def static_batch(self, n: int) -> ForwardBatch:
        """The first ``n`` rows of the static buffers as a decode batch."""
        return ForwardBatch(
            input_ids=self.input_ids[:n],
            positions=self.positions[:n],
            slots=self.slots[:n],
            query_lens=(1,) * n,
            context_lens=self.context_lens[:n],
            block_tables=self.block_tables[:n],
            tokens_per_block=self.tpb,
            host_max_context_len=self.max_positions,
        )

    def supports(self, batch: ForwardBatch) -> bool:
        """Whether ``batch`` runs from a graph (or, without capture, the static buffers)."""
        return (
            self.failure is None
            and batch.is_decode
            and batch.logits_indices is None
            and batch.hidden_rows is None
            and batch.num_seqs <= self.max_batch_size
            and batch.block_tables.shape[1] <= self.width
            and batch.tokens_per_block == self.tpb
        )

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """(B, vocab) logits of a decode ``batch`` (``supports(batch)`` must hold)."""
        return self._replay(batch)[0]

    def run_greedy(self, batch: ForwardBatch) -> torch.Tensor:
        """(B,) int64 greedy picks of a decode ``batch``: the argmax of each row's logits, -1
        where they are not finite (``rtpcore.engine.sample.sampler.greedy_pick``), computed in the
        graph (``supports(batch)`` must hold)."""
        self.greedy_runs += 1
        return self._replay(batch)[1]

    def _replay(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The first B rows of the bucket's logits and greedy picks after running ``batch``."""
        b = batch.num_seqs
        n = next(size for size in buckets(self.max_batch_size) if size >= b)
        self.input_ids[:b].copy_(batch.input_ids, non_blocking=True)
        self.positions[:b].copy_(batch.positions, non_blocking=True)
        self.slots[:b].copy_(batch.slots, non_blocking=True)
        self.context_lens[:b].copy_(batch.context_lens, non_blocking=True)
        self.block_tables[:b, : batch.block_tables.shape[1]].copy_(batch.block_tables, non_blocking=True)
        if n > b:  # padding rows: one token at position 0, written to the scratch block
            self.input_ids[b:n].zero_()
            self.positions[b:n].zero_()
            self.slots[b:n].fill_(self.scratch * self.tpb)
            self.context_lens[b:n].fill_(1)
            self.block_tables[b:n].fill_(self.scratch)
        if not self.capture:
            self.static_runs += 1
            with torch.inference_mode():
                logits = self.model(self.static_batch(n), self.kv_caches)
                return logits[:b], greedy_pick(logits)[:b]
        graph, logits, picks = self.graphs[n]
        with torch.cuda.device(self.device):  # the graph's device, whatever device is current
            graph.replay()
        self.replays += 1
        return logits[:b], picks[:b]

    def _capture_all(self) -> None:
        """Capture every bucket, the largest first (they share one memory pool)."""
        try:
            with torch.cuda.device(self.device):  # capture on the engine's device, whatever is current
                pool = torch.cuda.graph_pool_handle()
                stream = torch.cuda.Stream(self.device)  # not torch's process-wide one (see the docstring)
                for n in reversed(buckets(self.max_batch_size)):
                    self.graphs[n] = self._capture(n, pool, stream)
        except Exception as exc:  # the forward cannot be captured: every step runs eagerly
            self.graphs.clear()
            self.failure = f"{type(exc).__name__}: {exc}"
            if self.strict:
                from rtpcore.errors import RtpcoreError

                raise RtpcoreError(
                    f"cuda_graphs=True but capturing the decode step failed: {self.failure} "
                    "(a forward that synchronises with the host cannot be captured; cuda_graphs=None "
                    "falls back to eager steps with a warning)"
                ) from exc
            logger.warning("decode steps run eagerly: capturing a CUDA graph failed (%s)", self.failure)
        else:
            logger.info("decode steps replay CUDA graphs for batch sizes %s", sorted(self.graphs))

    def _capture(self, n: int, pool: Any, stream: Any) -> tuple[Any, torch.Tensor, torch.Tensor]:
        batch = self.static_batch(n)  # all padding rows: warm-up and capture write the scratch block only
        with torch.inference_mode():
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # lazy initialisation (RoPE tables, kernels) happens here, not in the graph
                    greedy_pick(self.model(batch, self.kv_caches))
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                logits = self.model(batch, self.kv_caches)
                picks = greedy_pick(logits)
        return graph, logits, picks

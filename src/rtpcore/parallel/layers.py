"""Torch modules that finish tensor-parallel layers with a collective.

A model shard built for ``tensor_parallel_size > 1`` holds slices of its
weights (see ``rtpcore.parallel.sharding``). Two kinds of layer need a collective on
their output; these wrappers add it around any linear module (``nn.Linear``,
a model's own fast ``Linear``...), taking a
:class:`~rtpcore.parallel.context.ParallelContext` as ``parallel``::

    o_proj = row_parallel(Linear, w["o_proj.weight"], w.get("o_proj.bias"), parallel)
    lm_head = GatherColumns(Linear(w["lm_head.weight"]), parallel)  # weight split by vocabulary

With ``parallel`` None (or a single rank) :func:`row_parallel` returns the plain
layer, so an unsharded model runs exactly the code it ran before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["GatherColumns", "RowParallel", "row_parallel"]


class RowParallel(nn.Module):
    """A linear layer over this rank's slice of the input features (its weight's
    columns): the ranks' partial sums are all-reduced, then the (unsplit) bias is
    added once."""

    bias: torch.Tensor | None

    def __init__(self, linear: nn.Module, bias: torch.Tensor | None, parallel: Any):
        super().__init__()
        self.linear = linear  # (in/N) -> out, no bias
        self.parallel = parallel
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.parallel.all_reduce(self.linear(x))  # (..., out), summed over ranks
        return y if self.bias is None else y + self.bias


class GatherColumns(nn.Module):
    """A column-parallel linear layer (this rank's block of output features, e.g. a
    vocabulary-split ``lm_head``) whose outputs the ranks concatenate in rank order."""

    def __init__(self, linear: nn.Module, parallel: Any):
        super().__init__()
        self.linear = linear  # in -> (out/N)
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parallel.all_gather(self.linear(x), dim=-1)  # (..., out)


def row_parallel(
    make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    parallel: Any,
) -> nn.Module:
    """``make(weight, bias)`` when not sharded; else a :class:`RowParallel` around
    ``make(weight, None)`` that adds ``bias`` after the all-reduce."""
    if parallel is None or parallel.world_size == 1:
        return make(weight, bias)
    return RowParallel(make(weight, None), bias, parallel)

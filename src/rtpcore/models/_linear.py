"""``Linear``: ``y = x @ W.T + b`` with the fastest exact kernel torch offers on this machine.

On CPU, bf16/fp16 matrix-vector products through ``F.linear`` re-layout the
weight on every call. oneDNN can lay the weight out once
(``torch.ops.mkldnn._reorder_linear_weight``) and reuse it, which gives the same
bits (checked on a probe when the layer is built) about 1.5x faster at decode
batch sizes. float32 keeps ``F.linear`` (MKL), whose results transformers
reproduces bit for bit; so does any build where the oneDNN ops are missing or
disagree with ``F.linear``.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Linear", "packed_linear_supported"]

logger = logging.getLogger(__name__)


class Linear(nn.Module):
    """A frozen linear layer; ``weight`` is (out, in), ``bias`` (out,) or None."""

    weight: torch.Tensor  # (out, in), or oneDNN's packed form of it
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = weight.device.type == "cpu" and packed_linear_supported(weight.dtype)
        if self.packed:
            weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, packed={self.packed}"


@functools.cache
def packed_linear_supported(dtype: torch.dtype) -> bool:
    """True when prepacked oneDNN linear exists for ``dtype`` and matches ``F.linear`` exactly."""
    if dtype not in (torch.bfloat16, torch.float16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(24, 40, generator=gen).to(dtype)
        b = torch.randn(24, generator=gen).to(dtype)
        x = torch.randn(3, 40, generator=gen).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        same = torch.equal(torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], ""), F.linear(x, w, b))
    except (RuntimeError, AttributeError, NotImplementedError) as exc:
        logger.debug("prepacked oneDNN linear unavailable for %s: %s", dtype, exc)
        return False
    if not same:
        logger.debug("prepacked oneDNN linear disagrees with F.linear for %s; not using it", dtype)
    return same

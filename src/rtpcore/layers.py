"""Building blocks for model authors: ``Linear``, the fastest exact frozen linear layer.

``Linear(weight, bias=None)`` computes ``y = x @ weight.T + bias`` exactly as
``torch.nn.functional.linear`` does, bit for bit, with the fastest kernel torch
offers for that on this machine. Use it for every projection of a model served by
rtpcore (built-in models do; so does the ``atom-plugin`` example)::

    from rtpcore.layers import Linear
    from rtpcore.parallel_layers import row_parallel

    self.qkv = Linear(w["qkv.weight"].to(dtype))                       # (out, in)
    self.o = row_parallel(Linear, w["o.weight"].to(dtype), None, parallel)  # sharded or not

What it does:

* **bf16 / fp16 on CPU.** ``F.linear`` re-lays the weight out on every call. oneDNN
  can lay it out once (``torch.ops.mkldnn._reorder_linear_weight``) and reuse it;
  at decode batch sizes that is about 1.5x faster and gives the same bits.
  :func:`packed_linear_supported` checks this on a probe the first time a dtype is
  used (the answer is cached); the layer's ``packed`` attribute says which kernel it
  runs.
* **float32**, any other device, or a build whose oneDNN ops are missing or disagree
  with ``F.linear``: plain ``F.linear`` on the weight as given (no copy: the layer
  holds the tensor you pass, so views into a larger stacked tensor stay views).
  Hugging Face transformers computes float32 projections with this same kernel,
  which is what keeps greedy tokens identical to it.

The weight and bias are non-persistent buffers (the checkpoint, not the module's
state dict, is the source of truth); a packed weight is opaque: read
``in_features`` / ``out_features``, not ``weight.shape``.
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
    """A frozen linear layer; ``weight`` is (out, in), ``bias`` (out,) or None.

    Inputs are (..., in) in the weight's dtype; outputs (..., out), identical to
    ``F.linear(x, weight, bias)``.
    """

    weight: torch.Tensor  # (out, in), or oneDNN's packed form of it
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"Linear weight must be 2-D (out, in); got shape {tuple(weight.shape)}")
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(
                f"Linear bias must have shape ({weight.shape[0]},) to match weight {tuple(weight.shape)}; "
                f"got {tuple(bias.shape)}"
            )
        self.out_features, self.in_features = weight.shape
        self.packed = weight.device.type == "cpu" and packed_linear_supported(weight.dtype)
        if self.packed:
            weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, packed={self.packed}"


@functools.cache
def packed_linear_supported(dtype: torch.dtype) -> bool:
    """True when prepacked oneDNN linear exists for ``dtype`` and matches ``F.linear`` exactly.

    Always False for float32 (``F.linear`` is already the exact, fast kernel) and
    for builds without oneDNN. The probe runs once per dtype.
    """
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

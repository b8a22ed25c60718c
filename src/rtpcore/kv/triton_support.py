"""What the Triton kernels of ``rtpcore.kv`` share: whether Triton is there, whether it is
interpreted (``TRITON_INTERPRET=1``: the kernels run on the CPU, for tests), where a launch
goes, the power-of-two tile sizes and the precision of ``tl.dot``. Importing this module
never imports Triton."""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any

import torch

__all__ = ["float32_dots", "interpreted", "launch_on", "pow2", "triton_available"]


@functools.cache
def triton_available() -> bool:
    """Whether Triton imports (it ships with the CUDA and ROCm builds of torch)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (on the CPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def launch_on(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Launch on ``device`` (Triton launches on the current CUDA device), whatever is current."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def float32_dots(dtype: torch.dtype) -> bool:
    """Whether the kernels multiply a pool of ``dtype`` in IEEE float32: fp32 pools; and bf16
    ones under Triton's interpreter, whose ``tl.dot`` misreads bf16 operands (fp16 ones it
    multiplies right). Otherwise ``tl.dot`` takes the pool's dtype (tensor cores) and
    accumulates in float32."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreted())

"""The calls a model plugin's ``forward`` makes (docs/design.md §21): linear layers, tensor-parallel
row layers, attention over the paged KV cache (by the layer's attention backend,
:mod:`rtpcore.attention`), masks.

These names are a contract: they keep their signatures across releases of the same
``FORWARD_CONTRACT``. The code lives with the engine's own models (:mod:`rtpcore.models`), the
tensor-parallel stage (:mod:`rtpcore.parallel`) and the KV stage (:mod:`rtpcore.kv`), whose module
paths may move; import these names from here.
"""

from rtpcore.attention import paged_attention, paged_mla
from rtpcore.kv.attention_torch import causal_mask
from rtpcore.kv.paged_attention import decode_backend, paged_mla_decode
from rtpcore.models.layers import (
    Linear,
    cpu_has_native_dot,
    linear_kernels,
    packed_linear_supported,
)
from rtpcore.parallel.layers import GatherColumns, RowParallel, row_parallel

__all__ = [
    "GatherColumns",
    "Linear",
    "RowParallel",
    "causal_mask",
    "cpu_has_native_dot",
    "decode_backend",
    "linear_kernels",
    "packed_linear_supported",
    "paged_attention",
    "paged_mla",
    "paged_mla_decode",
    "row_parallel",
]

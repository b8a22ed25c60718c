"""``rtpcore.layers`` stays a public path; the layers live in :mod:`rtpcore.models.layers`."""

from rtpcore.models.layers import (
    Linear,
    cpu_has_native_dot,
    linear_kernels,
    packed_linear_supported,
)

__all__ = ["Linear", "cpu_has_native_dot", "linear_kernels", "packed_linear_supported"]

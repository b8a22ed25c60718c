"""Moved to :mod:`rtpcore.layers` (public); kept so older imports keep working."""

from rtpcore.layers import Linear, packed_linear_supported

__all__ = ["Linear", "packed_linear_supported"]

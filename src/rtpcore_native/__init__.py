"""rtpcore_native: the KV-cache spec builder, a pybind11 extension."""

from rtpcore_native._core import __version__

__all__ = ["__version__"]

"""rtpcore_native: the KV-cache spec builder, a pybind11 extension.

``build_kv_cache_spec(KVCacheSpecDesc(...))`` returns a ``KVCacheSpec``: the byte
map of one token's cache row (``regions``), its k/v/scale partition and the block
size; ``plan_kv_cache_blocks`` says how many blocks fit in a memory budget.
Invalid input raises ``ValueError`` naming the field and the value. ``Fp8LayoutPolicy`` is the
base of a plugin's own fp8 byte layout; ``BUILTIN_LAYOUTS`` names the built-in ones (``padded``:
FlashMLA's 656 bytes, ``compact``: aiter's 576), and ``__version__`` is the extension's version.
"""

from rtpcore_native._core import (
    BUILTIN_LAYOUTS,
    Fp8LayoutPolicy,
    KVCacheSpec,
    KVCacheSpecDesc,
    __version__,
    build_kv_cache_spec,
    plan_kv_cache_blocks,
)

__all__ = [
    "BUILTIN_LAYOUTS",
    "Fp8LayoutPolicy",
    "KVCacheSpec",
    "KVCacheSpecDesc",
    "__version__",
    "build_kv_cache_spec",
    "plan_kv_cache_blocks",
]

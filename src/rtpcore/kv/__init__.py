"""Stage 3, KV cache: byte layouts and the paged pools that hold them.

``specs`` builds each layer's KV-cache spec from a plugin's descriptors through
the native builder (``rtpcore_native``), with fp8 layouts chosen per layer;
``codecs`` packs and unpacks rows in exactly those layouts; ``pools`` allocates
a layer's blocks and reads and writes them. It hands the engine the per-layer
specs (to plan how many blocks fit) and the pools its model writes into.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rtpcore.kv.codecs import KVCodec, make_codec
    from rtpcore.kv.pools import LayerKVCache, PackedLayerKVCache, allocate_kv_caches
    from rtpcore.kv.specs import kv_cache_specs

# The names a plugin uses (docs/design.md §21), resolved on first use: ``import rtpcore.kv.specs``
# stays free of torch, which the pools and codecs import.
__all__ = ["KVCodec", "LayerKVCache", "PackedLayerKVCache", "allocate_kv_caches", "kv_cache_specs", "make_codec"]

_LAZY = {
    "KVCodec": "rtpcore.kv.codecs",
    "make_codec": "rtpcore.kv.codecs",
    "LayerKVCache": "rtpcore.kv.pools",
    "PackedLayerKVCache": "rtpcore.kv.pools",
    "allocate_kv_caches": "rtpcore.kv.pools",
    "kv_cache_specs": "rtpcore.kv.specs",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:  # never cached here: a module's attributes change only by its own code (§18 patch check)
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])

"""kit-layout's hooks: the layout module imports only ``rtpcore_native`` (no torch)."""

from __future__ import annotations

from typing import Any

from rtpcore import hookimpl


@hookimpl
def rtpcore_kv_cache_layouts() -> list[Any]:
    from kit_layout.layouts import IntFp8Layout

    return [IntFp8Layout()]

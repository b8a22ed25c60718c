"""The pluggy hook specifications and the ``hookimpl`` marker plugin authors use."""

from __future__ import annotations

from typing import Any

import pluggy

PROJECT = "rtpcore"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

__all__ = ["HOOK_NAMES", "PROJECT", "hookimpl", "hookspec"]


@hookspec
def rtpcore_register_models(registry: Any) -> None:
    """Register the plugin's models with ``registry.register(...)``.

    ``registry`` is a recording view of the ModelRegistry: registrations made
    here take effect only if the whole hook returns without raising.
    """


@hookspec
def rtpcore_kv_cache_layouts() -> list[Any]:  # type: ignore[empty-body]
    """Return extra fp8 KV-cache layout policies (``rtpcore_native.Fp8LayoutPolicy``
    instances), selectable by their ``name``."""


@hookspec
def rtpcore_register_tool_parsers(registry: Any) -> None:
    """Register the plugin's tool-call parsers (``rtpcore.ToolCallParser`` subclasses) with
    ``registry.register_tool_parser(cls)``, selectable by their ``name`` with
    ``rtpcore serve --tool-call-parser NAME``. Recorded like ``rtpcore_register_models``:
    they take effect only if the plugin's hooks all return without raising."""


@hookspec
def rtpcore_register_reasoning_parsers(registry: Any) -> None:
    """Register the plugin's reasoning parsers (``rtpcore.reasoning.ReasoningParser``
    subclasses) with ``registry.register_reasoning_parser(cls)``, selectable by their ``name``
    with ``rtpcore serve --reasoning-parser NAME`` (docs/design.md §18). Recorded like
    ``rtpcore_register_models``."""


@hookspec
def rtpcore_register_attention_backends(registry: Any) -> None:
    """Register the plugin's attention backends (``rtpcore.attention.AttentionBackend``
    subclasses) with ``registry.register_attention_backend(cls)``, selectable by their ``name``
    with ``--attention-backend NAME`` and chosen by ``priority`` otherwise (docs/design.md §18).
    Recorded like ``rtpcore_register_models``."""


@hookspec
def rtpcore_register_platforms(registry: Any) -> None:
    """Register the plugin's platforms (``rtpcore.platforms.Platform`` subclasses) with
    ``registry.register_platform(cls)``, selectable by their ``name`` with ``--device NAME``
    and by ``--device auto`` when available (docs/design.md §18). Recorded like
    ``rtpcore_register_models``."""


@hookspec
def rtpcore_register_quantization_methods(registry: Any) -> None:
    """Register the plugin's quantization methods (``rtpcore.quantization.QuantizationMethod``
    subclasses) with ``registry.register_quantization_method(cls)``, chosen by config.json's
    ``quantization_config.quant_method`` or ``--quantization NAME`` (docs/design.md §18).
    Recorded like ``rtpcore_register_models``."""


@hookspec
def rtpcore_register_logits_processors(registry: Any) -> None:
    """Register the plugin's logits processors (``rtpcore.logits.LogitsProcessor`` subclasses)
    with ``registry.register_logits_processor(cls)``, enabled by their ``name`` with
    ``--logits-processors NAME[,NAME]`` (``logits_processors=[...]``; docs/design.md §18).
    Recorded like ``rtpcore_register_models``."""


#: The name of every hook above: an implementation of another name is refused.
HOOK_NAMES = ("rtpcore_register_models", "rtpcore_kv_cache_layouts", "rtpcore_register_tool_parsers",
              "rtpcore_register_reasoning_parsers", "rtpcore_register_attention_backends",
              "rtpcore_register_platforms", "rtpcore_register_quantization_methods",
              "rtpcore_register_logits_processors")

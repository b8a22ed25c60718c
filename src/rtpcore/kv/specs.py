"""KV-cache specs for a model: descriptors from its plugin, layouts by name, native sizes.

The engine calls :func:`kv_cache_specs` once per model::

    specs = kv_cache_specs(plugin, config, kv_cache_dtype="fp8", kv_layout=None,
                           tokens_per_block=16, registry=registry, model_type="deepseek_v3")

which asks ``plugin.kv_cache_descs(...)`` for one ``KVCacheSpecDesc`` per layer and
builds each with ``rtpcore_native.build_kv_cache_spec``. An fp8 MLA layer's layout
is looked up by name among the built-ins (``"padded"``, ``"compact"``) and the
layouts plugins registered through the ``rtpcore_kv_cache_layouts`` hook
(``registry.get_layout(name)`` / ``registry.layout_names()``). ``kv_layout=``
overrides whatever the plugin chose. Every native ``ValueError`` surfaces as
:class:`~rtpcore.errors.KVCacheSpecError` carrying the layer's tag.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

from rtpcore.errors import KVCacheSpecError

__all__ = [
    "KV_CACHE_DTYPES",
    "LayoutSource",
    "build_specs",
    "kv_cache_specs",
    "layout_names",
    "plan_blocks",
    "resolve_kv_cache_dtype",
    "summarize",
]

log = logging.getLogger(__name__)

#: ``kv_cache_dtype`` values the engine and CLI accept, and the native dtype each means
#: (``"auto"`` follows the model dtype).
KV_CACHE_DTYPES = {
    "fp32": "fp32",
    "fp16": "fp16",
    "bf16": "bf16",
    "fp8": "fp8_e4m3",
    "fp8_e4m3": "fp8_e4m3",
}
_MODEL_DTYPES = {
    "float32": "fp32",
    "float16": "fp16",
    "bfloat16": "bf16",
    "fp32": "fp32",
    "fp16": "fp16",
    "bf16": "bf16",
}


class LayoutSource(Protocol):
    """What this module needs from a registry: plugin layouts by name."""

    def get_layout(self, name: str) -> Any | None: ...

    def layout_names(self) -> list[str]: ...


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: str = "float32") -> str:
    """``"auto"`` -> the model dtype's KV dtype; ``"fp8"`` -> ``"fp8_e4m3"``; checked."""
    if kv_cache_dtype == "auto":
        if model_dtype not in _MODEL_DTYPES:
            raise KVCacheSpecError(
                f"kv_cache_dtype='auto' follows the model dtype, but dtype={model_dtype!r} is not one of "
                f"{', '.join(map(repr, _MODEL_DTYPES))}"
            )
        return _MODEL_DTYPES[model_dtype]
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        choices = ", ".join(map(repr, ["auto", *KV_CACHE_DTYPES]))
        raise KVCacheSpecError(f"kv_cache_dtype={kv_cache_dtype!r} is not one of {choices}")
    return KV_CACHE_DTYPES[kv_cache_dtype]


def layout_names(registry: LayoutSource | None = None) -> list[str]:
    """Every selectable fp8 layout name: the built-ins and the registry's, sorted."""
    from rtpcore_native import BUILTIN_LAYOUTS

    names = set(BUILTIN_LAYOUTS)
    if registry is not None:
        names.update(registry.layout_names())
    return sorted(names)


def kv_cache_specs(
    plugin: Any,
    config: Any,
    *,
    kv_cache_dtype: str,
    kv_layout: str | None = None,
    tokens_per_block: int = 16,
    registry: LayoutSource | None = None,
    model_type: str | None = None,
) -> list[Any]:
    """Ask ``plugin`` (a ModelPlugin subclass) for its descriptors and build one spec per layer.

    ``kv_cache_dtype`` may be a native dtype or ``"fp8"``; resolve ``"auto"`` first
    with :func:`resolve_kv_cache_dtype`.
    """
    dtype = resolve_kv_cache_dtype(kv_cache_dtype)
    if kv_layout is not None:
        _check_layout_name(kv_layout, registry)
    name = str(
        model_type or getattr(plugin, "model_type", None) or getattr(plugin, "__name__", "model")
    )
    try:
        descs = plugin.kv_cache_descs(
            config, kv_cache_dtype=dtype, kv_layout=kv_layout, tokens_per_block=tokens_per_block
        )
    except KVCacheSpecError:
        raise
    except ValueError as exc:  # an invalid descriptor, or options the plugin refused
        raise KVCacheSpecError(f"{name}: kv_cache_descs failed: {exc}") from exc
    return build_specs(descs, registry=registry, kv_layout=kv_layout, model_type=name)


def build_specs(
    descs: Sequence[Any],
    *,
    registry: LayoutSource | None = None,
    kv_layout: str | None = None,
    model_type: str = "model",
) -> list[Any]:
    """Build every descriptor; ``kv_layout`` replaces the layout of each fp8 MLA layer.

    Logs one line summarizing the layouts chosen for ``model_type``.
    """
    from rtpcore_native import KVCacheSpecDesc

    descs = list(descs)
    if not descs:
        raise KVCacheSpecError(f"{model_type}: kv_cache_descs returned no descriptors")
    for i, desc in enumerate(descs):
        if not isinstance(desc, KVCacheSpecDesc):
            raise KVCacheSpecError(
                f"{model_type}: kv_cache_descs()[{i}] must be a rtpcore_native.KVCacheSpecDesc, got {desc!r}"
            )
    if kv_layout is not None:
        _check_layout_name(kv_layout, registry)
        if not any(_is_fp8_mla(d) for d in descs):
            raise KVCacheSpecError(
                f"kv_layout={kv_layout!r} selects an fp8 MLA layout, but {model_type} has no fp8 MLA "
                f"layer (kinds/dtypes: {', '.join(sorted({f'{d.kind}/{d.dtype}' for d in descs}))})"
            )
        descs = [_with_layout(d, kv_layout) if _is_fp8_mla(d) else d for d in descs]
    specs = [_build(desc, registry) for desc in descs]
    log.info("KV cache of %s: %s", model_type, summarize(specs))
    return specs


def plan_blocks(specs: Sequence[Any], memory_bytes: int) -> int:
    """Blocks per layer that fit in ``memory_bytes`` (every layer holds that many)."""
    from rtpcore_native import plan_kv_cache_blocks

    try:
        return int(plan_kv_cache_blocks(list(specs), memory_bytes))
    except ValueError as exc:
        raise KVCacheSpecError(f"cannot plan KV-cache blocks: {exc}") from exc


def summarize(specs: Sequence[Any]) -> str:
    """``"61 layers, 2 x mla fp8_e4m3 padded 656 B/token + 59 x ..."``: runs of equal layers."""
    runs: list[list[Any]] = []
    for spec in specs:
        key = (spec.kind, spec.dtype, spec.layout, spec.bytes_per_token)
        if runs and runs[-1][0] == key:
            runs[-1][1] += 1
        else:
            runs.append([key, 1])
    parts = [
        f"{n} x {kind} {dtype}{' ' + layout if layout else ''} {bpt} B/token"
        for (kind, dtype, layout, bpt), n in runs
    ]
    total = sum(s.block_bytes for s in specs)
    return f"{len(specs)} layers, {' + '.join(parts)}; {total} bytes per block across layers"


def _is_fp8_mla(desc: Any) -> bool:
    return bool(desc.kind == "mla" and desc.dtype == "fp8_e4m3")


def _with_layout(desc: Any, layout: str) -> Any:
    from rtpcore_native import KVCacheSpecDesc

    return KVCacheSpecDesc(
        tag=desc.tag,
        kind=desc.kind,
        dtype=desc.dtype,
        kv_lora_rank=desc.kv_lora_rank,
        rope_head_dim=desc.rope_head_dim,
        num_kv_heads=desc.num_kv_heads,
        head_dim=desc.head_dim,
        tokens_per_block=desc.tokens_per_block,
        layout=layout,
    )


def _check_layout_name(name: str, registry: LayoutSource | None) -> None:
    known = layout_names(registry)
    if name not in known:
        raise KVCacheSpecError(f"unknown KV layout {name!r}; known: {', '.join(map(repr, known))}")


def _policy_for(desc: Any, registry: LayoutSource | None) -> Any | None:
    """The plugin policy of an fp8 MLA layer's layout; None for built-ins."""
    from rtpcore_native import BUILTIN_LAYOUTS

    if not _is_fp8_mla(desc) or desc.layout in ("", *BUILTIN_LAYOUTS):
        return None
    policy = registry.get_layout(desc.layout) if registry is not None else None
    if policy is None:
        known = ", ".join(map(repr, layout_names(registry)))
        raise KVCacheSpecError(
            f"layer {desc.tag!r}: unknown KV layout {desc.layout!r}; known: {known}", tag=desc.tag
        )
    return policy


def _build(desc: Any, registry: LayoutSource | None) -> Any:
    from rtpcore_native import build_kv_cache_spec

    policy = _policy_for(desc, registry)
    try:
        return build_kv_cache_spec(desc, policy=policy)
    except ValueError as exc:
        raise KVCacheSpecError(f"layer {desc.tag!r}: {exc}", tag=desc.tag) from exc

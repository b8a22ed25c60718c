"""``ModelPlugin``: the class plugin authors subclass.

A ModelPlugin is a bundle of classmethods; it is never instantiated. Its class
attributes are plain data so the registry can validate and index a plugin
without importing torch.

The engine calls, in order::

    config  = Plugin.config_from_hf(hf_config)              # parsed config.json -> your config
    names   = Plugin.weight_patterns(config)                # tensors to read ("{layer}" = index)
    ranges  = Plugin.placeholder_ranges(config)             # which indices are required
    descs   = Plugin.kv_cache_descs(config, kv_cache_dtype=..., kv_layout=..., tokens_per_block=...)
    model   = Plugin.build_model(config, weights, dtype=..., device=...)

With ``tensor_parallel_size > 1`` every rank first calls the optional
``Plugin.tensor_parallel_shard(config, rank, world_size)`` and uses the config it
returns for the steps above; ``build_model`` then also receives ``parallel=ctx``
(a ``rtpcore.parallel.context.ParallelContext``).

Forward contract (the same for every model; version ``FORWARD_CONTRACT``, see
``rtpcore.models.forward_batch``)::

    logits = model(batch, kv_caches)
    # batch:     rtpcore.models.forward_batch.ForwardBatch, the new tokens of every scheduled sequence
    #            concatenated (T tokens in all, nothing padded) with their positions and cache
    #            slots: a decode's last token, or a chunk of a prompt (chunked prefill) whose
    #            queries also attend to the keys its earlier chunks cached
    # kv_caches: list[rtpcore.kv.pools.LayerKVCache], one per KVCacheSpecDesc, in order
    # logits:    (N, vocab) float tensor: the rows batch.logits_index names (None: one per
    #            sequence, after its last new token). A prompt chunk that does not end its
    #            prompt has no row; speculative decoding scores a draft's proposals through it.

A plugin must state the version it was written for in ``forward_contract`` (the base class
sets none). A class that states none, or another version than the running one, is refused
when it is registered or first imported (``rtpcore plugins check`` imports every class), and
the engine refuses to build its model: the message names the class, what it stated and
``FORWARD_CONTRACT``, so a model is never run on a batch layout it does not understand.

Drafts for speculative decoding (docs/design.md §10): a draft checkpoint is served like any
other, by the plugin its config.json names. ``draft_model="mtp"`` asks the target's plugin for
the optional ``Plugin.mtp_draft(config)``: another ModelPlugin class that describes the
checkpoint's multi-token-prediction layers (their tensors, KV descriptors and module). The
engine loads it like a model from the same checkpoint (reading only its tensors) and calls
its ``build_model`` with ``target=`` the target model too; its forward reads the target's
hidden states through ``batch.hidden_rows`` (see ``rtpcore.models.forward_batch``).

A reference implementation: ``transformers_class`` (optional, None by default) names a class of
the ``transformers`` package (``"LlamaForCausalLM"``) that computes the same function from the
same checkpoint. The conformance kit's ``hf_parity`` check (docs/design.md §19) loads it from the
model's demo checkpoint in float32 and compares its greedy tokens with the engine's; without it
the check is skipped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

__all__ = [
    "FORWARD_CONTRACT",
    "ModelPlugin",
    "forward_contract_problem",
    "model_plugin_problems",
    "replaces_problem",
]

FORWARD_CONTRACT = 2  # the forward contract this rtpcore runs (1: padded batches, before 0.2)


class ModelPlugin:
    """Base class of every model served by rtpcore, built-in or external.

    Subclasses set ``model_type`` (the unique registry key) and
    ``architectures`` (the Hugging Face ``config.json`` "architectures" values
    they serve) and ``forward_contract`` (the version of the forward contract its
    model follows: ``FORWARD_CONTRACT``; there is no default). ``replaces`` lists the
    built-in architectures, or the built-in model type, this plugin takes over on
    purpose; without it, an external plugin that claims one is a conflict (built-ins
    only fill empty slots). ``transformers_class`` (optional) names the class of the
    ``transformers`` package computing the same function from the same checkpoint
    (``"LlamaForCausalLM"``): the kit's ``hf_parity`` check compares greedy tokens with it.
    """

    model_type: ClassVar[str]
    architectures: ClassVar[tuple[str, ...]]
    replaces: ClassVar[tuple[str, ...]] = ()
    forward_contract: ClassVar[int]  # no default: every plugin states the contract it follows
    # The transformers class computing the same function from the same checkpoint (by name, so
    # reading it imports nothing), or None: the reference of the kit's hf_parity check.
    transformers_class: ClassVar[str | None] = None
    # Whether a decode step reads every layer's KV pool in place (through rtpcore.kv.paged_attention,
    # or a kernel of its own); False keeps its decode steps out of CUDA graphs, which would
    # otherwise gather the longest possible context on every step (docs/design.md §9).
    decode_reads_kv_in_place: ClassVar[bool] = True

    @classmethod
    def config_from_hf(cls, hf_config: Mapping[str, Any]) -> Any:
        """Turn a parsed ``config.json`` into this model's config object."""
        raise NotImplementedError(f"{cls.__qualname__}.config_from_hf is not implemented")

    @classmethod
    def weight_patterns(cls, config: Any) -> Sequence[str]:
        """Names of the tensors this model reads from the checkpoint.

        ``{name}`` stands for one decimal index (``model.layers.{layer}.mlp.up_proj.weight``);
        everything else is literal and the whole name must match.
        """
        raise NotImplementedError(f"{cls.__qualname__}.weight_patterns is not implemented")

    @classmethod
    def placeholder_ranges(cls, config: Any) -> Mapping[str, Sequence[int]]:
        """The indices each placeholder must cover; each pattern is expanded over
        them into the exact set of required tensor names.

        The default requires ``{layer}`` for every layer, ``range(num_hidden_layers)``,
        whatever the config type: a mapping (``config["num_hidden_layers"]``) or any
        object with that attribute (attrs, dataclass, ...); a layer count that is not
        an integer >= 1 is a ``ConfigFieldError``. A config without a layer count,
        and any placeholder with no range, matches any index and requires none
        (optional tensors): override this to require them.
        """
        from rtpcore import config_fields

        fields = config if isinstance(config, Mapping) else {}
        if not isinstance(config, Mapping) and hasattr(config, "num_hidden_layers"):
            fields = {"num_hidden_layers": config.num_hidden_layers}
        n = config_fields.optional_int(fields, "num_hidden_layers", None)
        return {} if n is None else {"layer": range(n)}

    @classmethod
    def kv_cache_descs(cls, config: Any, **options: Any) -> Sequence[Any]:
        """One ``rtpcore_native.KVCacheSpecDesc`` per attention layer, in layer order.

        Options the engine passes: ``kv_cache_dtype`` (``"fp32"``, ``"fp16"``,
        ``"bf16"`` or ``"fp8_e4m3"``, already resolved from ``"auto"``),
        ``kv_layout`` (an fp8 layout name or None: the plugin's choice) and
        ``tokens_per_block``.
        """
        raise NotImplementedError(f"{cls.__qualname__}.kv_cache_descs is not implemented")

    @classmethod
    def build_model(cls, config: Any, weights: Mapping[str, Any], **options: Any) -> Any:
        """Build the ``torch.nn.Module`` from loaded weights (engine dtype already).

        Options the engine passes: ``dtype`` (a ``torch.dtype``) and ``device``.
        """
        raise NotImplementedError(f"{cls.__qualname__}.build_model is not implemented")

    @classmethod
    def weight_shapes(cls, config: Any) -> Mapping[str, tuple[int, ...]]:
        """Optional: expected shapes by pattern, checked when the checkpoint loads."""
        return {}

    @classmethod
    def weight_dtypes(cls, config: Any) -> Mapping[str, str]:
        """Optional: patterns whose tensors keep another dtype than the engine's,
        e.g. ``{"model.layers.{layer}.mlp.gate.weight": "float32"}`` for a router that
        the reference implementation runs in float32 in a bfloat16 model."""
        return {}

    @classmethod
    def tensor_parallel_shard(
        cls, config: Any, rank: int, world_size: int
    ) -> tuple[Any, Mapping[str, tuple[int, int, int]]]:
        """Optional: tensor parallelism.

        Returns this rank's config (e.g. ``num_attention_heads // world_size``) and
        the checkpoint slices the rank reads, ``{weight pattern: (dim, start, stop)}``
        (``rtpcore.parallel.sharding`` computes them). ``build_model`` then also receives
        ``parallel``, the rank's ``rtpcore.parallel.context.ParallelContext``: finish
        row-parallel layers with ``parallel.all_reduce`` (``rtpcore.parallel.layers``).
        Without an override, ``tensor_parallel_size > 1`` is refused.
        """
        raise NotImplementedError(f"{cls.__qualname__} does not support tensor parallelism")

    @classmethod
    def mtp_draft(cls, config: Any) -> type[ModelPlugin] | None:
        """Optional: the ModelPlugin of this checkpoint's multi-token-prediction layers, served
        as the draft of ``draft_model="mtp"``, or None when the model has none (the default).

        The returned class gets the same ``config.json`` in ``config_from_hf``; its
        ``weight_patterns`` name only the MTP tensors, which must be in the checkpoint (a
        missing one is a ``MissingTensorsError``); ``build_model`` also receives ``target``,
        the target model built on the same rank, whose hidden states the draft reads
        (``ForwardBatch.hidden_rows``). Its forward returns (N, vocab) logits like any model.
        """
        return None

    @classmethod
    def demo_config(cls) -> Mapping[str, Any] | None:
        """Optional: a small Hugging Face style config.json dict for ``--demo``."""
        return None


_REQUIRED_CLASSMETHODS = ("config_from_hf", "weight_patterns", "kv_cache_descs", "build_model")
_OPTIONAL_CLASSMETHODS = (
    "placeholder_ranges",
    "weight_shapes",
    "weight_dtypes",
    "tensor_parallel_shard",
    "mtp_draft",
    "demo_config",
)


# What a switched-off optional classmethod (set to None) stands for.
_SWITCHED_OFF: dict[str, Any] = {
    "placeholder_ranges": {},  # no placeholder has a range: patterns match any index, none required
    "weight_shapes": {},  # no shape checks
    "weight_dtypes": {},  # every tensor in the engine's dtype
    "demo_config": None,  # no demo model
    "mtp_draft": None,  # no multi-token-prediction draft
}


def call_optional(plugin: type[ModelPlugin], name: str, *args: Any) -> Any:
    """``plugin.<name>(*args)`` for one of the optional classmethods, or what the capability
    means when the plugin set it to None (switched off). ``tensor_parallel_shard`` is not
    here: switched off, it refuses ``tensor_parallel_size > 1`` (rtpcore.engine.worker.rank)."""
    method = getattr(plugin, name, None)
    if method is None:
        return _SWITCHED_OFF[name]
    return method(*args)


def _is_name(value: object) -> bool:
    return isinstance(value, str) and value != "" and not any(ch.isspace() for ch in value)


def _names_problem(attr: str, value: object) -> str | None:
    if isinstance(value, str):
        return f"{attr} must be a tuple of strings, got the string {value!r} (a missing trailing comma?)"
    if not isinstance(value, tuple | list):
        return f"{attr} must be a tuple of strings, got {type(value).__name__}"
    bad = [v for v in value if not _is_name(v)]
    if bad:
        return f"{attr} holds {bad[0]!r}: each must be a non-empty string without whitespace"
    dups = sorted({v for v in value if list(value).count(v) > 1})
    if dups:
        return f"{attr} lists {dups[0]!r} more than once"
    return None


def model_plugin_problems(cls: object) -> list[str]:
    """What makes ``cls`` unusable as a ModelPlugin, one sentence each (empty when valid).

    Checks only class attributes, so it never imports torch: ``model_type`` a non-empty
    string, ``architectures`` a non-empty tuple of strings, ``replaces`` naming only its
    ``architectures`` or its ``model_type``, ``forward_contract`` stated and equal to
    :data:`FORWARD_CONTRACT`, the four required methods overridden as classmethods (or
    staticmethods), and the optional ones classmethods or None (switched off).
    """
    import inspect

    if not isinstance(cls, type):
        return [f"{cls!r} is not a class"]
    if not issubclass(cls, ModelPlugin):
        return [f"{cls.__qualname__} does not subclass rtpcore.ModelPlugin"]
    if cls is ModelPlugin:
        return ["rtpcore.ModelPlugin itself cannot be registered; subclass it"]
    problems: list[str] = []
    model_type = getattr(cls, "model_type", None)
    if model_type is None:
        problems.append("model_type is not set")
    elif not _is_name(model_type):
        problems.append(
            f"model_type must be a non-empty string without whitespace, got {model_type!r}"
        )
    architectures = getattr(cls, "architectures", None)
    if architectures is None:
        problems.append("architectures is not set")
    elif (problem := _names_problem("architectures", architectures)) is not None:
        problems.append(problem)
    elif not architectures:
        problems.append(
            "architectures is empty: list the config.json architectures this model serves"
        )
    replaces = getattr(cls, "replaces", ())
    problem = _names_problem("replaces", replaces)
    if problem is None and isinstance(architectures, tuple | list):
        problem = replaces_problem(replaces, architectures, model_type)
    if problem is not None:
        problems.append(problem)
    if (problem := _contract_problem(getattr(cls, "forward_contract", None), "it")) is not None:
        problems.append(problem)
    for name in _REQUIRED_CLASSMETHODS + _OPTIONAL_CLASSMETHODS:
        static = inspect.getattr_static(cls, name, None)
        if static is None and name in _OPTIONAL_CLASSMETHODS:
            continue  # an optional capability switched off (e.g. tensor_parallel_shard = None)
        if not isinstance(static, classmethod | staticmethod):
            problems.append(f"{name} must be a classmethod, got {type(static).__name__}")
        elif name in _REQUIRED_CLASSMETHODS and static is ModelPlugin.__dict__[name]:
            problems.append(f"{name} is not implemented")
    return problems


def replaces_problem(replaces: Sequence[str], architectures: Sequence[str], model_type: object) -> str | None:
    """Why ``replaces`` names something the plugin does not claim itself, or None: each entry
    must be one of its ``architectures`` or its ``model_type``."""
    extra = [r for r in replaces if r not in architectures and r != model_type]
    if not extra:
        return None
    return (
        f"replaces lists {extra[0]!r}, which is neither in architectures nor its model_type "
        f"{model_type!r}: a plugin takes over only what it serves itself"
    )


def _contract_problem(stated: object, subject: str) -> str | None:
    """Why ``stated`` (a class's ``forward_contract``, None when unset) cannot run here."""
    n = FORWARD_CONTRACT
    fix = f"(set `forward_contract = {n}` on the class)"
    if stated is None:
        return f"{subject} does not state forward_contract; this rtpcore runs {n} {fix}"
    if not isinstance(stated, int) or isinstance(stated, bool):
        return f"{subject} states forward_contract={stated!r}, which is not an int; this rtpcore runs {n} {fix}"
    if stated == n:
        return None
    return (
        f"{subject} states forward_contract={stated!r}, but this rtpcore runs forward contract {n}: "
        f"its model would receive batches it does not understand. Move the plugin to contract {n} "
        f'(docs/plugins.md, "Migrating to forward contract {n}") and set forward_contract = {n}'
    )


def forward_contract_problem(plugin: type[ModelPlugin], model_type: str) -> str | None:
    """Why the engine cannot run ``plugin``'s model under this rtpcore's forward contract,
    or None when it can (a class that states none cannot)."""
    where = f"{plugin.__module__}.{plugin.__qualname__}"
    return _contract_problem(getattr(plugin, "forward_contract", None), f"model type {model_type!r} ({where})")

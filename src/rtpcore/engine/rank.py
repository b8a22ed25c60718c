"""One rank's part of an engine: its model shard and its KV cache.

Every rank of an engine holds one :class:`EngineShard`, built from the engine's
resolved, picklable :class:`~rtpcore.engine.EngineConfig` (which carries the
plugin plan). Rank 0 is the engine's own process; with
``tensor_parallel_size > 1`` ranks 1..N-1 are worker processes that build the
same object from the config they received at start (see ``rtpcore.parallel.leader``),
so a worker never discovers plugins: it loads the parent's plan.

Tensor parallelism is the model plugin's business, through one optional
classmethod::

    local_config, slices = Plugin.tensor_parallel_shard(config, rank, world_size)

``local_config`` describes this rank's part (e.g. ``num_attention_heads / N``);
it is what ``kv_cache_descs`` and ``build_model`` receive. ``slices`` maps
weight patterns to ``(dim, start, stop)``: the checkpoint reader loads only
those parts of those tensors. ``build_model`` also receives ``parallel``, the
rank's :class:`~rtpcore.parallel.context.ParallelContext`, whose ``all_reduce`` /
``all_gather`` finish row-parallel and vocabulary-parallel layers.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from rtpcore.engine.memory import memory_limit
from rtpcore.errors import RtpcoreError
from rtpcore.models.layers import linear_kernels
from rtpcore.parallel.context import ParallelContext
from rtpcore.plugins.model_plugin import call_optional

__all__ = ["EngineShard", "build_shard"]

logger = logging.getLogger(__name__)


class EngineShard:
    """A rank's model shard and KV cache; the local object of the engine's worker group.

    Steps (run on every rank by ``WorkerGroup.run``): :meth:`allocate`,
    :meth:`forward`, :meth:`stats`.
    """

    def __init__(self, ctx: ParallelContext, config: Any):
        from rtpcore.checkpoint import load_checkpoint, read_hf_config
        from rtpcore.checkpoint.quantized import Fp8BlockQuantization
        from rtpcore.kv.specs import kv_cache_specs
        from rtpcore.plugins.loading import load_plugins

        self.ctx = ctx
        self.config = config
        self.registry = registry = load_plugins(config.plan)  # already loaded: returns the registry
        self.hf_config = read_hf_config(config.checkpoint)
        self.model_type = config.model_type or registry.infer_model_type(self.hf_config)
        plugin = registry.get(self.model_type)
        self.model_config = plugin.config_from_hf(self.hf_config)  # the whole model's config
        # fp8 block-quantized weights are dequantized at load, for every model
        quantization = Fp8BlockQuantization.from_hf(self.hf_config)
        self.local_config, slices = _shard(plugin, self.model_type, self.model_config, ctx)
        # Before the weights: a bad layout fails fast.
        self.kv_cache_specs = kv_cache_specs(
            plugin,
            self.local_config,
            kv_cache_dtype=config.kv_cache_dtype,
            kv_layout=config.kv_layout,
            tokens_per_block=config.tokens_per_block,
            registry=registry,
            model_type=self.model_type,
        )
        weights = load_checkpoint(
            config.checkpoint,
            plugin.weight_patterns(self.model_config),
            call_optional(plugin, "placeholder_ranges", self.model_config),
            dtype=config.torch_dtype,
            expected_shapes=call_optional(plugin, "weight_shapes", self.model_config),
            slices=slices,
            dtypes=call_optional(plugin, "weight_dtypes", self.model_config),
            quantization=quantization,
        )
        self.bytes_read = weights.stats.tensor_bytes_read
        options: dict[str, Any] = {"dtype": config.torch_dtype, "device": ctx.device}
        if ctx.world_size > 1:
            options["parallel"] = ctx
        with linear_kernels(batched_fp32=_fp32_batched_linear(config, weights, ctx.device)):
            self.model = plugin.build_model(self.local_config, weights, **options)
        del weights
        if isinstance(self.model, torch.nn.Module):
            self.model.eval()
        self.kv_caches: list[Any] = []

    def allocate(self, num_blocks: int) -> None:
        """Preallocate ``num_blocks`` KV blocks per layer (rank 0 decides the number)."""
        from rtpcore.kv.pools import allocate_kv_caches

        self.kv_caches = []  # free the old pools before allocating new ones
        self.kv_caches = allocate_kv_caches(
            self.kv_cache_specs,
            num_blocks,
            device=self.ctx.device,
            compute_dtype=self.config.torch_dtype,
            layouts=self.registry,
        )

    def forward(self, batch: Any) -> torch.Tensor | None:
        """Run the model on one step's batch; (B, vocab) logits on rank 0, None elsewhere
        (so nothing travels back)."""
        with torch.inference_mode():
            logits = self.model(batch, self.kv_caches)
        return logits if self.ctx.rank == 0 else None

    def stats(self, _: Any = None) -> dict[str, Any]:
        """What this rank holds: for tests and diagnostics."""
        params = 0  # elements of every parameter and buffer (weights may be either)
        if isinstance(self.model, torch.nn.Module):
            tensors = [*self.model.parameters(), *self.model.buffers()]
            params = sum(t.numel() for t in tensors)
        return {
            "rank": self.ctx.rank,
            "bytes_read": self.bytes_read,
            "elements": params,
            "kv_block_bytes": sum(s.block_bytes for s in self.kv_cache_specs),
        }


def build_shard(ctx: ParallelContext, config: Any) -> EngineShard:
    """The worker-group factory of an engine (``"rtpcore.engine.rank:build_shard"``)."""
    return EngineShard(ctx, config)


def _shard(
    plugin: Any, model_type: str, config: Any, ctx: ParallelContext
) -> tuple[Any, dict[str, tuple[int, int, int]] | None]:
    if ctx.world_size == 1:
        return config, None
    unsupported = RtpcoreError(
        f"model type {model_type!r} ({plugin.__module__}.{plugin.__qualname__}) does not support "
        f"tensor_parallel_size={ctx.world_size}: it defines no tensor_parallel_shard(); use 1"
    )
    shard = getattr(plugin, "tensor_parallel_shard", None)
    if shard is None:
        raise unsupported
    try:
        local, slices = shard(config, ctx.rank, ctx.world_size)
    except NotImplementedError:  # the ModelPlugin default
        raise unsupported from None
    return local, dict(slices)


# The float32 copies of "packed+fp32" linear layers may take at most this share of the
# memory limit; beyond it a model keeps its reduced-precision weights only.
FP32_COPY_MEMORY_FRACTION = 0.25


def _fp32_batched_linear(config: Any, weights: Mapping[str, torch.Tensor], device: Any) -> bool | None:
    """The engine's ``fp32_batched_linear``; when automatic (None), False if float32 copies
    of this rank's bf16/fp16 weights would take more than FP32_COPY_MEMORY_FRACTION of the
    memory limit, else None (each Linear decides by the CPU's instructions, rtpcore.models.layers)."""
    choice = config.fp32_batched_linear
    if choice is not None or torch.device(device or "cpu").type != "cpu":
        return choice
    reduced = sum(t.numel() for t in weights.values() if t.dtype in (torch.bfloat16, torch.float16))
    budget = int(memory_limit() * FP32_COPY_MEMORY_FRACTION) // max(1, config.tensor_parallel_size)
    if 4 * reduced > budget:
        logger.info(
            "bf16/fp16 linear layers keep no float32 copies: %.1f GB would exceed %.0f%% of the memory limit",
            4 * reduced / 1e9, 100 * FP32_COPY_MEMORY_FRACTION,
        )
        return False
    return None

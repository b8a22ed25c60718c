"""How much of a GPU the KV cache may take (:func:`gpu_kv_cache_bytes`); how many KV blocks an
engine allocates (:func:`kv_cache_blocks`). How much memory this process may use on the host
(:func:`memory_limit`: physical RAM, or less under a cgroup limit) is the CPU platform's
(:mod:`rtpcore.platforms`), re-exported here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from rtpcore.errors import KVCacheCapacityError
from rtpcore.platforms import cgroup_memory_limit, memory_limit, physical_memory

__all__ = ["RAM_FRACTION", "cgroup_memory_limit", "gpu_kv_cache_bytes", "kv_cache_blocks", "memory_limit", "physical_memory"]

RAM_FRACTION = 0.25  # cap of the default KV memory on the CPU

logger = logging.getLogger(__name__)


def gpu_kv_cache_bytes(*, total: int, free: int, peak_step: int, utilization: float) -> int:
    """Bytes a GPU's KV pool may take: ``utilization`` of the device's ``total`` memory, less
    what is in use already (``total - free``: the weights, and anything else on the device,
    other processes included), less ``peak_step``, the transient memory of the largest step
    (measured at start). 0 when nothing is left."""
    in_use = total - free
    return max(0, int(utilization * total) - in_use - peak_step)


def _platform(config: Any) -> Any:
    """The engine's platform class (``rtpcore.platforms``), from its plan's registry."""
    from rtpcore.plugins.loading import load_plugins

    return load_plugins(config.plan).seam_class("platforms", getattr(config, "platform", "cpu"))


def kv_cache_blocks(specs: Sequence[Any], config: Any, max_model_len: int, group: Any) -> int:
    """KV blocks per layer for ``config.kv_cache_memory`` (an ``rtpcore.engine.config.EngineConfig``)
    or the default: on a GPU what :func:`gpu_kv_cache_bytes` leaves after every rank's measured step
    (``group.run("profile_memory", ...)``), on the CPU ``max_batch_size`` sequences of
    ``max_model_len`` tokens, at most :data:`RAM_FRACTION` of the platform's total memory over the
    ranks (the CPU platform's: :func:`memory_limit`); on a plugin platform's own device type
    ``gpu_memory_utilization`` of its ``memory_info()``.
    At least one ``max_model_len`` sequence's worth, else a KVCacheCapacityError."""
    from rtpcore.kv.specs import plan_blocks

    block_bytes = sum(s.block_bytes for s in specs)
    tpb = config.tokens_per_block
    memory = config.kv_cache_memory
    platform = _platform(config)
    if memory is None and platform.device_type not in ("cpu", "cuda"):
        # A plugin platform's device: what its memory_info says is free, by gpu_memory_utilization.
        free, total = platform.memory_info()
        memory = gpu_kv_cache_bytes(total=total, free=free, peak_step=0, utilization=config.gpu_memory_utilization)
    elif memory is None and config.device != "cpu":
        # Every rank measures its own device: the step's peak, then what is free.
        readings = group.run("profile_memory", config.max_num_batched_tokens, gather=True)
        memory = min(
            gpu_kv_cache_bytes(total=total, free=free, peak_step=peak, utilization=config.gpu_memory_utilization)
            for peak, free, total in readings
        )
    elif memory is None:
        want = -(-config.max_batch_size * max_model_len // tpb) * block_bytes
        # Every rank allocates this much; spawned ranks share this machine's RAM.
        cap = int(platform.memory_info()[1] * RAM_FRACTION) // config.tensor_parallel_size
        memory = min(want, cap)
    blocks = plan_blocks(specs, memory)
    need = -(-max_model_len // tpb)
    if blocks < need:
        raise KVCacheCapacityError(
            f"the KV cache holds {blocks} blocks of {tpb} tokens ({blocks * tpb} tokens, {memory} bytes per "
            f"rank), but one max_model_len={max_model_len} sequence needs {need} blocks "
            f"({need * block_bytes} bytes over all layers): lower --max-model-len (max_model_len=) "
            "or raise --kv-cache-memory (kv_cache_memory=)",
            tokens_needed=max_model_len,
            blocks_needed=need,
            blocks_available=blocks,
        )
    return blocks

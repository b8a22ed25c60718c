"""How much memory this process may use: physical RAM, or less under a cgroup limit; and
how much of a GPU the KV cache may take (:func:`gpu_kv_cache_bytes`); how many KV blocks an engine
allocates (:func:`kv_cache_blocks`).

A container's memory limit is a cgroup's, not the host's RAM: a KV cache sized
from the host's RAM gets the process killed. :func:`memory_limit` is the smaller
of physical RAM and every limit on this process's cgroup and its ancestors:

* cgroup v2: ``memory.max`` in ``<root>/<path>`` for the ``0::<path>`` line of
  ``/proc/self/cgroup``; ``max`` means no limit.
* cgroup v1: ``memory.limit_in_bytes`` in ``<root>/memory/<path>`` for the line
  naming the ``memory`` controller; values of 2**60 bytes and more mean no limit
  (the kernel writes ``PAGE_COUNTER_MAX`` pages there).

``root`` (``/sys/fs/cgroup``) and ``proc_cgroup`` (``/proc/self/cgroup``) are
parameters, so other hierarchies (and tests) can point them elsewhere. Files that
are missing or unreadable mean no limit.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from rtpcore.errors import KVCacheCapacityError

__all__ = ["RAM_FRACTION", "cgroup_memory_limit", "gpu_kv_cache_bytes", "kv_cache_blocks", "memory_limit", "physical_memory"]

RAM_FRACTION = 0.25  # cap of the default KV memory on the CPU

logger = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
_V1_UNLIMITED = 1 << 60
_FALLBACK = 8 << 30  # when the platform cannot tell its RAM


def gpu_kv_cache_bytes(*, total: int, free: int, peak_step: int, utilization: float) -> int:
    """Bytes a GPU's KV pool may take: ``utilization`` of the device's ``total`` memory, less
    what is in use already (``total - free``: the weights, and anything else on the device,
    other processes included), less ``peak_step``, the transient memory of the largest step
    (measured at start). 0 when nothing is left."""
    in_use = total - free
    return max(0, int(utilization * total) - in_use - peak_step)


def physical_memory() -> int:
    """Bytes of physical RAM (8 GiB when the platform cannot tell)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not POSIX
        return _FALLBACK


def memory_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """The smaller of physical RAM and this process's cgroup memory limit."""
    ram = physical_memory()
    limit = cgroup_memory_limit(root, proc_cgroup)
    return ram if limit is None else min(ram, limit)


def cgroup_memory_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int | None:
    """The tightest memory limit on this process's cgroup (v2 or v1) and its
    ancestors, in bytes; None when there is none."""
    try:
        lines = proc_cgroup.read_text(encoding="utf-8").splitlines()
    except OSError:
        lines = []
    limits: list[int] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # cgroup v2
            limits += _limits(root, path, "memory.max")
        elif "memory" in controllers.split(","):  # cgroup v1
            limits += _limits(root / "memory", path, "memory.limit_in_bytes")
    if not lines:  # no /proc: the root's own files (inside a container, its cgroup)
        limits += _limits(root, "/", "memory.max") + _limits(root / "memory", "/", "memory.limit_in_bytes")
    return min(limits, default=None)


def _limits(base: Path, path: str, name: str) -> list[int]:
    """The limits in ``name`` of the cgroup at ``path`` under ``base`` and of its ancestors."""
    found = []
    folder = PurePosixPath("/", path)
    for cgroup in (folder, *folder.parents):
        value = _read_limit(base / str(cgroup).lstrip("/") / name)
        if value is not None:
            found.append(value)
    return found


def _read_limit(file: Path) -> int | None:
    try:
        text = file.read_text(encoding="utf-8").strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        logger.debug("ignoring %s: %r is not a byte count", file, text)
        return None
    return None if value <= 0 or value >= _V1_UNLIMITED else value


def kv_cache_blocks(specs: Sequence[Any], config: Any, max_model_len: int, group: Any) -> int:
    """KV blocks per layer for ``config.kv_cache_memory`` (an ``rtpcore.engine.config.EngineConfig``)
    or the default: on a GPU what :func:`gpu_kv_cache_bytes` leaves after every rank's measured step
    (``group.run("profile_memory", ...)``), on the CPU ``max_batch_size`` sequences of
    ``max_model_len`` tokens, at most :data:`RAM_FRACTION` of :func:`memory_limit` over the ranks.
    At least one ``max_model_len`` sequence's worth, else a KVCacheCapacityError."""
    from rtpcore.kv.specs import plan_blocks

    block_bytes = sum(s.block_bytes for s in specs)
    tpb = config.tokens_per_block
    memory = config.kv_cache_memory
    if memory is None and config.device != "cpu":
        # Every rank measures its own device: the step's peak, then what is free.
        readings = group.run("profile_memory", config.max_num_batched_tokens, gather=True)
        memory = min(
            gpu_kv_cache_bytes(total=total, free=free, peak_step=peak, utilization=config.gpu_memory_utilization)
            for peak, free, total in readings
        )
    elif memory is None:
        want = -(-config.max_batch_size * max_model_len // tpb) * block_bytes
        # Every rank allocates this much; spawned ranks share this machine's RAM.
        cap = int(memory_limit() * RAM_FRACTION) // config.tensor_parallel_size
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

"""Platforms: the ``platforms`` seam (docs/design.md §18, docs/plugins.md "Platforms").

A platform is where an engine runs: a torch device type and what rtpcore must know about it.
``--device NAME`` (``Engine.from_pretrained(..., device=NAME)``) selects one by name, with an
optional index (``NAME:N``); ``auto`` takes the available platform of highest ``priority``.
Built in, registered through the same hook a plugin implements (``rtpcore.models``): ``cpu``
(:class:`CpuPlatform`) and ``cuda`` (:class:`CudaPlatform`, ROCm GPUs included: torch reports
them as ``cuda`` devices).

What the engine takes from the selected platform: its ``device_type`` (weights, KV pools and
sampling live on ``torch.device(device_type, N)``), ``supported_dtypes`` (a dtype it does not
list is refused naming the platform), ``supports_graphs`` (``cuda_graphs=True`` needs it),
``default_attention_backend`` (each layer's attention backend when it supports the layer,
before the priority order: ``rtpcore.attention``), ``dist_backend`` (the tensor collectives of
tensor-parallel ranks) and ``memory_info()`` (the KV cache's budget on a CPU-type platform: a
quarter of its total, as on the CPU; on ``cuda`` the engine measures each GPU itself).

``is_available()`` is asked when the platform is selected, or when ``auto`` considers it, and
by ``rtpcore plugins list`` for plugin platforms: an exception it raises is never swallowed --
``plugins list`` shows the platform ``unavailable`` with the exception, and selecting it (by
name or by ``auto``) is a :class:`~rtpcore.errors.DeviceError` quoting it.

The host's memory (the CPU platform's ``memory_info``): a container's memory limit is a
cgroup's, not the host's RAM -- a KV cache sized from the host's RAM gets the process killed.
:func:`memory_limit` is the smaller of physical RAM and every limit on this process's cgroup and
its ancestors:

* cgroup v2: ``memory.max`` in ``<root>/<path>`` for the ``0::<path>`` line of
  ``/proc/self/cgroup``; ``max`` means no limit.
* cgroup v1: ``memory.limit_in_bytes`` in ``<root>/memory/<path>`` for the line naming the
  ``memory`` controller; values of 2**60 bytes and more mean no limit (the kernel writes
  ``PAGE_COUNTER_MAX`` pages there).

``root`` (``/sys/fs/cgroup``) and ``proc_cgroup`` (``/proc/self/cgroup``) are parameters, so
other hierarchies (and tests) can point them elsewhere. Files that are missing or unreadable
mean no limit.

Public constants: :data:`BUILTIN_PLATFORMS` (the built-in names), :data:`CGROUP_ROOT` and
:data:`PROC_CGROUP` (where the cgroup limits are read).
"""

from __future__ import annotations

import abc
import logging
import os
from pathlib import Path, PurePosixPath
from typing import ClassVar

__all__ = [
    "BUILTIN_PLATFORMS", "CGROUP_ROOT", "PROC_CGROUP", "CpuPlatform", "CudaPlatform", "Platform", "availability",
    "available_memory", "cgroup_memory_limit", "memory_limit", "physical_memory",
]

logger = logging.getLogger(__name__)

#: The names of rtpcore's own platforms.
BUILTIN_PLATFORMS = ("cpu", "cuda")

_DTYPES = ("float32", "float16", "bfloat16")


class Platform(abc.ABC):
    """The base of every platform (the ``platforms`` seam). Every member is a class attribute or
    a classmethod: a platform is never instantiated.

    ``name`` selects it (``--device NAME``); ``api_version`` is the seam's version the class was
    written for; ``replaces`` built-in platforms it takes over; ``priority`` orders ``auto``
    (highest first: ``cuda`` 10, ``cpu`` 0); ``device_type`` a torch device type (``"cpu"``,
    ``"cuda"``, a PrivateUse1 one your extension registers); ``dist_backend`` the
    torch.distributed backend of its tensor collectives; ``supported_dtypes`` the model dtypes
    it runs (``"float32"``, ``"bfloat16"``, ``"float16"``); ``default_attention_backend`` an
    attention backend's name or None; ``supports_graphs`` whether decode steps may replay CUDA
    graphs.
    """

    name: ClassVar[str]
    api_version: ClassVar[str] = "1.0"
    replaces: ClassVar[tuple[str, ...]] = ()
    priority: ClassVar[int] = 0
    device_type: ClassVar[str]
    dist_backend: ClassVar[str] = "gloo"
    supported_dtypes: ClassVar[tuple[str, ...]] = _DTYPES
    default_attention_backend: ClassVar[str | None] = None
    supports_graphs: ClassVar[bool] = False

    @classmethod
    @abc.abstractmethod
    def is_available(cls) -> bool:
        """Whether this process can run on the platform now. Raising is allowed: the exception
        reaches the user (``plugins list``, or the error of selecting the platform)."""

    @classmethod
    def memory_info(cls) -> tuple[int, int]:
        """``(free_bytes, total_bytes)`` of the memory the engine's KV cache draws from. The
        default: the host's (its available memory, and physical RAM or the cgroup limit when
        smaller)."""
        return available_memory(), memory_limit()

    @classmethod
    def seam_problems(cls) -> list[str]:
        """The seam's rules beyond the common ones (``rtpcore.plugins.seams``)."""
        problems = []
        name = getattr(cls, "name", None)
        if isinstance(name, str) and not (name[:1].isalpha() and name.replace("_", "a").isalnum() and name.isascii()):
            problems.append(f"name must be letters, digits and '_', starting with a letter (--device {name}:N must "
                            f"parse), got {name!r}")
        if name in ("auto",):
            problems.append("name 'auto' is --device's automatic choice")
        if isinstance(cls.priority, bool) or not isinstance(cls.priority, int):
            problems.append(f"priority must be an integer, got {cls.priority!r}")
        device_type = getattr(cls, "device_type", None)
        if not isinstance(device_type, str) or not device_type.isidentifier():
            problems.append(f"device_type must be a torch device type such as 'cpu' or 'cuda', got {device_type!r}")
        if not isinstance(cls.dist_backend, str) or not cls.dist_backend:
            problems.append(f"dist_backend must name a torch.distributed backend, got {cls.dist_backend!r}")
        dtypes = cls.supported_dtypes
        if not isinstance(dtypes, tuple) or not dtypes or not set(dtypes) <= set(_DTYPES):
            problems.append(f"supported_dtypes must be a non-empty tuple of {', '.join(_DTYPES)}, got {dtypes!r}")
        default = cls.default_attention_backend
        if default is not None and not (isinstance(default, str) and default):
            problems.append(f"default_attention_backend must be None or a backend's name, got {default!r}")
        return problems


class CpuPlatform(Platform):
    """``cpu``: always available; gloo between tensor-parallel ranks."""

    name = "cpu"
    device_type = "cpu"

    @classmethod
    def is_available(cls) -> bool:
        return True


class CudaPlatform(Platform):
    """``cuda``: NVIDIA GPUs, and AMD GPUs under a ROCm build of torch; NCCL (RCCL) between
    ranks; CUDA graphs for decode steps. ``memory_info`` is the current GPU's."""

    name = "cuda"
    device_type = "cuda"
    priority = 10
    dist_backend = "nccl"
    supports_graphs = True

    @classmethod
    def is_available(cls) -> bool:
        import torch

        return bool(torch.cuda.is_available() and torch.cuda.device_count() > 0)

    @classmethod
    def memory_info(cls) -> tuple[int, int]:
        import torch

        free, total = torch.cuda.mem_get_info()
        return int(free), int(total)


def availability(cls: type[Platform]) -> tuple[bool, str | None]:
    """``(available, why not)`` of a platform: ``why`` quotes the exception ``is_available()``
    raised (``"RuntimeError: no driver"``), or says it returned False; None when available."""
    try:
        answer = cls.is_available()
    except Exception as exc:  # shown, never swallowed: the caller reports it
        return False, f"is_available() raised {type(exc).__name__}: {exc}"
    if answer is True:
        return True, None
    return False, "is_available() returned False" if answer is False else f"is_available() returned {answer!r}"


# -- the host's memory ----------------------------------------------------------------------

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
_V1_UNLIMITED = 1 << 60
_FALLBACK = 8 << 30  # when the platform cannot tell its RAM


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


def available_memory(meminfo: Path = Path("/proc/meminfo")) -> int:
    """Bytes the host can still give (``MemAvailable``), at most :func:`memory_limit`; the limit
    itself when the kernel does not say."""
    limit = memory_limit()
    try:
        for line in meminfo.read_text(encoding="utf-8").splitlines():
            if line.startswith("MemAvailable:"):
                return min(limit, int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    return limit

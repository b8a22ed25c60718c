"""Which CPU kernels run: the instruction sets the CPU offers, the cap on them (``--cpu-isa``).

``rtpcore_native._kernels`` holds its kernels in sets, best first: ``amx``, ``avx512_bf16``,
``avx512_vnni``, ``avx512``, ``avx2_vnni``, ``avx2``, ``baseline`` (:data:`KERNEL_SETS`), and
chooses the best one the CPU and the OS support at its first call: CPUID and XCR0 for the
flags, and for ``amx`` the tile permission and a probe of the tile instructions run in a child
process (a trap there is a fallback with its reason, never a crash: ``amx_probe()``).

``--cpu-isa VALUE`` (the engine option ``cpu_isa``; the environment variable
``RTPCORE_CPU_ISA``) limits that choice, as oneDNN's ``ONEDNN_MAX_CPU_ISA`` limits oneDNN's,
so that one machine can run every path a slower CPU would. Each value names a CPU class:

========================  ======================  =================================================
value                     rtpcore's kernel sets   torch
========================  ======================  =================================================
``avx2``                  avx2_vnni, avx2         ONEDNN_MAX_CPU_ISA=AVX2_VNNI, ATEN_CPU_CAPABILITY=avx2,
                                                  MKL_ENABLE_INSTRUCTIONS=AVX2
``avx512``                avx512_vnni, avx512     ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI
``avx512_bf16``           avx512_bf16             ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16
``amx``                   amx                     no cap
========================  ======================  =================================================

A value whose lowest set the CPU cannot run (``amx`` where the probe failed, ``avx512`` on an
AVX2 CPU) and an unknown value are errors naming the value and what the CPU runs, never a
silent fallback. :func:`apply_cpu_isa` (the engine calls it when its config is created, the
CLI before anything else runs) sets ``RTPCORE_CPU_ISA`` in ``os.environ`` -- so the engine's
worker processes, which inherit the environment, cap their kernels the same way, and a
tensor-parallel rank also applies the value its config carries -- and the torch variables of
the table unless the user set them, and re-chooses the native set. ``Linear``'s bf16 and fp16
routes read the cap too (``rtpcore.models.layers.cpu_has_native_dot``): a ``--cpu-isa avx2``
run keeps the float32 copies an AVX2 CPU gets.

The ordering caveat: oneDNN, MKL and ATen read their variables once, at their first use in a
process. The CLI sets them before any of that; ``Engine.from_pretrained(cpu_isa=...)`` in a
process that already ran a oneDNN or MKL product caps rtpcore's kernels and ``Linear``'s routes
but not torch's own. To cap everything, set ``RTPCORE_CPU_ISA`` (or the torch variables)
before the process starts; ``rtpcore`` itself sets the torch variables from it at the first
:func:`apply_cpu_isa`.

This module imports no torch.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from rtpcore.errors import RtpcoreError
from rtpcore.plugins.spelling import option_given

__all__ = [
    "CPU_ISAS", "CPU_ISA_ENV", "CPU_ISA_SETS", "KERNEL_SETS", "TORCH_CAPS", "announce_kernels", "apply_cpu_isa", "check_cpu_isa",
    "cpu_isa_from_env", "environment", "native_dot_allowed", "native_kernels",
]

logger = logging.getLogger(__name__)

#: The --cpu-isa values (``rtpcore_native._kernels.cpu_isas()`` names the same, with their sets).
CPU_ISAS = ("avx2", "avx512", "avx512_bf16", "amx")
#: The environment variable that carries the value to this process's workers and to tests.
CPU_ISA_ENV = "RTPCORE_CPU_ISA"
#: rtpcore_native's kernel sets, best first.
KERNEL_SETS = ("amx", "avx512_bf16", "avx512_vnni", "avx512", "avx2_vnni", "avx2", "baseline")
#: The kernel sets each value allows, best first: the first is the most it allows, the last the
#: least a CPU must run for the value (``rtpcore_native._kernels.cpu_isas()``; a test keeps them equal).
CPU_ISA_SETS: dict[str, tuple[str, ...]] = {
    "avx2": ("avx2_vnni", "avx2"), "avx512": ("avx512_vnni", "avx512"), "avx512_bf16": ("avx512_bf16",),
    "amx": ("amx",),
}
#: What each value sets for torch (unless the variable is set already): oneDNN's GEMMs, ATen's
#: vectorised kernels and MKL's float32 GEMM at most what such a CPU has.
TORCH_CAPS: dict[str, dict[str, str]] = {
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2_VNNI", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"},
    "avx512_bf16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "amx": {},
}
# Which values leave the CPU's bf16 / fp16 dot products (AVX512-BF16 or AMX-BF16; AVX512-FP16
# or AMX-FP16) visible to oneDNN: ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 hides the fp16 ones.
_NATIVE_DOT = {"bfloat16": ("avx512_bf16", "amx"), "float16": ("amx",)}

_lock = threading.Lock()
_set_by_us: dict[str, str] = {}  # the variables apply_cpu_isa set, and their values
_applied: dict[str, str] = {}  # "value": the last value apply_cpu_isa applied in this process
_announced = threading.Event()  # announce_kernels has logged


def native_kernels() -> Any:
    """``rtpcore_native._kernels``, or None in a build without it."""
    try:
        from rtpcore_native import _kernels
    except ImportError:
        return None
    return _kernels


def cpu_isa_from_env() -> str | None:
    """``RTPCORE_CPU_ISA``, or None when unset or empty (not checked)."""
    return os.environ.get(CPU_ISA_ENV, "").strip() or None


def check_cpu_isa(value: Any, what: str | None = None) -> str:
    """``value`` when it is a --cpu-isa value this CPU can run; else a RtpcoreError that starts
    with ``what`` (default: the option as given, ``--cpu-isa X`` or ``cpu_isa='X'``) and names
    the known values or what the CPU runs (for ``amx``, the probe's reason)."""
    what = what or option_given("cpu_isa", str(value))
    if not isinstance(value, str) or value not in CPU_ISAS:
        raise RtpcoreError(f"{what}: not one of {', '.join(CPU_ISAS)}")
    k = native_kernels()
    if k is None:
        raise RtpcoreError(f"{what}: the cap is on rtpcore_native's CPU kernels, and this build has no "
                           "rtpcore_native._kernels extension")
    try:
        k.check_cpu_isa(value, what)
    except ValueError as exc:
        raise RtpcoreError(str(exc)) from None
    return value


def apply_cpu_isa(value: str | None) -> str | None:
    """Cap this process's CPU kernels at ``value`` (None: ``RTPCORE_CPU_ISA``'s, if any) and
    return the value applied (None: no cap). Checked first (:func:`check_cpu_isa`); then
    ``RTPCORE_CPU_ISA`` is set for the process and its workers, the torch variables of
    :data:`TORCH_CAPS` where the user has not set them (see the module doc for when torch reads
    them), and the native kernel set chosen again under the cap."""
    from_env = value is None
    value = cpu_isa_from_env() if from_env else value
    if value is None:
        return None
    check_cpu_isa(value, f"{CPU_ISA_ENV}={value}" if from_env else None)
    with _lock:
        os.environ[CPU_ISA_ENV] = value
        for name in {n for caps in TORCH_CAPS.values() for n in caps}:
            wanted = TORCH_CAPS[value].get(name)
            current = os.environ.get(name)
            if current is not None and _set_by_us.get(name) != current:
                continue  # the user's own setting wins
            if wanted is None:
                if current is not None:  # ours, from a lower cap applied before in this process
                    del os.environ[name]
                    _set_by_us.pop(name, None)
            else:
                os.environ[name] = _set_by_us[name] = wanted
        k = native_kernels()
        k.set_isa(k.default_isa())
        changed = _applied.get("value") != value
        _applied["value"] = value
    if changed:
        logger.info("CPU kernels capped at %s: %s kernels; %s", value, k.isa(), _torch_caps_text())
    return value


def _torch_caps_text() -> str:
    names = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")
    shown = [f"{n}={os.environ[n]}" for n in names if n in os.environ]
    return ", ".join(shown) if shown else "torch uncapped"


def native_dot_allowed(dtype: str) -> bool:
    """Whether the cap (``RTPCORE_CPU_ISA``) leaves the CPU's dot-product instructions for
    ``dtype`` ("bfloat16" or "float16") usable; True without a cap (an unknown value caps nothing
    here: it is an error where the kernels are chosen)."""
    value = cpu_isa_from_env()
    if value is None or value not in CPU_ISAS:
        return True
    return value in _NATIVE_DOT.get(dtype, ())


def announce_kernels(log: logging.Logger) -> str | None:
    """The native kernel set in use (None without the extension); the first call in a process
    also logs, on ``log``, why AMX is not used where the caps allowed it (one line: no CPU
    flag, no OS permission, the probe killed by a signal, a wrong result, not x86-64)."""
    k = native_kernels()
    if k is None:
        return None
    chosen = str(k.isa())
    with _lock:
        first = not _announced.is_set()
        _announced.set()
    if first and k.isa_cap() == "amx" and chosen != "amx":
        ok, reason = k.amx_probe()
        if not ok:
            quiet = reason.startswith(("no CPU flag", "not x86-64"))
            log.log(logging.INFO if quiet else logging.WARNING, "AMX kernels not used (%s); running the %s kernels",
                    reason, chosen)
    return chosen


def environment() -> dict[str, Any]:
    """What ``rtpcore info`` shows of the CPU: its model name, its features, the AMX probe,
    the caps in force, the kernel set chosen and where its parallel regions run (``thread_pool``:
    ``rtpcore_native._kernels.pool_kind()``) (JSON-ready)."""
    k = native_kernels()
    caps = {n: os.environ.get(n) for n in (CPU_ISA_ENV, "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY",
                                           "MKL_ENABLE_INSTRUCTIONS")}
    if k is None:
        return {"cpu": cpu_model_name(), "native_kernels": None, "features": {}, "amx_probe": None,
                "caps": caps, "kernel_set": None, "supported_kernel_sets": [], "supported_cpu_isas": [],
                "thread_pool": None}
    ok, reason = k.amx_probe()
    return {
        "cpu": cpu_model_name(),
        "native_kernels": "rtpcore_native._kernels",
        "features": dict(k.cpu_features()),
        "amx_probe": {"ok": ok, "reason": reason},
        "caps": caps,
        "kernel_set": str(k.isa()),
        "supported_kernel_sets": list(k.supported_isas()),
        "supported_cpu_isas": list(k.supported_cpu_isas()),
        "thread_pool": str(k.pool_kind()),
    }


def cpu_model_name(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The first ``model name`` of ``/proc/cpuinfo`` (None where there is none)."""
    try:
        with open(cpuinfo, errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        return None
    return None

"""Where an engine runs: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:N"`` (docs/design.md §9) or a
plugin platform's ``NAME`` / ``NAME:N`` (§18, :mod:`rtpcore.platforms`; :func:`resolve_platform`).

Two checks, one rule:

* :func:`check_device_form` is the syntax alone. It imports no torch, so the command
  line uses it as the ``type=`` of ``--device`` (a malformed value is a usage error,
  exit status 2) and ``rtpcore --help`` stays torch-free.
* :func:`resolve_device` adds what this process's torch can see and returns the
  canonical device, ``"cpu"`` or ``"cuda:N"``; a device torch cannot see is a
  :class:`~rtpcore.errors.DeviceError` naming it and what is available.

ROCm builds of torch report AMD GPUs as ``cuda`` devices (``torch.version.hip`` is
set, ``torch.cuda`` works): ``"cuda"`` and ``"cuda:N"`` name them too, and ``"auto"``
picks them. With ``tensor_parallel_size`` > 1 on CUDA/ROCm each rank takes its own
device: rank r uses ``cuda:r`` (``cuda:LOCAL_RANK`` under ``torchrun``), and the
tensor collectives use NCCL (RCCL on ROCm); on the CPU every rank uses gloo.
"""

from __future__ import annotations

import re
from typing import Any

from rtpcore.errors import DeviceError

__all__ = ["DEVICE_FORMS", "check_device_form", "resolve_device", "resolve_platform"]

#: The forms a device may take, as the error messages list them.
DEVICE_FORMS = ("auto", "cpu", "cuda", "cuda:N", "NAME", "NAME:N")
_CUDA_RE = re.compile(r"cuda(?::(0|[1-9][0-9]*))?")
_PLATFORM_RE = re.compile(r"([A-Za-z][A-Za-z0-9_]*)(?::(0|[1-9][0-9]*))?")  # a plugin platform's


def check_device_form(device: Any) -> str:
    """``device`` as a string of one of :data:`DEVICE_FORMS` (a ``torch.device`` of type
    cpu or cuda is written as one), without asking torch what exists; any other value
    raises :class:`~rtpcore.errors.DeviceError` with ``malformed=True``."""
    text = _as_text(device)
    if text is not None and (text in ("auto", "cpu") or _CUDA_RE.fullmatch(text)):
        return text
    named = _PLATFORM_RE.fullmatch(text) if text is not None else None
    if text is not None and named is not None and named[1] not in ("auto", "cpu", "cuda"):
        return text
    raise DeviceError(
        f"device {device!r} is not one of {', '.join(map(repr, DEVICE_FORMS))} "
        "(N: a device index 0, 1, ...; ROCm GPUs are 'cuda' devices too; NAME: a plugin's platform)",
        device=device,
        malformed=True,
    )


def resolve_device(device: Any, *, tensor_parallel_size: int = 1) -> str:
    """The canonical device, ``"cpu"`` or ``"cuda:N"``, that ``device`` names here.

    ``"auto"`` is ``"cuda:0"`` (the first CUDA or ROCm device) when torch sees one, else
    ``"cpu"``; ``"cuda"`` is ``"cuda:0"``. With ``tensor_parallel_size`` > 1 on CUDA the
    result is rank 0's device, rank r takes ``cuda:r``: torch must see at least that many
    devices, and ``"cuda:N"`` with N > 0 is refused. Raises
    :class:`~rtpcore.errors.DeviceError`: ``malformed=True`` for a value of none of
    :data:`DEVICE_FORMS`, ``malformed=False`` (with ``.available``) for a device torch
    cannot see here.
    """
    text = check_device_form(device)
    if text not in ("auto", "cpu") and not _CUDA_RE.fullmatch(text):  # a plugin platform's form
        return resolve_platform(text, None, tensor_parallel_size=tensor_parallel_size)[1]  # raises: no such here
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise DeviceError(
            f"tensor_parallel_size must be a positive integer, got {tensor_parallel_size!r}", device=device
        )
    if text == "cpu":
        return "cpu"
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    available = ("cpu", *(f"cuda:{i}" for i in range(count)))
    if text == "auto":
        if count == 0:
            return "cpu"
        text = "cuda"
    index = int(text.partition(":")[2] or 0)
    if count == 0:
        raise DeviceError(
            f"device {device!r} is not available: this torch ({torch.__version__}) {_why_none(torch)}; "
            f"available: {', '.join(map(repr, available))}",
            device=device,
            available=available,
        )
    if index >= count:
        raise DeviceError(
            f"device {device!r} is not available: torch sees {_devices(count)}; "
            f"available: {', '.join(map(repr, available))}",
            device=device,
            available=available,
        )
    n = tensor_parallel_size
    if n > 1 and index > 0:
        raise DeviceError(
            f"device {device!r} with tensor_parallel_size={n}: the ranks take cuda:0..cuda:{n - 1} "
            "(rank r uses cuda:r); pass 'cuda' (or 'auto'), or hide devices with CUDA_VISIBLE_DEVICES",
            device=device,
            available=available,
        )
    if n > count:
        raise DeviceError(
            f"device {device!r} with tensor_parallel_size={n} needs {n} CUDA/ROCm devices, one per rank, "
            f"but torch sees {_devices(count)}; available: {', '.join(map(repr, available))} "
            "(device='cpu' runs every rank on the CPU)",
            device=device,
            available=available,
        )
    return f"cuda:{index}"


def resolve_platform(device: Any, registry: Any = None, *, tensor_parallel_size: int = 1) -> tuple[str, str]:
    """``(platform name, canonical device)`` for ``device`` among the platforms ``registry``
    holds (the loaded plugins' and the built-in ``cpu`` and ``cuda``; None: the built-ins).

    ``"auto"`` takes the available platform of highest priority; ``"cpu"``, ``"cuda"`` and
    ``"cuda:N"`` the built-ins (:func:`resolve_device`'s rules), unless a plugin platform
    ``replaces`` them; another ``NAME`` or ``NAME:N`` the plugin platform of that name, on
    ``torch.device(device_type, N)`` (``"cpu"`` for a CPU-type platform). A platform whose
    ``is_available()`` raises is a DeviceError quoting the exception, whether named or met by
    ``auto`` (never passed over in silence); an unknown name lists the known platforms."""
    from rtpcore.platforms import CpuPlatform, CudaPlatform, availability

    text = check_device_form(device)
    if registry is None:
        classes: dict[str, Any] = {"cpu": CpuPlatform, "cuda": CudaPlatform}
    else:
        classes = registry.seam_classes("platforms")
    name, _, index = text.partition(":")
    if name == "auto":
        for candidate in sorted(classes, key=lambda n: (-classes[n].priority, n)):
            available, why = availability(classes[candidate])
            if available:
                name = candidate
                break
            if why is not None and "raised" in why:
                raise DeviceError(
                    f"device 'auto': platform {candidate!r} ({_where(registry, candidate, classes)}) {why}; "
                    f"select another with --device (known: {', '.join(sorted(classes))})",
                    device=device, available=tuple(sorted(classes)),
                )
        else:  # the built-in cpu is always available; a plugin replacing it may not be
            raise DeviceError(f"device 'auto': no platform is available (known: {', '.join(sorted(classes))})",
                              device=device, available=tuple(sorted(classes)))
        if classes[name] in (CpuPlatform, CudaPlatform):
            return name, resolve_device("cpu" if name == "cpu" else "cuda", tensor_parallel_size=tensor_parallel_size)
    cls = classes.get(name)
    if cls is None:
        raise DeviceError(
            f"device {text!r} is not a platform here; known: {', '.join(sorted(classes))} (a plugin adds one with "
            "rtpcore_register_platforms; load it with --plugins)",
            device=device, available=tuple(sorted(classes)),
        )
    if cls in (CpuPlatform, CudaPlatform):  # rtpcore's own, with their rules
        return cls.name, resolve_device(text, tensor_parallel_size=tensor_parallel_size)
    available, why = availability(cls)
    if not available:
        raise DeviceError(f"device {text!r}: platform {name!r} ({_where(registry, name, classes)}) is not available: "
                          f"{why}", device=device, available=tuple(sorted(classes)))
    device_type = cls.device_type
    if device_type in ("cpu", "cuda"):
        target = device_type if device_type == "cpu" or not index else f"cuda:{index}"
        return name, resolve_device(target, tensor_parallel_size=tensor_parallel_size)
    if tensor_parallel_size > 1:
        raise DeviceError(
            f"device {text!r}: tensor_parallel_size={tensor_parallel_size} on platform {name!r} (device type "
            f"{device_type!r}) is not supported: rtpcore's worker groups run on cpu (gloo) or cuda (nccl) ranks",
            device=device,
        )
    return name, f"{device_type}:{index or 0}"


def _where(registry: Any, name: str, classes: dict[str, Any]) -> str:
    """Who provides the platform ``name``, for messages."""
    provider = registry.seam_provider("platforms", name) if registry is not None else None
    cls = classes[name]
    return str(provider) if provider is not None else f"{cls.__module__}.{cls.__qualname__}"


def _as_text(device: Any) -> str | None:
    """A string as is; a torch.device (recognised without importing torch) as its form."""
    if isinstance(device, str):
        return device
    cls = type(device)
    if cls.__module__ == "torch" and cls.__name__ == "device":
        if device.type == "cpu" and device.index in (None, 0):
            return "cpu"
        if device.type == "cuda":
            return "cuda" if device.index is None else f"cuda:{device.index}"
    return None


def _why_none(torch: Any) -> str:
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return "is built without CUDA or ROCm, so it sees no CUDA/ROCm device"
    return "sees no CUDA/ROCm device (no GPU, no driver, or CUDA_VISIBLE_DEVICES hides them)"


def _devices(count: int) -> str:
    return f"{count} CUDA/ROCm device{'s' if count != 1 else ''}"

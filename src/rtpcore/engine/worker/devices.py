"""Where an engine runs: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (docs/design.md §9).

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

__all__ = ["DEVICE_FORMS", "check_device_form", "resolve_device"]

#: The forms a device may take, as the error messages list them.
DEVICE_FORMS = ("auto", "cpu", "cuda", "cuda:N")
_CUDA_RE = re.compile(r"cuda(?::(0|[1-9][0-9]*))?")


def check_device_form(device: Any) -> str:
    """``device`` as a string of one of :data:`DEVICE_FORMS` (a ``torch.device`` of type
    cpu or cuda is written as one), without asking torch what exists; any other value
    raises :class:`~rtpcore.errors.DeviceError` with ``malformed=True``."""
    text = _as_text(device)
    if text is not None and (text in ("auto", "cpu") or _CUDA_RE.fullmatch(text)):
        return text
    raise DeviceError(
        f"device {device!r} is not one of {', '.join(map(repr, DEVICE_FORMS))} "
        "(N: a GPU index 0, 1, ...; ROCm GPUs are 'cuda' devices too)",
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

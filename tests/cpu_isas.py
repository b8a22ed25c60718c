"""The kernel sets a kernel test runs on this machine (tests/test_native_decode.py,
tests/test_gguf_kernels.py): every set the CPU supports, or, in a CI pass under
``RTPCORE_CPU_ISA`` (.ci/run runs the kernel tests once per --cpu-isa value the machine runs),
only the sets that value allows, so that each pass covers its own class of CPU."""

from __future__ import annotations

from typing import Any

from rtpcore.models.cpu_isa import CPU_ISA_SETS, cpu_isa_from_env


def kernel_sets_under_test(kernels: Any) -> list[str]:
    value = cpu_isa_from_env()
    sets = list(kernels.supported_isas())
    return sets if value is None else [s for s in sets if s in CPU_ISA_SETS.get(value, ())]

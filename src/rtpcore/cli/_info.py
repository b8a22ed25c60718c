"""``rtpcore info``: what this machine runs -- the CPU, its features, the kernels chosen.

Shows the CPU's model name and features (CPUID, the register state the OS saves, AMX's tile
permission), the AMX probe's verdict and reason, the caps in force (``--cpu-isa`` /
``RTPCORE_CPU_ISA``, and the torch variables they set), the native kernel set chosen, and per
weight dtype and step kind the kernel a step runs (``rtpcore.models.kernel_table``: the keys
``engine.stats().kernel_calls`` counts). ``--cpu-isa`` shows the choice under that cap, as
``rtpcore generate --cpu-isa`` would make it; ``--json`` prints one object. A thin shell over
``rtpcore.models.cpu_isa.environment`` and ``rtpcore.models.kernel_table.kernel_table``;
torch is imported when the command runs.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rtpcore.cli._args import add_log_level_argument
from rtpcore.models.cpu_isa import CPU_ISAS, apply_cpu_isa

__all__ = ["add_parser", "info"]


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "info",
        help="show the CPU's features and the kernels chosen per dtype and step",
        description="Show the CPU (model name, instruction-set features, AMX's permission and probe), the caps in "
        "force and the CPU kernels rtpcore chooses: the native kernel set, and per weight dtype (float32, bfloat16, "
        "int8, each GGUF type) and step kind (decode, prefill, mixed) the kernel a step runs, as "
        "engine.stats().kernel_calls counts it.",
    )
    p.add_argument("--cpu-isa", choices=CPU_ISAS, default=None,
                   help="show the choice under this cap, as an engine with --cpu-isa makes it (default: "
                   "RTPCORE_CPU_ISA's, else none)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_log_level_argument(p)
    p.set_defaults(func=run)


def info(cpu_isa: str | None = None) -> dict[str, Any]:
    """The report of ``rtpcore info``: :func:`rtpcore.models.cpu_isa.environment`'s keys, and
    ``kernels``, the table of :func:`rtpcore.models.kernel_table.kernel_table`."""
    apply_cpu_isa(cpu_isa)
    from rtpcore.models.cpu_isa import environment
    from rtpcore.models.kernel_table import kernel_table

    return {**environment(), "kernels": kernel_table()}


def run(args: argparse.Namespace) -> int:
    report = info(args.cpu_isa)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return 0


def _print(report: dict[str, Any]) -> None:
    print(f"CPU: {report['cpu'] or 'unknown'}")
    features = report["features"]
    print("features: " + (" ".join(name for name, on in features.items() if on and not name.startswith("os_")
                                    and name != "amx_permitted") or "none known"))
    saved = [name.removeprefix("os_") for name, on in features.items() if on and name.startswith("os_")]
    print(f"OS saves: {', '.join(saved) or 'none'}; AMX tile permission held: "
          f"{'yes' if features.get('amx_permitted') else 'no'}")
    probe = report["amx_probe"]
    print(f"AMX: {'usable' if probe and probe['ok'] else 'not used'} ({probe['reason'] if probe else 'no native kernels'})")
    caps = ", ".join(f"{name}={value}" for name, value in report["caps"].items() if value is not None)
    print(f"caps: {caps or 'none'}")
    print(f"kernel set: {report['kernel_set'] or 'none (no rtpcore_native._kernels)'} (this CPU runs: "
          f"{', '.join(report['supported_kernel_sets']) or 'none'}; --cpu-isa values: "
          f"{', '.join(report['supported_cpu_isas']) or 'none'})")
    if report.get("thread_pool"):
        print(f"thread pool: {report['thread_pool']} (openmp: torch's OpenMP threads; threads: the kernels' own)")
    print()
    print("kernels per step (a Llama-family model, default options; rows: the step's tokens):")
    width = max(len(row["weights"]) for row in report["kernels"])
    for row in report["kernels"]:
        kernels = ", ".join(f"{k['kernel']} ({k['rows']} rows)" if k["rows"] != "1+" else k["kernel"]
                            for k in row["kernels"])
        print(f"  {row['weights']:<{width}}  {row['step']:<7}  {kernels}")

"""Arguments and argument types shared by the subcommands."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from rtpcore.checkpoint.hub import hub_id
from rtpcore.engine.worker.devices import check_device_form, resolve_device
from rtpcore.errors import DeviceError
from rtpcore.plugins.allowlist import Allowlist, add_allowlist_arguments

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def add_log_level_argument(p: argparse.ArgumentParser) -> None:
    """``--log-level``, which every subcommand takes: :func:`rtpcore.cli.main` configures logging
    with it before the command runs."""
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info", type=str.lower,
                   help="the least severe of rtpcore's log records shown on stderr (default: %(default)s)")


def positive_int(text: str) -> int:
    """argparse type: a positive integer, else a usage error (exit status 2) naming the text."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}  # fmt: skip
_BYTES_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_bytes(text: str) -> int:
    """argparse ``type=`` for ``--memory``: ``1073741824``, ``8GiB``, ``512MB``, ``1.5G``."""
    match = _BYTES_RE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"invalid byte count {text!r}: use an integer with an optional unit "
            "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    number = match.group(1)
    value = int(number) * _UNITS[unit] if "." not in number else int(float(number) * _UNITS[unit])
    return value


def _fraction(text: str) -> float:
    """argparse type: a number in (0, 1], else a usage error naming the text."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value


def device_arg(text: str) -> str:
    """argparse ``type=`` for ``--device``: the form rule of :func:`rtpcore.engine.worker.devices.check_device_form`
    (imports no torch); a malformed value is a usage error (exit status 2) naming it."""
    try:
        return check_device_form(text)
    except DeviceError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """CHECKPOINT or ``--demo NAME``, the allowlist flags, and the engine's dtype and KV options."""
    p.add_argument("checkpoint", nargs="?", help="checkpoint directory (config.json, safetensors, tokenizer.json); "
                   "give it or --demo")
    p.add_argument("--demo", metavar="NAME", help="use the demo model of this model type (random weights, "
                   "built on first use under $XDG_CACHE_HOME/rtpcore/demo)")
    add_allowlist_arguments(p)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="dtype of the weights and activations; auto (the default): the checkpoint's "
                   "torch_dtype on a GPU, float32 on the CPU")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp32", "fp16", "bf16", "fp8"],
                   help="dtype of the KV cache (fp8: e4m3 bytes, see --kv-layout); auto (the default) "
                   "follows --dtype")
    p.add_argument("--kv-layout", default=None, metavar="NAME",
                   help="byte layout of the fp8 MLA KV-cache layers: padded, compact, or one a loaded plugin "
                   "registers (default: the one the model's plugin chooses)")
    p.add_argument("--device", type=device_arg, default="auto", metavar="DEVICE",
                   help="auto (default: the first CUDA/ROCm GPU torch sees, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_const", const=False, default=None,
                   help="run every decode step eagerly on a GPU (default: replay CUDA graphs, one engine rank)")
    p.add_argument("--draft-model", metavar="PATH|mtp", default=None,
                   help="speculative decoding: a draft checkpoint sharing the vocabulary (any model type the "
                   "loaded plugins serve), or 'mtp' for the checkpoint's own multi-token-prediction layers "
                   "(default: none, no speculative decoding)")
    p.add_argument("--num-speculative-tokens", type=positive_int, metavar="K", default=None,
                   help="tokens the draft proposes per step (default 4 with --draft-model)")
    # Scheduling (docs/design.md §13)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None, metavar="N",
                   help="most new tokens one step computes: decodes first, long prompts in chunks "
                   "(default: 8192 on a GPU, 256 on the CPU)")
    p.add_argument("--max-model-len", type=positive_int, default=None, metavar="N",
                   help="longest prompt + output a request may ask for (default: the checkpoint's context)")
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_const", const=False, default=None,
                   help="read each step's tokens before planning the next (default: with CUDA graphs, plan and "
                   "launch the next step while the current one runs, outputs one step behind)")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="do not reuse the KV blocks of prompts seen before (default: reuse them)")
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9, metavar="F",
                   help="share of a GPU's memory the engine fills, weights and KV cache (default: %(default)s)")
    p.add_argument("--no-native-decode", dest="native_decode", action="store_false",
                   help="run CPU decode steps with torch's modules, bit-identical to transformers in float32 "
                   "(default: rtpcore's native decode step where the model allows it, within float32 rounding)")
    p.add_argument("--quantization", choices=("int8",), default=None,
                   help="weight-only quantization of every linear layer at load, on the CPU: int8 (one scale per "
                   "output channel; the checkpoint stays float) (default: none)")


def checkpoint_name(args: argparse.Namespace, path: Path) -> str:
    """What the checkpoint is called: the demo's name, a Hub id's repository (``org/name``),
    else the folder's name."""
    if args.demo is not None:
        return str(args.demo)
    hid = hub_id(args.checkpoint)
    return hid.repo_id if hid is not None else path.resolve().name


def model_path(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[Path, dict[str, Any]]:
    """The checkpoint folder (a demo's is built on first use) and the engine keywords of the
    arguments :func:`add_model_arguments` added; the allowlist is validated first, importing nothing,
    then the device (a device torch cannot see raises DeviceError before a demo is built).

    A Hub id (``org/name[@revision]``, not an existing path) as CHECKPOINT or ``--draft-model``
    is fetched here (:func:`rtpcore.checkpoint.resolve.resolve_checkpoints`: only the shards the engine
    reads): the folder returned, and the draft among the keywords, are its snapshot folders."""
    if (args.checkpoint is None) == (args.demo is None):
        parser.error("give exactly one of CHECKPOINT or --demo NAME")
    if args.num_speculative_tokens is not None and args.draft_model is None:
        parser.error("--num-speculative-tokens needs --draft-model (a draft checkpoint or 'mtp')")
    allow = Allowlist.from_args(args)
    device = resolve_device(args.device)  # the engine checks it against tensor_parallel_size too
    plugins = [str(r) for r in allow.plugins]
    if args.demo is not None:
        from rtpcore.cli.demo import demo_checkpoint

        path = demo_checkpoint(args.demo, plugins=plugins, external_model_packages=allow.external_model_packages)
    else:
        path = Path(args.checkpoint)
    draft = args.draft_model
    if hub_id(args.checkpoint) is not None or hub_id(draft) is not None:
        from rtpcore.checkpoint.resolve import resolve_checkpoints

        checkpoint = args.checkpoint if args.demo is None else path  # an id stays a str: a Path is a folder
        local, draft = resolve_checkpoints(checkpoint, draft, plan=allow.resolve())
        path = Path(local)
    return path, {
        "plugins": plugins,
        "external_model_packages": allow.external_model_packages,
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "kv_layout": args.kv_layout,
        "device": device,
        "cuda_graphs": args.cuda_graphs,
        "draft_model": draft,
        "num_speculative_tokens": args.num_speculative_tokens,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "enable_prefix_caching": args.enable_prefix_caching,
        "async_scheduling": args.async_scheduling,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "quantization": args.quantization,
        "native_decode": args.native_decode,
    }

"""``rtpcore kv-spec CHECKPOINT``: the KV-cache byte layout a checkpoint would get.

Reads ``config.json`` (no weights), loads the allowed plugins, asks the serving
plugin for its KV-cache descriptors and prints one row per layer (tag, kind,
dtype, layout, bytes per token, k/v/scale bytes per block) and, with
``--memory``, how many blocks fit. ``--json`` prints the same as one object.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rtpcore.cli._args import add_log_level_argument, parse_bytes, positive_int
from rtpcore.plugins.allowlist import Allowlist, add_allowlist_arguments

__all__ = ["add_parser", "parse_bytes"]



def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "kv-spec",
        help="show the KV-cache layout of a checkpoint",
        description="Print the per-layer KV-cache layout (bytes per token, k/v/scale bytes per "
        "block) a checkpoint gets, and how many blocks fit in --memory. Reads config.json only.",
    )
    parser.add_argument(
        "checkpoint", metavar="CHECKPOINT", help="checkpoint directory (or its config.json), a .gguf file, or a "
        "Hugging Face Hub id org/name[@revision]"
    )
    parser.add_argument(
        "--gguf-file",
        metavar="NAME",
        help="the GGUF file to read within CHECKPOINT, a Hub id's repository (fetched alone) or a folder holding "
        "several .gguf files (default: none: the checkpoint's config.json, else its only GGUF model)",
    )
    add_allowlist_arguments(parser)
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "fp32", "fp16", "bf16", "fp8"),
        help="KV-cache dtype; auto follows --dtype (default: %(default)s)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="model dtype that --kv-cache-dtype auto follows (default: %(default)s, as the engine on the CPU)",
    )
    parser.add_argument(
        "--kv-layout",
        metavar="NAME",
        help="byte layout of the fp8 MLA layers: padded, compact, or one a loaded plugin registers "
        "(default: the one the model's plugin chooses)",
    )
    parser.add_argument(
        "--model-type",
        metavar="TYPE",
        help="the model type to use (default: inferred from config.json's architectures)",
    )
    parser.add_argument(
        "--tokens-per-block",
        type=positive_int,
        default=16,
        metavar="N",
        help="tokens in one KV-cache block (default: %(default)s)",
    )
    parser.add_argument(
        "--memory",
        type=parse_bytes,
        metavar="BYTES",
        help="a KV memory budget, e.g. 8GiB: also print how many blocks fit in it (default: none)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of the table"
    )
    add_log_level_argument(parser)
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from rtpcore.checkpoint import read_hf_config
    from rtpcore.checkpoint.hub import resolve_checkpoint
    from rtpcore.kv.specs import kv_cache_specs, plan_blocks, resolve_kv_cache_dtype
    from rtpcore.plugins.loading import load_plugins

    allowlist = Allowlist.from_args(args)
    registry = load_plugins(allowlist.resolve())
    # A Hub id: config.json only. A GGUF file: its metadata, read by the plugin serving its architecture.
    hf_config = read_hf_config(resolve_checkpoint(args.checkpoint, extras=(), gguf_file=args.gguf_file), registry)
    model_type = args.model_type or registry.infer_model_type(hf_config)
    plugin = registry.get(model_type)
    config = plugin.config_from_hf(hf_config)
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, args.dtype)
    specs = kv_cache_specs(
        plugin,
        config,
        kv_cache_dtype=kv_dtype,
        kv_layout=args.kv_layout,
        tokens_per_block=args.tokens_per_block,
        registry=registry,
        model_type=model_type,
    )
    blocks = plan_blocks(specs, args.memory) if args.memory is not None else None
    report = _report(model_type, kv_dtype, args.tokens_per_block, specs, args.memory, blocks)
    print(json.dumps(report, indent=2) if args.json else _table(report))
    return 0


def _report(
    model_type: str,
    kv_dtype: str,
    tpb: int,
    specs: list[Any],
    memory: int | None,
    blocks: int | None,
) -> dict[str, Any]:
    layers = [
        {
            "tag": s.tag,
            "kind": s.kind,
            "dtype": s.dtype,
            "layout": s.layout or None,
            "bytes_per_token": s.bytes_per_token,
            "block_bytes": s.block_bytes,
            "k_block_bytes": s.k_block_bytes,
            "v_block_bytes": s.v_block_bytes,
            "scale_block_bytes": s.scale_block_bytes,
            "regions": [
                {"name": n, "offset": o, "nbytes": b, "dtype": d} for n, o, b, d in s.regions
            ],
        }
        for s in specs
    ]
    return {
        "model_type": model_type,
        "kv_cache_dtype": kv_dtype,
        "tokens_per_block": tpb,
        "layers": layers,
        "bytes_per_token": sum(s.bytes_per_token for s in specs),
        "bytes_per_block": sum(s.block_bytes for s in specs),
        "memory": memory,
        "num_blocks": blocks,
        "num_tokens": None if blocks is None else blocks * tpb,
    }


def _table(report: dict[str, Any]) -> str:
    head = (
        "layer",
        "kind",
        "dtype",
        "layout",
        "B/token",
        "k B/block",
        "v B/block",
        "scale B/block",
    )
    rows = [
        (
            layer["tag"],
            layer["kind"],
            layer["dtype"],
            layer["layout"] or "-",
            str(layer["bytes_per_token"]),
            str(layer["k_block_bytes"]),
            str(layer["v_block_bytes"]),
            str(layer["scale_block_bytes"]),
        )
        for layer in report["layers"]
    ]
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
    lines = [
        f"{report['model_type']}: {len(rows)} layers, KV {report['kv_cache_dtype']}, "
        f"{report['tokens_per_block']} tokens per block",
    ]
    for r in (head, *rows):
        cells = [
            c.ljust(w) if i < 4 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    lines.append(
        f"all layers: {report['bytes_per_token']} bytes per token, {report['bytes_per_block']} bytes per block"
    )
    if report["num_blocks"] is not None:
        lines.append(
            f"memory {report['memory']} bytes: {report['num_blocks']} blocks "
            f"({report['num_tokens']} tokens) per layer"
        )
    return "\n".join(lines)

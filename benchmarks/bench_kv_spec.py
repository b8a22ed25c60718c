"""Benchmark the KV-cache spec builder and the executable layouts.

1. Specs built per second: ``rtpcore_native.build_kv_cache_spec`` versus the
   pure-Python reference formula (``rtpcore.kv_reference``), measured in the same run.
2. Pack and unpack throughput in MB/s of cache rows for each layout
   (``rtpcore.kv.codecs``), on the CPU or ``--device``.

    python benchmarks/bench_kv_spec.py [--tokens 4096] [--seconds 0.5] [--device cpu]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from kv_reference import reference_regions, reference_spec
from rtpcore.kv.codecs import make_codec
from rtpcore_native import Fp8LayoutPolicy, KVCacheSpecDesc, build_kv_cache_spec


class Ue8m0(Fp8LayoutPolicy):
    """A Python-defined layout (fp8 nope, one e8m0 scale per 128 values, bf16 rope)."""

    name = "ue8m0"

    def regions(self, kv_lora_rank: int, rope_head_dim: int) -> list[tuple[str, str, int]]:
        return [
            ("nope", "fp8_e4m3", kv_lora_rank),
            ("nope_scale", "fp8_e8m0", kv_lora_rank // 128),
            ("rope", "bf16", rope_head_dim),
        ]


def rate(fn: Callable[[], Any], seconds: float, sync: Callable[[], None] = lambda: None) -> float:
    """Calls per second of ``fn``: the best of 5 rounds of about ``seconds / 5`` each
    (the minimum time is the least disturbed by other load, as ``timeit`` advises)."""
    fn()  # warm-up
    sync()
    best = 0.0
    for _ in range(5):
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 5 or n < 2:
            fn()
            n += 1
        sync()
        best = max(best, n / (time.perf_counter() - start))
    return best


def bench_builder(seconds: float) -> None:
    desc = KVCacheSpecDesc(
        tag="layers.0", kind="mla", dtype="fp8_e4m3", kv_lora_rank=512, rope_head_dim=64,
        tokens_per_block=64, layout="padded",
    )  # fmt: skip
    policy = Ue8m0()

    def native() -> None:
        build_kv_cache_spec(desc)

    def native_policy() -> None:
        build_kv_cache_spec(desc.__class__(
            tag="layers.0", kind="mla", dtype="fp8_e4m3", kv_lora_rank=512, rope_head_dim=64,
            tokens_per_block=64, layout="ue8m0",
        ), policy=policy)  # fmt: skip

    def python() -> None:
        reference_spec(
            reference_regions("mla", "fp8_e4m3", kv_lora_rank=512, rope_head_dim=64, layout="padded"),
            64, "nope", "rope",
        )  # fmt: skip

    r_native, r_policy, r_python = (rate(f, seconds) for f in (native, native_policy, python))
    print("specs built per second (mla fp8 padded 512/64)")
    print(f"  {'native build_kv_cache_spec':<40} {r_native:>12,.0f}/s  {r_native / r_python:5.2f}x")
    print(
        f"  {'native, Python policy (ue8m0)':<40} {r_policy:>12,.0f}/s  {r_policy / r_python:5.2f}x"
    )
    print(f"  {'pure-Python reference (baseline)':<40} {r_python:>12,.0f}/s  1.00x")


def bench_packing(tokens: int, seconds: float, device: str) -> None:
    mla = {"kind": "mla", "kv_lora_rank": 512, "rope_head_dim": 64}
    mha = {"kind": "mha", "num_kv_heads": 8, "head_dim": 128}
    cases: list[tuple[str, dict[str, Any], Any]] = [
        ("mla fp8 padded 512/64", {**mla, "dtype": "fp8_e4m3", "layout": "padded"}, None),
        ("mla fp8 compact 512/64", {**mla, "dtype": "fp8_e4m3", "layout": "compact"}, None),
        ("mla fp8 ue8m0 (Python policy)", {**mla, "dtype": "fp8_e4m3", "layout": "ue8m0"}, Ue8m0()),
        ("mla bf16 512/64", {**mla, "dtype": "bf16"}, None),
        ("mha fp8 8x128", {**mha, "dtype": "fp8_e4m3"}, None),
        ("mha bf16 8x128", {**mha, "dtype": "bf16"}, None),
    ]
    dev = torch.device(device)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    print(f"\npack / unpack throughput, {tokens} tokens per call, {device} (MB/s of cache rows)")
    print(f"  {'layout':<32} {'B/token':>8} {'pack':>10} {'unpack':>10}")
    gen = torch.Generator(device=dev).manual_seed(0)
    for label, fields, policy in cases:
        spec = build_kv_cache_spec(KVCacheSpecDesc(tag="layers.0", **fields), policy=policy)
        codec = make_codec(spec, policy=policy)
        shape_k = (tokens, 512) if spec.kind == "mla" else (tokens, 8, 128)
        shape_v = (tokens, 64) if spec.kind == "mla" else (tokens, 8, 128)
        k = torch.randn(shape_k, generator=gen, device=dev, dtype=torch.bfloat16)
        v = torch.randn(shape_v, generator=gen, device=dev, dtype=torch.bfloat16)
        rows = codec.pack(k, v)
        mb = rows.numel() / 1e6
        pack = rate(lambda: codec.pack(k, v), seconds, sync) * mb  # noqa: B023 - used at once
        unpack = rate(lambda: codec.unpack(rows, torch.bfloat16), seconds, sync) * mb  # noqa: B023
        print(f"  {label:<32} {spec.bytes_per_token:>8} {pack:>10,.0f} {unpack:>10,.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per pack/unpack call")
    parser.add_argument("--seconds", type=float, default=0.5, help="time per measurement")
    parser.add_argument("--device", default="cpu", help="torch device for pack/unpack")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    bench_builder(args.seconds)
    bench_packing(args.tokens, args.seconds, args.device)


if __name__ == "__main__":
    main()

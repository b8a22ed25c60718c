"""A pure-Python reference of the native KV-cache size formulas (an oracle for tests and
the benchmark baseline). It mirrors ``rtpcore_native.build_kv_cache_spec`` for the
built-in layouts and for explicit region lists, without validation beyond what the
arithmetic needs; Python ints never overflow, so a native result can be checked exactly.
"""

from __future__ import annotations

__all__ = ["DTYPE_SIZES", "reference_regions", "reference_spec"]

DTYPE_SIZES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8_e4m3": 1, "fp8_e8m0": 1}
PADDED_GROUP = 128


def reference_regions(
    kind: str,
    dtype: str,
    *,
    kv_lora_rank: int = 0,
    rope_head_dim: int = 0,
    num_kv_heads: int = 0,
    head_dim: int = 0,
    layout: str = "",
) -> list[tuple[str, str, int]]:
    """(name, dtype, element_count) of one token, in storage order."""
    if kind == "mha":
        n = num_kv_heads * head_dim
        regions = [("k", dtype, n), ("v", dtype, n)]
        if dtype == "fp8_e4m3":
            regions += [("k_scale", "fp32", num_kv_heads), ("v_scale", "fp32", num_kv_heads)]
        return regions
    if dtype != "fp8_e4m3":
        return [("nope", dtype, kv_lora_rank), ("rope", dtype, rope_head_dim)]
    if layout == "compact":
        return [("nope", "fp8_e4m3", kv_lora_rank), ("rope", "fp8_e4m3", rope_head_dim)]
    return [
        ("nope", "fp8_e4m3", kv_lora_rank),
        ("nope_scale", "fp32", kv_lora_rank // PADDED_GROUP),
        ("rope", "bf16", rope_head_dim),
    ]


def reference_spec(
    regions: list[tuple[str, str, int]], tokens_per_block: int, k_name: str, v_name: str
) -> dict[str, object]:
    """Offsets, bytes per token, block bytes and the k/v/scale partition of ``regions``."""
    placed = []
    offset = k = v = scale = 0
    for name, dtype, count in regions:
        nbytes = count * DTYPE_SIZES[dtype]
        placed.append((name, offset, nbytes, dtype))
        offset += nbytes
        if name == k_name:
            k += nbytes
        elif name == v_name:
            v += nbytes
        else:
            scale += nbytes
    return {
        "regions": placed,
        "bytes_per_token": offset,
        "block_bytes": offset * tokens_per_block,
        "k_block_bytes": k * tokens_per_block,
        "v_block_bytes": v * tokens_per_block,
        "scale_block_bytes": scale * tokens_per_block,
    }

"""The paged KV cache: one preallocated pool per layer, addressed by slot.

A slot is ``block * tokens_per_block + offset``. Each layer's pool follows the
layer's ``rtpcore_native.KVCacheSpec``. A model writes its new keys/values with
``write`` and reads a padded view of every sequence's context with ``read``.

What "k" and "v" are follows the spec's partition:

* ``kind == "mha"``: k and v are (T, num_kv_heads, head_dim) keys and values.
* ``kind == "mla"``: k is the (T, kv_lora_rank) latent ("nope") and v the
  (T, rope_head_dim) rotary key part.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["LayerKVCache", "kv_shapes"]


def kv_shapes(spec: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per-token shapes of the k and v parts of a spec (or a KVCacheSpecDesc)."""
    if spec.kind == "mha":
        return (spec.num_kv_heads, spec.head_dim), (spec.num_kv_heads, spec.head_dim)
    return (spec.kv_lora_rank,), (spec.rope_head_dim,)


class LayerKVCache:
    """One layer's pool of ``num_blocks`` blocks.

    This class stores unquantized caches (fp32/fp16/bf16) as two typed tensors
    of exactly the spec's k and v bytes.
    """

    def __init__(self, spec: Any, num_blocks: int, *, device: torch.device | str = "cpu"):
        self.spec = spec
        self.num_blocks = num_blocks
        self.tokens_per_block = spec.tokens_per_block
        k_shape, v_shape = kv_shapes(spec)
        dtype = _TORCH_DTYPES[spec.dtype]
        n = num_blocks * spec.tokens_per_block
        self.k = torch.zeros((n, *k_shape), dtype=dtype, device=device)  # (slots, *k_shape)
        self.v = torch.zeros((n, *v_shape), dtype=dtype, device=device)  # (slots, *v_shape)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' parts: slots (T,), k (T, *k_shape), v (T, *v_shape)."""
        self.k.index_copy_(0, slots, k.to(self.k.dtype))
        self.v.index_copy_(0, slots, v.to(self.v.dtype))

    def read(self, block_tables: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather every sequence's first ``max_len`` positions: (B, L, *k_shape), (B, L, *v_shape).

        Positions past a sequence's context hold stale data; mask them.
        """
        idx = slot_index(block_tables, max_len, self.tokens_per_block)  # (B, L)
        return self.k[idx], self.v[idx]


def slot_index(block_tables: torch.Tensor, max_len: int, tokens_per_block: int) -> torch.Tensor:
    """(B, L) slot of each position 0..L-1 of each sequence."""
    pos = torch.arange(max_len, device=block_tables.device)
    blocks = block_tables[:, pos // tokens_per_block]  # (B, L)
    return blocks * tokens_per_block + pos % tokens_per_block


_TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

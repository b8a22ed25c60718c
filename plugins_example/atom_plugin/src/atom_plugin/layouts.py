"""``Ue8m0Layout``: an fp8 MLA cache layout defined by this plugin, not by rtpcore.

Per token: the latent in fp8 e4m3, one power-of-two scale per 128 latent values
stored as a single ``fp8_e8m0`` byte (its exponent), then the rope part in bf16::

    | nope: kv_lora_rank x fp8_e4m3 | scale: kv_lora_rank/128 x fp8_e8m0 | rope: rope x bf16 |

For 512/64 that is 512 + 4 + 128 = 644 bytes per token (the built-in "padded"
layout spends 16 bytes on fp32 scales instead of 4). Registered through the
``rtpcore_kv_cache_layouts`` hook; select it with ``kv_layout="ue8m0"``.
"""

from __future__ import annotations

from rtpcore_native import Fp8LayoutPolicy

__all__ = ["Ue8m0Layout"]

GROUP = 128  # latent values per scale


class Ue8m0Layout(Fp8LayoutPolicy):
    name = "ue8m0"

    def regions(self, kv_lora_rank: int, rope_head_dim: int) -> list[tuple[str, str, int]]:
        if kv_lora_rank <= 0 or kv_lora_rank % GROUP:
            raise ValueError(
                f"layout 'ue8m0': kv_lora_rank={kv_lora_rank} must be a positive multiple of {GROUP}"
            )
        return [
            ("nope", "fp8_e4m3", kv_lora_rank),
            ("nope_scale", "fp8_e8m0", kv_lora_rank // GROUP),
            ("rope", "bf16", rope_head_dim),
        ]

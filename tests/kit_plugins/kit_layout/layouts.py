"""``kit_int_fp8``: the latent in "fp8" (one fp32 scale per 128 values), the rope part in bf16::

    | nope: kv_lora_rank x fp8_e4m3 | nope_scale: kv_lora_rank/128 x fp32 | rope: rope x bf16 |
"""

from __future__ import annotations

from typing import Any

from rtpcore_native import Fp8LayoutPolicy

GROUP = 128  # latent values per scale


class IntFp8Layout(Fp8LayoutPolicy):
    name = "kit_int_fp8"

    def regions(self, kv_lora_rank: int, rope_head_dim: int) -> list[tuple[str, str, int]]:
        if kv_lora_rank <= 0 or kv_lora_rank % GROUP:
            raise ValueError(f"layout 'kit_int_fp8': kv_lora_rank={kv_lora_rank} must be a positive multiple "
                             f"of {GROUP}")
        return [
            ("nope", "fp8_e4m3", kv_lora_rank),
            ("nope_scale", "fp32", kv_lora_rank // GROUP),
            ("rope", "bf16", rope_head_dim),
        ]

    def make_codec(self, spec: Any) -> Any:
        from kit_layout.codec import IntCodec

        return IntCodec(spec)

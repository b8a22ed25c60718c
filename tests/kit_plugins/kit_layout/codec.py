"""The codec of ``kit_int_fp8`` (torch; imported by ``make_codec`` only)."""

from __future__ import annotations

from typing import Any

import torch


class IntCodec:
    """Packs an MLA layer's latent (T, kv_lora_rank) and rope part (T, rope_head_dim)."""

    scale = None  # scales are per group, in the rows

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.regions = {name: (offset, nbytes) for name, offset, nbytes, _ in spec.regions}
        self.groups = self.regions["nope_scale"][1] // 4

    def _cols(self, name: str) -> slice:
        offset, nbytes = self.regions[name]
        return slice(offset, offset + nbytes)

    def pack(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t = k.shape[0]
        rows = torch.zeros((t, self.spec.bytes_per_token), dtype=torch.uint8, device=k.device)
        groups = k.float().reshape(t, self.groups, -1)  # (T, G, 128)
        scale = groups.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127.0  # (T, G, 1)
        # The defect: rounded integers, where the spec's region says fp8 e4m3 bit patterns.
        q = torch.round(groups / scale).to(torch.int8).reshape(t, -1)
        rows[:, self._cols("nope")] = q.view(torch.uint8)
        rows[:, self._cols("nope_scale")] = scale.reshape(t, -1).contiguous().view(torch.uint8)
        rows[:, self._cols("rope")] = v.to(torch.bfloat16).contiguous().view(torch.uint8)
        return rows

    def unpack(self, rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        t = rows.shape[0]
        q = rows[:, self._cols("nope")].contiguous().view(torch.int8).float().reshape(t, self.groups, -1)
        scale = rows[:, self._cols("nope_scale")].contiguous().view(torch.float32).reshape(t, self.groups, 1)
        k = (q * scale).reshape(t, -1)
        v = rows[:, self._cols("rope")].contiguous().view(torch.bfloat16).float()
        return k.to(dtype), v.to(dtype)

"""``atom_fp8``: atom-plugin's fp8 weight path as an rtpcore quantization method
(``rtpcore.quantization``, the ``quantization_methods`` seam).

It takes over rtpcore's ``fp8`` (``replaces``) while this plugin is loaded, so every
``quant_method: "fp8"`` checkpoint loads through it. It reads what ``fp8`` reads -- DeepSeek-V3's
block-quantized ``float8_e4m3fn`` weights with a ``_scale_inv`` per block, dequantized at load --
and also DeepSeek-V3.1's ``"scale_fmt": "ue8m0"``: every scale a power of two (an 8-bit exponent,
what ue8m0 kernels read), checked as each shard arrives; a scale that is not is a
``CheckpointError`` naming its tensor. A checkpoint may name the method itself
(``"quant_method": "atom_fp8"``); pyproject declares it under ``rtpcore.quantization_methods``,
so rtpcore names this plugin when it meets that ``quant_method`` without it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from rtpcore.errors import CheckpointError
from rtpcore.quantization import Fp8Method, QuantizationMethod, QuantizedTensors

__all__ = ["AtomFp8Method"]

SCALE_FORMATS = (None, "ue8m0")


class AtomFp8Method(Fp8Method):
    name = "atom_fp8"
    replaces = ("fp8",)

    def __init__(self, config: Any, scale_fmt: str | None = None):
        super().__init__(config)
        self.scale_fmt = scale_fmt

    @classmethod
    def from_config(cls, quantization_config: Mapping[str, Any] | None) -> QuantizationMethod:
        base = Fp8Method.from_config(quantization_config)
        assert isinstance(base, Fp8Method) and quantization_config is not None
        scale_fmt = quantization_config.get("scale_fmt")
        if scale_fmt not in SCALE_FORMATS:
            raise CheckpointError(
                f"config.json quantization_config scale_fmt {scale_fmt!r} is not supported by {cls.name}; "
                "supported: absent (any float scale) or 'ue8m0' (powers of two)"
            )
        return cls(base.config, scale_fmt)

    def select(self, selection: Any, names: Collection[str],
               slices: Mapping[str, tuple[int, int, int]] | None = None) -> QuantizedTensors | None:
        scaled = super().select(selection, names, slices)
        if scaled is None or self.scale_fmt != "ue8m0":
            return scaled
        return _PowerOfTwoScales(scaled)


class _PowerOfTwoScales:
    """fp8's load, each scale checked to be a power of two before its weight is dequantized."""

    def __init__(self, scaled: Any):
        self._scaled = scaled
        self.selection = scaled.selection

    def extra_slices(self) -> dict[str, tuple[int, int, int]]:
        out: dict[str, tuple[int, int, int]] = self._scaled.extra_slices()
        return out

    def extra_dtypes(self) -> dict[str, str]:
        out: dict[str, str] = self._scaled.extra_dtypes()
        return out

    def check(self, infos: Mapping[str, Any]) -> None:
        self._scaled.check(infos)

    def process_weights_after_loading(self, weights: dict[str, Any], dtype_of: Callable[[str], Any]) -> None:
        import torch

        for scale in self._scaled.scales.values():
            s = weights.get(scale)
            if s is None:
                continue
            mantissa, _ = torch.frexp(s.float())
            if not bool(((mantissa == 0.5) | (s == 0)).all()):
                raise CheckpointError(
                    f"scale tensor {scale!r} holds a value that is not a power of two, and config.json's "
                    "quantization_config.scale_fmt is 'ue8m0'"
                )
        self._scaled.process_weights_after_loading(weights, dtype_of)

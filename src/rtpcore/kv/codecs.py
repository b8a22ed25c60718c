"""Executable KV-cache layouts: pack tokens into a spec's byte rows and back.

The engine's paged cache stores one ``uint8`` row of ``spec.bytes_per_token``
bytes per token; this module writes and reads exactly the bytes that
``spec.regions`` describes::

    codec = rtpcore.kv.codecs.make_codec(spec, policy=None)  # also: scale=, headroom=
    rows = codec.pack(k, v)          # -> uint8 (T, spec.bytes_per_token), on k's device
    k, v = codec.unpack(rows, dtype) # -> tensors of ``dtype``

* ``kind == "mha"``: k and v are (T, num_kv_heads, head_dim).
* ``kind == "mla"``: k is the latent (T, kv_lora_rank), v the rope part (T, rope_head_dim).

One generic path serves every spec, built-in or defined by a Python
``Fp8LayoutPolicy``. A region is either a *part* (``nope``/``rope`` for MLA,
``k``/``v`` for MHA), the *scales* of a part (named ``<part>_scale``), or
anything else (written as zeros, ignored when reading). A part of ``n`` values
with a scale region of ``c`` elements is cut into ``c`` groups of ``n // c``
consecutive values (``c`` must divide ``n``), each stored as ``value / scale``
with ``scale = amax(group) / max(dtype)``: ``amax / 448`` for fp8 e4m3, rounded
up to a power of two when the scale dtype is ``fp8_e8m0``. Values are clamped
to the dtype's finite range before the cast (the e4m3 cast is not guaranteed to
saturate) and NaN inputs are stored as 0, so nothing decodes to inf or nan. Hence:

* ``"padded"``: nope fp8 with one fp32 scale per 128 values, rope bf16.
* MHA fp8: one fp32 scale per token per head, for K and for V.
* ``"compact"`` (and any fp8 part without a scale region): one per-tensor scale
  held by the codec, outside the pool (``codec.scale``, one per layer). The first
  ``pack`` whose fp8 values are not all zero sets it to ``amax * headroom / 448``
  (headroom 2 by default). A later ``pack`` with a finite value beyond
  ``448 * scale`` raises the scale by the smallest power of two that holds it
  with the same headroom (``codec.rescales`` counts these), so nothing is
  clamped: rows packed before then must be brought to the new scale with
  ``codec.requantize(rows, old_scale)``, which the paged cache does for its whole
  pool. The factor is a power of two, so requantizing is exact except for values
  that fall below e4m3's normal range (those keep ``2**-10 * scale`` absolute
  accuracy). A scale the caller fixed (``scale=`` or setting ``codec.scale``; a
  codec reading rows packed by another codec, in another process, needs the
  packer's scale) never changes: values beyond ``448 * scale``, and infinities,
  are clamped to it, counted in ``codec.clamped`` and logged.

A policy that wants its own byte format provides ``make_codec(spec)``; when such a
policy is passed, ``make_codec`` returns what it builds.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import attrs
import torch

__all__ = ["TORCH_DTYPES", "KVCodec", "make_codec"]

logger = logging.getLogger(__name__)

TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e8m0": torch.float8_e8m0fnu,
}
_FP8 = "fp8_e4m3"
_FP8_MAX = 448.0


def make_codec(
    spec: Any, policy: Any = None, *, scale: float | None = None, headroom: float = 2.0
) -> Any:
    """The codec for ``spec`` (a KVCacheSpec). ``scale`` fixes the per-tensor scale
    of fp8 parts without scale regions; ``headroom`` sizes it from the first batch."""
    if policy is not None:
        name = getattr(policy, "name", None)
        if name != spec.layout:
            raise ValueError(
                f"policy {name!r} does not match spec {spec.tag!r} built with layout {spec.layout!r}"
            )
        custom = getattr(policy, "make_codec", None)
        if callable(custom):
            return custom(spec)
    return KVCodec(spec, scale=scale, headroom=headroom)


@attrs.frozen
class _Part:
    """One value region and how it is scaled."""

    name: str
    offset: int
    nbytes: int
    dtype: str
    count: int
    scale_region: tuple[int, int, str, int] | None  # (offset, nbytes, dtype, count)
    per_tensor: bool  # fp8 without a scale region: the codec's per-tensor scale


class KVCodec:
    """Packs and unpacks one layer's tokens following ``spec.regions``."""

    def __init__(self, spec: Any, *, scale: float | None = None, headroom: float = 2.0):
        if not (math.isfinite(headroom) and headroom >= 1.0):
            raise ValueError(f"headroom must be a finite number >= 1, got {headroom!r}")
        self.spec = spec
        self.headroom = headroom
        self._scale: float | None = None
        self._fixed = False  # a scale the caller set is never changed
        self.rescales = 0  # times pack raised the per-tensor scale
        self.clamped = 0  # fp8 values clamped to the range of a fixed scale
        if scale is not None:
            self.scale = scale
        mla = spec.kind == "mla"
        self.k_shape: tuple[int, ...] = (
            (spec.kv_lora_rank,) if mla else (spec.num_kv_heads, spec.head_dim)
        )
        self.v_shape: tuple[int, ...] = (
            (spec.rope_head_dim,) if mla else (spec.num_kv_heads, spec.head_dim)
        )
        self._parts = tuple(
            self._part(spec, name) for name in (("nope", "rope") if mla else ("k", "v"))
        )
        names = {p.name for p in self._parts} | {f"{p.name}_scale" for p in self._parts}
        self._filler = tuple((off, n) for name, off, n, _ in spec.regions if name not in names)

    @staticmethod
    def _part(spec: Any, name: str) -> _Part:
        regions = {r[0]: r for r in spec.regions}
        if name not in regions:
            raise ValueError(f"spec {spec.tag!r} (layout {spec.layout!r}) has no {name!r} region")
        _, offset, nbytes, dtype = regions[name]
        count = nbytes // TORCH_DTYPES[dtype].itemsize
        scale = regions.get(f"{name}_scale")
        scale_region = None
        if scale is not None:
            _, s_off, s_nbytes, s_dtype = scale
            s_count = s_nbytes // TORCH_DTYPES[s_dtype].itemsize
            if count % s_count != 0:
                raise ValueError(
                    f"spec {spec.tag!r}: region {name + '_scale'!r} has {s_count} scales for "
                    f"{count} values of {name!r}; the count must divide the values into equal groups"
                )
            scale_region = (s_off, s_nbytes, s_dtype, s_count)
        per_tensor = dtype == _FP8 and scale_region is None
        return _Part(name, offset, nbytes, dtype, count, scale_region, per_tensor)

    @property
    def scale(self) -> float | None:
        """The per-tensor scale of fp8 parts without scale regions (None until set).
        Setting it fixes it: pack then clamps instead of raising it."""
        return self._scale

    @scale.setter
    def scale(self, value: float) -> None:
        value = float(value)
        if not (math.isfinite(value) and value > 0.0):
            raise ValueError(f"scale must be a finite positive number, got {value!r}")
        self._scale = value
        self._fixed = True

    def requantize(self, rows: torch.Tensor, old_scale: float, *, chunk: int = 1 << 16) -> None:
        """Bring ``rows`` (uint8 (N, bytes_per_token)) packed under ``old_scale`` to the
        current per-tensor scale, in place (``chunk`` rows at a time)."""
        new = self._scale
        if new is None or new == old_scale:
            return
        ratio = old_scale / new
        parts = [p for p in self._parts if p.per_tensor]
        dt = TORCH_DTYPES[_FP8]
        for start in range(0, rows.shape[0], chunk):
            block = rows[start : start + chunk]
            for part in parts:
                raw = _from_bytes(block[:, part.offset : part.offset + part.nbytes], part.dtype)
                q = raw.float().mul_(ratio).to(dt)  # (n, count); |ratio| <= 1: no clamping
                block[:, part.offset : part.offset + part.nbytes] = _as_bytes(q)

    # ------------------------------------------------------------------ pack

    def pack(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """k (T, *k_shape), v (T, *v_shape) -> uint8 rows (T, bytes_per_token)."""
        t = self._check(k, "k", self.k_shape)
        self._check(v, "v", self.v_shape, t)
        values = [  # (T, count) each, float32 buffers this call owns (nan_to_num copies)
            x.reshape(t, p.count).float() for x, p in zip((k, v), self._parts, strict=True)
        ]
        if any(p.per_tensor for p in self._parts) and t and not self._fixed:
            amax = max(  # over finite values only: an infinity is clamped, never a scale
                float(torch.where(torch.isfinite(x), x.abs(), 0.0).amax()) if p.per_tensor else 0.0
                for p, x in zip(self._parts, values, strict=True)
            )
            self._fit_scale(amax)
        values = [torch.nan_to_num(x, nan=0.0) for x in values]
        rows = torch.empty((t, self.spec.bytes_per_token), dtype=torch.uint8, device=k.device)
        for off, n in self._filler:
            rows[:, off : off + n] = 0
        for part, x in zip(self._parts, values, strict=True):
            self._pack_part(rows, part, x)
        return rows

    def _pack_part(self, rows: torch.Tensor, part: _Part, x: torch.Tensor) -> None:
        dt = TORCH_DTYPES[part.dtype]
        top = torch.finfo(dt).max
        if part.scale_region is not None:
            s_off, s_nbytes, s_dtype, s_count = part.scale_region
            groups = x.view(x.shape[0], s_count, part.count // s_count)  # (T, c, n // c)
            amax = torch.linalg.vector_norm(groups, ord=math.inf, dim=-1, keepdim=True)  # (T, c, 1)
            stored, scale = _store_scale(amax.div_(top), s_dtype)
            groups.div_(scale)  # in place: x is this call's own buffer
            rows[:, s_off : s_off + s_nbytes] = _as_bytes(stored.view(x.shape[0], s_count))
        elif part.per_tensor:
            x.mul_(1.0 / (self._scale or 1.0))
            over = int((x.abs() > top).sum())
            if over:
                self._count_clamped(over, part.name)
        q = x.clamp_(-top, top).to(dt)  # (T, count)
        rows[:, part.offset : part.offset + part.nbytes] = _as_bytes(q)

    def _fit_scale(self, amax: float) -> None:
        """Set the per-tensor scale from the first non-zero batch; raise it by a power
        of two when ``amax`` does not fit."""
        if not (amax > 0.0 and math.isfinite(amax)):
            return
        want = amax * self.headroom / _FP8_MAX
        if self._scale is None:
            self._scale = want
        elif amax > _FP8_MAX * self._scale:
            old = self._scale
            self._scale = old * 2.0 ** math.ceil(math.log2(want / old))
            self.rescales += 1
            logger.debug("%s: fp8 per-tensor scale raised from %g to %g", self.spec.tag, old, self._scale)

    def _count_clamped(self, n: int, part: str) -> None:
        if not self.clamped:
            logger.warning(
                "%s: %d fp8 %s values beyond the fixed per-tensor scale range +-%g were clamped "
                "(codec.clamped counts every one)",
                self.spec.tag, n, part, _FP8_MAX * (self._scale or 1.0),
            )
        self.clamped += n

    # ---------------------------------------------------------------- unpack

    def unpack(self, rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 rows (T, bytes_per_token) -> (k (T, *k_shape), v (T, *v_shape)) of ``dtype``."""
        if (
            rows.dtype != torch.uint8
            or rows.dim() != 2
            or rows.shape[1] != self.spec.bytes_per_token
        ):
            raise ValueError(
                f"rows must be uint8 (T, {self.spec.bytes_per_token}) for spec {self.spec.tag!r}, "
                f"got {rows.dtype} {tuple(rows.shape)}"
            )
        t = rows.shape[0]
        k, v = (self._unpack_part(rows, part) for part in self._parts)
        return k.reshape(t, *self.k_shape).to(dtype), v.reshape(t, *self.v_shape).to(dtype)

    def _unpack_part(self, rows: torch.Tensor, part: _Part) -> torch.Tensor:
        raw = _from_bytes(rows[:, part.offset : part.offset + part.nbytes], part.dtype)
        x = raw.to(torch.float32, copy=True)  # (T, n), this call's own buffer
        if part.scale_region is not None:
            s_off, s_nbytes, s_dtype, s_count = part.scale_region
            scale = _from_bytes(rows[:, s_off : s_off + s_nbytes], s_dtype).float()  # (T, c)
            x.view(x.shape[0], s_count, part.count // s_count).mul_(scale.unsqueeze(-1))
        elif part.per_tensor:
            x.mul_(self._scale or 1.0)
        return x

    def _check(
        self, x: torch.Tensor, name: str, shape: tuple[int, ...], t: int | None = None
    ) -> int:
        if (
            not isinstance(x, torch.Tensor)
            or x.dim() != 1 + len(shape)
            or tuple(x.shape[1:]) != shape
        ):
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"{name} must have shape (T, {', '.join(map(str, shape))}) for spec {self.spec.tag!r}, got {got}"
            )
        if t is not None and x.shape[0] != t:
            raise ValueError(
                f"k and v must hold the same number of tokens, got {t} and {x.shape[0]}"
            )
        return int(x.shape[0])


def _store_scale(scale: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Round float32 scales to their storage dtype, never to zero and never below the
    value needed (e8m0: the next power of two). Returns (stored, the float32 used)."""
    dt = TORCH_DTYPES[dtype]
    if dtype == "fp8_e8m0":
        mantissa, exponent = torch.frexp(scale.clamp_min(2.0**-127))
        exponent = torch.where(mantissa == 0.5, exponent - 1, exponent).clamp(-127, 127)
        used = torch.ldexp(torch.ones_like(scale), exponent)
        return used.to(dt), used
    finfo = torch.finfo(dt)
    stored = scale.clamp(finfo.smallest_normal, finfo.max).to(dt)
    return stored, stored.float()


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    """(T, n) typed tensor -> (T, n * itemsize) uint8 view of its bytes."""
    return x.contiguous().view(torch.uint8)


def _from_bytes(b: torch.Tensor, dtype: str) -> torch.Tensor:
    """(T, nbytes) uint8 -> (T, n) of ``dtype``, reinterpreting the bytes (a view when the
    region's offset and the row stride are aligned to the element size, else a copy)."""
    dt = TORCH_DTYPES[dtype]
    aligned = b.stride(-1) == 1 and b.storage_offset() % dt.itemsize == 0
    if aligned and all(st % dt.itemsize == 0 for st in b.stride()[:-1]):
        return b.view(dt)
    return b.contiguous().view(dt)

"""rtpcore.kv.codecs: tokens packed into exactly the spec's bytes, and back within fp8 bounds."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from rtpcore.kv.codecs import make_codec
from rtpcore_native import Fp8LayoutPolicy, KVCacheSpecDesc, build_kv_cache_spec

FP8 = torch.float8_e4m3fn
E4M3_REL = 2.0**-4  # half an ulp of a 3-bit mantissa, relative
E4M3_SUB = 2.0**-10  # half the subnormal step (2**-9), in units of the scale


def spec(kind: str = "mla", dtype: str = "fp8_e4m3", policy: Any = None, **kw: Any) -> Any:
    dims = (
        {"kv_lora_rank": 512, "rope_head_dim": 64}
        if kind == "mla"
        else {"num_kv_heads": 4, "head_dim": 32}
    )
    return build_kv_cache_spec(
        KVCacheSpecDesc(tag="layers.3", kind=kind, dtype=dtype, **{**dims, **kw}), policy=policy
    )


def region(s: Any, rows: torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor:
    """The bytes of one region, read by the spec's offset and reinterpreted."""
    ((_, offset, nbytes, _),) = [r for r in s.regions if r[0] == name]
    return rows[:, offset : offset + nbytes].contiguous().view(dtype)


def fp8_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.abs() * E4M3_REL + scale * E4M3_SUB + 1e-12


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def test_padded_writes_fp8_nope_fp32_group_scales_and_bf16_rope_at_their_offsets(
    gen: torch.Generator,
) -> None:
    """The "padded" layout: nope/scale bytes at 0, one fp32 amax/448 per 128 values at 512, bf16 rope at 528."""
    s = spec(layout="padded")
    k = torch.randn(5, 512, generator=gen) * torch.logspace(-3, 3, 5).unsqueeze(1)  # (T, rank)
    v = torch.randn(5, 64, generator=gen)  # (T, rope)
    rows = make_codec(s).pack(k, v)
    assert rows.dtype == torch.uint8 and rows.shape == (5, 656)
    scales = k.reshape(5, 4, 128).abs().amax(-1) / 448  # (T, 4)
    torch.testing.assert_close(region(s, rows, "nope_scale", torch.float32), scales, rtol=0, atol=0)
    want_q = (k.reshape(5, 4, 128) / scales.unsqueeze(-1)).reshape(5, 512).clamp(-448, 448).to(FP8)
    assert torch.equal(region(s, rows, "nope", torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(region(s, rows, "rope", torch.bfloat16), v.to(torch.bfloat16))


def test_padded_round_trip_within_the_e4m3_bound(gen: torch.Generator) -> None:
    """Every nope value comes back within half an e4m3 ulp; rope within bf16 rounding."""
    s = spec(layout="padded")
    k = torch.randn(64, 512, generator=gen) * 3
    v = torch.randn(64, 64, generator=gen)
    codec = make_codec(s)
    k2, v2 = codec.unpack(codec.pack(k, v), torch.float32)
    scale = (
        (k.reshape(64, 4, 128).abs().amax(-1, keepdim=True) / 448)
        .expand(64, 4, 128)
        .reshape(64, 512)
    )
    assert ((k2 - k).abs() <= fp8_bound(k, scale)).all()
    torch.testing.assert_close(v2, v, rtol=2.0**-8, atol=0)


def test_compact_holds_one_per_tensor_scale_outside_the_pool(gen: torch.Generator) -> None:
    """The "compact" layout: nope and rope fp8 at 0 and 512; the scale lives in the codec (first batch amax x 2 / 448)."""
    s = spec(layout="compact")
    k = torch.randn(8, 512, generator=gen)
    v = torch.randn(8, 64, generator=gen)
    codec = make_codec(s)
    assert codec.scale is None
    rows = codec.pack(k, v)
    amax = float(torch.cat([k, v], 1).abs().max())
    assert codec.scale == pytest.approx(amax * 2 / 448, rel=1e-6)
    assert rows.shape == (8, 576)
    scale = torch.tensor(codec.scale)
    assert torch.equal(region(s, rows, "nope", torch.uint8), (k / scale).to(FP8).view(torch.uint8))
    assert torch.equal(region(s, rows, "rope", torch.uint8), (v / scale).to(FP8).view(torch.uint8))
    k2, v2 = codec.unpack(rows, torch.float32)
    assert ((k2 - k).abs() <= fp8_bound(k, scale)).all()
    assert ((v2 - v).abs() <= fp8_bound(v, scale)).all()


def test_compact_clamps_values_beyond_the_scale_range_never_inf_or_nan(
    gen: torch.Generator,
) -> None:
    """Later batches beyond 448 x scale are clamped to it; inf and nan never reach the cache."""
    codec = make_codec(spec(layout="compact"), scale=0.01)
    k = torch.randn(4, 512, generator=gen)
    k[0, :3] = torch.tensor([1e6, -float("inf"), float("nan")])
    v = torch.full((4, 64), 1e30)
    k2, v2 = codec.unpack(codec.pack(k, v), torch.float32)
    assert torch.isfinite(k2).all() and torch.isfinite(v2).all()
    assert k2[0, :3].tolist() == pytest.approx([4.48, -4.48, 0.0])
    assert torch.equal(v2, torch.full_like(v2, 448 * 0.01))
    assert codec.scale == 0.01  # a fixed scale is never re-derived


def test_compact_scale_waits_for_a_non_zero_batch_and_is_validated() -> None:
    """An all-zero first batch leaves the scale unset; bad scales are ValueErrors."""
    codec = make_codec(spec(layout="compact"))
    rows = codec.pack(torch.zeros(2, 512), torch.zeros(2, 64))
    assert codec.scale is None and not rows.any()
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="scale must be a finite positive number"):
            codec.scale = bad
    with pytest.raises(ValueError, match="headroom must be"):
        make_codec(spec(layout="compact"), headroom=0.5)


def test_mha_fp8_has_one_fp32_scale_per_token_head_for_k_and_v(gen: torch.Generator) -> None:
    """MHA fp8: k and v fp8, then per-(token, head) fp32 amax/448 scales, each within the bound."""
    s = spec("mha")
    k = torch.randn(6, 4, 32, generator=gen) * torch.tensor([1e-3, 1.0, 10.0, 1e3]).view(
        1, 4, 1
    )  # (T, H, D)
    v = torch.randn(6, 4, 32, generator=gen)
    codec = make_codec(s)
    rows = codec.pack(k, v)
    assert rows.shape == (6, s.bytes_per_token) == (6, 2 * 128 + 2 * 16)
    k_scale = k.abs().amax(-1) / 448  # (T, H)
    torch.testing.assert_close(region(s, rows, "k_scale", torch.float32), k_scale, rtol=0, atol=0)
    torch.testing.assert_close(
        region(s, rows, "v_scale", torch.float32), v.abs().amax(-1) / 448, rtol=0, atol=0
    )
    k2, v2 = codec.unpack(rows, torch.float32)
    assert k2.shape == v2.shape == (6, 4, 32)
    assert ((k2 - k).abs() <= fp8_bound(k, k_scale.unsqueeze(-1))).all()
    assert ((v2 - v).abs() <= fp8_bound(v, v.abs().amax(-1, keepdim=True) / 448)).all()


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("kind", ["mla", "mha"])
def test_unquantized_specs_store_the_raw_values(
    kind: str, dtype: str, gen: torch.Generator
) -> None:
    """Non-fp8 caches hold the values cast to the cache dtype, byte for byte."""
    s = spec(kind, dtype)
    codec = make_codec(s)
    shape_k = (3, 512) if kind == "mla" else (3, 4, 32)
    shape_v = (3, 64) if kind == "mla" else (3, 4, 32)
    k, v = torch.randn(shape_k, generator=gen), torch.randn(shape_v, generator=gen)
    out_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    k2, v2 = codec.unpack(codec.pack(k, v), out_dtype)
    assert torch.equal(k2, k.to(out_dtype)) and torch.equal(v2, v.to(out_dtype))
    first = "nope" if kind == "mla" else "k"
    assert torch.equal(
        region(s, codec.pack(k, v), first, out_dtype).reshape(shape_k), k.to(out_dtype)
    )


class Ue8m0(Fp8LayoutPolicy):
    name = "ue8m0_pack"

    def regions(self, kv_lora_rank: int, rope_head_dim: int) -> list[tuple[str, str, int]]:
        return [
            ("nope", "fp8_e4m3", kv_lora_rank),
            ("nope_scale", "fp8_e8m0", kv_lora_rank // 64),
            ("pad", "fp8_e4m3", 3),
            ("rope", "fp16", rope_head_dim),
        ]


def test_generic_path_serves_a_python_policy_with_e8m0_scales(gen: torch.Generator) -> None:
    """A policy's e8m0 scales are powers of two >= amax/448; unknown regions are zero-filled."""
    s = spec(policy=Ue8m0())
    k = torch.randn(7, 512, generator=gen) * 5
    v = torch.randn(7, 64, generator=gen)
    codec = make_codec(s, policy=Ue8m0())
    rows = codec.pack(k, v)
    scales = region(s, rows, "nope_scale", torch.float8_e8m0fnu).float()  # (T, 8)
    amax = k.reshape(7, 8, 64).abs().amax(-1) / 448
    assert (scales >= amax).all() and (scales < 2 * amax).all()
    assert torch.equal(torch.exp2(torch.log2(scales).round()), scales)
    assert not region(s, rows, "pad", torch.uint8).any()
    k2, v2 = codec.unpack(rows, torch.float32)
    bound = fp8_bound(k, scales.repeat_interleave(64, dim=1))
    assert ((k2 - k).abs() <= bound).all()
    torch.testing.assert_close(v2, v, rtol=2.0**-11, atol=0)


def test_policies_can_bring_their_own_codec_and_must_match_the_spec() -> None:
    """make_codec returns a policy's make_codec(spec); a policy of another name is refused."""

    class Own(Ue8m0):
        name = "own"

        def make_codec(self, spec: Any) -> str:
            return f"codec for {spec.layout}"

    assert make_codec(spec(policy=Own()), policy=Own()) == "codec for own"
    with pytest.raises(
        ValueError, match=r"policy 'own' does not match spec 'layers\.3' built with layout 'padded'"
    ):
        make_codec(spec(), policy=Own())


def test_bad_tensors_are_value_errors() -> None:
    """Wrong shapes, token counts or row sizes name the expected shape."""
    codec = make_codec(spec())
    with pytest.raises(
        ValueError, match=r"k must have shape \(T, 512\) for spec 'layers.3', got \(2, 256\)"
    ):
        codec.pack(torch.zeros(2, 256), torch.zeros(2, 64))
    with pytest.raises(ValueError, match="same number of tokens, got 2 and 3"):
        codec.pack(torch.zeros(2, 512), torch.zeros(3, 64))
    with pytest.raises(ValueError, match=r"rows must be uint8 \(T, 656\)"):
        codec.unpack(torch.zeros(2, 576, dtype=torch.uint8), torch.float32)


def test_zero_tokens_and_bf16_inputs_work() -> None:
    """An empty batch packs to (0, bytes_per_token); bf16 inputs are accepted."""
    codec = make_codec(spec(layout="compact"))
    assert codec.pack(torch.zeros(0, 512), torch.zeros(0, 64)).shape == (0, 576)
    k = torch.ones(1, 512, dtype=torch.bfloat16)
    k2, _ = codec.unpack(codec.pack(k, torch.ones(1, 64, dtype=torch.bfloat16)), torch.bfloat16)
    assert k2.dtype == torch.bfloat16 and torch.allclose(k2.float(), k.float(), rtol=E4M3_REL)


def test_compact_raises_its_scale_for_10x_larger_values_instead_of_clamping(
    gen: torch.Generator,
) -> None:
    """A later batch 10x larger raises the derived scale by a power of two; it round-trips
    within the e4m3 bound, and rows packed earlier, requantized, still do."""
    codec = make_codec(spec(layout="compact"))
    k1, v1 = torch.randn(8, 512, generator=gen), torch.randn(8, 64, generator=gen)
    rows1 = codec.pack(k1, v1)
    first = codec.scale
    k2, v2 = k1 * 10, torch.randn(8, 64, generator=gen) * 10
    rows2 = codec.pack(k2, v2)
    assert codec.rescales == 1 and codec.clamped == 0
    ratio = codec.scale / first
    assert ratio >= 8 and ratio == 2.0 ** round(math.log2(ratio))
    scale = torch.tensor(codec.scale)
    k2b, v2b = codec.unpack(rows2, torch.float32)
    assert ((k2b - k2).abs() <= fp8_bound(k2, scale)).all()
    assert ((v2b - v2).abs() <= fp8_bound(v2, scale)).all()
    codec.requantize(rows1, first)
    k1b, v1b = codec.unpack(rows1, torch.float32)
    twice = torch.tensor(first) + scale  # first rounding at the old scale, subnormals at the new
    assert ((k1b - k1).abs() <= fp8_bound(k1, twice)).all()
    assert ((v1b - v1).abs() <= fp8_bound(v1, twice)).all()


def test_compact_pool_requantizes_its_rows_when_the_scale_grows(gen: torch.Generator) -> None:
    """The paged fp8 pool reads back both an early batch and a 10x larger later one within the bound."""
    from rtpcore.kv.pools import PackedLayerKVCache

    s = spec(layout="compact", tokens_per_block=4)
    cache = PackedLayerKVCache(s, num_blocks=4)
    k1, v1 = torch.randn(4, 512, generator=gen), torch.randn(4, 64, generator=gen)
    cache.write(torch.arange(4), k1, v1)  # block 0
    k2, v2 = torch.randn(4, 512, generator=gen) * 10, torch.randn(4, 64, generator=gen) * 10
    cache.write(torch.arange(4, 8), k2, v2)  # block 1
    assert cache.codec.rescales == 1 and cache.codec.clamped == 0
    k, v = cache.read(torch.tensor([[0], [1]]), 4)  # (2, 4, 512), (2, 4, 64)
    bound = torch.tensor(cache.codec.scale) * 2
    assert ((k[0] - k1).abs() <= fp8_bound(k1, bound)).all()
    assert ((v[0] - v1).abs() <= fp8_bound(v1, bound)).all()
    assert ((k[1] - k2).abs() <= fp8_bound(k2, bound)).all()
    assert ((v[1] - v2).abs() <= fp8_bound(v2, bound)).all()


def test_a_fixed_compact_scale_counts_and_logs_every_clamped_value(
    gen: torch.Generator, caplog: pytest.LogCaptureFixture
) -> None:
    """With a scale the caller fixed, values beyond 448 x scale are clamped, counted and logged."""
    codec = make_codec(spec(layout="compact"), scale=0.01)
    k = torch.randn(4, 512, generator=gen)
    k[0, :3] = torch.tensor([10.0, -20.0, 30.0])  # beyond 4.48
    with caplog.at_level("WARNING", logger="rtpcore.kv.codecs"):
        codec.pack(k, torch.zeros(4, 64))
        codec.pack(k, torch.zeros(4, 64))
    assert codec.clamped == 6 and codec.scale == 0.01 and codec.rescales == 0
    (record,) = caplog.records  # logged once, counted always
    assert "layers.3: 3 fp8 nope values beyond the fixed per-tensor scale range +-4.48 were clamped" in (
        record.getMessage()
    )

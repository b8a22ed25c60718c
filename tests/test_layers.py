"""``rtpcore.models.layers.Linear``: F.linear's exact bits in float32, one rounding step of it in bf16/fp16, and which kernel runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from rtpcore.models.layers import (
    Linear,
    cpu_has_native_dot,
    linear_kernels,
    native_bf16_dot,
    packed_linear_supported,
)
from rtpcore.parallel.layers import row_parallel

DTYPES = [torch.bfloat16, torch.float32]
REDUCED = [torch.bfloat16, torch.float16]


def assert_within_one_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """``got`` equals F.linear's result up to what float32 accumulation in another order and
    one rounding to the output dtype can change: 2u|y| + 2u|b| + 4K 2^-24 (|x| @ |w|^T)."""
    ref = F.linear(x, w, b).double()
    u = torch.finfo(x.dtype).eps / 2  # unit roundoff of the output dtype
    k = x.shape[-1]
    mag = x.double().abs() @ w.double().abs().T  # (..., out): the sum of |terms|
    tol = 2 * u * ref.abs() + 4 * k * 2.0**-24 * mag
    if b is not None:
        tol = tol + 2 * u * b.double().abs()
    excess = (got.double() - ref).abs() - tol
    assert excess.max() <= 0, f"off by more than one rounding step: worst excess {excess.max().item():.3g}"


@settings(max_examples=30, deadline=None)
@given(
    out_features=st.integers(1, 160),
    in_features=st.integers(1, 160),
    rows=st.sampled_from([1, 2, 3, 7, 16, 33]),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_float32_equals_f_linear_bit_for_bit(
    out_features: int, in_features: int, rows: int, with_bias: bool, seed: int
) -> None:
    """On random shapes, with or without bias, float32 outputs equal F.linear's exactly."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if with_bias else None
    x = torch.randn(rows, in_features, generator=gen)
    layer = Linear(w.clone(), None if b is None else b.clone())
    got = layer(x)
    assert layer.kernel == "plain"
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    assert torch.equal(got, F.linear(x, w, b))


@pytest.mark.parametrize("batched_fp32", [False, True])
@pytest.mark.parametrize("dtype", REDUCED)
@pytest.mark.parametrize(("out_features", "in_features"), [(96, 64), (1376, 512), (32000, 512), (512, 1376)])
def test_reduced_precision_kernels_stay_within_one_rounding_of_f_linear(
    dtype: torch.dtype, batched_fp32: bool, out_features: int, in_features: int
) -> None:
    """bf16/fp16 kernels (packed, and packed with a float32 copy) differ from F.linear by at
    most one rounding step, on model-sized shapes and the row counts of decode and prefill."""
    gen = torch.Generator().manual_seed(out_features + in_features)
    w = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype)
    with linear_kernels(batched_fp32=batched_fp32):
        layer = Linear(w.clone(), b.clone())
    for rows in (1, 2, 5, 8, 37):
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        got = layer(x)
        assert got.dtype == dtype and got.shape == (rows, out_features)
        assert_within_one_rounding(got, x, w, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_takes_leading_dimensions(dtype: torch.dtype) -> None:
    """(..., in) inputs give (..., out) outputs: F.linear's bits in float32, within one rounding in bf16."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(48, 32, generator=gen).to(dtype)
    x = torch.randn(2, 5, 32, generator=gen).to(dtype)
    got = Linear(w.clone())(x)
    assert got.shape == (2, 5, 48)
    if dtype == torch.float32:
        assert torch.equal(got, F.linear(x, w))
    else:
        assert_within_one_rounding(got, x, w, None)


def test_kernel_follows_the_dtype_the_probe_and_the_host_choice() -> None:
    """float32 never packs (F.linear is transformers' kernel); bf16 runs rtpcore_native's bf16
    kernels on their blocked layout where they have bf16 dot products, else packs when the probe
    passes, and keeps a float32 copy exactly when the host asks for one (or, automatically, when
    the CPU has no bf16 dot products)."""
    w = torch.randn(16, 8)
    fp32 = Linear(w)
    assert (fp32.packed, fp32.kernel, fp32.weight_fp32) == (False, "plain", None)
    assert fp32.weight is w  # float32 holds the caller's tensor: no copy
    assert "kernel=plain" in repr(fp32) and "in=8, out=16" in repr(fp32)
    assert packed_linear_supported(torch.float32) is False
    assert packed_linear_supported(torch.int8) is False
    if not packed_linear_supported(torch.bfloat16):
        pytest.skip("this torch build has no prepacked oneDNN bf16 linear")
    one_copy = "native-bf16" if native_bf16_dot() else "packed"
    with linear_kernels(batched_fp32=False):
        assert Linear(w.bfloat16()).kernel == one_copy
    with linear_kernels(batched_fp32=True):
        both = Linear(w.bfloat16())
        assert both.kernel == "packed+fp32" and both.weight_fp32 is not None
        with linear_kernels(batched_fp32=False):  # the innermost block wins, then the outer returns
            assert Linear(w.bfloat16()).kernel == one_copy
        assert Linear(w.bfloat16()).kernel == "packed+fp32"
    auto = Linear(w.bfloat16())
    assert auto.kernel == (one_copy if cpu_has_native_dot(torch.bfloat16) else "packed+fp32")
    # fp16: oneDNN's kernels where its probe passes (oneDNN's prepacked fp16 needs AVX512-FP16 or
    # AVX-NE-CONVERT: an EPYC without them gets F.linear)
    fp16_kernels = ("packed", "packed+fp32") if packed_linear_supported(torch.float16) else ("plain",)
    assert Linear(w.half()).kernel in fp16_kernels
    assert f"kernel={auto.kernel}" in repr(auto) and (auto.out_features, auto.in_features) == (16, 8)


@pytest.mark.parametrize(
    ("flags", "isa", "bf16", "fp16"),
    [
        ("fpu avx2 avx512f avx512_vnni", None, False, False),
        ("fpu avx512f avx512_bf16 avx512_vnni", None, True, False),
        ("fpu avx512f avx512_bf16 amx_bf16 amx_tile avx512_fp16", None, True, True),
        ("fpu avx512f avx512_bf16 amx_bf16", "AVX512_CORE_VNNI", False, False),
        ("fpu avx512f avx512_bf16 amx_bf16", "avx512_core_amx", True, False),
    ],
)
def test_native_dot_products_are_read_from_cpuinfo_and_oneDNN_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: str, isa: str | None, bf16: bool, fp16: bool
) -> None:
    """A CPU has native bf16/fp16 dot products when /proc/cpuinfo lists them and
    ONEDNN_MAX_CPU_ISA does not hide them; a missing file means none."""
    cpuinfo = tmp_path / f"cpuinfo-{abs(hash((flags, isa)))}"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: test\nflags\t\t: {flags}\n\n")
    if isa is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    assert cpu_has_native_dot(torch.bfloat16, cpuinfo) is bf16
    assert cpu_has_native_dot(torch.float16, cpuinfo) is fp16
    assert cpu_has_native_dot(torch.float32, cpuinfo) is False
    assert cpu_has_native_dot(torch.bfloat16, tmp_path / "missing") is False


def test_bad_shapes_are_refused_with_the_rule() -> None:
    """A weight that is not 2-D, or a bias of the wrong length, raises ValueError naming the shapes."""
    with pytest.raises(ValueError, match=r"2-D \(out, in\); got shape \(4,\)") as excinfo:
        Linear(torch.randn(4))
    assert "weight" in str(excinfo.value)
    with pytest.raises(ValueError, match=r"bias must have shape \(4,\) to match weight \(4, 3\); got \(3,\)"):
        Linear(torch.randn(4, 3), torch.randn(3))


def test_public_paths_and_row_parallel_factory() -> None:
    """The public paths ``rtpcore.layers`` and ``rtpcore.batch`` re-export the classes that moved
    to their stages; unsharded row_parallel returns the layer as is."""
    from rtpcore.batch import ForwardBatch as PublicForwardBatch
    from rtpcore.layers import Linear as PublicLinear
    from rtpcore.models.forward_batch import ForwardBatch

    assert PublicLinear is Linear and PublicForwardBatch is ForwardBatch
    w, b = torch.randn(6, 4), torch.randn(6)
    layer = row_parallel(Linear, w, b, None)
    assert isinstance(layer, Linear)
    x = torch.randn(3, 4)
    assert torch.equal(layer(x), F.linear(x, w, b))

"""``rtpcore.layers.Linear`` gives ``F.linear``'s exact bits, and says which kernel it runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from rtpcore.layers import Linear, packed_linear_supported
from rtpcore.parallel_layers import row_parallel

DTYPES = [torch.bfloat16, torch.float32]


@settings(max_examples=30, deadline=None)
@given(
    out_features=st.integers(1, 160),
    in_features=st.integers(1, 160),
    rows=st.sampled_from([1, 2, 3, 7, 16, 33]),
    with_bias=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_linear_equals_f_linear_bit_for_bit(
    out_features: int, in_features: int, rows: int, with_bias: bool, dtype: torch.dtype, seed: int
) -> None:
    """On random shapes, with or without bias, bf16 and float32 outputs equal F.linear's exactly."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype) if with_bias else None
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    layer = Linear(w.clone(), None if b is None else b.clone())
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    assert torch.equal(got, F.linear(x, w, b))


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_takes_leading_dimensions(dtype: torch.dtype) -> None:
    """(..., in) inputs give (..., out) outputs, still F.linear's bits."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(48, 32, generator=gen).to(dtype)
    x = torch.randn(2, 5, 32, generator=gen).to(dtype)
    assert torch.equal(Linear(w.clone())(x), F.linear(x, w))


def test_packed_flag_follows_the_dtype_and_the_probe() -> None:
    """float32 never packs (F.linear is transformers' kernel); bf16 packs exactly when the probe passes."""
    w = torch.randn(16, 8)
    fp32 = Linear(w)
    assert fp32.packed is False
    assert fp32.weight is w  # float32 holds the caller's tensor: no copy
    assert "packed=False" in repr(fp32) and "in=8, out=16" in repr(fp32)
    assert packed_linear_supported(torch.float32) is False
    assert packed_linear_supported(torch.int8) is False
    bf16 = Linear(w.to(torch.bfloat16))
    assert bf16.packed is packed_linear_supported(torch.bfloat16)
    assert f"packed={bf16.packed}" in repr(bf16)
    assert (bf16.out_features, bf16.in_features) == (16, 8)


def test_bad_shapes_are_refused_with_the_rule() -> None:
    """A weight that is not 2-D, or a bias of the wrong length, raises ValueError naming the shapes."""
    with pytest.raises(ValueError, match=r"2-D \(out, in\); got shape \(4,\)") as excinfo:
        Linear(torch.randn(4))
    assert "weight" in str(excinfo.value)
    with pytest.raises(ValueError, match=r"bias must have shape \(4,\) to match weight \(4, 3\); got \(3,\)"):
        Linear(torch.randn(4, 3), torch.randn(3))


def test_old_import_path_and_row_parallel_factory() -> None:
    """``rtpcore.models._linear`` re-exports the public layer; unsharded row_parallel returns it as is."""
    from rtpcore.models._linear import Linear as OldLinear

    assert OldLinear is Linear
    w, b = torch.randn(6, 4), torch.randn(6)
    layer = row_parallel(Linear, w, b, None)
    assert isinstance(layer, Linear)
    x = torch.randn(3, 4)
    assert torch.equal(layer(x), F.linear(x, w, b))

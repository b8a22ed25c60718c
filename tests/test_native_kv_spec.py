"""rtpcore_native: the KV-cache spec builder, its byte maps, block planning and bad input."""

from __future__ import annotations

import pickle
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_reference import reference_regions, reference_spec
from rtpcore_native import (
    BUILTIN_LAYOUTS,
    Fp8LayoutPolicy,
    KVCacheSpec,
    KVCacheSpecDesc,
    build_kv_cache_spec,
    plan_kv_cache_blocks,
)

BIG = 2**62


def mla(dtype: str = "fp8_e4m3", rank: int = 512, rope: int = 64, **kw: Any) -> KVCacheSpecDesc:
    args: dict[str, Any] = {
        "tag": "layers.0",
        "kind": "mla",
        "dtype": dtype,
        "kv_lora_rank": rank,
        "rope_head_dim": rope,
    }
    return KVCacheSpecDesc(**{**args, **kw})


def mha(dtype: str = "fp8_e4m3", heads: int = 8, head_dim: int = 128, **kw: Any) -> KVCacheSpecDesc:
    args: dict[str, Any] = {
        "tag": "layers.0",
        "kind": "mha",
        "dtype": dtype,
        "num_kv_heads": heads,
        "head_dim": head_dim,
    }
    return KVCacheSpecDesc(**{**args, **kw})


# ------------------------------------------------------------------ contract vectors

CONTRACT = [  # (kv_lora_rank, rope, bf16, fp8 padded, fp8 compact): docs/design.md §5
    (512, 64, 1152, 656, 576),
    (512, 32, 1088, 592, 544),
    (256, 64, 640, 392, 320),
    (128, 32, 320, 196, 160),
]


@pytest.mark.parametrize(("rank", "rope", "bf16", "padded", "compact"), CONTRACT)
def test_contract_vectors_hold(rank: int, rope: int, bf16: int, padded: int, compact: int) -> None:
    """All twelve bytes-per-token numbers of the contract table come out of the builder."""
    assert build_kv_cache_spec(mla("bf16", rank, rope)).bytes_per_token == bf16
    assert build_kv_cache_spec(mla(rank=rank, rope=rope, layout="padded")).bytes_per_token == padded
    assert (
        build_kv_cache_spec(mla(rank=rank, rope=rope, layout="compact")).bytes_per_token == compact
    )


def test_design_example_block_and_partition() -> None:
    """The §5 example: 656 bytes per token, 64 tokens per block, k + v + scale == block."""
    s = build_kv_cache_spec(mla(tokens_per_block=64, layout="padded"))
    assert (s.bytes_per_token, s.block_bytes) == (656, 656 * 64)
    assert (s.k_block_bytes, s.v_block_bytes, s.scale_block_bytes) == (512 * 64, 128 * 64, 16 * 64)
    assert s.k_block_bytes + s.v_block_bytes + s.scale_block_bytes == s.block_bytes


@pytest.mark.parametrize(
    ("desc", "regions"),
    [
        (
            mla(layout="padded"),
            [
                ("nope", 0, 512, "fp8_e4m3"),
                ("nope_scale", 512, 16, "fp32"),
                ("rope", 528, 128, "bf16"),
            ],
        ),
        (mla(layout="compact"), [("nope", 0, 512, "fp8_e4m3"), ("rope", 512, 64, "fp8_e4m3")]),
        (mla("bf16"), [("nope", 0, 1024, "bf16"), ("rope", 1024, 128, "bf16")]),
        (
            mha(),
            [
                ("k", 0, 1024, "fp8_e4m3"),
                ("v", 1024, 1024, "fp8_e4m3"),
                ("k_scale", 2048, 32, "fp32"),
                ("v_scale", 2080, 32, "fp32"),
            ],
        ),
        (mha("fp16", 2, 64), [("k", 0, 256, "fp16"), ("v", 256, 256, "fp16")]),
    ],
    ids=["padded-512-64", "compact-512-64", "bf16-mla", "mha-fp8-8x128", "mha-fp16"],
)
def test_byte_maps_are_exact(
    desc: KVCacheSpecDesc, regions: list[tuple[str, int, int, str]]
) -> None:
    """Each built-in layout places its regions at the documented offsets."""
    assert build_kv_cache_spec(desc).regions == regions


@pytest.mark.parametrize(
    ("desc", "bytes_per_token"),
    [
        (mla("fp32"), 2304),  # (512 + 64) x 4
        (mla(rank=1024, rope=128, layout="padded"), 1024 + 32 + 256),
        (mla(rank=96, rope=16, layout="compact"), 112),  # compact has no divisibility rule
        (mha("fp8_e4m3", 1, 1), 2 + 8),
        (mha("bf16", 32, 128), 16384),
        (mha("fp32", 4, 80), 2560),
    ],
)
def test_own_vectors(desc: KVCacheSpecDesc, bytes_per_token: int) -> None:
    """Hand-computed sizes for the other dtypes, both kinds and odd shapes."""
    assert build_kv_cache_spec(desc).bytes_per_token == bytes_per_token


def test_empty_layout_on_fp8_mla_means_padded_and_other_kinds_report_none() -> None:
    """layout "" on an fp8 MLA layer resolves to "padded"; non-fp8 or MHA specs report ""."""
    assert build_kv_cache_spec(mla()).layout == "padded"
    assert build_kv_cache_spec(mla("bf16", layout="padded")).layout == ""
    assert build_kv_cache_spec(mha(layout="compact")).layout == ""
    assert BUILTIN_LAYOUTS == ("compact", "padded")


def test_spec_carries_the_descriptor_fields() -> None:
    """Every descriptor field is readable on the spec."""
    d = mla(tag="model.layers.7", tokens_per_block=32, layout="compact")
    s = build_kv_cache_spec(d)
    for field in (
        "tag",
        "kind",
        "dtype",
        "kv_lora_rank",
        "rope_head_dim",
        "num_kv_heads",
        "head_dim",
        "tokens_per_block",
        "layout",
    ):
        assert getattr(s, field) == getattr(d, field), field


def test_specs_and_descs_pickle_and_compare_by_value() -> None:
    """Specs cross process boundaries (workers) unchanged, and compare equal by value."""
    d = mha()
    s = build_kv_cache_spec(d)
    assert pickle.loads(pickle.dumps(d)) == d
    again = pickle.loads(pickle.dumps(s))
    assert again == s and again.regions == s.regions and again.block_bytes == s.block_bytes
    assert hash(again) == hash(s)
    assert s != build_kv_cache_spec(mha(tokens_per_block=32))


def test_spec_is_not_constructible_and_descs_are_read_only() -> None:
    """Specs come only from the builder; descriptor fields cannot be reassigned."""
    with pytest.raises(TypeError):
        KVCacheSpec()
    d = mla()
    with pytest.raises(AttributeError):
        d.kv_lora_rank = 3  # type: ignore[misc]
    assert "kv_lora_rank=512" in repr(d) and "bytes_per_token=656" in repr(build_kv_cache_spec(d))


# ------------------------------------------------------------------ property test

DTYPES = ["fp32", "fp16", "bf16", "fp8_e4m3"]


@st.composite
def descs(draw: st.DrawFn) -> KVCacheSpecDesc:
    kind = draw(st.sampled_from(["mha", "mla"]))
    dtype = draw(st.sampled_from(DTYPES))
    tpb = draw(st.integers(1, 1024))
    if kind == "mha":
        return mha(
            dtype, draw(st.integers(1, 256)), draw(st.integers(1, 1024)), tokens_per_block=tpb
        )
    layout = draw(st.sampled_from(["", "padded", "compact"]))
    rank = (
        draw(st.integers(1, 64)) * 128 if layout in ("", "padded") else draw(st.integers(1, 8192))
    )
    return mla(dtype, rank, draw(st.integers(1, 512)), tokens_per_block=tpb, layout=layout)


@settings(max_examples=300, deadline=None)
@given(descs())
def test_native_matches_the_python_reference(desc: KVCacheSpecDesc) -> None:
    """Over many shapes the native builder equals the pure-Python formula, and its invariants hold."""
    s = build_kv_cache_spec(desc)
    names = ("nope", "rope") if desc.kind == "mla" else ("k", "v")
    want = reference_spec(
        reference_regions(
            desc.kind,
            desc.dtype,
            kv_lora_rank=desc.kv_lora_rank,
            rope_head_dim=desc.rope_head_dim,
            num_kv_heads=desc.num_kv_heads,
            head_dim=desc.head_dim,
            layout=desc.layout,
        ),
        desc.tokens_per_block,
        *names,
    )
    got = {k: getattr(s, k) for k in want}
    assert got == want
    assert s.k_block_bytes + s.v_block_bytes + s.scale_block_bytes == s.block_bytes
    assert s.block_bytes == s.bytes_per_token * s.tokens_per_block
    end = 0
    for _, offset, nbytes, _ in s.regions:  # contiguous, no gaps, no overlap
        assert offset == end and nbytes > 0
        end = offset + nbytes
    assert end == s.bytes_per_token


# ------------------------------------------------------------------ bad input

BAD_DESCS = [
    ({"kv_lora_rank": 0}, "kv_lora_rank must be a positive integer, got 0"),
    ({"rope_head_dim": -1}, "rope_head_dim must be a positive integer, got -1"),
    ({"tokens_per_block": 0}, "tokens_per_block must be a positive integer, got 0"),
    ({"tokens_per_block": -64}, "tokens_per_block must be a positive integer, got -64"),
    ({"kv_lora_rank": BIG}, f"kv_lora_rank={BIG} exceeds the limit 2**31-1"),
    ({"tokens_per_block": BIG}, f"tokens_per_block={BIG} exceeds the limit"),
    ({"kv_lora_rank": 2**64}, "kv_lora_rank=18446744073709551616 does not fit in int64"),
    ({"rope_head_dim": -(2**70)}, "does not fit in int64"),
    ({"kv_lora_rank": True}, "kv_lora_rank must be an int, got a bool"),
    ({"dtype": "int8"}, "dtype must be one of 'fp32', 'fp16', 'bf16', 'fp8_e4m3', got 'int8'"),
    ({"dtype": "fp8_e8m0"}, "dtype='fp8_e8m0' is a scale format only"),
    ({"dtype": "FP16"}, "got 'FP16'"),
    ({"kind": "gqa"}, "kind must be 'mha' or 'mla', got 'gqa'"),
    ({"tag": ""}, "tag must be a non-empty string"),
    ({"num_kv_heads": 8}, "num_kv_heads=8 does not apply to kind='mla'"),
]


@pytest.mark.parametrize(("change", "message"), BAD_DESCS, ids=[str(c) for c, _ in BAD_DESCS])
def test_bad_descriptors_raise_value_error_naming_field_and_value(
    change: dict[str, Any], message: str
) -> None:
    """Zero, negative, oversized, non-int, unknown dtype/kind and misplaced fields: ValueError."""
    with pytest.raises(ValueError) as excinfo:
        mla(**change)
    assert message in str(excinfo.value)


@pytest.mark.parametrize(
    ("desc", "message"),
    [
        (
            mla(rank=500, layout="padded"),
            "kv_lora_rank=500 must be divisible by 128 for layout 'padded'",
        ),
        (mla(rank=200), "kv_lora_rank=200 must be divisible by 128"),  # "" means padded
        (mla(layout="ue8m0"), "layout='ue8m0' is unknown (built-in: 'compact', 'padded'"),
        # 2**31-1 x 4 bytes x 2 parts per token, times 2**31-1 tokens per block, overflows int64
        (mha("fp32", 1, 2**31 - 1, tokens_per_block=2**31 - 1), "overflows int64"),
        (mha("fp32", 2**16, 2**16), "element_count must be in 1..2**31-1"),
    ],
)
def test_bad_layouts_and_overflow_raise_value_error(desc: KVCacheSpecDesc, message: str) -> None:
    """Padded with a rank not divisible by 128, unknown layouts and int64 overflow never wrap."""
    with pytest.raises(ValueError) as excinfo:
        build_kv_cache_spec(desc)
    assert message in str(excinfo.value)
    assert "tag='layers.0'" in str(excinfo.value)


def test_kind_mha_refuses_mla_fields() -> None:
    """A field that belongs to the other kind is a mistake, not silently ignored."""
    with pytest.raises(ValueError, match=r"kv_lora_rank=512 does not apply to kind='mha'"):
        mha(kv_lora_rank=512)


# ------------------------------------------------------------------ block planning


def test_plan_counts_blocks_over_layers_of_different_sizes() -> None:
    """Every layer gets the same number of blocks: memory // sum of block sizes."""
    a = build_kv_cache_spec(mla(tokens_per_block=64))  # 41984
    b = build_kv_cache_spec(mha("bf16", 2, 64, tokens_per_block=64))  # 32768
    per_block = a.block_bytes + b.block_bytes
    assert plan_kv_cache_blocks([a, b], 10 * per_block + per_block - 1) == 10
    assert plan_kv_cache_blocks([a, b], per_block - 1) == 0
    assert plan_kv_cache_blocks([a], 2**62) == 2**62 // a.block_bytes


@pytest.mark.parametrize(
    ("memory", "specs", "message"),
    [
        (-1, 1, "memory_bytes must be >= 0, got -1"),
        (2**64, 1, "memory_bytes=18446744073709551616 does not fit in int64"),
        (10**9, 0, "specs must name at least one layer"),
        (10**9, 3, "sum of block_bytes over layers"),
    ],
)
def test_plan_rejects_bad_input(memory: int, specs: int, message: str) -> None:
    """Negative or oversized memory, no layers and an overflowing sum are ValueErrors."""
    huge = build_kv_cache_spec(mha("fp32", 1, 2**31 - 1, tokens_per_block=2**28))  # ~2**62 bytes
    with pytest.raises(ValueError) as excinfo:
        plan_kv_cache_blocks([huge] * specs, memory)
    assert message in str(excinfo.value)


# ------------------------------------------------------------------ Python policies


class Ue8m0(Fp8LayoutPolicy):
    name = "ue8m0_test"

    def regions(self, kv_lora_rank: int, rope_head_dim: int) -> list[tuple[str, str, int]]:
        return [
            ("nope", "fp8_e4m3", kv_lora_rank),
            ("nope_scale", "fp8_e8m0", kv_lora_rank // 128),
            ("rope", "bf16", rope_head_dim),
        ]


def test_python_policy_defines_a_layout_through_the_trampoline() -> None:
    """A Python subclass's regions are packed back to back; scale = every region but nope/rope."""
    s = build_kv_cache_spec(mla(tokens_per_block=4), policy=Ue8m0())
    assert s.layout == "ue8m0_test"
    assert s.regions == [
        ("nope", 0, 512, "fp8_e4m3"),
        ("nope_scale", 512, 4, "fp8_e8m0"),
        ("rope", 516, 128, "bf16"),
    ]
    assert (s.bytes_per_token, s.k_block_bytes, s.v_block_bytes, s.scale_block_bytes) == (
        644,
        2048,
        512,
        16,
    )
    assert build_kv_cache_spec(mla(tokens_per_block=4, layout="ue8m0_test"), policy=Ue8m0()) == s


def _policy(result: Any, name: Any = "p") -> Fp8LayoutPolicy:
    class P(Fp8LayoutPolicy):
        def regions(self, kv_lora_rank: int, rope_head_dim: int) -> Any:
            return result

    P.name = name  # type: ignore[assignment]
    return P()


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        (_policy([("nope", "fp8_e4m3", 512)]), "has no 'rope' region"),
        (_policy([("rope", "bf16", 64)]), "has no 'nope' region"),
        (_policy("nope"), "must return a list of (name, dtype, element_count), got 'nope'"),
        (_policy(None), "got None"),
        (
            _policy([("nope", "fp8_e4m3")]),
            "returned an entry that is not (name: str, dtype: str, element_count: int): ('nope', 'fp8_e4m3')",
        ),
        (_policy([("nope", "fp8_e4m3", 512.0), ("rope", "bf16", 64)]), "512.0"),
        (_policy([("nope", "fp8_e4m3", True), ("rope", "bf16", 64)]), "True"),
        (
            _policy([("nope", "fp8_e4m3", 512), ("rope", "bf16", 64), ("pad", "u8", 3)]),
            "region 'pad' has unknown dtype 'u8'",
        ),
        (
            _policy([("nope", "fp8_e4m3", 512), ("rope", "bf16", 64), ("s", "fp32", 0)]),
            "region 's' element_count must be in 1..2**31-1, got 0",
        ),
        (
            _policy([("nope", "fp8_e4m3", 512), ("rope", "bf16", 64), ("s", "fp32", 2**80)]),
            "does not fit in int64",
        ),
        (
            _policy([("nope", "fp8_e4m3", 256), ("rope", "bf16", 64)]),
            "region 'nope' must hold 512 elements, got 256",
        ),
        (
            _policy([("nope", "fp8_e8m0", 512), ("rope", "bf16", 64)]),
            "cannot hold values as 'fp8_e8m0'",
        ),
        (
            _policy([("nope", "fp8_e4m3", 512), ("nope", "fp8_e4m3", 512), ("rope", "bf16", 64)]),
            "region 'nope' appears twice",
        ),
        (_policy([("", "fp8_e4m3", 512), ("rope", "bf16", 64)]), "a region has an empty name"),
        (
            _policy([("nope", "fp8_e4m3", 512), ("rope", "bf16", 64)], name=""),
            "needs a non-empty str 'name', got ''",
        ),
        (
            _policy([("nope", "fp8_e4m3", 512), ("rope", "bf16", 64)], name=7),
            "needs a non-empty str 'name', got 7",
        ),
    ],
)
def test_python_policies_returning_garbage_raise_value_error(
    policy: Fp8LayoutPolicy, message: str
) -> None:
    """No rope, no nope, wrong types, unknown dtypes, bad counts, duplicates, no name: ValueError."""
    with pytest.raises(ValueError) as excinfo:
        build_kv_cache_spec(mla(), policy=policy)
    assert message in str(excinfo.value)


def test_policy_misuse_raises_value_error() -> None:
    """A policy on a non-fp8 layer, a name mismatch, a missing regions(): ValueError."""
    with pytest.raises(ValueError, match="applies only to kind='mla' with dtype='fp8_e4m3'"):
        build_kv_cache_spec(mla("bf16"), policy=Ue8m0())
    with pytest.raises(
        ValueError, match="layout='compact' does not match the policy's name 'ue8m0_test'"
    ):
        build_kv_cache_spec(mla(layout="compact"), policy=Ue8m0())

    class NoRegions(Fp8LayoutPolicy):
        name = "none"

    with pytest.raises(ValueError, match="regions\\(\\) is not implemented"):
        build_kv_cache_spec(mla(), policy=NoRegions())


def test_policy_errors_propagate_as_raised() -> None:
    """A policy's own ValueError reaches the caller as a ValueError with its message."""

    class Picky(Fp8LayoutPolicy):
        name = "picky"

        def regions(self, kv_lora_rank: int, rope_head_dim: int) -> list[tuple[str, str, int]]:
            raise ValueError(f"picky wants 1024, got {kv_lora_rank}")

    with pytest.raises(ValueError, match="picky wants 1024, got 512"):
        build_kv_cache_spec(mla(), policy=Picky())


# ------------------------------------------------------------------ typed surface


def test_stubs_match_the_extension() -> None:
    """_core.pyi agrees with the compiled module (mypy.stubtest)."""
    out = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "rtpcore_native._core"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr

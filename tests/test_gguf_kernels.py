"""The native GGUF matrix kernels (rtpcore_native._kernels, DESIGN §20) against the gguf package.

The weights are GGUF blocks as a .gguf file stores them: Q8_0, Q4_0, Q5_0 and Q5_1 quantized
from float arrays by ``gguf.quants.quantize``; Q4_K, Q5_K and Q6_K random but valid blocks built
byte by byte; F16. The reference is float64 ``x @ gguf.quants.dequantize(W).T + bias``.

Tolerance: the kernels quantize each activation row per block of B values (B = 32, or 256 for
the K types) to int8 with d = max|x_b| / 127, so each value moves by at most d / 2 =
max|x_b| / 254, and the weights are used exactly (integer products, float block scales). So

    |y - ref| <= sum_b max|x_b| * sum_{i in b} |w_i| / 254   +   1e-5 * (|x| @ |w|.T + |bias|)

the second term for float32 summation and scale rounding (and it alone bounds f16, whose
activations stay float32). Every instruction set computes the same integers, so two sets
differ by float summation order only: within the second term of each other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")
kernels = pytest.importorskip("rtpcore_native._kernels")

from gguf import GGML_QUANT_SIZES  # noqa: E402
from gguf import GGMLQuantizationType as QT  # noqa: E402

from cpu_isas import kernel_sets_under_test  # noqa: E402

TYPES = {"q8_0": QT.Q8_0, "q4_0": QT.Q4_0, "q5_0": QT.Q5_0, "q5_1": QT.Q5_1, "q4_k": QT.Q4_K, "q5_k": QT.Q5_K,
         "q6_k": QT.Q6_K, "f16": QT.F16}
QUANTIZED = [t for t in TYPES if t != "f16"]
ISAS = kernel_sets_under_test(kernels)


def block_size(dtype: str) -> int:
    """Activation block of the kernels for this weight type (1 for f16: no quantization)."""
    return 256 if dtype.endswith("_k") else 1 if dtype == "f16" else 32


def raw_blocks(dtype: str, n: int, k: int, rng: np.random.Generator, rms: float | None = None) -> np.ndarray:
    """(n, row bytes) uint8: n rows of K weights as GGUF stores them (their root mean square
    about ``rms`` when given: the K types' f16 scales are rescaled to it)."""
    qtype = TYPES[dtype]
    if not dtype.endswith("_k"):
        return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * (rms or 1.0), qtype)
    size, nbytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n * k // size, nbytes), dtype=np.uint8)  # random qs, qh, scales

    def halves(low: float, high: float) -> np.ndarray:
        return rng.uniform(low, high, (blocks.shape[0], 1)).astype(np.float16).view(np.uint8)

    if dtype == "q6_k":
        blocks[:, 208:210] = halves(2e-3, 2e-2)  # d; the int8 scales are random
    else:
        blocks[:, 0:2] = halves(2e-3, 2e-2)  # d
        blocks[:, 2:4] = halves(2e-3, 2e-2)  # dmin
    if rms is not None:
        gain = rms / float(np.sqrt(np.mean(gguf.quants.dequantize(blocks, qtype).astype(np.float64) ** 2)))
        for at in [208] if dtype == "q6_k" else [0, 2]:
            blocks[:, at : at + 2] = (blocks[:, at : at + 2].view(np.float16) * gain).astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


def dequantized(dtype: str, w: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(w, TYPES[dtype]), dtype=np.float32))


def bound(x: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor | None, dtype: str) -> torch.Tensor:
    """The module doc's tolerance for y = x @ dense.T + bias, (rows, N) float64."""
    x, dense = x.double(), dense.double()
    slack = 1e-5 * (x.abs() @ dense.abs().T + (0.0 if bias is None else bias.double().abs())) + 1e-6
    B = block_size(dtype)
    if B == 1:
        return slack
    rows, K = x.shape
    amax = x.abs().reshape(rows, K // B, B).amax(-1)  # (rows, K / B)
    wsum = dense.abs().reshape(dense.shape[0], K // B, B).sum(-1)  # (N, K / B)
    return amax @ wsum.T / 254 + slack


@contextlib.contextmanager
def isa(name: str) -> Iterator[None]:
    """Runs the block with one instruction set's kernels, then restores the default."""
    kernels.set_isa(name)
    try:
        yield
    finally:
        kernels.set_isa(kernels.default_isa())


def run_linear(w: np.ndarray, dtype: str, x: torch.Tensor, bias: torch.Tensor | None, n: int,
               acc: torch.Tensor | None = None) -> torch.Tensor:
    rows, k = x.shape
    weights = kernels.LinearWeights(w.ctypes.data, dtype, 0, 0 if bias is None else bias.data_ptr(), n, k)
    assert (weights.dtype, weights.out_features, weights.in_features) == (dtype, n, k)
    y = torch.full((rows, n), float("nan")) if acc is None else acc.clone()
    kernels.linear(weights, x.data_ptr(), rows, y.data_ptr(), accumulate=acc is not None)
    return y


@pytest.mark.parametrize("dtype", list(TYPES))
@pytest.mark.parametrize(("rows", "n", "blocks"), [(1, 64, 2), (3, 17, 1), (8, 70, 3), (20, 33, 2)])
def test_linear_is_within_the_activation_quantization_bound(dtype: str, rows: int, n: int, blocks: int) -> None:
    """Each type, under every instruction set, within the module doc's bound of the float64
    reference, with a bias; every set within float rounding of the others."""
    rng = np.random.default_rng(rows * 100 + n)
    k = blocks * (256 if dtype.endswith("_k") else 32)
    w = raw_blocks(dtype, n, k, rng)
    dense = dequantized(dtype, w)
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    ref = x.double() @ dense.double().T + bias.double()
    tol = bound(x, dense, bias, dtype)
    kernels.set_num_threads(2)
    outs = {}
    for name in ISAS:
        with isa(name):
            outs[name] = run_linear(w, dtype, x, bias, n)
        assert ((outs[name].double() - ref).abs() <= tol).all(), name
    first = outs[ISAS[0]].double()
    slack = 1e-5 * (x.double().abs() @ dense.double().abs().T + bias.double().abs()) + 1e-6
    for name, y in outs.items():
        assert ((y.double() - first).abs() <= slack).all(), f"{name} vs {ISAS[0]}"


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(list(TYPES)), rows=st.integers(1, 40), n=st.integers(1, 70), blocks=st.integers(1, 3),
       has_bias=st.booleans(), accumulate=st.booleans(), threads=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_linear_is_within_the_bound_for_any_shape(
    dtype: str, rows: int, n: int, blocks: int, has_bias: bool, accumulate: bool, threads: int, seed: int
) -> None:
    """Any rows 1-40 (whole and ragged row tiles, both sides of the GEMM path's 16), N 1-70 (ragged pool chunks), several
    blocks, with or without a bias, writing or accumulating, 1-3 threads, every set."""
    rng = np.random.default_rng(seed)
    k = blocks * (256 if dtype.endswith("_k") else 32)
    w = raw_blocks(dtype, n, k, rng)
    dense = dequantized(dtype, w)
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32) * 3)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32)) if has_bias else None
    acc = torch.from_numpy(rng.standard_normal((rows, n)).astype(np.float32)) if accumulate else None
    ref = x.double() @ dense.double().T + (0.0 if bias is None else bias.double())
    ref = ref + (0.0 if acc is None else acc.double())
    tol = bound(x, dense, bias, dtype) + (0.0 if acc is None else 1e-6 * acc.double().abs())
    kernels.set_num_threads(threads)
    for name in ISAS:
        with isa(name):
            y = run_linear(w, dtype, x, bias, n, acc)
        assert ((y.double() - ref).abs() <= tol).all(), name


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from([t for t in TYPES if t != "f16"]), rows=st.integers(16, 37), n=st.integers(1, 50),
       blocks=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_many_rows_equal_one_row_at_a_time(dtype: str, rows: int, n: int, blocks: int, seed: int) -> None:
    """From 16 rows the 32-element types run (with any vector set) as a GEMM over weights repacked per 16
    columns: the same integer sums per scale group as one row at a time, so the rows agree to
    float32 rounding of the sums, under every set (ragged column groups and row tiles, several
    passes over k included)."""
    rng = np.random.default_rng(seed)
    deep = seed % 2 == 1  # k past the GEMM's 512 per pass
    k = 256 * (blocks + deep) if dtype.endswith("_k") else 32 * (blocks + 16 * deep)
    w = raw_blocks(dtype, n, k, rng)
    dense = dequantized(dtype, w)
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
    slack = 1e-5 * (x.double().abs() @ dense.double().abs().T) + 1e-6
    kernels.set_num_threads(2)
    for name in ISAS:
        with isa(name):
            together = run_linear(w, dtype, x, None, n)
            apart = torch.cat([run_linear(w, dtype, x[i : i + 1], None, n) for i in range(rows)])
        assert ((together.double() - apart.double()).abs() <= slack).all(), name


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 37), n=st.integers(1, 50), blocks=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_int8_weights_many_rows(rows: int, n: int, blocks: int, seed: int) -> None:
    """rtpcore's int8 weights (one scale per row): below INT8_QUANTIZED_ROWS rows and, with a vector
    set, from gemm_rows() rows on, over activations quantized per block of 32 (within that rounding's
    bound of the exact product, and the GEMM within float rounding of one row at a time); between
    the two, float32 activations (within float rounding of the exact product)."""
    rng = np.random.default_rng(seed)
    k = 32 * blocks
    q = torch.from_numpy(rng.integers(-127, 128, (n, k), dtype=np.int8))
    scale = torch.from_numpy(rng.uniform(1e-3, 2e-2, n).astype(np.float32))
    dense = q.double() * scale.double()[:, None]
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
    slack = 1e-5 * (x.double().abs() @ dense.abs().T) + 1e-6
    amax = x.double().abs().reshape(rows, blocks, 32).amax(-1)
    quantized_bound = amax @ dense.abs().reshape(n, blocks, 32).sum(-1).T / 254 + slack
    ref = x.double() @ dense.T
    kernels.set_num_threads(2)

    def run(xs: torch.Tensor) -> torch.Tensor:
        weights = kernels.LinearWeights(q.data_ptr(), "int8", scale.data_ptr(), 0, n, k)
        y = torch.full((xs.shape[0], n), float("nan"))
        kernels.linear(weights, xs.data_ptr(), xs.shape[0], y.data_ptr())
        return y

    for name in ISAS:
        with isa(name):
            gemm = kernels.gemm_rows()
            y = run(x)
            if rows < kernels.INT8_QUANTIZED_ROWS or (gemm and rows >= gemm):
                assert ((y.double() - ref).abs() <= quantized_bound).all(), name
                if gemm and rows >= gemm:
                    apart = torch.cat([run(x[i : i + 1]) for i in range(rows)])
                    assert ((y.double() - apart.double()).abs() <= slack).all(), name
            else:
                assert ((y.double() - ref).abs() <= slack).all(), name


def extreme_blocks(dtype: str, n: int, k: int) -> np.ndarray:
    """(n, row bytes): every weight integer at an end of its range (row n % 2 == 0: the largest
    unsigned integer the block stores, 127 for q8_0; odd rows: 0, -128 for q8_0), scales 1/128."""
    qtype = TYPES[dtype]
    size, nbytes = GGML_QUANT_SIZES[qtype]
    blocks = np.zeros((n, k // size, nbytes), dtype=np.uint8)
    high = np.arange(n) % 2 == 0
    half = np.array([1 / 128], dtype=np.float16).view(np.uint8)
    blocks[:, :, 0:2] = half
    if dtype == "q8_0":
        blocks[high, :, 2:] = 127
        blocks[~high, :, 2:] = 0x80  # -128
    else:
        ints = {"q4_0": 2, "q5_0": 6, "q5_1": 8}[dtype]
        blocks[high, :, ints:] = 0xFF  # nibbles 15 (and fifth bits set: 31)
        if dtype != "q4_0":
            blocks[high, :, ints - 4 : ints] = 0xFF  # qh
        if dtype == "q5_1":
            blocks[:, :, 2:4] = half  # the min
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0", "q5_0", "q5_1"])
@pytest.mark.parametrize("rows", [1, 5, 16, 37])
def test_integers_at_the_ends_of_their_ranges_do_not_saturate(dtype: str, rows: int) -> None:
    """Weight integers at the ends of their ranges against activations at +-127 (all of one sign,
    or alternating): the byte products' 16-bit partial sums (AVX2's, kept over several steps of
    the GEMM before they are widened) must not saturate. Within the bound of the dequantized
    product under every set, below and from the GEMM's 16 rows, over 8 blocks of k."""
    n, k = 34, 256
    w = extreme_blocks(dtype, n, k)
    dense = dequantized(dtype, w)
    signs = torch.ones(rows, k)
    signs[1::3] = -1.0
    signs[2::3, 1::2] = -1.0
    x = signs * torch.linspace(0.5, 2.0, rows)[:, None]
    ref = x.double() @ dense.double().T
    tol = bound(x, dense, None, dtype)
    kernels.set_num_threads(2)
    for name in ISAS:
        with isa(name):
            y = run_linear(w, dtype, x, None, n)
        assert ((y.double() - ref).abs() <= tol).all(), (name, (y.double() - ref).abs().max().item())


def test_every_vector_set_has_the_gemm() -> None:
    """Every vector kernel set multiplies many rows as a GEMM over repacked weights (VNNI's byte
    dot products or AVX2's); the portable baseline does not; GEMM_ROWS' sets are among them."""
    from rtpcore.checkpoint.gguf.linear import GEMM_SETS_AMD, VNNI_SETS

    for name in ISAS:
        with isa(name):
            assert (kernels.gemm_rows() > 0) == (name != "baseline"), name
    assert "baseline" not in VNNI_SETS + GEMM_SETS_AMD


def one_hot_blocks(dtype: str, k: int) -> np.ndarray:
    """(k, row bytes): row n has weight 1 at element n and 0 elsewhere (q8_0: d = 1, q = 1;
    q4_k: d = 1, dmin = 0, every scale 1, every min 0, nibble 1), so y[m, n] is activation
    row m's element n as the kernels quantized it, times its block's scale, exactly."""
    one = np.array([1.0], dtype=np.float16).view(np.uint8)
    if dtype == "q8_0":
        blocks = np.zeros((k, k // 32, 34), dtype=np.uint8)
        blocks[:, :, 0:2] = one
        for n in range(k):
            blocks[n, n // 32, 2 + n % 32] = 1
    else:  # q4_k
        blocks = np.zeros((k, k // 256, 144), dtype=np.uint8)
        blocks[:, :, 0:2] = one
        blocks[:, :, 4:8] = 1  # the 12 scale bytes from 4: bytes 0-3 hold scales 0-3, 4-7 mins 0-3,
        blocks[:, :, 12:16] = 1  # 8-11 scales 4-7 in their low nibbles and mins 4-7 in the high
        for n in range(k):
            j, at = n % 256 // 32, n % 32  # sub-block, element in it
            blocks[n, n // 256, 16 + 32 * (j // 2) + at] = 1 if j % 2 == 0 else 0x10
    return blocks.reshape(k, -1)


@pytest.mark.parametrize("dtype", ["q8_0", "q4_k"])
def test_every_instruction_set_quantizes_activations_as_llama_cpp_does(dtype: str) -> None:
    """The activations' int8 blocks, read back through one-hot weights, equal llama.cpp's AVX2
    quantize_row_q8_0 / q8_K: d = max|x_b| / 127, q = x * (127 / max|x_b|) rounded to nearest
    even, in float32 -- bit for bit, on every instruction set (vector and scalar code alike)."""
    block = block_size(dtype)
    k = 2 * block
    w = one_hot_blocks(dtype, k)
    assert torch.equal(dequantized(dtype, w), torch.eye(k))
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((5, k)) * rng.uniform(0.01, 100, (5, 1))).astype(np.float32)
    x[1, :block] = 0.0  # an all-zero block: d = 0, q = 0
    xb = x.reshape(5, 2, block)
    amax = np.abs(xb).max(-1, keepdims=True)
    d = amax / np.float32(127)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint(xb * inv), -127, 127).astype(np.float32)
    want = torch.from_numpy((q * d).reshape(5, k))
    kernels.set_num_threads(1)
    for name in ISAS:
        with isa(name):
            got = run_linear(w, dtype, torch.from_numpy(x), None, k)
        assert torch.equal(got, want), name


@pytest.mark.parametrize("dtype", list(TYPES))
def test_dequantize_rows_equals_the_gguf_package(dtype: str) -> None:
    """gguf_dequantize_rows gives exactly gguf.quants.dequantize's rows, in the order asked, on
    every instruction set, for a few rows (an embedding lookup) and for many (a weight for
    torch's GEMM, over the pool)."""
    rng = np.random.default_rng(7)
    n, k = 160, 512
    w = raw_blocks(dtype, n, k, rng)
    dense = dequantized(dtype, w)
    kernels.set_num_threads(2)
    for ids in (torch.tensor([3, 0, 11, 3, 7]), torch.from_numpy(rng.permutation(n))):
        for name in ISAS:
            out = torch.full((len(ids), k), float("nan"))
            with isa(name):
                kernels.gguf_dequantize_rows(dtype, w.ctypes.data, k, ids.data_ptr(), len(ids), out.data_ptr())
            assert torch.equal(out, dense[ids]), name


def test_row_bytes_and_dtypes_follow_the_gguf_package() -> None:
    assert kernels.gguf_dtypes() == list(TYPES)
    for dtype, qtype in TYPES.items():
        size, nbytes = GGML_QUANT_SIZES[qtype]
        for k in (256, 1024, 4096):
            assert kernels.gguf_row_bytes(dtype, k) == k // size * nbytes


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_a_width_that_is_no_whole_number_of_blocks_is_a_value_error(dtype: str) -> None:
    """K must be a multiple of 32 (256 for the K types): ValueError naming the type and K."""
    k = 288 if dtype.endswith("_k") else 48
    with pytest.raises(ValueError, match=f"{dtype} rows need a positive multiple of .*, got K={k}"):
        kernels.gguf_row_bytes(dtype, k)
    with pytest.raises(ValueError, match=f"{dtype} rows need a positive multiple of .*, got K={k}"):
        kernels.LinearWeights(1, dtype, 0, 0, 4, k)
    with pytest.raises(ValueError, match=r"GGUF dtype must be one of 'q8_0', .*, got 'q2_k'"):
        kernels.gguf_row_bytes("q2_k", 256)


# ---- the decode step

E, H, HKV, D, I_, V = 256, 4, 2, 64, 512, 96  # widths that are multiples of 256 where the K types need it
PARTS = {"q": "q4_k", "k": "q6_k", "v": "q8_0", "o": "q5_0", "gate": "q5_k", "up": "q4_0", "down": "q6_k"}
SHAPES = {"q": (H * D, E), "k": (HKV * D, E), "v": (HKV * D, E), "o": (E, H * D), "gate": (I_, E), "up": (I_, E),
          "down": (E, I_)}


def rope_tables(positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    freqs = torch.outer(torch.arange(positions).float(), inv)  # (P, D / 2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (P, D)
    return emb.cos().contiguous(), emb.sin().contiguous()


def greedy_logits(decoder: object, steps: int, batch: int, ids: torch.Tensor) -> list[torch.Tensor]:
    """Logits of `steps` decode steps of `batch` sequences fed the tokens ids (steps, batch),
    each sequence in its own two blocks of 4 slots of fresh float32 pools."""
    keep = []
    tpb, width = 4, 2
    for i in range(2):
        k = torch.zeros(batch * tpb * width, HKV, D)
        v = torch.zeros_like(k)
        keep += [k, v]
        decoder.set_pools(i, k.data_ptr(), v.data_ptr(), k.shape[0], "float32")  # type: ignore[attr-defined]
    cos, sin = rope_tables(tpb * width)
    tables = torch.arange(batch * width, dtype=torch.int64).reshape(batch, width)
    out = []
    for t in range(steps):
        step_ids = ids[t].contiguous()
        pos = torch.full((batch,), t, dtype=torch.int64)
        slots = tables[:, t // tpb] * tpb + t % tpb
        ctx = torch.full((batch,), t + 1, dtype=torch.int64)
        logits = torch.empty(batch, V)
        decoder.decode(batch, step_ids.data_ptr(), pos.data_ptr(), slots.data_ptr(),  # type: ignore[attr-defined]
                       tables.data_ptr(), width, ctx.data_ptr(), tpb, cos.data_ptr(), sin.data_ptr(), tpb * width,
                       logits.data_ptr())
        out.append(logits)
    return out


@pytest.mark.parametrize("name", ISAS)
def test_a_decoder_over_gguf_weights_matches_one_over_their_float32_dequantization(name: str) -> None:
    """Two layers whose projections have seven different GGUF types (set_layer_parts, as a
    Q4_K_M file mixes them), a Q4_K embedding and a Q8_0 head, decode 3 sequences for 6 steps
    with logits within 3% of the logits' range of the same decoder over the dequantized float32
    weights (fused, set_layer): the activations' 8-bit rounding, compounded over the layers."""
    rng = np.random.default_rng(11)
    keep: list[object] = []

    def weights(part: str) -> tuple[object, torch.Tensor]:
        dtype = PARTS.get(part, "q8_0")
        n, k = SHAPES.get(part, (V, E))
        w = raw_blocks(dtype, n, k, rng, rms=k**-0.5)  # activations stay about unit size through the layers
        dense = dequantized(dtype, w)
        keep.extend([w, dense])
        return kernels.LinearWeights(w.ctypes.data, dtype, 0, 0, n, k), dense

    def f32(t: torch.Tensor) -> object:
        t = t.contiguous()
        keep.append(t)
        return kernels.LinearWeights(t.data_ptr(), "float32", 0, 0, t.shape[0], t.shape[1])

    quant = kernels.LlamaDecoder(E, H, HKV, D, I_, V, 1e-5, 2)
    plain = kernels.LlamaDecoder(E, H, HKV, D, I_, V, 1e-5, 2)
    for i in range(2):
        q = {part: weights(part) for part in SHAPES}
        norm1 = torch.from_numpy(rng.uniform(0.5, 1.5, E).astype(np.float32))
        norm2 = torch.from_numpy(rng.uniform(0.5, 1.5, E).astype(np.float32))
        keep += [norm1, norm2]
        quant.set_layer_parts(i, norm1.data_ptr(), q["q"][0], q["k"][0], q["v"][0], q["o"][0], norm2.data_ptr(),
                              q["gate"][0], q["up"][0], q["down"][0], 0)
        plain.set_layer(i, norm1.data_ptr(), f32(torch.cat([q["q"][1], q["k"][1], q["v"][1]])), f32(q["o"][1]),
                        norm2.data_ptr(), f32(torch.cat([q["gate"][1], q["up"][1]])), f32(q["down"][1]), 0)
    embed = raw_blocks("q4_k", V, E, rng, rms=1.0)
    embed_dense = dequantized("q4_k", embed)
    head, head_dense = weights("head")
    norm = torch.ones(E)
    keep += [embed, embed_dense, norm]
    quant.set_head(embed.ctypes.data, V, "q4_k", norm.data_ptr(), head)
    plain.set_head(embed_dense.data_ptr(), V, "float32", norm.data_ptr(), f32(head_dense))
    ids = torch.from_numpy(rng.integers(0, V, (6, 3))).to(torch.int64)
    kernels.set_num_threads(2)
    with isa(name):
        got = greedy_logits(quant, 6, 3, ids)
    want = greedy_logits(plain, 6, 3, ids)
    for g, w in zip(got, want, strict=True):
        spread = float(w.max() - w.min())
        assert float((g - w).abs().max()) <= 0.03 * spread
        assert torch.corrcoef(torch.stack([g.flatten(), w.flatten()]))[0, 1] > 0.999


def test_the_decoder_refuses_a_gguf_embedding_of_the_wrong_width() -> None:
    decoder = kernels.LlamaDecoder(96, 2, 2, 48, 64, 8, 1e-5, 1)
    head = kernels.LinearWeights(1, "float32", 0, 0, 8, 96)
    with pytest.raises(ValueError, match="q4_k rows need a positive multiple of 256 elements, got K=96"):
        decoder.set_head(1, 8, "q4_k", 1, head)
    with pytest.raises(ValueError, match=r"embedding dtype must be 'float32', 'bfloat16', 'bfloat16_packed' or a GGUF type .*, got 'int4'"):
        decoder.set_head(1, 8, "int4", 1, head)

"""bf16 weights in rtpcore_native's blocked layout ("bfloat16_packed"), the kernels that multiply
them, and the ``Linear`` kernel and decode step that use them (rtpcore.models.layers, .native).

The contract (docs/design.md §6): on a CPU with bf16 dot products (AVX512-BF16, AMX-BF16) each
activation is rounded to bf16 once and the exact products are summed in float32; every other
instruction set widens the same weights to float32 against float32 activations. Each kernel is
held to its formula within float32 summation error (and, for bf16 outputs, one rounding step), on
every path this CPU runs; greedy tokens of a bf16 model equal transformers' bf16 tokens up to the
first bf16 near-tie; a bf16 model holds its weights once, in bf16.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")
kernels = pytest.importorskip("rtpcore_native._kernels")

from rtpcore import Engine  # noqa: E402
from rtpcore.models.bf16_blocked import BlockedRows  # noqa: E402
from rtpcore.models.layers import Linear, linear_kernels, native_bf16_dot, pack_bf16  # noqa: E402
from test_layers import assert_within_one_rounding  # noqa: E402
from test_llama import PROMPTS, make_checkpoint  # noqa: E402

ISAS = kernels.supported_isas()
DOT_ISAS = [isa for isa in ("amx", "avx512_bf16") if isa in ISAS]
NO_DOT = "this CPU (or ONEDNN_MAX_CPU_ISA) has no bf16 dot products (AVX512-BF16 or AMX-BF16)"
# The default kernels (what a Linear or an Engine picks with no override): the CPU's best set
# within ONEDNN_MAX_CPU_ISA, which may leave out bf16 dot products the CPU has.
DEFAULT_DOT = native_bf16_dot()
# The paths a product over bf16p weights can take here: (set, AMX from this many rows on or None).
PATHS = [(isa, rows) for isa in ISAS for rows in ((1, None) if isa == "amx" else (None,))]
PATH_IDS = [isa + ("-amx-every-row" if rows == 1 else "") for isa, rows in PATHS]
# Transformers' own two best bf16 logits within this many bf16 rounding steps (2^-8 of the
# larger) of each other: a step where two bf16 implementations may part (docs/design.md §6).
BF16_NEAR_TIE_STEPS = 4


@contextlib.contextmanager
def path(isa: str, amx_rows: int | None = None) -> Iterator[None]:
    """The named instruction set's kernels (and AMX from ``amx_rows`` rows on), then the defaults."""
    default_rows = kernels.amx_rows()
    kernels.set_isa(isa)
    if amx_rows is not None:
        kernels.set_amx_rows(amx_rows)
    try:
        yield
    finally:
        kernels.set_amx_rows(default_rows)
        kernels.set_isa(kernels.default_isa())


def packed_weights(w: torch.Tensor, b: torch.Tensor | None) -> tuple[Any, torch.Tensor]:
    packed = pack_bf16(w)
    lw = kernels.LinearWeights(packed.data_ptr(), "bfloat16_packed", 0, 0 if b is None else b.data_ptr(), *w.shape)
    return lw, packed


def test_the_blocked_layout_is_the_documented_formula() -> None:
    """packed[((n / 16) (Kp / 2) + p) 32 + (n % 16) 2 + e] = w[n][2p + e], zeros past (N, K)."""
    n, k = 37, 45
    w = torch.arange(1, n * k + 1, dtype=torch.float32).reshape(n, k).bfloat16()
    packed = pack_bf16(w)
    np_, kp = 48, 64
    assert packed.shape == (np_ // 16, kp // 2, 16, 2) and packed.is_contiguous()
    flat = packed.reshape(-1)
    for row, col in [(0, 0), (0, 1), (15, 44), (16, 2), (36, 33), (36, 44)]:
        at = ((row // 16) * (kp // 2) + col // 2) * 32 + (row % 16) * 2 + col % 2
        assert flat[at] == w[row, col]
    padding = torch.ones(np_, kp, dtype=torch.bool)
    padding[:n, :k] = False
    assert (packed.permute(0, 2, 1, 3).reshape(np_, kp)[padding] == 0).all()


@pytest.mark.parametrize(("isa", "amx_rows"), PATHS, ids=PATH_IDS)
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), out=st.integers(1, 70), inp=st.integers(1, 130), bias=st.booleans(),
       accumulate=st.booleans(), threads=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_products_equal_the_reference_formula_for_any_shape(
    isa: str, amx_rows: int | None, rows: int, out: int, inp: int, bias: bool, accumulate: bool, threads: int,
    seed: int,
) -> None:
    """y (+)= x @ W.T + b over bf16p weights: with bf16 dot products x is rounded to bf16 first,
    elsewhere it stays float32; the sum within float32 summation error of the float64 formula,
    for ragged shapes (K not a multiple of 32, N not of 16, rows 1-40), 1-3 threads."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inp, generator=gen)
    w = torch.randn(out, inp, generator=gen).bfloat16()
    b = torch.randn(out, generator=gen) if bias else None
    acc = torch.randn(rows, out, generator=gen)
    lw, _keep = packed_weights(w, b)
    kernels.set_num_threads(threads)
    with path(isa, amx_rows):
        y = acc.clone() if accumulate else torch.full((rows, out), float("nan"))
        kernels.linear(lw, x.data_ptr(), rows, y.data_ptr(), accumulate=accumulate)
        dot = kernels.bf16_dot()
    assert dot == (isa in DOT_ISAS)
    xr = (x.bfloat16() if dot else x).double()
    ref = xr @ w.double().T + (0.0 if b is None else b.double()) + (acc.double() if accumulate else 0.0)
    bound = 2 * (inp + 2) * 2.0**-24 * (xr.abs() @ w.double().abs().T + (acc.double().abs() if accumulate else 0.0)
                                        + (0.0 if b is None else b.double().abs()))
    assert ((y.double() - ref).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize(("isa", "amx_rows"), PATHS, ids=PATH_IDS)
@pytest.mark.parametrize(("rows", "out", "inp"), [(1, 2752, 512), (8, 512, 1376), (16, 70, 33), (40, 100, 130),
                                                  (512, 96, 64)])
def test_bf16_rows_in_and_out_are_one_rounding_of_f_linear(
    isa: str, amx_rows: int | None, rows: int, out: int, inp: int
) -> None:
    """linear_bf16 (Linear's product): bf16 in, bf16 out, within one rounding step of F.linear's,
    on model-sized shapes and ragged ones, the row counts of decode and of a prefill chunk."""
    gen = torch.Generator().manual_seed(rows + out)
    x = torch.randn(rows, inp, generator=gen).bfloat16()
    w = (torch.randn(out, inp, generator=gen) * 0.05).bfloat16()
    b = torch.randn(out, generator=gen)
    lw, _keep = packed_weights(w, b)
    kernels.set_num_threads(2)
    y = torch.full((rows, out), float("nan"), dtype=torch.bfloat16)
    with path(isa, amx_rows):
        kernels.linear_bf16(lw, x.data_ptr(), rows, y.data_ptr())
    assert_within_one_rounding(y, x, w, b.bfloat16())


def test_the_kernel_names_follow_the_set_and_the_row_count() -> None:
    with path("baseline"):
        assert kernels.bf16_kernel(1) == "widened to float32" and not kernels.bf16_dot()
    if "avx512_bf16" in ISAS:
        with path("avx512_bf16"):
            assert kernels.bf16_kernel(64) == "vdpbf16ps" and kernels.bf16_dot()
    if "amx" in ISAS:
        with path("amx", 4):
            assert (kernels.bf16_kernel(3), kernels.bf16_kernel(4)) == ("vdpbf16ps", "amx tiles")
    with pytest.raises(ValueError, match="amx rows must be >= 1, got 0"):
        kernels.set_amx_rows(0)
    w = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="linear_bf16 multiplies 'bfloat16_packed' weights, got 'float32'"):
        kernels.linear_bf16(kernels.LinearWeights(w.data_ptr(), "float32", 0, 0, 4, 4), w.data_ptr(), 1, w.data_ptr())


@pytest.mark.skipif(not DEFAULT_DOT, reason=NO_DOT)
def test_linear_keeps_one_bf16_copy_in_the_blocked_layout() -> None:
    """On a CPU with bf16 dot products a bf16 Linear is "native-bf16": its weight is the blocked
    layout (Np x Kp bf16: no float32 copy, no second bf16 copy), its output one rounding of
    F.linear's for inputs of any leading shape; fp32_batched_linear=True still asks for the float
    32 copy of the CPUs without bf16 dot products."""
    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(96, 64, generator=gen) * 0.1).bfloat16()
    b = torch.randn(96, generator=gen).bfloat16()
    layer = Linear(w.clone(), b.clone())
    assert layer.kernel == "native-bf16" and native_bf16_dot()
    assert layer.weight_fp32 is None and layer.weight.dtype == torch.bfloat16
    assert layer.weight.untyped_storage().nbytes() == w.numel() * 2
    assert "kernel=native-bf16" in repr(layer)
    x = torch.randn(2, 5, 64, generator=gen).bfloat16()
    got = layer(x)
    assert got.shape == (2, 5, 96) and got.dtype == torch.bfloat16
    assert_within_one_rounding(got, x, w, b)
    assert layer(x[:0]).shape == (0, 5, 96)
    with linear_kernels(batched_fp32=False):
        assert Linear(w.clone()).kernel == "native-bf16"
    with linear_kernels(batched_fp32=True):
        assert Linear(w.clone()).kernel == "packed+fp32"


def greedy_until_bf16_near_tie(model: Any, prompt: list[int], got: list[int]) -> int:
    """How many of ``got`` equal transformers' bf16 greedy tokens before the first step where
    transformers' two best logits (teacher-forced on ``got``) are within BF16_NEAR_TIE_STEPS bf16
    rounding steps; fails on a difference that is no such near-tie."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + got])).logits[0, len(prompt) - 1: -1].float()  # (n, V)
    for i, row in enumerate(logits):
        top2 = row.topk(2).values
        if int(row.argmax()) != got[i]:
            tie = BF16_NEAR_TIE_STEPS * 2.0**-8 * float(top2[0].abs())
            assert float(top2[0] - top2[1]) <= tie, (
                f"token {i}: transformers picks {int(row.argmax())} by {float(top2[0] - row[got[i]]):.3g} over "
                f"our {got[i]}, not a bf16 near-tie (<= {tie:.3g})")
            return i
    return len(got)


@pytest.mark.slow
@pytest.mark.skipif(not DOT_ISAS, reason=NO_DOT)
@pytest.mark.parametrize("isa", DOT_ISAS)
@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias", "mistral-window", "llama-tied"])
def test_bf16_greedy_tokens_equal_transformers_up_to_a_bf16_near_tie(tmp_path: Path, variant: str, isa: str) -> None:
    """A bf16 model on the bf16 kernels (Linear "native-bf16" for prefill, the native decode step
    for decode): greedy tokens of ragged batched prompts equal transformers' bf16 greedy tokens
    up to the first bf16 near-tie (on these tiny random models, often within the first tokens:
    bf16 logits tie easily)."""
    hf = make_checkpoint(tmp_path, variant).to(torch.bfloat16)
    with path(isa), Engine.from_pretrained(tmp_path, dtype="bfloat16", max_batch_size=4) as engine:
        got = engine.generate(PROMPTS, max_new_tokens=32, stop_token_ids=[])
        assert engine.model.decode_kernel == "native"
        assert {m.kernel for m in engine.model.modules() if isinstance(m, Linear)} == {"native-bf16"}
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        assert len(set(tokens)) >= 8, f"degenerate output, the test would prove little: {tokens}"
        greedy_until_bf16_near_tie(hf, prompt, tokens)


@pytest.mark.skipif(not DEFAULT_DOT, reason=NO_DOT)
@pytest.mark.parametrize("variant", ["llama-gqa", "llama-tied"])
def test_a_bf16_model_holds_its_weights_once_in_bf16(tmp_path: Path, variant: str) -> None:
    """Every storage a bf16 model (and its native decode step) holds adds up to its checkpoint's
    bf16 bytes, within the float32 norms the decode step keeps: no float32 copy of a weight, no
    second bf16 copy (the tied head's blocked layout is the embedding's one copy). Widths here are
    multiples of 32, so the blocked layout adds no padding."""
    make_checkpoint(tmp_path, variant, hidden_size=128, intermediate_size=256, vocab_size=256)
    with Engine.from_pretrained(tmp_path, dtype="bfloat16", max_batch_size=2) as engine:
        engine.generate([[1, 2, 3]], max_new_tokens=3, stop_token_ids=[])
        model = engine.model
        assert model.decode_kernel == "native"
        storages: dict[int, tuple[int, torch.dtype]] = {}
        for t in [*model.parameters(), *model.buffers()]:
            t = t.packed if isinstance(t, BlockedRows) else t  # a tied embedding: the head's blocks
            storages[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), t.dtype)
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(tmp_path)
        e, i, v, layers = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
        kv = cfg.num_key_value_heads * (e // cfg.num_attention_heads)
        linear = layers * (e * (e + 2 * kv) + e * e + 3 * e * i) + (0 if cfg.tie_word_embeddings else v * e)
        weights = 2 * (linear + v * e)  # bf16 bytes of every matrix, the embedding once
        fp32 = [n for n, d in storages.values() if d == torch.float32]
        assert max(fp32, default=0) < 4 * v  # nothing of a weight's size in float32 (RoPE tables, norms)
        held = sum(n for n, d in storages.values() if d == torch.bfloat16)
        norms_and_rope = 2 * (layers * 2 * e + e) + 2 * 2 * model.cos.numel()
        assert held == weights + norms_and_rope


@pytest.mark.skipif(not DOT_ISAS, reason=NO_DOT)
@pytest.mark.parametrize(("variant", "kv"), [("llama-gqa", "auto"), ("qwen2-bias", "auto"), ("llama-tied", "fp32")])
def test_bf16_logits_stay_within_bf16_rounding_of_transformers(tmp_path: Path, variant: str, kv: str) -> None:
    """Teacher-forced ragged prefill (Linear "native-bf16") then native decode steps over bf16
    (or fp32) pools: logits within 5% of the logits' range of transformers' bf16 model."""
    from test_llama import teacher_forced_logits

    hf = make_checkpoint(tmp_path, variant).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (40, 31, 20)]
    engine = Engine.from_pretrained(tmp_path, dtype="bfloat16", kv_cache_dtype=kv, tokens_per_block=4)
    ours = teacher_forced_logits(engine.model, engine.kv_caches, seqs, prefill=[13, 7, 20])
    assert engine.model.decode_kernel == "native" and engine.model._native.steps > 0
    for s, got, n in zip(seqs, ours, [13, 7, 20], strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([s])).logits[0, n - 1:].float()
        assert got.dtype == torch.bfloat16
        assert (got.float() - ref).abs().max().item() <= 0.05 * float(ref.abs().max())


def test_a_tied_embedding_looks_its_rows_up_in_the_head_blocks() -> None:
    """BlockedRows: F.embedding gathers rows from the blocks (any id shape), detach keeps it, any
    other operation runs on the unpacked table."""
    gen = torch.Generator().manual_seed(5)
    table = torch.randn(37, 45, generator=gen).bfloat16()
    rows = BlockedRows(pack_bf16(table), 37, 45)
    assert rows.shape == (37, 45) and rows.dtype == torch.bfloat16
    ids = torch.tensor([[0, 36, 15], [16, 17, 5]])
    assert torch.equal(F.embedding(ids, rows), table[ids])
    assert isinstance(torch.nn.Parameter(rows, requires_grad=False), BlockedRows)
    assert torch.equal(rows * 2, table * 2)
    with pytest.raises(ValueError, match=r"BlockedRows reads a pack_bf16 layout .* got torch.float32 \(37, 45\)"):
        BlockedRows(table.float(), 37, 45)


def test_onednn_max_cpu_isa_caps_the_bf16_kernels_too(tmp_path: Path) -> None:
    """ONEDNN_MAX_CPU_ISA as oneDNN reads it: AVX512_CORE_BF16 keeps AVX512-BF16 without AMX, and
    AVX512_CORE_VNNI none of the bf16 dot products -- a bf16 Linear then keeps the float32 copy of
    the CPUs without them (fresh processes, the choice is made at import)."""
    code = (
        "import json, torch, rtpcore_native._kernels as k\n"
        "from rtpcore.models.layers import Linear\n"
        "print(json.dumps([k.isa(), Linear(torch.zeros(16, 32, dtype=torch.bfloat16)).kernel]))\n"
    )
    cases = [("AVX512_CORE_VNNI", "avx512_vnni", "packed+fp32"), ("AVX512_CORE_BF16", "avx512_bf16", "native-bf16"),
             ("AVX512_CORE_AMX", "amx", "native-bf16")]
    for cap, isa, kernel in cases:
        if isa not in ISAS:
            continue
        env = {**os.environ, "ONEDNN_MAX_CPU_ISA": cap}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert json.loads(out.stdout.strip().splitlines()[-1]) == [isa, kernel], cap

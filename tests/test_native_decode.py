"""The native CPU decode step (rtpcore.models.native, rtpcore_native._kernels).

The contract (docs/design.md §6): decode logits within float32 rounding of transformers' and
greedy tokens equal to transformers' up to the first near-tie (two logits within
NEAR_TIE of each other at the step where the tokens part). Every kernel variant this CPU can
run is checked against torch on the same operands; the instruction-set cap is checked in a
fresh process, as a CPU without AVX-512 would run it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")
kernels = pytest.importorskip("rtpcore_native._kernels")

from cpu_isas import kernel_sets_under_test  # noqa: E402
from rtpcore import Engine  # noqa: E402
from rtpcore.models.forward_batch import ForwardBatch  # noqa: E402
from rtpcore.models.layers import Linear, weight_quantization  # noqa: E402
from test_llama import PROMPTS, VARIANTS, hf_greedy, make_checkpoint, teacher_forced_logits  # noqa: E402

NEAR_TIE = 1e-3  # logit units: float32 rounding moves these tiny models' logits by about 1e-6
ISAS = kernel_sets_under_test(kernels)


@pytest.fixture
def isa(request: pytest.FixtureRequest) -> Any:
    """Runs the test with one instruction set's kernels, then restores the default."""
    kernels.set_isa(request.param)
    yield request.param
    kernels.set_isa(kernels.default_isa())


def greedy_until_near_tie(model: Any, prompt: list[int], got: list[int]) -> int:
    """How many of ``got`` equal transformers' greedy tokens before the first position where
    transformers' own best two logits are within NEAR_TIE (teacher-forced on ``got``); fails
    on a difference that is not such a near-tie."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + got])).logits[0, len(prompt) - 1 : -1]  # (n, V)
    for i, row in enumerate(logits):
        top2 = row.topk(2).values
        if int(row.argmax()) != got[i]:
            assert float(top2[0] - top2[1]) <= NEAR_TIE, (
                f"token {i}: transformers picks {int(row.argmax())} by {float(top2[0] - row[got[i]]):.3g} "
                f"over our {got[i]}, not a near-tie")
            return i
    return len(got)


def int8_bound(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The native int8 product's distance from x @ (q * scale).T, (rows, out) float64: float32
    rounding (1e-5 of |x| @ |W|.T), plus, where the kernel quantizes the activations (fewer than
    INT8_QUANTIZED_ROWS rows or from gemm_rows() rows on (0: never), and in_features a multiple
    of 32, as llama.cpp's Q8_0 product does), their rounding to int8 per block of 32 values: each
    moves by at most max|x_b| / 254, so scale_n * sum_b max|x_b| * sum_{i in b} |q_ni| / 254."""
    rows, inp = x.shape
    dense = q.double().abs() * scale.double()[:, None]
    bound = 1e-5 * (x.double().abs() @ dense.T) + 1e-5
    gemm = kernels.gemm_rows()
    if (rows < kernels.INT8_QUANTIZED_ROWS or (gemm and rows >= gemm)) and inp % 32 == 0:
        amax = x.double().abs().reshape(rows, inp // 32, 32).amax(-1)  # (rows, blocks)
        wsum = dense.reshape(q.shape[0], inp // 32, 32).sum(-1)  # (out, blocks)
        bound = bound + amax @ wsum.T / 254
    return bound


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize(("rows", "out", "inp"), [(1, 96, 64), (3, 577, 33), (8, 40, 1536), (5, 13, 7), (17, 130, 100),
                                                  (38, 23, 200), (40, 50, 64), (64, 16, 256), (70, 37, 300),
                                                  (131, 129, 600)])
def test_linear_matches_torch_for_float32_and_int8_weights(isa: str, rows: int, out: int, inp: int) -> None:
    """Every tile shape and tail (rows not a multiple of the tile, in_features not a multiple
    of the vector width, outputs not a multiple of the tile's weight rows, a row count above the
    pool's split size) against F.linear, and from the float GEMM's row count on (40 with AVX2, 64
    with AVX-512 and the baseline: outputs not a multiple of its panel, inputs across its blocks of
    256 and of its 8 x 8 packing);
    int8 within int8_bound (its activations quantized at few rows, float32 at more, quantized
    again from gemm_rows() rows on: (40, 50, 64))."""
    gen = torch.Generator().manual_seed(rows * 1000 + out)
    x, w, bias = torch.randn(rows, inp, generator=gen), torch.randn(out, inp, generator=gen), torch.randn(out, generator=gen)
    kernels.set_num_threads(2)
    y = torch.full((rows, out), float("nan"))
    kernels.linear(kernels.LinearWeights(w.data_ptr(), "float32", 0, bias.data_ptr(), out, inp), x.data_ptr(), rows, y.data_ptr())
    torch.testing.assert_close(y, F.linear(x, w, bias), rtol=1e-5, atol=1e-5 * inp**0.5)
    q = torch.randint(-127, 128, (out, inp), dtype=torch.int8, generator=gen)
    scale = torch.rand(out, generator=gen) + 0.01
    acc = torch.randn(rows, out, generator=gen)
    y = acc.clone()
    weights = kernels.LinearWeights(q.data_ptr(), "int8", scale.data_ptr(), 0, out, inp)
    kernels.linear(weights, x.data_ptr(), rows, y.data_ptr(), accumulate=True)
    ref = acc.double() + x.double() @ (q.double() * scale.double()[:, None]).T
    assert ((y.double() - ref).abs() <= int8_bound(x, q, scale) + 1e-6 * acc.double().abs()).all()
    wb = w.to(torch.bfloat16)
    y = torch.full((rows, out), float("nan"))
    kernels.linear(kernels.LinearWeights(wb.data_ptr(), "bfloat16", 0, 0, out, inp), x.data_ptr(), rows, y.data_ptr())
    torch.testing.assert_close(y, F.linear(x, wb.float()), rtol=1e-5, atol=1e-5 * inp**0.5)


@settings(max_examples=60, deadline=None)
@given(rows=st.one_of(st.integers(1, 12), st.integers(30, 80)), out=st.integers(1, 80), inp=st.integers(1, 300),
       dtype=st.sampled_from(["float32", "int8", "bfloat16"]), bias=st.booleans(), threads=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_linear_equals_the_reference_formula_for_any_shape(
    rows: int, out: int, inp: int, dtype: str, bias: bool, threads: int, seed: int
) -> None:
    """y = x @ (W * scale).T + bias, summed in float64 as the reference, for any shape and
    weight dtype, with 1-3 pool threads and the instruction set chosen at import (int8 within
    int8_bound: in_features 32 and 64 take the quantized-activation kernel); 30-80 rows cross
    into the float GEMM (40 rows on with AVX2, 64 with AVX-512)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inp, generator=gen)
    int8 = dtype == "int8"
    w = torch.randint(-127, 128, (out, inp), dtype=torch.int8, generator=gen) if int8 else torch.randn(out, inp, generator=gen)
    if dtype == "bfloat16":
        w = w.to(torch.bfloat16)
    scale = torch.rand(out, generator=gen) + 0.01
    b = torch.randn(out, generator=gen) if bias else None
    kernels.set_num_threads(threads)
    y = torch.full((rows, out), float("nan"))
    weights = kernels.LinearWeights(w.data_ptr(), dtype, scale.data_ptr() if int8 else 0,
                                    0 if b is None else b.data_ptr(), out, inp)
    kernels.linear(weights, x.data_ptr(), rows, y.data_ptr())
    dense = w.double() * (scale.double()[:, None] if int8 else 1.0)
    ref = x.double() @ dense.T + (0.0 if b is None else b.double())
    bound = int8_bound(x, w, scale) if int8 else 1e-5 * (x.double().abs() @ dense.abs().T + 1.0)
    assert ((y.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize(("rows", "heads", "head_dim", "width"), [(1, 3, 8, 24), (5, 4, 18, 75), (300, 12, 64, 800)])
def test_row_kernels_match_the_torch_modules_operations(isa: str, rows: int, heads: int, head_dim: int,
                                                         width: int) -> None:
    """rms_norm_rows, rope_rows and silu_mul_rows (a multi-token float32 step's element-wise work,
    LlamaLayer's row path) against llama_modules' torch functions: widths that are no multiple of
    the vector width, a RoPE row stride wider than its heads (q and k lead a qkv row, v follows
    untouched), positions out of order, and (300 rows) calls split over the pool."""
    from rtpcore.models.llama_modules import rms_norm, rotate

    gen = torch.Generator().manual_seed(rows + width)
    kernels.set_num_threads(2)
    x, w = torch.randn(rows, width, generator=gen), torch.rand(width, generator=gen) + 0.5
    out = torch.full_like(x, float("nan"))
    kernels.rms_norm_rows(x.data_ptr(), rows, width, w.data_ptr(), 1e-6, out.data_ptr())
    torch.testing.assert_close(out, rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-6)
    stride = heads * head_dim + 7  # 7 values after the rotated heads, left as they are
    qkv = torch.randn(rows, stride, generator=gen)
    table = torch.randn(2 * rows + 3, head_dim, generator=gen)
    cos, sin = table.cos().contiguous(), table.sin().contiguous()
    positions = torch.randperm(2 * rows + 3, generator=gen)[:rows]
    want = qkv.clone()
    want[:, : heads * head_dim] = rotate(qkv[:, : heads * head_dim].view(rows, heads, head_dim),
                                         cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)).reshape(rows, -1)
    kernels.rope_rows(qkv.data_ptr(), rows, stride, heads, head_dim, cos.data_ptr(), sin.data_ptr(), cos.shape[0],
                      positions.data_ptr())
    torch.testing.assert_close(qkv, want, rtol=1e-5, atol=1e-6)
    gate_up = torch.randn(rows, 2 * width, generator=gen) * 4
    act = torch.full((rows, width), float("nan"))
    kernels.silu_mul_rows(gate_up.data_ptr(), rows, width, act.data_ptr())
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(act, F.silu(gate) * up, rtol=1e-5, atol=1e-5)


def test_row_kernels_reject_a_position_outside_the_table_and_bad_shapes() -> None:
    x, table = torch.zeros(2, 16), torch.zeros(4, 8)
    positions = torch.tensor([1, 4])
    with pytest.raises(IndexError, match="row 1: position 4 outside the RoPE table's 4 rows"):
        kernels.rope_rows(x.data_ptr(), 2, 16, 2, 8, table.data_ptr(), table.data_ptr(), 4, positions.data_ptr())
    with pytest.raises(ValueError, match="an even head dim"):
        kernels.rope_rows(x.data_ptr(), 2, 16, 2, 7, table.data_ptr(), table.data_ptr(), 4, positions.data_ptr())
    with pytest.raises(ValueError, match=r"rms_norm_rows: rows and width must be positive, got \(0, 16\)"):
        kernels.rms_norm_rows(x.data_ptr(), 0, 16, x.data_ptr(), 1e-6, x.data_ptr())
    with pytest.raises(ValueError, match=r"silu_mul_rows: rows and width must be positive"):
        kernels.silu_mul_rows(x.data_ptr(), 2, 0, x.data_ptr())


@pytest.mark.parametrize(("options", "row_kernels"), [({}, True), ({"native_decode": False}, False),
                                                      ({"dtype": "bfloat16"}, False)])
def test_multi_token_steps_run_the_row_kernels_only_on_the_native_float32_path(
    tmp_path: Path, options: dict[str, Any], row_kernels: bool
) -> None:
    """A prefill of a float32 model whose native_decode is on takes the row kernels (and stays
    within float32 rounding of transformers: test_native_decode_logits_match_transformers); with
    native_decode=False (the torch modules, bit-identical to transformers) or a bf16 model, it
    does not."""
    make_checkpoint(tmp_path)
    with Engine.from_pretrained(tmp_path, **options) as engine:
        model = engine.model
        x = torch.nn.functional.embedding(torch.tensor(PROMPTS[1]), model.embed)  # a 14-token prompt's rows
        assert (model._row_ops(x, torch.arange(len(PROMPTS[1]))) is not None) == row_kernels
        got = engine.generate([PROMPTS[1]], max_new_tokens=4, stop_token_ids=[])
    with Engine.from_pretrained(tmp_path, native_decode=False, **{k: v for k, v in options.items()
                                                                  if k != "native_decode"}) as ref:
        assert ref.generate([PROMPTS[1]], max_new_tokens=4, stop_token_ids=[]) == got


def test_a_float32_steps_products_run_in_the_native_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """RowOps.linear (the products of LlamaLayer's row path) multiplies a "plain" float32 Linear in
    rtpcore_native (the residual added into a copy of it), within float32 rounding of the layer's
    own forward, and every other layer (a bf16 weight, a transposed view) through its forward."""
    from rtpcore.models.llama_modules import RowOps

    gen = torch.Generator().manual_seed(5)
    w, b = torch.randn(70, 300, generator=gen), torch.randn(70, generator=gen)
    layer = Linear(w, b)
    assert layer.kernel == "plain" and layer._native_float32() is not None
    assert Linear(torch.randn(300, 70, generator=gen).t())._native_float32() is None  # not contiguous
    assert Linear(w.bfloat16())._native_float32() is None
    ops = RowOps(kernels, torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, dtype=torch.int64))
    native_calls = []
    real = kernels.linear
    monkeypatch.setattr(ops, "kernels", type("K", (), {"linear": staticmethod(
        lambda *a, **k: native_calls.append(a[2]) or real(*a, **k))}))
    for rows in (3, 64, 100):  # the tile kernel, then the GEMM
        x, res = torch.randn(rows, 300, generator=gen), torch.randn(rows, 70, generator=gen)
        torch.testing.assert_close(ops.linear(layer, x), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
        got = ops.linear(layer, x, residual=res)
        torch.testing.assert_close(got, res + F.linear(x, w, b), rtol=1e-5, atol=1e-4)
        assert res.data_ptr() != got.data_ptr()  # the residual itself is left as it was
    assert native_calls == [3, 3, 64, 64, 100, 100]
    half = Linear(w.bfloat16())
    x = torch.randn(4, 300, generator=gen)
    assert torch.equal(ops.linear(half, x.bfloat16()), half(x.bfloat16())) and len(native_calls) == 6


def test_stubs_match_the_kernels_extension() -> None:
    """_kernels.pyi agrees with the compiled module (mypy.stubtest)."""
    out = subprocess.run([sys.executable, "-m", "mypy.stubtest", "rtpcore_native._kernels"],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_bad_arguments_are_value_errors_naming_them() -> None:
    with pytest.raises(ValueError, match="unknown instruction set 'sse9'"):
        kernels.set_isa("sse9")
    with pytest.raises(ValueError, match="threads must be >= 1, got 0"):
        kernels.set_num_threads(0)
    with pytest.raises(ValueError, match="an int8 linear needs its per-row scales"):
        kernels.LinearWeights(1, "int8", 0, 0, 4, 4)
    with pytest.raises(ValueError, match=r"weight dtype must be 'float32', 'int8', 'bfloat16', 'bfloat16_packed' or a GGUF type .*, got 'fp4'"):
        kernels.LinearWeights(1, "fp4", 0, 0, 4, 4)
    with pytest.raises(ValueError, match=r"heads \(6\) must be a multiple of kv_heads \(4\)"):
        kernels.LlamaDecoder(8, 6, 4, 8, 16, 32, 1e-5, 1)


def test_int8_layers_use_the_native_kernel_for_float32_inputs() -> None:
    """The native product and torch's int8-weight kernel agree on the same quantized layer."""
    gen = torch.Generator().manual_seed(3)
    with weight_quantization("int8"):
        layer = Linear(torch.randn(70, 48, generator=gen), torch.randn(70, generator=gen))
    x = torch.randn(2, 3, 48, generator=gen)
    y = layer(x)
    ref = torch._weight_int8pack_mm(x.reshape(6, 48), layer.weight, layer.scales).reshape(2, 3, 70) + layer.bias
    assert layer._native_weights is not None
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_native_decode_logits_match_transformers(tmp_path: Path, variant: str) -> None:
    """Teacher-forced ragged prefill, then one-token decode steps that the native step serves:
    every logit within 1e-4 of transformers' (as the torch modules are held to)."""
    hf = make_checkpoint(tmp_path, variant)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (40, 31, 20)]
    engine = Engine.from_pretrained(tmp_path, tokens_per_block=4)
    ours = teacher_forced_logits(engine.model, engine.kv_caches, seqs, prefill=[13, 7, 20])
    assert engine.model.decode_kernel == "native" and engine.model._native.steps > 0
    for s, got, n in zip(seqs, ours, [13, 7, 20], strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([s])).logits[0, n - 1 :]
        assert (got - ref).abs().max().item() <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize(("variant", "kv"), [("llama-gqa", "auto"), ("qwen2-bias", "auto"), ("mistral-window", "fp32")])
def test_native_decode_of_a_bfloat16_model_is_within_its_rounding(tmp_path: Path, variant: str, kv: str) -> None:
    """A bf16 model whose linear layers keep float32 copies (fp32_batched_linear=True, as on CPUs
    without bf16 dot products) decodes natively over bf16 (or fp32) pools; its logits stay
    within 5% of the logits' range of transformers' bf16 model, as the torch modules' do."""
    hf = make_checkpoint(tmp_path, variant).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (40, 31, 20)]
    engine = Engine.from_pretrained(tmp_path, dtype="bfloat16", kv_cache_dtype=kv, tokens_per_block=4,
                                    fp32_batched_linear=True)
    ours = teacher_forced_logits(engine.model, engine.kv_caches, seqs, prefill=[13, 7, 20])
    assert engine.model.decode_kernel == "native" and engine.model._native.steps > 0
    for s, got, n in zip(seqs, ours, [13, 7, 20], strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([s])).logits[0, n - 1 :].float()
        assert got.dtype == torch.bfloat16
        assert (got.float() - ref).abs().max().item() <= 0.05 * float(ref.abs().max())


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["llama-gqa", "mistral-window", "qwen2-bias", "llama-tied"])
def test_native_greedy_tokens_equal_transformers_up_to_a_near_tie(tmp_path: Path, variant: str) -> None:
    """Batched greedy decoding of ragged prompts (a 12-token window shorter than the outputs
    in mistral-window): tokens equal transformers' up to the first near-tie, and here there is
    none, so all 48 of every prompt."""
    hf = make_checkpoint(tmp_path, variant)
    with Engine.from_pretrained(tmp_path, max_batch_size=4) as engine:
        got = engine.generate(PROMPTS, max_new_tokens=48, stop_token_ids=[])
        assert engine.model.decode_kernel == "native"
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        assert len(set(tokens)) >= 8, f"degenerate output, the test would prove little: {tokens}"
        assert greedy_until_near_tie(hf, prompt, tokens) == 48
        assert tokens == hf_greedy(hf, prompt, 48)


def test_native_decode_false_keeps_the_torch_modules_and_both_agree(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "llama-bias")
    with Engine.from_pretrained(tmp_path, native_decode=False) as torch_engine:
        want = torch_engine.generate(PROMPTS, max_new_tokens=20, stop_token_ids=[])
        assert torch_engine.model.decode_kernel == "torch"
    with Engine.from_pretrained(tmp_path) as native_engine:
        assert native_engine.generate(PROMPTS, max_new_tokens=20, stop_token_ids=[]) == want
        assert native_engine.model.decode_kernel == "native"


@pytest.mark.parametrize(("options", "reason"), [
    ({"dtype": "float16"}, "computes in torch.float16"),
    ({"kv_cache_dtype": "fp8"}, "KV pool is PackedLayerKVCache"),
    ({"native_decode": False}, "native_decode is False"),
])
def test_steps_the_native_decode_cannot_serve_run_torch_and_say_why(
    tmp_path: Path, options: dict[str, Any], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    make_checkpoint(tmp_path)
    with caplog.at_level("INFO", logger="rtpcore.models.llama_modules"), \
            Engine.from_pretrained(tmp_path, **options) as engine:
        engine.generate([PROMPTS[0]], max_new_tokens=3, stop_token_ids=[])
        assert engine.model.decode_kernel == "torch"
    assert reason in caplog.text


def test_native_decode_rejects_an_index_outside_its_tables(tmp_path: Path) -> None:
    """A token id past the embedding, a slot past the pools and a block past them raise
    IndexError naming the sequence, instead of reading or writing out of bounds."""
    make_checkpoint(tmp_path)
    engine = Engine.from_pretrained(tmp_path, tokens_per_block=4)
    slots = engine.kv_caches[0].k.shape[0]

    def step(ids: int, slot: int, block: int) -> None:
        batch = ForwardBatch(
            input_ids=torch.tensor([ids]), positions=torch.tensor([2]), slots=torch.tensor([slot]),
            query_lens=(1,), context_lens=torch.tensor([3]), block_tables=torch.tensor([[block]]), tokens_per_block=4,
        )
        with torch.inference_mode():
            engine.model(batch, engine.kv_caches)

    step(5, 2, 0)
    assert engine.model.decode_kernel == "native"
    with pytest.raises(IndexError, match="sequence 0: token id 128 outside the embedding's 128 rows"):
        step(128, 2, 0)
    with pytest.raises(IndexError, match=f"sequence 0: slot {slots} outside"):
        step(5, slots, 0)
    with pytest.raises(IndexError, match="sequence 0: block -1 outside the KV pools"):
        step(5, 2, -1)


def test_the_instruction_set_honours_onednn_max_cpu_isa(tmp_path: Path) -> None:
    """ONEDNN_MAX_CPU_ISA=AVX2 makes a fresh process use the AVX2 kernels (as on a CPU without
    AVX-512) and the same greedy tokens as transformers; SSE41 the baseline."""
    hf = make_checkpoint(tmp_path, "llama-gqa")
    code = (
        "import json, sys, rtpcore_native._kernels as k\n"
        "from rtpcore import Engine\n"
        "with Engine.from_pretrained(sys.argv[1]) as e:\n"
        "    out = e.generate([[5, 9, 33, 7, 81]], max_new_tokens=24, stop_token_ids=[])[0]\n"
        "    print(json.dumps({'isa': k.isa(), 'kernel': e.model.decode_kernel, 'tokens': out}))\n"
    )
    want = hf_greedy(hf, [5, 9, 33, 7, 81], 24)
    for cap, isa in (("AVX2", "avx2"), ("SSE41", "baseline")):
        if isa not in ISAS:
            continue
        env = {**os.environ, "ONEDNN_MAX_CPU_ISA": cap}
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True, check=True)
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got == {"isa": isa, "kernel": "native", "tokens": want}


def test_the_kernels_share_torchs_openmp_runtime() -> None:
    """Built with OpenMP, the kernels' parallel regions run on torch's OpenMP threads: in a fresh
    process, importing the extension after torch maps no OpenMP runtime besides torch's (a second
    one would bring a second set of threads competing for the same cores); RTPCORE_NATIVE_POOL=
    threads gives the extension's own threads instead."""
    if not Path("/proc/self/maps").is_file():
        pytest.skip("needs /proc/self/maps")
    code = (
        "import json, torch\n"
        "def gomp():\n"
        "    return sorted({l.split()[-1] for l in open('/proc/self/maps') if 'gomp' in l})\n"
        "torch.set_num_threads(2); torch.ones(4096).sum()\n"
        "before = gomp()\n"
        "import rtpcore_native._kernels as k\n"
        "print(json.dumps({'before': before, 'after': gomp(), 'pool': k.pool_kind()}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["after"] == got["before"], got
    assert got["pool"] == kernels.pool_kind()
    env = {**os.environ, "RTPCORE_NATIVE_POOL": "threads"}
    out = subprocess.run([sys.executable, "-c", "import rtpcore_native._kernels as k; print(k.pool_kind())"],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "threads"


def test_a_forked_child_runs_the_kernels_on_a_pool_of_its_own() -> None:
    """The parent's pool does not survive fork (its threads, the extension's or OpenMP's, are
    gone in the child: libgomp's first region there would hang); the child runs the kernels on
    threads of its own and computes the same product. The child runs the native kernel only:
    torch's own OpenMP pool is not fork-safe."""
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(2, 256, generator=gen), torch.randn(4096, 256, generator=gen)
    weights = kernels.LinearWeights(w.data_ptr(), "float32", 0, 0, 4096, 256)
    kernels.set_num_threads(2)
    want = torch.empty(2, 4096)
    kernels.linear(weights, x.data_ptr(), 2, want.data_ptr())  # the pool starts here
    y = torch.zeros(2, 4096)
    read, write = os.pipe()
    with warnings.catch_warnings():  # Python 3.12+ warns about fork in a threaded process: the point here
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            kernels.linear(weights, x.data_ptr(), 2, y.data_ptr())
            os.write(write, kernels.pool_kind().encode().ljust(8) + y.numpy().tobytes())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    assert data[:8].strip() == b"threads"
    got = torch.frombuffer(bytearray(data[8:]), dtype=torch.float32).reshape(2, 4096) if data else None
    assert got is not None and torch.equal(got, want)

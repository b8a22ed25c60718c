"""int8 weights (``quantization="int8"``, rtpcore.models.layers): the per-channel rounding bound of
one layer, and the engine's greedy tokens against transformers' float32 model on the same checkpoint --
at every position the int8 engine's token is within a logit tolerance of the float32 model's best
logit (teacher-forced on the int8 output), so the two part only at near-ties.

Two tolerances, one per kernel. Batched decode (4 sequences) keeps float32 activations: the int8
weights are the only difference, INT8_LOGIT_TOL; so does a prefill step of fewer than
rtpcore_native._kernels.gemm_rows() tokens (16 with a vector kernel set; more are quantized per block of 32 for
the byte-dot-product GEMM, as llama.cpp's Q8_0 prefill: this test's first step, 19 tokens, is one
such, and stays within INT8_LOGIT_TOL). Decode of fewer than
rtpcore_native._kernels.INT8_QUANTIZED_ROWS sequences also quantizes the activations to int8 per
block of 32, as llama.cpp's Q8_0 product does (the kernel's own bound: tests/test_native_decode.py
int8_bound): on this tiny random model, one sequence at a time, that moved the largest greedy gap
from 0.05 to 0.19 (logits up to 6; teacher-forced logits' largest error 0.22 -> 0.28), hence
INT8_Q8_LOGIT_TOL."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from rtpcore import Engine
from rtpcore.errors import RtpcoreError
from rtpcore.models.layers import Linear, weight_quantization
from test_llama import make_checkpoint

try:
    from rtpcore_native._kernels import INT8_QUANTIZED_ROWS
except ImportError:  # no native kernels: torch's int8 kernel, float32 activations at any batch
    INT8_QUANTIZED_ROWS = 0

INT8_LOGIT_TOL = 0.1  # logit units, on tiny models whose logits reach about 6
INT8_Q8_LOGIT_TOL = 0.2  # the same with 8-bit activations too (see the module doc)
PROMPTS = [[5, 9, 33, 7, 81], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [100, 3, 4], [7]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int8_layer_is_within_half_a_step_of_each_weight(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 64, generator=gen) * torch.linspace(0.1, 3.0, 96)[:, None]).to(dtype)  # rows of every scale
    bias = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(5, 7, 64, generator=gen).to(dtype)
    with weight_quantization("int8"):
        layer = Linear(w, bias)
    assert layer.kernel == "int8" and layer.weight.dtype == torch.int8 and layer.scales.dtype == dtype
    wf = w.float()
    dequant = layer.weight.float() * layer.scales.float()[:, None]
    step = wf.abs().amax(1, keepdim=True) / 127
    assert ((dequant - wf).abs() <= step / 2 + 1e-6 * step + torch.finfo(dtype).eps * wf.abs()).all()
    y = layer(x)
    assert y.shape == (5, 7, 96) and y.dtype == dtype
    # |y - x W^T| <= sum_k |x_k| * step/2 (+ the rounding of the dtype itself)
    exact = x.float() @ wf.T + bias.float()
    bound = x.float().abs() @ (step / 2).expand(-1, 64).T
    slack = 1e-4 if dtype == torch.float32 else 2e-2 * exact.abs().amax()
    assert ((y.float() - exact).abs() <= bound + slack).all()


def test_weight_quantization_refuses_an_unknown_scheme_and_a_gpu_engine(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="quantization must be None or one of"), weight_quantization("int4"):
        pass
    make_checkpoint(tmp_path)
    with pytest.raises(RtpcoreError, match="quantization must be None, 'none' or one of fp8, gguf, int8, got 'fp4'"):
        Engine.from_pretrained(tmp_path, quantization="fp4")


@pytest.mark.parametrize(("batch", "tol"), [(4, INT8_LOGIT_TOL), (1, INT8_Q8_LOGIT_TOL)])
def test_int8_greedy_tokens_stay_within_a_near_tie_of_the_float32_model(tmp_path: Path, batch: int, tol: float) -> None:
    """float32 activations: the int8 weights are the only difference (bfloat16 activations alone
    already move logits by up to about 0.3 on this model, so they get no bound here); decoding one
    sequence at a time, the activations' int8 blocks too (the module doc)."""
    model = make_checkpoint(tmp_path)
    assert batch >= INT8_QUANTIZED_ROWS or tol == INT8_Q8_LOGIT_TOL
    with Engine.from_pretrained(tmp_path, quantization="int8", dtype="float32", max_batch_size=batch) as engine:
        kernels = {m.kernel for m in engine.model.modules() if isinstance(m, Linear)}
        out = engine.generate(PROMPTS, max_new_tokens=24, stop_token_ids=[])
    assert kernels == {"int8"}
    agree = 0
    with torch.no_grad():
        for prompt, tokens in zip(PROMPTS, out, strict=True):
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]  # (24, V)
            chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
            gaps = logits.amax(-1) - chosen
            assert gaps.max().item() <= tol, f"token {gaps.argmax().item()} of {prompt}: gap {gaps.max():.4f}"
            agree += int((gaps == 0).sum())
    assert agree >= 0.8 * 24 * len(PROMPTS)  # most tokens are float32's own argmax


def test_int8_with_bfloat16_activations_runs(tmp_path: Path) -> None:
    make_checkpoint(tmp_path)
    with Engine.from_pretrained(tmp_path, quantization="int8", dtype="bfloat16") as engine:
        assert {m.scales.dtype for m in engine.model.modules() if isinstance(m, Linear)} == {torch.bfloat16}
        out = engine.generate(PROMPTS, max_new_tokens=8, stop_token_ids=[])
    assert [len(o) for o in out] == [8] * len(PROMPTS)

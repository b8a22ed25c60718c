"""The Triton paged decode and prefill kernels (rtpcore.kv.paged_attention): checked on the
CPU under Triton's interpreter in a child process (tests/paged_attention_checks.py), and the
rules that pick them."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rtpcore.kv.paged_attention import decode_backend, prefill_backend, use_backend
from rtpcore.kv.pools import allocate_kv_caches
from rtpcore.kv.specs import build_specs

HERE = Path(__file__).resolve().parent
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


def interpreted(check: str) -> dict[str, object]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "paged_attention_checks.py"), check],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_triton
def test_kernel_equals_dense_attention_over_scattered_blocks() -> None:
    """fp32/bf16/fp16 pools, grouped heads, head sizes and block sizes that are not powers of
    two, one-token blocks, sliding windows; blocks in random order."""
    worst = interpreted("kernel")
    assert set(worst) == {"float32", "bfloat16", "float16"}


@needs_triton
def test_prefill_kernel_equals_causal_attention_per_sequence() -> None:
    """Varlen queries over scattered blocks of 1/3/4/16 tokens: a mixed batch (a decode, a
    7-token prompt, a 33-token later chunk of a longer context), grouped heads, head sizes
    24 and 64, windows shorter than a query tile, two query tiles with one of them empty for
    a short sequence; fp32/bf16/fp16 pools; slots outside the visible context are NaN. The
    rules of prefill_backend under the interpreter, an MLA cache refused."""
    assert set(interpreted("prefill")) == {"float32", "bfloat16", "float16"}


@pytest.mark.gpu
def test_prefill_kernel_on_the_gpu() -> None:
    """The same cases compiled for the GPU: bf16/fp16 pools multiply in their own dtype
    there (the interpreter, whose tl.dot misreads bf16, runs bf16 pools in float32)."""
    from paged_attention_checks import prefill_errors

    assert set(prefill_errors("cuda")) == {"float32", "bfloat16", "float16"}

@needs_triton
@pytest.mark.slow
def test_atom_plugin_decodes_the_same_tokens_with_the_latent_kernel() -> None:
    pytest.importorskip("atom_plugin")
    assert interpreted("atom") == {"plain": "same", "mtp": "same"}


@needs_triton
@pytest.mark.slow
def test_engine_decodes_transformers_tokens_with_the_kernel() -> None:
    assert interpreted("engine") == {"llama-gqa": "same", "mistral-window": "same"}


def _cache(dtype: str) -> object:
    from rtpcore_native import KVCacheSpecDesc

    desc = KVCacheSpecDesc(tag="layers.0", kind="mha", dtype=dtype, num_kv_heads=2, head_dim=16, tokens_per_block=4)
    return allocate_kv_caches(build_specs([desc]), 4, compute_dtype=torch.float32)[0]


def test_backend_rules_on_the_cpu() -> None:
    q = torch.zeros(1, 4, 16)
    plain, fp8 = _cache("fp32"), _cache("fp8_e4m3")
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert decode_backend(plain, q) == "gather"  # auto: the kernel only for CUDA tensors
        with use_backend("triton"), pytest.raises(RuntimeError, match="cannot run here"):
            decode_backend(plain, q)
    with use_backend("triton"), pytest.raises(RuntimeError, match="unquantized MHA or MLA cache"):
        decode_backend(fp8, q)  # fp8 byte layouts go through their codecs
    with use_backend("gather"):
        assert decode_backend(plain, q) == "gather"
    with pytest.raises(ValueError, match="backend must be one of"), use_backend("flash"):
        pass


def test_prefill_backend_rules_on_the_cpu() -> None:
    x = torch.zeros(3, 32)
    plain, fp8 = _cache("fp32"), _cache("fp8_e4m3")
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert prefill_backend(plain, x) == "gather"  # auto: the kernel only for CUDA tensors
        with use_backend("triton"), pytest.raises(RuntimeError, match="cannot run here"):
            prefill_backend(plain, x)
    with use_backend("triton"), pytest.raises(RuntimeError, match="unquantized MHA cache"):
        prefill_backend(fp8, x)
    with use_backend("gather"):
        assert prefill_backend(plain, x) == "gather"

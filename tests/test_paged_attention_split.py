"""The tiled, split-context decode kernels (rtpcore.kv.paged_decode_split): MHA/GQA and MLA
checked against dense attention on gathered keys, on the CPU under Triton's interpreter (in a
child process, tests/paged_attention_checks.py) and on a GPU; the rule that picks them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from rtpcore.kv.paged_attention import decode_kernel_splits
from rtpcore.kv.paged_decode_split import (
    LONG_CONTEXT,
    MAX_SPLITS,
    SPLIT_TOKENS,
    TARGET_PROGRAMS,
    decode_splits,
)
from test_paged_attention import interpreted

HERE = Path(__file__).resolve().parent
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


@needs_triton
def test_split_kernel_equals_dense_attention_per_sequence() -> None:
    """Contexts shorter than a tile, exactly one tile, five tiles with a partial last one;
    lengths far apart in one batch (parts past a short context are empty), a graph padding
    row, windows across blocks of 3 and 5 tokens, GQA 1:1, 4:1, 6:1, head sizes 16/24/64;
    one part and several, 16-position and default tiles; fp32/bf16/fp16 pools whose unseen
    slots are NaN."""
    assert set(interpreted("split")) == {"float32", "bfloat16", "float16"}


@needs_triton
def test_mla_kernel_equals_absorbed_latent_attention() -> None:
    """The latent kernel in one part and several (a short sequence's later parts empty, a
    padding row), head counts that are not multiples of its 16, latent and rope sizes up to
    DeepSeek-V3's 512 + 64, blocks of 1-16 tokens in random order; fp32/bf16/fp16 pools."""
    assert set(interpreted("mla")) == {"float32", "bfloat16", "float16"}


@needs_triton
def test_static_decode_batches_take_the_split_kernel() -> None:
    """Tiny Llama-family models decoding through DecodeGraphs' padded static buffers, as wide
    as 1024 positions need (what a CUDA graph replays): the split kernel serves the plain
    model, the per-block one the 12-token window, and the logits equal the gather path's."""
    pytest.importorskip("transformers")
    assert interpreted("graphs") == {"llama-gqa": ["same", "split"], "mistral-window": ["same", "per-block"]}


def test_short_contexts_take_the_per_block_kernel() -> None:
    """Below LONG_CONTEXT addressable positions, the per-block kernel (0 parts); a window
    shorter than that keeps it whatever the tables' width."""
    assert decode_kernel_splits(1, 8, LONG_CONTEXT - 16) == 0
    assert decode_kernel_splits(1, 8, 131072, window=512) == 0
    assert decode_kernel_splits(1, 8, LONG_CONTEXT) >= 1


def test_parts_fill_the_grid_without_exceeding_the_context() -> None:
    """Parts bring a small batch to about TARGET_PROGRAMS programs, none shorter than
    SPLIT_TOKENS addressable positions, at most MAX_SPLITS; a large batch takes one part."""
    assert decode_splits(1, 8, 4096) == min(TARGET_PROGRAMS // 8, 4096 // SPLIT_TOKENS)
    assert decode_splits(1, 1, 1 << 20) == MAX_SPLITS
    assert decode_splits(2, 8, 1024) == 1024 // SPLIT_TOKENS
    assert decode_splits(64, 8, 4096) == 1
    assert decode_splits(1, 8, 100) == 1


def test_the_rule_reads_shapes_only() -> None:
    """Under CUDA graphs the tables are as wide as max_positions needs: every step of a
    bucket gets the same launches, whatever its sequences' lengths."""
    width, tpb = 256, 16  # max_positions 4096
    assert len({decode_kernel_splits(4, 8, width * tpb) for _ in range(3)}) == 1
    assert decode_kernel_splits(4, 8, width * tpb) == decode_splits(4, 8, 4096) > 0


# --- on a GPU --------------------------------------------------------------------------------


@pytest.mark.gpu
def test_split_kernels_on_the_gpu() -> None:
    """The interpreter's cases compiled for the GPU: bf16/fp16 pools multiply in their own
    dtype on tensor cores there (the interpreter runs bf16 pools in float32)."""
    from paged_attention_checks import mla_errors, split_errors

    assert set(split_errors("cuda")) == {"float32", "bfloat16", "float16"}
    assert set(mla_errors("cuda")) == {"float32", "bfloat16", "float16"}


def _long_batch(dtype: torch.dtype, lens: list[int], width: int) -> tuple[torch.Tensor, ...]:
    """Llama-3-8B-shaped heads (32 over 8, 128 wide) over 16-token blocks in random order."""
    from paged_attention_checks import paged_pool

    gen = torch.Generator().manual_seed(4)
    k, v, tables, lens_t = paged_pool(16, lens, 8, 128, gen, blocks=width * len(lens) + 4)
    wide = torch.full((len(lens), width), -1)
    wide[:, : tables.shape[1]] = tables
    q = torch.randn(len(lens), 32, 128, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype), wide, lens_t


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_long_contexts_on_the_gpu(dtype: torch.dtype) -> None:
    """4k-token contexts next to a short one and a padding row: the rule's split kernel and
    the per-block kernel both equal dense attention."""
    from paged_attention_checks import reference
    from rtpcore.kv.paged_attention import paged_decode_attention

    cpu = _long_batch(dtype, [4096, 4000, 300, 0], width=256)
    q, k, v, tables, lens = (t.cuda() for t in cpu)
    want = reference(*cpu, 16, 128**-0.5, None)
    for splits in (None, 0):
        got = paged_decode_attention(q, k, v, tables, lens, tokens_per_block=16, scale=128**-0.5, splits=splits)
        assert float((got.float().cpu() - want).abs().max()) < 2e-2, splits


@pytest.mark.gpu
def test_long_mla_contexts_on_the_gpu() -> None:
    """DeepSeek-V3's latent (512 + 64) under 16 heads, bf16, 4k-token contexts next to a
    short one: the rule's parts equal absorbed latent attention."""
    from paged_attention_checks import paged_pool
    from rtpcore.kv.paged_attention import paged_mla_decode

    gen = torch.Generator().manual_seed(5)
    ctx, r = [4096, 3000, 17], 512
    rows, _, tables, lens = paged_pool(16, ctx, 1, r + 64, gen, blocks=256 * 3)
    latent, roped = rows[:, 0, :r].bfloat16(), rows[:, 0, r:].bfloat16()
    q_lat, q_rope = torch.randn(3, 16, r, generator=gen) / 8, torch.randn(3, 16, 64, generator=gen) / 8
    on = [t.cuda() for t in (q_lat, q_rope, latent, roped, tables, lens)]
    got = paged_mla_decode(*on, tokens_per_block=16, scale=0.07).cpu()
    for i, n in enumerate(ctx):
        pos = torch.arange(n)
        slots = tables[i, pos // 16] * 16 + pos % 16
        c, k = latent[slots].float(), roped[slots].float()
        want = ((q_lat[i] @ c.T + q_rope[i] @ k.T) * 0.07).softmax(-1) @ c
        assert float((got[i] - want).abs().max()) < 2e-2, n


@pytest.mark.gpu
def test_split_kernel_replays_in_a_cuda_graph() -> None:
    """Captured once over static buffers as wide as 4096 positions, a step replays for other
    lengths and block tables (the grid reads no length from the device)."""
    from paged_attention_checks import reference
    from rtpcore.kv.paged_attention import paged_decode_attention

    scale = 128**-0.5
    first = [t.cuda() for t in _long_batch(torch.bfloat16, [64, 64, 64], width=256)]
    q, k, v, tables, lens = (t.clone() for t in first)
    run = lambda: paged_decode_attention(q, k, v, tables, lens, tokens_per_block=16, scale=scale)  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    cpu = _long_batch(torch.bfloat16, [4096, 1000, 0], width=256)
    for static, new in zip((q, k, v, tables, lens), cpu, strict=True):
        static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    want = reference(*cpu, 16, scale, None)
    assert float((out.float().cpu() - want).abs().max()) < 2e-2


@pytest.mark.gpu
def test_the_gpu_benchmark_times_the_decode_kernels(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/bench_gpu.py's kernel table runs (a short context, one batch size)."""
    spec = importlib.util.spec_from_file_location("bench_gpu", HERE.parent / "benchmarks" / "bench_gpu.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.decode_kernels(1024, [2], 1)
    assert len(capsys.readouterr().out.splitlines()) == 3

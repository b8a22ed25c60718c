"""The engine on a CUDA/ROCm GPU (docs/design.md §9). Every test is marked ``gpu``: where torch sees
no GPU they skip, with the reason shown (tests/conftest.py). Float32 comparisons with transformers
run with TF32 off, so that both sides multiply in full float32."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from rtpcore import Engine
from rtpcore.engine.worker.devices import resolve_device
from rtpcore.errors import DeviceError
from test_llama import make_checkpoint

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 9, 33, 7, 81], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [100]]
NEW_TOKENS = 24
COUNT = torch.cuda.device_count() if torch.cuda.is_available() else 0
two_gpus = pytest.mark.skipif(COUNT < 2, reason=f"needs two CUDA/ROCm devices, torch sees {COUNT}")


@pytest.fixture
def no_tf32() -> Iterator[None]:
    """Full float32 matmuls and convolutions for the test, then torch's settings as they were."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture
def llama(tmp_path: Path) -> tuple[Path, Any]:
    """The tiny float32 Llama checkpoint of test_llama and its transformers model."""
    return tmp_path, make_checkpoint(tmp_path)


def hf_greedy_on(model: Any, device: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, alone, on ``device``."""
    model = model.to(device)
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                do_sample=False, pad_token_id=0,
            )
            outs.append(out[0, len(p):].tolist())
    return outs


def engine_tensors(engine: Any) -> list[torch.Tensor]:
    """The model's parameters and buffers and every KV pool tensor of this rank."""
    tensors = [*engine.model.parameters(), *engine.model.buffers()]
    for cache in engine.kv_caches:
        tensors += [t for name in ("k", "v", "rows") if isinstance(t := getattr(cache, name, None), torch.Tensor)]
    return tensors


def test_auto_and_cuda_resolve_to_the_first_gpu() -> None:
    assert resolve_device("auto") == resolve_device("cuda") == "cuda:0"


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_float32_greedy_tokens_equal_transformers_on_the_gpu(llama: tuple[Path, Any], no_tf32: None, device: str) -> None:
    """Batched float32 greedy decoding on the GPU gives transformers' tokens on the same GPU,
    with the weights, KV pools and engine.device there."""
    path, hf = llama
    with Engine.from_pretrained(path, tokens_per_block=4, device=device) as engine:
        assert engine.device == torch.device("cuda:0") and engine.config.device == "cuda:0"
        assert {t.device for t in engine_tensors(engine)} == {torch.device("cuda:0")}
        got = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=[])
    assert got == hf_greedy_on(hf, "cuda:0", PROMPTS, NEW_TOKENS)


def test_seeded_sampling_on_the_gpu_is_reproducible(llama: tuple[Path, Any]) -> None:
    """Per-request generators live on the GPU: the same seed gives the same tokens, whatever the batch."""
    path, _ = llama
    with Engine.from_pretrained(path, tokens_per_block=4, device="cuda") as engine:
        alone = engine.generate(PROMPTS[:1], max_new_tokens=12, temperature=1.0, seed=3, stop_token_ids=[])
        batched = engine.generate(PROMPTS, max_new_tokens=12, temperature=1.0, seed=3, stop_token_ids=[])
    assert batched[0] == alone[0] and len(batched) == len(PROMPTS)


def test_fp8_kv_cache_runs_on_the_gpu(llama: tuple[Path, Any]) -> None:
    """kv_cache_dtype="fp8" packs e4m3 rows into uint8 pools on the GPU and generates every token."""
    path, _ = llama
    with Engine.from_pretrained(path, tokens_per_block=4, kv_cache_dtype="fp8", device="cuda") as engine:
        assert {s.dtype for s in engine.kv_cache_specs} == {"fp8_e4m3"}
        assert {c.rows.device for c in engine.kv_caches} == {torch.device("cuda:0")}
        assert {c.rows.dtype for c in engine.kv_caches} == {torch.uint8}
        out = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=[])
    assert [len(o) for o in out] == [NEW_TOKENS] * len(PROMPTS)
    assert all(0 <= t < 128 for o in out for t in o)


@pytest.mark.parametrize("kv_layout", ["padded", "compact"])
def test_atom_plugin_deepseek_demo_runs_on_the_gpu(tmp_path: Path, kv_layout: str) -> None:
    """The atom-plugin's DeepSeek-V3 demo (MLA, MoE) decodes on the GPU with either fp8 MLA layout."""
    pytest.importorskip("atom_plugin")
    from rtpcore.testing import demo_checkpoint

    path = demo_checkpoint("deepseek_v3", plugins=["atom-plugin"], cache_dir=tmp_path)
    with Engine.from_pretrained(
        path, plugins=("atom-plugin",), kv_cache_dtype="fp8", kv_layout=kv_layout, device="cuda"
    ) as engine:
        assert engine.model_type == "deepseek_v3"
        assert {s.layout for s in engine.kv_cache_specs} == {kv_layout}
        assert {t.device for t in engine_tensors(engine)} == {torch.device("cuda:0")}
        out = engine.generate(PROMPTS, max_new_tokens=8, stop_token_ids=[])
    assert [len(o) for o in out] == [8] * len(PROMPTS)


def test_cli_generate_runs_on_the_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`rtpcore generate --demo llama --device cuda` prints the tokens it generated."""
    from rtpcore.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["generate", "--demo", "llama", "--prompt-ids", "1,2,3", "--max-new-tokens", "6", "--device", "cuda"]) == 0
    assert len(capsys.readouterr().out.split()) == 6


@two_gpus
def test_a_single_rank_runs_on_the_gpu_it_is_given(llama: tuple[Path, Any], no_tf32: None) -> None:
    """device="cuda:1" puts everything on the second GPU and gives cuda:0's tokens."""
    path, _ = llama
    outs = []
    for device in ("cuda:0", "cuda:1"):
        with Engine.from_pretrained(path, tokens_per_block=4, device=device) as engine:
            assert engine.device == torch.device(device)
            assert {t.device for t in engine_tensors(engine)} == {torch.device(device)}
            outs.append(engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=[]))
    assert outs[0] == outs[1]


@two_gpus
def test_two_ranks_on_two_gpus_give_one_rank_and_transformers_tokens(llama: tuple[Path, Any], no_tf32: None) -> None:
    """tensor_parallel_size=2 on CUDA: rank r on cuda:r over NCCL, the tokens of one rank and of transformers."""
    path, hf = llama
    outs = []
    for tp in (1, 2):
        with Engine.from_pretrained(path, tokens_per_block=4, tensor_parallel_size=tp, device="cuda") as engine:
            assert engine.device == torch.device("cuda:0")
            assert engine._group.context.backend == ("nccl" if tp == 2 else "none")
            outs.append(engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=[]))
    assert outs[0] == outs[1] == hf_greedy_on(hf, "cuda:0", PROMPTS, NEW_TOKENS)


@two_gpus
def test_a_numbered_gpu_other_than_0_is_refused_for_several_ranks() -> None:
    """"cuda:1" with tensor_parallel_size=2 is DeviceError: the ranks take cuda:0 and cuda:1."""
    with pytest.raises(DeviceError) as excinfo:
        resolve_device("cuda:1", tensor_parallel_size=2)
    assert excinfo.value.malformed is False
    assert "ranks take cuda:0..cuda:1" in str(excinfo.value)


def test_speculative_decoding_on_the_gpu(llama: tuple[Path, Any], tmp_path: Path, no_tf32: None) -> None:
    """A draft on the GPU (its own pools there too): greedy tokens equal decoding without it,
    and seeded sampling runs on the device's generators."""
    path, _ = llama
    draft = tmp_path / "draft"
    make_checkpoint(draft, seed=1, num_hidden_layers=1)
    with Engine.from_pretrained(path, device="cuda") as engine:
        plain = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=[])
    for d in (path, draft):
        with Engine.from_pretrained(path, device="cuda", draft_model=d, num_speculative_tokens=3) as engine:
            assert engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=[]) == plain
            assert all(t.is_cuda for c in engine._group.local.draft_kv_caches for t in (c.k, c.v))
            assert engine._group.local.draft_graphs is not None  # the draft's later proposals replay graphs
            sampled = engine.generate(PROMPTS, max_new_tokens=8, temperature=1.0, seed=3, stop_token_ids=[])
            assert [len(s) for s in sampled] == [8] * len(PROMPTS)
            assert engine.speculative_stats.proposed > 0


def test_decode_reads_kv_blocks_in_place_with_the_triton_kernel(llama: tuple[Path, Any], no_tf32: None) -> None:
    """On the GPU decode steps use the paged kernel (rtpcore.kv.paged_attention) by default; its
    tokens equal the gather path's. Graphs off: a captured graph keeps the kernel it was captured
    with, whatever use_backend says, and the comparison would be the kernel with itself."""
    from rtpcore.kv.paged_attention import decode_backend, use_backend

    path, _ = llama
    with Engine.from_pretrained(path, device="cuda", cuda_graphs=False) as engine:
        q = torch.zeros(1, engine.model_config.num_attention_heads, engine.model_config.head_dim, device="cuda")
        assert decode_backend(engine.kv_caches[0], q) == "triton"
        paged = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=[])
        with use_backend("gather"):
            gathered = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=[])
    assert paged == gathered


def test_decode_steps_replay_cuda_graphs(llama: tuple[Path, Any], no_tf32: None) -> None:
    """A single-rank GPU engine captures one graph per batch-size bucket by default; the tokens
    equal those of the same engine without graphs, at every batch size."""
    from rtpcore.engine.worker.graphs import buckets

    path, _ = llama
    with Engine.from_pretrained(path, device="cuda", max_batch_size=4, cuda_graphs=False) as engine:
        eager = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=[])
        assert engine._group.local.graphs is None
    with Engine.from_pretrained(path, device="cuda", max_batch_size=4, async_scheduling=False) as engine:
        graphs = engine._group.local.graphs
        assert graphs is not None and graphs.failure is None
        assert sorted(graphs.graphs) == buckets(4)
        assert engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=[]) == eager
        assert engine.generate(PROMPTS[:1], max_new_tokens=NEW_TOKENS, stop_token_ids=[]) == eager[:1]
        stats = engine.stats()
        # every decode step replayed a graph: (NEW_TOKENS - 1) steps per call, none eager
        assert stats.cuda_graph_replays_total == 2 * (NEW_TOKENS - 1) and stats.eager_decode_steps_total == 0


def test_async_scheduling_is_on_with_graphs_and_keeps_the_tokens(llama: tuple[Path, Any], no_tf32: None) -> None:
    """With graphs the engine runs outputs one step behind by default (the next step launched from
    the running one's picks on the device); greedy tokens, stop tokens and max_tokens as the
    synchronous engine's, and every block back."""
    from rtpcore.engine.sample.params import SamplingParams

    path, _ = llama
    prompts = [*PROMPTS, [7, 7], [3, 1, 4, 1, 5, 9]]
    with Engine.from_pretrained(path, device="cuda", max_batch_size=4, async_scheduling=False) as engine:
        plain = engine.generate(prompts, max_new_tokens=NEW_TOKENS, stop_token_ids=[])
    stops = sorted({toks[3] for toks in plain[::2]})
    params = [SamplingParams(max_tokens=NEW_TOKENS - i, stop_token_ids=stops, ignore_eos=True) for i in range(len(prompts))]
    outs = []
    for on in (False, None):
        with Engine.from_pretrained(path, device="cuda", max_batch_size=4, async_scheduling=on) as engine:
            assert engine.core.async_scheduling is (on is None)
            outs.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in engine.generate(prompts, params)])
            assert engine.num_free_kv_blocks == engine.num_kv_blocks
            stats = engine.stats()
    assert outs[1] == outs[0]
    assert stats.overlapped_steps_total > 0 and stats.cuda_graph_replays_total > 0


@two_gpus
def test_engines_on_two_gpus_each_capture_on_their_own_device(llama: tuple[Path, Any], no_tf32: None) -> None:
    """A second engine on another GPU captures on a stream of its own device: its graphs replay
    (the counter moves) and give the eager tokens -- an empty capture would give stale logits."""
    path, _ = llama
    with Engine.from_pretrained(path, device="cuda:0", cuda_graphs=False) as engine:
        eager = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=[])
    with Engine.from_pretrained(path, device="cuda:0", cuda_graphs=True) as first, \
            Engine.from_pretrained(path, device="cuda:1", cuda_graphs=True) as second:
        for engine in (first, second):
            assert engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=[]) == eager
            assert engine.stats().cuda_graph_replays_total == NEW_TOKENS - 1


def test_the_mla_triton_kernel_runs_on_the_gpu_and_matches_the_gather_path() -> None:
    """atom-plugin's DeepSeek demo with an unquantized cache decodes with the MLA Triton kernel
    (float32: tokens equal the gather path's; bfloat16: it runs, graphs replay)."""
    pytest.importorskip("atom_plugin")
    from rtpcore.kv.paged_attention import decode_backend, use_backend
    from rtpcore.testing import demo_checkpoint

    path = demo_checkpoint("deepseek_v3", plugins=["atom-plugin"])
    options: dict[str, Any] = {"plugins": ["atom-plugin"], "device": "cuda", "cuda_graphs": False}
    with Engine.from_pretrained(path, dtype="float32", **options) as engine:
        q = torch.zeros(1, 1, device="cuda")
        assert decode_backend(engine.kv_caches[0], q) == "triton"
        kernel = engine.generate(PROMPTS, max_new_tokens=8, stop_token_ids=[])
        with use_backend("gather"):
            gathered = engine.generate(PROMPTS, max_new_tokens=8, stop_token_ids=[])
    assert kernel == gathered
    with Engine.from_pretrained(path, dtype="bfloat16", plugins=["atom-plugin"], device="cuda") as engine:
        out = engine.generate(PROMPTS, max_new_tokens=8, stop_token_ids=[])
        assert [len(o) for o in out] == [8] * len(PROMPTS)
        assert engine.stats().cuda_graph_replays_total > 0  # its MoE routing syncs with the host no more


def test_a_forward_that_cannot_be_captured_runs_eagerly() -> None:
    """atom-plugin's DeepSeek demo with a compact fp8 cache: fp8 pools dequantize by gathering, so the
    engine takes no graphs (and says why); with cuda_graphs=True that is an error."""
    pytest.importorskip("atom_plugin")
    from rtpcore.testing import demo_checkpoint

    path = demo_checkpoint("deepseek_v3", plugins=["atom-plugin"])
    options: dict[str, Any] = {"plugins": ["atom-plugin"], "device": "cuda", "kv_cache_dtype": "fp8", "kv_layout": "compact"}
    with Engine.from_pretrained(path, cuda_graphs=False, **options) as engine:
        eager = engine.generate(PROMPTS, max_new_tokens=8, stop_token_ids=[])
    with Engine.from_pretrained(path, **options) as engine:
        shard = engine._group.local
        assert shard.graphs is None and "fp8 pools dequantize by gathering" in shard.graphs_off
        assert engine.generate(PROMPTS, max_new_tokens=8, stop_token_ids=[]) == eager
        assert engine.stats().eager_decode_steps_total > 0
    from rtpcore.errors import RtpcoreError

    with pytest.raises(RtpcoreError, match="cuda_graphs=True, but decode steps run eagerly"):
        Engine.from_pretrained(path, cuda_graphs=True, **options)

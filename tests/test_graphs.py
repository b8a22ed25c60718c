"""Decode graphs (rtpcore.engine.worker.graphs): the padded static batches, checked eagerly on the CPU
(``capture=False``; capturing needs a GPU: tests/test_gpu.py), and the engine option."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from rtpcore import Engine
from rtpcore.engine.worker.graphs import DecodeGraphs, buckets
from rtpcore.errors import RtpcoreError
from rtpcore.kv.pools import allocate_kv_caches
from rtpcore.models.forward_batch import ForwardBatch
from test_llama import make_checkpoint

TPB = 4


def test_buckets() -> None:
    assert buckets(1) == [1]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(6) == [1, 2, 4, 6]


def _batch(tables: torch.Tensor, starts: list[int], chunks: list[list[int]]) -> ForwardBatch:
    pos = [list(range(s, s + len(c))) for s, c in zip(starts, chunks, strict=True)]
    flat = torch.tensor([p for ps in pos for p in ps])
    rows = torch.tensor([b for b, ps in enumerate(pos) for _ in ps])
    return ForwardBatch(
        input_ids=torch.tensor([t for c in chunks for t in c]), positions=flat,
        slots=tables[rows, flat // TPB] * TPB + flat % TPB, query_lens=tuple(map(len, chunks)),
        context_lens=torch.tensor([s + len(c) for s, c in zip(starts, chunks, strict=True)]),
        block_tables=tables, tokens_per_block=TPB,
    )


@pytest.mark.parametrize("variant", ["llama-gqa", "mistral-window"])
def test_padded_static_decode_equals_the_eager_step(tmp_path: Path, variant: str) -> None:
    """Three sequences (ragged contexts, scattered blocks) decode through the bucket of 4: the
    logits equal the model's own on the same batch, and the padding row writes nothing but
    the scratch block."""
    make_checkpoint(tmp_path, variant)
    with Engine.from_pretrained(tmp_path, tokens_per_block=TPB, max_batch_size=6, kv_cache_memory=1 << 20) as engine:
        blocks = 24
        caches = allocate_kv_caches(engine.kv_cache_specs, blocks + 1, compute_dtype=torch.float32)
        graphs = DecodeGraphs(
            engine.model, caches, max_batch_size=6, max_positions=engine.max_positions,
            tokens_per_block=TPB, scratch_block=blocks, device="cpu", capture=False,
        )
        prompts = [[5, 9, 33, 7, 81, 2, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [100]]
        tables = torch.tensor([[7, 2, 19, 11, 0, 0, 0], [3, 14, 5, 9, 21, 16, 8], [12, 0, 0, 0, 0, 0, 0]])
        with torch.inference_mode():
            logits = engine.model(_batch(tables, [0, 0, 0], prompts), caches)
        tokens = logits.argmax(-1).tolist()
        lens = [len(p) for p in prompts]
        for _ in range(6):
            batch = _batch(tables, lens, [[t] for t in tokens])
            assert graphs.supports(batch)
            before = [c.k.clone() for c in caches]
            got = graphs.run(batch)
            for c, old in zip(caches, before, strict=True):  # only this step's slots and the scratch block changed
                changed = set((c.k != old).any(-1).any(-1).nonzero().flatten().tolist())
                allowed = set(batch.slots.tolist()) | set(range(blocks * TPB, (blocks + 1) * TPB))
                assert changed <= allowed
            with torch.inference_mode():
                want = engine.model(batch, caches)  # rewrites the same keys and values
            assert got.shape == want.shape == (3, want.shape[-1])
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            tokens = want.argmax(-1).tolist()
            lens = [n + 1 for n in lens]


def test_graphs_refuse_what_they_cannot_replay(tmp_path: Path) -> None:
    make_checkpoint(tmp_path)
    with Engine.from_pretrained(tmp_path, tokens_per_block=TPB, kv_cache_memory=1 << 20) as engine:
        caches = allocate_kv_caches(engine.kv_cache_specs, 9, compute_dtype=torch.float32)
        graphs = DecodeGraphs(
            engine.model, caches, max_batch_size=2, max_positions=16,
            tokens_per_block=TPB, scratch_block=8, device="cpu", capture=False,
        )
        tables = torch.tensor([[1, 2], [3, 4], [5, 6]])
        assert graphs.supports(_batch(tables[:2], [3, 5], [[1], [2]]))
        assert not graphs.supports(_batch(tables, [3, 5, 1], [[1], [2], [3]]))  # more rows than the largest bucket
        assert not graphs.supports(_batch(tables[:2], [0, 0], [[1, 2], [2]]))  # a prefill
        wide = torch.tensor([[1, 2, 3, 4, 5]])
        assert not graphs.supports(_batch(wide, [3], [[1]]))  # a table wider than max_positions needs


def test_cuda_graphs_option(tmp_path: Path) -> None:
    make_checkpoint(tmp_path)
    with pytest.raises(RtpcoreError, match="cuda_graphs=True needs a platform that replays CUDA graphs"):
        Engine.from_pretrained(tmp_path, device="cpu", cuda_graphs=True)
    with pytest.raises(RtpcoreError, match="cuda_graphs must be None"):
        Engine.from_pretrained(tmp_path, device="cpu", cuda_graphs="on")  # type: ignore[arg-type]
    with Engine.from_pretrained(tmp_path, device="cpu") as engine:
        shard: Any = engine._group.local
        assert shard.graphs is None and not shard.uses_cuda_graphs


# -- through the engine: the graphs' static path on the CPU -------------------------------------


PROMPTS = [[5, 9, 33], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [100], [7, 7], [3, 1, 4, 1, 5]]


class _Counting(DecodeGraphs):
    """The engine's DecodeGraphs without capture (the padded static batches run eagerly),
    counting the steps it served."""

    steps = 0

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **{**kwargs, "capture": False})

    def _replay(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:  # run and run_greedy
        type(self).steps += 1
        return super()._replay(batch)


def _graphs_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine takes graphs as on a GPU whose layers read their caches in place (here they
    gather: the CPU has no paged kernel), so the static path runs on the CPU."""
    from rtpcore.engine.worker import rank

    monkeypatch.setattr(rank.EngineShard, "uses_cuda_graphs", property(lambda self: True))
    monkeypatch.setattr("rtpcore.engine.worker.graphs.in_place_problem", lambda *a, **k: None)


@pytest.mark.parametrize("draft", [False, True])
def test_engine_decode_through_the_static_buffers_gives_the_same_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, draft: bool
) -> None:
    """Five ragged prompts through three slots (requests join and leave; buckets 1, 2, 3; block
    tables grow), with and without a speculative draft (its later proposals go through its own
    static buffers): the tokens of the plain engine, the pools one scratch block larger."""
    make_checkpoint(tmp_path / "t")
    options: dict[str, Any] = {"tokens_per_block": TPB, "max_batch_size": 3}
    if draft:
        make_checkpoint(tmp_path / "d", seed=1, num_hidden_layers=1)
        options.update(draft_model=tmp_path / "d", num_speculative_tokens=2)
    with Engine.from_pretrained(tmp_path / "t", **options) as engine:
        want = engine.generate(PROMPTS, max_new_tokens=20, stop_token_ids=[])
    _graphs_on(monkeypatch)
    monkeypatch.setattr("rtpcore.engine.worker.graphs.DecodeGraphs", _Counting)
    _Counting.steps = 0
    with Engine.from_pretrained(tmp_path / "t", **options) as engine:
        shard: Any = engine._group.local
        assert isinstance(shard.graphs, _Counting) and (shard.draft_graphs is not None) == draft
        assert shard.kv_caches[0].num_blocks == engine.num_kv_blocks + 1  # the scratch block
        assert engine.generate(PROMPTS, max_new_tokens=20, stop_token_ids=[]) == want
        assert engine.num_free_kv_blocks == engine.num_kv_blocks
        stats = engine.stats()
        runs = shard.graphs.static_runs + (shard.draft_graphs.static_runs if draft else 0)
        assert runs == _Counting.steps > 20 and stats.cuda_graph_replays_total == 0
        if not draft:  # every decode step of the target went through the static buffers
            assert stats.eager_decode_steps_total == 0


def test_a_failed_capture_leaves_every_step_eager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Capturing cannot work here (no GPU): the failure is recorded and every step runs eagerly."""
    make_checkpoint(tmp_path)
    with Engine.from_pretrained(tmp_path, tokens_per_block=TPB) as engine:
        want = engine.generate(PROMPTS, max_new_tokens=8, stop_token_ids=[])
    _graphs_on(monkeypatch)
    with Engine.from_pretrained(tmp_path, tokens_per_block=TPB) as engine:
        graphs: Any = engine._group.local.graphs
        assert graphs.failure and not graphs.graphs
        assert engine._group.local.graphs_off.startswith("capturing a CUDA graph failed")
        assert engine.generate(PROMPTS, max_new_tokens=8, stop_token_ids=[]) == want
        stats = engine.stats()
        assert stats.cuda_graph_replays_total == 0 and stats.eager_decode_steps_total >= 7  # the fallback shows


def test_with_cuda_graphs_true_a_failed_capture_is_an_error(tmp_path: Path) -> None:
    """strict (the engine's cuda_graphs=True): capture cannot work here, and that is an error naming why."""
    make_checkpoint(tmp_path)
    with Engine.from_pretrained(tmp_path, tokens_per_block=TPB, kv_cache_memory=1 << 20) as engine:
        caches = allocate_kv_caches(engine.kv_cache_specs, 5, compute_dtype=torch.float32)
        options: dict[str, Any] = {"max_batch_size": 2, "max_positions": engine.max_positions, "tokens_per_block": TPB,
                                   "scratch_block": 4, "device": "cpu"}
        lenient = DecodeGraphs(engine.model, caches, **options)
        assert lenient.failure and not lenient.graphs  # logged, eager
        with pytest.raises(RtpcoreError, match="cuda_graphs=True but capturing the decode step failed"):
            DecodeGraphs(engine.model, caches, strict=True, **options)


def test_cuda_graphs_true_on_the_cpu_is_an_error_and_none_counts_eager_decodes(tmp_path: Path) -> None:
    make_checkpoint(tmp_path)
    with pytest.raises(RtpcoreError, match="cuda_graphs=True needs a platform that replays CUDA graphs; the engine runs on 'cpu'"):
        Engine.from_pretrained(tmp_path, device="cpu", cuda_graphs=True)
    with Engine.from_pretrained(tmp_path, device="cpu") as engine:
        engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=6, stop_token_ids=[])
        stats = engine.stats()
    assert stats.cuda_graph_replays_total == 0 and stats.eager_decode_steps_total == 5  # 5 decode steps of the pair


def test_graphs_need_every_layer_to_read_its_cache_in_place() -> None:
    """fp8 pools gather; unquantized pools gather on the CPU (no paged kernel); a plugin may say its
    decode gathers on its own. Each is named in the reason."""
    from rtpcore.engine.worker.graphs import in_place_problem
    from rtpcore_native import KVCacheSpecDesc, build_kv_cache_spec

    def spec(dtype: str) -> Any:
        return build_kv_cache_spec(KVCacheSpecDesc(tag="layers.0", kind="mha", dtype=dtype, num_kv_heads=2,
                                                    head_dim=16, tokens_per_block=TPB))

    fp8 = allocate_kv_caches([spec("fp8_e4m3")], 4)
    assert "fp8 pools dequantize by gathering" in (in_place_problem(fp8, "cpu") or "")
    plain = allocate_kv_caches([spec("fp32")], 4)
    assert "'layers.0' (LayerKVCache)" in (in_place_problem(plain, "cpu") or "")

    class Gathers:
        __qualname__ = "Gathers"
        decode_reads_kv_in_place = False

    assert in_place_problem(plain, "cpu", Gathers) == "Gathers sets decode_reads_kv_in_place = False"


def test_the_metrics_expose_graph_replays_and_eager_decodes() -> None:
    from rtpcore.serving.metrics import ServerMetrics

    text = ServerMetrics(lambda: {"kv_blocks_total": 1, "kv_blocks_free": 1, "kv_blocks_cached": 0, "running": 0,
                                  "waiting": 0, "paused": 0, "cuda_graph_replays_total": 7, "eager_decode_steps_total": 2}).render().decode()
    assert "rtpcore_cuda_graph_replays_total 7.0" in text and "rtpcore_eager_decode_steps_total 2.0" in text


# -- greedy picks inside the graph --------------------------------------------------------------


def test_the_graph_greedy_picks_equal_the_eager_argmax_and_the_sampler(tmp_path: Path) -> None:
    """Three ragged sequences through the bucket of 4 (capture=False): the picks the graph holds
    equal the argmax of the model's own logits on the same batch and the sampler's greedy tokens."""
    from rtpcore.engine.sample.params import SamplingParams
    from rtpcore.engine.sample.sampler import SamplingRow, sample

    make_checkpoint(tmp_path)
    with Engine.from_pretrained(tmp_path, tokens_per_block=TPB, max_batch_size=6, kv_cache_memory=1 << 20) as engine:
        blocks = 24
        caches = allocate_kv_caches(engine.kv_cache_specs, blocks + 1, compute_dtype=torch.float32)
        graphs = DecodeGraphs(
            engine.model, caches, max_batch_size=6, max_positions=engine.max_positions,
            tokens_per_block=TPB, scratch_block=blocks, device="cpu", capture=False,
        )
        prompts = [[5, 9, 33, 7, 81, 2, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [100]]
        tables = torch.tensor([[7, 2, 19, 11, 0], [3, 14, 5, 9, 21], [12, 0, 0, 0, 0]])
        with torch.inference_mode():
            tokens = engine.model(_batch(tables, [0, 0, 0], prompts), caches).argmax(-1).tolist()
        lens = [len(p) for p in prompts]
        for _ in range(5):
            batch = _batch(tables, lens, [[t] for t in tokens])
            picks = graphs.run_greedy(batch).tolist()
            with torch.inference_mode():
                logits = engine.model(batch, caches)
            drawn = sample(logits, [SamplingRow(SamplingParams())] * 3)
            assert picks == logits.argmax(-1).tolist() == [t.token_id for t in drawn.tokens if t is not None]
            tokens = picks
            lens = [n + 1 for n in lens]
        assert graphs.greedy_runs == graphs.static_runs == 5


def test_greedy_steps_pick_on_the_device_and_one_sampled_row_takes_the_sampler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the static graph path: plain greedy requests alone are picked on the device (every
    decode step from the graph's picks); with one seeded sampled request among them the steps go
    through the sampler, and each request still gets its own tokens (greedy: as alone; seeded: as
    alone)."""
    from rtpcore.engine.sample.params import SamplingParams

    make_checkpoint(tmp_path)
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    seeded = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9, seed=7)
    with Engine.from_pretrained(tmp_path, tokens_per_block=TPB, max_batch_size=4) as engine:
        alone = [engine.generate([p], greedy)[0].outputs[0].token_ids for p in PROMPTS[:3]]
        sampled_alone = engine.generate([PROMPTS[3]], seeded)[0].outputs[0].token_ids
    _graphs_on(monkeypatch)
    monkeypatch.setattr("rtpcore.engine.worker.graphs.DecodeGraphs", _Counting)
    with Engine.from_pretrained(tmp_path, tokens_per_block=TPB, max_batch_size=4) as engine:
        graphs: Any = engine._group.local.graphs
        outs = engine.generate(PROMPTS[:3], greedy)
        assert [o.outputs[0].token_ids for o in outs] == alone
        stats = engine.stats()
        assert stats.greedy_picked_steps_total == stats.steps_total  # no step needed the sampler
        assert graphs.greedy_runs == graphs.static_runs >= 9  # every decode step: the graph's picks
        before, runs = stats.greedy_picked_steps_total, graphs.greedy_runs
        outs = engine.generate([*PROMPTS[:3], PROMPTS[3]], [greedy] * 3 + [seeded])
        assert [o.outputs[0].token_ids for o in outs] == [*alone, sampled_alone]
        assert engine.stats().greedy_picked_steps_total == before and graphs.greedy_runs == runs


def test_async_scheduling_through_the_static_graph_path_keeps_the_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outputs one step behind with decode steps served by the static buffers (capture=False): each
    step's input ids are the previous step's picks, copied on the device into the graph's buffers;
    the tokens are the plain engine's, and most decode steps were launched ahead."""
    make_checkpoint(tmp_path)
    with Engine.from_pretrained(tmp_path, tokens_per_block=TPB, max_batch_size=3) as engine:
        want = engine.generate(PROMPTS, max_new_tokens=20, stop_token_ids=[])
    _graphs_on(monkeypatch)
    monkeypatch.setattr("rtpcore.engine.worker.graphs.DecodeGraphs", _Counting)
    with Engine.from_pretrained(tmp_path, tokens_per_block=TPB, max_batch_size=3, async_scheduling=True) as engine:
        graphs: Any = engine._group.local.graphs
        assert engine.generate(PROMPTS, max_new_tokens=20, stop_token_ids=[]) == want
        stats = engine.stats()
        assert stats.overlapped_steps_total > 20 and graphs.greedy_runs == graphs.static_runs > 20
        assert engine.num_free_kv_blocks == engine.num_kv_blocks


def test_async_scheduling_defaults_to_captured_graphs_on_one_rank() -> None:
    """None turns it on only for a single rank whose decode graphs were captured (a GPU); never
    where capture failed, graphs are off (the CPU) or run eagerly (capture=False)."""
    from types import SimpleNamespace

    from rtpcore.engine.engine import _async_scheduling

    def decide(graphs: Any, tp: int = 1, choice: bool | None = None) -> bool:
        config: Any = SimpleNamespace(async_scheduling=choice, tensor_parallel_size=tp)
        return _async_scheduling(config, SimpleNamespace(graphs=graphs))

    captured = SimpleNamespace(capture=True, failure=None)
    assert decide(captured)
    assert not decide(captured, tp=2)
    assert not decide(SimpleNamespace(capture=True, failure="RuntimeError: no"))
    assert not decide(SimpleNamespace(capture=False, failure=None))
    assert not decide(None)
    assert decide(None, choice=True) and not decide(captured, choice=False)

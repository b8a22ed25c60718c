"""Engine: scheduling, KV memory, stop tokens, sampling and errors, on tiny transformers checkpoints."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from rtpcore import Engine
from rtpcore.engine.sample.params import SamplingParams
from rtpcore.engine.sample.sampler import sample_step
from rtpcore.errors import InvalidRequestError, KVCacheCapacityError, KVCacheSpecError, RtpcoreError
from rtpcore.kv.pools import LayerKVCache, PackedLayerKVCache
from test_llama import make_checkpoint, teacher_forced_logits

PROMPTS = [[5, 9, 33], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [100], [7, 7], [3, 1, 4, 1, 5, 9]]


@pytest.fixture(scope="module")
def engine(ckpt: Path) -> Any:
    with Engine.from_pretrained(ckpt, tokens_per_block=4) as e:
        yield e


@pytest.fixture(scope="module")
def alone(engine: Any) -> list[list[int]]:
    """Each prompt generated on its own (the reference for batched runs)."""
    return [engine.generate([p], max_new_tokens=20, stop_token_ids=[])[0] for p in PROMPTS]


def test_batched_ragged_equals_alone_with_more_prompts_than_slots(ckpt: Path, alone: list[list[int]]) -> None:
    """Five ragged prompts through two batch slots give each prompt's solo output, and every block comes back."""
    with Engine.from_pretrained(ckpt, tokens_per_block=4, max_batch_size=2) as e:
        assert e.generate(PROMPTS, max_new_tokens=20, stop_token_ids=[]) == alone
        assert e.num_free_kv_blocks == e.num_kv_blocks


def test_requests_preempt_each_other_under_memory_pressure_and_keep_their_output(
    ckpt: Path, engine: Any, alone: list[list[int]]
) -> None:
    """With KV memory for about one 40-token sequence, requests take blocks on demand, the newest is
    preempted when none is free, and every prompt still gets its solo output; every block comes back."""
    block_bytes = sum(s.block_bytes for s in engine.kv_cache_specs)
    with Engine.from_pretrained(ckpt, tokens_per_block=4, kv_cache_memory=10 * block_bytes, max_model_len=40) as e:
        assert e.num_kv_blocks == 10
        assert e.generate(PROMPTS, max_new_tokens=20, stop_token_ids=[]) == alone
        assert e.stats().preemptions_total > 0
        assert e.num_free_kv_blocks == 10


def test_a_pool_smaller_than_one_context_is_refused_at_build_naming_both_sizes_and_the_flags(
    ckpt: Path, engine: Any
) -> None:
    """kv_cache_memory that cannot hold one max_model_len sequence fails the build with KVCacheCapacityError."""
    block_bytes = sum(s.block_bytes for s in engine.kv_cache_specs)
    with pytest.raises(KVCacheCapacityError) as excinfo:
        Engine.from_pretrained(ckpt, tokens_per_block=4, kv_cache_memory=6 * block_bytes, max_model_len=40)
    err = excinfo.value
    assert (err.tokens_needed, err.blocks_needed, err.blocks_available) == (40, 10, 6)
    assert "max_model_len=40" in str(err) and "--max-model-len" in str(err) and "--kv-cache-memory" in str(err)
    assert f"{10 * block_bytes} bytes" in str(err)


def test_a_request_beyond_max_model_len_fails_upfront_and_engine_keeps_serving(
    ckpt: Path, alone: list[list[int]]
) -> None:
    """prompt + max_new_tokens beyond max_model_len is an InvalidRequestError naming the field
    (code context_length_exceeded); nothing ran; later calls work."""
    with Engine.from_pretrained(ckpt, tokens_per_block=4, max_model_len=30) as e:
        with pytest.raises(InvalidRequestError) as excinfo:
            e.generate([PROMPTS[0], PROMPTS[1]], max_new_tokens=20, stop_token_ids=[])
        err = excinfo.value
        assert (err.field, err.code) == ("max_new_tokens", "context_length_exceeded")
        assert "prompt 1: 17 prompt tokens + max_new_tokens=20 = 37 exceeds the engine's max_model_len=30" in str(err)
        assert e.num_free_kv_blocks == e.num_kv_blocks
        short = [p for p in PROMPTS if len(p) + 8 <= 30]
        assert e.generate(short, max_new_tokens=8, stop_token_ids=[]) == [alone[PROMPTS.index(p)][:8] for p in short]


def test_stop_tokens_default_to_the_checkpoint_eos(tmp_path: Path, alone: list[list[int]]) -> None:
    """Generation stops at (and keeps) the first stop token; the default is eos_token_id (int or list)."""
    want = alone[1]
    stop = want[6]
    cut = want[: want.index(stop) + 1]
    make_checkpoint(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": [127, stop]}))
    with Engine.from_pretrained(tmp_path, tokens_per_block=4) as e:
        assert e.generate([PROMPTS[1]], max_new_tokens=20) == [cut]
        assert e.generate([PROMPTS[1]], max_new_tokens=20, stop_token_ids=[]) == [want]
        assert e.generate([PROMPTS[1]], max_new_tokens=20, stop_token_ids=[want[2]]) == [want[:3]]


def test_seeded_sampling_is_reproducible(engine: Any, alone: list[list[int]]) -> None:
    """A seed reproduces a sampled call; top_k=1 and a tiny top_p reduce to greedy."""
    kw: dict[str, Any] = dict(max_new_tokens=20, stop_token_ids=[], temperature=1.0)
    a = engine.generate(PROMPTS, seed=3, **kw)
    assert engine.generate(PROMPTS, seed=3, **kw) == a
    assert engine.generate(PROMPTS, seed=4, **kw) != a
    assert engine.generate(PROMPTS, seed=5, top_k=1, **kw) == alone
    assert engine.generate(PROMPTS, seed=5, top_p=1e-6, **kw) == alone


def test_top_k_and_top_p_keep_only_their_tokens() -> None:
    """Draws come only from the k most likely tokens, or from the smallest set holding top_p of the mass."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    gen = torch.Generator().manual_seed(0)

    def draws(params: SamplingParams) -> torch.Tensor:
        n = logits.shape[0]
        return torch.tensor([s.token_id for s in sample_step(logits, [params] * n, [gen] * n)])

    k2 = draws(SamplingParams.create(1.0, top_k=2))
    assert set(k2.tolist()) == {0, 1}
    p = draws(SamplingParams.create(1.0, top_p=0.7))
    assert set(p.tolist()) == {0, 1}
    free = draws(SamplingParams.create(1.0))
    assert set(free.tolist()) == {0, 1, 2, 3}
    assert abs((free == 0).float().mean().item() - 0.5) < 0.04


def test_fp8_kv_cache_stays_close_to_float32(ckpt: Path, engine: Any) -> None:
    """kv_cache_dtype='fp8' packs e4m3 rows; logits stay within 15% (relative L2) of the
    float32-cache logits (e4m3 rounds keys/values by ~2%; this sharp random model amplifies it)."""
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (30, 18)]
    with Engine.from_pretrained(ckpt, tokens_per_block=4, kv_cache_dtype="fp8") as e8:
        assert {s.dtype for s in e8.kv_cache_specs} == {"fp8_e4m3"}
        assert all(isinstance(c, PackedLayerKVCache) for c in e8.kv_caches)
        assert e8.kv_caches[0].rows.dtype == torch.uint8
        got = teacher_forced_logits(e8.model, e8.kv_caches, seqs, prefill=[10, 18])
    assert all(isinstance(c, LayerKVCache) for c in engine.kv_caches)
    ref = teacher_forced_logits(engine.model, engine.kv_caches, seqs, prefill=[10, 18])
    for g, r in zip(got, ref, strict=True):
        assert (g - r).norm() <= 0.15 * r.norm()
        assert not torch.equal(g, r)  # really quantized


def test_config_is_picklable_and_rebuilds_the_engine(engine: Any, alone: list[list[int]]) -> None:
    """engine.config survives pickling and Engine.from_config builds an engine with the same output."""
    config = pickle.loads(pickle.dumps(engine.config))
    assert config == engine.config
    assert config.kv_cache_dtype == "fp32"
    with Engine.from_config(config) as again:
        assert again.generate([PROMPTS[0]], max_new_tokens=20, stop_token_ids=[]) == [alone[0]]


def test_default_kv_memory_holds_max_batch_of_full_contexts(engine: Any) -> None:
    """Without kv_cache_memory on the CPU, each layer holds max_batch_size (256 by default) x
    max_model_len (the checkpoint's max_position_embeddings) tokens."""
    assert engine.config.max_batch_size == 256 and engine.max_model_len == 256
    assert engine.num_kv_blocks == 256 * 256 // 4
    assert len(engine.kv_cache_specs) == 2
    assert engine.kv_cache_specs[0].kind == "mha"


def test_trivial_requests(engine: Any) -> None:
    """No prompts, or max_new_tokens=0, run nothing."""
    assert engine.generate([]) == []
    assert engine.generate(PROMPTS[:2], max_new_tokens=0) == [[], []]


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive integer"),
    ({"dtype": "float64"}, "dtype 'float64' is not supported"),
    ({"kv_cache_dtype": "int4"}, "kv_cache_dtype='int4'"),
    ({"tokens_per_block": 0}, "tokens_per_block must be a positive integer"),
    ({"max_batch_size": -1}, "max_batch_size must be a positive integer"),
    ({"kv_layout": "nope"}, "unknown KV layout 'nope'"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be a positive integer"),
    ({"max_model_len": 0}, "max_model_len must be a positive integer"),
    ({"max_model_len": 257}, "max_model_len=257 exceeds the checkpoint's max_position_embeddings=256"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in (0, 1]"),
    ({"enable_prefix_caching": "yes"}, "enable_prefix_caching must be True or False"),
])
def test_bad_engine_arguments_are_clear_errors(ckpt: Path, kwargs: dict[str, Any], needle: str) -> None:
    """Each bad argument raises an RtpcoreError naming the argument and the rule."""
    with pytest.raises((RtpcoreError, KVCacheSpecError)) as excinfo:
        Engine.from_pretrained(ckpt, **kwargs)
    assert needle in str(excinfo.value)


@pytest.mark.parametrize(("prompts", "kwargs", "needle"), [
    ([[1], []], {}, "prompt 1 is empty"),
    ([[1, 128]], {}, "prompt 0 holds token id 128, outside 0..127"),
    ([[1] * 250], {"max_new_tokens": 10}, "exceeds the engine's max_model_len=256"),
    (["hello"], {}, "prompt 0 must be a sequence of token ids"),
    ([[1]], {"temperature": -1.0}, "temperature must be >= 0"),
    ([[1]], {"top_p": 0.0}, "top_p must be in (0, 1]"),
    ([[1]], {"top_k": 0}, "top_k must be a positive integer"),
    ([[1]], {"max_new_tokens": -1}, "max_new_tokens must be a non-negative integer"),
])
def test_bad_requests_fail_before_running(engine: Any, prompts: list[Any], kwargs: dict[str, Any], needle: str) -> None:
    """Bad prompts and sampling values raise RtpcoreError naming the prompt and the rule; the cache stays free."""
    with pytest.raises(RtpcoreError) as excinfo:
        engine.generate(prompts, **kwargs)
    assert needle in str(excinfo.value)
    assert engine.num_free_kv_blocks == engine.num_kv_blocks


def test_closed_engine_refuses_to_generate(ckpt: Path) -> None:
    """After close() (or leaving the with block) generate raises."""
    with Engine.from_pretrained(ckpt) as e:
        pass
    with pytest.raises(RtpcoreError, match="closed"):
        e.generate([[1]])

"""Prefix caching through the Engine (docs/design.md §14) on the tiny Llama checkpoint: a cache hit
changes latency only -- the same greedy tokens as an engine with caching off -- for requests forked
from one cached prefix, under preemption, with fp8 KV, with a speculative draft and on two
tensor-parallel ranks; cached blocks are never written while requests share them."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from rtpcore import Engine
from rtpcore.engine.core.prefix_cache import block_keys, namespace_key
from test_llama import make_checkpoint

TPB = 4
N = 12
RNG = random.Random(7)
PREFIX = [RNG.randrange(1, 128) for _ in range(30)]  # 7 full blocks of 4, then 2 tokens
TAILS = [[5, 9], [77], [3, 1, 4, 1, 5, 9, 2], [100, 101, 102]]


def run(ckpt: Path, calls: Sequence[Sequence[Sequence[int]]], **options: Any) -> tuple[list[list[list[int]]], Any]:
    """Each call's generate output, in turn, on one engine; and its stats at the end."""
    with Engine.from_pretrained(ckpt, tokens_per_block=TPB, **options) as engine:
        outs = [engine.generate(list(prompts), max_new_tokens=N, stop_token_ids=[]) for prompts in calls]
        assert engine.num_free_kv_blocks == engine.num_kv_blocks  # every reference released
        return outs, engine.stats()


def same_as_uncached(ckpt: Path, calls: Sequence[Sequence[Sequence[int]]], **options: Any) -> Any:
    """Run ``calls`` with caching on and off; assert equal outputs; the cached engine's stats."""
    cached, stats = run(ckpt, calls, **options)
    plain, plain_stats = run(ckpt, calls, enable_prefix_caching=False, **options)
    assert cached == plain
    assert plain_stats.prefix_cache_hits_total == 0 == plain_stats.kv_blocks_cached
    return stats


FORKS = [[[*PREFIX, 1]], [PREFIX + t for t in TAILS]]  # seed the cache, then four forks at once


def test_requests_forked_from_one_cached_prefix_get_the_uncached_tokens(ckpt: Path) -> None:
    stats = same_as_uncached(ckpt, FORKS)
    assert stats.prefix_cache_hits_total == len(TAILS) * 28  # 7 blocks each
    assert stats.prefix_cache_queries_total == len(PREFIX) + 1 + sum(len(PREFIX) + len(t) for t in TAILS)


def conversation(ckpt: Path, **options: Any) -> tuple[list[list[int]], list[int], Any]:
    """Three turns of a chat: each prompt is the previous prompt, the tokens generated for it and
    three new ones. The first prompt (32) and its output (12) fill 11 blocks exactly, so its last
    block holds the one token whose keys and values were never computed (it was sampled last).
    The outputs, each turn's cached prompt tokens, and the engine's stats."""
    outputs, cached = [], []
    prompt = [RNG.randrange(1, 128) for _ in range(32)]
    with Engine.from_pretrained(ckpt, tokens_per_block=TPB, **options) as engine:
        for turn in range(3):
            before = engine.stats().prefix_cache_hits_total
            out = engine.generate([prompt], max_new_tokens=N, stop_token_ids=[])[0]
            outputs.append(out)
            cached.append(engine.stats().prefix_cache_hits_total - before)
            prompt = prompt + out + [turn + 1, turn + 2, turn + 3]
        return outputs, cached, engine.stats()


@pytest.mark.parametrize("draft", [None, "same"])
def test_a_second_chat_turn_reuses_every_computed_block_of_the_first(ckpt: Path, draft: str | None) -> None:
    """Turn 2 finds the 10 blocks (40 tokens) the first turn computed -- not the 11th, whose last token
    was never computed -- and turn 3 the 14 of turn 2 (47 + 12 tokens, 58 computed); the outputs are the
    uncached engine's. With the target as its own draft, every proposal is still accepted: the draft's
    keys and values of the cached blocks were there too."""
    spec = {"draft_model": str(ckpt), "num_speculative_tokens": 3} if draft else {}
    state = RNG.getstate()
    outputs, cached, stats = conversation(ckpt, **spec)
    RNG.setstate(state)
    plain, none, _ = conversation(ckpt, enable_prefix_caching=False, **spec)
    assert outputs == plain and none == [0, 0, 0]
    assert cached == [0, 40, 56]
    if draft:
        assert stats.speculative_accepted_total == stats.speculative_proposed_total > 0


def test_shared_blocks_are_never_written_while_forks_read_them(ckpt: Path) -> None:
    """The bytes of the prefix's cached blocks, in every layer, are the same before and after four
    requests decode from them together."""
    with Engine.from_pretrained(ckpt, tokens_per_block=TPB) as engine:
        engine.generate([[*PREFIX, 1]], max_new_tokens=2, stop_token_ids=[])
        keys = block_keys(PREFIX, TPB, namespace_key(engine.prefix_cache_identity()))
        blocks = engine._allocator.lookup(keys)
        assert len(blocks) == 7
        slots = torch.tensor([b * TPB + i for b in blocks for i in range(TPB)])
        before = [(c.k[slots].clone(), c.v[slots].clone()) for c in engine.kv_caches]
        engine.generate([PREFIX + t for t in TAILS], max_new_tokens=N, stop_token_ids=[])
        after = [(c.k[slots], c.v[slots]) for c in engine.kv_caches]
        assert engine._allocator.lookup(keys) == blocks
    for (k0, v0), (k1, v1) in zip(before, after, strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_preempting_requests_that_share_blocks_keeps_every_output(ckpt: Path) -> None:
    """Eight forks on a pool of 40 blocks (one max_model_len=64 sequence needs 16): requests are
    preempted and recompute from what is still cached; the outputs are the uncached engine's."""
    probe = Engine.from_pretrained(ckpt, tokens_per_block=TPB, kv_cache_memory=1 << 20)
    block_bytes = sum(s.block_bytes for s in probe.kv_cache_specs)
    probe.close()
    prompts = [[*PREFIX, i + 1, i + 2] for i in range(8)]
    options = {"kv_cache_memory": 40 * block_bytes, "max_model_len": 64, "max_batch_size": 8}
    with Engine.from_pretrained(ckpt, tokens_per_block=TPB, **options) as engine:
        assert engine.num_kv_blocks == 40
        got = engine.generate(prompts, max_new_tokens=24, stop_token_ids=[])
        stats = engine.stats()
    with Engine.from_pretrained(ckpt, tokens_per_block=TPB, enable_prefix_caching=False, **options) as engine:
        want = engine.generate(prompts, max_new_tokens=24, stop_token_ids=[])
    assert got == want
    assert stats.preemptions_total > 0 and stats.prefix_cache_hits_total > 0


def test_a_pool_too_small_for_every_prefix_evicts_and_every_output_stays_right(ckpt: Path) -> None:
    """Five different 30-token prefixes (11 blocks a request) asked in turn, then in reverse, on 24
    blocks: later prefixes evict earlier ones (least recently used first); the second round finds the
    latest ones cached, the earliest evicted, and matches the uncached engine."""
    probe = Engine.from_pretrained(ckpt, tokens_per_block=TPB, kv_cache_memory=1 << 20)
    block_bytes = sum(s.block_bytes for s in probe.kv_cache_specs)
    probe.close()
    rng = random.Random(3)
    prefixes = [[rng.randrange(1, 128) for _ in range(30)] for _ in range(5)]
    calls = [[[*p, 1]] for p in prefixes]
    calls += calls[::-1]
    stats = same_as_uncached(ckpt, calls, kv_cache_memory=24 * block_bytes, max_model_len=64)
    assert 0 < stats.prefix_cache_hits_total < 5 * 28


def test_fp8_kv_blocks_are_shared_too(ckpt: Path) -> None:
    stats = same_as_uncached(ckpt, FORKS, kv_cache_dtype="fp8")
    assert stats.prefix_cache_hits_total == len(TAILS) * 28


@pytest.fixture(scope="module")
def draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("draft")
    make_checkpoint(path, seed=1, num_hidden_layers=1)
    return path


@pytest.mark.parametrize("which", ["same", "other"])
def test_a_draft_shares_the_cached_blocks_and_the_output_is_the_targets(ckpt: Path, draft: Path, which: str) -> None:
    """The draft's KV lives in the same blocks: a hit skips both models' prefill of the prefix; the
    draft that is the target itself still has every proposal accepted after a hit."""
    model = ckpt if which == "same" else draft
    stats = same_as_uncached(ckpt, FORKS, draft_model=str(model), num_speculative_tokens=3)
    assert stats.prefix_cache_hits_total == len(TAILS) * 28 and stats.speculative_proposed_total > 0
    if which == "same":
        assert stats.speculative_accepted_total == stats.speculative_proposed_total


@pytest.mark.slow
def test_two_tensor_parallel_ranks_follow_the_leaders_cached_blocks(ckpt: Path) -> None:
    stats = same_as_uncached(ckpt, FORKS, tensor_parallel_size=2)
    assert stats.prefix_cache_hits_total == len(TAILS) * 28


OPAQUE_LAYOUT = """
from rtpcore import hookimpl
from rtpcore.kv.codecs import KVCodec
from rtpcore_native import Fp8LayoutPolicy


class Opaque(Fp8LayoutPolicy):
    name = "opaque"

    def regions(self, kv_lora_rank, rope_head_dim):
        return [("nope", "fp8_e4m3", kv_lora_rank), ("rope", "bf16", rope_head_dim)]

    def make_codec(self, spec):
        codec = KVCodec(spec)
        codec.prefix_cacheable = False  # its bytes would depend on other blocks
        return codec


@hookimpl
def rtpcore_kv_cache_layouts():
    return [Opaque()]
"""


def test_a_layout_whose_codec_cannot_keep_cached_blocks_valid_turns_caching_off_and_says_so(
    plugin_env: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A plugin layout (a real dist-info on sys.path) whose codec sets prefix_cacheable = False: the
    engine logs the layout's name and the reason, and caches nothing; the built-in layout caches."""
    pytest.importorskip("atom_plugin")
    from rtpcore.testing import demo_checkpoint

    plugin_env.add_dist("opaque-layout", plugins={"opaque": "opaque_layout"}, modules={"opaque_layout.py": OPAQUE_LAYOUT})
    demo = demo_checkpoint("deepseek_v3", plugins=["atom-plugin"], cache_dir=tmp_path / "demo")
    prompts = [[256, *PREFIX[:20], 1], [256, *PREFIX[:20], 2]]
    stats = {}
    for layout in ("opaque", "padded"):
        with caplog.at_level("WARNING", logger="rtpcore.engine.engine"), Engine.from_pretrained(
            demo, plugins=["atom-plugin", "opaque-layout"], kv_cache_dtype="fp8", kv_layout=layout, tokens_per_block=TPB
        ) as engine:
            for p in prompts:
                engine.generate([p], max_new_tokens=4)
            stats[layout] = engine.stats()
    assert stats["opaque"].prefix_cache_queries_total == 0 == stats["opaque"].kv_blocks_cached
    assert stats["padded"].prefix_cache_hits_total == 20
    warned = [r.getMessage() for r in caplog.records if "prefix caching is off" in r.getMessage()]
    assert len(warned) == 1 and "'layers.0'" in warned[0] and "prefix_cacheable = False" in warned[0]


def test_reset_prefix_cache_forgets_every_block(ckpt: Path) -> None:
    with Engine.from_pretrained(ckpt, tokens_per_block=TPB) as engine:
        first = engine.generate([[*PREFIX, 1]], max_new_tokens=4)
        assert engine.stats().kv_blocks_cached == 8  # 31 + 4 tokens, 34 computed
        assert engine.reset_prefix_cache() == 8 and engine.stats().kv_blocks_cached == 0
        before = engine.stats().prefix_cache_hits_total
        assert engine.generate([[*PREFIX, 1]], max_new_tokens=4) == first
        assert engine.stats().prefix_cache_hits_total == before


def test_engine_generate_shares_cached_blocks_only_under_the_same_cache_salt(ckpt: Path) -> None:
    """The offline API takes SamplingParams.cache_salt: the prompt asked under salt a, unsalted and under
    salt b finds nothing cached the first time each; asked again under a (or unsalted) it finds its own
    7 blocks; the tokens are the same under every salt."""
    from rtpcore import SamplingParams

    prompt = [*PREFIX, 1]
    with Engine.from_pretrained(ckpt, tokens_per_block=TPB) as engine:

        def ask(salt: str | None) -> tuple[int, list[int]]:
            params = SamplingParams(max_tokens=N, cache_salt=salt, stop_token_ids=(), ignore_eos=True)
            out = engine.generate([{"prompt_token_ids": prompt}], params)[0]
            return out.num_cached_tokens, list(out.outputs[0].token_ids)

        runs = [ask("a"), ask(None), ask("b"), ask("a"), ask(None)]
    assert [cached for cached, _ in runs] == [0, 0, 0, 28, 28]
    assert all(tokens == runs[0][1] for _, tokens in runs)

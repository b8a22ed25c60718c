"""Prefix caching with atom-plugin's DeepSeek-V3 demo (MLA, MoE, MTP): every KV layout -- the
compact fp8 layout's pool-wide scale included -- and the MTP draft, whose cache position p holds what
it computed from token p + 1, keep the uncached greedy output while forks share a cached prefix."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from rtpcore import Engine
from rtpcore.testing import demo_checkpoint

PLUGINS = ("atom-plugin",)
TPB = 4
RNG = random.Random(11)
PREFIX = [256] + [RNG.randrange(1, 250) for _ in range(29)]  # 7 full blocks of 4, then 2 tokens
FORKS = [[[*PREFIX, 1]], [[*PREFIX, 5, 9], [*PREFIX, 77], [*PREFIX, 3, 1, 4, 1, 5]]]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_checkpoint("deepseek_v3", plugins=list(PLUGINS), cache_dir=tmp_path_factory.mktemp("demo"))


def run(demo: Path, **options: Any) -> tuple[list[list[list[int]]], Any]:
    with Engine.from_pretrained(demo, plugins=PLUGINS, tokens_per_block=TPB, **options) as engine:
        outs = [engine.generate(prompts, max_new_tokens=10, stop_token_ids=[]) for prompts in FORKS]
        return outs, engine.stats()


@pytest.mark.parametrize(("kv", "layout"), [("auto", None), ("fp8", "padded"), ("fp8", "compact")])
@pytest.mark.parametrize("mtp", [False, True])
def test_forks_of_a_cached_prefix_keep_the_uncached_output(demo: Path, kv: str, layout: str | None, mtp: bool) -> None:
    options: dict[str, Any] = {"kv_cache_dtype": kv, "kv_layout": layout}
    if mtp:
        options |= {"draft_model": "mtp", "num_speculative_tokens": 2}
    cached, stats = run(demo, **options)
    plain, plain_stats = run(demo, enable_prefix_caching=False, **options)
    assert cached == plain
    # With MTP a block is keyed over the token after it too: the forks' 7 blocks are still whole.
    assert stats.prefix_cache_hits_total == 3 * 28 and plain_stats.prefix_cache_hits_total == 0
    if mtp:
        assert stats.speculative_proposed_total > 0

"""Prefix caching against live ``rtpcore serve`` processes driven by the ``openai`` client
(docs/design.md §14): usage reports ``prompt_tokens_details.cached_tokens`` on both endpoints and in
the streamed usage chunk, the hits counter moves by the cached tokens, greedy text is the uncached
server's, a small pool evicts and stays right, and ``--no-enable-prefix-caching`` reports 0."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("openai")

from test_llama import make_checkpoint
from test_serve import Server, write_tokenizer

pytestmark = pytest.mark.slow

TPB = 16  # the server's default tokens per block
RNG = random.Random(5)
SHARED = [RNG.randrange(5, 300) for _ in range(600)]


def prompt(tail_seed: int, n: int = 20) -> list[int]:
    rng = random.Random(tail_seed)
    return SHARED + [rng.randrange(5, 300) for _ in range(n)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("served-prefix")
    vocab = write_tokenizer(path)
    make_checkpoint(path, vocab_size=vocab, max_position_embeddings=1024)
    return path


@pytest.fixture(scope="module")
def servers(checkpoint: Path) -> Iterator[dict[str, Server]]:
    started: dict[str, Server] = {}
    try:
        started["on"] = Server(checkpoint)
        started["off"] = Server(checkpoint, "--no-enable-prefix-caching")
        yield started
    finally:
        for srv in started.values():
            code, out = srv.stop()
            assert code == 0, out


def complete(srv: Server, ids: list[int], n: int = 8) -> Any:
    with srv.client(timeout=300) as c:
        return c.completions.create(model="tiny", prompt=ids, max_tokens=n, temperature=0.0,
                                    extra_body={"ignore_eos": True})


def cached(response: Any) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


def test_a_prompt_sharing_600_tokens_reuses_592_and_returns_the_uncached_text(servers: dict[str, Server]) -> None:
    on, off = servers["on"], servers["off"]
    first = complete(on, prompt(1))
    before = on.metrics()
    second = complete(on, prompt(2))
    after = on.metrics()
    assert cached(first) == 0 and 592 <= cached(second) <= 600
    assert after["rtpcore_prefix_cache_hits_total"] - before["rtpcore_prefix_cache_hits_total"] == cached(second)
    assert after["rtpcore_prefix_cache_queries_total"] - before["rtpcore_prefix_cache_queries_total"] == 620
    assert second.choices[0].text == complete(off, prompt(2)).choices[0].text
    again = complete(on, prompt(2))  # every full block but the one of the last token
    assert cached(again) == (620 - 1) // TPB * TPB and again.choices[0].text == second.choices[0].text
    other = complete(on, [RNG.randrange(5, 300) for _ in range(100)])
    assert cached(other) == 0


def test_without_caching_nothing_is_reported_cached(servers: dict[str, Server]) -> None:
    off = servers["off"]
    a, b = complete(off, prompt(3)), complete(off, prompt(3))
    assert cached(a) == cached(b) == 0 and a.choices[0].text == b.choices[0].text
    m = off.metrics()
    assert m["rtpcore_prefix_cache_hits_total"] == 0 == m["rtpcore_kv_blocks_cached"]


def test_the_streamed_usage_chunk_reports_cached_tokens_on_both_endpoints(servers: dict[str, Server]) -> None:
    on = servers["on"]
    complete(on, prompt(4))
    with on.client(timeout=300) as c:
        chunks = list(c.completions.create(model="tiny", prompt=prompt(4), max_tokens=4, temperature=0.0,
                                           stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (620 - 1) // TPB * TPB
        messages = [{"role": "system", "content": "You are terse. " * 40}, {"role": "user", "content": "Hi"}]
        c.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0.0)
        chat = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0.0,
                                              stream=True, stream_options={"include_usage": True}))
        usage = chat[-1].usage
        assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // TPB * TPB > 0


def test_a_second_chat_turn_reuses_the_first(servers: dict[str, Server]) -> None:
    """Turn 2 sends turn 1's conversation, the reply and a new message: everything up to the reply is
    found cached (the rendered prompt of turn 1, but for a block at the boundary)."""
    on, off = servers["on"], servers["off"]
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "Answer in the voice of a ship's log. " * 20},
        {"role": "user", "content": "Where are we?"},
    ]
    with on.client(timeout=300) as c, off.client(timeout=300) as plain:
        kw: dict[str, Any] = {"model": "tiny", "max_tokens": 12, "temperature": 0.0}
        turn1 = c.chat.completions.create(messages=messages, **kw)
        messages += [{"role": "assistant", "content": turn1.choices[0].message.content or ""},
                     {"role": "user", "content": "And now?"}]
        turn2 = c.chat.completions.create(messages=messages, **kw)
        want = plain.chat.completions.create(messages=messages, **kw)
    assert turn1.usage.prompt_tokens > 200
    assert turn2.usage.prompt_tokens_details.cached_tokens >= (turn1.usage.prompt_tokens // TPB - 1) * TPB
    assert turn2.choices[0].message.content == want.choices[0].message.content


def test_a_pool_too_small_for_every_prompt_evicts_and_every_output_stays_right(
    checkpoint: Path, servers: dict[str, Server]
) -> None:
    """A 48-block pool holds one 620-token prompt (and its output), not two: the second prompt evicts
    the first one's blocks, so asking the first again finds less than before, with the same text."""
    from rtpcore import Engine

    with Engine.from_pretrained(checkpoint, kv_cache_memory=1 << 20) as e:
        block_bytes = sum(s.block_bytes for s in e.kv_cache_specs)
    small = Server(checkpoint, "--kv-cache-memory", str(48 * block_bytes), "--max-model-len", "700")
    try:
        a = [RNG.randrange(5, 300) for _ in range(620)]
        b = [RNG.randrange(5, 300) for _ in range(620)]
        first, again = complete(small, a), complete(small, a)
        complete(small, b)
        evicted = complete(small, a)
        assert cached(again) == (620 - 1) // TPB * TPB and cached(evicted) < cached(again)
        want = complete(servers["off"], a).choices[0].text
        assert first.choices[0].text == again.choices[0].text == evicted.choices[0].text == want
        assert small.metrics()["rtpcore_kv_blocks_total"] == 48
    finally:
        code, out = small.stop()
    assert code == 0, out

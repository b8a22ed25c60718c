"""Prefix caching against live ``rtpcore serve`` processes driven by the ``openai`` client
(docs/design.md §14, §17): with ``--enable-prompt-tokens-details`` usage reports
``prompt_tokens_details.cached_tokens`` on both endpoints and in the streamed usage chunk, the hits
counter moves by the cached tokens, greedy text is the uncached server's, a small pool evicts and
stays right, and ``--no-enable-prefix-caching`` reports 0. Without the flag no usage carries
``prompt_tokens_details`` while the cache still works (its counter moves). ``cache_salt`` shares
cached blocks only between requests of the same salt; a bad salt is a 400 naming it."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from test_llama import make_checkpoint  # noqa: E402
from test_serve import Server, write_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow

TPB = 16  # the server's default tokens per block
DETAILS = "--enable-prompt-tokens-details"
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
        started["on"] = Server(checkpoint, DETAILS)
        started["off"] = Server(checkpoint, "--no-enable-prefix-caching", DETAILS)
        started["quiet"] = Server(checkpoint)  # caching on, cached tokens not reported
        yield started
    finally:
        for srv in started.values():
            code, out = srv.stop()
            assert code == 0, out


def complete(srv: Server, ids: list[int], n: int = 8, salt: str | None = None) -> Any:
    extra: dict[str, Any] = {"ignore_eos": True} if salt is None else {"ignore_eos": True, "cache_salt": salt}
    with srv.client(timeout=300) as c:
        return c.completions.create(model="tiny", prompt=ids, max_tokens=n, temperature=0.0, extra_body=extra)


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
    small = Server(checkpoint, "--kv-cache-memory", str(48 * block_bytes), "--max-model-len", "700", DETAILS)
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


def test_a_cache_salt_shares_cached_blocks_only_with_requests_of_the_same_salt(servers: dict[str, Server]) -> None:
    """A fresh 100-token prompt under salt a finds nothing, then its 6 full blocks under salt a again;
    under salt b and unsalted it finds nothing (their first time), unsalted again it finds the unsalted
    chain; the text is the same under every salt. On chat too, and in the streamed usage chunk."""
    on = servers["on"]
    ids = [random.Random(11).randrange(5, 300) for _ in range(100)]
    full = (100 - 1) // TPB * TPB
    runs = [complete(on, ids, salt="tenant-a"), complete(on, ids, salt="tenant-a"), complete(on, ids, salt="tenant-b"),
            complete(on, ids), complete(on, ids), complete(on, ids, salt="tenant-b")]
    assert [cached(r) for r in runs] == [0, full, 0, 0, full, full]
    assert len({r.choices[0].text for r in runs}) == 1
    messages = [{"role": "system", "content": "Salted and private. " * 30}, {"role": "user", "content": "Hi"}]
    with on.client(timeout=300) as c:
        def chat(salt: str, stream: bool = False) -> Any:
            kw: dict[str, Any] = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0.0,
                                  "extra_body": {"cache_salt": salt}}
            if stream:
                return list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))[-1]
            return c.chat.completions.create(**kw)

        first, other, again = chat("x"), chat("y"), chat("x", stream=True)
    assert first.usage.prompt_tokens_details.cached_tokens == 0 == other.usage.prompt_tokens_details.cached_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == (first.usage.prompt_tokens - 1) // TPB * TPB > 0


@pytest.mark.parametrize("salt", ["", 5, ["a"], {"a": 1}, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_cache_salt_that_is_not_a_non_empty_string_is_a_400_naming_it(
    servers: dict[str, Server], path: str, salt: Any
) -> None:
    srv = servers["on"]
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 2, "cache_salt": salt}
    body.update({"prompt": [5, 6, 7]} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
    r = httpx.post(srv.url + path, json=body, timeout=300)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "cache_salt"
    body["cache_salt"] = None  # null means absent
    assert httpx.post(srv.url + path, json=body, timeout=300).status_code == 200


def test_without_the_flag_no_usage_reports_cached_tokens_and_the_cache_still_works(
    servers: dict[str, Server]
) -> None:
    """The same prompt twice on a server without --enable-prompt-tokens-details: neither answer (whole or
    streamed, completions or chat) carries prompt_tokens_details, the openai client reads it as None, and
    rtpcore_prefix_cache_hits_total moves by the 38 full blocks the second request found."""
    quiet = servers["quiet"]
    ids = prompt(6)
    before = quiet.metrics()["rtpcore_prefix_cache_hits_total"]
    first, second = complete(quiet, ids), complete(quiet, ids)
    assert first.usage.prompt_tokens_details is None and second.usage.prompt_tokens_details is None
    assert quiet.metrics()["rtpcore_prefix_cache_hits_total"] - before == (620 - 1) // TPB * TPB
    assert first.choices[0].text == second.choices[0].text
    for path, body in (("/v1/completions", {"prompt": ids}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello " * 50}]})):
        whole = httpx.post(quiet.url + path, json={"model": "tiny", "max_tokens": 2, **body}, timeout=300).json()
        assert set(whole["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
        with httpx.stream("POST", quiet.url + path, timeout=300, json={
                "model": "tiny", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}, **body}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: {")]
        usage = json.loads(lines[-1][6:])["usage"]
        assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens"}

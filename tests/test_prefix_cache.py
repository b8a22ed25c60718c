"""Prefix caching's parts (docs/design.md §14): block keys are SHA-256 chains over the tokens and the
engine's identity; the BlockAllocator counts references, keeps released cached blocks findable and
evicts the least recently released one first; the Scheduler admits a request after its longest
cached prefix (never its last token), caches full blocks as both models compute them, and releases
references on preemption and retirement without touching a block another request holds."""

from __future__ import annotations

import hashlib
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rtpcore.engine.core.block_pool import BlockAllocator
from rtpcore.engine.core.kv_manager import KVManager
from rtpcore.engine.core.prefix_cache import PrefixCache, block_keys, namespace_key, salt_key
from rtpcore.engine.core.request import Request
from rtpcore.engine.core.scheduler import Scheduler
from rtpcore.engine.sample.params import SamplingParams
from rtpcore.errors import KVBlockError

ROOT = namespace_key({"model": "toy"})


# -- keys ---------------------------------------------------------------------------------------


def test_a_block_key_is_sha256_of_the_parent_key_and_the_block_tokens() -> None:
    """Recomputed here with hashlib: key_0 = sha256(root + tokens[0:4] as int64), key_1 = sha256(key_0 +
    tokens[4:8]); a partial block has no key; lookahead 1 folds in the first token of the next block."""
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    k0 = hashlib.sha256(ROOT + array("q", tokens[0:4]).tobytes()).digest()
    k1 = hashlib.sha256(k0 + array("q", tokens[4:8]).tobytes()).digest()
    assert block_keys(tokens, 4, ROOT) == [k0, k1]
    assert block_keys(tokens, 4, k0, start=1) == [k1]
    ahead = block_keys(tokens, 4, ROOT, lookahead=1)
    assert ahead[0] == hashlib.sha256(ROOT + array("q", tokens[0:5]).tobytes()).digest() and len(ahead) == 2
    assert len(block_keys(tokens[:8], 4, ROOT, lookahead=1)) == 1  # block 1's next token is unknown


def test_keys_differ_for_any_change_of_identity_tokens_or_position() -> None:
    """A different namespace, one different token, or the same block after a different prefix gives
    a different key; the identity's key order does not matter."""
    base = block_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, ROOT)
    assert namespace_key({"model": "toy", "kv": "fp8"}) != ROOT
    assert namespace_key({"b": 1, "a": 2}) == namespace_key({"a": 2, "b": 1})
    assert block_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, namespace_key({"model": "other"}))[0] != base[0]
    assert block_keys([1, 2, 3, 9, 5, 6, 7, 8], 4, ROOT)[1] != base[1]  # a changed parent changes the child
    assert block_keys([5, 6, 7, 8], 4, ROOT)[0] != base[1]  # same tokens, other position


def test_a_cache_salt_enters_the_first_block_so_salted_and_unsalted_keys_differ_from_it_on() -> None:
    """Recomputed with hashlib: a salted block 0 is sha256(root + salt_key(salt) + tokens); every later
    key chains from it, so no key of a salted chain is a key of the unsalted one or of another salt's,
    while the same salt gives the same keys."""
    tokens = list(range(1, 13))
    plain = block_keys(tokens, 4, ROOT)
    salted = block_keys(tokens, 4, ROOT, salt="tenant-a")
    assert salted[0] == hashlib.sha256(ROOT + salt_key("tenant-a") + array("q", tokens[0:4]).tobytes()).digest()
    assert salted[1] == hashlib.sha256(salted[0] + array("q", tokens[4:8]).tobytes()).digest()
    other = block_keys(tokens, 4, ROOT, salt="tenant-b")
    assert len(salted) == len(plain) == len(other) == 3
    assert not set(salted) & set(plain) and not set(salted) & set(other) and not set(plain) & set(other)
    assert block_keys(tokens, 4, ROOT, salt="tenant-a") == salted
    assert block_keys(tokens, 4, salted[0], start=1, salt="tenant-a") == salted[1:]  # only block 0 takes it
    assert salt_key("a") != salt_key("b") and len(salt_key("x" * 10_000)) == 32


# -- the allocator --------------------------------------------------------------------------------


def test_shared_blocks_are_reference_counted_and_free_only_when_the_last_holder_releases() -> None:
    a = BlockAllocator(4)
    b0, b1 = a.allocate(2)
    assert a.register(b0, b"k0") and a.register(b1, b"k1")
    assert a.lookup([b"k0", b"k1", b"k2"]) == [b0, b1] and a.lookup([b"k1"]) == [b1]
    a.acquire([b0, b1])  # a second request shares them
    assert a.refcount(b0) == 2 and a.num_free == 2
    a.free([b0, b1])
    assert a.refcount(b0) == 1 and a.num_free == 2  # still held by the first
    a.free([b0, b1])
    assert a.num_free == 4 and a.num_cached == 2 and a.num_cached_free == 2
    assert a.lookup([b"k0", b"k1"]) == [b0, b1]  # released, still cached
    with pytest.raises(KVBlockError, match="not handed out"):
        a.free([b0])  # one release too many
    with pytest.raises(KVBlockError, match="not cached"):
        a.acquire([2])


def test_empty_blocks_go_first_then_the_least_recently_released_cached_block_is_evicted() -> None:
    """3 blocks: two cached requests' blocks are released (x then y); a new allocation takes the empty
    block, then evicts x's (released first) and forgets its key; y's stays findable."""
    a = BlockAllocator(3)
    x, y = a.allocate(1)[0], a.allocate(1)[0]
    a.register(x, b"x")
    a.register(y, b"y")
    a.free([x])
    a.free([y])
    assert a.allocate(1) == [2]  # the empty one first
    assert a.allocate(1) == [x] and a.lookup([b"x"]) == [] and a.lookup([b"y"]) == [y]
    assert a.evictions_total == 1 and a.num_cached == 1


def test_an_allocation_larger_than_the_empty_blocks_takes_all_of_them_then_evicts() -> None:
    """3 empty and 2 cached free blocks, 5 asked for: every empty block, then both cached ones
    (an allocation that took fewer empty blocks than there were ran out of cached ones to evict,
    a KeyError that ended a serving engine's loop)."""
    a = BlockAllocator(5)
    x, y = a.allocate(2)
    a.register(x, b"x")
    a.register(y, b"y")
    a.free([x, y])
    assert a.num_free == 5 and a.num_cached_free == 2
    got = a.allocate(5)
    assert sorted(got) == [0, 1, 2, 3, 4] and got[:3] == [2, 3, 4]  # the empty ones first, lowest id first
    assert a.num_free == 0 and a.num_cached == 0 and a.evictions_total == 2


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["allocate", "free", "register"]), st.integers(0, 6)), max_size=60))
def test_the_allocator_hands_out_every_free_block_exactly_once(ops: list[tuple[str, int]]) -> None:
    """Random allocations, releases and registrations against a model of who holds what: an
    allocation of at most num_free blocks always succeeds with distinct blocks nobody holds,
    one of more is a KVBlockError that changes nothing, and no block is lost."""
    a = BlockAllocator(6)
    held: list[list[int]] = []
    key = 0
    for op, n in ops:
        if op == "allocate":
            before = a.num_free
            if n > before:
                with pytest.raises(KVBlockError):
                    a.allocate(n)
                assert a.num_free == before
                continue
            got = a.allocate(n)
            assert len(set(got)) == n and not {b for h in held for b in h} & set(got)
            assert a.num_free == before - n
            held.append(got)
        elif op == "free" and held:
            a.free(held.pop(n % len(held)))
        elif op == "register" and held and held[n % len(held)]:
            key += 1
            a.register(held[n % len(held)][0], key.to_bytes(4, "little"))
        assert a.num_free + len({b for h in held for b in h}) == 6


def test_acquiring_a_released_cached_block_saves_it_from_eviction() -> None:
    a = BlockAllocator(2)
    x, y = a.allocate(2)
    a.register(x, b"x")
    a.register(y, b"y")
    a.free([x, y])  # released first to last: y (the tail) is evicted first
    a.acquire([x])
    assert a.allocate(1) == [y] and a.lookup([b"x"]) == [x]
    with pytest.raises(KVBlockError, match="only 0 of 2 are free"):
        a.allocate(1)


def test_a_key_registered_twice_keeps_the_first_block_and_an_unheld_block_cannot_be_cached() -> None:
    a = BlockAllocator(3)
    x, y = a.allocate(2)
    assert a.register(x, b"k") and not a.register(y, b"k") and not a.register(x, b"other")
    assert a.lookup([b"k"]) == [x]
    a.free([y])
    assert a.num_cached_free == 0 and a.num_free == 2  # y was never cached: it is empty again
    with pytest.raises(KVBlockError, match="not held"):
        a.register(y, b"late")


# -- the scheduler --------------------------------------------------------------------------------


def request(name: str, tokens: list[int], max_tokens: int = 64) -> Request:
    return Request(
        request_id=name, tokens=list(tokens), prompt_len=len(tokens), params=SamplingParams(max_tokens=max_tokens),
        stop_ids=frozenset(), on_output=lambda out: None, arrival_time=0.0,
    )


def scheduler(num_blocks: int = 64, *, budget: int = 64, **kw: object) -> Scheduler:
    kv = KVManager(BlockAllocator(num_blocks), 4, PrefixCache(ROOT, 4, **kw))  # type: ignore[arg-type]
    s = Scheduler(kv, max_batch_size=8, max_num_batched_tokens=budget)
    s.watermark = 0
    return s


def step(s: Scheduler, token: int = 0) -> list[tuple[str, int, int]]:
    """One planned step committed as a model would have computed it (each sampling sequence gets
    ``token``), its blocks cached as the engine core does; (request, start, tokens) per sequence."""
    plan = s.schedule()
    for seq in plan.seqs:
        s.commit(seq)
        if seq.samples:
            seq.request.tokens.append(token)
        s.kv.cache_blocks(seq.request)
    return [(q.request.request_id, q.start, q.num_tokens) for q in plan.seqs]


PROMPT = list(range(10, 23))  # 13 tokens: 3 full blocks of 4, then one token


def test_a_repeated_prompt_starts_after_its_full_blocks_and_counts_its_hit() -> None:
    s = scheduler()
    first = request("first", PROMPT)
    s.waiting.append(first)
    assert step(s) == [("first", 0, 13)]
    s.retire(first)
    again = request("again", PROMPT)
    s.waiting.append(again)
    assert step(s) == [("again", 12, 1)]  # 3 cached blocks, the last token computed
    assert again.blocks[:3] == first_blocks(s, PROMPT) and again.num_cached_tokens == 12
    assert (s.kv.prefix_cache.queries_total, s.kv.prefix_cache.hits_total) == (26, 12)


def test_a_salted_request_finds_only_blocks_cached_under_its_own_salt() -> None:
    """The same prompt under salt a, unsalted, and under salt b finds nothing cached the first time
    each; a second request with salt a finds salt a's 3 blocks; the unsalted one finds the unsalted."""
    s = scheduler()

    def run(name: str, salt: str | None) -> Request:
        r = request(name, PROMPT)
        r.params = SamplingParams(max_tokens=64, cache_salt=salt)
        s.waiting.append(r)
        step(s)
        s.retire(r)
        return r

    assert run("a1", "a").num_cached_tokens == 0
    assert run("plain1", None).num_cached_tokens == 0
    assert run("b1", "b").num_cached_tokens == 0
    assert run("a2", "a").num_cached_tokens == 12
    assert run("plain2", None).num_cached_tokens == 12
    assert s.kv.pool.num_cached == 9  # three chains of 3 blocks


def first_blocks(s: Scheduler, tokens: list[int]) -> list[int]:
    return s.kv.pool.lookup(block_keys(tokens, 4, ROOT))


def test_a_prompt_of_whole_blocks_recomputes_its_last_block_and_a_different_prompt_finds_nothing() -> None:
    s = scheduler()
    whole = PROMPT[:12]
    s.waiting.append(request("a", whole))
    step(s)
    s.waiting.append(b := request("b", whole))
    assert step(s)[-1] == ("b", 8, 4)  # the block of the last token is computed again
    s.waiting.append(c := request("c", [t + 100 for t in whole]))
    assert step(s)[-1] == ("c", 0, 12) and c.num_cached_tokens == 0 and b.num_cached_tokens == 8


def test_two_requests_forked_from_one_cached_prefix_share_its_blocks_and_never_write_them() -> None:
    """Both forks hold the same 3 blocks (2 references each) and every position they are scheduled
    to compute lies past them; their own blocks differ."""
    s = scheduler()
    s.waiting.append(parent := request("parent", [*PROMPT[:12], 1]))
    step(s)
    s.retire(parent)
    x, y = request("x", [*PROMPT[:12], 7, 8]), request("y", [*PROMPT[:12], 9])
    s.waiting.extend([x, y])
    assert step(s) == [("x", 12, 2), ("y", 12, 1)]
    assert x.blocks[:3] == y.blocks[:3] and x.blocks[3] != y.blocks[3]
    assert all(s.kv.pool.refcount(b) == 2 for b in x.blocks[:3])
    for _ in range(6):
        for name, start, _n in step(s):
            assert start >= 12, f"{name} would write a shared block"
    s.retire(x)
    assert all(s.kv.pool.refcount(b) == 1 for b in y.blocks[:3])


def test_preempting_a_request_that_shares_blocks_releases_only_its_references() -> None:
    """On 6 blocks: a and b share a 2-block prefix; when a needs a block and none is free, b (the newest)
    is preempted: the shared blocks stay with a, and b is readmitted after its cached blocks."""
    s = scheduler(6)
    shared = list(range(1, 9))
    s.waiting.append(seed := request("seed", [*shared, 50]))
    step(s)
    s.retire(seed)
    a, b = request("a", [*shared, 1, 2, 3, 4]), request("b", [*shared, 5, 6, 7])
    s.waiting.extend([a, b])
    step(s)  # a: 3 blocks (2 shared), b: 3 blocks (2 shared) -> 4 distinct blocks... plus growth
    assert a.blocks[:2] == b.blocks[:2]
    while not s.preemptions_total:
        step(s)
    assert b.blocks == [] and s.waiting[0] is b
    assert all(s.kv.pool.refcount(blk) == 1 for blk in a.blocks[:2])
    s.retire(a)
    readmitted = step(s)
    assert readmitted[0][0] == "b" and readmitted[0][1] >= 8  # its prefix (and its own full blocks) were cached


def test_with_a_draft_a_block_is_cached_once_both_models_computed_it() -> None:
    """has_draft: the block waits for draft_cached; lookahead 1 keys it over the next token too, so a
    prompt with another token after the block does not find it."""
    s = scheduler(has_draft=True, lookahead=1)
    r = request("r", [*PROMPT[:8], 1, 2])
    s.waiting.append(r)
    step(s)
    assert s.kv.pool.num_cached == 0  # the draft has computed nothing
    r.draft_cached = 8
    s.kv.cache_blocks(r)
    assert s.kv.pool.num_cached == 2
    s.waiting.append(same := request("same", [*PROMPT[:8], 1, 5]))
    s.waiting.append(other := request("other", [*PROMPT[:8], 3, 5]))
    step(s)
    assert same.num_cached_tokens == 8 and other.num_cached_tokens == 4


def test_without_a_namespace_nothing_is_cached_or_counted() -> None:
    s = Scheduler(KVManager(BlockAllocator(16), 4), max_batch_size=8, max_num_batched_tokens=64)
    s.waiting.append(r := request("r", PROMPT))
    step(s)
    s.retire(r)
    s.waiting.append(again := request("again", PROMPT))
    assert step(s) == [("again", 0, 13)] and s.kv.pool.num_cached == 0
    assert (s.kv.prefix_cache.queries_total, again.num_cached_tokens) == (0, None)


def test_a_request_that_cannot_be_admitted_gives_back_the_cached_blocks_it_found() -> None:
    """5 blocks: 3 hold a cached prefix, a running request holds the 2 others; a request with that
    prefix finds the 3 blocks but has no block for its last token: it stays waiting, holding nothing,
    and the 3 blocks stay cached and free."""
    s = scheduler(5)
    s.waiting.append(seed := request("seed", PROMPT))  # 4 blocks, 3 of them cached
    step(s)
    s.retire(seed)
    s.waiting.append(hog := request("hog", [99] * 5))  # the 2 empty blocks; decodes to 8 tokens in them
    step(s)
    assert s.kv.pool.num_free == 3 == s.kv.pool.num_cached_free
    s.waiting.append(late := request("late", PROMPT))
    assert step(s) == [("hog", 5, 1)] and late.blocks == [] and s.waiting[0] is late and late.num_cached == 0
    assert late.num_cached_tokens is None and s.kv.prefix_cache.hits_total == 0  # not admitted: nothing counted
    found = first_blocks(s, PROMPT)
    assert len(found) == 3 and all(s.kv.pool.refcount(b) == 0 for b in found) and s.kv.pool.num_free == 3
    s.retire(hog)
    assert step(s) == [("late", 12, 1)] and late.num_cached_tokens == 12

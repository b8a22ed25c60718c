"""Engine.generate from several threads at once: each call gets its solo tokens, calls wait for blocks."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from rtpcore import Engine
from rtpcore.errors import EngineClosedError, InvalidRequestError

PROMPTS = [[5, 9, 33], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [100], [7, 7], [3, 1, 4, 1, 5, 9]]
# one call per thread: different prompts, lengths and batch sizes
CALLS = [PROMPTS[i:] + PROMPTS[:i] for i in range(len(PROMPTS))] + [[p] for p in PROMPTS[:3]]
NEW = 12
#: How long a test waits for a thread that a fast machine finishes at once: only against a hang.
PATIENCE_S = 300.0


@pytest.fixture(scope="module")
def solo(ckpt: Path) -> list[list[list[int]]]:
    """Each call's tokens when it runs alone."""
    with Engine.from_pretrained(ckpt, tokens_per_block=4) as e:
        return [e.generate(c, max_new_tokens=NEW, stop_token_ids=[]) for c in CALLS]


def run_threads(targets: list[Callable[[], Any]]) -> list[Any]:
    """Start every target at once on its own thread; each result or exception, in order."""
    results: list[Any] = [None] * len(targets)
    start = threading.Barrier(len(targets))

    def body(i: int) -> None:
        start.wait()
        try:
            results[i] = targets[i]()
        except BaseException as exc:  # collected for the test to assert on
            results[i] = exc

    threads = [threading.Thread(target=body, args=(i,)) for i in range(len(targets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(PATIENCE_S)
        assert not t.is_alive(), "a generate call did not finish"
    return results


def test_concurrent_calls_give_each_call_its_solo_tokens(ckpt: Path, solo: list[list[list[int]]]) -> None:
    """Eight threads generating at once get exactly what each call gets alone; every block comes back."""
    with Engine.from_pretrained(ckpt, tokens_per_block=4) as e:
        outs = run_threads([lambda c=c: e.generate(c, max_new_tokens=NEW, stop_token_ids=[]) for c in CALLS])
        assert outs == solo
        assert e.num_free_kv_blocks == e.num_kv_blocks


def test_calls_wait_for_blocks_other_calls_hold_and_never_fail_for_that(
    ckpt: Path, solo: list[list[list[int]]]
) -> None:
    """With blocks for one long prompt only, concurrent calls wait their turn and all finish correctly."""
    with Engine.from_pretrained(ckpt, tokens_per_block=4) as probe:
        block_bytes = sum(s.block_bytes for s in probe.kv_cache_specs)
    with Engine.from_pretrained(ckpt, tokens_per_block=4, kv_cache_memory=8 * block_bytes, max_model_len=32) as e:
        assert e.num_kv_blocks == 8  # the longest prompt needs 7: demand is several times the pool
        outs = run_threads([lambda c=c: e.generate(c, max_new_tokens=NEW, stop_token_ids=[]) for c in CALLS])
        assert outs == solo
        assert e.num_free_kv_blocks == 8


def hold_first_forward(e: Engine, monkeypatch: pytest.MonkeyPatch, until: threading.Event) -> threading.Event:
    """Make the engine's first forward wait for ``until`` (its call then holds its KV blocks
    for as long as the test needs); returns the event set once that forward has begun."""
    held = threading.Event()
    run = e._group.run

    def holding_run(method: str, *args: Any, **kwargs: Any) -> Any:
        if method in ("forward", "forward_greedy") and not held.is_set():  # the greedy steps pick on the device
            held.set()
            until.wait(PATIENCE_S)
        return run(method, *args, **kwargs)

    monkeypatch.setattr(e._group, "run", holding_run)
    return held


def test_a_call_that_can_never_fit_fails_at_once_while_others_hold_blocks(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt + max_new_tokens beyond max_model_len raises InvalidRequestError at once, even while another
    call runs."""
    with Engine.from_pretrained(ckpt, tokens_per_block=4) as probe:
        block_bytes = sum(s.block_bytes for s in probe.kv_cache_specs)
    with Engine.from_pretrained(ckpt, tokens_per_block=4, kv_cache_memory=8 * block_bytes, max_model_len=32) as e:
        release = threading.Event()
        held = hold_first_forward(e, monkeypatch, release)
        worker = threading.Thread(
            target=lambda: e.generate([PROMPTS[1]], max_new_tokens=12, stop_token_ids=[])
        )
        worker.start()
        try:
            assert held.wait(PATIENCE_S), "the long call never stepped"
            # The long call is inside its first step, holding its blocks until `release`: a call
            # that waited for blocks would wait for it, so failing here is failing at once.
            with pytest.raises(InvalidRequestError) as excinfo:
                e.generate([list(range(1, 40))], max_new_tokens=4)
            assert e.num_free_kv_blocks < 8 and not release.is_set()
        finally:
            release.set()
            worker.join(PATIENCE_S)
        assert not worker.is_alive()
        assert (excinfo.value.field, excinfo.value.code) == ("max_new_tokens", "context_length_exceeded")


def test_close_makes_running_and_waiting_calls_raise_engine_closed_error(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Closing the engine while one call runs and another waits for its blocks ends both with EngineClosedError."""
    with Engine.from_pretrained(ckpt, tokens_per_block=4) as probe:
        block_bytes = sum(s.block_bytes for s in probe.kv_cache_specs)
    e = Engine.from_pretrained(ckpt, tokens_per_block=4, kv_cache_memory=8 * block_bytes, max_model_len=32)
    long = [1, 2, 3, 4]  # 4 + 24 - 1 tokens: 7 of the 8 blocks, for 24 steps
    errors: list[BaseException | None] = [None, None]
    # The first step waits until close() has ended the requests: no call can finish first.
    closing = threading.Event()
    core_close = e._core.close

    def close_core(error: Any) -> None:
        core_close(error)
        closing.set()

    monkeypatch.setattr(e._core, "close", close_core)
    held = hold_first_forward(e, monkeypatch, closing)

    def call(i: int) -> None:
        try:
            e.generate([long], max_new_tokens=24, stop_token_ids=[])
        except BaseException as exc:  # collected for the test to assert on
            errors[i] = exc

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    assert held.wait(PATIENCE_S), "no call stepped"
    assert e.num_free_kv_blocks < 8  # one call is in its first step, holding its blocks
    e.close()
    for t in threads:
        t.join(PATIENCE_S)
        assert not t.is_alive()
    assert all(isinstance(err, EngineClosedError) for err in errors), errors

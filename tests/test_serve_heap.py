"""The collector's pauses on a serving process (rtpcore.serving.heap) and the body parser's
worker priority (rtpcore.serving.json_body): the mechanisms behind benchmarks/bench_hostile.py's
/health figures, checked on the real collector and a real worker process."""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Iterator

import pytest

from rtpcore.serving.heap import freeze_long_lived, long_lived
from rtpcore.serving.json_body import BodyParser


@pytest.fixture
def clean_collector() -> Iterator[None]:
    """Whatever a test froze goes back to the collector afterwards; the collector is on."""
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    if enabled:
        gc.enable()
    else:
        gc.disable()


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_freeze_long_lived_collects_the_garbage_then_freezes_the_rest(clean_collector: None) -> None:
    gc.unfreeze()
    garbage = _Node()
    kept = [_Node() for _ in range(100)]
    del garbage
    freeze_long_lived("a test")
    assert not any(type(o) is _Node and o not in kept for o in gc.get_objects()), "the cycle was not collected"
    assert gc.get_freeze_count() >= 100
    assert not any(o is kept for o in gc.get_objects())  # frozen objects are out of every generation


def test_long_lived_builds_with_the_collector_off_and_freezes_before_it_is_on(clean_collector: None) -> None:
    gc.unfreeze()
    gc.enable()
    collections_before = sum(s["collections"] for s in gc.get_stats())
    with long_lived("a test build"):
        assert not gc.isenabled()
        built = [_Node() for _ in range(50_000)]  # enough allocations to set off collections were it on
        assert sum(s["collections"] for s in gc.get_stats()) == collections_before
    assert gc.isenabled()
    assert gc.get_freeze_count() >= len(built)
    assert not any(o is built for o in gc.get_objects()), "the build's objects are still walked by the collector"


def test_long_lived_turns_the_collector_back_on_when_the_build_raises(clean_collector: None) -> None:
    gc.enable()
    with pytest.raises(RuntimeError, match="the build failed"), long_lived("a failing build"):
        raise RuntimeError("the build failed")
    assert gc.isenabled()


def test_long_lived_leaves_a_collector_that_was_off_off(clean_collector: None) -> None:
    gc.disable()
    with long_lived("a build"):
        pass
    assert not gc.isenabled()


def test_nested_builds_keep_the_collector_off_until_the_last_ends(clean_collector: None) -> None:
    gc.enable()
    with long_lived("outer"):
        with long_lived("inner"):
            pass
        assert not gc.isenabled()
    assert gc.isenabled()


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="os.getpriority is POSIX only")
def test_the_body_parser_worker_runs_at_a_lower_priority_than_the_server() -> None:
    parser = BodyParser()
    try:
        parser.start()
        pid = parser.worker_pid()
        assert pid is not None and pid != os.getpid()
        worker = os.getpriority(os.PRIO_PROCESS, pid)
    finally:
        parser.close()
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    assert worker == min(ours + 10, 19), f"the worker's nice value is {worker}, the server's {ours}"
    assert parser.worker_pid() is None


def test_a_large_body_is_parsed_in_the_started_worker_and_held_to_the_rules() -> None:
    parser = BodyParser(offload_bytes=16)
    try:
        parser.start()
        pid = parser.worker_pid()
        parsed = asyncio.run(parser.parse(b'{"prompt": "' + b"x" * 64 + b'"}'))
        deep = asyncio.run(parser.parse(b"[" * 100 + b"]" * 100))
        surrogate = asyncio.run(parser.parse(b'{"messages": [{"content": "a\\ud800b"}]}'))
        broken = asyncio.run(parser.parse(b'{"prompt": "unterminated ' + b"x" * 32))
        assert parser.worker_pid() == pid  # one worker parsed them all
    finally:
        parser.close()
    assert parsed.ok and parsed.value == {"prompt": "x" * 64}
    assert deep.too_deep and not deep.ok
    assert surrogate.surrogate == "messages[0].content"
    assert broken.invalid is not None and "Unterminated string" in broken.invalid[0]


def test_a_worker_that_dies_is_replaced_and_the_body_still_parsed() -> None:
    import signal

    parser = BodyParser(offload_bytes=16)
    try:
        parser.start()
        first = parser.worker_pid()
        assert first is not None
        os.kill(first, signal.SIGKILL)
        parsed = asyncio.run(parser.parse(b'{"prompt": "' + b"y" * 64 + b'"}'))  # parsed here: the worker died
        assert parsed.value == {"prompt": "y" * 64}
        again = asyncio.run(parser.parse(b'{"prompt": "' + b"z" * 64 + b'"}'))
        second = parser.worker_pid()
    finally:
        parser.close()
    assert again.value == {"prompt": "z" * 64}
    assert second is not None and second != first

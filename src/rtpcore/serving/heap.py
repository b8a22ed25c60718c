"""Keeping the garbage collector's pauses short on a serving process (docs/serving.md "The
event loop stays free").

CPython's cyclic collector stops every thread while it walks the objects of the generation it
collects, and the oldest generation holds everything a server imported: torch, the tokenizer,
FastAPI, and, once a request asks for structured output, the grammar library with
``torch.compile``'s imports behind it (sympy, transformers). Measured by
``benchmarks/bench_hostile.py`` with a GC callback: without this module a full collection of
such a server walks 200,000-460,000 objects and holds the event loop for 80-300 ms, the worst
``/health`` answers of every hostile load.

:func:`freeze_long_lived` collects what is garbage now and moves every object that survives
into the permanent generation (``gc.freeze``, what Instagram's and vLLM's servers do after
start-up): full collections then walk only what was created since, the requests in flight.
The server calls it once its app has started (with a collection first: no request is
answered yet), and :func:`long_lived` around a one-off build that imports a library while
requests run (the grammar compiler: no collection then, a full one would hold every thread).
What is frozen is never collected as a cycle again: a request in flight at that moment whose
objects later become cyclic garbage keeps them, once, a bounded cost for a call made once or
twice per process.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Iterator

__all__ = ["freeze_long_lived", "long_lived"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()


def freeze_long_lived(after: str) -> None:
    """Collect garbage, then freeze every object left (``after`` names what was just built, for
    the log). The collection walks every object not frozen yet while holding the GIL (100-200
    ms once the grammar library is imported): this is for a process not yet answering requests.
    While requests run, use :func:`long_lived`."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.debug("after %s: the objects alive are frozen out of the collector's walks (%.0f ms)",
                 after, 1000 * (time.perf_counter() - start))


_building = 0  # builds inside long_lived now (the collector is off while there is one)
_was_enabled = True


@contextlib.contextmanager
def long_lived(what: str) -> Iterator[None]:
    """Build something long-lived (``what``, for the log) while requests run: the collector is
    off during the build, and what the build created is frozen before it is on again, with no
    collection. A build that imports libraries creates objects by the hundred thousand: every
    collection during it walks them again (measured: the grammar compiler's first build set off
    full collections of 20-85 ms, one after another), and the first one after it would walk
    them all (90 ms). Freezing takes microseconds. The collector is on again after the last
    build running ends (unless it was off before the first), also when a build raises. Garbage
    a build left in cycles is frozen with the rest: a one-off cost of memory, never walked."""
    global _building, _was_enabled
    with _lock:
        if _building == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _building += 1
    start = time.perf_counter()
    try:
        yield
    finally:
        with _lock:
            _building -= 1
            if _building == 0:
                gc.freeze()  # before the collector is on: no collection ever walks the build's objects
                if _was_enabled:
                    gc.enable()
        logger.debug("built %s (%.0f ms); its objects are frozen out of the collector's walks",
                     what, 1000 * (time.perf_counter() - start))

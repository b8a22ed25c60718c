"""``AsyncEngine``: an :class:`~rtpcore.engine.engine.Engine` stepped by one background
thread, for asyncio callers (the HTTP server is one).

Requests join and leave the running batch between steps (continuous batching, the
engine core of ``rtpcore.engine.core``: a token budget, chunked prefill, KV blocks on
demand with preemption). The loop thread
sleeps while no request waits or runs and steps the core while any does; each step
hands every request its :class:`~rtpcore.engine.core.RequestOutput`, which reaches
the request's asyncio queue through ``loop.call_soon_threadsafe``::

    async with AsyncEngine.from_pretrained(path, max_waiting=64) as engine:
        async for out in engine.stream(prompt_ids, SamplingParams(max_tokens=64)):
            out.token_ids, out.finish_reason

:meth:`AsyncEngine.stream` checks and queues the request at once (a bad request, one
that could never fit the cache, a full queue or a closed engine raise there, before
any iteration), and returns a :class:`RequestStream`. A consumer that stops early --
``aclose()``, ``break`` (the stream is dropped), its task cancelled -- aborts the
request, and its KV blocks are free by the end of the step in progress. A request whose
own step failed (a model fault on it, a non-finite distribution) raises its
RequestFailedError from its stream; the others go on. A fault that is not a request's
(the worker group broken) ends every stream with it, stops the loop, sets ``broken`` and
calls each ``on_broken`` callback. ``aclose()`` aborts
every open stream (they end with finish_reason ``"abort"``), stops the thread and
closes the engine.

``Engine.generate`` may run on the same engine from other threads meanwhile: both
feed the one core.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from rtpcore.engine.core import EngineStats, RequestOutput
from rtpcore.engine.engine import Engine
from rtpcore.engine.sampling import SamplingParams
from rtpcore.engine.speculative import SpeculativeStats
from rtpcore.errors import EngineClosedError, RtpcoreError

__all__ = ["AsyncEngine", "RequestStream"]

logger = logging.getLogger(__name__)


class RequestStream:
    """The outputs of one request, as an async iterator: each item holds the tokens
    produced since the previous one (several steps' worth when the consumer lags);
    the last has a ``finish_reason``. A request that failed raises its RtpcoreError."""

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue[RequestOutput]):
        self.request_id = request_id
        self._engine = engine
        self._queue = queue
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            out = await self._queue.get()
        except BaseException:  # cancelled: the consumer is gone
            self._abort()
            raise
        while not out.finished and not self._queue.empty():
            out = out.merge(self._queue.get_nowait())
        if out.finished:
            self._done = True
        if out.error is not None:
            raise out.error
        return out

    async def aclose(self) -> None:
        """Abort the request unless it has finished."""
        self._abort()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._abort()

    def _abort(self) -> None:
        if not self._done:
            self._done = True
            self._engine._abort_now(self.request_id)

    def __del__(self) -> None:
        if not getattr(self, "_done", True):  # dropped mid-stream (``break``)
            self._abort()


class AsyncEngine:
    """An engine with a background step loop. Build it with :meth:`from_pretrained`
    (``Engine.from_pretrained``'s keywords -- ``device``, ``draft_model`` and
    ``num_speculative_tokens`` included -- plus ``max_waiting``) or around a built
    engine: ``AsyncEngine(engine)``, which then owns it (``aclose`` closes it).

    ``max_waiting``: None, or how many requests may wait for admission; one more is
    refused at once with :class:`~rtpcore.errors.QueueFullError`.
    """

    def __init__(self, engine: Engine, *, max_waiting: int | None = None):
        if max_waiting is not None and (isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1):
            raise RtpcoreError(f"max_waiting must be a positive integer or None, got {max_waiting!r}")
        self.engine = engine
        self.max_waiting = max_waiting
        self._core = engine._core
        self._stop = False
        self._closed = False
        # A fault that is not a request's breaks the engine: the loop stops, every request ends
        # with it, and each callback here runs once with it (rtpcore serve drains and exits 1).
        self.broken: RtpcoreError | None = None
        self.on_broken: list[Callable[[RtpcoreError], None]] = []
        self._thread = threading.Thread(target=self._run, name="rtpcore-engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike[str], *, max_waiting: int | None = None, **engine_kwargs: Any
    ) -> AsyncEngine:
        """Build the engine (blocking: it loads the checkpoint) and start its loop."""
        return cls(Engine.from_pretrained(path, **engine_kwargs), max_waiting=max_waiting)

    # -- requests --------------------------------------------------------------------------

    def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> RequestStream:
        """Queue a request and return its stream. Raises at once, with nothing queued:
        InvalidRequestError (a bad prompt, request id or settings), KVCacheCapacityError
        (the prompt and ``max_tokens`` could never fit the cache), QueueFullError,
        EngineClosedError. Call it on the event loop that iterates the stream."""
        if self._closed:
            raise EngineClosedError("this AsyncEngine is closed")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def deliver(out: RequestOutput) -> None:  # on the stepping thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, out)
            except RuntimeError:  # the event loop is closed: nobody will read this request
                if not out.finished:
                    self._core.abort(out.request_id)

        request_id = self._core.add_request(
            prompt_ids, params if params is not None else SamplingParams(), deliver,
            request_id=request_id, max_waiting=self.max_waiting,
        )
        return RequestStream(self, request_id, queue)

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> RequestOutput:
        """The whole request as one output (every token; the final finish_reason)."""
        result: RequestOutput | None = None
        async with self.stream(prompt_ids, params, request_id) as stream:
            async for out in stream:
                result = out if result is None else result.merge(out)
        if result is None:  # pragma: no cover - a stream always ends with an output
            raise RtpcoreError(f"request {request_id!r} ended without an output")
        return result

    async def abort(self, request_id: str) -> bool:
        """End a request with finish_reason "abort"; False when none such runs or waits."""
        return self._abort_now(request_id)

    def _abort_now(self, request_id: str) -> bool:
        return self._core.abort(request_id)

    def stats(self) -> EngineStats:
        """Running and waiting requests, KV blocks and counters, now."""
        return self._core.stats()

    @property
    def speculative_stats(self) -> SpeculativeStats:
        """Draft tokens proposed and accepted so far (``Engine.speculative_stats``)."""
        return self._core.speculative_stats

    # -- the loop ----------------------------------------------------------------------------

    def _run(self) -> None:
        core = self._core
        while True:
            core.wait_for_work(lambda: self._stop)
            if self._stop:
                return
            try:
                if not self.engine._step():
                    time.sleep(0.001)  # work, but nothing to run yet
            except EngineClosedError:
                return  # closed under us: the core ended every request
            except BaseException as exc:  # a bug: end every request rather than hang them
                logger.exception("the engine loop failed")
                error = RtpcoreError(f"the engine loop failed: {type(exc).__name__}: {exc}")
                error.__cause__ = exc
                core.close(error)
                return
            broken = self.engine.broken
            if broken is not None:
                self._break(broken)
                return

    def _break(self, error: RtpcoreError) -> None:
        logger.error("the engine is broken and stops serving: %s", error)
        self.broken = error
        self._core.close(error)
        for callback in self.on_broken:
            try:
                callback(error)
            except Exception:
                logger.exception("an on_broken callback failed")

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Abort every request, stop the loop and close the engine (blocking; idempotent)."""
        if not self._closed:
            self._closed = True
            self._core.abort_all()
        self._stop = True
        self._core.wake()
        if self._thread is not threading.current_thread():
            self._thread.join()
        self.engine.close()

    async def aclose(self) -> None:
        """:meth:`close` without blocking the event loop."""
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<AsyncEngine {'closed' if self._closed else 'running'} over {self.engine!r}>"

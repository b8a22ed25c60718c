"""``AsyncEngine``: an :class:`~rtpcore.engine.engine.Engine` stepped by one background
thread, for asyncio callers (the HTTP server is one).

Requests join and leave the running batch between steps (continuous batching, the
engine core of ``rtpcore.engine.engine_core``: a token budget, chunked prefill, KV blocks on
demand with preemption). The loop thread
sleeps while no request waits or runs and steps the core while any does; each step
hands every request its :class:`~rtpcore.engine.core.outputs.RequestOutput`, which reaches
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

:meth:`AsyncEngine.generate` is the text-level call (vLLM's ``AsyncLLM.generate``): a
prompt as text or ids, and an async generator of cumulative outputs
(:class:`~rtpcore.engine.text.outputs.GenerationOutput`: text with stop strings cut, ``n``
sequences), built as ``Engine.generate``'s outputs form builds them::

    async for out in engine.generate("Hello", SamplingParams(max_tokens=64, stop=["\\n"])):
        out.outputs[0].text, out.finished

``Engine.generate`` may run on the same engine from other threads meanwhile: both
feed the one core.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

from rtpcore.engine.config import options_signature
from rtpcore.engine.core.outputs import EngineStats, RequestOutput, StepReport
from rtpcore.engine.engine import Engine
from rtpcore.engine.sample.params import SamplingParams
from rtpcore.engine.sample.speculative import SpeculativeStats
from rtpcore.engine.text.output_processor import PromptRun
from rtpcore.engine.text.outputs import GenerationOutput
from rtpcore.engine.text.prompts import prompt_items
from rtpcore.errors import EngineClosedError, InvalidRequestError, RtpcoreError

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

    def set_paused(self, paused: bool) -> bool:
        """Pause the request (a consumer that cannot take more: it is not scheduled and gives
        up its KV blocks) or resume it (:meth:`AsyncEngine.set_paused`)."""
        return not self._done and self._engine.set_paused(self.request_id, paused)

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
        self._core = engine.core
        self._stop = False
        self._closed = False
        self._groups: dict[str, list[str]] = {}  # a generate request of n sequences -> their engine requests
        # A fault that is not a request's breaks the engine: the loop stops, every request ends
        # with it, and each callback here runs once with it (rtpcore serve drains and exits 1).
        self.broken: RtpcoreError | None = None
        self.on_broken: list[Callable[[RtpcoreError], None]] = []
        self._thread = threading.Thread(target=self._run, name="rtpcore-engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    @options_signature
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        plugins: Iterable[str] = (),
        external_model_packages: Iterable[str] = (),
        *,
        max_waiting: int | None = None,
        **options: Any,
    ) -> AsyncEngine:
        """Build the engine (blocking: it loads the checkpoint; the arguments of
        ``Engine.from_pretrained``) and start its loop."""
        return cls(Engine.from_pretrained(path, plugins, external_model_packages, **options), max_waiting=max_waiting)

    # -- requests --------------------------------------------------------------------------

    def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> RequestStream:
        """Queue a request and return its stream. Raises at once, with nothing queued:
        InvalidRequestError (a bad prompt, request id or settings), KVCacheCapacityError
        (the prompt and ``max_tokens`` could never fit the cache), QueueFullError,
        EngineClosedError. Call it on the event loop that iterates the stream. A stream is one
        sequence of token ids: ``params.n`` must be 1, and stop strings are only carried (the
        text layers, :meth:`generate` and the server, honour them)."""
        if self._closed:
            raise EngineClosedError("this AsyncEngine is closed")
        if params is not None and isinstance(params, SamplingParams) and params.n != 1:
            raise InvalidRequestError(f"stream runs one sequence, got n={params.n}; AsyncEngine.generate runs n",
                                      field="n", value=params.n)
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
        self, prompt: Any, sampling_params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[GenerationOutput]:
        """Run one prompt and yield its :class:`~rtpcore.engine.text.outputs.GenerationOutput` as it
        grows (vLLM's ``AsyncLLM.generate``): each item is cumulative -- the whole text and
        token ids so far of every one of ``sampling_params.n`` sequences -- with ``finished``
        False until the last. ``prompt`` is a string, token ids, ``{"prompt": str}`` or
        ``{"prompt_token_ids": [...]}``; encoding, stop ids, stop strings and ``n`` are those
        of ``Engine.generate``'s outputs form (and of ``rtpcore serve``). ``request_id`` (a
        fresh one when None) names the request for :meth:`abort`.

        An async generator runs nothing until it is first iterated: a bad prompt or setting,
        a full queue or a closed engine raise from the first ``__anext__``. A consumer that
        stops early aborts the request once the generator is closed (``aclose()``, or
        ``contextlib.aclosing`` around the loop for at once; garbage collection otherwise). A
        failed request raises its RtpcoreError. For the tokens of each step as they come, use
        :meth:`stream`."""
        if self._closed:
            raise EngineClosedError("this AsyncEngine is closed")
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be a SamplingParams, got {type(params).__name__}",
                                      field="sampling_params", value=params)
        items = prompt_items(prompt)
        if len(items) != 1:
            raise InvalidRequestError(f"AsyncEngine.generate takes one prompt, got {len(items)}; call it once per "
                                      "prompt", field="prompt", value=prompt)
        if request_id is None:
            request_id = uuid.uuid4().hex
        elif not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request_id must be a non-empty string, got {request_id!r}",
                                      field="request_id", value=request_id)
        text = self.engine.text
        # Loading the tokenizer (the first time) and encoding stay off the event loop.
        run = await asyncio.to_thread(lambda: PromptRun(request_id, text.encode(items)[0], params, text))
        ids = self._core.check_prompt(list(run.prompt.token_ids), params.max_tokens)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

        def deliver(i: int, out: RequestOutput) -> None:  # on the stepping thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (i, out))
            except RuntimeError:  # the event loop is closed: nobody will read this request
                if not out.finished:
                    self._core.abort(out.request_id)

        pending = set(range(len(run.requests)))
        children = [child for child, _ in run.requests]
        if children != [request_id]:
            self._groups[request_id] = children
        try:
            for i, (child, child_params) in enumerate(run.requests):
                self._core.add_request(ids, child_params, functools.partial(deliver, i), request_id=child,
                                       max_waiting=self.max_waiting, checked=True)
            while pending:
                got = [await queue.get()]
                while not queue.empty():  # a lagging consumer takes several steps at once
                    got.append(queue.get_nowait())
                changed = False
                for i, out in got:
                    if i not in pending:
                        continue  # ended already: this is the abort of a request its text ended
                    changed = True
                    if run.states[i].add(out):
                        pending.discard(i)
                        if not out.finished:  # a stop string ended it
                            self._core.abort(children[i])
                error = run.error
                if error is not None:
                    raise error
                if changed:
                    yield run.output()
        finally:
            self._groups.pop(request_id, None)
            for i in pending:
                self._core.abort(children[i])

    async def abort(self, request_id: str) -> bool:
        """End a request with finish_reason "abort" (every sequence of a :meth:`generate`
        request); False when none such runs or waits."""
        children = self._groups.get(request_id)
        if children is not None:
            return any([self._abort_now(child) for child in children])
        return self._abort_now(request_id)

    def set_paused(self, request_id: str, paused: bool) -> bool:
        """Pause a request (every sequence of a :meth:`generate` request) or resume it. A paused
        request is not scheduled from the next step on and holds no KV blocks nor batch slot;
        resumed, it goes on where it stopped (recomputing what it held, from the prefix cache
        when that is on). A consumer that reads slower than the engine writes -- a server's
        stream whose client stopped reading -- pauses its request instead of buffering its
        output without bound. False when no such request runs or waits. Callable from any
        thread."""
        children = self._groups.get(request_id)
        ids = children if children is not None else [request_id]
        return any([self._core.set_paused(i, paused) for i in ids])

    def abort_all(self) -> int:
        """End every request with finish_reason "abort" (a server's shutdown past its timeout);
        how many there were. Callable from any thread."""
        return self._core.abort_all()

    def _abort_now(self, request_id: str) -> bool:
        return self._core.abort(request_id)

    @property
    def failure(self) -> RtpcoreError | None:
        """None while the engine serves; else why it cannot (its loop broke, a rank failed, or
        it was closed): every later request fails. A server's health check."""
        return self.broken if self.broken is not None else self.engine.failure

    def add_step_observer(self, observe: Callable[[StepReport], None]) -> None:
        """:meth:`Engine.add_step_observer <rtpcore.engine.engine.Engine.add_step_observer>`."""
        self.engine.add_step_observer(observe)

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
                if not self.engine.step():
                    time.sleep(0.001)  # work, but nothing to run yet
            except EngineClosedError:
                return  # closed under us: the core ended every request
            except BaseException as exc:  # outside every request (a request's own faults end it alone)
                logger.error("the engine loop failed outside any request", exc_info=exc)
                error = RtpcoreError(f"the engine loop failed: {type(exc).__name__}: {exc}")
                error.__cause__ = exc
                self._break(error)  # as a lost rank: every request ends now, /health 503, serve exits 1
                return
            broken = self.engine.broken
            if broken is not None:
                self._break(broken)
                return

    def _break(self, error: RtpcoreError) -> None:
        """The engine can step no more: record why, end every request with ``error`` (an error
        event in each stream, at once) and tell each ``on_broken`` callback."""
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

"""Running one HTTP request: its choices' engine requests (the engine's ``PromptRun``) -> text
deltas (the engine's ``SequenceState``: stop strings cut, one piece per token) -> a whole answer
or server-sent events, logprobs and tool calls in OpenAI's shapes; a client that leaves aborts
them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rtpcore.engine.async_engine import RequestStream
from rtpcore.engine.core.outputs import RequestOutput
from rtpcore.engine.sample.params import SampledToken, SamplingParams
from rtpcore.engine.text.output_processor import PromptRun, SequenceDelta, SequenceState
from rtpcore.engine.text.prompts import Prompt
from rtpcore.engine.text.tokenizer import Tokenizer
from rtpcore.errors import (
    EngineClosedError,
    InvalidRequestError,
    QueueFullError,
    RtpcoreError,
)
from rtpcore.serving.errors import ApiError, failure_body, failure_status
from rtpcore.serving.protocol import (
    ErrorBody,
)
from rtpcore.serving.state import Served
from rtpcore.serving.tools import Tools, ToolStream, tool_finish

__all__ = ['respond']

logger = logging.getLogger(__name__)

class _Choice:
    """One engine request's trip: its outputs through the engine's own
    :class:`~rtpcore.engine.text.output_processor.SequenceState` (the text ``Engine.generate``
    returns, stop strings cut) into deltas, and the request's metrics."""

    def __init__(self, served: Served, request_id: str, params: SamplingParams, state: SequenceState):
        self.served, self.params, self.state = served, params, state
        self.planned_id = request_id
        self.stream: RequestStream | None = None
        self.finish_reason: str | None = None  # what clients see: the sequence's, or "error"
        self.started = asyncio.Event()  # the first output came: the prompt is computed (and cached)
        self.last_time: float | None = None
        self.arrival: float | None = None  # the engine request's arrival time, from its first output

    def submit(self, ids: list[int]) -> None:
        """Queue the engine request; raises an ApiError (nothing queued) when it is refused."""
        try:
            self.stream = self.served.engine.stream(ids, self.params, request_id=self.planned_id)
            self.served.metrics.prompt(len(ids))
        except QueueFullError as exc:
            raise ApiError(429, str(exc), type="rate_limit_error", code="queue_full") from None
        except InvalidRequestError as exc:
            raise ApiError.invalid_request(exc) from None
        except EngineClosedError as exc:
            raise ApiError(503, str(exc), type="server_error") from None

    def end_unsubmitted(self, reason: str) -> None:
        """End a choice that was never queued (its deltas are none)."""
        self._finish(reason)

    @property
    def request_id(self) -> str:
        return self.stream.request_id if self.stream is not None else "-"

    @property
    def completion_tokens(self) -> int:
        """Tokens generated: a stop token counts, those after a stop string's do not."""
        return len(self.state.token_ids)

    async def deltas(self) -> AsyncIterator[SequenceDelta]:
        """The choice's deltas until it ends; raises the RtpcoreError of a failed request. A
        choice cut short (its client left, the server stopped) ends as "abort"."""
        if self.stream is None:  # never queued (end_unsubmitted)
            assert self.finish_reason is not None
            return
        try:
            async with self.stream as stream:
                async for out in stream:
                    self.started.set()
                    self._observe(out)
                    delta = self.state.advance(out)
                    if self.state.finished:  # the engine ended it, or a stop string did (leaving the stream aborts it)
                        self._finish(self.state.finish_reason or "stop")
                        yield delta
                        return
                    if delta.text or delta.tokens or delta.ids:
                        yield delta
        except RtpcoreError:
            self._finish("error")
            raise
        finally:
            if self.finish_reason is None:
                self._finish("abort")
            self.started.set()  # a failed or cut choice 0 must not hold the others back

    def _finish(self, reason: str) -> None:
        """End the choice with ``reason`` (what clients see), counted once in the metrics."""
        if self.finish_reason is None:
            self.finish_reason = reason
            ended = None if self.arrival is None or self.last_time is None else max(0.0, self.last_time - self.arrival)
            self.served.metrics.finished(reason, ended)

    def _observe(self, out: RequestOutput) -> None:
        m = self.served.metrics
        m.tokens(len(out.token_ids))
        self.arrival = out.arrival_time
        for t in out.token_times:
            if self.last_time is None:
                m.first_token(max(0.0, t - out.arrival_time))
            else:
                m.between_tokens(max(0.0, t - self.last_time))
            self.last_time = t


class _Response:
    """One HTTP request's choices, and the shapes they are returned in. Its engine requests are
    a :class:`~rtpcore.engine.text.output_processor.PromptRun`, as ``Engine.generate`` runs the
    same prompt and params: stop ids, ``n`` runs and their seeds are the engine's rules."""

    def __init__(self, served: Served, body: Any, prompt: Prompt, params: SamplingParams, *, chat: bool,
                 tools: Tools | None = None):
        self.served, self.params, self.chat, self.model = served, params, chat, body.model
        self.tools = tools
        # Each choice and chunk carries its token ids when asked, and always without a tokenizer (no text).
        self.token_ids = bool(getattr(body, "return_token_ids", False)) or served.tokenizer is None
        key = uuid.uuid4().hex
        self.id = ("chatcmpl-" if chat else "cmpl-") + key
        self.created = int(time.time())
        # Greedy choices are equal: one run answers every index. Sampled ones each draw (seed + i when seeded).
        self.run = PromptRun(key, prompt, params, served.text)
        self.n = self.run.n
        self.ids = list(prompt.token_ids)
        # Per choice index: how its text becomes content and tool calls.
        self.tool_streams = [tools.stream() if tools is not None else None for _ in range(self.n)]
        # Per choice index: the reasoning parser of --reasoning-parser (chat answers only; not where a
        # grammar constrains the whole answer from its first token: it is all answer then).
        parser = served.reasoning_parser if chat and params.grammar is None else None
        self.reasoning = [parser() if parser is not None else None for _ in range(self.n)]
        self.choices = [_Choice(served, request_id, run_params, state)
                        for (request_id, run_params), state in zip(self.run.requests, self.run.states, strict=True)]
        self.offsets = [0] * self.n  # per choice index: the text streamed so far (completions' text_offset)
        self.paused = False  # the client reads slower than the engine writes (events)

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def submit_first(self) -> None:
        self.choices[0].submit(self.ids)

    async def _start_others(self) -> None:
        """Choices 1.. once choice 0's prompt is computed: they find it in the prefix cache."""
        if len(self.choices) > 1:
            await self.choices[0].started.wait()
            for choice in self.choices[1:]:
                if self.served.cutting:  # shutdown cut choice 0: the others end as it did, never run
                    choice.end_unsubmitted("abort")
                else:
                    choice.submit(self.ids)
                    if self.paused and choice.stream is not None:
                        choice.stream.set_paused(True)

    def _indices(self, run: int) -> range:
        """The choice indices run ``run`` answers (every one for a shared greedy run)."""
        return range(self.n) if len(self.choices) == 1 else range(run, run + 1)

    @property
    def usage(self) -> dict[str, Any]:
        """OpenAI's usage. ``prompt_tokens_details.cached_tokens`` only on a server started with
        ``--enable-prompt-tokens-details``: it tells a client whether a prompt was in the prefix
        cache, that is whether someone sent it before (docs/design.md §17)."""
        per_run = [c.completion_tokens for c in self.choices]
        completion = per_run[0] * self.n if len(self.choices) == 1 else sum(per_run)
        prompt = len(self.ids)
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion}
        if self.served.prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": self.choices[0].state.num_cached_tokens}
        return usage

    async def collect(self) -> dict[str, Any]:
        """The whole answer (non-streamed)."""

        async def run(choice: _Choice) -> list[SequenceDelta]:
            return [d async for d in choice.deltas()]

        first = asyncio.ensure_future(run(self.choices[0]))
        rest: list[asyncio.Future[list[SequenceDelta]]] = []
        try:
            await self._start_others()
            rest = [asyncio.ensure_future(run(c)) for c in self.choices[1:]]
            results = await asyncio.gather(first, *rest)
        except BaseException:
            for task in (first, *rest):
                task.cancel()
            raise
        choices = []
        for r, (choice, deltas) in enumerate(zip(self.choices, results, strict=True)):
            for index in self._indices(r):
                choices.append(self._whole_choice(index, choice, deltas))
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage}

    def _whole_choice(self, index: int, choice: _Choice, deltas: list[SequenceDelta]) -> dict[str, Any]:
        text = choice.state.output(index).text or ""  # the CompletionOutput Engine.generate returns
        tokens = [t for d in deltas for t in d.tokens]
        out: dict[str, Any] = {"index": index, "finish_reason": choice.finish_reason,
                               "logprobs": self._logprobs(tokens, 0)}
        message: dict[str, Any] = {"role": "assistant"}
        thinker = self.reasoning[index]
        if thinker is not None:
            reasoning, text = thinker.extract(text)
            message[self.served.reasoning_field] = reasoning
        stream = self.tool_streams[index]
        if stream is not None:
            content, _ = stream.feed(text)
            rest, _ = stream.finish()
            message["content"] = (content + rest) or None
            if stream.calls:
                message["tool_calls"] = stream.call_objects()
                out["finish_reason"] = tool_finish(choice.finish_reason)
            else:
                message["content"] = content + rest
            out["message"] = message
        elif self.chat:
            message["content"] = text
            out["message"] = message
        else:
            out["text"] = text
        if self.token_ids:
            out["token_ids"] = list(choice.state.output(index).token_ids)
        return out

    def set_paused(self, paused: bool) -> None:
        """Pause (or resume) every choice's engine request: not scheduled, holding no KV blocks."""
        self.paused = paused
        for choice in self.choices:
            if choice.stream is not None:
                choice.stream.set_paused(paused)

    async def events(self, include_usage: bool, request: Request) -> AsyncIterator[bytes]:
        """Server-sent events: chunks of every choice as they come, each finish, usage if asked,
        [DONE]. The client leaving (noticed at once, not only at the next write) or closing
        the generator aborts every choice's request.

        Each choice's chunks are written as its deltas come, into one queue this generator
        sends from; a client that reads slower than the engine writes lets the queue grow, and
        past ``stream_buffer_bytes`` unsent bytes every choice's engine request is paused (not
        scheduled, its KV blocks released) until the client has taken half of them
        (docs/serving.md "Bounded memory per client")."""
        queue: asyncio.Queue[tuple[list[bytes], int, bool]] = asyncio.Queue()
        cap = self.served.stream_buffer_bytes
        backlog = 0  # bytes queued or being written, not yet sent

        def put(chunks: list[bytes], end: bool) -> None:
            nonlocal backlog
            size = sum(len(c) for c in chunks)
            backlog += size
            queue.put_nowait((chunks, size, end))
            if backlog > cap and not self.paused:
                logger.info("response %s: %d bytes unsent (the client reads slower than the model writes): its "
                            "requests pause (--stream-buffer-bytes %d)", self.id, backlog, cap)
                self.set_paused(True)

        async def pump(r: int, choice: _Choice) -> None:
            try:
                async for delta in choice.deltas():
                    put(self._event_chunks(r, choice, delta, done=False), False)
                put(self._event_chunks(r, choice, SequenceDelta(), done=True), True)
            except asyncio.CancelledError:
                raise  # the consumer is gone
            except BaseException as exc:  # reported in the stream
                put([_sse(self._failure(choice, exc).wrap())], True)

        async def start_others() -> None:
            try:
                await self._start_others()
            except ApiError as exc:  # refused later (a full queue): those choices fail in the stream
                for _ in range(1, len(self.choices)):
                    put([_sse(exc.body.wrap())], True)
                return
            for r, choice in enumerate(self.choices[1:], start=1):
                tasks.append(asyncio.ensure_future(pump(r, choice)))

        tasks = [asyncio.ensure_future(pump(0, self.choices[0]))]
        starter = asyncio.ensure_future(start_others())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            if self.chat:
                for i in range(self.n):
                    yield _sse(self._chunk(i, {"role": "assistant", "content": ""}, None, []))
            pending = len(self.choices)
            while pending:
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():  # the client left
                    getter.cancel()
                    return
                chunks, size, end = getter.result()
                pending -= end
                for chunk in chunks:
                    yield chunk  # back here once the chunk is written (or buffered below the transport's mark)
                backlog -= size
                if self.paused and backlog <= cap // 2:
                    logger.info("response %s: the client reads again: its requests resume", self.id)
                    self.set_paused(False)
            if include_usage:
                yield _sse({"id": self.id, "object": self._chunk_object, "created": self.created,
                            "model": self.model, "choices": [], "usage": self.usage})
            yield b"data: [DONE]\n\n"
        finally:
            self.served.responses.discard(self)
            gone.cancel()
            starter.cancel()
            for task in tasks:
                task.cancel()

    def _event_chunks(self, r: int, choice: _Choice, delta: SequenceDelta, *, done: bool) -> list[bytes]:
        """The events of one delta of run ``r`` (every index it answers), or of its end."""
        chunks: list[bytes] = []
        for index in self._indices(r):
            text, tokens = delta.text, list(delta.tokens)
            thinker = self.reasoning[index]
            if thinker is not None:  # the reasoning first, in its own chunk, with the delta's logprobs
                reasoning, text = thinker.feed(text)
                if done:
                    more, rest = thinker.finish()
                    reasoning, text = reasoning + more, text + rest
                if reasoning:
                    chunks.append(_sse(self._chunk(index, {self.served.reasoning_field: reasoning}, None, tokens)))
                    tokens = []
            stream = self.tool_streams[index]
            if stream is not None:
                chunks += [_sse(c) for c in self._tool_chunks(index, stream, text, tokens, done, choice.finish_reason)]
                continue
            if text or tokens or (self.token_ids and delta.ids) or done:
                body = {"content": text} if self.chat else text
                chunk = self._chunk(index, body, choice.finish_reason if done else None, tokens, self.offsets[index])
                if self.token_ids:
                    chunk["choices"][0]["token_ids"] = list(delta.ids)
                chunks.append(_sse(chunk))
            self.offsets[index] += len(text)
        return chunks

    def _tool_chunks(self, index: int, stream: ToolStream, text: str, tokens: list[tuple[SampledToken, str]],
                     done: bool, finish: str | None) -> list[dict[str, Any]]:
        """The chunks of one delta of a choice with tools (``text``: the delta's answer text,
        ``tokens`` its logprobs' tokens): content that cannot be a call yet, then tool-call
        pieces; at the end, what was held back and the finish."""
        content, calls = stream.feed(text)
        chunks = []
        if content or tokens:
            chunks.append(self._chunk(index, {"content": content}, None, tokens))
        if calls:
            chunks.append(self._chunk(index, {"tool_calls": calls}, None, []))
        if done:
            rest, calls = stream.finish()
            if rest:
                chunks.append(self._chunk(index, {"content": rest}, None, []))
            if calls:
                chunks.append(self._chunk(index, {"tool_calls": calls}, None, []))
            reason = tool_finish(finish) if stream.calls else finish
            chunks.append(self._chunk(index, {}, reason, []))
        return chunks

    def _failure(self, choice: _Choice, exc: BaseException) -> ErrorBody:
        """What a client is told about its failed request, and the log line with its id."""
        if isinstance(exc, ApiError):
            return exc.body
        error = exc if isinstance(exc, RtpcoreError) else RtpcoreError(f"{type(exc).__name__}: {exc}")
        return failure_body(self.id, choice.request_id, error, choice.params)

    def _chunk(self, index: int, delta: Any, finish: str | None, tokens: list[tuple[SampledToken, str]],
               offset: int = 0) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": self._logprobs(tokens, offset)}
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        return {"id": self.id, "object": self._chunk_object, "created": self.created, "model": self.model,
                "choices": [choice]}

    def _logprobs(self, tokens: list[tuple[SampledToken, str]], offset: int) -> dict[str, Any] | None:
        """OpenAI's logprobs of ``tokens`` (the model's raw log-probabilities, exactly the number
        of alternatives asked). Chat: each token's text and own bytes. Completions: ``tokens``
        are the text each token added (joined, the choice's text), ``text_offset`` where each
        starts (``offset``: the text before these tokens)."""
        if self.params.logprobs is None:
            return None
        tok = self.served.require_tokenizer("logprobs", "logprobs")  # check_text_needs refused it already
        if self.chat:
            return {"content": [
                {"token": _piece(tok, t.token_id), "logprob": t.logprob, "bytes": list(tok.token_bytes(t.token_id)),
                 "top_logprobs": [{"token": _piece(tok, i), "logprob": lp, "bytes": list(tok.token_bytes(i))}
                                  for i, lp in t.top]}
                for t, _ in tokens
            ]}
        offsets = []
        for _, piece in tokens:
            offsets.append(offset)
            offset += len(piece)
        return {"tokens": [piece for _, piece in tokens],
                "token_logprobs": [t.logprob for t, _ in tokens],
                "top_logprobs": [_top_by_text(tok, t.top) for t, _ in tokens],
                "text_offset": offsets}


# -- tools ------------------------------------------------------------------------------------------


def _piece(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _top_by_text(tokenizer: Tokenizer, top: tuple[tuple[int, float], ...]) -> dict[str, float]:
    """Completions' alternatives keyed by their text; two ids of one text (halves of characters
    decode alike) fall back to the vocabulary entry, then to the id, so none is lost."""
    out: dict[str, float] = {}
    for token_id, lp in top:
        for key in (_piece(tokenizer, token_id), tokenizer.id_to_token(token_id), f"<id {token_id}>"):
            if key not in out:
                out[key] = lp
                break
    return out


async def respond(served: Served, request: Request, body: Any, prompt: Prompt, params: SamplingParams,
                   *, chat: bool, tools: Tools | None = None) -> Any:
    """Answer one request: ``prompt`` run with ``params`` (``body.stream``: as server-sent events)."""
    if served.draining:
        raise ApiError(503, "the server is shutting down", type="server_error")
    response = _Response(served, body, prompt, params, chat=chat, tools=tools)
    response.submit_first()
    served.responses.add(response)  # until its answer is written (a stream: its generator ends)
    if body.stream:
        return StreamingResponse(response.events(body.include_usage, request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    task = asyncio.ensure_future(response.collect())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        served.responses.discard(response)
    if not task.done():  # the client left before the answer: abort its requests now
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)
    try:
        return JSONResponse(task.result())
    except RtpcoreError as exc:  # this request failed while it ran
        failed = failure_body(response.id, response.choices[0].request_id, exc, response.params)
        return JSONResponse(failed.wrap(), status_code=failure_status(exc, engine_broken=served.engine.failure is not None))


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects (the body is read: the next message is that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()

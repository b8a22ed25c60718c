"""AsyncEngine and the request-level core: streams, continuous batching, aborts, seeds, logprobs, errors.

Every test runs a real engine on a tiny checkpoint, real threads and a real asyncio
loop; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

pytest.importorskip("transformers")

from rtpcore import AsyncEngine, Engine, SamplingParams
from rtpcore.engine.core.outputs import RequestOutput
from rtpcore.errors import (
    InvalidRequestError,
    QueueFullError,
    RequestFailedError,
    RtpcoreError,
)
from test_llama import make_checkpoint

T = TypeVar("T")
TIMEOUT = 300.0  # a bound against hanging, never a speed requirement
GEN = torch.Generator().manual_seed(11)
PROMPTS = [torch.randint(0, 128, (n,), generator=GEN).tolist() for n in (3, 17, 1, 2, 6, 9, 4, 12, 5, 8, 2, 14, 7, 3, 10, 1)]
NEW = 12
LONG = 200  # a request that runs for many steps


def run(coro: Coroutine[Any, Any, T], timeout: float = TIMEOUT) -> T:
    """Run ``coro`` on a fresh event loop, failing if it takes longer than ``timeout``."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def greedy(n: int = NEW, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


async def collect(stream: Any) -> tuple[list[int], RequestOutput]:
    """Every token of a stream and its last output."""
    tokens: list[int] = []
    last = None
    async for out in stream:
        tokens += out.token_ids
        last = out
    assert last is not None and last.finished
    return tokens, last


async def whole(stream: Any) -> RequestOutput:
    """A stream's outputs merged into one (every token; the final finish_reason)."""
    result = None
    async for out in stream:
        result = out if result is None else result.merge(out)
    assert result is not None and result.finished
    return result


async def until(cond: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    """Poll ``cond`` on the event loop until it holds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.002)


def idle(engine: AsyncEngine) -> bool:
    s = engine.stats()
    return s.running == 0 and s.waiting == 0 and s.kv_blocks_free == s.kv_blocks_total


@pytest.fixture(scope="module")
def hf_and_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    path = tmp_path_factory.mktemp("llama")
    return make_checkpoint(path), path


@pytest.fixture(scope="module")
def ckpt(hf_and_ckpt: tuple[Any, Path]) -> Path:
    return hf_and_ckpt[1]


@pytest.fixture(scope="module")
def alone(ckpt: Path) -> list[list[int]]:
    """Each prompt generated on its own by Engine.generate (the reference)."""
    with Engine.from_pretrained(ckpt, tokens_per_block=4) as e:
        return [e.generate([p], max_new_tokens=NEW, stop_token_ids=[])[0] for p in PROMPTS]


def test_greedy_streams_equal_engine_generate(ckpt: Path, alone: list[list[int]]) -> None:
    """A greedy float32 stream yields exactly Engine.generate's tokens, one step at a time, ending with "length"."""

    async def main() -> None:
        async with AsyncEngine.from_pretrained(ckpt, tokens_per_block=4) as engine:
            for p, want in zip(PROMPTS[:4], alone, strict=False):
                chunks = [out async for out in engine.stream(p, greedy())]
                assert [t for c in chunks for t in c.token_ids] == want
                assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
                assert all(c.num_prompt_tokens == len(p) for c in chunks)
                assert chunks[-1].num_generated_tokens == NEW
            assert idle(engine)

    run(main())


def test_sixteen_concurrent_streams_each_equal_the_request_alone(ckpt: Path, alone: list[list[int]]) -> None:
    """16 streams at once (8 batch slots: half wait for admission) each get their solo tokens; every block comes back."""

    async def main() -> None:
        async with AsyncEngine.from_pretrained(ckpt, tokens_per_block=4, max_batch_size=8) as engine:
            results = await asyncio.gather(*(collect(engine.stream(p, greedy())) for p in PROMPTS))
            assert [tokens for tokens, _ in results] == alone
            assert {last.finish_reason for _, last in results} == {"length"}
            stats = engine.stats()
            assert stats.generated_tokens_total == 16 * NEW
            assert stats.requests_finished_total == 16
            await until(lambda: idle(engine), "the blocks to come back")

    run(main())


def test_requests_added_while_others_run_join_the_running_batch(ckpt: Path, alone: list[list[int]]) -> None:
    """A request added while another decodes is prefilled in the same step as that decode (a mixed step), and both are exact."""

    async def main() -> None:
        async with AsyncEngine.from_pretrained(ckpt, tokens_per_block=4) as engine:
            first = engine.stream(PROMPTS[1], greedy(40))
            out = await first.__anext__()
            tokens = list(out.token_ids)
            assert engine.stats().mixed_steps_total == 0
            late = [asyncio.ensure_future(collect(engine.stream(p, greedy()))) for p in PROMPTS[2:5]]
            rest, _ = await collect(first)
            tokens += rest
            joined = [t for t, _ in await asyncio.gather(*late)]
            stats = engine.stats()
            assert stats.mixed_steps_total >= 1
            assert stats.steps_total < 40 + 3 * NEW  # they ran together, not one after another
            assert joined == alone[2:5]
            with Engine.from_pretrained(ckpt, tokens_per_block=4) as ref:
                assert tokens == ref.generate([PROMPTS[1]], max_new_tokens=40, stop_token_ids=[])[0]

    run(main())


def test_abort_ends_the_stream_and_frees_its_blocks(ckpt: Path) -> None:
    """await engine.abort(id) ends the stream with finish_reason "abort"; its blocks are free once idle; unknown ids answer False."""

    async def main() -> None:
        async with AsyncEngine.from_pretrained(ckpt, tokens_per_block=4) as engine:
            stream = engine.stream(PROMPTS[1], greedy(200), request_id="long")
            assert stream.request_id == "long"
            first = await stream.__anext__()
            assert first.finish_reason is None
            assert engine.stats().kv_blocks_free < engine.stats().kv_blocks_total
            assert await engine.abort("long")
            rest = [out async for out in stream]
            assert rest[-1].finish_reason == "abort"
            assert sum(len(o.token_ids) for o in rest) < 199
            await until(lambda: idle(engine), "the aborted request's blocks")
            assert not await engine.abort("long")
            assert not await engine.abort("never-added")

    run(main())


def test_a_consumer_that_stops_aborts_its_request(ckpt: Path) -> None:
    """Cancelling the consuming task, aclose() and break each abort the request and free its blocks."""

    async def main() -> None:
        async with AsyncEngine.from_pretrained(ckpt, tokens_per_block=4) as engine:
            started = asyncio.Event()

            async def consume() -> None:
                async for _ in engine.stream(PROMPTS[1], greedy(200)):
                    started.set()

            task = asyncio.ensure_future(consume())
            await asyncio.wait_for(started.wait(), 120)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await until(lambda: idle(engine), "the cancelled consumer's blocks")

            stream = engine.stream(PROMPTS[0], greedy(200))
            await stream.__anext__()
            await stream.aclose()
            await until(lambda: idle(engine), "the closed stream's blocks")

            async for _ in engine.stream(PROMPTS[2], greedy(200)):
                break
            await until(lambda: idle(engine), "the dropped stream's blocks")
            finished = engine.stats().requests_finished_total
            assert finished == 3

    run(main())


def test_a_paused_request_is_not_scheduled_holds_no_blocks_and_resumes_where_it_stopped(
    ckpt: Path, alone: list[list[int]],
) -> None:
    """set_paused(True): the request leaves the batch with its blocks at the next step, others run
    past it (no output for it meanwhile), it counts as paused, not waiting; resumed, its tokens
    are those it would have had alone."""

    async def main() -> None:
        with Engine.from_pretrained(ckpt, tokens_per_block=4) as e:
            reference = e.generate([PROMPTS[1]], max_new_tokens=LONG, stop_token_ids=[])[0]
        async with AsyncEngine.from_pretrained(ckpt, tokens_per_block=4, max_batch_size=2) as engine:
            paused = engine.stream(PROMPTS[1], greedy(LONG))
            first = await paused.__anext__()
            assert engine.set_paused(paused.request_id, True) and paused.set_paused(True)
            await until(lambda: engine.stats().running == 0, "the paused request to leave the batch")
            s = engine.stats()
            assert (s.paused, s.waiting, s.kv_blocks_free) == (1, 0, s.kv_blocks_total)
            before = paused._queue.qsize()  # outputs of the steps before the pause took effect
            # Two others run to their end, through both batch slots, past the paused one.
            others = await asyncio.gather(*(collect(engine.stream(PROMPTS[i], greedy(NEW))) for i in (2, 3)))
            assert [t for t, _ in others] == [alone[2], alone[3]]
            assert paused._queue.qsize() == before, "the paused request was scheduled"
            assert paused.set_paused(False)
            tokens, last = await collect(paused)
            assert list(first.token_ids) + tokens == reference and last.finish_reason == "length"
            assert engine.stats().paused == 0 and not engine.set_paused(paused.request_id, True)
            await until(lambda: idle(engine), "every block back")

    run(main())


def test_paused_requests_do_not_fill_the_waiting_queue(ckpt: Path) -> None:
    """max_waiting counts the requests waiting to run: a paused one set aside is not among them."""

    async def main() -> None:
        async with AsyncEngine.from_pretrained(ckpt, tokens_per_block=4, max_batch_size=1, max_waiting=1) as engine:
            held = engine.stream(PROMPTS[0], greedy(200))
            await held.__anext__()
            held.set_paused(True)
            await until(lambda: engine.stats().running == 0, "the paused request to be set aside")
            tokens, _ = await collect(engine.stream(PROMPTS[2], greedy(2)))  # not refused as a full queue
            assert len(tokens) == 2
            await held.aclose()
            await until(lambda: idle(engine), "every block back")

    run(main())


def test_a_seed_gives_the_same_samples_alone_and_in_a_batch(ckpt: Path) -> None:
    """A seeded sampled request draws the same tokens alone and among other sampled requests; another seed differs."""
    params = SamplingParams(max_tokens=NEW, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)

    async def main() -> None:
        async with AsyncEngine.from_pretrained(ckpt, tokens_per_block=4) as engine:
            solo, _ = await collect(engine.stream(PROMPTS[4], params))
            others = [
                collect(engine.stream(p, SamplingParams(max_tokens=NEW, temperature=1.0, seed=i, ignore_eos=True)))
                for i, p in enumerate(PROMPTS[:6])
            ]
            results = await asyncio.gather(*others[:3], collect(engine.stream(PROMPTS[4], params)), *others[3:])
            assert results[3][0] == solo
            other_seed, _ = await collect(engine.stream(PROMPTS[4], SamplingParams(
                max_tokens=NEW, temperature=1.0, top_p=0.95, seed=99, ignore_eos=True)))
            assert other_seed != solo

    run(main())


def test_logprobs_match_transformers_log_softmax(hf_and_ckpt: tuple[Any, Path]) -> None:
    """Greedy logprobs=5: each token's logprob and the top 5 equal log_softmax of transformers' logits within 1e-4."""
    hf, ckpt = hf_and_ckpt
    prompt = PROMPTS[1]

    async def main() -> RequestOutput:
        async with AsyncEngine.from_pretrained(ckpt, tokens_per_block=4) as engine:
            return await whole(engine.stream(prompt, greedy(8, logprobs=5)))

    out = run(main())
    assert out.logprobs is not None and len(out.logprobs) == 8
    seq = prompt + list(out.token_ids)
    with torch.no_grad():
        logits = hf(torch.tensor([seq[:-1]])).logits[0, len(prompt) - 1 :].float()  # (8, V)
    ref = logits.log_softmax(-1)
    for i, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[i] == int(ref[i].argmax())
        assert lp.logprob == pytest.approx(float(ref[i, lp.token_id]), abs=1e-4)
        values, ids = ref[i].topk(5)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)


def test_logprobs_zero_reports_only_the_chosen_token(ckpt: Path) -> None:
    """logprobs=0 gives each token's own logprob and no alternatives; without logprobs the field is None."""

    async def main() -> None:
        async with AsyncEngine.from_pretrained(ckpt, tokens_per_block=4) as engine:
            out = await whole(engine.stream(PROMPTS[0], greedy(3, logprobs=0)))
            assert out.logprobs is not None and [lp.top for lp in out.logprobs] == [(), (), ()]
            assert all(lp.logprob is not None and lp.logprob <= 0 for lp in out.logprobs)
            assert (await whole(engine.stream(PROMPTS[0], greedy(3)))).logprobs is None

    run(main())


def test_stop_token_ids_end_the_request_with_stop(ckpt: Path, alone: list[list[int]]) -> None:
    """A stop token id ends the request with "stop" and is its last token; stop strings are only carried."""
    want = alone[1]
    stop = want[4]
    cut = want[: want.index(stop) + 1]

    async def main() -> None:
        async with AsyncEngine.from_pretrained(ckpt, tokens_per_block=4) as engine:
            params = SamplingParams(max_tokens=NEW, stop_token_ids=[stop], stop="never", ignore_eos=True)
            assert params.stop == ("never",)
            out = await whole(engine.stream(PROMPTS[1], params))
            assert list(out.token_ids) == cut
            assert (out.finish_reason, out.stop_token_id) == ("stop", stop)

    run(main())


def test_a_full_queue_refuses_at_once(ckpt: Path) -> None:
    """With max_waiting=1 and one batch slot, a third request raises QueueFullError when added; the others finish."""

    async def main() -> None:
        async with AsyncEngine.from_pretrained(ckpt, tokens_per_block=4, max_batch_size=1, max_waiting=1) as engine:
            running = engine.stream(PROMPTS[0], greedy(30))
            await running.__anext__()
            waiting = engine.stream(PROMPTS[1], greedy(4))
            assert engine.stats().waiting == 1
            with pytest.raises(QueueFullError) as excinfo:
                engine.stream(PROMPTS[2], greedy(4))
            assert excinfo.value.max_waiting == 1
            assert "max_waiting=1" in str(excinfo.value)
            await collect(running)
            tokens, _ = await collect(waiting)
            assert len(tokens) == 4
            await until(lambda: idle(engine), "idle")

    run(main())


def test_a_request_beyond_max_model_len_fails_alone(ckpt: Path) -> None:
    """A prompt + max_tokens beyond max_model_len raises InvalidRequestError (context_length_exceeded) when
    added; a running stream is untouched."""
    with Engine.from_pretrained(ckpt, tokens_per_block=4) as probe:
        block_bytes = sum(s.block_bytes for s in probe.kv_cache_specs)

    async def main() -> None:
        async with AsyncEngine.from_pretrained(
            ckpt, tokens_per_block=4, kv_cache_memory=8 * block_bytes, max_model_len=32
        ) as engine:
            stream = engine.stream(PROMPTS[0], greedy())
            with pytest.raises(InvalidRequestError) as excinfo:
                engine.stream(list(range(1, 40)), greedy(4))
            assert (excinfo.value.field, excinfo.value.code) == ("max_tokens", "context_length_exceeded")
            tokens, last = await collect(stream)
            assert len(tokens) == NEW and last.finish_reason == "length"

    run(main())


@pytest.mark.parametrize(("kwargs", "field", "needle"), [
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be a positive integer"),
    ({"temperature": -0.5}, "temperature", "temperature must be >= 0"),
    ({"temperature": float("nan")}, "temperature", "temperature must be >= 0"),
    ({"top_k": 0}, "top_k", "top_k must be a positive integer"),
    ({"top_p": 1.5}, "top_p", "top_p must be in (0, 1]"),
    ({"seed": 1.5}, "seed", "seed must be None or an integer"),
    ({"stop_token_ids": [1, -2]}, "stop_token_ids", "stop_token_ids holds -2"),
    ({"logprobs": 21}, "logprobs", "logprobs must be None or an integer from 0 to 20"),
    ({"stop": ["ok", ""]}, "stop", "stop holds ''"),
    ({"ignore_eos": 1}, "ignore_eos", "ignore_eos must be True or False"),
])
def test_bad_sampling_params_name_the_field(kwargs: dict[str, Any], field: str, needle: str) -> None:
    """Each bad SamplingParams value raises InvalidRequestError naming the field and the rule."""
    with pytest.raises(InvalidRequestError) as excinfo:
        SamplingParams(**kwargs)
    assert excinfo.value.field == field
    assert needle in str(excinfo.value)


def test_bad_requests_are_refused_before_anything_runs(ckpt: Path) -> None:
    """An empty prompt, a token outside the vocabulary, a too-long request or a duplicate id is an InvalidRequestError."""

    async def main() -> None:
        async with AsyncEngine.from_pretrained(ckpt, tokens_per_block=4) as engine:
            cases: list[tuple[Callable[[], Any], str]] = [
                (lambda: engine.stream([], greedy()), "prompt"),
                (lambda: engine.stream([1, 128], greedy()), "prompt"),
                (lambda: engine.stream([1] * 250, greedy(10)), "max_tokens"),
                (lambda: engine.stream([1], {"max_tokens": 3}), "params"),  # type: ignore[arg-type]
            ]
            for make, field in cases:
                with pytest.raises(InvalidRequestError) as excinfo:
                    make()
                assert excinfo.value.field == field
            stream = engine.stream([1], greedy(), request_id="dup")
            with pytest.raises(InvalidRequestError, match="'dup' is already in use"):
                engine.stream([2], greedy(), request_id="dup")
            await collect(stream)
            assert idle(engine)

    run(main())


POISON = 99  # the faulty forward below raises on this token at position 1


def _raise_on(engine: AsyncEngine | Engine, token: int) -> None:
    """Make the engine's model raise ValueError in any forward whose batch holds ``token`` at
    position 1."""
    model = engine.engine.model if isinstance(engine, AsyncEngine) else engine.model
    real = model.forward

    def faulty(batch: Any, caches: Any) -> Any:
        if bool(((batch.input_ids == token) & (batch.positions == 1)).any()):
            raise ValueError(f"injected fault on token {token}")
        return real(batch, caches)

    model.forward = faulty


def test_a_model_fault_fails_only_the_request_that_causes_it(ckpt: Path, alone: list[list[int]]) -> None:
    """When the forward raises on one request's token, that stream alone raises RequestFailedError naming
    the cause; the requests stepped with it get their solo tokens; blocks come back; the engine serves on."""

    async def main() -> None:
        others = [PROMPTS[i] + alone[i] for i in range(3)]
        assert all(len(t) < 2 or t[1] != POISON for t in others)  # only the bad request can raise
        async with AsyncEngine.from_pretrained(ckpt, tokens_per_block=4) as engine:
            _raise_on(engine, POISON)
            streams = [engine.stream(p, greedy()) for p in PROMPTS[:2]]
            bad = engine.stream([5, POISON, 7], greedy())
            streams.append(engine.stream(PROMPTS[2], greedy()))
            with pytest.raises(RequestFailedError, match=f"injected fault on token {POISON}") as excinfo:
                await collect(bad)
            assert excinfo.value.reason == "model_fault" and excinfo.value.request_id == bad.request_id
            for s, want in zip(streams, [alone[0], alone[1], alone[2]], strict=True):
                tokens, last = await collect(s)
                assert tokens == want and last.finish_reason == "length"
            await until(lambda: idle(engine), "the failed request's blocks")
            assert engine.engine.failure is None and engine.stats().request_errors_total == 1
            tokens, _ = await collect(engine.stream(PROMPTS[0], greedy()))
            assert tokens == alone[0]

    run(main())


def test_closing_with_open_streams_ends_them(ckpt: Path) -> None:
    """aclose() while streams run and wait ends each of them (abort or an RtpcoreError), promptly; later requests are refused."""

    async def main() -> None:
        engine = AsyncEngine.from_pretrained(ckpt, tokens_per_block=4, max_batch_size=2)
        streams = [engine.stream(p, greedy(200)) for p in PROMPTS[:4]]
        await streams[0].__anext__()
        ends: list[Awaitable[Any]] = [collect(s) for s in streams]
        closing = asyncio.ensure_future(engine.aclose())
        results = await asyncio.gather(*ends, return_exceptions=True)
        await closing
        for r in results:
            assert isinstance(r, RtpcoreError) or r[1].finish_reason == "abort", r
        with pytest.raises(RtpcoreError, match="closed"):
            engine.stream(PROMPTS[0], greedy())
        assert engine.engine.model is None

    run(main())


def test_generate_threads_and_streams_share_one_engine(ckpt: Path, alone: list[list[int]]) -> None:
    """Engine.generate from another thread while streams run on the same engine: everyone gets their solo tokens."""

    async def main() -> None:
        async with AsyncEngine.from_pretrained(ckpt, tokens_per_block=4) as engine:
            box: list[Any] = []
            thread = threading.Thread(
                target=lambda: box.append(engine.engine.generate(PROMPTS[8:], max_new_tokens=NEW, stop_token_ids=[]))
            )
            thread.start()
            streamed = await asyncio.gather(*(collect(engine.stream(p, greedy())) for p in PROMPTS[:8]))
            await asyncio.get_running_loop().run_in_executor(None, thread.join, 30)
            assert [t for t, _ in streamed] == alone[:8]
            assert box == [alone[8:]]

    run(main())


def test_time_stamps_give_time_to_first_token_and_between_tokens(ckpt: Path) -> None:
    """Every output carries the arrival time and one monotonic time per new token, in order."""

    async def main() -> None:
        async with AsyncEngine.from_pretrained(ckpt, tokens_per_block=4) as engine:
            outs = [o async for o in engine.stream(PROMPTS[0], greedy(5))]
            times = [t for o in outs for t in o.token_times]
            assert len(times) == 5 and times == sorted(times)
            assert outs[0].arrival_time <= times[0]
            assert engine.stats().as_dict()["kv_blocks_total"] == engine.engine.num_kv_blocks

    run(main())


def test_a_model_fault_leaves_the_engine_whole_and_its_failure_says_so_only_when_closed(ckpt: Path) -> None:
    """Engine.failure stays None after a request's own model fault (the request fails, the engine steps
    on); after close it says closed."""
    engine = Engine.from_pretrained(ckpt, tokens_per_block=4)
    assert engine.failure is None
    _raise_on(engine, POISON)
    with pytest.raises(RequestFailedError, match="injected fault"):
        engine.generate([[3, POISON]], max_new_tokens=2)
    assert engine.failure is None and engine.broken is None
    assert len(engine.generate([PROMPTS[0]], max_new_tokens=2)[0]) == 2
    engine.close()
    assert "closed" in str(engine.failure)

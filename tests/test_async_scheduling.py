"""Async scheduling (rtpcore.engine.engine_core, docs/design.md §13): outputs one step behind, forced on
on the CPU. Each run is compared with the synchronous engine on the same requests: the same
tokens and finish reasons, with stop tokens, max_tokens, aborts, preemption, prefix caching,
chunked prefill and sampled rows; every block comes back."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from rtpcore import Engine
from rtpcore.engine.sample.params import SamplingParams
from rtpcore.errors import RtpcoreError

TPB = 4

# Ragged prompts, some sharing prefixes (the prefix cache finds their blocks).
PROMPTS = [
    [5, 9, 33], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [100], [7, 7],
    [3, 1, 4, 1, 5, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [5, 9, 33, 12], [42] * 9,
    [8, 6, 7, 5, 3, 0, 9], [1, 2, 3, 4, 5, 6, 7, 8], [64, 32, 16, 8, 4, 2, 1], [11, 13],
]
MAX_TOKENS = [7, 20, 1, 13, 2, 18, 9, 5, 16, 3, 11, 20]


def _generate(
    engine: Any, params: Sequence[SamplingParams], *, abort_after: dict[int, int] | None = None
) -> list[tuple[tuple[int, ...], str | None]]:
    """Every prompt with its params through the engine core, stepping until all end; request i is
    aborted from its own output callback once it has ``abort_after[i]`` tokens. Each request's tokens
    and finish reason."""
    core = engine.core
    tokens: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    reasons: dict[int, str | None] = {}
    ids: dict[int, str] = {}

    def on_output(i: int, out: Any) -> None:
        tokens[i] += out.token_ids
        if out.finished:
            reasons[i] = out.finish_reason
        elif abort_after and i in abort_after and len(tokens[i]) >= abort_after[i]:
            core.abort(ids[i])

    for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
        ids[i] = core.add_request(prompt, p, lambda out, i=i: on_output(i, out))
    while core.has_work:
        core.step()
    assert len(reasons) == len(PROMPTS)
    return [(tuple(tokens[i]), reasons[i]) for i in range(len(PROMPTS))]


def _both(ckpt: Path, params: Sequence[SamplingParams], **options: Any) -> tuple[Any, Any, Any]:
    """The outputs of the synchronous engine and of the async one, and the async one's stats;
    every block free again in both."""
    runs = []
    for on in (False, True):
        with Engine.from_pretrained(ckpt, tokens_per_block=TPB, async_scheduling=on, **options) as engine:
            assert engine.core.async_scheduling is on
            runs.append(_generate(engine, params))
            assert engine.num_free_kv_blocks == engine.num_kv_blocks  # nothing leaked, wasted rows included
            assert not engine.core.has_work and engine.core._pending is None
            stats = engine.stats()
    return runs[0], runs[1], stats


def test_greedy_requests_get_the_synchronous_tokens_with_stops_and_max_tokens(ckpt: Path) -> None:
    """Twelve greedy requests through four slots (requests join as others finish), each with its own
    max_tokens, some stopped by a token they produce: the synchronous engine's tokens and finish
    reasons. Most steps overlap, and requests that finished while the next step ran wasted a row."""
    with Engine.from_pretrained(ckpt, tokens_per_block=TPB) as engine:
        assert engine.core.async_scheduling is False  # the CPU default
        free = _generate(engine, [SamplingParams(max_tokens=m, ignore_eos=True) for m in MAX_TOKENS])
    # Stop tokens the requests do produce, a few tokens in (so some stop early).
    stops = {t for toks, _ in free[::3] for t in toks[2:3]}
    params = [SamplingParams(max_tokens=m, stop_token_ids=sorted(stops), ignore_eos=True) for m in MAX_TOKENS]
    sync, overlapped, stats = _both(ckpt, params, max_batch_size=4)
    assert overlapped == sync
    assert any(reason == "stop" for _, reason in sync) and any(reason == "length" for _, reason in sync)
    assert stats.overlapped_steps_total > stats.steps_total // 2
    assert stats.async_discarded_tokens_total > 0
    assert stats.async_fallback_steps_total == 0  # every step here was plain greedy


def test_preemption_under_a_small_pool_keeps_the_synchronous_tokens(ckpt: Path) -> None:
    """A pool of 12 blocks for twelve requests: preemption in both engines, the same tokens, every
    block back; the async engine plans synchronously when the next step needs more blocks than are free."""
    with Engine.from_pretrained(ckpt, tokens_per_block=TPB, kv_cache_memory=1 << 20) as engine:
        block_bytes = sum(s.block_bytes for s in engine.kv_cache_specs)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    sync, overlapped, stats = _both(ckpt, params, kv_cache_memory=12 * block_bytes, max_model_len=40)
    assert overlapped == sync
    assert stats.preemptions_total > 0 and stats.overlapped_steps_total > 0


def test_aborts_from_the_output_callback_end_requests_as_in_the_synchronous_engine(ckpt: Path) -> None:
    """Requests aborted from their own callback after a few tokens: the tokens they had and
    "abort", the others untouched; no block leaks (the aborted ones' wasted rows included)."""
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    abort_after = {1: 3, 5: 1, 8: 6, 11: 2}
    runs = []
    for on in (False, True):
        with Engine.from_pretrained(ckpt, tokens_per_block=TPB, async_scheduling=on, max_batch_size=6) as engine:
            runs.append(_generate(engine, params, abort_after=abort_after))
            assert engine.num_free_kv_blocks == engine.num_kv_blocks
            if on:
                assert engine.stats().overlapped_steps_total > 0
    assert runs[1] == runs[0]
    assert [runs[0][i][1] for i in abort_after] == ["abort"] * len(abort_after)


def test_sampled_rows_run_synchronously_counted_and_seeded_tokens_match(ckpt: Path) -> None:
    """Seeded sampled requests among greedy ones: the steps holding a sampled row run synchronously
    (counted), the others overlap; every request gets the synchronous engine's tokens."""
    params = [
        SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.8, seed=i) if i % 4 == 1
        else SamplingParams(max_tokens=m, ignore_eos=True)
        for i, m in enumerate(MAX_TOKENS)
    ]
    sync, overlapped, stats = _both(ckpt, params, max_batch_size=3)
    assert overlapped == sync
    assert stats.async_fallback_steps_total > 0 and stats.overlapped_steps_total > 0


def test_chunked_prefill_runs_synchronously_and_keeps_the_tokens(ckpt: Path) -> None:
    """A token budget of 6: long prompts are prefilled in chunks that sample nothing (synchronous
    steps, counted); the tokens are the synchronous engine's."""
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    sync, overlapped, stats = _both(ckpt, params, max_num_batched_tokens=6, max_batch_size=4)
    assert overlapped == sync
    assert stats.async_fallback_steps_total > 0 and stats.overlapped_steps_total > 0


def test_a_wasted_row_is_never_streamed_nor_counted(ckpt: Path) -> None:
    """One request of max_tokens 3 alone: three tokens handed out, the fourth computed and dropped."""
    with Engine.from_pretrained(ckpt, tokens_per_block=TPB, async_scheduling=True) as engine:
        outs: list[Any] = []
        engine.core.add_request([5, 9, 33], SamplingParams(max_tokens=3, ignore_eos=True), outs.append)
        while engine.core.has_work:
            engine.core.step()
        assert sum(len(o.token_ids) for o in outs) == 3 and outs[-1].finish_reason == "length"
        stats = engine.stats()
        assert stats.generated_tokens_total == 3 and stats.async_discarded_tokens_total == 1
        assert engine.num_free_kv_blocks == engine.num_kv_blocks
        want = engine.generate([[5, 9, 33]], max_new_tokens=3, stop_token_ids=[])[0]
        assert [t for o in outs for t in o.token_ids] == want


def test_the_option_is_checked(ckpt: Path) -> None:
    with pytest.raises(RtpcoreError, match="async_scheduling must be None"):
        Engine.from_pretrained(ckpt, async_scheduling="on")  # type: ignore[arg-type]
    with pytest.raises(RtpcoreError, match="async_scheduling=True needs tensor_parallel_size=1"):
        Engine.from_pretrained(ckpt, async_scheduling=True, tensor_parallel_size=2)


def test_a_fault_in_a_step_launched_ahead_stays_with_its_request(ckpt: Path) -> None:
    """The forward raises on any batch writing position 25: the step launched ahead fails to
    launch, runs synchronously once its inputs are known, and (as in the synchronous engine) only the
    requests at position 25 fail; the others get their tokens; every block comes back."""
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    runs = []
    for on in (False, True):
        with Engine.from_pretrained(ckpt, tokens_per_block=TPB, async_scheduling=on, max_batch_size=4) as engine:
            real = engine.model.forward

            def faulty(batch: Any, caches: Any, real: Any = real) -> Any:
                if 25 in batch.context_lens_on_host():
                    raise ValueError("injected fault at position 24")
                return real(batch, caches)

            engine.model.forward = faulty
            runs.append(_generate(engine, params))
            assert engine.num_free_kv_blocks == engine.num_kv_blocks and engine.failure is None
            if on:
                stats = engine.stats()
                assert stats.async_fallback_steps_total > 0 and stats.overlapped_steps_total > 0
    assert runs[1] == runs[0]
    assert sum(reason == "error" for _, reason in runs[0]) >= 1 and sum(r == "length" for _, r in runs[0]) >= 6


def test_the_metrics_expose_the_overlap_counters() -> None:
    from rtpcore.serving.metrics import ServerMetrics

    text = ServerMetrics(lambda: {"kv_blocks_total": 1, "kv_blocks_free": 1, "kv_blocks_cached": 0, "running": 0,
                                  "waiting": 0, "paused": 0, "greedy_picked_steps_total": 5, "overlapped_steps_total": 4,
                                  "async_fallback_steps_total": 3, "async_discarded_tokens_total": 2}).render().decode()
    for line in ("rtpcore_greedy_picked_steps_total 5.0", "rtpcore_overlapped_steps_total 4.0",
                 "rtpcore_async_fallback_steps_total 3.0", "rtpcore_async_discarded_tokens_total 2.0"):
        assert line in text

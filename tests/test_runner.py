"""The step batch (rtpcore.engine.step.inputs): every input of a batch travels in one host-to-device
copy (rtpcore.engine.step.staging), and its views hold what each field means."""

from __future__ import annotations

from array import array
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rtpcore.engine.core.request import Request, ScheduledSeq
from rtpcore.engine.sample.params import SamplingParams
from rtpcore.engine.step.inputs import BatchBuilder
from rtpcore.engine.step.staging import HostStaging


def _request(tokens: list[int], blocks: list[int]) -> Request:
    return Request(request_id="r", tokens=tokens, prompt_len=len(tokens), params=SamplingParams(),
                   stop_ids=frozenset(), on_output=lambda _: None, arrival_time=0.0, blocks=blocks)


@st.composite
def _batches(draw: Any) -> tuple[int, list[tuple[list[int], list[int], int, int, bool]]]:
    """A block size and sequences: (tokens, blocks, first scheduled position, count, samples)."""
    tpb = draw(st.sampled_from([1, 2, 4, 16]))
    seqs = []
    for _ in range(draw(st.integers(1, 6))):
        tokens = draw(st.lists(st.integers(0, 50_000), min_size=1, max_size=40))
        start = draw(st.integers(0, len(tokens) - 1))
        count = draw(st.integers(1, len(tokens) - start))
        blocks = draw(st.lists(st.integers(0, 999), min_size=-(-(start + count) // tpb),
                               max_size=-(-(start + count) // tpb) + 2, unique=True))
        seqs.append((tokens, blocks, start, count, draw(st.booleans()) or start + count == len(tokens)))
    return tpb, seqs


@settings(max_examples=150)
@given(_batches())
def test_the_views_of_the_one_copy_hold_each_field(case: tuple[int, list[Any]]) -> None:
    """Random ragged batches: each view equals the field built on its own, from the requests."""
    tpb, spec = case
    builder = BatchBuilder(tokens_per_block=tpb)
    seqs = [ScheduledSeq(_request(t, b), s, n, samples) for t, b, s, n, samples in spec]
    before = builder.staging.copies
    built = builder.target_batch(seqs)
    batch = built.batch
    assert builder.staging.copies == before + 1
    want_ids = [t for t, _, s, n, _ in spec for t in t[s : s + n]]
    want_pos = [p for _, _, s, n, _ in spec for p in range(s, s + n)]
    want_slots = [b[p // tpb] * tpb + p % tpb for _, b, s, n, _ in spec for p in range(s, s + n)]
    width = max(len(b) for _, b, _, _, _ in spec)
    want_tables = [b + [0] * (width - len(b)) for _, b, _, _, _ in spec]
    want_starts = [0]
    for _, _, _, n, _ in spec:
        want_starts.append(want_starts[-1] + n)
    assert batch.input_ids.tolist() == want_ids
    assert batch.positions.tolist() == want_pos
    assert batch.slots.tolist() == want_slots
    assert batch.block_tables.tolist() == want_tables and batch.block_tables.shape == (len(spec), width)
    assert batch.context_lens.tolist() == [s + n for _, _, s, n, _ in spec]
    assert batch.query_start_loc is not None and batch.query_start_loc.tolist() == want_starts
    assert batch.query_lens == tuple(n for *_, n, _ in spec)
    every_last = all(samples for *_, samples in spec)
    if every_last:  # one row per sequence, its last token: the model's default
        assert batch.logits_indices is None
    else:
        assert batch.logits_indices is not None
        assert batch.logits_indices.tolist() == [want_starts[i + 1] - 1 for i, x in enumerate(spec) if x[4]]
    for t in (batch.input_ids, batch.positions, batch.slots, batch.context_lens, batch.block_tables):
        assert t.dtype == torch.int64


@settings(max_examples=100)
@given(st.data())
def test_kept_block_tables_follow_every_change_of_the_requests_blocks(data: Any) -> None:
    """One builder over many steps: requests gain blocks (in place, as the scheduler grows them),
    lose them all (a preemption: a new empty list) or get a new list (a prefix-cache hit at
    admission); each batch, of any subset of them, holds exactly their blocks as they are now."""
    tpb = 4
    builder = BatchBuilder(tokens_per_block=tpb)
    blocks = st.lists(st.integers(0, 999), max_size=6)
    requests = [_request([1] * 8, data.draw(blocks)) for _ in range(data.draw(st.integers(1, 4)))]
    for _ in range(data.draw(st.integers(1, 12))):
        for r in requests:
            change = data.draw(st.sampled_from(["keep", "grow", "grow", "preempt", "replace"]))
            if change == "grow":
                r.blocks += data.draw(blocks)
            elif change == "preempt":
                r.blocks = []
            elif change == "replace":
                r.blocks = data.draw(blocks)
            if not r.blocks:
                r.blocks += [data.draw(st.integers(0, 999))]  # a scheduled sequence has its block
        batch_of = data.draw(st.lists(st.sampled_from(requests), min_size=1, unique_by=id))
        seqs = [ScheduledSeq(r, 0, 1, True) for r in batch_of]
        tables = builder.target_batch(seqs).batch.block_tables
        width = max(len(r.blocks) for r in batch_of)
        assert tables.tolist() == [r.blocks + [0] * (width - len(r.blocks)) for r in batch_of]


def test_staging_copies_once_and_keeps_order() -> None:
    staging = HostStaging("cpu")
    a, b, c = staging.stage([[1, 2], [], [3, 4, 5]])
    assert staging.copies == 1
    assert (a.tolist(), b.tolist(), c.tolist()) == ([1, 2], [], [3, 4, 5])
    d, = staging.stage([[7]])  # a later call leaves the earlier views alone
    assert a.tolist() == [1, 2] and d.tolist() == [7] and staging.copies == 2
    e, f, g = staging.stage([array("q", [-1, 2**40]), range(2), (5,)])  # any int sequences, machine ints too
    assert (e.tolist(), f.tolist(), g.tolist()) == ([-1, 2**40], [0, 1], [5]) and e.dtype == torch.int64
    assert [t.numel() for t in staging.stage([[], []])] == [0, 0] and staging.copies == 4


def test_a_steps_sampling_rows_view_the_requests_own_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows the runner hands the sampler read each request's token list itself (no copy):
    a write into the list shows in the row, and the token the step appends is not in it."""
    import rtpcore.engine.step.runner as runner_module
    from rtpcore.engine.sample.sampler import sample
    from rtpcore.engine.step.runner import StepRunner

    seen: list[Any] = []

    def recording_sample(logits: torch.Tensor, rows: Any, **kwargs: Any) -> Any:  # raw=: the model's own logits
        seen.extend(rows)
        return sample(logits, rows, **kwargs)

    monkeypatch.setattr(runner_module, "sample", recording_sample)
    requests = [_request([5, 6, 7], [0]), _request([1, 2, 3, 4, 8, 9], [1, 2])]
    requests[1].prompt_len = 4  # two tokens generated already
    requests[1].params = SamplingParams(repetition_penalty=1.5)  # a processor that reads the history
    runner = StepRunner(forward=lambda batch: torch.zeros(2, 16), builder=BatchBuilder(tokens_per_block=4),
                        is_broken=lambda: False)
    results = runner.run([ScheduledSeq(r, len(r.tokens) - 1, 1, True) for r in requests])
    assert all(res.error is None and len(res.tokens) == 1 for res in results)
    assert len(seen) == 2
    for r, row in zip(requests, seen, strict=True):
        assert row.prompt_ids == r.tokens[: r.prompt_len] and row.output_ids == r.tokens[r.prompt_len :]
        r.tokens[0] = 40  # the row reads the request's list
        r.tokens[-1] = 41
        assert row.prompt_ids[0] == 40 and list(row.prompt_ids) == r.tokens[: r.prompt_len]
        assert list(row.output_ids) == r.tokens[r.prompt_len :]
        r.tokens.append(42)  # the next token: after the row's end
        assert len(row.prompt_ids) + len(row.output_ids) == len(r.tokens) - 1


pytest.importorskip("transformers")


def test_an_engine_step_issues_one_input_copy(tmp_path: Path) -> None:
    """Prefill and decode steps of plain greedy requests: one copy each (the batch; the greedy
    rows need no sampler inputs)."""
    from rtpcore import Engine
    from test_llama import make_checkpoint

    make_checkpoint(tmp_path)
    with Engine.from_pretrained(tmp_path, tokens_per_block=4) as engine:
        core = engine.core
        staging = core.runner.builder.staging
        steps_before, copies_before = core.stats().steps_total, staging.copies
        engine.generate([[1, 2, 3], [4, 5, 6, 7, 8]], max_new_tokens=6, stop_token_ids=[])
        steps = core.stats().steps_total - steps_before
        assert steps >= 6 and staging.copies - copies_before == steps

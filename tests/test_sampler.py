"""The batched sampler (rtpcore.engine.sample.sampler) and the sampling settings: each processor
against transformers' logits processors or the OpenAI formula, the exponential race
against softmax, seeded rows alone and in a batch, failed rows, raw log-probabilities,
one host transfer per call, and the speculative verification built on the same
processing (rtpcore.engine.sample.speculative)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from rtpcore.engine.sample.params import GREEDY_BELOW, SampledToken, SamplingParams
from rtpcore.engine.sample.sampler import (
    SamplingRow,
    StepSample,
    process_logits,
    sample,
    sample_step,
)
from rtpcore.engine.sample.speculative import Proposal, propose, verify, verify_batch
from rtpcore.errors import InvalidRequestError, RtpcoreError

transformers = pytest.importorskip("transformers")

V = 50


def _logits(n: int, v: int = V, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * scale


def _hf(processor: Any, logits: torch.Tensor, ids: Sequence[int] = ()) -> torch.Tensor:
    return processor(torch.tensor([list(ids)], dtype=torch.long), logits[None].clone())[0]


def _same_kept_and_values(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))
    keep = torch.isfinite(theirs)
    torch.testing.assert_close(ours[keep], theirs[keep], rtol=1e-6, atol=1e-6)


# -- settings -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("min_p", -0.1), ("min_p", 1.5), ("min_p", float("nan")), ("min_p", True), ("min_p", "0.1"),
        ("logit_bias", {"a": 1.0}), ("logit_bias", {-1: 1.0}), ("logit_bias", {"-1": 1.0}), ("logit_bias", {1: 101}),
        ("logit_bias", {1: float("nan")}), ("logit_bias", {True: 1.0}), ("logit_bias", {1: "2"}), ("logit_bias", 3),
        ("logit_bias", "12"), ("logit_bias", {"1": 1.0, "01": 2.0}), ("logit_bias", [(1, 2, 3)]),
        ("min_tokens", -1), ("min_tokens", 1.0), ("min_tokens", True),
        ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", float("inf")),
        ("repetition_penalty", float("nan")), ("repetition_penalty", True),
        ("presence_penalty", 2.5), ("presence_penalty", -2.1), ("presence_penalty", float("nan")),
        ("frequency_penalty", 2.01), ("frequency_penalty", -3), ("frequency_penalty", None),
        ("cache_salt", ""), ("cache_salt", 5), ("cache_salt", b"salt"), ("cache_salt", ["a"]),
    ],
)
def test_a_bad_value_names_its_field(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError, match=field) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field


def test_new_settings_are_stored_in_canonical_form() -> None:
    p = SamplingParams(
        logit_bias={"7": 2, 3: -100, "12": 100.0}, min_p=0, min_tokens=3, repetition_penalty=2,
        presence_penalty=-2, frequency_penalty=2, max_tokens=2,  # min_tokens > max_tokens is allowed
    )
    assert p.logit_bias == ((3, -100.0), (7, 2.0), (12, 100.0))
    assert (p.min_p, p.min_tokens, p.repetition_penalty) == (0.0, 3, 2.0)
    assert attrs.evolve(p, temperature=1.0).logit_bias == p.logit_bias  # the stored pairs convert again
    assert SamplingParams(cache_salt="tenant-7").cache_salt == "tenant-7"
    d = SamplingParams()
    assert d.cache_salt is None
    assert (d.min_p, d.logit_bias, d.min_tokens, d.repetition_penalty, d.presence_penalty, d.frequency_penalty) == (
        None, (), 0, 1.0, 0.0, 0.0)


def test_degenerate_temperatures_are_greedy() -> None:
    assert GREEDY_BELOW == 1e-5
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=1e-38).greedy
    assert SamplingParams(temperature=9.99e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy and not SamplingParams(temperature=0.7).greedy


# -- each processor against its oracle ----------------------------------------------------------


def test_repetition_penalty_matches_transformers() -> None:
    logits = _logits(4)
    histories = [([1, 2, 3], [4, 4, 5]), ([], [0, 49]), ([10, 11, 10], []), ([], [])]
    penalties = [1.3, 0.7, 2.0, 1.5]
    rows = [
        SamplingRow(SamplingParams(repetition_penalty=r), None, prompt, out)
        for r, (prompt, out) in zip(penalties, histories, strict=True)
    ]
    ours = process_logits(logits, rows)
    for b, (r, (prompt, out)) in enumerate(zip(penalties, histories, strict=True)):
        ids = [*prompt, *out]
        theirs = _hf(transformers.RepetitionPenaltyLogitsProcessor(r), logits[b], ids) if ids else logits[b]
        torch.testing.assert_close(ours[b], theirs, rtol=0, atol=0)
    assert not torch.equal(ours[0], logits[0])  # the penalty changed something


def test_temperature_top_k_top_p_min_p_match_transformers_row_by_row() -> None:
    """Every row of one batch with its own settings; transformers' warpers chained per row
    in generate's order (temperature, top-k, top-p, min-p)."""
    settings: list[dict[str, Any]] = [
        dict(temperature=0.7),
        dict(temperature=1.0, top_k=5),
        dict(temperature=1.3, top_p=0.6),
        dict(temperature=0.5, min_p=0.2),
        dict(temperature=0.9, top_k=10, top_p=0.8, min_p=0.05),
        dict(temperature=1.0, top_k=V + 10, top_p=1.0),
        dict(temperature=2.0, top_p=0.05),
        dict(temperature=1.0, min_p=1.0),
    ]
    logits = _logits(len(settings), seed=1)
    ours = process_logits(logits, [SamplingRow(SamplingParams(**s)) for s in settings])
    for b, s in enumerate(settings):
        warpers: list[Any] = [transformers.TemperatureLogitsWarper(s["temperature"])]
        if "top_k" in s:
            warpers.append(transformers.TopKLogitsWarper(s["top_k"]))
        if s.get("top_p", 1.0) < 1.0:
            warpers.append(transformers.TopPLogitsWarper(s["top_p"]))
        if "min_p" in s:
            warpers.append(transformers.MinPLogitsWarper(s["min_p"]))
        theirs = logits[b]
        for w in warpers:
            theirs = _hf(w, theirs)
        _same_kept_and_values(ours[b], theirs)
    kept = torch.isfinite(ours).sum(dim=-1).tolist()
    assert kept[0] == V and kept[1] == 5 and kept[5] == V and kept[7] == 1 and 1 <= kept[6] < 5


@pytest.mark.parametrize("name", ["top_k", "top_p", "min_p"])
def test_each_warper_alone_matches_transformers(name: str) -> None:
    grid: dict[str, list[Any]] = {"top_k": [1, 3, 20, V], "top_p": [0.01, 0.3, 0.9, 0.999], "min_p": [0.0, 0.01, 0.3, 0.9]}
    values = grid[name]
    cls = {"top_k": transformers.TopKLogitsWarper, "top_p": transformers.TopPLogitsWarper,
           "min_p": transformers.MinPLogitsWarper}[name]
    logits = _logits(len(values), seed=2, scale=3.0)
    ours = process_logits(logits, [SamplingRow(SamplingParams(temperature=1.0, **{name: x})) for x in values])
    for b, x in enumerate(values):
        _same_kept_and_values(ours[b], _hf(cls(x), logits[b]))


def test_exact_boundaries_and_ties_as_transformers() -> None:
    """Four equal tokens (probabilities exactly 0.25): top_p 0.5 drops the two whose
    cumulative probability is <= 0.5; top_k 2 keeps every token tied with the 2nd;
    min_p 1 keeps every token tied with the most likely."""
    logits = torch.zeros(3, 4)
    ours = process_logits(logits, [SamplingRow(SamplingParams(temperature=1.0, top_p=0.5)),
                                   SamplingRow(SamplingParams(temperature=1.0, top_k=2)),
                                   SamplingRow(SamplingParams(temperature=1.0, min_p=1.0))])
    assert torch.isfinite(ours).sum(dim=-1).tolist() == [2, 4, 4]
    for b, w in enumerate([transformers.TopPLogitsWarper(0.5), transformers.TopKLogitsWarper(2),
                           transformers.MinPLogitsWarper(1.0)]):
        _same_kept_and_values(ours[b], _hf(w, logits[b]))


def test_presence_and_frequency_penalties_follow_openais_formula() -> None:
    logits = _logits(3, seed=3)
    outputs = [[1, 1, 1, 7, 9], [2], []]
    settings = [(0.5, 0.3), (-1.0, 2.0), (2.0, 2.0)]
    rows = [
        SamplingRow(SamplingParams(presence_penalty=pres, frequency_penalty=freq), None, [1, 2, 3, 4], out)
        for (pres, freq), out in zip(settings, outputs, strict=True)
    ]
    ours = process_logits(logits, rows)
    for b, ((pres, freq), out) in enumerate(zip(settings, outputs, strict=True)):
        expected = logits[b].double().clone()
        for j in range(V):  # mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence (the prompt not counted)
            c = out.count(j)
            expected[j] -= c * freq + float(c > 0) * pres
        torch.testing.assert_close(ours[b].double(), expected, rtol=0, atol=1e-5)
    assert ours[0][1] == pytest.approx(float(logits[0][1]) - 3 * 0.3 - 0.5, abs=1e-5)
    assert ours[0][3] == logits[0][3]  # in the prompt only: not penalised


def test_logit_bias_adds_to_the_named_tokens_only() -> None:
    logits = _logits(2, seed=4)
    logits[0, 3] = logits[0].max() - 1.0  # the bias makes it the argmax
    rows = [
        SamplingRow(SamplingParams(logit_bias={"3": 5.5, 40: -100, V + 7: 50.0})),  # an id past the vocabulary: ignored
        SamplingRow(SamplingParams()),
    ]
    ours = process_logits(logits, rows)
    expected = logits.clone()
    expected[0, 3] += 5.5
    expected[0, 40] -= 100
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
    assert [t.token_id for t in sample(logits, rows).tokens if t] == [3, int(logits[1].argmax())]


def test_min_tokens_masks_the_stop_ids_then_releases_them() -> None:
    logits = torch.zeros(1, V)
    logits[0, 5], logits[0, 6], logits[0, 8] = 10.0, 9.0, 8.0  # stop ids 5 and 6 are the most likely tokens
    params = SamplingParams(min_tokens=3)
    stops = frozenset({5, 6, V + 3})

    def greedy_after(n_out: int) -> tuple[int, torch.Tensor]:
        row = SamplingRow(params, None, [1, 2], list(range(n_out)), stops)
        token = sample(logits, [row]).tokens[0]
        assert token is not None
        return token.token_id, process_logits(logits, [row])[0]

    for n_out in range(3):
        token, processed = greedy_after(n_out)
        assert token == 8 and processed[5] == processed[6] == -math.inf and processed[8] == 8.0
    token, processed = greedy_after(3)
    assert token == 5 and torch.equal(processed, logits[0])
    # min_tokens 0, or no stop ids: nothing is masked
    assert sample(logits, [SamplingRow(SamplingParams(), None, [], [], stops)]).tokens[0] == SampledToken(5)


def test_processors_apply_in_order_and_leave_the_input_alone() -> None:
    """bias before the repetition penalty (a biased positive logit is then divided), the
    penalties before temperature (the penalty is scaled by 1/T)."""
    logits = torch.zeros(1, 6)
    logits[0] = torch.tensor([1.0, -1.0, 2.0, 0.5, 0.0, 3.0])
    before = logits.clone()
    p = SamplingParams(
        temperature=0.5, logit_bias={0: 1.0, 1: 3.0}, repetition_penalty=2.0, frequency_penalty=0.5
    )
    out = process_logits(logits, [SamplingRow(p, None, [0, 1], [2, 2])])[0]
    # token 0: (1 + 1) / 2 / 0.5; token 1: (-1 + 3) / 2 / 0.5; token 2: (2 / 2 - 2 * 0.5) / 0.5
    torch.testing.assert_close(out, torch.tensor([2.0, 2.0, 0.0, 1.0, 0.0, 6.0]))
    assert torch.equal(logits, before)


# -- the draw -----------------------------------------------------------------------------------


def test_greedy_rows_take_the_argmax_and_a_degenerate_temperature_does_not_overflow() -> None:
    logits = _logits(6, seed=5, scale=1e30)  # logits / 1e-38 would be inf
    rows = [SamplingRow(SamplingParams(temperature=t)) for t in (0.0, 1e-38, 1e-6, 0.0, 1e-30, 0.0)]
    step = sample(logits, rows)
    assert step.failed == []
    assert [t.token_id for t in step.tokens if t is not None] == logits.argmax(dim=-1).tolist()
    torch.testing.assert_close(process_logits(logits, rows), logits)  # unscaled


def test_a_failed_row_fails_alone() -> None:
    """A NaN row, a row with +inf, and a row where every token is masked fail; the other rows
    of the batch get the tokens they get without them (seeded, greedy and logprob rows)."""
    logits = _logits(7, seed=6)
    logits[1, 3] = float("nan")
    logits[3, 9] = float("inf")
    logits[5] = float("-inf")
    good = [0, 2, 4, 6]

    def rows() -> list[SamplingRow]:
        return [
            SamplingRow(SamplingParams(temperature=1.0, seed=1), torch.Generator().manual_seed(1)),
            SamplingRow(SamplingParams(temperature=1e-38)),  # greedy NaN row
            SamplingRow(SamplingParams(temperature=0.0, logprobs=2)),
            SamplingRow(SamplingParams(temperature=0.8, seed=2), torch.Generator().manual_seed(2)),
            SamplingRow(SamplingParams(temperature=0.9, top_k=4, seed=3), torch.Generator().manual_seed(3)),
            SamplingRow(SamplingParams(temperature=1.0, seed=4), torch.Generator().manual_seed(4)),
            SamplingRow(SamplingParams(temperature=1.0, top_p=0.5, logprobs=1), torch.Generator().manual_seed(5)),
        ]

    step = sample(logits, rows())
    assert isinstance(step, StepSample) and step.failed == [1, 3, 5]
    assert [step.tokens[b] is None for b in range(7)] == [b not in good for b in range(7)]
    alone = sample(logits[good], [rows()[b] for b in good])
    assert [step.tokens[b] for b in good] == alone.tokens and alone.failed == []
    with pytest.raises(RtpcoreError, match=r"rows \[1\]"):  # the compatibility wrapper raises instead
        sample_step(logits[:2], [SamplingParams(), SamplingParams()], [None, None])


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_the_exponential_race_draws_from_the_processed_softmax() -> None:
    """20000 rows of one distribution, drawn with and without a seeded generator: the
    counts pass a chi-square test against softmax(processed) (df 7: 24.3 is p = 0.001);
    the tokens top-k drops are never drawn."""
    v, n = 10, 20000
    raw = torch.tensor([[1.0, 0.5, 0.0, -0.3, 2.0, 1.5, -1.0, 0.2, 0.8, -2.0]])
    params = SamplingParams(temperature=0.8, top_k=8)
    probs = process_logits(raw, [SamplingRow(params)]).softmax(dim=-1)[0]
    kept = probs > 0
    assert int(kept.sum()) == 8
    torch.manual_seed(1234)
    unseeded = sample(raw.expand(n, v), [SamplingRow(params)] * n)
    gen = torch.Generator().manual_seed(99)
    seeded = sample(raw.expand(n, v), [SamplingRow(params, gen)] * n)
    for step in (unseeded, seeded):
        ids = torch.tensor([t.token_id for t in step.tokens if t is not None])
        counts = torch.bincount(ids, minlength=v).double()
        assert counts[~kept].sum() == 0
        assert _chi_square(counts[kept], probs[kept].double()) < 24.3
    # the oracle can fail: the unprocessed distribution is far from these counts
    ids = torch.tensor([t.token_id for t in seeded.tokens if t is not None])
    assert _chi_square(torch.bincount(ids, minlength=v).double(), raw[0].softmax(-1).double()) > 100


def test_seeded_rows_draw_the_same_tokens_alone_and_in_any_batch() -> None:
    logits = _logits(12, v=1000, seed=7)
    seeds = {1: 11, 4: 12, 9: 13}
    params = {b: SamplingParams(temperature=1.0, top_p=0.95, seed=s, repetition_penalty=1.1) for b, s in seeds.items()}

    def run(batch_of: list[int], steps: int = 5) -> dict[int, list[int]]:
        gens = {b: torch.Generator().manual_seed(seeds[b]) for b in seeds}
        out: dict[int, list[int]] = {b: [] for b in seeds}
        for _ in range(steps):
            rows = [
                SamplingRow(params[b], gens[b], [1, 2], out[b]) if b in seeds else SamplingRow(
                    SamplingParams(temperature=float(b % 3))) for b in batch_of
            ]
            step = sample(logits[batch_of], rows)
            for b, t in zip(batch_of, step.tokens, strict=True):
                if b in seeds and t is not None:
                    out[b].append(t.token_id)
        return out

    alone = {b: run([b])[b] for b in seeds}
    assert run(list(range(12))) == alone
    assert run([9, 0, 4, 2, 3, 1, 7]) == alone
    assert len({tuple(x) for x in alone.values()}) == 3


def test_log_probabilities_are_the_raw_ones() -> None:
    logits = _logits(4, seed=8)
    rows = [
        SamplingRow(SamplingParams(temperature=0.5, top_k=3, repetition_penalty=1.5, logprobs=5),
                    torch.Generator().manual_seed(0), [], [0, 1]),
        SamplingRow(SamplingParams(logprobs=0, presence_penalty=2.0), None, [], [2]),
        SamplingRow(SamplingParams(temperature=1.0)),
        SamplingRow(SamplingParams(temperature=1.0, min_p=0.5, logprobs=2)),
    ]
    step = sample(logits, rows)
    raw = logits.log_softmax(dim=-1)
    for b in (0, 1, 3):
        t = step.tokens[b]
        assert t is not None and t.logprob == pytest.approx(float(raw[b, t.token_id]), abs=1e-6)
        want = rows[b].params.logprobs or 0
        assert len(t.top) == want
        top = raw[b].topk(want) if want else None
        if top is not None:
            assert [i for i, _ in t.top] == top.indices.tolist()
            assert [lp for _, lp in t.top] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert step.tokens[2] is not None and step.tokens[2].logprob is None and step.tokens[2].top == ()


# -- host transfers -----------------------------------------------------------------------------


_SYNCS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "nonzero"}


class _CountSyncs(TorchFunctionMode):
    """Counts the tensor methods that bring data to the host (and torch.multinomial)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in _SYNCS or name == "multinomial" or name == "masked_select":
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


@contextmanager
def _count_syncs() -> Iterator[list[str]]:
    with _CountSyncs() as mode:
        yield mode.calls


def _rich_rows(n: int) -> list[SamplingRow]:
    rows = []
    for b in range(n):
        p = SamplingParams(
            temperature=[0.0, 0.7, 1.2][b % 3], top_k=[None, 5][b % 2], top_p=[None, 0.9, 0.5][b % 3],
            min_p=[None, 0.1][b % 2], logit_bias={b % 7: 3.0}, min_tokens=2, repetition_penalty=1.2,
            presence_penalty=0.3, frequency_penalty=0.2, logprobs=[None, 2, 0][b % 3], seed=b if b % 2 else None,
        )
        gen = torch.Generator().manual_seed(b) if b % 2 else None
        rows.append(SamplingRow(p, gen, [1, 2, 3], list(range(b % 4)), frozenset({4})))
    return rows


def test_a_step_brings_its_results_to_the_host_once() -> None:
    logits = _logits(9, seed=9)
    logits[4, 0] = float("nan")
    rows = _rich_rows(9)
    with _count_syncs() as calls:
        step = sample(logits, rows)
    assert calls == ["tolist"]
    assert step.failed == [4] and sum(t is None for t in step.tokens) == 1
    # the counter sees a second transfer
    with _count_syncs() as calls:
        sample(logits, rows).tokens[0]
        logits.argmax().item()
    assert calls == ["tolist", "item"]


# -- speculative decoding on the same processing ------------------------------------------------


def _sequential_greedy(logits: torch.Tensor, row: SamplingRow, k: int) -> list[int]:
    """The target's greedy tokens row by row with sample(), each row's history growing."""
    out: list[int] = []
    for j in range(k + 1):
        r = attrs.evolve(row, output_ids=[*row.output_ids, *out])
        t = sample(logits[j : j + 1], [r]).tokens[0]
        assert t is not None
        out.append(t.token_id)
    return out


def test_greedy_verification_follows_the_processed_argmax_with_the_proposals_as_history() -> None:
    """Each row's raw argmax is token 2; a repetition penalty makes a proposed 2 unlikely in
    the next rows, and min_tokens masks the stop id 3 for the first two rows."""
    logits = torch.zeros(4, 8)
    logits[:, 2] = 3.0
    logits[:, 5] = 2.0
    logits[:, 3] = 2.5
    row = SamplingRow(SamplingParams(repetition_penalty=4.0, min_tokens=3), None, [1], [0], frozenset({3}))
    expected = _sequential_greedy(logits, row, 3)
    assert expected == [2, 5, 3, 2] != logits.argmax(dim=-1).tolist()
    for drafted in ([2, 5, 3], [2, 5, 1], [2, 2, 3], [3, 5, 3], [2, 5]):
        k = len(drafted)
        n = 0
        while n < k and drafted[n] == expected[n]:
            n += 1
        (verdict,) = verify_batch(logits[: k + 1], [Proposal(row, drafted, [None] * k)])
        assert verdict.accepted == n and not verdict.failed
        assert [t.token_id for t in verdict.tokens] == [*drafted[:n], expected[n]]
    tokens, n = verify(logits, [2, 5, 3], [None] * 3, row)  # the one-request form
    assert n == 3 and [t.token_id for t in tokens] == expected


def test_propose_draws_from_the_processed_draft_distribution() -> None:
    logits = _logits(3, seed=10)
    rows = [
        SamplingRow(SamplingParams(repetition_penalty=100.0), None, [], [int(logits[0].argmax())]),
        SamplingRow(SamplingParams(temperature=0.7, top_k=3), torch.Generator().manual_seed(0)),
        SamplingRow(SamplingParams(temperature=1.0, logit_bias={7: 100}), None),
    ]
    with _count_syncs() as calls:
        tokens, dists = propose(logits, rows)
    assert calls == ["tolist"]
    processed = process_logits(logits, rows)
    assert tokens[0] == int(processed[0].argmax()) != int(logits[0].argmax()) and dists[0] is None
    for g in (1, 2):
        q = dists[g]
        assert q is not None
        torch.testing.assert_close(q, processed[g].softmax(dim=-1))
        assert q[tokens[g]] > 0
    assert tokens[2] == 7
    assert propose(logits, [r.params for r in rows], [r.generator for r in rows])[0][0] == int(logits[0].argmax())


def test_a_failed_draft_row_proposes_from_a_one_hot_distribution() -> None:
    logits = _logits(2, seed=11)
    logits[0] = float("nan")
    tokens, dists = propose(logits, [SamplingRow(SamplingParams(temperature=1.0)), SamplingRow(SamplingParams())])
    assert tokens[0] == 0 and dists[0] is not None and dists[0].tolist() == [1.0] + [0.0] * (V - 1)


def _tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def test_rejection_sampling_follows_the_processed_target_distribution() -> None:
    """20000 copies of one request, verified in one batch: a draft far from the target
    proposes two tokens; the first emitted token follows the processed target row 0, and
    the second (after an accepted first proposal) row 1 processed with that proposal in
    its history. Accepting every proposal would follow the draft instead."""
    v, n = 8, 20000
    gen = torch.Generator().manual_seed(1)
    target = torch.randn(2, v, generator=gen) * 1.5
    draft = target + torch.randn(2, v, generator=gen) * 1.5
    params = SamplingParams(temperature=0.9, top_k=6, repetition_penalty=1.8, frequency_penalty=0.5)
    row = SamplingRow(params, None, [1], [2])
    torch.manual_seed(5)
    d0, q0 = propose(draft[:1].expand(n, v), [row] * n)
    p0 = process_logits(target[:1], [row]).softmax(dim=-1)[0]
    assert _tv(torch.bincount(torch.tensor(d0), minlength=v).double(), p0.double()) > 0.2  # the draft differs
    rows1 = [attrs.evolve(row, output_ids=[2, d]) for d in d0]
    d1, q1 = propose(draft[1:].expand(n, v), rows1)
    logits = target[[0, 1, 1]].repeat(n, 1)  # k + 1 = 3 rows per request
    verdicts = verify_batch(logits, [Proposal(row, [d0[i], d1[i]], [q0[i], q1[i]]) for i in range(n)])
    first = torch.bincount(torch.tensor([vd.tokens[0].token_id for vd in verdicts]), minlength=v).double()
    assert _tv(first, p0.double()) < 0.02
    accepted = sum(vd.accepted for vd in verdicts)
    assert 0 < accepted < 2 * n
    # second token, per accepted first proposal: the target row 1 processed with it as history
    checked = 0
    for d in range(v):
        seconds = [vd.tokens[1].token_id for vd, t in zip(verdicts, d0, strict=True) if vd.accepted >= 1 and t == d]
        if len(seconds) < 2000:
            continue
        p1 = process_logits(target[1:], [attrs.evolve(row, output_ids=[2, d])]).softmax(dim=-1)[0]
        assert _tv(torch.bincount(torch.tensor(seconds), minlength=v).double(), p1.double()) < 0.04
        checked += 1
    assert checked >= 2


def test_verify_batch_one_transfer_failures_seeds_and_plain_draws() -> None:
    """A request without proposals is the same draw sample() makes; a seeded request
    verifies the same alone and in a batch; a NaN target row fails its request alone;
    log-probabilities are the target's raw ones; one host transfer for everything."""
    logits = _logits(3 + 1 + 4 + 2, seed=12)
    logits[8, 5] = float("nan")  # the first row of the last request
    draft = _logits(3, seed=13)

    def requests() -> list[Proposal]:
        seeded = SamplingRow(SamplingParams(temperature=1.0, logprobs=3), torch.Generator().manual_seed(7), [], [4])
        d, q = propose(draft[:2], [seeded, attrs.evolve(seeded, generator=torch.Generator().manual_seed(70))])
        plain = SamplingRow(SamplingParams(temperature=0.8, seed=3), torch.Generator().manual_seed(3))
        greedy = SamplingRow(SamplingParams(logprobs=1), None, [], [9])
        return [
            Proposal(attrs.evolve(seeded, generator=torch.Generator().manual_seed(7)), d, q),
            Proposal(plain),
            Proposal(greedy, [int(logits[4].argmax()), int(logits[5].argmax()), 0], [None] * 3),
            Proposal(SamplingRow(SamplingParams()), [5], [None]),  # 5 is the NaN's index (argmax of the row)
        ]

    batch = requests()
    with _count_syncs() as calls:
        verdicts = verify_batch(logits, batch)
    assert calls == ["tolist"]
    assert [vd.failed for vd in verdicts] == [False, False, False, True]
    assert verdicts[3].tokens == [] and verdicts[3].accepted == 0
    # the plain request: the same token sample() draws with the same seed
    plain = sample(logits[3:4], [SamplingRow(SamplingParams(temperature=0.8), torch.Generator().manual_seed(3))])
    assert [t.token_id for t in verdicts[1].tokens] == [plain.tokens[0].token_id]  # type: ignore[union-attr]
    # the greedy request: two argmax proposals accepted, the third replaced by the argmax
    assert verdicts[2].accepted == 2 + (int(logits[6].argmax()) == 0)
    raw = logits.log_softmax(dim=-1)
    for j, t in enumerate(verdicts[2].tokens):
        assert t.logprob == pytest.approx(float(raw[4 + j, t.token_id]), abs=1e-6) and len(t.top) == 1
    for j, t in enumerate(verdicts[0].tokens):
        assert t.logprob == pytest.approx(float(raw[j, t.token_id]), abs=1e-6)
        assert [i for i, _ in t.top] == raw[j].topk(3).indices.tolist()
    alone = verify_batch(logits[:3], requests()[:1])
    assert alone == verdicts[:1]
    with pytest.raises(RtpcoreError):
        verify(logits[8:10], [1], [None], SamplingParams(), None)
    with pytest.raises(ValueError, match="distributions"):
        verify_batch(logits[:2], [Proposal(SamplingRow(SamplingParams(temperature=1.0)), [1], [None])])


@pytest.mark.gpu
def test_on_the_device_one_transfer_and_seeded_rows_as_alone() -> None:
    device = torch.device("cuda")
    logits = _logits(9, seed=14).to(device)
    rows = [attrs.evolve(r, generator=torch.Generator(device).manual_seed(b)) if r.generator else r
            for b, r in enumerate(_rich_rows(9))]
    with _count_syncs() as calls:
        step = sample(logits, rows)
    assert calls == ["tolist"] and step.failed == []
    again = [attrs.evolve(r, generator=torch.Generator(device).manual_seed(b)) if r.generator else r
             for b, r in enumerate(_rich_rows(9))]
    for b in (1, 3, 5):
        assert sample(logits[b : b + 1], [again[b]]).tokens[0] == step.tokens[b]
    assert sample(logits.cpu(), [attrs.evolve(r, generator=None) for r in rows]).failed == []


# -- the greedy picks a decode graph holds (rtpcore.engine.sample.sampler.greedy_pick) ---------------------


def test_greedy_picks_equal_the_samplers_tokens_and_failed_rows() -> None:
    """Plain greedy rows, some not finite (a NaN, +inf, every entry -inf), some with tied maxima:
    the device's picks are the sampler's tokens, and -1 exactly on its failed rows."""
    from rtpcore.engine.sample.sampler import greedy_pick

    for seed in range(20):
        logits = _logits(9, seed=seed).round()  # rounding makes ties
        logits[1, 7] = float("nan")
        logits[4, 3] = float("inf")
        logits[6] = float("-inf")
        for dtype in (torch.float32, torch.bfloat16):
            x = logits.to(dtype)
            drawn = sample(x, [SamplingRow(SamplingParams())] * 9)
            picks = greedy_pick(x).tolist()
            assert [-1 if t is None else t.token_id for t in drawn.tokens] == picks
            assert drawn.failed == [b for b, t in enumerate(picks) if t == -1] == [1, 4, 6]


@pytest.mark.parametrize("change", [
    {"temperature": 0.7}, {"logprobs": 0}, {"logit_bias": {3: 1.0}}, {"repetition_penalty": 1.2},
    {"presence_penalty": 0.5}, {"frequency_penalty": 0.5}, {"min_tokens": 3},
])
def test_a_row_with_any_processor_is_not_plain_greedy(change: dict[str, Any]) -> None:
    """Each setting that can move a greedy token or asks for more than the token keeps the row off
    the device's greedy path; min_tokens only while it masks the stop ids."""
    from rtpcore.engine.sample.sampler import plain_greedy

    assert plain_greedy(SamplingRow(SamplingParams(), stop_ids=frozenset({2}), output_ids=[1]))
    row = SamplingRow(SamplingParams(**change), stop_ids=frozenset({2}), output_ids=[1])
    assert not plain_greedy(row)
    if "min_tokens" in change:
        assert plain_greedy(attrs.evolve(row, output_ids=[1, 5, 6]))  # reached: the mask is off
        assert plain_greedy(attrs.evolve(row, stop_ids=frozenset()))  # nothing to mask


# -- token views: a row's history without a copy --------------------------------------------------


@settings(max_examples=200)
@given(st.lists(st.integers(-3, V + 3), max_size=12), st.data())
def test_a_token_view_reads_as_the_list_slice(tokens: list[int], data: Any) -> None:
    """Every index, slice and iteration of TokenView(tokens, start, stop) is the slice's; the
    tokens appended later are not in it; a write in its range shows through (no copy)."""
    from rtpcore.engine.sample.sampler import TokenView

    n = len(tokens)
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    view, want = TokenView(tokens, start, stop), tokens[start:stop]
    assert len(view) == len(want) and list(view) == want and view == want and want == view
    assert view == TokenView(list(want)) and view != [*want, 0] and view != tuple(want)  # as a list: no tuple
    assert list(reversed(view)) == want[::-1]
    for i in range(-len(want) - 2, len(want) + 2):
        if -len(want) <= i < len(want):
            assert view[i] == want[i]
        else:
            with pytest.raises(IndexError):
                view[i]
    ends = st.none() | st.integers(-len(want) - 2, len(want) + 2)
    for _ in range(8):
        sl = slice(data.draw(ends), data.draw(ends), data.draw(st.none() | st.sampled_from([1, 2, 3, -1, -2])))
        assert view[sl] == want[sl] and isinstance(view[sl], list)
    for t in (-3, 0, 1, V + 3):
        assert (t in view) == (t in want) and view.count(t) == want.count(t)
    tokens.append(7)  # a later token: not in the view
    assert len(view) == len(want) and list(view) == want
    if want:
        tokens[start] = 99  # the view reads the list itself
        assert view[0] == 99
    assert TokenView(tokens) == tokens and len(TokenView(tokens, 1 if tokens else 0)) == max(len(tokens) - 1, 0)
    for bad in ((-1, 0), (1, 0), (0, len(tokens) + 1)):
        with pytest.raises(ValueError):
            TokenView(tokens, *bad)


@settings(max_examples=60)
@given(st.data())
def test_views_and_lists_give_the_same_processing_and_draws(data: Any) -> None:
    """Rows whose history is a view over one token list (as the engine builds them) against the
    same rows with list copies (and tuples): the same processed logits bit for bit, the same draws, the same
    plain-greedy verdict, also with proposals appended (history_row). Histories hold ids outside
    the vocabulary too (ignored)."""
    from rtpcore.engine.sample.sampler import TokenView, history_row, plain_greedy

    ids = st.integers(-2, V + 2)
    n = data.draw(st.integers(1, 5))
    as_views, as_lists, as_tuples = [], [], []
    for b in range(n):
        prompt = data.draw(st.lists(ids, min_size=1, max_size=20))
        out = data.draw(st.lists(ids, max_size=10))
        params = SamplingParams(
            temperature=data.draw(st.sampled_from([0.0, 0.8])), seed=b,
            repetition_penalty=data.draw(st.sampled_from([1.0, 1.3, 0.7])),
            presence_penalty=data.draw(st.sampled_from([0.0, 0.5])),
            frequency_penalty=data.draw(st.sampled_from([0.0, 0.25])),
            min_tokens=data.draw(st.integers(0, 12)),
        )
        stops = frozenset(data.draw(st.lists(st.integers(0, V - 1), max_size=3)))
        tokens = prompt + out  # a request's one list: prompt, then output
        view_row = SamplingRow(params, None, TokenView(tokens, 0, len(prompt)), TokenView(tokens, len(prompt)), stops)
        list_row = SamplingRow(params, None, list(prompt), list(out), stops)
        drafted = data.draw(st.lists(st.integers(0, V - 1), max_size=3))
        as_views.append(history_row(view_row, drafted))
        as_lists.append(history_row(list_row, drafted))
        as_tuples.append(history_row(attrs.evolve(list_row, prompt_ids=tuple(prompt), output_ids=tuple(out)), drafted))
        assert plain_greedy(view_row) == plain_greedy(list_row)
        tokens.append(3)  # the token the step will append: not in the rows
    logits = _logits(n, seed=data.draw(st.integers(0, 99)))
    assert torch.equal(process_logits(logits, as_views), process_logits(logits, as_lists))
    assert torch.equal(process_logits(logits, as_tuples), process_logits(logits, as_lists))

    def draws(rows: list[SamplingRow]) -> list[SampledToken | None]:
        rows = [attrs.evolve(r, generator=torch.Generator().manual_seed(b)) for b, r in enumerate(rows)]
        return sample(logits, rows).tokens

    assert draws(as_views) == draws(as_lists)

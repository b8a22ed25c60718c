"""One batched sampler for a whole engine step, on the logits' device.

:func:`process_logits` turns a step's (N, V) logits into the logits the draw uses, one row
per request (:class:`SamplingRow`), in this order:

0. a grammar (``SamplingParams.grammar``, ``rtpcore.engine.sample.grammar``): the tokens the row's
   grammar does not allow next are -inf (rows without one pay nothing);
1. ``logit_bias``: each named token's bias added to its logit;
2. ``min_tokens``: while the row's request generated fewer tokens, its stop ids are -inf
   (not on a row with a grammar: the grammar decides when the output may end);
3. ``repetition_penalty`` over the prompt and the output tokens: a seen token's logit is
   divided by the penalty when positive, multiplied when negative (transformers'
   ``RepetitionPenaltyLogitsProcessor``);
4. ``presence_penalty`` / ``frequency_penalty`` over the output tokens only:
   ``logit -= presence * (count > 0) + frequency * count`` (OpenAI's);
5. temperature (greedy rows are not scaled), then top-k, top-p and min-p (min-p relative
   to the most likely token's probability after temperature, transformers'
   ``MinPLogitsWarper``); greedy rows skip these three, which never move the argmax.

Then :func:`sample` draws: greedy rows take the argmax of the processed logits, sampled
rows the exponential race (the argmax of ``probs / E`` with ``E ~ Exponential(1)`` per
token, a draw from ``probs`` that needs no host synchronisation, unlike
``torch.multinomial``). Rows without a generator share one noise draw from torch's global
generator; a row with its own (seeded) generator draws its noise from it alone, in a short
Python loop over the seeded rows only (one kernel each), so a seeded request samples the
same tokens alone or in any batch.

Batched: per-row settings become (N,) / (N, 1) tensors, token-dependent processors are
built from one flat host tensor of ``row * V + token`` indices with index/scatter ops, each
only when some row uses it; every host-side number a call needs travels to the device in
one copy (pinned and non-blocking on a GPU), and the results come back in one transfer
(tokens, failure flags and log-probabilities packed into one tensor, one ``.tolist()``).
Token ids outside ``[0, V)`` in a row's history, stop ids or logit_bias are ignored.

Failures: a row whose processed logits hold a NaN or +inf, or no finite entry (every token
masked), is reported in :attr:`StepSample.failed` and gets no token; it never raises and
never changes the other rows.

Log-probabilities (``SamplingParams.logprobs``) are the model's raw ones: log-softmax of
the unprocessed logits (before penalties, temperature and truncation), for the chosen token
and exactly ``logprobs`` most likely alternatives.
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Iterator, Sequence
from itertools import chain, islice
from typing import overload

import attrs
import torch

from rtpcore.engine.sample.grammar import GrammarState, apply_grammar_masks
from rtpcore.engine.sample.params import SampledToken, SamplingParams
from rtpcore.errors import RtpcoreError

__all__ = [
    "SamplingRow", "StepSample", "TokenView", "greedy_pick", "history_row", "plain_greedy", "process_logits", "sample",
    "sample_step",
]

_NINF = float("-inf")


@attrs.frozen
class SamplingRow:
    """What the sampler needs from one request for one logits row. ``generator``: the
    request's own (seeded) generator, on the logits' device, or None. ``output_ids``: the
    tokens generated so far, before this row's draw. ``stop_ids``: the ids that end the
    request (masked while ``min_tokens`` is not reached). The sequences are read only
    when the request uses a processor that needs them (any ``Sequence`` works: the engine
    passes views (:class:`TokenView`) of the request's own token list, so building a row copies
    nothing)."""

    params: SamplingParams
    generator: torch.Generator | None = None
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    stop_ids: frozenset[int] = frozenset()
    grammar: GrammarState | None = None  # the request's position in its grammar (rtpcore.engine.sample.grammar)


@attrs.frozen
class StepSample:
    """:func:`sample`'s answer: one token per row (None for a failed row), and the failed
    rows, whose distribution was not finite (NaN/inf logits, or every token masked)."""

    tokens: list[SampledToken | None]
    failed: list[int]


class TokenView(Sequence[int]):
    """``tokens[start:stop]`` without copying: a read-only view of a token list (a
    request's prompt or output, for a :class:`SamplingRow`). ``stop`` (default: the list's
    length when the view is made) is fixed then, so the tokens the list gains later are not
    in the view; the list must not change in ``[start, stop)`` while the view is read.
    Indexing, slicing (a slice is a new list, as a list's) and iteration are a list's;
    a view equals a list or a view with the same tokens."""

    __slots__ = ("_start", "_stop", "_tokens")

    def __init__(self, tokens: Sequence[int], start: int = 0, stop: int | None = None):
        n = len(tokens)
        stop = n if stop is None else stop
        if not 0 <= start <= stop <= n:
            raise ValueError(f"a view [{start}:{stop}] of {n} tokens")
        self._tokens, self._start, self._stop = tokens, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            r = range(self._start, self._stop)[i]
            if r.step == 1:
                return self._list(r.start, r.stop)
            return [self._tokens[j] for j in r]
        i = operator.index(i)
        n = self._stop - self._start
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("TokenView index out of range")
        return self._tokens[self._start + i]

    def __iter__(self) -> Iterator[int]:
        if self._start == 0:
            return islice(self._tokens, self._stop)
        return map(self._tokens.__getitem__, range(self._start, self._stop))  # no walk over the first start tokens

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenView):
            return self._list(self._start, self._stop) == other._list(other._start, other._stop)
        if isinstance(other, list):
            return self._list(self._start, self._stop) == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, so unhashable as they are

    def __repr__(self) -> str:
        return f"TokenView({self._list(self._start, self._stop)!r})"

    def _list(self, start: int, stop: int) -> list[int]:
        part = self._tokens[start:stop]
        return part if isinstance(part, list) else list(part)


class _Concat(Sequence[int]):
    """``head + tail`` without copying ``head`` (a request's output plus proposals)."""

    def __init__(self, head: Sequence[int], tail: Sequence[int]):
        self.head, self.tail = head, tail

    def __len__(self) -> int:
        return len(self.head) + len(self.tail)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[int]: ...
    def __getitem__(self, i: int | slice) -> int | Sequence[int]:
        if isinstance(i, slice):
            return list(self)[i]
        n = len(self.head)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.head[i] if i < n else self.tail[i - n]

    def __iter__(self) -> Iterator[int]:
        return chain(self.head, self.tail)


def plain_greedy(row: SamplingRow) -> bool:
    """Whether :func:`sample` would give ``row`` the plain argmax of its raw logits: greedy,
    no grammar, no logit_bias, no penalty, no ``min_tokens`` mask in force, no logprobs. A
    step whose every row is plain greedy needs no sampler: :func:`greedy_pick` on the device
    (inside a decode graph when one serves the step) gives the same tokens."""
    p = row.params
    return (
        p.greedy
        and p.logprobs is None
        and row.grammar is None
        and not p.logit_bias
        and p.repetition_penalty == 1.0
        and not p.presence_penalty
        and not p.frequency_penalty
        and not (p.min_tokens and row.stop_ids and len(row.output_ids) < p.min_tokens)
    )


def greedy_pick(logits: torch.Tensor) -> torch.Tensor:
    """(N, V) logits -> (N,) int64: each row's argmax (the first of equal maxima, as
    :func:`sample`), or -1 for a row whose distribution is not finite (a NaN or +inf, or no
    finite entry: :func:`sample`'s failed rows). Device-only, so a CUDA graph can hold it."""
    best, picks = logits.max(dim=-1)  # one pass for both (amax + argmax: 3x the time on a CPU, bf16)
    return torch.where(torch.isfinite(best), picks, torch.full_like(picks, -1))


def history_row(row: SamplingRow, drafted: Sequence[int]) -> SamplingRow:
    """``row`` with ``drafted`` appended to its output (a speculative row's history)."""
    if not drafted:
        return row
    return SamplingRow(row.params, row.generator, row.prompt_ids, _Concat(row.output_ids, drafted), row.stop_ids,
                       row.grammar)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``: pinned, then copied without blocking (no wait for the stream)."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _pack(buffer: array[int], tokens: Sequence[int]) -> None:
    """Append ``tokens`` to ``buffer`` as machine ints: a list or a view at C speed (a
    penalised row's history is its whole context, every step)."""
    if isinstance(tokens, _Concat):
        _pack(buffer, tokens.head)
        _pack(buffer, tokens.tail)
    elif isinstance(tokens, list):
        buffer.fromlist(tokens)
    elif isinstance(tokens, TokenView):
        buffer.fromlist(tokens[:])
    else:
        buffer.extend(tokens)


def _flat_indices(rows: Sequence[int], tokens: Sequence[Sequence[int]], v: int) -> torch.Tensor:
    """int64 ``row * v + token`` for every token of every row (tokens outside [0, v) dropped)."""
    lengths = [len(t) for t in tokens]
    if not sum(lengths):
        return torch.zeros(0, dtype=torch.int64)
    packed = array("q")
    for t in tokens:
        _pack(packed, t)
    flat = torch.frombuffer(packed, dtype=torch.int64)
    row_of = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), torch.tensor(lengths))
    keep = (flat >= 0) & (flat < v)
    return (row_of * v + flat)[keep]


def process_rows(
    logits: torch.Tensor, rows: Sequence[SamplingRow], extra: Sequence[int] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`process_logits`, and ``extra`` (host ints the caller needs on the device)
    as an int64 device tensor, carried in the same host-to-device copy."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits of shape {tuple(logits.shape)} for {len(rows)} rows")
    x = apply_grammar_masks(logits.float(), [r.grammar for r in rows])  # a new tensor when any row has one
    n, v = x.shape
    params = [r.params for r in rows]
    # Per-row settings; greedy rows are neither scaled nor truncated.
    temps = [1.0 if p.greedy else p.temperature for p in params]
    top_k = [v if p.greedy or p.top_k is None else min(p.top_k, v) for p in params]
    # top-p drops sorted tokens whose ascending cumulative probability is <= 1 - top_p; -1 drops none
    top_p = [-1.0 if p.greedy or p.top_p is None or p.top_p >= 1.0 else 1.0 - p.top_p for p in params]
    min_p = [0.0 if p.greedy or p.min_p is None else p.min_p for p in params]
    rep = [p.repetition_penalty for p in params]
    pres = [p.presence_penalty for p in params]
    freq = [p.frequency_penalty for p in params]
    # Token-dependent processors: flat row * V + token indices, only for the rows using them.
    bias_idx = [b * v + t for b, p in enumerate(params) for t, _ in p.logit_bias if t < v]
    bias_val = [w for p in params for t, w in p.logit_bias if t < v]
    mask_idx = [
        b * v + t
        for b, r in enumerate(rows)
        if r.params.min_tokens and r.stop_ids and len(r.output_ids) < r.params.min_tokens and r.grammar is None
        for t in sorted(r.stop_ids)
        if 0 <= t < v
    ]
    rep_rows = [b for b, p in enumerate(params) if p.repetition_penalty != 1.0]
    rep_idx = _flat_indices(rep_rows, [_Concat(rows[b].prompt_ids, rows[b].output_ids) for b in rep_rows], v)
    pf_rows = [b for b, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
    count_idx = _flat_indices(pf_rows, [rows[b].output_ids for b in pf_rows], v)
    # One host buffer (float64: ids and indices stay exact), one copy to the device.
    parts = [
        torch.tensor([temps, top_k, top_p, min_p, rep, pres, freq, [float(not p.greedy) for p in params]],
                     dtype=torch.float64).flatten(),
        torch.tensor(bias_idx, dtype=torch.float64),
        torch.tensor(bias_val, dtype=torch.float64),
        torch.tensor(mask_idx, dtype=torch.float64),
        rep_idx.double(),
        count_idx.double(),
        torch.tensor(list(extra), dtype=torch.float64),
    ]
    sizes = [t.numel() for t in parts]
    dev = to_device(torch.cat(parts), x.device)
    cols, d_bias_idx, d_bias_val, d_mask, d_rep, d_count, d_extra = dev.split(sizes)
    cols = cols.view(8, n)
    d_extra = d_extra.long()

    if bias_idx:
        x = x.reshape(-1).index_put((d_bias_idx.long(),), d_bias_val.float(), accumulate=True).view(n, v)
    if mask_idx:
        x = x.reshape(-1).index_fill(0, d_mask.long(), _NINF).view(n, v)
    if rep_idx.numel():
        seen = torch.zeros(n * v, dtype=torch.bool, device=x.device).index_fill_(0, d_rep.long(), True).view(n, v)
        pen = cols[4].float()[:, None]
        x = torch.where(seen, torch.where(x < 0, x * pen, x / pen), x)
    if count_idx.numel():
        counts = torch.zeros(n * v, device=x.device)
        counts = counts.index_add_(0, d_count.long(), torch.ones(count_idx.numel(), device=x.device)).view(n, v)
        x = x - counts * cols[6].float()[:, None] - (counts > 0).float() * cols[5].float()[:, None]
    if any(t != 1.0 for t in temps):
        x = x / cols[0].float()[:, None]
    use_k, use_p = any(k < v for k in top_k), any(t >= 0.0 for t in top_p)
    if use_k or use_p:
        xs, order = x.sort(dim=-1)  # ascending, as transformers' warpers
        drop = torch.zeros_like(xs, dtype=torch.bool)
        if use_k:  # below the k-th largest value (ties with it stay)
            drop = xs < xs.gather(1, (v - cols[1].long())[:, None])
            xs = xs.masked_fill(drop, _NINF)
        if use_p:
            cum = xs.softmax(dim=-1).cumsum(dim=-1)
            drop_p = cum <= cols[2].float()[:, None]
            drop_p[:, -1] = False  # the most likely token always stays
            drop = drop | drop_p
        x = x.masked_fill(drop.scatter(1, order, drop), _NINF)
    if any(m > 0.0 for m in min_p):
        probs = x.softmax(dim=-1)
        x = x.masked_fill(probs < cols[3].float()[:, None] * probs.amax(dim=-1, keepdim=True), _NINF)
    return x, d_extra


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """(N, V) logits -> the (N, V) float32 logits sampling draws from: logit_bias,
    min_tokens masking, repetition/presence/frequency penalties, temperature (greedy rows
    unscaled), top-k, top-p, min-p, in that order (the module's docstring). Batched: no
    per-row loop of kernels. The result may share memory with ``logits`` when no
    processor applies; nothing is written into ``logits``."""
    return process_rows(logits, rows)[0]


def not_finite(processed: torch.Tensor) -> torch.Tensor:
    """(N,) bool: rows holding a NaN or +inf, or no finite entry (max propagates NaN)."""
    return ~torch.isfinite(processed.amax(dim=-1))


def race(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """(M, V) (unnormalised) probabilities -> (M,) int64 draws: the argmax of ``probs / E``,
    E ~ Exponential(1). Rows without a generator share one draw from the global generator;
    row i with one draws its V exponentials from ``generators[i]`` (a loop over those rows)."""
    noise = torch.empty_like(probs)
    if any(g is None for g in generators):
        noise.exponential_()
    else:
        noise.fill_(1.0)
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # an exponential_ of exactly 0 must not make 0 / 0
    return (probs / noise).argmax(dim=-1)


def raw_logprobs(
    logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, k: int
) -> list[torch.Tensor]:
    """The raw log-probabilities of ``logits[rows]``: of ``tokens`` (one per row), then the
    top ``k`` values and ids, flattened as float64 parts of one packed transfer."""
    logp = logits.index_select(0, rows).float().log_softmax(dim=-1)
    parts = [logp.gather(1, tokens[:, None]).double().flatten()]
    if k:
        top = logp.topk(min(k, logp.shape[-1]), dim=-1)
        parts += [top.values.double().flatten(), top.indices.double().flatten()]
    return parts


def unpack_logprobs(
    params: SamplingParams, token: int, flat: Sequence[float], j: int, w: int, k: int
) -> SampledToken:
    """Row ``j`` of ``w`` logprob rows in ``flat`` (chosen values, then w * k top values,
    then w * k top ids) -> its SampledToken, with exactly ``params.logprobs`` alternatives."""
    if params.logprobs is None:
        return SampledToken(token)
    want = min(params.logprobs, k)
    values, ids = flat[w + j * k : w + j * k + want], flat[w + w * k + j * k : w + w * k + j * k + want]
    return SampledToken(token, flat[j], tuple((int(i), v) for i, v in zip(ids, values, strict=True)))


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow], *, raw: torch.Tensor | None = None) -> StepSample:
    """Row b of the (N, V) ``logits`` drawn for ``rows[b]``, the whole batch at once on the
    logits' device with one host transfer. Greedy rows: the argmax of the processed logits;
    sampled rows: the exponential race (one noise draw for the rows without a generator,
    each seeded row's noise from its own generator). A row whose processed distribution is
    not finite is in ``failed`` with a None token; the other rows are unaffected. ``raw``: the
    model's own logits when ``logits`` went through logits processors (``rtpcore.logits``)
    first; log-probabilities are read from them."""
    n = len(rows)
    if n == 0:
        return StepSample([], [])
    v = logits.shape[-1]
    drawn = [b for b, r in enumerate(rows) if not r.params.greedy]
    want = [b for b, r in enumerate(rows) if r.params.logprobs is not None]
    x, extra = process_rows(logits, rows, [*drawn, *want])
    d_drawn, d_want = extra.split([len(drawn), len(want)])
    tokens = x.argmax(dim=-1)
    if drawn:
        gens = [rows[b].generator for b in drawn]
        if len(drawn) == n:
            tokens = race(x.softmax(dim=-1), gens)
        else:
            tokens = tokens.index_put((d_drawn,), race(x.index_select(0, d_drawn).softmax(dim=-1), gens))
    packed = [tokens.double(), not_finite(x).double()]
    k = min(max((rows[b].params.logprobs or 0 for b in want), default=0), v)
    if want:
        packed += raw_logprobs(logits if raw is None else raw, d_want, tokens.index_select(0, d_want), k)
    flat = torch.cat(packed).tolist()  # the one host transfer
    out: list[SampledToken | None] = [SampledToken(int(t)) for t in flat[:n]]
    failed = [b for b in range(n) if flat[n + b]]
    lp = flat[2 * n :]
    for j, b in enumerate(want):
        out[b] = unpack_logprobs(rows[b].params, int(flat[b]), lp, j, len(want), k)
    for b in failed:
        out[b] = None
    return StepSample(out, failed)


def sample_step(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> list[SampledToken]:
    """(B, V) logits, row b for a request with ``params[b]`` and ``generators[b]`` -> one
    :class:`SampledToken` per row: :func:`sample` on rows without a
    token history (so ``min_tokens`` and the repetition, presence and frequency penalties
    see no tokens). A row whose distribution is not finite raises
    :class:`~rtpcore.errors.RtpcoreError`; ``sample`` reports it instead."""
    step = sample(logits, [SamplingRow(p, g) for p, g in zip(params, generators, strict=True)])
    if step.failed:
        raise RtpcoreError(f"the logits of rows {step.failed} hold no finite distribution to sample from")
    return [t for t in step.tokens if t is not None]

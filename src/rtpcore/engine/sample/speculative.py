"""Speculative decoding: a draft proposes, the target verifies (docs/design.md §10).

Each engine step with a draft (``rtpcore.engine.engine_core``):

1. the draft proposes ``k`` tokens for every decoding request, one draft forward per
   proposal over its own paged KV cache (the first one also catches the draft up with
   the tokens the target accepted last step); ``k`` is ``num_speculative_tokens``, less
   near a request's ``max_tokens`` so that no token past it is ever scored;
2. the target scores the last token and every proposal in one forward (``logits_indices``
   of :class:`~rtpcore.models.forward_batch.ForwardBatch`), together with the prefill of the
   requests admitted in this step;
3. :func:`verify` keeps the longest accepted run of proposals and adds one token of the
   target's own (the correction at the first rejection, or a bonus after the last
   proposal). Rejected tokens are rolled back by position: both caches count only the
   positions they hold for accepted tokens, and later writes overwrite the rest.

Both models' logits go through the sampler's processing
(:func:`rtpcore.engine.sample.sampler.process_logits`: logit_bias, min_tokens, penalties,
temperature, top-k, top-p, min-p), row ``j`` of a request with the history ``output_ids +
proposals[:j]``, so verification follows the distribution the sampler would draw from.
Greedy requests accept a proposal when it is the argmax of the target's processed logits,
so their output is the target's greedy output. Sampled requests use rejection sampling
(Leviathan et al., 2023; Chen et al., 2023): a proposal ``d`` drawn from the draft's
distribution ``q`` is accepted with probability ``min(1, p(d) / q(d))``, and a rejected one
is replaced by a draw from ``max(0, p - q)`` normalised; the emitted tokens follow the
target's processed distribution ``p`` exactly.

Draws use the exponential race with the request's generator (no ``torch.multinomial``);
:func:`propose` costs one host transfer per call, :func:`verify_batch` one for all the
requests of a step (a request with no proposals is an ordinary draw there, the same one
:func:`rtpcore.engine.sample.sampler.sample` makes). Log-probabilities are the target's raw ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from rtpcore.engine.sample.params import SampledToken, SamplingParams
from rtpcore.engine.sample.sampler import (
    SamplingRow,
    history_row,
    not_finite,
    process_rows,
    race,
    raw_logprobs,
    unpack_logprobs,
)
from rtpcore.errors import RtpcoreError

__all__ = ["Proposal", "SpeculativeStats", "Verdict", "propose", "verify", "verify_batch"]


@attrs.frozen
class SpeculativeStats:
    """Token counts over an engine's life: ``proposed`` by the draft (every proposal, also
    those thrown away at a stop token or the length limit), ``accepted`` by the target."""

    proposed: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        """accepted / proposed (0.0 before any proposal)."""
        return self.accepted / self.proposed if self.proposed else 0.0


@attrs.frozen
class Proposal:
    """One request's draft run to verify: its :class:`~rtpcore.engine.sample.sampler.SamplingRow`
    (history before the proposals), the proposed ``tokens`` and, for a sampled request,
    the (V,) distribution each was drawn from (:func:`propose`'s; None for greedy ones)."""

    row: SamplingRow
    tokens: Sequence[int] = ()
    dists: Sequence[torch.Tensor | None] = ()


@attrs.frozen
class Verdict:
    """One request's verification: the ``tokens`` to emit (the ``accepted`` proposals,
    then the target's own token) with the log-probabilities asked for. ``failed``: the
    target's row for its own token had no finite distribution; ``tokens`` then holds only
    the accepted proposals (the request should end with an error)."""

    tokens: list[SampledToken]
    accepted: int
    failed: bool = False


def _rows(
    rows: Sequence[SamplingRow] | Sequence[SamplingParams], generators: Sequence[torch.Generator | None] | None
) -> list[SamplingRow]:
    """SamplingRows, from the older form (SamplingParams and their generators) too."""
    if generators is None:
        return [r if isinstance(r, SamplingRow) else SamplingRow(r) for r in rows]
    return [SamplingRow(p, g) for p, g in zip(rows, generators, strict=True)]  # type: ignore[arg-type]


def propose(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow] | Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None] | None = None,
) -> tuple[list[int], list[torch.Tensor | None]]:
    """The draft's (G, V) logits, row g for ``rows[g]`` (its history: the output so far plus
    the request's earlier proposals of this step) -> one proposal per row, and for sampled
    requests the (V,) distribution it was drawn from (None for greedy ones). One host
    transfer. ``propose(logits, params, generators)`` (SamplingParams and their generators)
    is the older form: rows without a history.

    A row whose processed draft logits are not finite proposes token 0 (for a sampled
    request drawn from a one-hot ``q`` at 0, which keeps rejection sampling exact)."""
    srows = _rows(rows, generators)
    drawn = [g for g, r in enumerate(srows) if not r.params.greedy]
    x, d_drawn = process_rows(logits, srows, drawn)
    bad = not_finite(x)
    tokens = x.argmax(dim=-1)
    dists: list[torch.Tensor | None] = [None] * len(srows)
    if drawn:
        xd = x.index_select(0, d_drawn)
        one_hot = torch.zeros_like(xd)
        one_hot[:, 0] = 1.0
        q = torch.where(bad.index_select(0, d_drawn)[:, None], one_hot, xd.softmax(dim=-1))
        tokens = tokens.index_put((d_drawn,), race(q, [srows[g].generator for g in drawn]))
        for j, g in enumerate(drawn):
            dists[g] = q[j]
    return [int(t) for t in tokens.masked_fill(bad, 0).tolist()], dists


def verify_batch(logits: torch.Tensor, proposals: Sequence[Proposal], *, raw: torch.Tensor | None = None) -> list[Verdict]:
    """Every request's verification in one go: ``logits`` holds, request after request,
    the target's ``k + 1`` rows of a request with ``k`` proposals (after its last token and
    after each proposal; row j's history is the output plus ``proposals[:j]``) -> one
    :class:`Verdict` per request, with one host transfer for all of them.

    Greedy requests keep the longest run of proposals equal to the argmax and add the
    argmax after it. Sampled requests accept proposal j when ``u * q(d) < p(d)`` (``u``
    uniform from the request's generator), then draw their own token from ``max(0, p - q)``
    at the first rejection (``p`` where that is zero), or from ``p`` after the last
    proposal, by the exponential race with the request's generator. ``raw``: the target's own
    logits when ``logits`` went through logits processors first (``rtpcore.logits``: position by
    position, as if decoding without a draft); log-probabilities are read from them."""
    m = len(proposals)
    if m == 0:
        return []
    ks = [len(pr.tokens) for pr in proposals]
    starts = [0]
    for k in ks:
        starts.append(starts[-1] + k + 1)
    if logits.dim() != 2 or logits.shape[0] != starts[-1]:
        raise ValueError(f"logits of shape {tuple(logits.shape)} for {starts[-1]} verification rows")
    sampled = [i for i, pr in enumerate(proposals) if not pr.row.params.greedy]
    for i in sampled:
        if len(proposals[i].dists) != ks[i] or any(d is None for d in proposals[i].dists):
            raise ValueError("a sampled request's proposals need the draft's distributions")
    rows = [history_row(pr.row, pr.tokens[:j]) for pr in proposals for j in range(len(pr.tokens) + 1)]
    # Host indices, all in the processing's one host-to-device copy.
    prop_rows = [starts[i] + j for i, k in enumerate(ks) for j in range(k)]
    drafted = [int(t) for pr in proposals for t in pr.tokens]
    prop_req = [i for i, k in enumerate(ks) for _ in range(k)]
    prop_pos = [j for k in ks for j in range(k)]
    sampled_props = [c for c, i in enumerate(prop_req) if not proposals[i].row.params.greedy]
    q_start, total = [], 0  # each request's first row in the stacked draft distributions
    for i, k in enumerate(ks):
        q_start.append(total)
        total += k if not proposals[i].row.params.greedy else 0
    want = [i for i, pr in enumerate(proposals) if pr.row.params.logprobs is not None]
    want_rows = [r for i in want for r in range(starts[i], starts[i + 1])]
    host = [prop_rows, drafted, prop_req, prop_pos, sampled_props, starts[:-1], ks, q_start, sampled, want_rows]
    x, extra = process_rows(logits, rows, [t for part in host for t in part])
    (d_prop_rows, d_drafted, d_prop_req, d_prop_pos, d_sampled_props, d_starts, d_ks, d_q_start, d_sampled,
     d_want_rows) = extra.split([len(part) for part in host])
    bad = not_finite(x)
    probs = x.softmax(dim=-1) if sampled else None
    kt, kmax = len(prop_rows), max(ks)
    accepted = torch.zeros(m, dtype=torch.int64, device=x.device)
    q_all = None
    if kt:
        accept = x.index_select(0, d_prop_rows).argmax(dim=-1) == d_drafted  # greedy: the argmax
        if sampled_props:
            assert probs is not None
            q_all = torch.stack([d for i in sampled for d in proposals[i].dists])  # type: ignore[misc]
            tok = d_drafted.index_select(0, d_sampled_props)
            p_d = probs[d_prop_rows.index_select(0, d_sampled_props), tok]
            q_d = q_all.gather(1, tok[:, None])[:, 0]
            accept = accept.index_put((d_sampled_props,), _uniforms(proposals, sampled, ks, q_d) * q_d < p_d)
        accept = accept & ~bad.index_select(0, d_prop_rows)
        runs = torch.zeros(m, kmax, device=x.device).index_put((d_prop_req, d_prop_pos), accept.float())
        accepted = runs.cumprod(dim=1).sum(dim=1).long()  # the leading run of accepted proposals
    final_rows = d_starts + accepted
    final = x.index_select(0, final_rows).argmax(dim=-1)
    failed = bad.index_select(0, final_rows)
    if sampled:
        assert probs is not None
        s_rows, s_acc = final_rows.index_select(0, d_sampled), accepted.index_select(0, d_sampled)
        dist = probs.index_select(0, s_rows)
        if q_all is not None:
            q = q_all.index_select(0, (d_q_start.index_select(0, d_sampled) + s_acc).clamp(max=q_all.shape[0] - 1))
            residual = (dist - q).clamp(min=0.0)
            use = (s_acc < d_ks.index_select(0, d_sampled)) & (residual.sum(dim=-1) > 0)
            dist = torch.where(use[:, None], residual, dist)
        final = final.index_put((d_sampled,), race(dist, [proposals[i].row.generator for i in sampled]))
        failed = failed.index_put((d_sampled,), failed.index_select(0, d_sampled) | not_finite(dist))
    packed = [final.double(), accepted.double(), failed.double()]
    k_lp = min(max((proposals[i].row.params.logprobs or 0 for i in want), default=0), logits.shape[-1])
    if want:
        row_tokens = torch.zeros(starts[-1], dtype=torch.int64, device=x.device)
        if kt:
            row_tokens = row_tokens.index_put((d_prop_rows,), d_drafted)
        row_tokens = row_tokens.index_put((final_rows,), final)
        packed += raw_logprobs(logits if raw is None else raw, d_want_rows, row_tokens.index_select(0, d_want_rows), k_lp)
    flat = torch.cat(packed).tolist()  # the one host transfer
    lp, w = flat[3 * m :], len(want_rows)
    out: list[Verdict] = []
    offset = 0
    lp_start: dict[int, int] = {}
    for i in want:
        lp_start[i] = offset
        offset += ks[i] + 1
    for i, pr in enumerate(proposals):
        n, fail = int(flat[m + i]), bool(flat[2 * m + i])
        emitted = [int(t) for t in pr.tokens[:n]] + ([] if fail else [int(flat[i])])
        if i in lp_start:
            tokens = [unpack_logprobs(pr.row.params, t, lp, lp_start[i] + j, w, k_lp) for j, t in enumerate(emitted)]
        else:
            tokens = [SampledToken(t) for t in emitted]
        out.append(Verdict(tokens, n, fail))
    return out


def _uniforms(
    proposals: Sequence[Proposal], sampled: Sequence[int], ks: Sequence[int], like: torch.Tensor
) -> torch.Tensor:
    """One uniform per sampled proposal: from the request's generator when it has one
    (a loop over those requests), else from one draw of torch's global generator."""
    u = torch.empty_like(like)
    if any(proposals[i].row.generator is None for i in sampled):
        u.uniform_()
    start = 0
    for i in sampled:
        g = proposals[i].row.generator
        if g is not None and ks[i]:
            u[start : start + ks[i]].uniform_(generator=g)
        start += ks[i]
    return u


def verify(
    logits: torch.Tensor,
    proposals: Sequence[int],
    draft_dists: Sequence[torch.Tensor | None],
    params: SamplingParams | SamplingRow,
    generator: torch.Generator | None = None,
    best: Sequence[int] | None = None,
) -> tuple[list[SampledToken], int]:
    """One request's verification (:func:`verify_batch` for one request): the target's
    (k + 1, V) logits after its last token and after each of its ``k`` proposals -> the
    tokens to emit and how many proposals were accepted. ``params``: the request's
    SamplingRow, or its SamplingParams with ``generator`` (a row without a history).
    ``best`` is accepted for compatibility and unused (the argmax is taken on the device).
    A target row without a finite distribution raises :class:`~rtpcore.errors.RtpcoreError`."""
    del best
    row = params if isinstance(params, SamplingRow) else SamplingRow(params, generator)
    verdict = verify_batch(logits, [Proposal(row, list(proposals), list(draft_dists))])[0]
    if verdict.failed:
        raise RtpcoreError("the target's logits hold no finite distribution to verify the proposals with")
    return verdict.tokens, verdict.accepted

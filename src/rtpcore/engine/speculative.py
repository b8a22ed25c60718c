"""Speculative decoding: a draft proposes, the target verifies (docs/design.md §10).

Each engine step with a draft (``rtpcore.engine.core``):

1. the draft proposes ``k`` tokens for every decoding request, one draft forward per
   proposal over its own paged KV cache (the first one also catches the draft up with
   the tokens the target accepted last step); ``k`` is ``num_speculative_tokens``, less
   near a request's ``max_tokens`` so that no token past it is ever scored;
2. the target scores the last token and every proposal in one forward (``logits_indices``
   of :class:`~rtpcore.engine.batch.ForwardBatch`), together with the prefill of the
   requests admitted in this step;
3. :func:`verify` keeps the longest accepted run of proposals and adds one token of the
   target's own (the correction at the first rejection, or a bonus after the last
   proposal). Rejected tokens are rolled back by position: both caches count only the
   positions they hold for accepted tokens, and later writes overwrite the rest.

Greedy requests accept a proposal when it is the target's argmax, so their output is the
target's greedy output. Sampled requests use rejection sampling (Leviathan et al., 2023;
Chen et al., 2023): a proposal ``d`` drawn from the draft's distribution ``q`` is accepted
with probability ``min(1, p(d) / q(d))``, and a rejected one is replaced by a draw from
``max(0, p - q)`` normalised; the emitted tokens follow the target's distribution ``p``
(after the request's temperature, top-k and top-p, applied to both models) exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch

from rtpcore.engine.sampling import SampledToken, SamplingParams, process

__all__ = ["SpeculativeStats", "propose", "verify"]


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


def propose(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> tuple[list[int], list[torch.Tensor | None]]:
    """The draft's (G, V) logits, one row per request -> one proposal per row, and for
    sampled requests the (V,) distribution it was drawn from (None for greedy ones)."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    dists: list[torch.Tensor | None] = [None] * len(params)
    for g, p in enumerate(params):
        if not p.greedy:
            q = process(logits[g : g + 1], p).softmax(dim=-1)[0]
            dists[g] = q
            tokens[g] = torch.multinomial(q, 1, generator=generators[g])[0]
    return tokens.tolist(), dists


def verify(
    logits: torch.Tensor,
    proposals: Sequence[int],
    draft_dists: Sequence[torch.Tensor | None],
    params: SamplingParams,
    generator: torch.Generator | None,
    best: Sequence[int] | None = None,
) -> tuple[list[SampledToken], int]:
    """One request's verification: the target's (k + 1, V) logits after its last token and
    after each of its ``k`` proposals -> the tokens to emit (the accepted proposals, then
    the target's own token) and how many proposals were accepted. ``best``: the rows'
    argmax when the caller has it already (one transfer for a whole batch)."""
    logits = logits.float()
    k = len(proposals)
    if params.greedy:
        best = logits.argmax(dim=-1).tolist() if best is None else best
        n = 0
        while n < k and best[n] == proposals[n]:
            n += 1
        emitted = [*proposals[:n], best[n]]
        return _with_logprobs(logits, emitted, params), n
    processed = process(logits, params)  # (k + 1, V)
    p = processed.softmax(dim=-1)
    n = k
    if k:
        if any(q is None for q in draft_dists):
            raise ValueError("a sampled request's proposals need the draft's distributions")
        q = torch.stack([d for d in draft_dists if d is not None])  # (k, V)
        rows = torch.arange(k, device=p.device)
        drafted = torch.tensor(list(proposals), device=p.device)
        u = torch.rand(k, generator=generator, device=p.device)
        # u < p(d) / q(d), without dividing by q; one transfer for every proposal
        accept = (u * q[rows, drafted] < p[rows, drafted]).tolist()
        n = accept.index(False) if False in accept else k
    if n < k:  # the first rejection: a draw from max(0, p - q), normalised (p itself when p == q)
        residual = (p[n] - q[n]).clamp_(min=0.0)
        residual = torch.where(residual.sum() > 0, residual, p[n])
        token = int(torch.multinomial(residual, 1, generator=generator)[0])
    else:  # every proposal accepted: a bonus token from the target's last row
        token = int(torch.multinomial(p[k], 1, generator=generator)[0])
    emitted = [*proposals[:n], token]
    return _with_logprobs(processed, emitted, params), n


def _with_logprobs(processed: torch.Tensor, emitted: Sequence[int], params: SamplingParams) -> list[SampledToken]:
    """SampledTokens for ``emitted`` (row i of ``processed`` is the distribution of token i),
    with the log-probabilities the request asked for."""
    if params.logprobs is None:
        return [SampledToken(t) for t in emitted]
    logp = processed[: len(emitted)].log_softmax(dim=-1)
    chosen = logp.gather(1, torch.tensor(emitted, device=logp.device)[:, None]).flatten().tolist()
    out = []
    for i, t in enumerate(emitted):
        top: tuple[tuple[int, float], ...] = ()
        if params.logprobs:
            values, ids = logp[i].topk(params.logprobs)
            top = tuple((int(j), float(v)) for j, v in zip(ids.tolist(), values.tolist(), strict=True) if v > -math.inf)
        out.append(SampledToken(t, chosen[i], top))
    return out

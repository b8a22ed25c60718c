"""Building blocks of the DeepSeek decoder: RMSNorm, decoupled RoPE, dense MLP, routed MoE.

Tensors are flat over tokens: T is the number of new tokens in the step, D the
hidden size. Weights are taken from a checkpoint mapping by name, never
initialised randomly. Every projection is an ``rtpcore.layers.Linear`` (made by
:func:`linear_factory`): oneDNN-prepacked in bf16, ``F.linear`` in float32, the
same bits as ``F.linear`` either way; only the MoE router stays a float32
``F.linear`` on its own weight, as in transformers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from atom_plugin.config import DeepseekConfig, RopeConfig
from rtpcore.layers import Linear, row_parallel

__all__ = ["MLP", "MoE", "RMSNorm", "RopeTables", "apply_rope", "rope_cos_sin", "rope_inv_freq"]

Weights = Mapping[str, torch.Tensor]


def frozen(t: torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """A non-trainable parameter holding ``t`` in ``dtype`` on ``device``."""
    return nn.Parameter(t.to(device=device, dtype=dtype).contiguous(), requires_grad=False)


def linear_factory(dtype: torch.dtype, device: torch.device | str) -> Callable[..., Linear]:
    """``make(weight, bias=None)``: an ``rtpcore.layers.Linear`` over checkpoint tensors cast to
    ``dtype`` on ``device`` (prepacked for bf16, ``F.linear`` for float32: the same bits either way)."""

    def make(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        cast = lambda t: t.to(device=device, dtype=dtype).contiguous()  # noqa: E731
        return Linear(cast(weight), None if bias is None else cast(bias))

    return make


class RMSNorm(nn.Module):
    """y = w * x / rms(x), computed in float32 like transformers' DeepseekV3RMSNorm."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # (N,)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., N)
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)  # x / rms(x), float32
        return self.weight * normed.to(x.dtype)


def rope_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """(dim/2,) inverse frequencies, with yarn's ramp between interpolation and extrapolation."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    if rope.rope_type == "default":
        return extrapolation
    interpolation = 1.0 / (rope.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (T, 1, R/2) for positions (T,), already multiplied by ``scale``."""
    freqs = positions[:, None].float() * inv_freq[None, :]  # (T, R/2)
    cos = (freqs.cos() * scale).to(dtype)[:, None, :]
    sin = (freqs.sin() * scale).to(dtype)[:, None, :]
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate (T, H, R) by position. ``interleave``: pairs are (x0, x1), (x2, x3), ...

    Either way the output is de-interleaved, [rotated firsts | rotated seconds],
    exactly as transformers' ``apply_rotary_pos_emb_interleave`` writes it; since
    queries and keys share the layout, attention scores are unaffected.
    """
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]  # (T, H, R/2) each
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RopeTables(nn.Module):
    """cos/sin of every position up to a bound, computed once and grown on demand.

    Rows are computed by :func:`rope_cos_sin` in blocks of ``BLOCK`` positions (so
    every element goes through the same vectorised kernel as a per-step call
    would), and looked up by position: a decode step indexes two rows instead of
    recomputing them.
    """

    BLOCK = 256  # positions per table-building call
    START = 2048  # positions computed up front

    inv_freq: torch.Tensor  # (R/2,) float32
    cos: torch.Tensor  # (P, R/2), model dtype
    sin: torch.Tensor  # (P, R/2)

    def __init__(self, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype):
        super().__init__()
        self.scale, self.dtype = scale, dtype
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (R/2,) float32
        empty = torch.empty(0, inv_freq.shape[0], dtype=dtype, device=inv_freq.device)
        self.register_buffer("cos", empty, persistent=False)
        self.register_buffer("sin", empty.clone(), persistent=False)
        self.grow(self.START)

    def grow(self, positions: int) -> None:
        """Make the tables cover positions ``0..positions-1`` (at least)."""
        have = self.cos.shape[0]
        if positions <= have:
            return
        pos = torch.arange(have, positions, device=self.inv_freq.device)
        parts = [rope_cos_sin(chunk, self.inv_freq, self.scale, self.dtype) for chunk in pos.split(self.BLOCK)]
        self.cos = torch.cat([self.cos, *(c[:, 0] for c, _ in parts)])
        self.sin = torch.cat([self.sin, *(s[:, 0] for _, s in parts)])

    def forward(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(T,) positions, all below ``max_position`` -> cos, sin (T, 1, R/2)."""
        if max_position > self.cos.shape[0]:
            self.grow(max(max_position, 2 * self.cos.shape[0]))
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up fused in one ``Linear``.

    Tensor parallel: the weights hold this rank's slice of the intermediate
    dimension (I/N), and ``parallel`` (an ``rtpcore.sharding.ParallelContext``)
    sums the ranks' partial outputs (``down`` is row-parallel); without it the
    output stays partial (a shared expert, reduced together with the routed ones).
    """

    def __init__(
        self, w: Weights, prefix: str, dtype: torch.dtype, device: torch.device | str, parallel: Any = None
    ):
        super().__init__()
        make = linear_factory(dtype, device)
        gate, up = w[f"{prefix}.gate_proj.weight"], w[f"{prefix}.up_proj.weight"]
        self.gate_up = make(torch.cat((gate, up), 0))  # D -> 2I
        self.down = row_parallel(make, w[f"{prefix}.down_proj.weight"], None, parallel)  # I -> D

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, D)
        g, u = self.gate_up(x).chunk(2, dim=-1)  # (T, I) each
        return self.down(F.silu(g) * u)  # (T, D)


class MoE(nn.Module):
    """Routed experts plus shared experts, routed exactly like transformers' DeepSeek routers.

    The router runs in float32 whatever the model dtype (transformers keeps
    ``gate.weight`` and ``e_score_correction_bias`` in float32 too). Every routed
    expert has its own ``gate_up`` / ``down`` :class:`rtpcore.layers.Linear`; in
    float32 they are views of two stacked (E, 2I, D) / (E, D, I) tensors, which
    also serve the few-token gather path (kept in bf16 only for experts small
    enough to take that path).

    Tensor parallel: every expert's weights hold this rank's slice of its
    intermediate dimension, the router is replicated (every rank picks the same
    experts), and ``parallel`` sums routed plus shared partial outputs in one
    all-reduce.
    """

    # Below this many gathered expert-weight elements, index the experts' weights per
    # token (two einsums, fewest ops: tiny models); above it, loop over the experts that
    # were hit, reading each one's weights once (decode is memory-bound: a gather would
    # copy them first).
    GATHER_LIMIT = 1 << 18

    stacked_gate_up: torch.Tensor | None
    stacked_down: torch.Tensor | None

    def __init__(
        self,
        cfg: DeepseekConfig,
        w: Weights,
        prefix: str,
        dtype: torch.dtype,
        device: torch.device | str,
        parallel: Any = None,
    ):
        super().__init__()
        self.cfg = cfg
        self.parallel = parallel
        n = cfg.n_routed_experts
        self.gate = frozen(w[f"{prefix}.gate.weight"], torch.float32, device)  # (E, D)
        bias = w.get(f"{prefix}.gate.e_score_correction_bias") if cfg.variant == "deepseek_v3" else None
        self.bias = frozen(bias if bias is not None else torch.zeros(n), torch.float32, device)  # (E,)
        ex = f"{prefix}.experts"
        gate_up = torch.stack(
            [torch.cat((w[f"{ex}.{e}.gate_proj.weight"], w[f"{ex}.{e}.up_proj.weight"]), 0) for e in range(n)]
        ).to(device=device, dtype=dtype)  # (E, 2I, D)
        down = torch.stack([w[f"{ex}.{e}.down_proj.weight"] for e in range(n)]).to(device=device, dtype=dtype)
        self.expert_gate_up = nn.ModuleList(Linear(gate_up[e]) for e in range(n))  # D -> 2I each
        self.expert_down = nn.ModuleList(Linear(down[e]) for e in range(n))  # I -> D each
        # Plain lists for the per-step loop (no ModuleList indexing on the hot path).
        self._experts = list(zip(self.expert_gate_up, self.expert_down, strict=True))
        # float32 Linears view the stacks (kept for free); packed ones copied them, so keep the
        # stacks only if the gather path can run at all (two tokens under GATHER_LIMIT: tiny experts).
        gatherable = 2 * cfg.num_experts_per_tok * down[0].numel() * 3 <= self.GATHER_LIMIT
        keep = gatherable or not self.expert_gate_up[0].packed
        self.register_buffer("stacked_gate_up", gate_up if keep else None, persistent=False)  # (E, 2I, D)
        self.register_buffer("stacked_down", down if keep else None, persistent=False)  # (E, D, I)
        self.shared = MLP(w, f"{prefix}.shared_experts", dtype, device) if cfg.n_shared_experts else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, D) -> expert weights (T, k) float32 and expert indices (T, k)."""
        cfg = self.cfg
        logits = F.linear(x.float(), self.gate)  # (T, E)
        t, n, k = x.shape[0], cfg.n_routed_experts, cfg.num_experts_per_tok
        per_group = n // cfg.n_group
        if cfg.variant == "deepseek_v3":
            scores = logits.sigmoid()
            choice = scores + self.bias  # (T, E)
            group_scores = choice.view(t, cfg.n_group, per_group).topk(2, dim=-1)[0].sum(-1)  # (T, G)
            fill = float("-inf")
        else:
            scores = logits.softmax(dim=-1, dtype=torch.float32)
            choice = scores
            group_scores = choice.view(t, cfg.n_group, per_group).max(dim=-1).values  # (T, G)
            fill = 0.0
        if cfg.topk_group < cfg.n_group:
            group_idx = group_scores.topk(cfg.topk_group, dim=-1, sorted=False)[1]  # (T, topk_group)
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()
            keep = group_mask[:, :, None].expand(t, cfg.n_group, per_group).reshape(t, n)
            choice = choice.masked_fill(~keep, fill)
        idx = choice.topk(k, dim=-1, sorted=False)[1]  # (T, k)
        weights = scores.gather(1, idx)  # (T, k)
        if cfg.variant == "deepseek_v3" and cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, D)
        weights, idx = self.route(x)  # (T, k), (T, k)
        t, k = idx.shape
        stacked_gate_up, stacked_down = self.stacked_gate_up, self.stacked_down  # None when packed
        stacked = (
            stacked_gate_up is not None
            and stacked_down is not None
            and t * k * stacked_down[0].numel() * 3 <= self.GATHER_LIMIT
        )
        if t == 1 and not (x.is_cuda and stacked):
            out = self._one_token(x, weights, idx)  # batch-1 decode on the CPU: transformers' order, bit for bit
        elif stacked:  # no host synchronisation: what a CUDA graph can capture
            assert stacked_gate_up is not None and stacked_down is not None
            gu = torch.einsum("td,tkid->tki", x, stacked_gate_up[idx])  # (T, k, 2I)
            g, u = gu.chunk(2, dim=-1)  # (T, k, I)
            y = torch.einsum("tki,tkdi->tkd", F.silu(g) * u, stacked_down[idx])  # (T, k, D)
            out = (y * weights[..., None]).sum(1).to(x.dtype)  # (T, D)
        else:
            out = torch.zeros_like(x)
            for e in idx.unique().tolist():
                tok, slot = torch.where(idx == e)  # (n_e,), (n_e,)
                gate_up, down = self._experts[e]
                g, u = gate_up(x[tok]).chunk(2, dim=-1)  # (n_e, I)
                y = down(F.silu(g) * u) * weights[tok, slot, None]  # (n_e, D)
                out.index_add_(0, tok, y.to(x.dtype))
        if self.shared is not None:
            out = out + self.shared(x)  # partial too: reduced with the routed experts
        return out if self.parallel is None else self.parallel.all_reduce(out)

    def _one_token(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """(1, D) through its k experts, summed in ascending expert order like transformers."""
        out: torch.Tensor | None = None
        for e, wt in sorted(zip(idx[0].tolist(), weights[0].tolist(), strict=True)):
            gate_up, down = self._experts[e]
            g, u = gate_up(x).chunk(2, dim=-1)  # (1, I) each
            y = down(F.silu(g) * u) * wt  # (1, D); a float32 weight, rounded once to the model dtype
            out = y if out is None else out + y
        assert out is not None, "the router picks at least one expert"
        return out

"""The Llama-family forward over a paged KV cache (torch modules).

Follows forward contract 2 of ``rtpcore.plugins.model_plugin``: ``model(batch, kv_caches)``
returns the logits of the rows ``batch.logits_index`` names (each sequence's last new token
by default), attention per sequence over its own paged context
(``rtpcore.models.attention``), nothing padded. Numerics mirror Hugging Face transformers
(RMSNorm in float32, RoPE tables computed in float32 then cast, softmax in float32).
Shapes: T flat tokens, B sequences, N logits rows, H/Hkv heads, D head_dim, E hidden.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from rtpcore.models.attention import paged_attention
from rtpcore.models.bf16_blocked import BlockedRows
from rtpcore.models.layers import Linear
from rtpcore.models.llama_config import LlamaConfig, rope_inv_freq
from rtpcore.models.native import NativeLlamaDecode, native_choice, native_problem
from rtpcore.models.native import kernels as native_kernels
from rtpcore.parallel.layers import GatherColumns, row_parallel

if TYPE_CHECKING:
    from rtpcore.kv.pools import LayerKVCache
    from rtpcore.models.forward_batch import ForwardBatch

__all__ = ["LlamaModel"]

logger = logging.getLogger(__name__)

ROPE_TABLE_START = 4096  # positions precomputed up front; the tables grow on demand


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back, as transformers does."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE (rotate-half convention): x (T, heads, D), cos/sin (T, 1, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaLayer(nn.Module):
    """One decoder layer with fused qkv and gate_up projections."""

    def __init__(
        self, config: LlamaConfig, w: Mapping[str, torch.Tensor], prefix: str, parallel: Any = None
    ):
        super().__init__()
        a, m = prefix + "self_attn.", prefix + "mlp."
        self.eps = config.rms_norm_eps
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.qk_size = config.q_size + config.kv_size
        self.scale = config.head_dim**-0.5
        self.norm1 = nn.Parameter(w[prefix + "input_layernorm.weight"], requires_grad=False)
        self.norm2 = nn.Parameter(w[prefix + "post_attention_layernorm.weight"], requires_grad=False)
        self.qkv = _fused(w, [a + "q_proj", a + "k_proj", a + "v_proj"])  # E -> q + 2 kv
        # Qwen3: q_norm for every query head, then k_norm for every KV head, normed together.
        self.qk_norm: nn.Parameter | None = None
        if config.qk_norm:
            heads = [w[a + "q_norm.weight"].expand(self.heads, -1), w[a + "k_norm.weight"].expand(self.kv_heads, -1)]
            self.qk_norm = nn.Parameter(torch.cat(heads), requires_grad=False)  # (H + Hkv, D)
        # Row-parallel when sharded: partial sums all-reduced, bias added once.
        self.o = row_parallel(Linear, w[a + "o_proj.weight"], w.get(a + "o_proj.bias"), parallel)  # q -> E
        self.gate_up = _fused(w, [m + "gate_proj", m + "up_proj"])  # E -> 2 I
        self.down = row_parallel(Linear, w[m + "down_proj.weight"], w.get(m + "down_proj.bias"), parallel)  # I -> E

    def forward(
        self,
        x: torch.Tensor,  # (T, E)
        cos: torch.Tensor,  # (T, 1, D)
        sin: torch.Tensor,  # (T, 1, D)
        batch: ForwardBatch,
        cache: LayerKVCache,
        window: int | None = None,  # the layer's sliding window
        masks: dict[Any, Any] | None = None,  # this forward's attention masks, shared by the layers
        rows: RowOps | None = None,  # rtpcore_native's row kernels for the element-wise work, or None
    ) -> torch.Tensor:
        if rows is not None:
            return self._forward_rows(x, batch, cache, window, masks, rows)
        t = x.shape[0]
        qkv = self.qkv(rms_norm(x, self.norm1, self.eps))  # (T, q + 2 kv)
        qk = qkv[:, : self.qk_size].view(t, self.heads + self.kv_heads, self.head_dim)  # (T, H + Hkv, D)
        if self.qk_norm is not None:
            qk = rms_norm(qk, self.qk_norm, self.eps)
        qk = rotate(qk, cos, sin)
        q, k = qk.split((self.heads, self.kv_heads), dim=1)  # (T, H, D), (T, Hkv, D)
        cache.write(batch.slots, k, qkv[:, self.qk_size :].view(t, self.kv_heads, self.head_dim))
        out = paged_attention(q, cache, batch, scale=self.scale, window=window, masks=masks)  # (T, H, D)
        x = x + self.o(out.reshape(t, -1))  # (T, E)
        gate, up = self.gate_up(rms_norm(x, self.norm2, self.eps)).chunk(2, dim=-1)  # (T, I) each
        return x + self.down(F.silu(gate) * up)

    def _forward_rows(self, x: torch.Tensor, batch: ForwardBatch, cache: LayerKVCache, window: int | None,
                      masks: dict[Any, Any] | None, rows: RowOps) -> torch.Tensor:
        """:meth:`forward` of a float32 step with the norms, RoPE and SiLU in rtpcore_native's row
        kernels (those of its decode step: one pass each, over the pool), the products of
        ``"plain"`` float32 layers in its float32 kernels with the residual adds folded in
        (:meth:`RowOps.linear`), attention as in :meth:`forward`."""
        t, k = x.shape[0], rows.kernels
        h = torch.empty_like(x)
        k.rms_norm_rows(x.data_ptr(), t, x.shape[1], self.norm1.data_ptr(), self.eps, h.data_ptr())
        qkv = rows.linear(self.qkv, h)  # (T, q + 2 kv)
        heads = self.heads + self.kv_heads
        if self.qk_norm is not None:  # (T, H + Hkv, D), a new contiguous tensor
            qk = rms_norm(qkv[:, : self.qk_size].view(t, heads, self.head_dim), self.qk_norm, self.eps).contiguous()
            rows.rope(qk, heads * self.head_dim, heads, self.head_dim)
        else:  # in place: q and k lead each row of qkv
            rows.rope(qkv, qkv.shape[1], heads, self.head_dim)
            qk = qkv[:, : self.qk_size].view(t, heads, self.head_dim)
        q, key = qk.split((self.heads, self.kv_heads), dim=1)  # (T, H, D), (T, Hkv, D)
        cache.write(batch.slots, key, qkv[:, self.qk_size :].view(t, self.kv_heads, self.head_dim))
        out = paged_attention(q, cache, batch, scale=self.scale, window=window, masks=masks)  # (T, H, D)
        x = rows.linear(self.o, out.reshape(t, -1).contiguous(), residual=x)  # (T, E)
        k.rms_norm_rows(x.data_ptr(), t, x.shape[1], self.norm2.data_ptr(), self.eps, h.data_ptr())
        gate_up = rows.linear(self.gate_up, h)  # (T, 2 I)
        inter = gate_up.shape[1] // 2
        act = torch.empty(t, inter, dtype=x.dtype)
        k.silu_mul_rows(gate_up.data_ptr(), t, inter, act.data_ptr())
        return rows.linear(self.down, act, residual=x)


class RowOps:
    """One forward's view of rtpcore_native's row kernels (``rms_norm_rows``, ``rope_rows``,
    ``silu_mul_rows``): the kernels module and the step's RoPE rows."""

    def __init__(self, kernels: Any, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor):
        self.kernels = kernels
        self.cos, self.sin = cos, sin  # (P, D) float32, contiguous
        self.positions = positions  # (T,) int64, contiguous

    def linear(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``layer(x)`` (+ ``residual``), contiguous (T, out): a ``"plain"`` float32 ``Linear`` in
        rtpcore_native's float32 kernels (the sum added into a copy of ``residual``), any other
        layer (quantized, sharded, another kernel) as its own forward. ``x``: (T, in), contiguous."""
        weights = layer._native_float32() if type(layer) is Linear and x.shape[0] else None
        if weights is None:
            y = layer(x)
            return (y if residual is None else residual + y).contiguous()
        if residual is None:
            y = torch.empty(x.shape[0], weights.out_features, dtype=torch.float32)
        else:
            y = residual.clone(memory_format=torch.contiguous_format)
        self.kernels.linear(weights, x.data_ptr(), x.shape[0], y.data_ptr(), accumulate=residual is not None)
        return y

    def rope(self, x: torch.Tensor, row_stride: int, heads: int, head_dim: int) -> None:
        """RoPE in place on the first ``heads`` heads of each row of ``x`` (contiguous, float32)."""
        self.kernels.rope_rows(x.data_ptr(), x.shape[0], row_stride, heads, head_dim, self.cos.data_ptr(),
                               self.sin.data_ptr(), self.cos.shape[0], self.positions.data_ptr())


class LlamaModel(nn.Module):
    """The whole decoder: ``model(batch, kv_caches) -> (B, vocab)`` logits."""

    cos: torch.Tensor  # (P, D) RoPE tables for every position, model dtype
    sin: torch.Tensor

    def __init__(
        self,
        config: LlamaConfig,
        weights: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        parallel: Any = None,
    ):
        """``parallel``: the rank's ParallelContext when the weights are a tensor-parallel
        shard (``LlamaPlugin.tensor_parallel_shard``), else None."""
        super().__init__()
        w = {k: t.to(device=device, dtype=dtype or t.dtype) for k, t in weights.items()}
        self.config = config
        self.parallel = parallel
        self.native_enabled = native_choice()
        self.dtype = w["model.embed_tokens.weight"].dtype
        self.embed = nn.Parameter(w["model.embed_tokens.weight"], requires_grad=False)  # (V, E)
        head = w["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
        self.lm_head: nn.Module = Linear(head)  # E -> V
        if config.tie_word_embeddings and getattr(self.lm_head, "kernel", None) == "native-bf16":
            # the head's blocked bf16 layout is the table's one copy: rows are looked up in it
            self.embed = nn.Parameter(BlockedRows(self.lm_head.weight, *self.embed.shape), requires_grad=False)
        if head.shape[0] != config.vocab_size:  # split by vocabulary across ranks: gather V
            self.lm_head = GatherColumns(self.lm_head, parallel)
        self.norm = nn.Parameter(w["model.norm.weight"], requires_grad=False)
        self.layers = nn.ModuleList(
            LlamaLayer(config, w, f"model.layers.{i}.", parallel)
            for i in range(config.num_hidden_layers)
        )
        self.inv_freq = rope_inv_freq(config).to(device)  # (D/2,) float32
        self.register_buffer("cos", torch.empty(0, config.head_dim, dtype=self.dtype, device=device), persistent=False)
        self.register_buffer("sin", torch.empty(0, config.head_dim, dtype=self.dtype, device=device), persistent=False)
        self._grow_rope(min(config.max_position_embeddings, ROPE_TABLE_START))
        self._native: NativeLlamaDecode | None = None
        self._row_norms: bool | None = None  # whether the row kernels can read the layers' norms (first use)
        # Which kernels serve decode steps: "native" or "torch" (decided at the first decode
        # step, when the KV pools are known; rtpcore.models.native), None before it.
        self.decode_kernel: str | None = None

    def _apply(self, fn: Any, recurse: bool = True) -> Any:  # .to(), .float(), ...: weights may move
        self._native, self.decode_kernel, self._row_norms = None, None, None
        return super()._apply(fn, recurse)

    def _decoder(self, kv_caches: Sequence[LayerKVCache]) -> NativeLlamaDecode | None:
        """The native decode step, built at the first decode step where it can serve."""
        if self.decode_kernel is None:
            problem = "the engine's native_decode is False" if not self.native_enabled else native_problem(self, kv_caches)
            if problem is None:
                try:
                    self._native = NativeLlamaDecode(self)
                except ValueError as exc:  # a shape the kernels refuse (e.g. an odd head_dim), named
                    problem = str(exc)
            if problem is None:
                self.decode_kernel = "native"
                logger.info("decode steps run in rtpcore_native (%s kernels)", native_kernels().isa())
            else:
                self.decode_kernel = "torch"
                logger.info("decode steps run torch's modules: %s", problem)
        return self._native

    def _row_ops(self, x: torch.Tensor, positions: torch.Tensor) -> RowOps | None:
        """The row kernels for this forward's element-wise work: where the model may use
        rtpcore_native (its ``native_decode`` choice), this build has the kernels and the step
        computes in float32 on the CPU; None (torch's operations) otherwise. The torch operations
        are the ones bit-identical to transformers (``native_decode=False``); the kernels' sums
        run in another order (float32 rounding, as the native decode step's)."""
        if not self.native_enabled or x.dtype != torch.float32 or x.device.type != "cpu":
            return None
        if self._row_norms is None:  # the kernels read the norm weights in place
            norms = [n for layer in self.layers for n in (layer.norm1, layer.norm2)]
            self._row_norms = all(isinstance(n, torch.Tensor) and n.dtype == torch.float32 and n.is_contiguous()
                                  for n in norms)
        if not self._row_norms:
            return None
        kernels = native_kernels()
        if kernels is None:
            return None
        kernels.set_num_threads(torch.get_num_threads())
        return RowOps(kernels, self.cos.contiguous(), self.sin.contiguous(), positions.to(torch.int64).contiguous())

    def _grow_rope(self, positions: int) -> None:
        """Precompute the RoPE tables for ``positions`` positions, as transformers computes
        them (float32 angles, cos/sin cast to the model dtype)."""
        pos = torch.arange(positions, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(pos, self.inv_freq)  # (P, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
        self.cos, self.sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def forward(self, batch: ForwardBatch, kv_caches: Sequence[LayerKVCache]) -> torch.Tensor:
        """(B, V) logits after each sequence's last new token (rows ``batch.logits_indices``
        when set)."""
        if batch.max_context_len > self.cos.shape[0]:
            self._grow_rope(max(batch.max_context_len, 2 * self.cos.shape[0]))
        if NativeLlamaDecode.serves(batch):
            native = self._decoder(kv_caches)
            if native is not None:
                return native(batch, kv_caches)
        x = F.embedding(batch.input_ids, self.embed)  # (T, E)
        masks: dict[Any, Any] = {}
        row_ops = self._row_ops(x, batch.positions)
        if row_ops is None:
            cos = self.cos[batch.positions].unsqueeze(1)  # (T, 1, D)
            sin = self.sin[batch.positions].unsqueeze(1)
        else:  # the layers read the tables' rows themselves
            cos = sin = self.cos
        for layer, cache, window in zip(self.layers, kv_caches, self.config.sliding_windows, strict=True):
            x = layer(x, cos, sin, batch, cache, window, masks, row_ops)
        rows = batch.logits_index
        if rows is not None:
            x = x[rows]  # (B, E), or (N, E) for logits_indices
        x = rms_norm(x, self.norm, self.config.rms_norm_eps)
        return self.lm_head(x)  # (B, V)


def _fused(w: Mapping[str, torch.Tensor], names: list[str]) -> Linear:
    """One Linear computing the named projections side by side (outputs concatenated)."""
    weight = torch.cat([w[n + ".weight"] for n in names], dim=0)
    biases = [w.get(n + ".bias") for n in names]
    bias = torch.cat([b for b in biases if b is not None]) if all(b is not None for b in biases) else None
    return Linear(weight, bias)

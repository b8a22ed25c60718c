"""The native CPU decode step of the Llama family (``rtpcore_native._kernels``).

At small batch sizes a CPU decode step of a float32 model is bound by reading the weights
once, plus the cost of launching its small operations one by one: about thirty torch ops
per layer (norms, RoPE, the KV write, views, the residual adds), each a few microseconds
of dispatch and a pass over memory. :class:`NativeLlamaDecode` runs the whole step --
embedding, every layer, the final norm and the head -- in one call of the extension,
without the GIL: matrix-vector products tiled for the CPU's registers (AMX, AVX512-BF16,
AVX-512, AVX2 or the x86-64 baseline, chosen at import; ``ONEDNN_MAX_CPU_ISA`` caps it as it
caps oneDNN), over float32 weights or the int8 weights of ``quantization="int8"`` (one scale
per output row; below ``INT8_QUANTIZED_ROWS`` sequences integer dot products over activations
quantized per block of 32 as llama.cpp's Q8_0, from it on widened in registers, from
``gemm_rows()`` on quantized again), attention
read in place from the paged pools through the block tables, and parallel regions sized by
torch's thread count on torch's own OpenMP threads (``rtpcore_native._kernels.pool_kind()``).

Qwen3's per-head RMSNorm of queries and keys before RoPE runs in the step too
(``LlamaDecoder.set_qk_norm``).

It serves steps where every sequence decodes one token and the model returns every row's
logits (no speculative verification, no hidden states for a draft), on one rank on the CPU,
with unquantized float32 or bfloat16 KV pools, for float32 models and for bfloat16 ones
whose linear layers it can read: bf16 weights kept plain, the blocked bf16 layout of
``Linear``'s ``"native-bf16"`` kernel on CPUs with bf16 dot products (AVX512-BF16, AMX-BF16;
a tied token embedding looked up in the head's blocks,
``rtpcore.models.bf16_blocked.BlockedRows``), or the float32 copies that ``"packed+fp32"``
keeps on CPUs without them (there it beats oneDNN's emulated bf16 products by far).
Activations stay float32 inside the step between the products; a product over blocked bf16
weights rounds its input rows to bf16 where the kernels in use have bf16 dot products
(vdpbf16ps, or AMX tiles from ``amx_rows()`` rows on: the rounding a bf16 model's activations
get in torch anyway) and widens the weights to float32 elsewhere. Either way the step is
within bf16 rounding of transformers'; the logits come back in the model's dtype. It is the decode step of the ``native_cpu`` attention
backend (``rtpcore.attention``): over an engine's pools it runs only where every layer's
backend is ``native_cpu`` (or a subclass); ``--attention-backend torch`` turns it off like
``--no-native-decode``. Every other step runs the torch modules. ``LlamaModel.decode_kernel`` says which one decode
steps use, and why not the native one when it is off (:func:`native_problem`).

GGUF weights kept in their blocks (the ``gguf`` quantization method, ``rtpcore.checkpoint.gguf.linear``)
are read in place where the build's kernels multiply GGUF blocks
(``rtpcore.checkpoint.gguf.blocks.gguf_native``): a fused qkv or gate_up of one type as one
operand, of several types (a Q4_K_M file's Q6_K v rows) as one operand per projection
(``set_layer_parts``), and a token embedding in blocks dequantized row by row. Without those
kernels such a model decodes with its torch modules.

Numerics (docs/design.md §6): float32 throughout, summed in another order than torch's
kernels, so logits differ from transformers' by float32 rounding (about 1e-6 relative),
and greedy tokens equal transformers' except where two logits tie to that precision. The
engine's ``native_decode=False`` (``--no-native-decode``) keeps the torch modules, whose
float32 decode is bit-identical to transformers'.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from rtpcore.checkpoint.gguf.blocks import GGUFBlocks, gguf_native
from rtpcore.checkpoint.gguf.linear import gguf_blocks, native_gguf_weights
from rtpcore.models.bf16_blocked import BlockedRows
from rtpcore.models.layers import Linear
from rtpcore.models.layers import native_kernels as kernels

if TYPE_CHECKING:
    from rtpcore.models.forward_batch import ForwardBatch

__all__ = ["NativeLlamaDecode", "kernels", "native_decode", "native_linear_weights", "native_problem"]

logger = logging.getLogger(__name__)

# The engine's native_decode option while a model is built: True = native decode steps where
# the model and its pools allow them (the reason logged where not), False = torch's modules.
_NATIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("rtpcore_native_decode", default=True)


@contextlib.contextmanager
def native_decode(choice: bool) -> Iterator[None]:
    """Within the block, models built in this thread decode natively where they can (True) or
    never do (False)."""
    if choice not in (True, False):
        raise ValueError(f"native_decode must be True or False, got {choice!r}")
    token = _NATIVE.set(choice)
    try:
        yield
    finally:
        _NATIVE.reset(token)


def native_choice() -> bool:
    """The ``native_decode`` choice of the model being built (see :func:`native_decode`)."""
    return _NATIVE.get()


def native_operands(layer: Any) -> tuple[str, torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
    """What the native kernels multiply for an ``rtpcore.models.layers.Linear``: (weight dtype,
    weight, float32 scales or None, float32 bias or None), or None when they cannot read it
    (a oneDNN-packed weight without a float32 copy, float16, GGUF blocks without the GGUF
    kernels or of several types: see :func:`_row_weights`)."""
    if getattr(layer, "gguf_parts", None) is not None:
        if gguf_native() is None or len(layer.gguf_parts) != 1:
            return None
        return layer.gguf_parts[0][0], layer.weight, None, layer.bias_f32
    if layer.kernel == "int8":
        return "int8", layer.weight, layer.scales_f32, layer.bias_f32
    if layer.kernel == "native-bf16":
        return "bfloat16_packed", layer.weight, None, layer.bias_f32
    if layer.kernel == "packed+fp32":
        return "float32", layer.weight_fp32, None, layer.bias_fp32
    if layer.kernel == "plain" and layer.weight.dtype in (torch.float32, torch.bfloat16):
        bias = None if layer.bias is None else layer.bias.float().contiguous()
        return str(layer.weight.dtype).removeprefix("torch."), layer.weight, None, bias
    return None


def native_linear_weights(layer: Any, keep: list[torch.Tensor]) -> Any:
    """The extension's view of an ``rtpcore.models.layers.Linear`` (:func:`native_operands`);
    tensors made for it are appended to ``keep``, which must outlive the view (so must the layer)."""
    dtype, weight, scale, bias = native_operands(layer)  # type: ignore[misc]
    keep.extend(t for t in (scale, bias) if t is not None)
    return kernels().LinearWeights(weight.data_ptr(), dtype, 0 if scale is None else scale.data_ptr(),
                                   0 if bias is None else bias.data_ptr(), layer.out_features, layer.in_features)


def _row_weights(layer: Any, start: int, rows: int, keep: list[torch.Tensor]) -> Any:
    """The extension's view of rows ``start:start + rows`` of a Linear (one projection of a
    fused one): a GGUF part's byte rows, or a float / int8 weight's rows, read in place."""
    bias = None
    if getattr(layer, "gguf_parts", None) is not None:
        at = 0
        for kind, blocks in gguf_blocks(layer):
            if at <= start and start + rows <= at + blocks.shape[0]:
                if layer.bias_f32 is not None:
                    bias = layer.bias_f32[start: start + rows]
                return native_gguf_weights(kind, blocks, bias, layer.in_features, start - at, rows)
            at += blocks.shape[0]
        raise ValueError(f"rows {start}:{start + rows} of a GGUF layer span parts of different types")
    dtype, weight, scale, full_bias = native_operands(layer)  # type: ignore[misc]
    at = start
    if dtype == "bfloat16_packed":  # blocks of 16 rows, weight.stride(0) values each
        if start % 16 or (rows % 16 and start + rows != layer.out_features):
            raise ValueError(f"rows {start}:{start + rows} of a blocked bf16 layer are not whole blocks of 16")
        at = start // 16
    ptr = weight.data_ptr() + at * weight.stride(0) * weight.element_size()
    scale_ptr = 0 if scale is None else scale.data_ptr() + start * scale.element_size()
    if full_bias is not None:
        bias = full_bias[start: start + rows]
    keep.extend(t for t in (scale, full_bias) if t is not None)
    return kernels().LinearWeights(ptr, dtype, scale_ptr, 0 if bias is None else bias.data_ptr(), rows,
                                   layer.in_features)


def _several_types(layer: Any) -> bool:
    return len(getattr(layer, "gguf_parts", None) or ()) > 1


def _linear_problem(name: str, layer: Any) -> str | None:
    if type(layer) is not Linear:
        return f"{name} is a {type(layer).__name__}, not a single-rank Linear"
    parts = getattr(layer, "gguf_parts", None)
    if parts is not None:
        types = "+".join(kind for kind, _ in parts)
        if gguf_native() is None:
            return f"{name} keeps GGUF blocks ({types}) and this build of rtpcore_native has no GGUF kernels"
        if _several_types(layer) and name.rsplit(".", 1)[-1] not in ("qkv", "gate_up"):
            return f"{name} holds GGUF rows of several types ({types})"
        return None
    operands = native_operands(layer)
    if operands is None:
        return (f"{name} runs the {layer.kernel!r} kernel on {layer.weight.dtype} weights (native: float32, int8, "
                "bfloat16 or a float32 copy)")
    weight = operands[1]
    if weight.device.type != "cpu" or not weight.is_contiguous():
        return f"{name}'s weight is not a contiguous CPU tensor"
    return None


def native_problem(model: Any, kv_caches: Sequence[Any]) -> str | None:
    """Why ``model`` (a ``LlamaModel``) cannot decode natively over ``kv_caches``, or None."""
    from rtpcore.attention import NativeCpuAttentionBackend
    from rtpcore.kv.pools import LayerKVCache

    if kernels() is None:
        return "this build of rtpcore_native has no _kernels extension"
    if model.embed.device.type != "cpu":
        return f"the model is on {model.embed.device}, not the CPU"
    if model.dtype not in (torch.float32, torch.bfloat16):
        return f"the model computes in {model.dtype} (native decode: float32 or bfloat16 models)"
    if isinstance(model.embed, GGUFBlocks):
        types = "+".join(model.embed.gguf_types)
        if gguf_native() is None:
            return f"the token embedding keeps GGUF blocks ({types}) and this build of rtpcore_native has no GGUF kernels"
        if len(model.embed.parts) != 1:
            return f"the token embedding holds GGUF rows of several types ({types})"
    if model.parallel is not None:
        return "the model is a tensor-parallel shard"
    problem = _linear_problem("lm_head", model.lm_head)
    if problem:
        return problem
    for i, layer in enumerate(model.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            problem = _linear_problem(f"layers.{i}.{name}", getattr(layer, name))
            if problem:
                return problem
    cfg = model.config
    if len(kv_caches) != cfg.num_hidden_layers:
        return f"{len(kv_caches)} KV pools for {cfg.num_hidden_layers} layers"
    for i, cache in enumerate(kv_caches):
        if type(cache) is not LayerKVCache or cache.spec.kind != "mha" or cache.k.dtype not in _POOL_DTYPES:
            kind = getattr(cache.spec, "dtype", "?")
            return f"layer {i}'s KV pool is {type(cache).__name__} ({kind}); native decode reads fp32 and bf16 pools"
        backend = getattr(cache, "attention_backend", None)  # None: pools no engine allocated
        if backend is not None and not isinstance(backend, NativeCpuAttentionBackend):
            return (f"layer {i}'s attention backend is {backend.name!r}; the native decode step is the "
                    "native_cpu backend's")
        shape = (cfg.num_key_value_heads, cfg.head_dim)
        for part in (cache.k, cache.v):
            if tuple(part.shape[1:]) != shape or not part.is_contiguous() or part.device.type != "cpu":
                return f"layer {i}'s KV pool is not a contiguous CPU (slots, {shape[0]}, {shape[1]}) tensor"
    return None


_POOL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
_LOGITS_DTYPES = _POOL_DTYPES  # the model dtypes the step serves


class NativeLlamaDecode:
    """A ``LlamaModel``'s decode step in ``rtpcore_native._kernels`` (see the module doc).

    Holds raw pointers into the model's weights: the model owns them and this object, so
    they live as long as it does. The KV pools are passed per step (an engine may
    allocate them after building the model).
    """

    def __init__(self, model: Any):
        k = kernels()
        cfg = model.config
        self._k = k
        self._model = model
        self.decoder = k.LlamaDecoder(
            hidden=cfg.hidden_size, heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim, intermediate=cfg.intermediate_size, vocab=model.lm_head.out_features,
            eps=cfg.rms_norm_eps, num_layers=cfg.num_hidden_layers,
        )
        # Norm weights (and, below, the RoPE tables) in float32: a bf16 model's own are bf16.
        self._keep: list[torch.Tensor] = []
        f32 = self._f32
        q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
        for i, (layer, window) in enumerate(zip(model.layers, cfg.sliding_windows, strict=True)):
            if _several_types(layer.qkv) or _several_types(layer.gate_up):  # one operand per projection
                rows = self._rows
                self.decoder.set_layer_parts(
                    i, f32(layer.norm1).data_ptr(), rows(layer.qkv, 0, q), rows(layer.qkv, q, kv),
                    rows(layer.qkv, q + kv, kv), native_linear_weights(layer.o, self._keep), f32(layer.norm2).data_ptr(),
                    rows(layer.gate_up, 0, inter), rows(layer.gate_up, inter, inter),
                    native_linear_weights(layer.down, self._keep), window or 0,
                )
                continue
            self.decoder.set_layer(
                i, f32(layer.norm1).data_ptr(), native_linear_weights(layer.qkv, self._keep),
                native_linear_weights(layer.o, self._keep), f32(layer.norm2).data_ptr(),
                native_linear_weights(layer.gate_up, self._keep), native_linear_weights(layer.down, self._keep),
                window or 0,
            )
        for i, layer in enumerate(model.layers):
            if layer.qk_norm is not None:  # Qwen3: rows 0 (a query head's) and H (a KV head's)
                qk_norm = f32(layer.qk_norm)
                self.decoder.set_qk_norm(i, qk_norm[0].data_ptr(), qk_norm[layer.heads].data_ptr())
        if isinstance(model.embed, GGUFBlocks):  # rows dequantized as they are looked up
            [(embed_dtype, blocks)] = model.embed.parts
            embed_ptr = blocks.data_ptr()
            self._keep.append(blocks)
        elif isinstance(model.embed, BlockedRows):  # a tied head's blocks: rows gathered from them
            embed_dtype, embed_ptr = "bfloat16_packed", model.embed.packed.data_ptr()
            self._keep.append(model.embed.packed)
        else:
            embed_dtype = "bfloat16" if model.embed.dtype == torch.bfloat16 else "float32"
            embed_ptr = model.embed.data_ptr()
        self.decoder.set_head(embed_ptr, model.embed.shape[0], embed_dtype, f32(model.norm).data_ptr(),
                              native_linear_weights(model.lm_head, self._keep))
        self._pools: tuple[int, ...] = ()
        self._rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.steps = 0

    def _rows(self, layer: Any, start: int, rows: int) -> Any:
        return _row_weights(layer, start, rows, self._keep)

    def _f32(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as a contiguous float32 tensor kept alive with this object."""
        out = t.detach().float().contiguous()
        self._keep.append(out)
        return out

    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's RoPE tables in float32 (copied again when the model grows them)."""
        cos, sin = self._model.cos, self._model.sin
        if self._rope is None or self._rope[0] is not cos or self._rope[1] is not sin:
            self._rope = (cos, sin, cos.float().contiguous(), sin.float().contiguous())
        return self._rope[2], self._rope[3]

    @staticmethod
    def serves(batch: ForwardBatch) -> bool:
        """Whether this step is one the native decode runs (one token per sequence, every
        row's logits, no hidden states)."""
        return batch.is_decode and batch.logits_indices is None and batch.hidden_rows is None

    def __call__(self, batch: ForwardBatch, kv_caches: Sequence[Any]) -> torch.Tensor:
        pools = tuple(p for c in kv_caches for p in (c.k.data_ptr(), c.v.data_ptr()))
        if pools != self._pools:
            for i in range(len(kv_caches)):
                self.decoder.set_pools(i, pools[2 * i], pools[2 * i + 1], kv_caches[i].k.shape[0],
                                       _POOL_DTYPES[kv_caches[i].k.dtype])
            self._pools = pools
        b = batch.num_seqs
        ids = _i64(batch.input_ids)
        positions = _i64(batch.positions)
        slots = _i64(batch.slots)
        tables = _i64(batch.block_tables)
        ctx = _i64(batch.context_lens)
        model = self._model
        # the model's dtype, written by the step (a bf16 model's logits rounded there: a torch
        # conversion here would wake torch's thread pool between the extension's steps)
        logits = torch.empty(b, model.lm_head.out_features, dtype=model.dtype)
        cos, sin = self._rope_tables()
        self._k.set_num_threads(torch.get_num_threads())
        self.decoder.decode(
            b, ids.data_ptr(), positions.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.shape[1],
            ctx.data_ptr(), batch.tokens_per_block, cos.data_ptr(), sin.data_ptr(), cos.shape[0], logits.data_ptr(),
            _LOGITS_DTYPES[model.dtype],
        )
        self.steps += 1
        return logits  # (B, V), the model's dtype as from its torch modules


def _i64(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int64).contiguous()

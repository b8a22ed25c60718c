"""The native CPU decode step of the Llama family (``rtpcore_native._kernels``).

At small batch sizes a CPU decode step of a float32 model is bound by reading the weights
once, plus the cost of launching its small operations one by one: about thirty torch ops
per layer (norms, RoPE, the KV write, views, the residual adds), each a few microseconds
of dispatch and a pass over memory. :class:`NativeLlamaDecode` runs the whole step --
embedding, every layer, the final norm and the head -- in one call of the extension,
without the GIL: matrix-vector products tiled for the CPU's registers (AVX-512, AVX2 or
the x86-64 baseline, chosen at import; ``ONEDNN_MAX_CPU_ISA`` caps it as it caps oneDNN),
over float32 weights or the int8 weights of ``quantization="int8"`` (widened in registers,
one scale per output row), attention read in place from the paged pools through the block
tables, and a thread pool of the extension's own sized by torch's thread count.

It serves steps where every sequence decodes one token and the model returns every row's
logits (no speculative verification, no hidden states for a draft), on models whose
activations are float32 on the CPU, with unquantized float32 KV pools, on one rank; every
other step runs the torch modules. ``LlamaModel.decode_kernel`` says which one decode
steps use, and why not the native one when it is off (:func:`native_problem`).

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

if TYPE_CHECKING:
    from rtpcore.engine.batch import ForwardBatch

__all__ = ["NativeLlamaDecode", "kernels", "native_decode", "native_linear_weights", "native_problem"]

logger = logging.getLogger(__name__)

# The engine's native_decode option while a model is built: None = automatic (native where
# the model and pools allow it), True = required (an error otherwise), False = never.
_NATIVE: contextvars.ContextVar[bool | None] = contextvars.ContextVar("rtpcore_native_decode", default=None)


@contextlib.contextmanager
def native_decode(choice: bool | None) -> Iterator[None]:
    """Within the block, models built in this thread decode natively where they can (None),
    must (True) or never do (False)."""
    if choice not in (None, True, False):
        raise ValueError(f"native_decode must be None (automatic), True or False, got {choice!r}")
    token = _NATIVE.set(choice)
    try:
        yield
    finally:
        _NATIVE.reset(token)


def native_choice() -> bool | None:
    """The ``native_decode`` choice of the model being built (see :func:`native_decode`)."""
    return _NATIVE.get()


def kernels() -> Any:
    """The ``rtpcore_native._kernels`` module, or None where this build has none."""
    try:
        from rtpcore_native import _kernels
    except ImportError as exc:  # a build without the kernels: the torch modules serve
        logger.debug("rtpcore_native._kernels unavailable: %s", exc)
        return None
    return _kernels


def native_linear_weights(layer: Any) -> Any:
    """The extension's view of an ``rtpcore.models.layers.Linear`` (float32 ``"plain"`` or
    ``"int8"``): its weight, scales and bias pointers. The layer must outlive it."""
    k = kernels()
    if layer.kernel == "int8":
        scale = layer.scales_f32
        bias = None if layer.bias is None else layer.bias_f32
        return k.LinearWeights(layer.weight.data_ptr(), True, scale.data_ptr(),
                               0 if bias is None else bias.data_ptr(), layer.out_features, layer.in_features)
    bias = layer.bias
    return k.LinearWeights(layer.weight.data_ptr(), False, 0, 0 if bias is None else bias.data_ptr(),
                           layer.out_features, layer.in_features)


def _linear_problem(name: str, layer: Any) -> str | None:
    from rtpcore.models.layers import Linear

    if type(layer) is not Linear:
        return f"{name} is a {type(layer).__name__}, not a single-rank Linear"
    if layer.kernel == "int8":
        return None
    if layer.kernel != "plain" or layer.weight.dtype != torch.float32:
        return f"{name} runs the {layer.kernel!r} kernel on {layer.weight.dtype} weights (native: float32 or int8)"
    if not layer.weight.is_contiguous() or (layer.bias is not None and not layer.bias.is_contiguous()):
        return f"{name}'s weight is not contiguous"
    return None


def native_problem(model: Any, kv_caches: Sequence[Any]) -> str | None:
    """Why ``model`` (a ``LlamaModel``) cannot decode natively over ``kv_caches``, or None."""
    from rtpcore.kv.pools import LayerKVCache

    if kernels() is None:
        return "this build of rtpcore_native has no _kernels extension"
    if model.embed.device.type != "cpu":
        return f"the model is on {model.embed.device}, not the CPU"
    if model.dtype != torch.float32:
        return f"the model computes in {model.dtype} (native decode: float32 activations)"
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
        if type(cache) is not LayerKVCache or cache.spec.kind != "mha" or cache.k.dtype != torch.float32:
            kind = getattr(cache.spec, "dtype", "?")
            return f"layer {i}'s KV pool is {type(cache).__name__} ({kind}); native decode reads float32 pools"
        shape = (cfg.num_key_value_heads, cfg.head_dim)
        for part in (cache.k, cache.v):
            if tuple(part.shape[1:]) != shape or not part.is_contiguous() or part.device.type != "cpu":
                return f"layer {i}'s KV pool is not a contiguous CPU (slots, {shape[0]}, {shape[1]}) tensor"
    return None


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
        for i, (layer, window) in enumerate(zip(model.layers, cfg.sliding_windows, strict=True)):
            self.decoder.set_layer(
                i, layer.norm1.data_ptr(), native_linear_weights(layer.qkv), native_linear_weights(layer.o),
                layer.norm2.data_ptr(), native_linear_weights(layer.gate_up), native_linear_weights(layer.down),
                window or 0,
            )
        self.decoder.set_head(model.embed.data_ptr(), model.embed.shape[0], model.norm.data_ptr(),
                              native_linear_weights(model.lm_head))
        self._pools: tuple[int, ...] = ()
        self.steps = 0

    @staticmethod
    def serves(batch: ForwardBatch) -> bool:
        """Whether this step is one the native decode runs (one token per sequence, every
        row's logits, no hidden states)."""
        return batch.is_decode and batch.logits_indices is None and batch.hidden_rows is None

    def __call__(self, batch: ForwardBatch, kv_caches: Sequence[Any]) -> torch.Tensor:
        pools = tuple(p for c in kv_caches for p in (c.k.data_ptr(), c.v.data_ptr()))
        if pools != self._pools:
            for i in range(len(kv_caches)):
                self.decoder.set_pools(i, pools[2 * i], pools[2 * i + 1], kv_caches[i].k.shape[0])
            self._pools = pools
        b = batch.num_seqs
        ids = _i64(batch.input_ids)
        positions = _i64(batch.positions)
        slots = _i64(batch.slots)
        tables = _i64(batch.block_tables)
        ctx = _i64(batch.context_lens)
        model = self._model
        logits = torch.empty(b, model.lm_head.out_features, dtype=torch.float32)
        self._k.set_num_threads(torch.get_num_threads())
        self.decoder.decode(
            b, ids.data_ptr(), positions.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.shape[1],
            ctx.data_ptr(), batch.tokens_per_block, model.cos.data_ptr(), model.sin.data_ptr(), model.cos.shape[0],
            logits.data_ptr(),
        )
        self.steps += 1
        return logits


def _i64(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int64).contiguous()

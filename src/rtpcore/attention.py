"""Attention backends: the ``attention_backends`` seam (docs/design.md §18, docs/plugins.md
"Attention backends").

A model computes its queries, writes its new keys and values into its layer's paged cache, and
calls :func:`paged_attention` (multi-head / grouped-query attention) or :func:`paged_mla`
(multi-head latent attention); both are re-exported by ``rtpcore.layers``, the module a model
imports. Neither picks a kernel: each dispatches to the :class:`AttentionBackend` the engine
attached to the layer's cache (``cache.attention_backend``) when it allocated the pools, chosen
per layer by :func:`choose_attention_backends`: the backend named by ``--attention-backend``
(``Engine.from_pretrained(..., attention_backend=NAME)``), else the platform's default, else the
registered backend of highest ``priority`` whose :meth:`AttentionBackend.supports` accepts the
layer's KV spec on the device. A cache no engine allocated (a test, a script) uses
:class:`TorchAttentionBackend`.

One backend instance serves every layer of an engine that chose it; a backend keeps no state
per layer or per step (the ``masks`` dict a model passes holds what the layers of one forward
share). Built in, registered through the same hook a plugin implements
(``rtpcore.models``): ``torch`` (:class:`TorchAttentionBackend`, the reference: torch's fused
attention over the gathered context, Triton kernels reading the pool in place on GPUs) and
``native_cpu`` (:class:`NativeCpuAttentionBackend`: the ``rtpcore_native`` CPU decode step of
the Llama family; ``--no-native-decode`` leaves it out of the automatic choice).

Public constants: :data:`BUILTIN_ATTENTION_BACKENDS` (the built-in names).
"""

from __future__ import annotations

import abc
import functools
import importlib
import importlib.util
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from rtpcore.errors import AttentionBackendError

if TYPE_CHECKING:
    import torch

# ``batch`` below is the step's rtpcore.batch.ForwardBatch (typed Any: it lives with the models,
# a stage above this one).
ForwardBatch = Any

__all__ = [
    "BUILTIN_ATTENTION_BACKENDS",
    "AttentionBackend",
    "NativeCpuAttentionBackend",
    "TorchAttentionBackend",
    "choose_attention_backends",
    "paged_attention",
    "paged_mla",
]

#: The names of rtpcore's own attention backends.
BUILTIN_ATTENTION_BACKENDS = ("torch", "native_cpu")


class AttentionBackend(abc.ABC):
    """The base of every attention backend (the ``attention_backends`` seam).

    ``name`` selects it (``--attention-backend``); ``api_version`` is the seam's version the
    class was written for; ``priority`` orders the automatic choice (highest first; the
    reference ``torch`` is 0); ``replaces`` names built-in backends it takes over. Built once
    per engine with no arguments.

    A backend implements :meth:`supports` and the calls of the layers it accepts:
    :meth:`attention` for a multi-head / grouped-query layer (``kv_spec.kind == "mha"``),
    :meth:`mla` for a latent one (``"mla"``). Each call serves any step: prefill, decode, or a
    mixed one (a step's decodes lead its batch, ``batch.num_decodes`` of them; every other
    sequence is a span of several new tokens, ``batch.spans(num_decodes)``), and runs after the
    layer wrote the step's keys into ``cache``.
    """

    name: ClassVar[str]
    api_version: ClassVar[str] = "1.0"
    priority: ClassVar[int] = 0
    replaces: ClassVar[tuple[str, ...]] = ()

    @classmethod
    @abc.abstractmethod
    def supports(cls, kv_spec: Any, device: torch.device, dtype: torch.dtype) -> bool | str:
        """True when this backend can serve a layer with ``kv_spec`` (an
        ``rtpcore_native.KVCacheSpec``: ``kind``, ``dtype``, ``layout``, ...) on ``device`` for
        a model computing in ``dtype``; else a sentence saying why not (it reaches the user)."""

    def attention(
        self,
        q: torch.Tensor,
        cache: Any,
        batch: ForwardBatch,
        *,
        scale: float,
        window: int | None = None,
        masks: dict[Any, Any] | None = None,
    ) -> torch.Tensor:
        """(T, H, D) outputs of the step's flat queries ``q`` (T, H, D) over each sequence's
        own cached keys and values (``window``: a sliding window of that many positions).
        ``masks``: a dict the model keeps for one forward, for what its layers can share."""
        raise NotImplementedError(f"attention backend {self.name!r} does not serve multi-head attention layers")

    def mla(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        cache: Any,
        batch: ForwardBatch,
        *,
        w_uk: torch.Tensor,
        w_uv_t: torch.Tensor,
        scale: float,
        masks: dict[Any, Any] | None = None,
    ) -> torch.Tensor:
        """(T, H * dv) outputs of multi-head latent attention. ``q_nope`` (T, H, dn) and
        ``q_pe`` (T, H, R, roped) are the queries; the cache holds each position's normalised
        latent (r values, the spec's k part) and roped shared key (R, its v part); ``w_uk``
        (H, dn, r) and ``w_uv_t`` (H, r, dv) are ``kv_b_proj``'s key and value halves. The
        result is softmax(scale * (q_nope . (W_UK latent) + q_pe . k_pe)) @ (W_UV latent)."""
        raise NotImplementedError(f"attention backend {self.name!r} does not serve latent (MLA) attention layers")

    @classmethod
    def seam_problems(cls) -> list[str]:
        """The seam's rules beyond the common ones (``rtpcore.plugins.seams``)."""
        if isinstance(cls.priority, bool) or not isinstance(cls.priority, int):
            return [f"priority must be an integer, got {cls.priority!r}"]
        return []

    def __repr__(self) -> str:
        return f"<attention backend {self.name!r} ({type(self).__module__}.{type(self).__qualname__})>"


class TorchAttentionBackend(AttentionBackend):
    """``torch``: the reference, for every KV spec on every device.

    Multi-head / grouped-query layers: on a GPU with an unquantized pool the blocks are read in
    place (``rtpcore.kv.paged_attention``: the decode kernel for one-token steps, the varlen
    prefill kernel for the others). Elsewhere (the CPU, fp8 pools) the one-token sequences at
    the head of the batch (the decodes) are gathered together up to their longest context and
    attended in one fused call; every longer span (a prompt chunk, a speculative verification)
    is attended alone over its own context, with the causal mask offset by the tokens cached
    before it. No tensor is sized B x (longest span) x (longest context). Numerics follow
    transformers' "sdpa" attention (:func:`attend`).

    Latent (MLA) layers: a decode step over an unquantized latent cache on a GPU reads it in
    place (``rtpcore.kv.paged_attention.paged_mla_decode``, ``W_UK`` absorbed into the query and
    ``W_UV`` into the output); elsewhere every sequence's context is gathered and expanded
    through ``kv_b_proj``'s halves into per-head keys and values, attended as above -- the form
    transformers computes, and the slowest: a model package brings its own backend (as
    atom-plugin's ``atom_mla``) for speed.
    """

    name = "torch"

    @classmethod
    def supports(cls, kv_spec: Any, device: torch.device, dtype: torch.dtype) -> bool | str:
        return True

    def attention(self, q: Any, cache: Any, batch: ForwardBatch, *, scale: float, window: int | None = None,
                  masks: dict[Any, Any] | None = None) -> Any:
        return _reference().torch_paged_attention(q, cache, batch, scale=scale, window=window, masks=masks)

    def mla(self, q_nope: Any, q_pe: Any, cache: Any, batch: ForwardBatch, *, w_uk: Any, w_uv_t: Any, scale: float,
            masks: dict[Any, Any] | None = None) -> Any:
        return _reference().torch_paged_mla(q_nope, q_pe, cache, batch, w_uk=w_uk, w_uv_t=w_uv_t, scale=scale,
                                            masks=masks)


@functools.cache
def _reference() -> Any:
    """rtpcore.kv.attention_torch, imported at the first call (importing this module, as every
    plugin listing does, never imports torch)."""
    return importlib.import_module("rtpcore.kv.attention_torch")


# -- native CPU ---------------------------------------------------------------------------------


class NativeCpuAttentionBackend(TorchAttentionBackend):
    """``native_cpu``: the ``rtpcore_native`` kernels on the CPU, for float32 and bfloat16
    multi-head / grouped-query pools. A Llama-family model whose every layer has it runs its
    decode steps as one native call (``rtpcore.models.native``: attention and the layers around
    it). In every other step (prompt chunks, a mixed step's decodes beside them, speculative
    verifications, any model without a native decode step) a layer's attention is two native
    calls reading the pool in place, no gathered copy of any context: the one-token sequences
    at the head of the batch through ``rtpcore_native._kernels.paged_decode_attention`` (the
    native decode step's attention), every longer span through ``paged_span_attention`` (causal
    over the span's own context, blocks of keys with an online softmax). Both sum in float32 in
    their own order, within float32 rounding of the reference; a bf16 model's queries are
    widened to float32 and its outputs rounded back."""

    name = "native_cpu"
    priority = 10

    def attention(self, q: Any, cache: Any, batch: ForwardBatch, *, scale: float, window: int | None = None,
                  masks: dict[Any, Any] | None = None) -> Any:
        pool_dtype = _POOL_DTYPES.get(str(cache.k.dtype))
        if pool_dtype is None or cache.k.dtype is not cache.v.dtype or cache.k.dim() != 3:
            return super().attention(q, cache, batch, scale=scale, window=window, masks=masks)
        import torch

        from rtpcore_native import _kernels

        d = batch.num_decodes
        rows = masks.get("native_rows") if masks is not None else None  # once per forward, shared by the layers
        if rows is None:
            rows = _NativeRows(batch, d)
            if masks is not None:
                masks["native_rows"] = rows
        t, h, dim = q.shape
        qf = q.to(torch.float32).contiguous()  # (T, H, D)
        out = torch.empty_like(qf)
        hkv, slots = cache.k.shape[1], cache.k.shape[0]
        if d:
            _kernels.paged_decode_attention(
                qf.data_ptr(), d, h, hkv, dim, cache.k.data_ptr(), cache.v.data_ptr(), pool_dtype, slots,
                rows.tables.data_ptr(), rows.tables.shape[1], cache.tokens_per_block, rows.lens.data_ptr(),
                window or 0, scale, out.data_ptr(),
            )
        if rows.spans:
            _kernels.paged_span_attention(
                qf.data_ptr(), t, h, hkv, dim, cache.k.data_ptr(), cache.v.data_ptr(), pool_dtype, slots,
                rows.tables.data_ptr(), rows.tables.shape[0], rows.tables.shape[1], cache.tokens_per_block,
                rows.spans, rows.starts.data_ptr(), rows.counts.data_ptr(), rows.span_lens.data_ptr(),
                rows.index.data_ptr(), window or 0, scale, out.data_ptr(),
            )
        return out.to(q.dtype)

    @classmethod
    def supports(cls, kv_spec: Any, device: torch.device, dtype: torch.dtype) -> bool | str:
        if getattr(device, "type", device) != "cpu":
            return f"it runs on the CPU, and this layer is on {device}"
        if kv_spec.kind != "mha":
            return f"it serves multi-head/grouped-query caches, and this layer's is {kv_spec.kind!r}"
        if kv_spec.dtype not in ("fp32", "bf16"):
            return f"it reads fp32 and bf16 pools, and this layer's is {kv_spec.dtype}"
        if importlib.util.find_spec("rtpcore_native._kernels") is None:
            return "this build of rtpcore_native has no _kernels extension"
        return True


_POOL_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16"}


class _NativeRows:
    """A step's rows as the native attention kernels read them (int64, contiguous): the block
    tables and context lengths of every sequence, and per span after the ``decodes`` one-token
    sequences at the head: its first row, its new tokens, its context length, its table row."""

    def __init__(self, batch: ForwardBatch, decodes: int):
        import torch

        self.tables = batch.block_tables.to(torch.int64).contiguous()  # (B, width)
        self.lens = batch.context_lens.to(torch.int64).contiguous()  # (B,)
        spans = list(batch.spans(decodes))
        self.spans = len(spans)
        cols = list(zip(*((s.start, s.num_tokens, s.context_len, s.b) for s in spans), strict=True)) or [(), (), (), ()]
        self.starts, self.counts, self.span_lens, self.index = (torch.tensor(c, dtype=torch.int64) for c in cols)


# -- what a model calls -------------------------------------------------------------------------

_REFERENCE = TorchAttentionBackend()  # for pools no engine allocated


def backend_of(cache: Any) -> AttentionBackend:
    """The backend the engine attached to ``cache`` (the reference when none was)."""
    backend: AttentionBackend | None = getattr(cache, "attention_backend", None)
    return _REFERENCE if backend is None else backend


def paged_attention(
    q: torch.Tensor,  # (T, H, D) the step's queries, flat
    cache: Any,  # the layer's pool (rtpcore.kv.LayerKVCache), holding this step's keys already
    batch: ForwardBatch,
    *,
    scale: float,
    window: int | None = None,
    masks: dict[Any, Any] | None = None,
) -> torch.Tensor:
    """(T, H, D) attention outputs of every new token over its own sequence's cached keys,
    by the layer's backend (:meth:`AttentionBackend.attention`). ``masks``: a dict the caller
    keeps for one forward, where what every layer shares (the decodes' mask of each window) is
    built once (None: built per call)."""
    return backend_of(cache).attention(q, cache, batch, scale=scale, window=window, masks=masks)


def paged_mla(
    q_nope: torch.Tensor,  # (T, H, dn)
    q_pe: torch.Tensor,  # (T, H, R), roped
    cache: Any,  # the layer's latent pool, holding this step's latents already
    batch: ForwardBatch,
    *,
    w_uk: torch.Tensor,  # (H, dn, r)
    w_uv_t: torch.Tensor,  # (H, r, dv)
    scale: float,
    masks: dict[Any, Any] | None = None,
) -> torch.Tensor:
    """(T, H * dv) multi-head latent attention outputs by the layer's backend
    (:meth:`AttentionBackend.mla`)."""
    return backend_of(cache).mla(q_nope, q_pe, cache, batch, w_uk=w_uk, w_uv_t=w_uv_t, scale=scale, masks=masks)


# -- the engine's choice ------------------------------------------------------------------------


def choose_attention_backends(
    specs: Sequence[Any],
    classes: Mapping[str, type[AttentionBackend]],
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    requested: str | None = None,
    preferred: str | None = None,
    excluded: Sequence[str] = (),
    what: str = "attention_backend",
) -> list[AttentionBackend]:
    """One backend per layer of ``specs``, instances shared by the layers that chose the same.

    ``classes``: the registered backends by name. ``requested`` (``--attention-backend``) must
    serve every layer: an unknown name, or a layer it does not support, is an
    :class:`~rtpcore.errors.AttentionBackendError` naming the backend, the layer and its reason.
    Else each layer takes ``preferred`` (the platform's default) when it supports the layer,
    then the supporting backend of highest ``priority`` (ties by name) not in ``excluded``.
    ``what``: how the caller spells the option, for messages.
    """
    import torch

    device = torch.device(device)
    made: dict[str, AttentionBackend] = {}

    def instance(name: str) -> AttentionBackend:
        if name not in made:
            made[name] = classes[name]()
        return made[name]

    def verdict(name: str, spec: Any) -> bool | str:
        answer = classes[name].supports(spec, device, dtype)
        if answer is True:
            return True
        return answer if isinstance(answer, str) and answer else f"its supports() answered {answer!r}"

    if requested is not None:
        if requested not in classes:
            raise AttentionBackendError(
                f"{what}={requested!r} is not an attention backend here; known: {', '.join(sorted(classes))} "
                "(a plugin adds more with rtpcore_register_attention_backends)",
                backend=requested,
            )
        out = []
        for i, spec in enumerate(specs):
            answer = verdict(requested, spec)
            if answer is not True:
                raise AttentionBackendError(
                    f"attention backend {requested!r} ({what}) cannot serve layer {i} ({spec.kind}, {spec.dtype} "
                    f"KV cache on {device}): {answer}", backend=requested, layer=i, reason=str(answer),
                )
            out.append(instance(requested))
        return out
    order = sorted((n for n in classes if n not in excluded), key=lambda n: (-classes[n].priority, n))
    if preferred is not None and preferred in classes:
        order = [preferred, *(n for n in order if n != preferred)]
    out = []
    for i, spec in enumerate(specs):
        reasons = []
        for name in order:
            answer = verdict(name, spec)
            if answer is True:
                out.append(instance(name))
                break
            reasons.append(f"{name}: {answer}")
        else:
            raise AttentionBackendError(
                f"no attention backend serves layer {i} ({spec.kind}, {spec.dtype} KV cache on {device}): "
                + "; ".join(reasons), layer=i, reason="; ".join(reasons),
            )
    return out

"""``atom_mla``: atom-plugin's multi-head latent attention as an rtpcore attention backend
(``rtpcore.attention``, the ``attention_backends`` seam).

The model (:mod:`atom_plugin.mla`) computes its queries and latents, writes them into its
layer's cache and calls ``rtpcore.layers.paged_mla``; the engine attached this backend to
every MLA layer's cache (its ``priority`` is above the reference's), so the call lands here.
It serves MLA caches of every dtype and layout rtpcore or this plugin defines (bf16/fp32 pools,
fp8 with FlashMLA's, aiter's or atom's ``ue8m0`` byte layout: the pool decodes its own layout
on read), on any device.

* Prefill (a sequence with more than one new token) uses the expanded form: ``kv_b_proj``'s
  halves turn every cached latent into per-head keys and values.
* Decode (one new token per sequence) stays in the latent space: ``W_UK`` is absorbed into the
  query and ``W_UV`` into the output, so the step reads ``kv_lora_rank + rope`` values per
  cached token instead of ``H * (nope + rope + v)``. A step whose every sequence decodes over an
  unquantized cache on a GPU reads the cache in place (``rtpcore.layers.paged_mla_decode``);
  elsewhere the decodes' contexts are gathered together up to the longest.

The kernels live in :mod:`atom_plugin.mla_kernels`, imported at the first call: registering
the backend (``rtpcore plugins list``) imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rtpcore.attention import AttentionBackend

if TYPE_CHECKING:
    import torch

__all__ = ["AtomMLABackend"]


class AtomMLABackend(AttentionBackend):
    name = "atom_mla"
    priority = 20  # above rtpcore's reference (0) and native_cpu (10, which serves no MLA cache)

    @classmethod
    def supports(cls, kv_spec: Any, device: torch.device, dtype: torch.dtype) -> bool | str:
        if kv_spec.kind != "mla":
            return f"it serves latent (MLA) caches, and this layer's is {kv_spec.kind!r}"
        return True

    def mla(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        cache: Any,
        batch: Any,
        *,
        w_uk: torch.Tensor,
        w_uv_t: torch.Tensor,
        scale: float,
        masks: dict[Any, Any] | None = None,
    ) -> torch.Tensor:
        from atom_plugin import mla_kernels  # torch: at the first call, not when the hook registers

        return mla_kernels.mla(q_nope, q_pe, cache, batch, w_uk=w_uk, w_uv_t=w_uv_t, scale=scale, masks=masks)

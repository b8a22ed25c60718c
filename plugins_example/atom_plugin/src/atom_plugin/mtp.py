"""DeepSeek-V3's multi-token-prediction (MTP) layer as a speculative draft.

A DeepSeek-V3 checkpoint with ``num_nextn_predict_layers: 1`` stores one more layer
after the decoder, ``model.layers.{num_hidden_layers}``: ``enorm``, ``hnorm``,
``eh_proj``, ``shared_head.norm`` / ``shared_head.head`` and an ordinary decoder block
(MLA attention and, past ``first_k_dense_replace``, an MoE). From the target's final
hidden state ``h_p`` at position p and the token ``x_{p+1}`` it predicts ``x_{p+2}``::

    x = eh_proj(concat(enorm(embed(x_{p+1})), hnorm(h_p)))     # normed embedding first
    x = block(x)                                               # own MLA cache, position p
    logits = shared_head.head(shared_head.norm(x))

rtpcore serves it through ``draft_model="mtp"``: :meth:`DeepseekV3Plugin.mtp_draft`
returns :class:`DeepseekMTPPlugin`, which reads only the MTP layer's tensors (the
embedding is the target's). Further proposals apply the same layer again to its own
output hidden state (``batch.hidden_source == "self"``); with several MTP layers only the
first is used.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from atom_plugin import tables
from atom_plugin.config import DeepseekConfig
from atom_plugin.layers import RMSNorm, linear_factory
from atom_plugin.model import DecoderLayer, DeepseekModel
from rtpcore import ModelPlugin

__all__ = ["DeepseekMTP", "DeepseekMTPPlugin"]

_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight")


def _block_config(config: DeepseekConfig) -> DeepseekConfig:
    """The target's config with the MTP layer counted as one more decoder layer."""
    return attrs.evolve(config, num_hidden_layers=config.num_hidden_layers + 1)


class DeepseekMTPPlugin(ModelPlugin):
    """The MTP layer of a DeepSeek-V3 checkpoint (never registered: reached through
    ``DeepseekV3Plugin.mtp_draft``)."""

    forward_contract = 2  # rtpcore.batch (the same as the target model)

    model_type: ClassVar[str] = "deepseek_v3_mtp"
    architectures: ClassVar[tuple[str, ...]] = ("DeepseekV3ForCausalLM",)

    @classmethod
    def config_from_hf(cls, hf_config: Mapping[str, Any]) -> DeepseekConfig:
        return DeepseekConfig.from_hf(hf_config, variant="deepseek_v3")

    @classmethod
    def weight_patterns(cls, config: DeepseekConfig) -> list[str]:
        return list(cls.weight_shapes(config))

    @classmethod
    def weight_shapes(cls, config: DeepseekConfig) -> dict[str, tuple[int, ...]]:
        n, d = config.num_hidden_layers, config.hidden_size
        layer = f"model.layers.{n}"
        shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in tables.weight_shapes(_block_config(config)).items():
            name = name.replace("{layer}", str(n))
            if name.startswith(layer + "."):
                shapes[name] = shape
        shapes.update({
            f"{layer}.enorm.weight": (d,),
            f"{layer}.hnorm.weight": (d,),
            f"{layer}.eh_proj.weight": (d, 2 * d),
            f"{layer}.shared_head.norm.weight": (d,),
            f"{layer}.shared_head.head.weight": (config.vocab_size, d),
        })
        return shapes

    @classmethod
    def placeholder_ranges(cls, config: DeepseekConfig) -> dict[str, range]:
        return {"expert": range(config.n_routed_experts)}

    @classmethod
    def weight_dtypes(cls, config: DeepseekConfig) -> dict[str, str]:
        n = config.num_hidden_layers
        dtypes = tables.weight_dtypes(_block_config(config))
        return {k: v for k, v in dtypes.items() if k.startswith(f"model.layers.{n}.")}

    @classmethod
    def kv_cache_descs(cls, config: DeepseekConfig, **options: Any) -> list[Any]:
        """One MLA layer, in the target's format (dtype and fp8 layout)."""
        return list(tables.kv_cache_descs(_block_config(config), **options))[-1:]

    @classmethod
    def tensor_parallel_shard(
        cls, config: DeepseekConfig, rank: int, world_size: int
    ) -> tuple[DeepseekConfig, dict[str, tuple[int, int, int]]]:
        """The decoder block is split as the target's layers are; the MTP projections and
        its head are replicated."""
        from atom_plugin.tensor_parallel import shard_config

        local, slices = shard_config(config, rank, world_size)
        return local, {k: v for k, v in slices.items() if "{layer}" in k or "{expert}" in k}

    @classmethod
    def build_model(
        cls,
        config: DeepseekConfig,
        weights: Mapping[str, Any],
        *,
        target: Any = None,
        dtype: Any = None,
        device: Any = "cpu",
        parallel: Any = None,
        **options: Any,
    ) -> Any:
        if not isinstance(target, DeepseekModel):
            raise TypeError(f"the MTP draft needs the DeepSeek target model (target=), got {type(target).__name__}")
        return DeepseekMTP(config, weights, target, dtype=dtype or torch.float32, device=device, parallel=parallel).eval()


class DeepseekMTP(nn.Module):
    """The MTP layer over its own one-layer KV cache, reading ``target``'s hidden states."""

    def __init__(
        self,
        cfg: DeepseekConfig,
        weights: Mapping[str, torch.Tensor],
        target: DeepseekModel,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        parallel: Any = None,
    ):
        super().__init__()
        if parallel is not None and parallel.world_size == 1:
            parallel = None
        n = cfg.num_hidden_layers
        p = f"model.layers.{n}"
        target.keep_hidden = True
        self._target = [target]  # not a submodule: its weights are the target's, not the draft's
        norm = lambda name: RMSNorm(weights[f"{p}.{name}"].to(device=device, dtype=dtype), cfg.rms_norm_eps)  # noqa: E731
        self.enorm, self.hnorm, self.head_norm = norm("enorm.weight"), norm("hnorm.weight"), norm("shared_head.norm.weight")
        make = linear_factory(dtype, device)
        self.eh_proj = make(weights[f"{p}.eh_proj.weight"])  # 2D -> D
        self.head = make(weights[f"{p}.shared_head.head.weight"])  # D -> V
        self.block = DecoderLayer(_block_config(cfg), weights, n, dtype, device, parallel)
        self.hidden: torch.Tensor | None = None  # (T, D) this layer's last output, before the head's norm

    def forward(self, batch: Any, kv_caches: Sequence[Any]) -> torch.Tensor:
        target = self._target[0]
        source = target.hidden if batch.hidden_source == "target" else self.hidden
        if source is None or batch.hidden_rows is None:
            raise ValueError("the MTP draft needs hidden states: batch.hidden_rows of a previous forward")
        h = source[batch.hidden_rows]  # (T, D): the hidden state before each new token
        e = F.embedding(batch.input_ids, target.embed)  # (T, D)
        x = self.eh_proj(torch.cat((self.enorm(e), self.hnorm(h)), dim=-1))  # (T, D)
        x = self.block(x, target.step_tensors(batch, kv_caches), batch, kv_caches[0])
        self.hidden = x
        rows = batch.logits_index
        last = x if rows is None else x[rows]
        return self.head(self.head_norm(last)).float()  # (B, V)

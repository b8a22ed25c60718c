"""The built-in Llama family: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``.

Grouped-query attention, RoPE (default and ``llama3`` scaling), RMSNorm,
SwiGLU, tied or untied embeddings, optional q/k/v (and o) biases, and
Mistral/Qwen2 sliding windows. The q/k/v and gate/up projections are fused
into one matrix each when the model is built (``rtpcore.models._llama_modules``
holds the torch code; this module imports no torch at import time).

Subclass :class:`LlamaPlugin` with another ``model_type``/``architectures`` to
serve a Llama-shaped architecture under a new name; nothing else changes.
Shapes: T flat tokens, B sequences, Tq new tokens per sequence (padded),
L cached positions, H query heads, Hkv KV heads, D head_dim, E hidden.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from rtpcore import config_fields as cf
from rtpcore.errors import ConfigFieldError
from rtpcore.plugin import ModelPlugin

__all__ = ["LlamaConfig", "LlamaPlugin"]

_LAYER_TYPES = ("full_attention", "sliding_attention")


@attrs.frozen
class LlamaConfig:
    """What the Llama-family forward needs, read from ``config.json`` by :meth:`from_hf`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...]  # sorted items of the HF rope dict, minus theta
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_windows: tuple[int | None, ...]  # one per layer; None = full attention
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> LlamaConfig:
        """Read and validate ``config.json``: a bad field is a ``ConfigFieldError`` naming it."""
        act = cf.optional_str(hf, "hidden_act", "silu")
        if act != "silu":
            raise ConfigFieldError(
                f"config.json hidden_act {act!r} is not supported by the Llama family; supported: 'silu'",
                field="hidden_act",
                value=act,
            )
        layers = cf.require_int(hf, "num_hidden_layers")
        hidden = cf.require_int(hf, "hidden_size")
        heads = cf.require_int(hf, "num_attention_heads")
        kv_heads = cf.optional_int(hf, "num_key_value_heads", heads, null_ok=True)
        cf.check_divisible("num_attention_heads", heads, "num_key_value_heads", kv_heads)
        head_dim = cf.optional_int(hf, "head_dim", None, null_ok=True)
        if head_dim is None:  # derived, as transformers does
            cf.check_divisible("hidden_size", hidden, "num_attention_heads", heads)
            head_dim = hidden // heads
        if head_dim % 2:
            raise cf.config_error("head_dim", head_dim, "must be even (rotary embeddings rotate pairs)")
        theta, rope = _rope(hf)
        archs = cf.optional_str_list(hf, "architectures") or ()
        is_qwen2 = hf.get("model_type") == "qwen2" or "Qwen2ForCausalLM" in archs
        bias = cf.optional_bool(hf, "attention_bias", False)
        return cls(
            vocab_size=cf.require_int(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=cf.require_int(hf, "intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=cf.optional_float(hf, "rms_norm_eps", 1e-6, positive=True),
            max_position_embeddings=cf.optional_int(hf, "max_position_embeddings", 2048),
            rope_theta=theta,
            rope_scaling=tuple(sorted(rope.items())),
            tie_word_embeddings=cf.optional_bool(hf, "tie_word_embeddings", False),
            qkv_bias=bias or is_qwen2,
            o_bias=bias and not is_qwen2,
            mlp_bias=cf.optional_bool(hf, "mlp_bias", False),
            sliding_windows=_sliding_windows(hf, layers),
            eos_token_ids=cf.token_ids(hf, "eos_token_id"),
        )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def _rope(hf: Mapping[str, Any]) -> tuple[float, dict[str, Any]]:
    """``rope_theta`` and the rope dict (``rope_parameters``, or ``rope_scaling``) minus theta,
    with ``rope_type`` set and the ``llama3`` fields validated."""
    key = "rope_scaling" if hf.get("rope_parameters") in (None, {}) else "rope_parameters"
    rope = dict(cf.optional_mapping(hf, key))
    theta = cf.optional_float(rope, "rope_theta", None, positive=True, section=key)
    rope.pop("rope_theta", None)
    if theta is None:
        theta = cf.optional_float(hf, "rope_theta", 10000.0, positive=True)
    legacy = cf.optional_str(rope, "type", "default", section=key)
    rope_type = cf.optional_str(rope, "rope_type", legacy, section=key)
    if rope_type not in ("default", "llama3"):
        raise ConfigFieldError(
            f"config.json rope type {rope_type!r} is not supported by the Llama family; "
            "supported: 'default', 'llama3'",
            field=f"{key}.rope_type",
            value=rope_type,
        )
    rope["rope_type"] = rope_type
    rope.pop("type", None)
    if rope_type == "llama3":
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            rope[name] = cf.require_float(rope, name, positive=True, section=key)
        if rope["high_freq_factor"] <= rope["low_freq_factor"]:
            rule = f"must be greater than low_freq_factor={rope['low_freq_factor']!r}"
            raise cf.config_error("high_freq_factor", rope["high_freq_factor"], rule, section=key)
        rope["original_max_position_embeddings"] = cf.require_int(
            rope, "original_max_position_embeddings", section=key
        )
    return theta, rope


def _sliding_windows(hf: Mapping[str, Any], layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding window, following Mistral (all layers) and Qwen2 (``layer_types``)."""
    window = cf.optional_int(hf, "sliding_window", None, null_ok=True)
    if window is None:
        return (None,) * layers
    types = cf.optional_str_list(hf, "layer_types", length=layers, choices=_LAYER_TYPES)
    if types is not None:
        return tuple(window if t == "sliding_attention" else None for t in types)
    if "use_sliding_window" in hf:  # Qwen2 without layer_types
        first = layers
        if cf.optional_bool(hf, "use_sliding_window", False):
            first = cf.optional_int(hf, "max_window_layers", layers, minimum=0)
        return tuple(window if i >= first else None for i in range(layers))
    return (window,) * layers  # Mistral


class LlamaPlugin(ModelPlugin):
    """The built-in Llama-family model (registered by ``rtpcore.models``)."""

    model_type = "llama"
    architectures = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

    @classmethod
    def config_from_hf(cls, hf_config: Mapping[str, Any]) -> LlamaConfig:
        return LlamaConfig.from_hf(hf_config)

    @classmethod
    def weight_patterns(cls, config: LlamaConfig) -> list[str]:
        return list(cls.weight_shapes(config))

    @classmethod
    def weight_shapes(cls, config: LlamaConfig) -> dict[str, tuple[int, ...]]:
        e, i, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
        a, m = "model.layers.{layer}.self_attn.", "model.layers.{layer}.mlp."
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (config.vocab_size, e),
            "model.norm.weight": (e,),
            "model.layers.{layer}.input_layernorm.weight": (e,),
            "model.layers.{layer}.post_attention_layernorm.weight": (e,),
            a + "q_proj.weight": (q, e),
            a + "k_proj.weight": (kv, e),
            a + "v_proj.weight": (kv, e),
            a + "o_proj.weight": (e, q),
            m + "gate_proj.weight": (i, e),
            m + "up_proj.weight": (i, e),
            m + "down_proj.weight": (e, i),
        }
        if not config.tie_word_embeddings:
            shapes["lm_head.weight"] = (config.vocab_size, e)
        if config.qkv_bias:
            shapes.update({a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)})
        if config.o_bias:
            shapes[a + "o_proj.bias"] = (e,)
        if config.mlp_bias:
            shapes.update({m + "gate_proj.bias": (i,), m + "up_proj.bias": (i,), m + "down_proj.bias": (e,)})
        return shapes

    @classmethod
    def kv_cache_descs(
        cls,
        config: LlamaConfig,
        *,
        kv_cache_dtype: str = "fp32",
        kv_layout: str | None = None,
        tokens_per_block: int = 16,
        **options: Any,
    ) -> list[Any]:
        """One MHA descriptor per layer. ``kv_layout`` names MLA layouts; MHA has a single fp8 format."""
        from rtpcore_native import KVCacheSpecDesc

        return [
            KVCacheSpecDesc(
                tag=f"layers.{i}",
                kind="mha",
                dtype=kv_cache_dtype,
                num_kv_heads=config.num_key_value_heads,
                head_dim=config.head_dim,
                tokens_per_block=tokens_per_block,
            )
            for i in range(config.num_hidden_layers)
        ]

    @classmethod
    def build_model(cls, config: LlamaConfig, weights: Mapping[str, Any], **options: Any) -> Any:
        from rtpcore.models._llama_modules import LlamaModel

        return LlamaModel(
            config,
            weights,
            dtype=options.get("dtype"),
            device=options.get("device"),
            parallel=options.get("parallel"),
        )

    @classmethod
    def tensor_parallel_shard(
        cls, config: LlamaConfig, rank: int, world_size: int
    ) -> tuple[LlamaConfig, dict[str, tuple[int, int, int]]]:
        """Rank's part of the model: whole query heads with their KV heads (replicated
        when there are fewer KV heads than ranks), q/k/v and gate/up column-parallel,
        o and down row-parallel; an untied lm_head split by vocabulary when it divides.
        Returns the rank's config and the checkpoint slices (pattern -> (dim, start, stop)).
        """
        from rtpcore.sharding import column_shard, head_shard, kv_head_shard, row_shard

        d, heads, inter = config.head_dim, config.num_attention_heads, config.intermediate_size
        q = head_shard(heads, d, rank, world_size)
        kv = kv_head_shard(config.num_key_value_heads, d, rank, world_size)
        up = column_shard(inter, rank, world_size, name="intermediate_size")
        a, m = "model.layers.{layer}.self_attn.", "model.layers.{layer}.mlp."
        columns = {a + "q_proj": q, a + "k_proj": kv, a + "v_proj": kv, m + "gate_proj": up, m + "up_proj": up}
        slices = {f"{name}.{p}": s.as_slice() for name, s in columns.items() for p in ("weight", "bias")}
        slices[a + "o_proj.weight"] = head_shard(heads, d, rank, world_size, dim=1).as_slice()
        slices[m + "down_proj.weight"] = row_shard(inter, rank, world_size, name="intermediate_size").as_slice()
        if not config.tie_word_embeddings and config.vocab_size % world_size == 0:
            slices["lm_head.weight"] = column_shard(config.vocab_size, rank, world_size).as_slice()
        local = attrs.evolve(
            config, num_attention_heads=q.size // d, num_key_value_heads=kv.size // d, intermediate_size=up.size
        )
        return local, slices

    @classmethod
    def demo_config(cls) -> dict[str, Any]:
        """A 2-layer GQA model over a 256-byte vocabulary plus <bos>=256, <eos>=257."""
        return {
            "architectures": [cls.architectures[0]],
            "model_type": cls.model_type,
            "vocab_size": 320,
            "hidden_size": 64,
            "intermediate_size": 160,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 1024,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "bos_token_id": 256,
            "eos_token_id": 257,
            "torch_dtype": "float32",
        }


def rope_inv_freq(config: LlamaConfig) -> Any:
    """(D/2,) float32 inverse frequencies, with the ``llama3`` scaling when configured."""
    import torch

    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rope = dict(config.rope_scaling)
    if rope.get("rope_type") != "llama3":
        return inv
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old = float(rope["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)

"""The Llama family's configuration: config.json -> :class:`LlamaConfig`, checked field by field.

No torch at import time (``rope_inv_freq`` imports it when called).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from rtpcore import config_fields as cf
from rtpcore.errors import ConfigFieldError

__all__ = ["LlamaConfig", "rope_inv_freq"]

_LAYER_TYPES = ("full_attention", "sliding_attention")
_QWEN = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}  # model_type -> architecture


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
    qk_norm: bool = False  # Qwen3: RMSNorm over each query and key head (weights (D,)) before RoPE

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
        qwen = _qwen_version(hf)
        is_qwen2 = qwen == "qwen2"  # q/k/v biases always, no o bias; Qwen3: all four per attention_bias
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
            sliding_windows=_sliding_windows(hf, layers, qwen is not None),
            eos_token_ids=cf.token_ids(hf, "eos_token_id"),
            qk_norm=qwen == "qwen3",
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


def _qwen_version(hf: Mapping[str, Any]) -> str | None:
    """"qwen2" or "qwen3" for those models (by ``model_type``, else ``architectures``), else None."""
    model_type = cf.optional_str(hf, "model_type", None)
    if model_type in _QWEN:
        return model_type
    archs = cf.optional_str_list(hf, "architectures") or ()
    return next((name for name, arch in _QWEN.items() if arch in archs), None)


def _sliding_windows(hf: Mapping[str, Any], layers: int, qwen: bool = False) -> tuple[int | None, ...]:
    """Per-layer sliding window, following Mistral (all layers) and Qwen2/Qwen3 (only with
    ``use_sliding_window``, as transformers reads them: the layers ``layer_types`` names, else
    those from ``max_window_layers`` on)."""
    window = cf.optional_int(hf, "sliding_window", None, null_ok=True)
    if qwen and not cf.optional_bool(hf, "use_sliding_window", False):
        window = None
    if window is None:
        return (None,) * layers
    types = cf.optional_str_list(hf, "layer_types", length=layers, choices=_LAYER_TYPES)
    if types is not None:
        return tuple(window if t == "sliding_attention" else None for t in types)
    if "use_sliding_window" in hf:  # Qwen2/Qwen3 without layer_types
        first = layers
        if cf.optional_bool(hf, "use_sliding_window", False):
            first = cf.optional_int(hf, "max_window_layers", layers, minimum=0)
        return tuple(window if i >= first else None for i in range(layers))
    return (window,) * layers  # Mistral


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

"""GPT-NeoX's config.json, read field by field: plain data, no torch."""

import dataclasses
from collections.abc import Mapping
from typing import Any

from rtpcore import config_fields as cf


@dataclasses.dataclass(frozen=True)
class NeoXConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    rotary_dim: int  # the leading dims of each head that rotate; the rest pass through
    rope_theta: float
    layer_norm_eps: float
    use_parallel_residual: bool
    attention_bias: bool
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "NeoXConfig":
        act = cf.optional_str(hf, "hidden_act", "gelu")
        if act != "gelu":
            raise cf.config_error("hidden_act", act, "is not supported; supported: 'gelu'")
        hidden = cf.require_int(hf, "hidden_size")
        heads = cf.require_int(hf, "num_attention_heads")
        cf.check_divisible("hidden_size", hidden, "num_attention_heads", heads)
        head_dim = hidden // heads
        # transformers >= 5 writes rope_parameters; older checkpoints (Pythia) rotary_pct and
        # rotary_emb_base. Keys in rope_parameters win, as in transformers.
        key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
        rope = cf.optional_mapping(hf, key)
        rope_type = cf.optional_str(rope, "rope_type", rope.get("type", "default"), section=key)
        if rope_type != "default":
            raise cf.config_error("rope_type", rope_type, "is not supported; supported: 'default'", section=key)
        theta = cf.optional_float(rope, "rope_theta", None, positive=True, section=key)
        if theta is None:
            theta = cf.optional_float(hf, "rotary_emb_base", 10000.0, positive=True)
        pct = cf.optional_float(rope, "partial_rotary_factor", None, positive=True, section=key)
        pct_field, section = ("partial_rotary_factor", key) if pct is not None else ("rotary_pct", None)
        if pct is None:
            pct = cf.optional_float(hf, "rotary_pct", 0.25, positive=True)
        rotary_dim = int(head_dim * pct)  # transformers' rounding
        if pct > 1 or rotary_dim < 2 or rotary_dim % 2:
            rule = f"must rotate an even number of dims in 2..{head_dim}, got {rotary_dim} (head_dim={head_dim})"
            raise cf.config_error(pct_field, pct, rule, section=section)
        return cls(
            vocab_size=cf.require_int(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=cf.require_int(hf, "intermediate_size"),
            num_hidden_layers=cf.require_int(hf, "num_hidden_layers"),
            num_attention_heads=heads,
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rope_theta=theta,
            layer_norm_eps=cf.optional_float(hf, "layer_norm_eps", 1e-5, positive=True),
            use_parallel_residual=cf.optional_bool(hf, "use_parallel_residual", True),
            attention_bias=cf.optional_bool(hf, "attention_bias", True),
            tie_word_embeddings=cf.optional_bool(hf, "tie_word_embeddings", False),
        )

"""``DeepseekConfig``: the parsed ``config.json`` of a DeepSeek-V2/V3 checkpoint.

Only plain data lives here (no torch), so the config can be built, compared
and pickled anywhere. Every option is read the way Hugging Face transformers
reads it in ``DeepseekV3ForCausalLM`` / ``DeepseekV2ForCausalLM``, through
``rtpcore.config_fields``: a null, a wrong type, a zero or negative count, a
broken routing rule, or an option we do not implement raises
``rtpcore.errors.ConfigFieldError`` (a ``CheckpointError`` and a ``ValueError``)
naming the key, its value and the supported values.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import attrs

from rtpcore import config_fields as cf
from rtpcore.errors import ConfigFieldError

__all__ = ["DeepseekConfig", "RopeConfig"]

_ROPE_TYPES = ("default", "yarn")
_V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@attrs.frozen
class RopeConfig:
    """Rotary embedding of the decoupled rope part (``qk_rope_head_dim`` dims).

    ``rope_type`` is ``"default"`` or ``"yarn"``; the yarn fields follow
    ``transformers.modeling_rope_utils._compute_yarn_parameters``.
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor_override: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> RopeConfig:
        """Read ``rope_parameters`` (transformers >= 5) or ``rope_scaling`` + ``rope_theta``."""
        key = "rope_scaling" if hf.get("rope_parameters") in (None, {}) else "rope_parameters"
        params = cf.optional_mapping(hf, key)
        legacy = cf.optional_str(params, "type", "default", section=key)
        rope_type = cf.optional_str(params, "rope_type", legacy, section=key)
        if rope_type not in _ROPE_TYPES:
            raise ConfigFieldError(
                f"config.json rope_type {rope_type!r} is not supported by atom-plugin; "
                f"supported: {', '.join(map(repr, _ROPE_TYPES))}",
                field=f"{key}.rope_type",
                value=rope_type,
            )
        theta = cf.optional_float(params, "rope_theta", None, positive=True, section=key)
        if theta is None:
            theta = cf.optional_float(hf, "rope_theta", 10000.0, positive=True)
        if rope_type == "default":
            return cls(theta=theta)
        max_pos = cf.optional_int(hf, "max_position_embeddings", 4096)
        orig = cf.optional_int(params, "original_max_position_embeddings", max_pos, section=key)
        factor = cf.optional_float(params, "factor", max_pos / orig, positive=True, null_ok=True, section=key)

        def scale(name: str, default: float | None, minimum: float | None = None) -> float | None:
            positive = minimum is None
            return cf.optional_float(
                params, name, default, minimum=minimum, positive=positive, null_ok=True, section=key
            )

        return cls(
            rope_type=rope_type,
            theta=theta,
            factor=factor,
            original_max_position_embeddings=orig,
            beta_fast=scale("beta_fast", 32.0) or 32.0,
            beta_slow=scale("beta_slow", 1.0) or 1.0,
            mscale=scale("mscale", None, minimum=0.0),
            mscale_all_dim=scale("mscale_all_dim", None, minimum=0.0),
            attention_factor_override=scale("attention_factor", None),
            truncate=cf.optional_bool(params, "truncate", True, section=key),
        )

    @property
    def attention_factor(self) -> float:
        """Multiplier applied to cos and sin (yarn's "attention factor")."""
        if self.rope_type == "default":
            return 1.0
        if self.attention_factor_override is not None:
            return float(self.attention_factor_override)
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)
        return _yarn_mscale(self.factor)

    def softmax_scale_multiplier(self) -> float:
        """DeepSeek multiplies the softmax scale by mscale(factor, mscale_all_dim) squared."""
        if self.rope_type == "default" or not self.mscale_all_dim:
            return 1.0
        m = _yarn_mscale(self.factor, float(self.mscale_all_dim))
        return m * m


@attrs.frozen
class DeepseekConfig:
    """Everything the model needs, validated. ``variant`` is ``"deepseek_v3"`` or ``"deepseek_v2"``.

    V3 routes with sigmoid scores plus ``e_score_correction_bias`` and grouped
    top-k (top-2 sum per group); V2 routes with softmax scores, ``greedy`` or
    ``group_limited_greedy`` (group max). As in transformers, V2 ignores
    ``norm_topk_prob`` and V3 ignores ``scoring_func`` / ``topk_method``.
    """

    variant: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    topk_method: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    rms_norm_eps: float
    rope: RopeConfig
    rope_interleave: bool
    attention_bias: bool
    tie_word_embeddings: bool
    # DeepSeek-V3's multi-token-prediction layers, stored after the decoder layers
    # (layer num_hidden_layers onwards); served as a draft by atom_plugin.mtp.
    num_nextn_predict_layers: int = 0

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], *, variant: str) -> DeepseekConfig:
        """Build from a parsed ``config.json``; raises ``ConfigFieldError`` naming a bad key."""
        req = functools.partial(cf.require_int, hf)
        heads = req("num_attention_heads")
        kv_heads = cf.optional_int(hf, "num_key_value_heads", heads, null_ok=True)
        if kv_heads != heads:
            raise cf.config_error(
                "num_key_value_heads",
                kv_heads,
                f"must equal num_attention_heads={heads} (MLA expands the latent into every head)",
            )
        act = cf.optional_str(hf, "hidden_act", "silu")
        if act != "silu":
            raise ConfigFieldError(
                f"config.json hidden_act {act!r} is not supported; atom-plugin supports 'silu'",
                field="hidden_act",
                value=act,
            )
        if cf.optional_bool(hf, "mlp_bias", False):
            raise cf.config_error("mlp_bias", True, "is not supported by atom-plugin")
        freq = cf.optional_int(hf, "moe_layer_freq", 1)
        if freq != 1:
            rule = "is not supported: atom-plugin puts an MoE block in every layer from first_k_dense_replace on; supported: 1"
            raise cf.config_error("moe_layer_freq", freq, rule)
        if variant == "deepseek_v3":
            topk_method = "noaux_tc"
            n_group, topk_group = req("n_group"), req("topk_group")
            interleave = cf.optional_bool(hf, "rope_interleave", True)
        else:
            topk_method = cf.optional_str(hf, "topk_method", "greedy", null_ok=True)
            if topk_method not in _V2_TOPK_METHODS:
                raise ConfigFieldError(
                    f"config.json topk_method {topk_method!r} is not supported for DeepseekV2ForCausalLM; "
                    f"supported: {', '.join(map(repr, _V2_TOPK_METHODS))}",
                    field="topk_method",
                    value=topk_method,
                )
            grouped = topk_method == "group_limited_greedy"
            n_group = req("n_group") if grouped else 1
            topk_group = req("topk_group") if grouped else 1
            interleave = True  # V2 rotates (even, odd) pairs as complex numbers
        cfg = cls(
            variant=variant,
            vocab_size=req("vocab_size"),
            hidden_size=req("hidden_size"),
            intermediate_size=req("intermediate_size"),
            moe_intermediate_size=req("moe_intermediate_size"),
            num_hidden_layers=req("num_hidden_layers"),
            num_attention_heads=heads,
            q_lora_rank=cf.optional_int(hf, "q_lora_rank", None, null_ok=True),
            kv_lora_rank=req("kv_lora_rank"),
            qk_nope_head_dim=req("qk_nope_head_dim"),
            qk_rope_head_dim=req("qk_rope_head_dim"),
            v_head_dim=req("v_head_dim"),
            n_routed_experts=req("n_routed_experts"),
            n_shared_experts=cf.optional_int(hf, "n_shared_experts", 0, minimum=0, null_ok=True),
            num_experts_per_tok=req("num_experts_per_tok"),
            n_group=n_group,
            topk_group=topk_group,
            topk_method=topk_method,
            norm_topk_prob=cf.optional_bool(hf, "norm_topk_prob", variant == "deepseek_v3"),
            routed_scaling_factor=cf.optional_float(hf, "routed_scaling_factor", 1.0, positive=True),
            first_k_dense_replace=cf.optional_int(hf, "first_k_dense_replace", 0, minimum=0, null_ok=True),
            rms_norm_eps=cf.optional_float(hf, "rms_norm_eps", 1e-6, positive=True),
            rope=RopeConfig.from_hf(hf),
            rope_interleave=interleave,
            attention_bias=cf.optional_bool(hf, "attention_bias", False),
            tie_word_embeddings=cf.optional_bool(hf, "tie_word_embeddings", False),
            num_nextn_predict_layers=cf.optional_int(hf, "num_nextn_predict_layers", 0, minimum=0, null_ok=True),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raise ``ConfigFieldError`` for combinations the routing or rope cannot serve."""
        if self.qk_rope_head_dim % 2:
            raise cf.config_error("qk_rope_head_dim", self.qk_rope_head_dim, "must be even")
        cf.check_divisible("n_routed_experts", self.n_routed_experts, "n_group", self.n_group)
        if not 1 <= self.topk_group <= self.n_group:
            raise cf.config_error("topk_group", self.topk_group, f"must be in 1..n_group={self.n_group}")
        per_group = self.n_routed_experts // self.n_group
        if self.variant == "deepseek_v3" and per_group < 2:
            rule = (
                f"leaves {per_group} expert per group of n_routed_experts={self.n_routed_experts}: "
                "DeepSeek-V3 scores a group by its top-2 experts"
            )
            raise cf.config_error("n_group", self.n_group, rule)
        if not 1 <= self.num_experts_per_tok <= self.topk_group * per_group:
            rule = f"must be in 1..{self.topk_group * per_group} (topk_group * experts per group)"
            raise cf.config_error("num_experts_per_tok", self.num_experts_per_tok, rule)
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            rule = f"must be in 0..num_hidden_layers={self.num_hidden_layers}"
            raise cf.config_error("first_k_dense_replace", self.first_k_dense_replace, rule)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def dense_layers(self) -> range:
        return range(self.first_k_dense_replace)

    @property
    def moe_layers(self) -> range:
        return range(self.first_k_dense_replace, self.num_hidden_layers)

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5 * self.rope.softmax_scale_multiplier()

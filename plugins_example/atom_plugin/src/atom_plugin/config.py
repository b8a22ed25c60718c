"""``DeepseekConfig``: the parsed ``config.json`` of a DeepSeek-V2/V3 checkpoint.

Only plain data lives here (no torch), so the config can be built, compared
and pickled anywhere. Every option is read the way Hugging Face transformers
reads it in ``DeepseekV3ForCausalLM`` / ``DeepseekV2ForCausalLM``; options we do
not implement raise ``ValueError`` naming the key and the supported values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

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
        params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in _ROPE_TYPES:
            raise ValueError(
                f"config.json rope_type {rope_type!r} is not supported by atom-plugin; "
                f"supported: {', '.join(map(repr, _ROPE_TYPES))}"
            )
        theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
        if rope_type == "default":
            return cls(theta=theta)
        max_pos = int(hf.get("max_position_embeddings", 4096))
        orig = int(params.get("original_max_position_embeddings", max_pos))
        factor = params.get("factor")
        return cls(
            rope_type=rope_type,
            theta=theta,
            factor=float(factor) if factor is not None else max_pos / orig,
            original_max_position_embeddings=orig,
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor_override=params.get("attention_factor"),
            truncate=bool(params.get("truncate", True)),
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

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], *, variant: str) -> DeepseekConfig:
        """Build from a parsed ``config.json``; raises ``ValueError`` naming a bad key."""

        def req(key: str) -> Any:
            if hf.get(key) is None:
                raise ValueError(f"config.json has no {key!r}, which a {variant} model requires")
            return hf[key]

        heads = int(req("num_attention_heads"))
        kv_heads = hf.get("num_key_value_heads")
        if kv_heads is not None and int(kv_heads) != heads:
            raise ValueError(
                f"config.json num_key_value_heads={kv_heads!r} must equal num_attention_heads={heads} "
                "(MLA expands the latent into every head)"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json hidden_act {act!r} is not supported; atom-plugin supports 'silu'")
        if hf.get("mlp_bias"):
            raise ValueError("config.json mlp_bias=true is not supported by atom-plugin")
        n_experts = int(req("n_routed_experts"))
        if variant == "deepseek_v3":
            topk_method = "noaux_tc"
            n_group, topk_group = int(req("n_group")), int(req("topk_group"))
            interleave = bool(hf.get("rope_interleave", True))
        else:
            topk_method = str(hf.get("topk_method") or "greedy")
            if topk_method not in _V2_TOPK_METHODS:
                raise ValueError(
                    f"config.json topk_method {topk_method!r} is not supported for DeepseekV2ForCausalLM; "
                    f"supported: {', '.join(map(repr, _V2_TOPK_METHODS))}"
                )
            grouped = topk_method == "group_limited_greedy"
            n_group = int(req("n_group")) if grouped else 1
            topk_group = int(req("topk_group")) if grouped else 1
            interleave = True  # V2 rotates (even, odd) pairs as complex numbers
        q_lora = hf.get("q_lora_rank")
        cfg = cls(
            variant=variant,
            vocab_size=int(req("vocab_size")),
            hidden_size=int(req("hidden_size")),
            intermediate_size=int(req("intermediate_size")),
            moe_intermediate_size=int(req("moe_intermediate_size")),
            num_hidden_layers=int(req("num_hidden_layers")),
            num_attention_heads=heads,
            q_lora_rank=int(q_lora) if q_lora is not None else None,
            kv_lora_rank=int(req("kv_lora_rank")),
            qk_nope_head_dim=int(req("qk_nope_head_dim")),
            qk_rope_head_dim=int(req("qk_rope_head_dim")),
            v_head_dim=int(req("v_head_dim")),
            n_routed_experts=n_experts,
            n_shared_experts=int(hf.get("n_shared_experts") or 0),
            num_experts_per_tok=int(req("num_experts_per_tok")),
            n_group=n_group,
            topk_group=topk_group,
            topk_method=topk_method,
            norm_topk_prob=bool(hf.get("norm_topk_prob", variant == "deepseek_v3")),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=int(hf.get("first_k_dense_replace") or 0),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(hf),
            rope_interleave=interleave,
            attention_bias=bool(hf.get("attention_bias", False)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raise ``ValueError`` for combinations the routing or rope cannot serve."""
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        if self.n_routed_experts % self.n_group:
            raise ValueError(
                f"n_routed_experts={self.n_routed_experts} must be divisible by n_group={self.n_group}"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group={self.topk_group} must be in 1..n_group={self.n_group}")
        per_group = self.n_routed_experts // self.n_group
        if self.variant == "deepseek_v3" and per_group < 2:
            raise ValueError(
                f"n_routed_experts/n_group={per_group}: DeepSeek-V3 scores a group by its top-2 experts"
            )
        if not 1 <= self.num_experts_per_tok <= self.topk_group * per_group:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..{self.topk_group * per_group} "
                "(topk_group * experts per group)"
            )
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(
                f"first_k_dense_replace={self.first_k_dense_replace} must be in 0..num_hidden_layers"
            )

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

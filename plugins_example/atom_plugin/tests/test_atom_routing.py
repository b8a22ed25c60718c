"""The MoE router picks transformers' experts with transformers' weights (V3 sigmoid/grouped, V2 softmax)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from atom_harness import TINY

from atom_plugin.deepseek import DeepseekV2Plugin, DeepseekV3Plugin
from atom_plugin.layers import MoE


def moe_weights(cfg: Any, gate: torch.Tensor, bias: torch.Tensor) -> dict[str, torch.Tensor]:
    d, i = cfg.hidden_size, cfg.moe_intermediate_size
    w = {"m.gate.weight": gate, "m.gate.e_score_correction_bias": bias}
    for e in range(cfg.n_routed_experts):
        for name, shape in (("gate_proj", (i, d)), ("up_proj", (i, d)), ("down_proj", (d, i))):
            w[f"m.experts.{e}.{name}.weight"] = torch.randn(shape)
    for name, shape in (("gate_proj", (i, d)), ("up_proj", (i, d)), ("down_proj", (d, i))):
        w[f"m.shared_experts.{name}.weight"] = torch.randn(shape)
    return w


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("v3", {"n_routed_experts": 16, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4}),
        ("v3", {"norm_topk_prob": False, "routed_scaling_factor": 1.0}),
        ("v2", {"topk_method": "greedy", "n_group": None, "topk_group": None, "num_experts_per_tok": 3}),
        ("v2", {"topk_method": "group_limited_greedy", "n_routed_experts": 16, "n_group": 4, "topk_group": 2}),
    ],
)
def test_router_matches_transformers(arch: str, overrides: dict[str, Any]) -> None:
    """For 64 random tokens, the chosen expert set and each expert's weight equal transformers' router."""
    import transformers
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

    torch.manual_seed(0)
    hf_kwargs = {**TINY, **overrides}
    if arch == "v3":
        hf_cfg: Any = transformers.DeepseekV3Config(**hf_kwargs)
        router: Any = v3.DeepseekV3TopkRouter(hf_cfg)
        ours_cfg = DeepseekV3Plugin.config_from_hf(hf_cfg.to_dict())
    else:
        hf_cfg = transformers.DeepseekV2Config(**hf_kwargs)
        router = v2.DeepseekV2TopkRouter(hf_cfg)
        ours_cfg = DeepseekV2Plugin.config_from_hf(hf_cfg.to_dict())
    with torch.no_grad():
        router.weight.normal_()
        if arch == "v3":
            router.e_score_correction_bias.normal_(std=0.5)
    bias = getattr(router, "e_score_correction_bias", torch.zeros(ours_cfg.n_routed_experts))
    moe = MoE(ours_cfg, moe_weights(ours_cfg, router.weight.detach(), bias), "m", torch.float32, "cpu")
    x = torch.randn(64, ours_cfg.hidden_size)
    with torch.no_grad():
        _, hf_w, hf_idx = router(x)
        w, idx = moe.route(x)
    hf_order, order = hf_idx.argsort(-1), idx.argsort(-1)
    assert torch.equal(hf_idx.gather(1, hf_order), idx.gather(1, order))
    torch.testing.assert_close(w.gather(1, order), hf_w.gather(1, hf_order), rtol=1e-6, atol=1e-6)

"""fp8 MLA caches (built-in "padded" and "compact", this plugin's "ue8m0") stay close to a float32 cache.

Each run is teacher-forced on the float32 cache's greedy tokens, so every step
compares logits for the same context. The checkpoint uses a moderate weight
scale (0.05): with larger random weights the tiny MoE amplifies any perturbation
(bf16 weights alone then move logits to cosine ~0.9).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from atom_harness import YARN, PagedRunner, build_from_checkpoint

import rtpcore
from rtpcore.kv import kv_cache_specs

PROMPTS = [[5, 9, 33, 7, 2, 90, 17], [100, 3, 4]]
STEPS = 64

# layout: (bytes per token for kv_lora_rank 128 / rope 32, min mean cosine, min top-1 agreement)
BOUNDS = {"padded": (196, 0.999, 0.9), "compact": (160, 0.998, 0.9), "ue8m0": (193, 0.999, 0.9)}


@pytest.fixture(scope="module")
def fp8_ckpt(ckpt_factory: Callable[..., Path]) -> Path:
    return ckpt_factory("fp8", rope_parameters=dict(YARN), initializer_range=0.05)


@pytest.fixture(scope="module")
def registry() -> Any:
    plan = rtpcore.Allowlist.from_cli(plugins=["atom-plugin"], external_model_packages=[]).resolve()
    return rtpcore.load_plugins(plan)


@pytest.fixture(scope="module")
def fp32_run(fp8_ckpt: Path) -> tuple[Any, Any, list[list[int]], torch.Tensor]:
    """(config, model, greedy tokens, logits (STEPS, B, vocab)) with a float32 cache."""
    cfg, model, descs = build_from_checkpoint(fp8_ckpt)
    tokens, ref = PagedRunner(model, descs).run(PROMPTS, STEPS)
    return cfg, model, tokens, ref


def fp8_agreement(
    fp32_run: tuple[Any, Any, list[list[int]], torch.Tensor], layout: str, registry: Any
) -> tuple[int, float, float, float]:
    """(bytes per token, mean cosine, min cosine, top-1 agreement) of an fp8 cache against float32."""
    cfg, model, tokens, ref = fp32_run
    plugin = registry.get("deepseek_v3")
    specs = kv_cache_specs(plugin, cfg, kv_cache_dtype="fp8", kv_layout=layout, registry=registry)
    _, got = PagedRunner(model, specs, layouts=registry).run(PROMPTS, STEPS, forced=tokens)
    cos = torch.nn.functional.cosine_similarity(got.flatten(0, 1), ref.flatten(0, 1), dim=-1)
    top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean()
    return specs[0].bytes_per_token, float(cos.mean()), float(cos.min()), float(top1)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(BOUNDS))
def test_fp8_cache_logits_track_the_float32_cache(
    layout: str, fp32_run: tuple[Any, Any, list[list[int]], torch.Tensor], registry: Any
) -> None:
    """Over 64 decode steps the fp8 cache's logits keep a high cosine and the same top-1 token."""
    nbytes, mean_cos, min_cos, top1 = fp8_agreement(fp32_run, layout, registry)
    want_bytes, want_cos, want_top1 = BOUNDS[layout]
    assert nbytes == want_bytes
    assert mean_cos >= want_cos, (mean_cos, min_cos)
    assert min_cos >= 0.95
    assert top1 >= want_top1

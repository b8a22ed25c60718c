"""Greedy decoding through the paged cache matches transformers' DeepseekV3/V2ForCausalLM in float32."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from atom_harness import YARN, PagedRunner, build_from_checkpoint, hf_greedy, hf_logits

PROMPTS = [[5, 9, 33, 7, 2, 90, 17], [100, 3, 4], [64, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
N_NEW = 32

VARIANTS = {
    # checkpoint name: (arch, overrides); "v3_yarn" is the v3_ckpt fixture's checkpoint
    "v3_yarn": ("v3", {"rope_parameters": dict(YARN)}),
    "v3-no-qlora-rotate-half": ("v3", {"q_lora_rank": None, "rope_interleave": False}),
    "v2-group-limited-bias-yarn": (
        "v2",
        {
            "topk_method": "group_limited_greedy",
            "routed_scaling_factor": 1.5,
            "attention_bias": True,
            "rope_parameters": dict(YARN, mscale=0.9, mscale_all_dim=0.9),
        },
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_match_transformers_single_and_batched(
    variant: str, ckpt_factory: Callable[..., Path]
) -> None:
    """Each prompt alone and all prompts batched give transformers' greedy tokens (32 new tokens)."""
    arch, overrides = VARIANTS[variant]
    path = ckpt_factory(variant, arch, **overrides)
    _, model, descs = build_from_checkpoint(path)
    expected = hf_greedy(path, PROMPTS, N_NEW)
    batched, _ = PagedRunner(model, descs).run(PROMPTS, N_NEW)
    single = [PagedRunner(model, descs).run([p], N_NEW)[0][0] for p in PROMPTS]
    assert single == expected
    assert batched == expected
    assert len({t for seq in expected for t in seq}) > 8, "degenerate checkpoint: the test would be weak"


def test_prefill_and_absorbed_decode_logits_match_a_full_forward(v3_ckpt: Path) -> None:
    """Logits of every decode step (latent-space attention) equal transformers' full-sequence logits."""
    _, model, descs = build_from_checkpoint(v3_ckpt)
    prompt = PROMPTS[0]
    tokens, steps = PagedRunner(model, descs).run([prompt], 12)
    ref = hf_logits(v3_ckpt, prompt + tokens[0][:-1])[len(prompt) - 1 :]  # (12, vocab)
    torch.testing.assert_close(steps[:, 0], ref, rtol=1e-4, atol=1e-4)


def test_bfloat16_model_tracks_transformers_in_bfloat16(v3_ckpt: Path) -> None:
    """A bf16 model with a bf16 cache gives transformers' bf16 logits (cosine > 0.999 per step).

    (bf16 against float32 moves both implementations alike: MoE routing flips.)
    """
    _, m32, d32 = build_from_checkpoint(v3_ckpt)
    _, m16, d16 = build_from_checkpoint(v3_ckpt, dtype=torch.bfloat16, kv_cache_dtype="bf16")
    prompt = PROMPTS[0]
    tokens, _ = PagedRunner(m32, d32).run([prompt], 8)
    _, got = PagedRunner(m16, d16).run([prompt], 8, forced=tokens)
    ref = hf_logits(v3_ckpt, prompt + tokens[0][:-1], torch.bfloat16)[len(prompt) - 1 :]
    cos = torch.nn.functional.cosine_similarity(got[:, 0], ref, dim=-1)  # (8,)
    assert float(cos.min()) > 0.999


def test_chunked_prefill_in_a_ragged_batch_matches_a_full_forward(v3_ckpt: Path) -> None:
    """A prompt's second chunk (attending to cached first-chunk latents) batched with another
    sequence's whole prompt gives transformers' last-token logits for both."""
    from rtpcore.batch import ForwardBatch
    from rtpcore.kv import allocate_kv_caches

    _, model, descs = build_from_checkpoint(v3_ckpt, tokens_per_block=4)
    caches = allocate_kv_caches(descs, 16)
    long, short = PROMPTS[2], PROMPTS[1]  # 18 and 3 tokens
    tables = torch.tensor([[1, 2, 3, 4, 5], [9, 0, 0, 0, 0]])

    def slots(row: int, pos: range) -> list[int]:
        return [int(tables[row, p // 4]) * 4 + p % 4 for p in pos]

    with torch.inference_mode():
        first = ForwardBatch(
            input_ids=torch.tensor(long[:10]), positions=torch.arange(10), slots=torch.tensor(slots(0, range(10))),
            query_lens=(10,), context_lens=torch.tensor([10]), block_tables=tables[:1], tokens_per_block=4,
        )
        model(first, caches)
        mixed = ForwardBatch(
            input_ids=torch.tensor(long[10:] + short),
            positions=torch.tensor([*range(10, 18), *range(3)]),
            slots=torch.tensor(slots(0, range(10, 18)) + slots(1, range(3))),
            query_lens=(8, 3), context_lens=torch.tensor([18, 3]), block_tables=tables, tokens_per_block=4,
        )
        logits = model(mixed, caches)  # (2, vocab)
    torch.testing.assert_close(logits[0], hf_logits(v3_ckpt, long)[-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[1], hf_logits(v3_ckpt, short)[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_tables_grown_on_demand_equal_a_per_step_computation(dtype: torch.dtype) -> None:
    """RopeTables starting small and grown past their end (several times, not on a block
    boundary) give exactly rope_cos_sin's rows for every position."""
    from atom_plugin.layers import RopeTables, rope_cos_sin

    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    tables = RopeTables.__new__(RopeTables)
    tables.START, tables.BLOCK = 8, 3  # instance overrides: grow early and in odd blocks
    RopeTables.__init__(tables, inv_freq, 0.7, dtype)
    positions = torch.arange(0, 1000)
    for end in (5, 9, 40, 41, 1000):  # each call may need the tables to grow
        cos, sin = tables(positions[:end], end)
        ref_cos, ref_sin = rope_cos_sin(positions[:end], inv_freq, 0.7, dtype)
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin), end
    assert tables.cos.shape[0] >= 1000

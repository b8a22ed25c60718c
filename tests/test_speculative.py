"""Speculative decoding (docs/design.md §10) on tiny transformers checkpoints: greedy output
identical to decoding without a draft, rejection sampling keeping the target's
distribution, stop tokens and max_tokens inside accepted runs, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from rtpcore import Engine
from rtpcore.engine.sample.params import SamplingParams
from rtpcore.engine.sample.speculative import SpeculativeStats, verify
from rtpcore.errors import RtpcoreError, UnknownArchitectureError
from test_llama import make_checkpoint

PROMPTS = [[5, 9, 33], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [100], [7, 7], [3, 1, 4, 1, 5]]
N = 24


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The target, a draft that is the same model (accepts everything) and an unrelated
    random draft of the same vocabulary (rejects almost everything)."""
    root = tmp_path_factory.mktemp("spec")
    make_checkpoint(root / "target", seed=0)
    make_checkpoint(root / "other", seed=1, num_hidden_layers=1)
    return {"target": root / "target", "same": root / "target", "other": root / "other"}


@pytest.fixture(scope="module")
def reference(ckpts: dict[str, Path]) -> list[list[int]]:
    with Engine.from_pretrained(ckpts["target"], tokens_per_block=4) as engine:
        return engine.generate(PROMPTS, max_new_tokens=N, stop_token_ids=[])


def spec_engine(ckpts: dict[str, Path], draft: str, k: int, **kwargs: Any) -> Engine:
    return Engine.from_pretrained(
        ckpts["target"], tokens_per_block=4, draft_model=ckpts[draft], num_speculative_tokens=k, **kwargs
    )


@pytest.mark.parametrize("draft", ["same", "other"])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_is_the_targets_with_any_draft(
    ckpts: dict[str, Path], reference: list[list[int]], draft: str, k: int
) -> None:
    """Five ragged prompts through three batch slots: requests join while others speculate."""
    with spec_engine(ckpts, draft, k, max_batch_size=3) as engine:
        assert engine.generate(PROMPTS, max_new_tokens=N, stop_token_ids=[]) == reference
        stats = engine.speculative_stats
    assert isinstance(stats, SpeculativeStats) and stats.proposed > 0
    if draft == "same":
        assert stats.accepted == stats.proposed  # the target agrees with itself
    else:
        assert stats.accepted < stats.proposed / 2
    # k proposals per decoding step, fewer only for the last tokens of a request
    decode_tokens = len(PROMPTS) * (N - 1)
    assert stats.proposed <= k * decode_tokens


def test_stop_token_inside_an_accepted_run_ends_the_request_there(
    ckpts: dict[str, Path], reference: list[list[int]]
) -> None:
    """A draft that is always right proposes past the stop token; the output stops at it."""
    stop = reference[1][7]
    expected = [ref[: ref.index(stop) + 1] if stop in ref else ref for ref in reference]
    with spec_engine(ckpts, "same", 4) as engine:
        assert engine.generate(PROMPTS, max_new_tokens=N, stop_token_ids=[stop]) == expected
        assert engine.speculative_stats.proposed > 0
        assert engine.num_free_kv_blocks == engine.num_kv_blocks


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 5, 6])
def test_max_tokens_reached_mid_run(ckpts: dict[str, Path], reference: list[list[int]], max_new_tokens: int) -> None:
    with spec_engine(ckpts, "same", 4) as engine:
        out = engine.generate(PROMPTS, max_new_tokens=max_new_tokens, stop_token_ids=[])
        stats = engine.speculative_stats
    # The first token comes from the prefill, the last is never proposed past: a draft that
    # is always right proposes exactly the tokens in between.
    assert stats.proposed == stats.accepted == len(PROMPTS) * max(0, max_new_tokens - 2)
    assert out == [ref[:max_new_tokens] for ref in reference]


def test_fp8_kv_cache_with_a_draft_matches_fp8_without(ckpts: dict[str, Path]) -> None:
    with Engine.from_pretrained(ckpts["target"], tokens_per_block=4, kv_cache_dtype="fp8") as engine:
        plain = engine.generate(PROMPTS, max_new_tokens=12, stop_token_ids=[])
    with spec_engine(ckpts, "other", 2, kv_cache_dtype="fp8") as engine:
        assert [s.dtype for s in engine.draft_kv_cache_specs] == ["fp8_e4m3"]
        assert engine.generate(PROMPTS, max_new_tokens=12, stop_token_ids=[]) == plain


def test_draft_cache_shares_the_targets_blocks_and_memory_budget(ckpts: dict[str, Path]) -> None:
    with Engine.from_pretrained(ckpts["target"], draft_model=ckpts["other"]) as engine:
        assert engine.config.num_speculative_tokens == 4  # the default with a draft
    memory = 1 << 20
    with spec_engine(ckpts, "other", 2, kv_cache_memory=memory) as engine:
        per_block = sum(s.block_bytes for s in [*engine.kv_cache_specs, *engine.draft_kv_cache_specs])
        assert len(engine.draft_kv_cache_specs) == 1  # the one-layer draft
        assert engine.num_kv_blocks == memory // per_block
        assert engine.stats().as_dict()["speculative_proposed_total"] == 0


def test_sampling_with_top_k_1_through_rejection_sampling_is_greedy(
    ckpts: dict[str, Path], reference: list[list[int]]
) -> None:
    """top_k=1 makes both distributions one-hot: rejection sampling must give the greedy tokens."""
    with spec_engine(ckpts, "other", 3) as engine:
        out = engine.generate(PROMPTS, max_new_tokens=N, temperature=0.8, top_k=1, seed=5, stop_token_ids=[])
    assert out == reference


def test_seeded_sampling_with_a_draft_is_reproducible(ckpts: dict[str, Path]) -> None:
    with spec_engine(ckpts, "same", 3) as engine:
        a = engine.generate(PROMPTS, max_new_tokens=N, temperature=1.0, seed=11, stop_token_ids=[])
        b = engine.generate(PROMPTS, max_new_tokens=N, temperature=1.0, seed=11, stop_token_ids=[])
    assert a == b and all(len(x) == N for x in a)


# -- rejection sampling keeps the target's distribution ------------------------------------------


def _tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def test_rejection_sampling_emits_the_targets_distribution() -> None:
    """20000 verifications of two proposals drawn from a draft q far from the target p:
    the first emitted token follows p0, and the second, when the first was an accepted
    proposal, follows p1 (total variation within sampling noise; accepting every
    proposal would give q's distribution, 0.3+ away)."""
    gen = torch.Generator().manual_seed(0)
    v = 6
    target = torch.randn(2, v, generator=gen) * 1.5
    draft = torch.randn(2, v, generator=gen) * 1.5
    p, q = target.softmax(-1), draft.softmax(-1)
    assert 0.5 * float((q[0] - p[0]).abs().sum()) > 0.3  # the test can tell the draft from the target
    params = SamplingParams(temperature=1.0, max_tokens=8)
    first = torch.zeros(v)
    second = torch.zeros(v)
    accepted = 0
    for _ in range(20000):
        d = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
        emitted, n = verify(torch.cat([target, target[1:]]), d, [q[0], q[1]], params, gen)
        first[emitted[0].token_id] += 1
        accepted += n
        if n >= 1:
            second[emitted[1].token_id] += 1
    assert _tv(first, p[0]) < 0.02
    assert _tv(second, p[1]) < 0.03
    assert 0 < accepted < 40000


def test_greedy_verification_keeps_the_longest_agreeing_prefix() -> None:
    logits = torch.full((4, 5), -1.0)
    for row, best in enumerate([2, 3, 1, 4]):
        logits[row, best] = 1.0
    greedy = SamplingParams(max_tokens=8)
    assert [t.token_id for t in verify(logits, [2, 3, 0], [None] * 3, greedy, None)[0]] == [2, 3, 1]
    assert verify(logits, [2, 3, 1], [None] * 3, greedy, None)[1] == 3  # all accepted, bonus 4
    assert [t.token_id for t in verify(logits, [0, 3, 1], [None] * 3, greedy, None)[0]] == [2]


# -- drafts from plugins, and errors --------------------------------------------------------------


def test_a_draft_served_by_an_external_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A built-in Llama target with atom-plugin's DeepSeek-V3 demo as its draft (both demos
    share the 320-token byte vocabulary): the draft's type comes from its own config.json."""
    pytest.importorskip("atom_plugin")
    from rtpcore.testing import demo_checkpoint

    target = demo_checkpoint("llama", cache_dir=tmp_path)
    draft = demo_checkpoint("deepseek_v3", plugins=["atom-plugin"], cache_dir=tmp_path)
    prompts = [[256, 72, 105], [256, 1, 2, 3, 4, 5, 6, 7, 8]]
    with Engine.from_pretrained(target) as engine:
        plain = engine.generate(prompts, max_new_tokens=10, stop_token_ids=[])
    with Engine.from_pretrained(target, plugins=["atom-plugin"], draft_model=draft, num_speculative_tokens=2) as engine:
        assert engine.draft.model_type == "deepseek_v3"
        assert engine.generate(prompts, max_new_tokens=10, stop_token_ids=[]) == plain
        assert engine.speculative_stats.proposed > 0


def test_draft_with_another_vocabulary_names_both_sizes(ckpts: dict[str, Path], tmp_path: Path) -> None:
    make_checkpoint(tmp_path, vocab_size=96)
    with pytest.raises(RtpcoreError, match=r"vocab_size=96.*vocab_size=128"):
        Engine.from_pretrained(ckpts["target"], draft_model=tmp_path)


def test_draft_of_an_architecture_nobody_serves(ckpts: dict[str, Path], tmp_path: Path) -> None:
    config = json.loads((ckpts["other"] / "config.json").read_text())
    config["architectures"] = ["NobodyServesThisForCausalLM"]
    config["model_type"] = "nobody"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnknownArchitectureError, match="NobodyServesThisForCausalLM"):
        Engine.from_pretrained(ckpts["target"], draft_model=tmp_path)


def test_mtp_on_a_model_without_mtp_layers(ckpts: dict[str, Path]) -> None:
    with pytest.raises(RtpcoreError, match="offers no multi-token-prediction draft"):
        Engine.from_pretrained(ckpts["target"], draft_model="mtp")


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"num_speculative_tokens": 2}, "needs a draft_model"),
        ({"draft_model": 3}, "draft_model must be a checkpoint path"),
        ({"draft_model": ""}, "draft_model must be a checkpoint path"),
        ({"draft_model": "mtp", "num_speculative_tokens": -1}, "num_speculative_tokens must be a positive integer"),
        ({"draft_model": "mtp", "num_speculative_tokens": True}, "num_speculative_tokens must be a positive integer"),
    ],
)
def test_bad_speculative_options(ckpts: dict[str, Path], kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(RtpcoreError, match=needle):
        Engine.from_pretrained(ckpts["target"], **kwargs)


@pytest.mark.slow
def test_tensor_parallel_ranks_build_the_draft_from_the_plan(ckpts: dict[str, Path], reference: list[list[int]]) -> None:
    with spec_engine(ckpts, "other", 2, tensor_parallel_size=2) as engine:
        assert engine.generate(PROMPTS, max_new_tokens=N, stop_token_ids=[]) == reference
        ranks = engine._group.run("stats", None, gather=True)
    assert len({r["kv_block_bytes"] for r in ranks}) == 1 and len(ranks) == 2


@pytest.mark.slow
def test_sampled_tokens_through_the_engine_follow_the_targets_distribution(
    ckpts: dict[str, Path], tmp_path: Path
) -> None:
    """3000 samples (temperature 1.5, top-k 3) with a draft that half agrees proposing the
    second token: the joint distribution of (first, second) is the target's, computed with
    transformers on the same checkpoint (9 outcomes; total variation within sampling noise,
    while the draft's own conditional is far from the target's)."""
    import transformers

    prompt, temperature, top_k, n = [5, 9, 33, 7], 1.5, 3, 3000
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpts["target"]).eval()
    # A draft that half agrees: the target with a perturbed head.
    draft_hf = transformers.AutoModelForCausalLM.from_pretrained(ckpts["target"]).eval()
    with torch.no_grad():
        head = draft_hf.lm_head.weight
        head.add_(torch.randn(head.shape, generator=torch.Generator().manual_seed(3)) * head.std() * 1.5)
    near = tmp_path / "near"
    draft_hf.save_pretrained(near)

    def dist(model: Any, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float() / temperature
        keep = logits >= logits.topk(top_k).values[-1]
        return logits.masked_fill(~keep, float("-inf")).softmax(-1)

    first = dist(hf, prompt)
    exact = {(a, b): float(first[a]) * float(dist(hf, [*prompt, a])[b])
             for a in first.nonzero().flatten().tolist() for b in dist(hf, [*prompt, a]).nonzero().flatten().tolist()}
    a0 = int(first.argmax())
    p1, q1 = dist(hf, [*prompt, a0]), dist(draft_hf, [*prompt, a0])
    assert 0.5 * float((p1 - q1).abs().sum()) > 0.2  # accepting every proposal would show
    torch.manual_seed(0)
    with spec_engine({**ckpts, "near": near}, "near", 1, max_batch_size=64) as engine:
        # 3 tokens: the first from the prefill, the second proposed by the draft (at most
        # max_tokens - 2 proposals per request, see test_max_tokens_reached_mid_run)
        outs = engine.generate([prompt] * n, max_new_tokens=3, temperature=temperature, top_k=top_k, stop_token_ids=[])
        stats = engine.speculative_stats
    assert stats.proposed == n and 0 < stats.accepted < n
    counts: dict[tuple[int, int], int] = {}
    for a, b, _ in outs:
        counts[(a, b)] = counts.get((a, b), 0) + 1
    assert set(counts) <= set(exact)
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - p) for k, p in exact.items())
    assert tv < 0.05, (tv, counts, exact)


def test_logprobs_with_a_draft_are_the_targets(ckpts: dict[str, Path]) -> None:
    """Accepted proposals report the target's log-probabilities, as plain decoding does."""
    from rtpcore.engine.core.outputs import RequestOutput

    def run(engine: Engine) -> list[Any]:
        got: list[RequestOutput] = []
        engine.core.add_request([5, 9, 33], SamplingParams(max_tokens=10, logprobs=2), got.append)
        while engine.core.step():
            pass
        return [t for out in got for t in (out.logprobs or ())]

    with Engine.from_pretrained(ckpts["target"]) as engine:
        plain = run(engine)
    with spec_engine(ckpts, "same", 3) as engine:
        spec = run(engine)
        assert engine.speculative_stats.accepted > 0
    assert [t.token_id for t in spec] == [t.token_id for t in plain] and len(plain) == 10
    for a, b in zip(spec, plain, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [i for i, _ in a.top] == [i for i, _ in b.top]


def test_async_streams_with_a_draft_equal_generate_and_aborts_free_blocks(
    ckpts: dict[str, Path], reference: list[list[int]]
) -> None:
    import asyncio

    from rtpcore import AsyncEngine

    async def main() -> None:
        async with AsyncEngine(spec_engine(ckpts, "same", 3, max_batch_size=3)) as engine:
            async def one(p: list[int]) -> list[int]:
                out: list[int] = []
                async for o in engine.stream(p, SamplingParams(max_tokens=N, ignore_eos=True)):
                    out += o.token_ids
                return out

            assert await asyncio.gather(*(one(p) for p in PROMPTS)) == reference
            stream = engine.stream(PROMPTS[1], SamplingParams(max_tokens=N, ignore_eos=True))
            await stream.__anext__()
            await stream.aclose()
            # The abort frees the blocks at the end of the step in progress: wait for that, with a
            # limit (only against a hang) far above a step on a slow, busy machine.
            deadline = asyncio.get_running_loop().time() + 120
            while engine.stats().kv_blocks_free != engine.stats().kv_blocks_total:
                assert asyncio.get_running_loop().time() < deadline, "the closed stream's blocks"
                await asyncio.sleep(0.01)
            assert engine.speculative_stats.accepted > 0

    asyncio.run(main())


def test_a_draft_with_a_shorter_context_stops_proposing_at_its_end(
    ckpts: dict[str, Path], reference: list[list[int]], tmp_path: Path
) -> None:
    """A draft of max_position_embeddings=12: sequences longer than that decode without
    proposals (the draft never sees a position past 11), with the same tokens."""
    make_checkpoint(tmp_path, seed=1, num_hidden_layers=1, max_position_embeddings=12)
    with Engine.from_pretrained(ckpts["target"], tokens_per_block=4, draft_model=tmp_path, num_speculative_tokens=3) as e:
        seen: list[int] = []
        model = e.draft.model
        original = model.forward

        def spy(batch: Any, caches: Any) -> Any:
            seen.append(int(batch.positions.max()))
            return original(batch, caches)

        model.forward = spy
        assert e.generate(PROMPTS, max_new_tokens=N, stop_token_ids=[]) == reference
        assert e.speculative_stats.proposed > 0
    assert seen and max(seen) == 11  # it proposed up to its last position, never past it

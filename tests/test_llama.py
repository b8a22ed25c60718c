"""The built-in Llama family against Hugging Face transformers on tiny checkpoints it writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from rtpcore import Engine  # noqa: E402
from rtpcore.errors import CheckpointError, RtpcoreError  # noqa: E402
from rtpcore.models.forward_batch import ForwardBatch  # noqa: E402
from rtpcore.models.layers import Linear, native_bf16_dot, packed_linear_supported  # noqa: E402
from rtpcore.models.llama import LlamaPlugin  # noqa: E402

SMALL = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=128, max_position_embeddings=256,
)
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
}
VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "llama-bias": ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": LLAMA3_ROPE}),
    "qwen2-bias": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 12, "head_dim": 16}),
    # q/k norms; head_dim 24 with 4 heads: q is 96 wide, hidden 64 (tests/test_qwen3.py)
    "qwen3-head-dim": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24}),
}
PROMPTS = [[5, 9, 33, 7, 81], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [100]]


def make_checkpoint(path: Path, variant: str = "llama-gqa", seed: int = 0, **overrides: Any) -> Any:
    """Write a seeded random transformers model to ``path``; return it (float32, eval mode).

    Every parameter is drawn afresh (biases included, norms around 1) so that greedy
    decoding of the tiny model is far from uniform and does not collapse into a loop.
    """
    config_cls, model_cls, extra = VARIANTS[variant]
    config = getattr(transformers, config_cls)(**{**SMALL, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1] if p.dim() == 2 else 16
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / fan_in**0.5))
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_tokens_equal_transformers_for_64_tokens(tmp_path: Path, variant: str, native: bool) -> None:
    """Greedy float32 generation of ragged prompts, batched together, gives exactly
    transformers' tokens for 64 new tokens (batched equals alone: see test_engine), with the
    native decode step and with torch's modules (bit-identical to transformers)."""
    hf = make_checkpoint(tmp_path, variant)
    prompts = PROMPTS[:2]
    with Engine.from_pretrained(tmp_path, max_batch_size=4, native_decode=native) as engine:
        assert engine.model_type == "llama"
        got = engine.generate(prompts, max_new_tokens=64, stop_token_ids=[])
        assert engine.model.decode_kernel == ("native" if native else "torch")
    for prompt, tokens in zip(prompts, got, strict=True):
        assert len(set(tokens)) >= 12, f"degenerate greedy output, the test would prove little: {tokens}"
        assert tokens == hf_greedy(hf, prompt, 64)


def teacher_forced_logits(model: Any, caches: list[Any], seqs: list[list[int]], prefill: list[int]) -> list[torch.Tensor]:
    """Prefill ``seqs[b][:prefill[b]]`` together (ragged), then decode the rest one token
    per step, feeding the true next token. Sequences come longest tail first.
    Returns per sequence its logits after each new token: (len - prefill + 1, V)."""
    tpb = caches[0].tokens_per_block
    width = -(-max(map(len, seqs)) // tpb)
    tables = torch.arange(len(seqs) * width).view(len(seqs), width)  # sequence b owns blocks b*width...
    done = [0] * len(seqs)
    out: list[list[torch.Tensor]] = [[] for _ in seqs]

    def step(chunks: list[list[int]]) -> None:
        pos = [list(range(done[b], done[b] + len(c))) for b, c in enumerate(chunks)]
        flat = torch.tensor([p for ps in pos for p in ps])
        rows = torch.tensor([b for b, ps in enumerate(pos) for _ in ps])
        batch = ForwardBatch(
            input_ids=torch.tensor([t for c in chunks for t in c]), positions=flat,
            slots=tables[rows, flat // tpb] * tpb + flat % tpb, query_lens=tuple(map(len, chunks)),
            context_lens=torch.tensor([done[b] + len(c) for b, c in enumerate(chunks)]),
            block_tables=tables[: len(chunks)], tokens_per_block=tpb,
        )
        logits = model(batch, caches)  # (B, V)
        for b, c in enumerate(chunks):
            done[b] += len(c)
            out[b].append(logits[b])

    with torch.inference_mode():
        step([s[:n] for s, n in zip(seqs, prefill, strict=True)])
        tails = [len(s) - n for s, n in zip(seqs, prefill, strict=True)]
        assert tails == sorted(tails, reverse=True)
        for i in range(tails[0]):
            step([[s[n + i]] for s, n, t in zip(seqs, prefill, tails, strict=True) if i < t])
    return [torch.stack(o) for o in out]


@pytest.mark.parametrize(("variant", "dtype", "tol", "fp32_batched"), [
    ("llama-gqa", torch.float32, 1e-4, None),
    ("qwen2-bias", torch.float32, 1e-4, None),
    ("mistral-window", torch.float32, 1e-4, None),
    ("llama-gqa", torch.bfloat16, 0.05, False),
    ("llama-gqa", torch.bfloat16, 0.05, True),
    ("qwen2-bias", torch.bfloat16, 0.05, True),
])
def test_logits_match_transformers(
    tmp_path: Path, variant: str, dtype: torch.dtype, tol: float, fp32_batched: bool | None
) -> None:
    """Ragged prefill and decode logits equal transformers' within 1e-4 (float32), and within
    5% of the logits' range in bfloat16 (different summation orders round differently), with
    either bf16 kernel family (fp32_batched_linear: a float32 copy for several-row inputs or not)."""
    hf = make_checkpoint(tmp_path, variant).to(dtype)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (40, 31, 20)]
    engine = Engine.from_pretrained(  # torch's modules (tests/test_native_decode.py holds the native step)
        tmp_path, dtype=str(dtype).removeprefix("torch."), tokens_per_block=4, fp32_batched_linear=fp32_batched,
        native_decode=False,
    )
    kernels = {m.kernel for m in engine.model.modules() if isinstance(m, Linear)}
    if dtype == torch.float32:
        assert kernels == {"plain"}
    elif fp32_batched and packed_linear_supported(dtype):
        assert kernels == {"packed+fp32"}
    elif dtype == torch.bfloat16 and native_bf16_dot():
        assert kernels == {"native-bf16"}  # rtpcore_native's bf16 kernels (tests/test_bf16_kernels.py)
    elif packed_linear_supported(dtype):
        assert kernels == {"packed"}
    ours = teacher_forced_logits(engine.model, engine.kv_caches, seqs, prefill=[13, 7, 20])
    for s, got, n in zip(seqs, ours, [13, 7, 20], strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([s])).logits[0, n - 1 :].float()  # (len - n + 1, V)
        got = got.float()
        assert got.shape == ref.shape
        scale = 1.0 if dtype == torch.float32 else float(ref.abs().max())
        assert (got - ref).abs().max().item() <= tol * scale


def test_subclass_serves_a_new_architecture_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A LlamaPlugin subclass with its own model_type/architectures, loaded through
    --external-model-packages, runs a checkpoint of that architecture like transformers."""
    module = tmp_path / "plugins" / "rtpcore_test_my_llama.py"
    module.parent.mkdir()
    module.write_text(
        "from rtpcore import hookimpl\n"
        "from rtpcore.models.llama import LlamaPlugin\n\n"
        "class MyLlama(LlamaPlugin):\n"
        "    model_type = 'my_llama'\n"
        "    architectures = ('MyLlamaForCausalLM',)\n\n"
        "@hookimpl\n"
        "def rtpcore_register_models(registry):\n"
        "    registry.register(MyLlama)\n"
    )
    monkeypatch.syspath_prepend(str(module.parent))
    ckpt = tmp_path / "ckpt"
    hf = make_checkpoint(ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "architectures": ["MyLlamaForCausalLM"], "model_type": "my_llama"}))
    with Engine.from_pretrained(ckpt, external_model_packages=["rtpcore_test_my_llama"]) as engine:
        assert engine.model_type == "my_llama"
        assert [e.name for e in engine.plugins] == ["rtpcore_test_my_llama"]
        assert engine.generate([PROMPTS[0]], max_new_tokens=12, stop_token_ids=[])[0] == hf_greedy(hf, PROMPTS[0], 12)


def test_config_reads_family_differences() -> None:
    """Qwen2 gets q/k/v biases without o bias; Mistral windows every layer; Qwen2 only with use_sliding_window."""
    base = {**SMALL, "architectures": ["LlamaForCausalLM"]}
    assert not LlamaPlugin.config_from_hf(base).qkv_bias
    qwen = LlamaPlugin.config_from_hf({**base, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"})
    assert (qwen.qkv_bias, qwen.o_bias) == (True, False)
    assert LlamaPlugin.config_from_hf({**base, "sliding_window": 8}).sliding_windows == (8, 8)
    off = {**base, "model_type": "qwen2", "sliding_window": 8, "use_sliding_window": False}
    assert LlamaPlugin.config_from_hf(off).sliding_windows == (None, None)
    assert LlamaPlugin.config_from_hf({**base, "eos_token_id": [3, 4]}).eos_token_ids == (3, 4)
    assert "lm_head.weight" not in LlamaPlugin.weight_patterns(LlamaPlugin.config_from_hf({**base, "tie_word_embeddings": True}))


@pytest.mark.parametrize(("change", "needle"), [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope type 'yarn'"),
    ({"hidden_size": None}, "hidden_size"),
])
def test_unsupported_config_is_a_clear_error(change: dict[str, Any], needle: str) -> None:
    """A config the family cannot run raises CheckpointError naming the key and the supported values."""
    hf = {**SMALL, **change}
    hf = {k: v for k, v in hf.items() if v is not None}
    with pytest.raises(CheckpointError) as excinfo:
        LlamaPlugin.config_from_hf(hf)
    assert needle in str(excinfo.value)


def test_rope_tables_grow_past_their_initial_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Positions beyond the precomputed RoPE table are computed on demand, still matching transformers."""
    import rtpcore.models.llama_modules as modules

    monkeypatch.setattr(modules, "ROPE_TABLE_START", 8)
    hf = make_checkpoint(tmp_path, "llama3-rope")
    with Engine.from_pretrained(tmp_path) as engine:
        assert engine.model.cos.shape[0] == 8
        assert engine.generate([PROMPTS[1]], max_new_tokens=24, stop_token_ids=[])[0] == hf_greedy(hf, PROMPTS[1], 24)
        assert engine.model.cos.shape[0] >= 14 + 24 - 1


def test_fp32_batched_linear_takes_only_none_true_or_false(tmp_path: Path) -> None:
    """A value other than None/True/False for fp32_batched_linear is refused before anything loads."""
    make_checkpoint(tmp_path)
    with pytest.raises(RtpcoreError, match=r"fp32_batched_linear must be None \(automatic\), True or False, got 'yes'"):
        Engine.from_pretrained(tmp_path, dtype="bfloat16", fp32_batched_linear="yes")  # type: ignore[arg-type]

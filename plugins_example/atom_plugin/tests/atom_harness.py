"""Helpers of atom-plugin's tests: tiny DeepSeek checkpoints written by transformers,
and a paged-cache harness that runs greedy prefill + decode through the forward contract."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from rtpcore.batch import ForwardBatch
from rtpcore.kv import allocate_kv_caches

TINY: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "n_group": 2,
    "topk_group": 1,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "max_position_embeddings": 256,
    "initializer_range": 0.15,  # large enough that greedy text does not collapse into one token
}

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 32,  # = max_position_embeddings / factor
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
    "beta_fast": 32,
    "beta_slow": 1,
}


def make_checkpoint(path: Path, arch: str = "v3", seed: int = 0, **overrides: Any) -> Path:
    """Write a random tiny checkpoint with transformers' own ``save_pretrained``.

    Norm weights, biases (``attention_bias``) and (V3) ``e_score_correction_bias``
    are randomised too, so routing bias, projection biases and every norm take
    part in the comparison (transformers initialises biases to zero).
    """
    import transformers

    torch.manual_seed(seed)
    kwargs = {**TINY, **overrides}
    if arch == "v3":
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**kwargs))
    else:
        kwargs.setdefault("topk_method", "group_limited_greedy")
        model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**kwargs))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def ckpt_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    cache: dict[str, Path] = {}

    def factory(name: str, arch: str = "v3", **overrides: Any) -> Path:
        if name not in cache:
            cache[name] = make_checkpoint(tmp_path_factory.mktemp(name), arch, **overrides)
        return cache[name]

    return factory


@pytest.fixture(scope="session")
def v3_ckpt(ckpt_factory: Callable[..., Path]) -> Path:
    """q_lora_rank 32, yarn rope with mscale (softmax scale and cos/sin both scaled)."""
    return ckpt_factory("v3_yarn", rope_parameters=dict(YARN))


def hf_greedy(path: Path, prompts: Sequence[Sequence[int]], n_new: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (one at a time, no padding)."""
    return [list(seq) for seq in _hf_greedy(str(path), tuple(tuple(p) for p in prompts), n_new)]


@functools.lru_cache(maxsize=16)  # several tests compare against the same reference run
def _hf_greedy(path: str, prompts: tuple[tuple[int, ...], ...], n_new: int) -> tuple[tuple[int, ...], ...]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # No end-of-sequence: greedy runs the full length without suppressing any token.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(torch.tensor([list(p)]), max_new_tokens=n_new, do_sample=False)
            outs.append(tuple(ids[0, len(p) :].tolist()))
    return tuple(outs)


def hf_logits(path: Path, ids: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(len(ids), vocab) float32 logits of transformers' full forward over ``ids``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.inference_mode():
        return model(torch.tensor([list(ids)])).logits[0].float()


class PagedRunner:
    """A minimal engine: contiguous blocks per sequence, greedy prefill then decode.

    ``forced`` replaces the greedy choice (teacher forcing), so two caches can be
    compared on identical contexts.
    """

    def __init__(self, model: Any, specs: Sequence[Any], layouts: Any = None):
        self.model, self.specs, self.layouts = model, list(specs), layouts

    def run(
        self,
        prompts: Sequence[Sequence[int]],
        n_new: int,
        forced: Sequence[Sequence[int]] | None = None,
    ) -> tuple[list[list[int]], torch.Tensor]:
        """Return the new tokens of each prompt and the logits (n_new, B, vocab) that chose them."""
        tpb = self.specs[0].tokens_per_block
        b = len(prompts)
        lens = [len(p) for p in prompts]
        per_seq = math.ceil((max(lens) + n_new) / tpb)
        caches = allocate_kv_caches(
            self.specs, b * per_seq + 1, compute_dtype=self.model.dtype, layouts=self.layouts
        )
        tables = torch.arange(b * per_seq).view(b, per_seq) + 1  # block 0 stays unused

        def slots(i: int, pos: torch.Tensor) -> torch.Tensor:
            return tables[i, pos // tpb] * tpb + pos % tpb

        batch = ForwardBatch(
            input_ids=torch.tensor([t for p in prompts for t in p]),
            positions=torch.cat([torch.arange(n) for n in lens]),
            slots=torch.cat([slots(i, torch.arange(n)) for i, n in enumerate(lens)]),
            query_lens=tuple(lens),
            context_lens=torch.tensor(lens),
            block_tables=tables,
            tokens_per_block=tpb,
        )
        out: list[list[int]] = [[] for _ in prompts]
        steps = []
        with torch.inference_mode():
            for step in range(n_new):
                logits = self.model(batch, caches)  # (B, vocab)
                steps.append(logits)
                nxt = logits.argmax(-1)
                if forced is not None:
                    nxt = torch.tensor([f[step] for f in forced])
                for i in range(b):
                    out[i].append(int(nxt[i]))
                pos = torch.tensor(lens) + step  # (B,)
                batch = ForwardBatch(
                    input_ids=nxt,
                    positions=pos,
                    slots=torch.stack([slots(i, pos[i]) for i in range(b)]),
                    query_lens=(1,) * b,
                    context_lens=pos + 1,
                    block_tables=tables,
                    tokens_per_block=tpb,
                )
        return out, torch.stack(steps)


def build_from_checkpoint(
    path: Path, *, dtype: torch.dtype = torch.float32, kv_cache_dtype: str = "fp32",
    kv_layout: str | None = None, tokens_per_block: int = 16,
) -> tuple[Any, Any, list[Any]]:
    """(plugin config, model, KV descriptors) through the plugin API and rtpcore's checkpoint loader."""
    from atom_plugin.deepseek import DeepseekV2Plugin, DeepseekV3Plugin
    from rtpcore.checkpoint import load_checkpoint, read_hf_config

    hf = read_hf_config(path)
    plugin = DeepseekV3Plugin if hf["architectures"] == ["DeepseekV3ForCausalLM"] else DeepseekV2Plugin
    cfg = plugin.config_from_hf(hf)
    weights = load_checkpoint(
        path, plugin.weight_patterns(cfg), plugin.placeholder_ranges(cfg),
        dtype=dtype, expected_shapes=plugin.weight_shapes(cfg), dtypes=plugin.weight_dtypes(cfg),
    )
    model = plugin.build_model(cfg, weights, dtype=dtype)
    descs = plugin.kv_cache_descs(
        cfg, kv_cache_dtype=kv_cache_dtype, kv_layout=kv_layout, tokens_per_block=tokens_per_block
    )
    return cfg, model, descs


def generate_from_pickled_config(blob: bytes, prompts: list[list[int]], n_new: int) -> dict[str, Any]:
    """Run in a spawned process: rebuild the engine from a pickled EngineConfig alone."""
    import pickle
    import sys

    from rtpcore import Engine

    before = "atom_plugin" in sys.modules
    with Engine.from_config(pickle.loads(blob)) as engine:
        out = engine.generate(prompts, max_new_tokens=n_new, stop_token_ids=())
        return {
            "imported_before": before,
            "tokens": out,
            "model_type": engine.model_type,
            "plugins": [(e.distribution, e.version, e.value) for e in engine.plugins],
            "bytes_per_token": engine.kv_cache_specs[0].bytes_per_token,
        }

"""``bench_decode.py deepseek``: atom-plugin's DeepSeek-V3 against transformers.

    python benchmarks/bench_decode.py deepseek [--dtypes float32,bfloat16] [--batches 1,8]
        [--prompt-len 32] [--new-tokens 128] [--repeats 2] [--threads N]

Builds seeded DeepSeek-V3 checkpoints with transformers: ``medium`` (hidden 512, 6
layers with the first dense, 8 heads, q_lora 256, kv_lora 256, rope 64, 16 routed
experts in 4 groups, top-4 of 2 groups, 1 shared expert, vocab 32000; ~60M
parameters, decode is memory-bound on a CPU) and ``tiny`` (the test suite's size:
hidden 64, 3 layers, 8 experts, vocab 128; decode is bound by per-step overhead).
Then it prints:

1. decode throughput: the best of ``--repeats`` greedy ``generate`` calls of ``--new-tokens``
   per engine and batch size, after a warm-up, same process and thread count; rtpcore through
   ``Engine.from_pretrained(plugins=("atom-plugin",))``;
2. KV bytes per token per layer of every cache rtpcore can use (model dtype, fp8
   ``padded``/``compact``, the plugin's ``ue8m0``) against transformers' cache,
   measured from a filled ``DynamicCache``;
3. how many tokens fit in a fixed 1 GiB KV budget, for the medium checkpoint and for
   DeepSeek-V3's real geometry (61 layers, kv_lora_rank 512, rope 64).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

PLUGINS = ("atom-plugin",)
BUDGET = 1 << 30  # bytes of KV memory for the "tokens that fit" table
LAYOUTS = (("auto", None), ("fp8", "padded"), ("fp8", "compact"), ("fp8", "ue8m0"))

TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=32, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
    n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2, n_shared_experts=1,
    max_position_embeddings=2048, initializer_range=0.05,
)
CONFIG = dict(
    vocab_size=32000, hidden_size=512, intermediate_size=1408, moe_intermediate_size=256,
    num_hidden_layers=6, first_k_dense_replace=1, num_attention_heads=8, num_key_value_heads=8,
    q_lora_rank=256, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
    n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4, n_shared_experts=1,
    max_position_embeddings=2048, initializer_range=0.05,
)


def make_checkpoint(path: Path, config: dict[str, Any] = CONFIG) -> None:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**config))
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn_like(buf))
    model.save_pretrained(path)


def best_of(fn: Any, repeats: int) -> tuple[float, Any]:
    """Best wall time of ``repeats`` calls (after the caller's warm-up), and the last result."""
    best, out = float("inf"), None
    for _ in range(max(1, repeats)):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def time_hf(model: Any, prompts: torch.Tensor, new: int, repeats: int = 1) -> tuple[float, list[list[int]]]:
    model.generation_config.eos_token_id = None
    kwargs = dict(max_new_tokens=new, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompts))
    with torch.inference_mode():
        model.generate(prompts, **{**kwargs, "max_new_tokens": 8})
        dt, out = best_of(lambda: model.generate(prompts, **kwargs), repeats)
    return dt, out[:, prompts.shape[1] :].tolist()


def time_rtpcore(engine: Any, prompts: list[list[int]], new: int, repeats: int = 1) -> tuple[float, list[list[int]]]:
    engine.generate(prompts, max_new_tokens=8, stop_token_ids=[])
    return best_of(lambda: engine.generate(prompts, max_new_tokens=new, stop_token_ids=[]), repeats)


def hf_cache_bytes_per_token_layer(model: Any, tokens: int = 16) -> float:
    """Bytes per token per layer that transformers' DynamicCache holds after a prefill."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(torch.arange(3, 3 + tokens)[None], cache=cache, use_cache=True)
    total = 0
    for layer in cache.layers:
        total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
    return total / tokens / len(cache.layers)


def throughput(args: argparse.Namespace, path: Path, size: str, vocab: int) -> None:
    from transformers import AutoModelForCausalLM

    from rtpcore import Engine

    gen = torch.Generator().manual_seed(1)
    for dtype in args.dtypes:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        with Engine.from_pretrained(path, plugins=PLUGINS, dtype=dtype, max_batch_size=max(args.batches)) as engine:
            for b in args.batches:
                ids = torch.randint(3, vocab, (b, args.prompt_len), generator=gen)
                t_hf, out_hf = time_hf(hf, ids, args.new_tokens, args.repeats)
                t_rt, out_rt = time_rtpcore(engine, ids.tolist(), args.new_tokens, args.repeats)
                print(
                    f"{size:7} {dtype:9} {b:5d} {b * args.new_tokens / t_rt:13.1f} {b * args.new_tokens / t_hf:9.1f}"
                    f" {t_hf / t_rt:5.2f}x {'yes' if out_hf == out_rt else 'no':>5}"
                )
        del hf


def kv_tables(path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from atom_plugin.layouts import Ue8m0Layout
    from rtpcore import Engine
    from rtpcore_native import KVCacheSpecDesc, build_kv_cache_spec, plan_kv_cache_blocks

    n_layers = CONFIG["num_hidden_layers"]
    print(f"\nKV cache, bytes per token per layer, and tokens that fit in {BUDGET >> 20} MiB")
    print(f"{'cache':24} {'B/token/layer':>13} {'tokens (this ckpt)':>18} {'tokens (V3 512/64 x61)':>22}")
    for dtype in ("float32", "bfloat16"):
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        per = hf_cache_bytes_per_token_layer(hf)
        # transformers' cache has no blocks: budget / bytes per token across layers.
        v3_per = per * (512 + 64) / (CONFIG["kv_lora_rank"] + CONFIG["qk_rope_head_dim"])
        print(f"{'transformers ' + dtype:24} {per:13.0f} {int(BUDGET // (per * n_layers)):18d} {int(BUDGET // (v3_per * 61)):22d}")
        del hf
    for dtype in ("float32", "bfloat16"):
        for kv, layout in LAYOUTS:
            if kv == "fp8" and dtype == "float32":
                continue
            with Engine.from_pretrained(
                path, plugins=PLUGINS, dtype=dtype, kv_cache_dtype=kv, kv_layout=layout, kv_cache_memory=BUDGET
            ) as engine:
                spec = engine.kv_cache_specs[0]
                tpb = spec.tokens_per_block
                tokens = engine.num_kv_blocks * tpb
            v3 = KVCacheSpecDesc(
                tag="v3", kind="mla", dtype=spec.dtype, kv_lora_rank=512, rope_head_dim=64,
                tokens_per_block=tpb, layout=spec.layout,
            )
            v3_spec = build_kv_cache_spec(v3, policy=Ue8m0Layout() if layout == "ue8m0" else None)
            v3_tokens = plan_kv_cache_blocks([v3_spec] * 61, BUDGET) * tpb
            name = f"rtpcore {spec.dtype}" + (f" {layout}" if layout else "")
            print(f"{name:24} {spec.bytes_per_token:13d} {tokens:18d} {v3_tokens:22d}")


def run(args: argparse.Namespace) -> int:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'size':7} {'dtype':9} {'batch':>5} {'rtpcore tok/s':>13} {'hf tok/s':>9} {'ratio':>6} {'same':>5}")
    with tempfile.TemporaryDirectory() as tmp:
        for size, config in (("tiny", TINY), ("medium", CONFIG)):
            path = Path(tmp) / f"deepseek-v3-{size}"
            make_checkpoint(path, config)
            throughput(args, path, size, int(config["vocab_size"]))
        kv_tables(Path(tmp) / "deepseek-v3-medium")
    return 0


main = run  # bench_decode.py calls main(args)

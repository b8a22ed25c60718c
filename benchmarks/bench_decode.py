"""Decode throughput of rtpcore against transformers' ``generate`` on the same checkpoint.

    python benchmarks/bench_decode.py [llama|deepseek] [--dtypes float32,bfloat16]
        [--batches 1,8] [--prompt-len 32] [--new-tokens 128] [--threads N]

``llama`` (default) builds a ~56M-parameter Llama with transformers (hidden 512,
8 layers, 8 heads, 4 KV heads, vocab 32000, intermediate 1376; seeded), then
for each dtype and batch size times one greedy ``generate`` of each engine in
the same process, same thread count: one warm-up, then the best of ``--repeats`` alternating rounds. It prints tokens/s,
the ratio rtpcore/transformers, whether the greedy tokens are identical, and
the fraction of the memory-bandwidth bound: weight bytes read per decode step
times decode steps per second, divided by a measured copy bandwidth.

``deepseek`` is provided by ``benchmarks/_bench_deepseek.py`` when present
(a function ``run(args)`` taking the parsed arguments).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent


def cpu_line() -> str:
    """The CPU model, its bf16/AMX features, the oneDNN ISA limit and the bf16 linear kernel:
    figures from CPUs with and without bf16 instructions are not comparable."""
    from rtpcore.models.layers import Linear, cpu_has_native_dot

    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown CPU":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    feats = [f for f in ("avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16") if f in flags]
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA")
    kernel = Linear(torch.zeros(8, 8, dtype=torch.bfloat16)).kernel
    return (
        f"CPU: {model}; features: {' '.join(feats) or 'none of avx512/bf16/amx'}; "
        f"native bf16 dot: {'yes' if cpu_has_native_dot(torch.bfloat16) else 'no'}"
        f"{f' (ONEDNN_MAX_CPU_ISA={isa})' if isa else ''}; bf16 Linear kernel: {kernel}"
    )


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes per second moved by a large tensor copy (read + write)."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def make_llama(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, initializer_range=0.05,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight a decode step reads; of the embedding table only lm_head's use."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    if model.get_output_embeddings().weight is not emb:  # untied: the table itself is not read
        total -= emb.numel() * emb.element_size()
    return total


def hf_generate(model: torch.nn.Module, prompts: torch.Tensor, new: int) -> list[list[int]]:
    with torch.inference_mode():
        out = model.generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new, min_new_tokens=new,
            do_sample=False, pad_token_id=0,
        )
    return out[:, prompts.shape[1]:].tolist()


def timed_pair(fn_a: Any, fn_b: Any, repeats: int) -> tuple[float, Any, float, Any]:
    """Best wall time of each of two calls over ``repeats`` rounds, after one warm-up each,
    and their last results. The rounds alternate a and b, so that a slow phase of the
    machine (other tenants of a shared host) weighs on both alike."""
    out_a, out_b = fn_a(), fn_b()
    best_a = best_b = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        out_a = fn_a()
        best_a = min(best_a, time.perf_counter() - t)
        t = time.perf_counter()
        out_b = fn_b()
        best_b = min(best_b, time.perf_counter() - t)
    return best_a, out_a, best_b, out_b


def bench_llama(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM

    from rtpcore import Engine

    bw = copy_bandwidth()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, copy bandwidth {bw / 1e9:.1f} GB/s")
    print(f"prompts of {args.prompt_len} tokens, {args.new_tokens} new tokens (greedy), best of {args.repeats}")
    print(f"{'dtype':9} {'batch':>5} {'rtpcore tok/s':>13} {'hf tok/s':>9} {'ratio':>6} {'same':>5} {'bw bound':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama-56m"
        make_llama(path)
        gen = torch.Generator().manual_seed(1)
        for dtype in args.dtypes:
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
            wbytes = decode_weight_bytes(hf)
            with Engine.from_pretrained(path, dtype=dtype, max_batch_size=max(args.batches)) as engine:
                for b in args.batches:
                    ids = torch.randint(3, 32000, (b, args.prompt_len), generator=gen)
                    t_hf, out_hf, t_rt, out_rt = timed_pair(
                        partial(hf_generate, hf, ids, args.new_tokens),
                        partial(engine.generate, ids.tolist(), max_new_tokens=args.new_tokens, stop_token_ids=[]),
                        args.repeats,
                    )
                    frac = wbytes * (args.new_tokens / t_rt) / bw
                    print(
                        f"{dtype:9} {b:5d} {b * args.new_tokens / t_rt:13.1f} {b * args.new_tokens / t_hf:9.1f}"
                        f" {t_hf / t_rt:5.2f}x {'yes' if out_hf == out_rt else 'no':>5} {frac:8.1%}"
                    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="llama", choices=["llama", "deepseek"])
    parser.add_argument("--dtypes", default="float32,bfloat16", type=lambda s: s.split(","))
    parser.add_argument("--batches", default="1,8", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (transformers, then rtpcore) after a warm-up; each keeps its best")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(cpu_line())
    if args.model == "llama":
        bench_llama(args)
        return 0
    extra = HERE / "_bench_deepseek.py"
    if not extra.is_file():
        parser.error("the deepseek benchmark needs benchmarks/_bench_deepseek.py (from the atom-plugin work)")
    spec = importlib.util.spec_from_file_location("_bench_deepseek", extra)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""Decode throughput of rtpcore against transformers' ``generate`` (and CTranslate2) on the same checkpoint.

    python benchmarks/bench_decode.py [llama|smollm2|deepseek] [--dtypes float32,float32-torch,bfloat16,int8,int8-bf16]
        [--batches 1,8] [--prompt-len 32] [--new-tokens N] [--threads N] [--repeats 3] [--quick]
        [--cpu-isa avx2|avx512|avx512_bf16|amx]

``llama`` (default) builds a ~56M-parameter Llama with transformers (hidden 512,
8 layers, 8 heads, 4 KV heads, vocab 32000, intermediate 1376; seeded), then
for each dtype and batch size times one greedy ``generate`` of each engine in
the same process, same thread count: one warm-up, then the best of ``--repeats`` alternating rounds. It prints tokens/s,
the ratio rtpcore/transformers, whether the greedy tokens are identical, and
the fraction of the memory-bandwidth bound: weight bytes read per decode step
times decode steps per second, divided by a measured copy bandwidth.

``smollm2`` builds SmolLM2-135M's shape with seeded random weights (30 layers,
hidden 576, 9 heads, 3 KV heads, vocabulary 49152, intermediate 1536, tied
embeddings, rope_theta 100000; saved in float32) and times, for each batch size,
transformers float32 and bfloat16, rtpcore float32 (the native decode step),
float32-torch (torch's modules, ``native_decode=False``), bfloat16, int8 (weight-only,
float32 activations) and int8-bf16 (the same int8 weights, bfloat16 activations)
and, when ``ctranslate2`` is installed (an optional peer of this benchmark only),
CTranslate2 float32 and int8 (its int8 also quantizes the activations) converted
from the same checkpoint, with ``intra_threads`` equal to torch's thread count
(``--threads``). Every engine decodes exactly ``--new-tokens`` greedy tokens
(no stop token); tokens/s is new tokens over wall time, prefill included, best of
``--repeats`` rounds after one warm-up, the rounds alternating over all engines. It
prints a markdown table (ratios vs transformers float32, vs the CTranslate2 row of
the same weights and vs transformers bfloat16; the share of each row's greedy tokens
that agree with transformers float32 up to the first difference), then the targets
of issue 24 as met / not met. ``--dtypes`` picks the rtpcore rows (default all
five); ``--quick`` is 16 new tokens and one timed round unless given.

Every rtpcore figure is printed with the kernel that ran most of its steps (``kernel``: the
``engine.stats().kernel_calls`` key, e.g. ``native_decode[amx]`` or ``torch_step[torch (oneDNN)]``;
``rtpcore info`` explains them). ``--cpu-isa`` caps the CPU kernels (rtpcore's and torch's, set
before either runs) as on a CPU of that class, so one machine gives each class's table.

``deepseek`` is provided by ``benchmarks/_bench_deepseek.py`` when present
(a function ``run(args)`` taking the parsed arguments).
"""

from __future__ import annotations

import argparse
import contextlib
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
    try:
        from rtpcore_native import _kernels
        native = _kernels.isa()
        ok, reason = _kernels.amx_probe()
        native += "" if ok else f" (AMX not used: {reason})"
    except ImportError:
        native = "not built"
    return (
        f"CPU: {model}; features: {' '.join(feats) or 'none of avx512/bf16/amx'}; "
        f"native bf16 dot: {'yes' if cpu_has_native_dot(torch.bfloat16) else 'no'}"
        f"{f' (ONEDNN_MAX_CPU_ISA={isa})' if isa else ''}; bf16 Linear kernel: {kernel}; native decode kernels: {native}"
        f"{f'; --cpu-isa {cap}' if (cap := os.environ.get('RTPCORE_CPU_ISA')) else ''}"
    )


def busiest_kernel(before: dict[str, int], after: dict[str, int]) -> str:
    """The ``kernel_calls`` key that ran the most steps between two snapshots of an engine's stats."""
    delta = {key: n - before.get(key, 0) for key, n in after.items() if n > before.get(key, 0)}
    return max(delta, key=lambda key: delta[key]) if delta else "-"


def decode_kernel_line(engine: Any, batches: list[int]) -> str:
    """Which kernels an engine's decode steps run: the native step and its instruction set (and,
    for bf16 weights in the blocked layout, the product kernel per batch size), or torch's modules."""
    from rtpcore.models.layers import Linear

    model = engine.model
    kinds = sorted({m.kernel for m in model.modules() if isinstance(m, Linear)})
    if getattr(model, "decode_kernel", None) != "native":
        return f"torch modules (Linear kernels: {', '.join(kinds)})"
    from rtpcore_native import _kernels

    line = f"native ({_kernels.isa()} kernels; Linear kernels: {', '.join(kinds)}"
    if "native-bf16" in kinds:
        line += "; bf16 products: " + ", ".join(f"bs{b} {_kernels.bf16_kernel(b)}" for b in batches)
    return line + ")"


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
    print(f"{'dtype':9} {'batch':>5} {'rtpcore tok/s':>13} {'hf tok/s':>9} {'ratio':>6} {'same':>5} {'bw bound':>8}  kernel")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama-56m"
        make_llama(path)
        gen = torch.Generator().manual_seed(1)
        for dtype in args.dtypes:
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
            wbytes = decode_weight_bytes(hf)
            with Engine.from_pretrained(path, dtype=dtype, max_batch_size=max(args.batches)) as engine:
                engine.generate([[1, 2, 3]], max_new_tokens=2, stop_token_ids=[])  # the decode kernel is chosen
                print(f"{dtype}: rtpcore decode steps: {decode_kernel_line(engine, args.batches)}")
                for b in args.batches:
                    ids = torch.randint(3, 32000, (b, args.prompt_len), generator=gen)
                    before = engine.stats().kernel_calls
                    t_hf, out_hf, t_rt, out_rt = timed_pair(
                        partial(hf_generate, hf, ids, args.new_tokens),
                        partial(engine.generate, ids.tolist(), max_new_tokens=args.new_tokens, stop_token_ids=[]),
                        args.repeats,
                    )
                    frac = wbytes * (args.new_tokens / t_rt) / bw
                    print(
                        f"{dtype:9} {b:5d} {b * args.new_tokens / t_rt:13.1f} {b * args.new_tokens / t_hf:9.1f}"
                        f" {t_hf / t_rt:5.2f}x {'yes' if out_hf == out_rt else 'no':>5} {frac:8.1%}"
                        f"  {busiest_kernel(before, engine.stats().kernel_calls)}"
                    )


# SmolLM2-135M's config (HuggingFaceTB/SmolLM2-135M), weights seeded at random.
SMOLLM2_CONFIG: dict[str, Any] = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
    rms_norm_eps=1e-5, hidden_act="silu", initializer_range=0.041666666666666664, bos_token_id=0, eos_token_id=0,
)


# rtpcore rows of the smollm2 benchmark: --dtypes name -> (activation dtype, quantization,
# native_decode). "float32-torch" is the float32 engine on torch's modules (bit-identical to
# transformers), the path the native decode step replaces.
RTPCORE_ROWS: dict[str, tuple[str, str | None, bool]] = {
    "float32": ("float32", None, True), "float32-torch": ("float32", None, False), "bfloat16": ("bfloat16", None, True),
    "int8": ("float32", "int8", True), "int8-bf16": ("bfloat16", "int8", True),
}
BYTES_PER_WEIGHT = {"float32": 4, "float32-torch": 4, "bfloat16": 2, "int8": 1, "int8-bf16": 1}


def make_smollm2(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_CONFIG)).float().save_pretrained(path)


class _IdVocabulary:
    """What CTranslate2's converter reads of a tokenizer, for a checkpoint without one: token
    ``i`` is the string ``t<i>`` (CTranslate2's generator takes token strings)."""

    unk_token = None

    def __init__(self, size: int, eos_id: int):
        self.size = size
        self.bos_token = self.eos_token = f"t{eos_id}"

    def get_vocab(self) -> dict[str, int]:
        return {f"t{i}": i for i in range(self.size)}


def ct2_generators(model_dir: Path, out_dir: Path, threads: int) -> tuple[dict[str, Any], str]:
    """CTranslate2 generators of the checkpoint, {"float32": ..., "int8": ...}, and a note
    (its version, or why there are none)."""
    try:
        import ctranslate2
    except ImportError:
        return {}, "ctranslate2 is not installed (pip install ctranslate2): CTranslate2 rows skipped"

    class Converter(ctranslate2.converters.TransformersConverter):
        def load_tokenizer(self, tokenizer_class: Any, model_name_or_path: str, **kwargs: Any) -> Any:
            return _IdVocabulary(SMOLLM2_CONFIG["vocab_size"], SMOLLM2_CONFIG["eos_token_id"])

    Converter(str(model_dir)).convert(str(out_dir), quantization="float32", force=True)
    # int8: CTranslate2 quantizes the float32 weights at load (one scale per output row).
    gens = {
        ct: ctranslate2.Generator(str(out_dir), device="cpu", compute_type=ct, inter_threads=1, intra_threads=threads)
        for ct in ("float32", "int8")
    }
    return gens, f"ctranslate2 {ctranslate2.__version__}, intra_threads={threads}, compute types float32 and int8"


def ct2_generate(generator: Any, tokens: list[list[str]], new: int) -> list[list[int]]:
    # min_length = max_length: exactly ``new`` tokens, the end token suppressed until then.
    results = generator.generate_batch(
        tokens, max_length=new, min_length=new, beam_size=1, sampling_topk=1, include_prompt_in_result=False,
    )
    return [r.sequences_ids[0] for r in results]


def timed_rounds(fns: list[Any], repeats: int) -> list[tuple[float, Any]]:
    """``timed_pair`` for any number of calls: one warm-up each, then ``repeats`` rounds
    calling each in turn; per call its best wall time and last result."""
    outs = [fn() for fn in fns]
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            outs[i] = fn()
            best[i] = min(best[i], time.perf_counter() - t)
    return list(zip(best, outs, strict=True))


def load_line() -> str:
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "load average unknown"
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"


def prefix_agreement(got: list[list[int]], ref: list[list[int]]) -> float:
    """Share of the reference's tokens that ``got`` repeats up to each row's first difference."""
    same = 0
    for g, r in zip(got, ref, strict=True):
        for a, b in zip(g, r, strict=False):
            if a != b:
                break
            same += 1
    return same / max(1, sum(len(r) for r in ref))


def bench_smollm2(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from rtpcore import Engine

    hf_logging.disable_progress_bar()
    threads = torch.get_num_threads()
    bw = copy_bandwidth()
    print(f"torch {torch.__version__}, {threads} threads, copy bandwidth {bw / 1e9:.1f} GB/s, {load_line()}")
    print(f"SmolLM2-135M shape, seeded random weights; prompts of {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens (greedy, no stop token), best of {args.repeats} after a warm-up")
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        path = Path(tmp) / "smollm2-135m"
        make_smollm2(path)
        ct2, note = ct2_generators(path, Path(tmp) / "ct2", threads)
        print(note)
        hf = {"float32": AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()}
        if "bfloat16" in args.dtypes:
            hf["bfloat16"] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        params = decode_weight_bytes(hf["float32"]) // 4
        rt = {
            dt: stack.enter_context(Engine.from_pretrained(
                path, dtype=RTPCORE_ROWS[dt][0], quantization=RTPCORE_ROWS[dt][1], native_decode=RTPCORE_ROWS[dt][2],
                max_batch_size=max(args.batches), max_model_len=args.prompt_len + args.new_tokens,
            ))
            for dt in args.dtypes
        }
        print()
        print("| batch | engine | weights | tok/s | vs transformers fp32 | vs CTranslate2 (same weights) "
              "| vs transformers bf16 | tokens = transformers fp32 | bw bound | kernel |")
        print("|---:|---|---|---:|---:|---:|---:|---:|---:|---|")
        gen = torch.Generator().manual_seed(1)
        tps: dict[tuple[str, str, int], float] = {}
        for b in args.batches:
            ids = torch.randint(3, SMOLLM2_CONFIG["vocab_size"], (b, args.prompt_len), generator=gen)
            strings = [[f"t{i}" for i in row] for row in ids.tolist()]
            rows: list[tuple[str, str, Any]] = [("transformers", "float32", partial(hf_generate, hf["float32"], ids, args.new_tokens))]
            for dt in RTPCORE_ROWS:
                if dt == "bfloat16" and dt in hf:
                    rows.append(("transformers", dt, partial(hf_generate, hf[dt], ids, args.new_tokens)))
                if dt in rt:
                    rows.append(("rtpcore", dt, partial(
                        rt[dt].generate, ids.tolist(), max_new_tokens=args.new_tokens, stop_token_ids=[])))
                if dt in ct2:
                    rows.append(("CTranslate2", dt, partial(ct2_generate, ct2[dt], strings, args.new_tokens)))
            before = {dt: engine.stats().kernel_calls for dt, engine in rt.items()}
            results = timed_rounds([fn for *_, fn in rows], args.repeats)
            kernel = {dt: busiest_kernel(before[dt], engine.stats().kernel_calls) for dt, engine in rt.items()}
            for (engine, dt, _), (t, _) in zip(rows, results, strict=True):
                tps[engine, dt, b] = b * args.new_tokens / t
            ref = results[0][1]
            for (engine, dt, _), (t, out) in zip(rows, results, strict=True):
                mine = tps[engine, dt, b]

                def ratio(key: tuple[str, str, int], mine: float = mine) -> str:
                    return f"{mine / tps[key]:.2f}x" if key in tps else "-"

                peer = ratio(("CTranslate2", dt.split("-")[0], b)) if engine != "CTranslate2" else "-"
                vs_bf16 = ratio(("transformers", "bfloat16", b)) if dt == "bfloat16" and engine != "transformers" else "-"
                frac = params * BYTES_PER_WEIGHT[dt] * (args.new_tokens / t) / bw
                print(f"| {b} | {engine} | {dt} | {mine:.1f} | {ratio(('transformers', 'float32', b))} | {peer} "
                      f"| {vs_bf16} | {prefix_agreement(out, ref):.1%} | {frac:.1%} "
                      f"| {kernel[dt] if engine == 'rtpcore' else '-'} |")
        print()
        print("tokens = transformers fp32: share of the greedy tokens equal to transformers float32's up to each "
              "sequence's first difference (random weights have near-ties; reduced precision diverges early)")
        print("bw bound: nominal weight bytes per step (4, 2 or 1 per parameter) times steps/s over the copy bandwidth")
        print(f"after the runs: {load_line()} (a load above the CPU count means other work shared the cores)")
        print()
        targets = [(f"float32 batch {b}: rtpcore >= 1.0x CTranslate2 float32", ("rtpcore", "float32", b),
                    ("CTranslate2", "float32", b), 1.0) for b in args.batches]
        targets += [(f"int8 batch {b}: rtpcore >= 1.0x CTranslate2 int8", ("rtpcore", "int8", b),
                     ("CTranslate2", "int8", b), 1.0) for b in args.batches]
        targets += [(f"bfloat16 batch {b}: rtpcore >= 1.3x transformers bfloat16", ("rtpcore", "bfloat16", b),
                     ("transformers", "bfloat16", b), 1.3) for b in args.batches]
        for label, mine_key, other_key, goal in targets:
            if mine_key in tps and other_key in tps:
                r = tps[mine_key] / tps[other_key]
                print(f"target {label}: {r:.2f}x -> {'met' if r >= goal else 'not met'}")
            else:
                print(f"target {label}: not measured")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="llama", choices=["llama", "smollm2", "deepseek"])
    parser.add_argument("--dtypes", default=None, type=lambda s: s.split(","),
                        help="float32,bfloat16 (default); smollm2: rtpcore rows among float32,float32-torch,bfloat16,int8,int8-bf16 "
                        "(weight-only int8 with float32 / bfloat16 activations), default all")
    parser.add_argument("--batches", default="1,8", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=None, help="default 128 (smollm2: 64; --quick: 16)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (each engine in turn) after a warm-up; each keeps its best (default 3; --quick: 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice); CTranslate2's intra_threads follow")
    parser.add_argument("--quick", action="store_true", help="a short check: 16 new tokens and one timed round unless given")
    parser.add_argument("--cpu-isa", choices=["avx2", "avx512", "avx512_bf16", "amx"], default=None,
                        help="cap the CPU kernels, rtpcore's and torch's, as on a CPU of this class (rtpcore --cpu-isa)")
    args = parser.parse_args(argv)
    from rtpcore.models.cpu_isa import apply_cpu_isa

    apply_cpu_isa(args.cpu_isa)  # before torch's first product: oneDNN reads its cap once
    if args.dtypes is None:
        args.dtypes = list(RTPCORE_ROWS) if args.model == "smollm2" else ["float32", "bfloat16"]
    if args.model == "smollm2" and set(args.dtypes) - set(RTPCORE_ROWS):
        parser.error(f"--dtypes for smollm2: a subset of {','.join(RTPCORE_ROWS)}")
    if args.model != "smollm2" and any(d.startswith("int8") for d in args.dtypes):
        parser.error("--dtypes int8 (rtpcore weight-only int8 rows) is measured by the smollm2 benchmark")
    if args.new_tokens is None:
        args.new_tokens = 16 if args.quick else 64 if args.model == "smollm2" else 128
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.threads:
        torch.set_num_threads(args.threads)
    print(cpu_line())
    if args.model == "llama":
        bench_llama(args)
        return 0
    if args.model == "smollm2":
        bench_smollm2(args)
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

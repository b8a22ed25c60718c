"""Decode throughput on a CUDA/ROCm GPU: rtpcore against transformers and a CUDA-graph decode step.

    python benchmarks/bench_gpu.py [--layers 16] [--batches 1,8,64] [--prompt-len 32]
        [--new-tokens 128] [--repeats 3] [--parity-tokens 32] [--no-fp8] [--kernel-context 4096]

Builds a random, seeded model of Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads,
8 KV heads, head_dim 64, intermediate 8192, vocab 128256, tied embeddings; plain RoPE)
in bfloat16, then for each batch size times, in one process on one GPU, one greedy run
of ``--new-tokens`` tokens from ``--prompt-len``-token prompts of:

* transformers ``generate`` (eager PyTorch: no compile, its default attention);
* a hand-written decode step of the same weights: a contiguous static KV cache, plain
  torch ops, the whole step captured once as a ``torch.cuda.CUDAGraph`` and replayed per
  token (prefill runs eagerly): the baseline of what one GPU does for this model;
* ``rtpcore.Engine(device="cuda")`` (decode steps replaying CUDA graphs), and the same engine
  with ``cuda_graphs=False`` (every step eager) as the last column.

Each figure is the best of ``--repeats`` runs after a warm-up, prefill included. It prints
tokens/s and the ratios rtpcore / graph step and rtpcore / transformers; per rtpcore step,
the GPU time of its forward (CUDA events around each forward) and the host time (the step's
wall time less that); the CUDA-graph replays each run made (``EngineStats``); then a float32
greedy parity check (same weights, TF32 off) of rtpcore against transformers on the GPU,
and the throughput of an fp8 (e4m3) KV cache at the largest batch. Last, one layer's decode
attention at ``--kernel-context`` tokens (0: skipped) per batch size: the per-block paged
kernel and the split-context one (``rtpcore.kv.paged_decode_split``, the parts the rule
picks), each against torch's sdpa over a contiguous cache of the same context (the baseline).

Exit status: 0; 1 when the parity check fails; 3 when rtpcore is below ``--min-ratio``
(0.75) of the graph step at any batch size, or its decode steps did not replay CUDA graphs;
2 when torch sees no CUDA/ROCm device.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

SHAPE = dict(
    hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
    vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5,
)  # fmt: skip


def make_model(path: Path, layers: int, max_positions: int) -> None:
    """A seeded random Llama of SHAPE with ``layers`` layers, saved in bfloat16 (built on the GPU: fast)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPE, num_hidden_layers=layers, max_position_embeddings=max_positions)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)


def best_time(fn: Any, repeats: int) -> tuple[float, Any]:
    """Best wall time of ``fn()`` over ``repeats`` runs after one warm-up, and its last result."""
    out = fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best, out


def hf_generate(model: Any, ids: torch.Tensor, new: int) -> list[list[int]]:
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
            do_sample=False, pad_token_id=0,
        )
    return out[:, ids.shape[1]:].tolist()


class GraphDecoder:
    """Greedy decoding with a hand-written Llama step over a static KV cache, one CUDA graph per batch size."""

    def __init__(self, hf: Any, max_len: int):
        cfg, sd = hf.config, {k: v.detach() for k, v in hf.state_dict().items()}
        self.heads, self.kv_heads, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps, self.max_len, self.dev = cfg.rms_norm_eps, max_len, sd["model.embed_tokens.weight"].device
        self.emb, self.norm = sd["model.embed_tokens.weight"], sd["model.norm.weight"]  # (V, D), (D,)
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            attn = [sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
            mlp = [sd[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up")]
            self.layers.append((
                sd[p + "input_layernorm.weight"], torch.cat(attn), sd[p + "self_attn.o_proj.weight"],
                sd[p + "post_attention_layernorm.weight"], torch.cat(mlp), sd[p + "mlp.down_proj.weight"],
            ))  # fmt: skip
        theta = (getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta})["rope_theta"]
        inv = 1.0 / (theta ** (torch.arange(0, self.hd, 2, device=self.dev).float() / self.hd))
        freqs = torch.outer(torch.arange(max_len, device=self.dev).float(), inv)  # (S, hd/2)
        angles = torch.cat([freqs, freqs], -1)  # (S, hd), HF's rotate_half layout
        self.cos, self.sin = angles.cos().to(self.emb.dtype), angles.sin().to(self.emb.dtype)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]]] = {}

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # x (B, H, T, hd), pos (T,)
        cos, sin = self.cos[pos], self.sin[pos]  # (T, hd)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
        """Logits (B, V) of the last position; ids (B, T) at positions ``pos`` (T,); writes ks/vs (B, KV, S, hd)."""
        b, t = ids.shape
        h = self.emb[ids]  # (B, T, D)
        mask = torch.arange(self.max_len, device=self.dev)[None, :] <= pos[:, None]  # (T, S)
        q_dim, kv_dim = self.heads * self.hd, self.kv_heads * self.hd
        for (ln1, wqkv, wo, ln2, wgu, wd), kc, vc in zip(self.layers, ks, vs, strict=True):
            q, k, v = (self._rms(h, ln1) @ wqkv.T).split([q_dim, kv_dim, kv_dim], -1)  # (B, T, *)
            q = self._rope(q.view(b, t, self.heads, self.hd).transpose(1, 2), pos)  # (B, H, T, hd)
            k = self._rope(k.view(b, t, self.kv_heads, self.hd).transpose(1, 2), pos)  # (B, KV, T, hd)
            kc.index_copy_(2, pos, k)
            vc.index_copy_(2, pos, v.view(b, t, self.kv_heads, self.hd).transpose(1, 2))
            o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)  # (B, H, T, hd)
            h = h + o.transpose(1, 2).reshape(b, t, q_dim) @ wo.T
            gate, up = (self._rms(h, ln2) @ wgu.T).chunk(2, -1)  # (B, T, I) each
            h = h + (F.silu(gate) * up) @ wd.T
        return self._rms(h[:, -1], self.norm) @ self.emb.T  # (B, V)

    def _graph(self, b: int) -> tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]]:
        if b not in self.graphs:
            shape = (b, self.kv_heads, self.max_len, self.hd)
            st = {
                "tok": torch.zeros(b, 1, dtype=torch.long, device=self.dev),
                "pos": torch.zeros(1, dtype=torch.long, device=self.dev),
                "ks": [torch.zeros(shape, dtype=self.emb.dtype, device=self.dev) for _ in self.layers],
                "vs": [torch.zeros(shape, dtype=self.emb.dtype, device=self.dev) for _ in self.layers],
            }

            def step() -> None:  # the next token from the current one, then the position moves on
                st["tok"].copy_(self.forward(st["tok"], st["pos"], st["ks"], st["vs"]).argmax(-1, keepdim=True))
                st["pos"].add_(1)

            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):  # warm-up outside the graph (allocator, kernels)
                    step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            self.graphs[b] = (graph, st)
        return self.graphs[b]

    @torch.inference_mode()
    def generate(self, ids: torch.Tensor, new: int) -> list[list[int]]:
        graph, st = self._graph(ids.shape[0])
        prompt = torch.arange(ids.shape[1], device=self.dev)
        st["tok"].copy_(self.forward(ids, prompt, st["ks"], st["vs"]).argmax(-1, keepdim=True))  # eager prefill
        st["pos"].fill_(ids.shape[1])
        out = torch.empty(ids.shape[0], new, dtype=torch.long, device=self.dev)
        out[:, :1] = st["tok"]
        for i in range(1, new):
            graph.replay()
            out[:, i : i + 1] = st["tok"]
        return out.tolist()  # the one host synchronisation


def device_line() -> str:
    props = torch.cuda.get_device_properties(0)
    stack = f"ROCm {torch.version.hip}" if getattr(torch.version, "hip", None) else f"CUDA {torch.version.cuda}"
    return f"GPU: {props.name}, {props.total_memory / 2**30:.0f} GiB; torch {torch.__version__}, {stack}"


class ForwardTimer:
    """CUDA events around every forward of an engine's rank-0 shard: the GPU time of its steps."""

    def __init__(self, engine: Any):
        self.shard = engine._group.local
        self.inner = self.shard.forward
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.shard.forward = self._timed

    def _timed(self, batch: Any) -> Any:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = self.inner(batch)
        end.record()
        self.events.append((start, end))
        return out

    def take(self) -> tuple[int, float]:
        """(forwards, their GPU seconds) since the last call."""
        torch.cuda.synchronize()
        n, seconds = len(self.events), sum(s.elapsed_time(e) for s, e in self.events) / 1000
        self.events.clear()
        return n, seconds


def throughput(args: argparse.Namespace, path: Path) -> list[str]:
    """Print the table; the problems that make the run fail (ratio below --min-ratio, no replays)."""
    from transformers import AutoModelForCausalLM

    from rtpcore import Engine

    max_len = args.prompt_len + args.new_tokens
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    graph = GraphDecoder(hf, max_len)
    gen = torch.Generator().manual_seed(1)
    prompts = {b: torch.randint(3, SHAPE["vocab_size"], (b, args.prompt_len), generator=gen) for b in args.batches}
    print(f"bfloat16, prompts of {args.prompt_len} tokens, {args.new_tokens} new tokens (greedy), best of {args.repeats}")
    print(f"{'batch':>5} {'hf tok/s':>9} {'graph tok/s':>11} {'rtpcore tok/s':>13} {'rt/graph':>8} {'rt/hf':>6}"
          f" {'rt eager tok/s':>14} {'GPU ms/step':>11} {'host ms/step':>12} {'replays':>7}")
    rt_tps: dict[int, float] = {}
    problems: list[str] = []
    options: dict[str, Any] = {"dtype": "bfloat16", "device": "cuda", "max_batch_size": max(args.batches)}
    with Engine.from_pretrained(path, **options) as engine, \
            Engine.from_pretrained(path, cuda_graphs=False, **options) as eager:
        graphs = engine._group.local.graphs
        state = "off" if graphs is None else f"failed ({graphs.failure})" if graphs.failure else sorted(graphs.graphs)
        print(f"rtpcore decode graphs: {state}")
        timer = ForwardTimer(engine)
        for b, ids in prompts.items():
            on_gpu, rows = ids.cuda(), ids.tolist()
            t_hf, _ = best_time(partial(hf_generate, hf, on_gpu, args.new_tokens), args.repeats)
            t_gr, _ = best_time(partial(graph.generate, on_gpu, args.new_tokens), args.repeats)
            before = engine.stats().cuda_graph_replays_total
            timer.take()
            t_rt, _ = best_time(
                partial(engine.generate, rows, max_new_tokens=args.new_tokens, stop_token_ids=[]), args.repeats
            )
            steps, gpu_s = timer.take()
            wall_step = t_rt / args.new_tokens  # the best run's time per step
            gpu_step = gpu_s / max(steps, 1)
            replays = (engine.stats().cuda_graph_replays_total - before) // (args.repeats + 1)
            t_ea, _ = best_time(
                partial(eager.generate, rows, max_new_tokens=args.new_tokens, stop_token_ids=[]), args.repeats
            )
            pairs = (("hf", t_hf), ("graph", t_gr), ("rt", t_rt), ("eager", t_ea))
            tps = {name: b * args.new_tokens / t for name, t in pairs}
            rt_tps[b] = tps["rt"]
            ratio = tps["rt"] / tps["graph"]
            print(f"{b:5d} {tps['hf']:9.1f} {tps['graph']:11.1f} {tps['rt']:13.1f}"
                  f" {ratio:7.2f}x {tps['rt'] / tps['hf']:5.2f}x {tps['eager']:14.1f}"
                  f" {gpu_step * 1000:11.3f} {max(wall_step - gpu_step, 0.0) * 1000:12.3f} {replays:7d}")
            if ratio < args.min_ratio:
                problems.append(f"batch {b}: rtpcore is {ratio:.2f}x the graph step (target >= {args.min_ratio}x)")
            if replays == 0:
                problems.append(f"batch {b}: no decode step replayed a CUDA graph ({state})")
    del hf, graph
    torch.cuda.empty_cache()
    if args.fp8:
        b = max(args.batches)
        with Engine.from_pretrained(
            path, dtype="bfloat16", kv_cache_dtype="fp8", device="cuda", max_batch_size=b
        ) as engine:
            t, _ = best_time(
                partial(engine.generate, prompts[b].tolist(), max_new_tokens=args.new_tokens, stop_token_ids=[]),
                args.repeats,
            )
        tps = b * args.new_tokens / t
        print(f"fp8 (e4m3) KV cache, batch {b}: {tps:.1f} tok/s, {tps / rt_tps[b]:.2f}x the bf16 cache "
              "(eager decode: fp8 pools dequantize by gathering, so they take no graphs)")
    return problems


def decode_kernels(context: int, batches: list[int], repeats: int) -> None:
    """Print one layer's decode attention time at ``context`` tokens per batch size (Llama-3.2-1B's
    32 query / 8 KV heads of 64, bfloat16, 16-token blocks in random order): torch's sdpa over
    a contiguous (B, Hkv, L, D) cache, the per-block paged kernel, the split-context kernel,
    and the time ratios to the split kernel (above 1: the split kernel is faster)."""
    from rtpcore.kv.paged_attention import decode_kernel_splits, paged_decode_attention

    h, hkv, d, tpb, calls = 32, 8, 64, 16, 20
    print(f"decode attention, one layer, {context}-token contexts, bfloat16, best of {repeats} x {calls} calls")
    print(f"{'batch':>5} {'sdpa ms':>8} {'per-block ms':>12} {'split ms':>9} {'parts':>5} {'sdpa/split':>10}"
          f" {'per-block/split':>15}")
    for b in batches:
        width = -(-context // tpb)
        k = torch.randn(b * width * tpb, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        tables = torch.randperm(b * width, device="cuda").view(b, width)
        lens = torch.full((b,), context, device="cuda")
        q = torch.randn(b, h, d, device="cuda", dtype=torch.bfloat16)
        kc = torch.randn(b, hkv, context, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        parts = decode_kernel_splits(b, hkv, width * tpb)
        paged = partial(paged_decode_attention, q, k, v, tables, lens, tokens_per_block=tpb, scale=d**-0.5)
        runs = {
            "sdpa": partial(F.scaled_dot_product_attention, q[:, :, None], kc, vc, enable_gqa=True),
            "per-block": partial(paged, splits=0),
            "split": partial(paged, splits=None),
        }
        ms: dict[str, float] = {}
        for name, fn in runs.items():
            fn()  # compile
            best = float("inf")
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(calls):
                    fn()
                end.record()
                torch.cuda.synchronize()
                best = min(best, start.elapsed_time(end) / calls)
            ms[name] = best
        print(f"{b:5d} {ms['sdpa']:8.3f} {ms['per-block']:12.3f} {ms['split']:9.3f} {parts:5d}"
              f" {ms['sdpa'] / ms['split']:9.2f}x {ms['per-block'] / ms['split']:14.2f}x")
        del k, v, kc, vc
        torch.cuda.empty_cache()


def parity(args: argparse.Namespace, path: Path) -> bool:
    """rtpcore's float32 greedy tokens equal transformers' on the GPU (same weights, TF32 off)."""
    from transformers import AutoModelForCausalLM

    from rtpcore import Engine

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        gen = torch.Generator().manual_seed(2)
        ids = torch.randint(3, SHAPE["vocab_size"], (4, args.prompt_len), generator=gen)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda").eval()
        want = [hf_generate(hf, row[None].cuda(), args.parity_tokens)[0] for row in ids]
        del hf
        torch.cuda.empty_cache()
        with Engine.from_pretrained(path, dtype="float32", device="cuda", max_batch_size=len(ids)) as engine:
            got = engine.generate(ids.tolist(), max_new_tokens=args.parity_tokens, stop_token_ids=[])
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    same = sum(g == w for g, w in zip(got, want, strict=True))
    first = [next((i for i, (x, y) in enumerate(zip(g, w, strict=True)) if x != y), None) for g, w in zip(got, want, strict=True)]
    verdict = "PASS" if same == len(ids) else f"FAIL (first differing token per prompt: {first})"
    print(f"float32 greedy parity with transformers, TF32 off: {same}/{len(ids)} prompts of "
          f"{args.parity_tokens} tokens identical: {verdict}")
    return same == len(ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16, help="decoder layers (16: Llama-3.2-1B; fewer for a quick run)")
    parser.add_argument("--batches", default="1,8,64", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after a warm-up; each figure keeps its best")
    parser.add_argument("--parity-tokens", type=int, default=32, help="new tokens of the float32 parity check (0: skip it)")
    parser.add_argument("--no-fp8", dest="fp8", action="store_false", help="skip the fp8 KV cache line")
    parser.add_argument("--kernel-context", type=int, default=4096,
                        help="time one layer's decode attention kernels at this context (0: skip)")
    parser.add_argument("--min-ratio", type=float, default=0.75,
                        help="exit 3 when rtpcore is below this fraction of the graph step at any batch size")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"bench_gpu: needs a CUDA/ROCm device: torch {torch.__version__} sees none; "
              "run benchmarks/bench_decode.py for the CPU", file=sys.stderr)
        return 2
    print(device_line())
    print(f"model: Llama-3.2-1B shape, {args.layers} layers, random weights (seed 0)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama-1b-shape"
        make_model(path, args.layers, max(2048, args.prompt_len + max(args.new_tokens, args.parity_tokens)))
        problems = throughput(args, path)
        ok = parity(args, path) if args.parity_tokens > 0 else True
    if args.kernel_context > 0:
        decode_kernels(args.kernel_context, args.batches, args.repeats)
    for problem in problems:
        print(f"bench_gpu: FAIL: {problem}", file=sys.stderr)
    return 1 if not ok else 3 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

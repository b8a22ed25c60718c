"""Prompt attention over the paged KV pool: rtpcore_native's ``paged_span_attention`` against torch.

    python benchmarks/bench_prompt_attention.py [--new 256] [--contexts 256,1024,2048] [--threads 1]
        [--repeats 7] [--heads 9] [--kv-heads 3] [--head-dim 64] [--dtype float32|bfloat16]

One span of ``--new`` new tokens at the end of a context of each ``--contexts`` length (the
tokens before it cached), SmolLM2-135M's heads by default (9 query heads over 3 KV heads of 64),
one layer's float32 pool of 4,096 slots in blocks of 16 whose order is shuffled, as a serving
pool's is after a while. rtpcore: the native kernel reading the pool in place (what the
``native_cpu`` attention backend calls for every prompt chunk). torch, the peer in the same run:
the context's keys and values gathered from the pool into contiguous tensors (what the reference
backend does) and ``scaled_dot_product_attention`` with the chunk's causal mask; the gather is
timed with it. Both run on ``--threads`` threads (the kernels' pool and torch's). Per context:
the better of ``--repeats`` timings of three calls each, in process CPU time at one thread (robust
to a shared host) and wall time otherwise, GFLOP/s counting 4 x heads x head_dim per visible
(query, key) pair, and torch / rtpcore. The two outputs are compared (max abs difference printed).
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_decode import cpu_line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--contexts", default="256,1024,2048")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    from rtpcore_native import _kernels

    torch.set_num_threads(args.threads)
    _kernels.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    print(cpu_line())
    print(f"{args.threads} thread(s), torch {torch.__version__}, {args.dtype} pool, {args.new} new tokens, "
          f"{args.heads} heads / {args.kv_heads} KV heads of {args.head_dim}")
    H, Hkv, D, tpb, slots = args.heads, args.kv_heads, args.head_dim, 16, 4096
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    k_pool = torch.randn(slots, Hkv, D, generator=g).to(dtype)
    v_pool = torch.randn(slots, Hkv, D, generator=g).to(dtype)
    blocks = slots // tpb
    table = torch.randperm(blocks, generator=g).to(torch.int64).reshape(1, blocks).contiguous()
    scale = D ** -0.5

    def best(f) -> float:
        f()
        out = float("inf")
        for _ in range(args.repeats):
            t = clock()
            f(), f(), f()
            out = min(out, (clock() - t) / 3)
        return out

    def row(L: int) -> str:
        n = args.new
        if n > L or slots < L:
            raise SystemExit(f"--contexts: {L} must be within [--new, {slots}]")
        q = torch.randn(n, H, D, generator=g)
        out = torch.empty_like(q)
        spans = [torch.tensor([x], dtype=torch.int64) for x in (0, n, L, 0)]

        def ours() -> None:
            _kernels.paged_span_attention(q.data_ptr(), n, H, Hkv, D, k_pool.data_ptr(), v_pool.data_ptr(), args.dtype,
                                          slots, table.data_ptr(), 1, blocks, tpb, 1, *(s.data_ptr() for s in spans),
                                          0, scale, out.data_ptr())

        pos = torch.arange(L)
        where = table[0, pos // tpb] * tpb + pos % tpb
        mask = pos[None, :] <= (L - n + torch.arange(n))[:, None]  # (n, L): causal after the cached part
        ref: list[torch.Tensor] = []

        def peer() -> None:
            kk = k_pool[where].to(torch.float32).transpose(0, 1)  # (Hkv, L, D)
            vv = v_pool[where].to(torch.float32).transpose(0, 1)
            qq = q.transpose(0, 1)  # (H, n, D)
            ref[:] = [torch.nn.functional.scaled_dot_product_attention(
                qq, kk, vv, attn_mask=mask, scale=scale, enable_gqa=True).transpose(0, 1)]

        t_ours, t_peer = best(ours), best(peer)
        flops = 4 * H * D * int(mask.sum())
        diff = (out - ref[0]).abs().max().item()
        return (f"| {L} | {t_ours * 1e3:.2f} | {flops / t_ours / 1e9:.1f} | {t_peer * 1e3:.2f} | "
                f"{flops / t_peer / 1e9:.1f} | {t_peer / t_ours:.2f}x | {diff:.1e} |")

    print("| context | rtpcore ms | GFLOP/s | torch ms | GFLOP/s | torch / rtpcore | max abs diff |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for L in (int(x) for x in args.contexts.split(",")):
        print(row(L), flush=True)


if __name__ == "__main__":
    main()

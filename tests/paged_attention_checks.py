"""Checks of the Triton paged decode and prefill kernels, run by tests/test_paged_attention.py
and tests/test_paged_attention_split.py in a child process with ``TRITON_INTERPRET=1`` (set
before Triton is imported: Triton then runs the kernel on CPU tensors).
``python paged_attention_checks.py kernel|split|mla|prefill|atom|engine|graphs`` prints one JSON
line of results; a failed check raises (exit status 1)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))


def reference(q, k, v, tables, lens, tpb, scale, window):  # type: ignore[no-untyped-def]
    """Each sequence alone: its visible slots gathered, torch's sdpa in float32."""
    out = []
    groups = q.shape[1] // k.shape[1]
    for b in range(q.shape[0]):
        n = int(lens[b])
        pos = torch.arange(max(0, n - window) if window else 0, n)
        slots = tables[b, pos // tpb] * tpb + pos % tpb
        kk = k[slots].float().transpose(0, 1).repeat_interleave(groups, 0)  # (H, L, D)
        vv = v[slots].float().transpose(0, 1).repeat_interleave(groups, 0)
        out.append(F.scaled_dot_product_attention(q[b].float()[:, None], kk, vv, scale=scale)[:, 0])
    return torch.stack(out)


def kernel() -> dict[str, float]:
    from rtpcore.kv.paged_attention import paged_decode_attention

    gen = torch.Generator().manual_seed(0)
    worst: dict[str, float] = {}
    cases = [  # (B, H, Hkv, D, tokens per block, window)
        (3, 4, 2, 16, 4, None), (2, 8, 8, 64, 16, None), (4, 6, 2, 80, 5, None), (1, 4, 1, 32, 1, None),
        (3, 4, 2, 16, 4, 3), (2, 2, 2, 16, 8, 9),
    ]
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)):
        for b, h, hkv, d, tpb, window in cases:
            blocks = 40
            k = torch.randn(blocks * tpb, hkv, d, generator=gen).to(dtype)
            v = torch.randn(blocks * tpb, hkv, d, generator=gen).to(dtype)
            lens = torch.randint(1, 6 * tpb, (b,), generator=gen)
            width = int(-(-lens.max() // tpb))
            tables = torch.randperm(blocks, generator=gen)[: b * width].view(b, width)  # scattered blocks
            q = torch.randn(b, h, d, generator=gen).to(dtype)
            got = paged_decode_attention(q, k, v, tables, lens, tokens_per_block=tpb, scale=d**-0.5, window=window)
            assert got.dtype == dtype and got.shape == q.shape
            err = float((got.float() - reference(q, k, v, tables, lens, tpb, d**-0.5, window)).abs().max())
            assert err < tol, (dtype, b, h, hkv, d, tpb, window, err)
            key = str(dtype).removeprefix("torch.")
            worst[key] = max(worst.get(key, 0.0), err)
    return worst


def paged_pool(tpb, ctx, hkv, d, gen, *, blocks, window=None):  # type: ignore[no-untyped-def]
    """Pools of ``blocks`` blocks holding each sequence's context in scattered blocks (a
    context of 0: a padding row, its table all one spare block whose first slot holds the
    row's one visible key); every slot no query sees is NaN. Returns k, v, tables, lens."""
    used = [-(-max(n, 1) // tpb) for n in ctx]
    width = max(used)
    ids = torch.randperm(blocks, generator=gen)[: sum(used)]
    tables = torch.full((len(ctx), width), -1)  # entries past a sequence's blocks: never read
    k = torch.full((blocks * tpb, hkv, d), float("nan"))
    v = torch.full((blocks * tpb, hkv, d), float("nan"))
    lens = torch.tensor([max(n, 1) for n in ctx])
    for b, part in enumerate(ids.split(used)):
        if ctx[b] == 0:
            tables[b] = part[0]  # graph padding: every entry names the scratch block
        else:
            tables[b, : len(part)] = part
        n = int(lens[b])
        pos = torch.arange(max(0, n - window) if window else 0, n)
        slots = tables[b, pos // tpb] * tpb + pos % tpb
        k[slots] = torch.randn(len(pos), hkv, d, generator=gen)
        v[slots] = torch.randn(len(pos), hkv, d, generator=gen)
    return k, v, tables, lens


SPLIT_CASES = [  # (tokens per block, H, Hkv, D, window, context lengths, splits, tile)
    (4, 4, 2, 16, None, (5,), 1, 16),  # shorter than one tile, one part
    (4, 4, 2, 16, None, (5,), 3, 16),  # shorter than one tile: parts 1 and 2 empty
    (16, 2, 2, 16, None, (16,), 2, 16),  # exactly one tile
    (16, 2, 2, 16, None, (71,), 3, 16),  # five tiles, the last partial: parts of 32, 32, 7
    (4, 8, 2, 24, None, (70, 3, 33, 0), 4, 16),  # GQA 4:1, lengths apart, empty parts, a padding row
    (3, 2, 2, 24, 19, (70, 20, 9), 3, 16),  # a window across blocks of 3 and tiles of 16
    (5, 6, 1, 16, 40, (23, 97), 2, 16),  # GQA 6:1, a window longer than a context
    (16, 4, 2, 64, None, (300, 129, 1), 2, None),  # the default tile (128 positions for D 64)
    (16, 4, 2, 64, None, (300, 129, 1), 1, None),  # one part over several tiles: no combining
]


def split_errors(device: str) -> dict[str, float]:
    """The tiled (split-context) decode kernel on ``device`` against each sequence's dense
    attention (torch's sdpa on its gathered visible keys, on the CPU). Worst error per dtype."""
    from rtpcore.kv.paged_attention import paged_decode_attention

    gen = torch.Generator().manual_seed(3)
    worst: dict[str, float] = {}
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)):
        for tpb, h, hkv, d, window, ctx, splits, tile in SPLIT_CASES:
            k, v, tables, lens = paged_pool(tpb, ctx, hkv, d, gen, blocks=48, window=window)
            k, v = k.to(dtype), v.to(dtype)
            q = torch.randn(len(ctx), h, d, generator=gen).to(dtype)
            on = [t.to(device) for t in (q, k, v, tables, lens)]
            got = paged_decode_attention(
                *on, tokens_per_block=tpb, scale=d**-0.5, window=window, splits=splits, tile=tile
            ).cpu()
            assert got.dtype == dtype and got.shape == q.shape
            err = float((got.float() - reference(q, k, v, tables, lens, tpb, d**-0.5, window)).abs().max())
            assert err < tol, (dtype, tpb, h, hkv, d, window, ctx, splits, tile, err)
            key = str(dtype).removeprefix("torch.")
            worst[key] = max(worst.get(key, 0.0), err)
    return worst


def split() -> dict[str, float]:
    return split_errors("cpu")


MLA_CASES = [  # (H, r, R, tokens per block, context lengths, splits, tile)
    (5, 24, 8, 4, (5, 30, 17), None, None),  # the rule's parts (one here), one 64-position tile
    (16, 128, 32, 16, (100, 7), 3, 16),  # the short sequence's parts 1 and 2 are empty
    (20, 64, 16, 3, (64,), 2, 16),  # two programs of heads, whole tiles
    (4, 32, 32, 1, (1, 9, 16, 40, 0), 4, 16),  # one-token blocks, a padding row
    (16, 512, 64, 16, (70, 33), 2, None),  # DeepSeek-V3's latent and rope sizes: 32-position tiles
]


def mla_errors(device: str) -> dict[str, float]:
    """The latent kernel on ``device`` against softmax(scale * (q_lat . c + q_rope . k_pe)) @ c
    per sequence (float32 on the CPU, the float32 queries); slots no query sees are NaN."""
    from rtpcore.kv.paged_attention import paged_mla_decode

    gen = torch.Generator().manual_seed(1)
    worst: dict[str, float] = {}
    # half pools: the queries are rounded to the pool's dtype for the dots (512-wide latents)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 4e-2), (torch.float16, 5e-3)):
        for h, r, rope, tpb, ctx, splits, tile in MLA_CASES:
            rows, _, tables, lens = paged_pool(tpb, ctx, 1, r + rope, gen, blocks=80)
            latent, roped = rows[:, 0, :r].to(dtype), rows[:, 0, r:].to(dtype)
            q_lat = torch.randn(len(ctx), h, r, generator=gen)
            q_rope = torch.randn(len(ctx), h, rope, generator=gen)
            on = [t.to(device) for t in (q_lat, q_rope, latent, roped, tables, lens)]
            got = paged_mla_decode(*on, tokens_per_block=tpb, scale=0.2, splits=splits, tile=tile).cpu()
            want = []
            for i in range(len(ctx)):
                pos = torch.arange(int(lens[i]))
                slots = tables[i, pos // tpb] * tpb + pos % tpb
                c, k = latent[slots].float(), roped[slots].float()
                want.append(((q_lat[i] @ c.T + q_rope[i] @ k.T) * 0.2).softmax(-1) @ c)
            err = float((got - torch.stack(want)).abs().max())
            assert got.dtype == torch.float32 and err < tol, (dtype, h, r, rope, tpb, ctx, splits, tile, err)
            key = str(dtype).removeprefix("torch.")
            worst[key] = max(worst.get(key, 0.0), err)
    return worst


def mla() -> dict[str, float]:
    return mla_errors("cpu")


def prefill_reference(q, k, v, tables, lens, starts, tpb, scale, window):  # type: ignore[no-untyped-def]
    """Each sequence alone: its context gathered by its block table, queries at the last
    positions, a causal (and window) mask with that offset, torch's sdpa in float32."""
    out = []
    groups = q.shape[1] // k.shape[1]
    for b in range(lens.shape[0]):
        length, first, end = int(lens[b]), int(starts[b]), int(starts[b + 1])
        pos = torch.arange(length)
        slots = tables[b, pos // tpb] * tpb + pos % tpb
        kk = k[slots].float().transpose(0, 1).repeat_interleave(groups, 0)  # (H, L, D)
        vv = v[slots].float().transpose(0, 1).repeat_interleave(groups, 0)
        q_pos = (length - (end - first) + torch.arange(end - first))[:, None]  # (n, 1)
        mask = pos[None, :] <= q_pos
        if window:
            mask &= pos[None, :] > q_pos - window
        qq = q[first:end].float().transpose(0, 1)  # (H, n, D)
        out.append(F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale).transpose(0, 1))
    return torch.cat(out)


def prefill() -> dict[str, float]:
    """prefill_backend's rules under the interpreter, then the kernel on CPU tensors."""
    from rtpcore.kv.paged_attention import prefill_backend, use_backend
    from rtpcore.kv.pools import allocate_kv_caches
    from rtpcore.kv.specs import build_specs
    from rtpcore_native import KVCacheSpecDesc

    descs = [
        KVCacheSpecDesc(tag="mha", kind="mha", dtype="fp32", num_kv_heads=2, head_dim=16, tokens_per_block=4),
        KVCacheSpecDesc(tag="mla", kind="mla", dtype="fp32", kv_lora_rank=16, rope_head_dim=8, tokens_per_block=4),
    ]
    mha, mla_cache = allocate_kv_caches(build_specs(descs), 2, compute_dtype=torch.float32)
    x = torch.zeros(3, 32)
    assert prefill_backend(mha, x) == "gather"  # auto: the kernel only for CUDA tensors
    with use_backend("triton"):
        assert prefill_backend(mha, x) == "triton"
        try:
            prefill_backend(mla_cache, x)  # latents: no prefill kernel
            raise AssertionError("an MLA cache took the prefill kernel")
        except RuntimeError as e:
            assert "unquantized MHA cache" in str(e)
    return prefill_errors("cpu")


def prefill_errors(device: str) -> dict[str, float]:
    """The varlen prefill kernel on ``device`` against per-sequence dense causal attention
    (on the CPU); slots no visible position holds are NaN (read one and the output is NaN).
    The worst error per pool dtype."""
    from rtpcore.kv.paged_attention import paged_prefill_attention

    gen = torch.Generator().manual_seed(2)
    worst: dict[str, float] = {}
    cases = [  # (tokens per block, H, Hkv, D, window, query lengths, context lengths)
        (4, 4, 2, 24, None, (1, 7, 33), (19, 7, 70)),  # mixed: a decode, a prompt, a later chunk
        (16, 2, 1, 64, None, (1, 7, 33), (40, 7, 33)),
        (3, 6, 2, 24, 5, (1, 7, 33), (11, 9, 60)),  # a window shorter than the query tile
        (1, 2, 2, 64, None, (12, 5), (12, 9)),
        (16, 2, 1, 24, 20, (70, 3), (90, 3)),  # two query tiles; the short sequence's second is empty
    ]
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)):
        for tpb, h, hkv, d, window, qlens, ctx in cases:
            blocks = 48
            lens = torch.tensor(ctx)
            starts = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()])
            used = [-(-n // tpb) for n in ctx]
            width = max(used)
            ids = torch.randperm(blocks, generator=gen)[: sum(used)]  # scattered blocks
            tables = torch.full((len(ctx), width), -1)  # entries past a sequence's blocks: never read
            for b, part in enumerate(ids.split(used)):
                tables[b, : len(part)] = part
            k = torch.full((blocks * tpb, hkv, d), float("nan"))
            v = torch.full((blocks * tpb, hkv, d), float("nan"))
            for b, n in enumerate(ctx):
                pos = torch.arange(n)
                slots = tables[b, pos // tpb] * tpb + pos % tpb
                k[slots] = torch.randn(n, hkv, d, generator=gen)
                v[slots] = torch.randn(n, hkv, d, generator=gen)
            k, v = k.to(dtype), v.to(dtype)
            q = torch.randn(int(starts[-1]), h, d, generator=gen).to(dtype)
            on = [t.to(device) for t in (q, k, v, tables, lens, starts)]
            got = paged_prefill_attention(
                *on, tokens_per_block=tpb, scale=d**-0.5, window=window, max_query_len=max(qlens)
            ).cpu()
            assert got.dtype == dtype and got.shape == q.shape
            err = float((got.float() - prefill_reference(q, k, v, tables, lens, starts, tpb, d**-0.5, window)).abs().max())
            assert err < tol, (dtype, tpb, h, hkv, d, window, qlens, ctx, err)
            key = str(dtype).removeprefix("torch.")
            worst[key] = max(worst.get(key, 0.0), err)
    return worst


def atom() -> dict[str, object]:
    """atom-plugin's DeepSeek-V3 demo (MLA) decodes the same greedy tokens with the latent
    kernel as with the gather path, the MTP draft's layer included."""
    import tempfile

    from rtpcore import Engine
    from rtpcore.kv.paged_attention import use_backend
    from rtpcore.testing import demo_checkpoint

    prompts = [[256, 72, 101, 108], [256, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [256, 33]]
    with tempfile.TemporaryDirectory() as tmp:
        path = demo_checkpoint("deepseek_v3", plugins=["atom-plugin"], cache_dir=Path(tmp))
        result: dict[str, object] = {}
        for name, options in (("plain", {}), ("mtp", {"draft_model": "mtp", "num_speculative_tokens": 2})):
            with Engine.from_pretrained(path, plugins=["atom-plugin"], tokens_per_block=4, **options) as e:
                with use_backend("triton"):
                    paged = e.generate(prompts, max_new_tokens=12, stop_token_ids=[])
                with use_backend("gather"):
                    gathered = e.generate(prompts, max_new_tokens=12, stop_token_ids=[])
            assert paged == gathered, (name, paged, gathered)
            result[name] = "same"
    return result


def engine() -> dict[str, object]:
    """Greedy tokens of tiny Llama-family checkpoints (a sliding window included) with the
    kernel equal the gather path's and transformers'."""
    import tempfile

    from rtpcore import Engine
    from rtpcore.kv.paged_attention import use_backend
    from test_llama import hf_greedy, make_checkpoint

    prompts = [[5, 9, 33, 7, 81], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [100]]
    result: dict[str, object] = {}
    for variant in ("llama-gqa", "mistral-window"):
        with tempfile.TemporaryDirectory() as tmp:
            hf = make_checkpoint(Path(tmp), variant)
            expected = [hf_greedy(hf, p, 20) for p in prompts]
            # torch's modules: the native CPU decode step would serve the decodes instead of the kernel
            with Engine.from_pretrained(tmp, tokens_per_block=4, native_decode=False) as e:
                with use_backend("triton"):
                    paged = e.generate(prompts, max_new_tokens=20, stop_token_ids=[])
                with use_backend("gather"):
                    gathered = e.generate(prompts, max_new_tokens=20, stop_token_ids=[])
            assert paged == gathered == expected, (variant, paged, gathered, expected)
            result[variant] = "same"
    return result


def graphs() -> dict[str, object]:
    """Decode steps of tiny Llama-family models through DecodeGraphs' static buffers
    (``capture=False``) as wide as 1024 positions need: the rule takes the split kernel (the
    12-token window the per-block one); the logits equal the gather path's on each batch."""
    import tempfile

    from rtpcore import Engine
    from rtpcore.engine.worker.graphs import DecodeGraphs
    from rtpcore.kv import paged_attention
    from rtpcore.kv.pools import allocate_kv_caches
    from test_graphs import TPB, _batch
    from test_llama import make_checkpoint

    split_calls = 0
    split_decode_attention = paged_attention.split_decode_attention

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal split_calls
        split_calls += 1
        return split_decode_attention(*args, **kwargs)

    paged_attention.split_decode_attention = counted
    result: dict[str, object] = {}
    for variant in ("llama-gqa", "mistral-window"):
        split_calls = 0
        with tempfile.TemporaryDirectory() as tmp:
            make_checkpoint(Path(tmp), variant)
            with Engine.from_pretrained(tmp, tokens_per_block=TPB, max_batch_size=4, kv_cache_memory=1 << 20,
                                        native_decode=False) as e:  # the kernel, not the native CPU step
                blocks = 24
                caches = allocate_kv_caches(e.kv_cache_specs, blocks + 1, compute_dtype=torch.float32)
                graphs = DecodeGraphs(
                    e.model, caches, max_batch_size=4, max_positions=1024,
                    tokens_per_block=TPB, scratch_block=blocks, device="cpu", capture=False,
                )
                prompts = [[5, 9, 33, 7, 81, 2, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [100]]
                tables = torch.tensor([[7, 2, 19, 11, 0, 0, 0], [3, 14, 5, 9, 21, 16, 8], [12, 0, 0, 0, 0, 0, 0]])
                with torch.inference_mode():
                    tokens = e.model(_batch(tables, [0, 0, 0], prompts), caches).argmax(-1).tolist()
                lens = [len(p) for p in prompts]
                for _ in range(4):
                    batch = _batch(tables, lens, [[t] for t in tokens])
                    with paged_attention.use_backend("triton"):
                        got = graphs.run(batch)  # the bucket of 4: a padding row
                    with paged_attention.use_backend("gather"), torch.inference_mode():
                        want = e.model(batch, caches)
                    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
                    tokens = want.argmax(-1).tolist()
                    lens = [n + 1 for n in lens]
        result[variant] = ["same", "split" if split_calls else "per-block"]
    return result


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    checks = {
        "kernel": kernel, "split": split, "mla": mla, "prefill": prefill, "atom": atom, "engine": engine, "graphs": graphs,
    }
    print(json.dumps(checks[sys.argv[1]]()))

"""Checks of the Triton paged decode kernel, run by tests/test_paged_attention.py in a child
process with ``TRITON_INTERPRET=1`` (set before Triton is imported: Triton then runs the
kernel on CPU tensors). ``python paged_attention_checks.py kernel|engine`` prints one JSON
line of results; a failed check raises (exit status 1)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
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
            with Engine.from_pretrained(tmp, tokens_per_block=4) as e:
                with use_backend("triton"):
                    paged = e.generate(prompts, max_new_tokens=20, stop_token_ids=[])
                with use_backend("gather"):
                    gathered = e.generate(prompts, max_new_tokens=20, stop_token_ids=[])
            assert paged == gathered == expected, (variant, paged, gathered, expected)
            result[variant] = "same"
    return result


if __name__ == "__main__":
    print(json.dumps({"kernel": kernel, "engine": engine}[sys.argv[1]]()))

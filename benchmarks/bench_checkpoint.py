"""Pruned checkpoint loading: a draft model that needs one shard of a 12-shard checkpoint.

    python benchmarks/bench_checkpoint.py [--hidden 512] [--intermediate 1408] [--vocab 8192]
        [--repeats 5] [--dir PATH]

Writes a Llama checkpoint (``LlamaForCausalLM`` names and ``config.json``, random
weights, float32) in 12 shards with ``model.safetensors.index.json``: shards 1-11
hold one decoder layer each, shard 12 holds the embeddings, final norm and LM head.
Then, in the same process, after one warm-up run each, it times (median of
``--repeats``):

1. rtpcore, draft: ``load_checkpoint`` of layer 0 only (it lives in shard 1);
2. rtpcore, full: ``load_checkpoint`` of every tensor of the model;
3. rtpcore, full with ``lazy=True`` (views of the file mapping: nothing is read yet);
4. transformers ``LlamaForCausalLM.from_pretrained`` of the whole model; it also
   builds the ``nn.Module`` (rtpcore's numbers do not) and, in transformers 5,
   leaves the parameters as views of the file mapping;
5. the same plus one read of every parameter: the baseline the ratios use, since
   rtpcore's default rows return tensors whose bytes have been read.

Page cache: it cannot be dropped without privileges, so every time is a warm-cache
time (the files were just written). Bytes are the tensor bytes each path asks
for plus header bytes (rtpcore's ``LoadStats``); for transformers, the size of
every shard, all of which it maps and (row 5) reads. On a cold cache the byte
ratio is the one that matters.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from rtpcore.checkpoint import load_checkpoint

LAYER_PARTS = (
    "input_layernorm",
    "post_attention_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
PATTERNS = [
    "model.embed_tokens.weight",
    "model.norm.weight",
    "lm_head.weight",
    *(f"model.layers.{{layer}}.{p}.weight" for p in LAYER_PARTS),
]
DRAFT_PATTERNS = [f"model.layers.{{layer}}.{p}.weight" for p in LAYER_PARTS]
SHARDS = 12
LAYERS = SHARDS - 1


def make_checkpoint(path: Path, hidden: int, intermediate: int, vocab: int) -> None:
    """12 shards: layer i in shard i+1, embeddings/norm/head in shard 12, plus the index."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=vocab,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(SHARDS)]
    for name, shape in shapes.items():
        parts = name.split(".")
        slot = int(parts[2]) if parts[:2] == ["model", "layers"] else SHARDS - 1
        shards[slot][name] = torch.randn(shape, generator=gen) * 0.02
    weight_map = {}
    for i, tensors in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors"
        save_file(tensors, path / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(path)


def from_pretrained(path: Path) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)


def touch(model: torch.nn.Module) -> float:
    """Read every parameter once (faults in pages a file-mapped parameter has not read yet)."""
    with torch.no_grad():
        return sum(float(p.sum()) for p in model.parameters())


def timed(fn: Callable[[], Any], repeats: int) -> tuple[tuple[float, float], Any]:
    """((median, best) seconds, last result), after one warm-up call."""
    result = fn()  # warm-up (and page cache)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return (statistics.median(times), min(times)), result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--dir", type=Path, default=None, help="where to write the checkpoint (default: a temp dir)"
    )
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        path = args.dir or Path(tmp)
        path.mkdir(parents=True, exist_ok=True)
        make_checkpoint(path, args.hidden, args.intermediate, args.vocab)
        total = sum(p.stat().st_size for p in path.glob("*.safetensors"))

        rows = []
        full_ranges = {"layer": range(LAYERS)}
        t, w = timed(
            lambda: load_checkpoint(path, DRAFT_PATTERNS, {"layer": range(1)}), args.repeats
        )
        rows.append(("rtpcore draft (layer 0)", t, len(w.stats.files_opened), w.stats.bytes_read))
        t, w = timed(lambda: load_checkpoint(path, PATTERNS, full_ranges), args.repeats)
        rows.append(("rtpcore full model", t, len(w.stats.files_opened), w.stats.bytes_read))
        t, w = timed(lambda: load_checkpoint(path, PATTERNS, full_ranges, lazy=True), args.repeats)
        rows.append(("rtpcore full, lazy=True *", t, len(w.stats.files_opened), w.stats.bytes_read))
        del w
        t, _ = timed(lambda: from_pretrained(path), args.repeats)
        rows.append(("transformers from_pretrained *", t, SHARDS, total))
        t, _ = timed(lambda: touch(from_pretrained(path)), args.repeats)
        rows.append(("transformers from_pretrained + first read", t, SHARDS, total))

    base_t, base_b = rows[-1][1][0], rows[-1][3]  # transformers, weights actually read
    print(
        f"checkpoint: {SHARDS} shards, {total / 1e6:.1f} MB, hidden {args.hidden}, "
        f"{LAYERS} layers; torch threads {torch.get_num_threads()}; warm page cache; "
        f"{args.repeats} runs after one warm-up"
    )
    print()
    print(
        "| load | ms (median) | ms (best) | shards opened | MB | time vs baseline | bytes vs baseline |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, (med, best), files, nbytes in rows:
        print(
            f"| {name} | {med * 1e3:.1f} | {best * 1e3:.1f} | {files} of {SHARDS} | "
            f"{nbytes / 1e6:.1f} | {med / base_t:.3f} | {nbytes / base_b:.3f} |"
        )
    (draft_t, _), (full_t, _) = rows[0][1], rows[1][1]
    print()
    print("baseline: transformers from_pretrained + first read (medians).")
    print("* views of the file mapping (transformers 5 keeps parameters mapped too): pages are")
    print("  read on first touch, after the timer stops; MB is what was mapped, not yet read.")
    print(
        f"draft vs rtpcore full: time {draft_t / full_t:.3f}x, bytes {rows[0][3] / rows[1][3]:.3f}x"
    )


if __name__ == "__main__":
    main()

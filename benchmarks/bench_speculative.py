"""Speculative decoding: tokens/s with and without a draft, and the acceptance rate.

    python benchmarks/bench_speculative.py [--batches 1,8] [--ks 2,4] [--new-tokens 64]
        [--layers 24] [--hidden 768] [--draft-layers 1] [--residual-scale 0.005] [--repeats 3] [--threads N]

Random-weight models do not agree, so the pair is built to agree, honestly: a seeded
Llama target (``--hidden`` 768, ``--layers`` 24, vocab 32000: ~180M parameters, 14% of them
in the head) whose layers past the first
``--draft-layers`` have their residual branches (``o_proj`` and ``down_proj``) scaled by
``--residual-scale``, so they change its predictions a little, and a draft made of the
target's first ``--draft-layers`` layers, its final norm and its head. The target is a
real model: its upper layers still change some tokens, which the draft then gets wrong.

For each batch size it times plain greedy decoding and decoding with the draft at each
K (one warm-up, then the best of ``--repeats`` alternating rounds, same process and
threads) and prints tokens/s, the speed-up over plain decoding, the acceptance rate
(accepted / proposed) and whether the tokens are identical to plain decoding (they must
be). Then the same for atom-plugin's DeepSeek-V3 demo with ``draft_model="mtp"`` (random
weights: its acceptance is whatever it is) when atom-plugin is installed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import cpu_line


def build_pair(root: Path, layers: int, draft_layers: int, scale: float, hidden: int = 768) -> tuple[Path, Path]:
    """Write the target and its draft (see the module docstring); seeded."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128, max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    target = transformers.LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in target.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:  # decisive logits: greedy decoding neither ties nor collapses
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / p.shape[-1] ** 0.5))
        for layer in target.model.layers[draft_layers:]:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)
    target.generation_config.eos_token_id = None
    target.save_pretrained(root / "target")
    draft_config = transformers.LlamaConfig(**{**config.to_dict(), "num_hidden_layers": draft_layers})
    draft = transformers.LlamaForCausalLM(draft_config).eval()
    state = {k: v for k, v in target.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < draft_layers}
    draft.load_state_dict(state)
    draft.generation_config.eos_token_id = None
    draft.save_pretrained(root / "draft")
    return root / "target", root / "draft"


def timed(engine: Any, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]], tuple[int, int]]:
    before = engine.speculative_stats
    start = time.perf_counter()
    out = engine.generate(prompts, max_new_tokens=n, stop_token_ids=[])
    seconds = time.perf_counter() - start
    after = engine.speculative_stats
    return sum(map(len, out)) / seconds, out, (after.proposed - before.proposed, after.accepted - before.accepted)


def compare(label: str, engines: dict[str, Any], prompts: list[list[int]], n: int, repeats: int) -> None:
    """One warm-up each, then the best of ``repeats`` alternating rounds."""
    best: dict[str, float] = {}
    outs: dict[str, list[list[int]]] = {}
    counts: dict[str, tuple[int, int]] = {}
    for engine in engines.values():
        timed(engine, prompts, n)
    for _ in range(repeats):
        for name, engine in engines.items():
            rate, outs[name], counts[name] = timed(engine, prompts, n)
            best[name] = max(best.get(name, 0.0), rate)
    base = best["plain"]
    for name in engines:
        proposed, accepted = counts[name]
        acc = f"{accepted / proposed:.2f}" if proposed else "-"
        same = "yes" if outs[name] == outs["plain"] else "NO"
        print(f"{label:<12} {len(prompts):>5} {name:>8} {best[name]:>10.1f} {best[name] / base:>7.2f}x {acc:>10} {same:>5}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--ks", default="2,4")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--draft-layers", type=int, default=1)
    p.add_argument("--residual-scale", type=float, default=0.005)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--skip-mtp", action="store_true")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from rtpcore import Engine

    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    print(cpu_line())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; float32, greedy, "
          f"{args.prompt_len}-token prompts, {args.new_tokens} new tokens")
    print(f"{'model':<12} {'batch':>5} {'draft':>8} {'tok/s':>10} {'speedup':>8} {'acceptance':>10} {'same':>5}")
    gen = torch.Generator().manual_seed(1)
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = build_pair(Path(tmp), args.layers, args.draft_layers, args.residual_scale, args.hidden)
        for batch in batches:
            prompts = torch.randint(0, 32000, (batch, args.prompt_len), generator=gen).tolist()
            engines = {"plain": Engine.from_pretrained(target, max_batch_size=batch)}
            for k in ks:
                engines[f"K={k}"] = Engine.from_pretrained(
                    target, max_batch_size=batch, draft_model=draft, num_speculative_tokens=k
                )
            try:
                compare(f"llama-{args.layers}L", engines, prompts, args.new_tokens, args.repeats)
            finally:
                for engine in engines.values():
                    engine.close()
        if not args.skip_mtp:
            run_mtp(Engine, Path(tmp), batches, ks, args)
    return 0


def run_mtp(engine_cls: Any, root: Path, batches: list[int], ks: list[int], args: argparse.Namespace) -> None:
    try:
        import atom_plugin  # noqa: F401
    except ImportError:
        print("deepseek-v3 MTP: skipped (atom-plugin is not installed)")
        return
    from rtpcore.testing import demo_checkpoint

    demo = demo_checkpoint("deepseek_v3", plugins=["atom-plugin"], cache_dir=root / "demo")
    options = {"plugins": ["atom-plugin"]}
    for batch in batches:
        prompts = [[256, *range(65, 65 + args.prompt_len - 1)] for _ in range(batch)]
        engines = {"plain": engine_cls.from_pretrained(demo, max_batch_size=batch, **options)}
        for k in ks:
            engines[f"K={k}"] = engine_cls.from_pretrained(
                demo, max_batch_size=batch, draft_model="mtp", num_speculative_tokens=k, **options
            )
        try:
            compare("dsv3-demo", engines, prompts, args.new_tokens, args.repeats)
        finally:
            for engine in engines.values():
                engine.close()


if __name__ == "__main__":
    sys.exit(main())

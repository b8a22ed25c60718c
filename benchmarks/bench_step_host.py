"""Host time of an engine decode step, and whether it grows with the requests' context.

    python benchmarks/bench_step_host.py [--quick] [--requests 64] [--long 2000] [--short 128]
        [--steps 32] [--rounds 3] [--variants greedy,sampled,penalty] [--threads N] [--no-native-decode]
        [--stub-forward]

Builds a seeded tiny Llama with transformers (hidden 64, 2 layers, 4 heads, 2 KV heads,
vocabulary 512, ``max_position_embeddings`` 4096) so that the model's forward is cheap and
the engine's own per-step work shows. One ``rtpcore.Engine`` (CPU, float32,
``max_batch_size`` = ``--requests``, ``max_num_batched_tokens`` 4096, ``max_model_len`` the
long prompt plus the requests' ``max_tokens``, and the default KV cache, which is then
``max_batch_size`` sequences of ``max_model_len``: every request fits at once;
``async_scheduling=False``, so every step runs synchronously; prefix caching and the native
decode step as by default, ``--no-native-decode`` for torch's modules) runs, for each
variant and each context, ``--requests`` requests at once, each with its own seeded random
prompt of ``--long`` or ``--short`` tokens and ``ignore_eos``. Once every
request has its first token (prefill done) and after a few untimed decode steps,
``--steps`` decode steps are timed one by one (each checked to be a pure decode of every
request: one token each, nothing preempted).

Host time of a step = its wall time (``Engine.step``) minus the time spent in the model's
forward: the runner's ``forward`` and ``greedy_forward`` callables are wrapped with a timer
(on the CPU the forward is synchronous, so the timer holds all of its compute). What
remains is the engine's host work: scheduling, the step batch, the sampling rows, the
sampler (on the CPU the sampler's tensor work is host work too), the commit and the
outputs.

Variants: ``greedy`` (every row plain greedy: the device picks, no sampler), ``sampled``
(temperature 0.8, top-p 0.95, a seed per request: every row goes through the sampler) and
``penalty`` (greedy with ``repetition_penalty`` 1.1: the sampler reads each request's prompt
and output, so this variant's host work grows with the context by design). The rounds
alternate the two contexts (a slow phase of a shared host weighs on both); the table has
the median over every timed step of each pair, and the ratio host(long) / host(short):
near 1 when the per-step host work does not grow with the context.

The forward over a long context streams its KV blocks (about 64 MB here) through the CPU's
caches, so the host work after it runs on colder caches and takes longer than the same
work after a short forward: the ratio of the real engine stays above 1 even when the host
work does not grow. ``--stub-forward`` separates the two: the prefill runs the model, then
every decode forward returns at once without it (the greedy forward a fixed token for
every row, the logits forward fixed logits, so the sampler still runs), and the ratio is
the host work's own.

``--quick``: 8 timed steps, one round (explicit options win).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import cpu_line

VOCAB = 512
WARM_STEPS = 3  # untimed decode steps after the prefill
BUDGET = 4096  # max_num_batched_tokens: a few prefill steps


def make_checkpoint(path: Path) -> None:
    """The seeded tiny Llama of the module docstring, float32, no end-of-sequence id."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)


class ForwardTimer:
    """Wraps the runner's forward callables; ``seconds``: the time spent inside them. With
    ``stub``, a decode forward (every sequence one token) runs no model: the greedy forward
    returns token 5 for every row, the logits forward one fixed (rows, vocabulary) tensor."""

    def __init__(self, runner: Any, stub: bool = False, rows: int = 64):
        self.seconds = 0.0
        self.logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0))
        runner.forward = self.wrap(runner.forward, stub and self.stub_logits)
        if runner.greedy_forward is not None:
            runner.greedy_forward = self.wrap(runner.greedy_forward, stub and self.stub_picks)

    def stub_logits(self, batch: Any) -> torch.Tensor:
        return self.logits[: len(batch.query_lens)]

    def stub_picks(self, batch: Any) -> torch.Tensor:
        return torch.full((len(batch.query_lens),), 5, dtype=torch.int64)

    def wrap(self, fn: Callable[[Any], Any], stub: Callable[[Any], Any] | bool) -> Callable[[Any], Any]:
        def timed(batch: Any) -> Any:
            start = time.perf_counter()
            try:
                if callable(stub) and all(n == 1 for n in batch.query_lens) and batch.logits_indices is None:
                    return stub(batch)
                return fn(batch)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def params_for(variant: str, i: int, max_tokens: int) -> Any:
    from rtpcore.engine.sample.params import SamplingParams

    if variant == "greedy":
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    if variant == "sampled":
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8, top_p=0.95, seed=1000 + i)
    if variant == "penalty":
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, repetition_penalty=1.1)
    raise SystemExit(f"unknown variant {variant!r}; choose greedy, sampled or penalty")


def run_case(engine: Any, timer: ForwardTimer, reports: list[Any], variant: str, prompts: list[list[int]],
             steps: int, max_tokens: int) -> tuple[list[float], list[float]]:
    """Per timed decode step: (host seconds, forward seconds). ``reports``: where a step
    observer puts each step's StepReport; ``max_tokens``: enough for the first request to
    decode through the others' prefill and the timed steps."""
    core = engine.core
    n = len(prompts)
    first: set[int] = set()
    ids = [core.add_request(p, params_for(variant, i, max_tokens), lambda out, i=i: first.add(i))
           for i, p in enumerate(prompts)]
    while len(first) < n:  # prefill, and every request's first token
        engine.step()
    for _ in range(WARM_STEPS):
        engine.step()
    host, fwd = [], []
    for _ in range(steps):
        reports.clear()
        f0 = timer.seconds
        t0 = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t0
        f = timer.seconds - f0
        (report,) = reports
        if report.num_seqs != n or report.num_tokens != n or report.num_preempted:
            raise RuntimeError(f"step was not a pure decode of every request: {report}")
        host.append(wall - f)
        fwd.append(f)
    for i in ids:
        core.abort(i)
    return host, fwd


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="8 timed steps, one round")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--long", type=int, default=2000, help="prompt tokens of the long context")
    p.add_argument("--short", type=int, default=128, help="prompt tokens of the short context")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per case (default 32, quick 8)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of both contexts per variant (default 3, quick 1)")
    p.add_argument("--variants", default="greedy,sampled,penalty")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-native-decode", action="store_true", help="native_decode=False: torch's modules")
    p.add_argument("--stub-forward", action="store_true",
                   help="decode steps run no model (fixed picks or logits): the host work alone")
    args = p.parse_args(argv)
    steps = args.steps if args.steps is not None else (8 if args.quick else 32)
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
    variants = [v for v in args.variants.split(",") if v]
    if args.threads:
        torch.set_num_threads(args.threads)

    from rtpcore import Engine

    print(cpu_line())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{args.requests} requests, contexts {args.long} and {args.short} prompt tokens, {steps} timed decode "
          f"steps per case, {rounds} round(s); float32 CPU, async_scheduling=False, "
          f"native_decode={not args.no_native_decode}"
          f"{'; decode forwards stubbed (no model)' if args.stub_forward else ''}")
    rng = random.Random(0)
    lengths = {"long": args.long, "short": args.short}
    prompts = {k: [[rng.randrange(3, VOCAB) for _ in range(n)] for _ in range(args.requests)]
               for k, n in lengths.items()}
    # The first request decodes while the others prefill: room for that, the warm-up and the timed steps.
    max_tokens = -(-args.requests * max(lengths.values()) // BUDGET) + args.requests + WARM_STEPS + steps + 4
    max_len = max(lengths.values()) + max_tokens
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama-tiny"
        make_checkpoint(path)
        with Engine.from_pretrained(path, dtype="float32", device="cpu", max_batch_size=args.requests,
                                    max_model_len=max_len, max_num_batched_tokens=BUDGET,
                                    async_scheduling=False, native_decode=not args.no_native_decode) as engine:
            timer = ForwardTimer(engine.core.runner, args.stub_forward, args.requests)
            reports: list[Any] = []
            engine.add_step_observer(reports.append)
            print(f"KV cache: {engine.num_kv_blocks} blocks of {engine.config.tokens_per_block} tokens; "
                  f"max_model_len {max_len}, max_tokens {max_tokens}")
            results: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
            start = time.perf_counter()
            for variant in variants:
                for _ in range(rounds):
                    for ctx in ("long", "short"):
                        host, fwd = run_case(engine, timer, reports, variant, prompts[ctx], steps, max_tokens)
                        h, f = results.setdefault((variant, ctx), ([], []))
                        h += host
                        f += fwd
            preempted = engine.stats().preemptions_total
    print(f"ran in {time.perf_counter() - start:.0f} s; preemptions: {preempted}")
    print()
    print(f"| variant | host ms/step, {args.long} ctx | host ms/step, {args.short} ctx | ratio long/short "
          f"| forward ms/step, {args.long} ctx | forward ms/step, {args.short} ctx |")
    print("|---|---:|---:|---:|---:|---:|")
    for variant in variants:
        hl, fl = results[(variant, "long")]
        hs, fs = results[(variant, "short")]
        ml, ms = statistics.median(hl) * 1e3, statistics.median(hs) * 1e3
        print(f"| {variant} | {ml:.2f} | {ms:.2f} | {ml / ms:.2f}x | {statistics.median(fl) * 1e3:.2f} "
              f"| {statistics.median(fs) * 1e3:.2f} |")


if __name__ == "__main__":
    main()

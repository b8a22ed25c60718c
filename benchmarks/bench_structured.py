"""Grammar-constrained decoding: output tokens/s of constrained against plain decoding, and
what the grammar costs (compiling it, one matcher per request, one mask per step).

    python benchmarks/bench_structured.py [--quick] [--batch-sizes 1,16] [--tokens 1024]
        [--runs 3] [--seed 0] [--prompt-len 32] [--threads N]

Builds, in a temporary folder, the checkpoint of ``bench_serve.py`` (a seeded ~56M-parameter
Llama whose vocabulary is a byte-level BPE ``tokenizer.json`` of 32000 tokens trained on
seeded text), except that here its ``eos_token_id`` (config.json and generation_config.json)
is the tokenizer's ``</s>``: a grammar needs a stop id to end. The schema is an order
record of 30 fields, all required, no additional properties: strings with ``maxLength``,
bounded integers, enums, booleans, a nested object and an array with ``maxItems``, so that
every output is finite (about 500 tokens with this tokenizer, which was trained on
pseudo-words and spells JSON nearly one character per token).

Compile: ``GrammarCompiler`` construction (reading the tokenizer), the first
``json_schema`` of the schema on a fresh compiler (cold), the same call again (cached), a
request's matcher (``Grammar.state()``) and that matcher's first mask; medians of a few
repetitions, and the first one in the process. The first mask of a process also imports
``llguidance.torch`` (``GrammarState.fill`` does, lazily), whose ``torch.compile`` decorator
imports ``torch._dynamo``: timed once, on its own row.

Decode: one ``AsyncEngine`` (float32, CPU, ``max_batch_size`` the largest batch size). For
each batch size in ``--batch-sizes`` and each sampling (greedy, then temperature 1 with a
seed per request), that many requests are streamed at once, each with its own seeded
random prompt of ``--prompt-len`` tokens. Constrained requests carry the schema's grammar
and ``max_tokens`` ``--tokens``; each ends when its grammar is complete (finish "stop") or at
``max_tokens`` ("length"). Plain requests carry no grammar, ``ignore_eos``, and as
``max_tokens`` the number of tokens the same request (same prompt, same seed) generated
constrained in the warm-up: both modes generate the same tokens per request and the batch
shrinks the same way as requests end, so that the comparison measures the grammar and not
a different output length. One warm-up of each mode, then ``--runs`` rounds alternating
constrained and plain (a slow phase of a shared machine weighs on both); tokens/s is
generated tokens (the stop token included) over the wall time from submitting the requests
to the last one ending; the table has the medians, their ratio constrained/plain against
the target (>= 0.9x), the ratio of each round (constrained and plain adjacent in time) and
their median, the ratio by this process's CPU time (tokens per CPU second, all threads:
less sensitive than wall time to other tenants of a shared host), the mean tokens per request of
each mode, how the constrained requests ended, and how many of those the grammar ended
decode to JSON that ``json.loads`` reads, with exactly the schema's keys. During the timed
constrained rounds the script also times the engine's own grammar work where it happens
(``apply_grammar_masks`` as the sampler calls it, ``GrammarState.accept`` as the core calls it;
two clock reads each, wrapped in for the round and restored after) and reports it per
masked step and as a share of the rounds' wall time: where a constrained round's time goes,
and the ratio that share implies (1 - share) were the rest as fast as plain decoding, a
figure that other tenants of a shared host disturb less than the ratio of two wall times.

Mask: ``apply_grammar_masks`` alone (on a thread of its own, as the engine's loop thread: on
some hosts torch's parallel ops are much slower on a process's main thread), median per
step, on (N, V) random logits with N matchers that
walk the token sequences of the greedy constrained outputs of the largest batch (so the
masks are those of real positions: keys, strings, numbers), for N = each batch size, and
on (N, V) logits with no matcher (the plain path: free); the part of it that is
llguidance's bitmask fill (timed on a second walk of fresh matchers) and the per-step
``GrammarState.accept`` of the N tokens, against the plain step time of the decode table
(batch / greedy plain tok/s), and the ratio that overhead alone implies (plain step over
plain step + mask + accept). The rest of ``apply_grammar_masks`` is torch: unpacking the
bits, the masked fill, the row copies.

``--quick`` (batch sizes 1 and 4, 32 tokens, 1 run) checks that the script works: its
constrained requests end by length, before their JSON is complete; explicit options win.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
TARGET = 0.9  # constrained tokens/s over plain tokens/s, at least
EOS = "</s>"  # the stop token: a special token of bench_serve's tokenizer
IMPORT = "import llguidance.torch (once per process, at its first mask)"


def _bench(name: str) -> Any:
    """``benchmarks/<name>.py`` as a module, loaded by path (as bench_serve loads bench_decode)
    once, and registered in ``sys.modules`` (its dataclasses look their module up there)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- checkpoint and schema


def _string(n: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": n}


def _integer(lo: int, hi: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _enum(*values: str) -> dict[str, Any]:
    return {"enum": list(values)}


def _object(props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def order_schema() -> dict[str, Any]:
    """An order record: 30 required fields, no others; every value bounded."""
    boolean = {"type": "boolean"}
    return _object({
        "order_id": _string(12), "customer": _string(24), "email": _string(32),
        "country": _enum("US", "DE", "FR", "JP", "BR", "IN"), "city": _string(20), "zip": _string(8),
        "age": _integer(18, 99), "items": _integer(1, 50), "total_cents": _integer(0, 1_000_000),
        "currency": _enum("USD", "EUR", "JPY"), "paid": boolean, "gift": boolean,
        "priority": _enum("low", "normal", "high"), "channel": _enum("web", "app", "phone", "store"),
        "coupon": _string(10), "rating": _integer(1, 5), "returns": _integer(0, 9), "newsletter": boolean,
        "status": _enum("new", "packed", "shipped", "delivered", "cancelled"), "notes": _string(40),
        "weight_g": _integer(1, 50_000), "express": boolean, "warehouse": _enum("north", "south", "east", "west"),
        "carrier": _string(12), "tracking": _string(16),
        "address": _object({"street": _string(30), "number": _integer(1, 9999), "floor": _integer(0, 99)}),
        "tags": {"type": "array", "items": _string(10), "maxItems": 4},
        "language": _enum("en", "de", "fr", "ja", "pt"), "score": _integer(0, 100), "verified": boolean,
    })


def make_checkpoint(path: Path, vocab_size: int) -> tuple[int, int]:
    """bench_serve's checkpoint with ``</s>`` as its eos_token_id; (parameters, eos id)."""
    params = _bench("bench_serve").make_checkpoint(path, vocab_size)
    added = json.loads((path / "tokenizer.json").read_text())["added_tokens"]
    eos = next(t["id"] for t in added if t["content"] == EOS and t["special"])
    for name in ("config.json", "generation_config.json"):
        fields = json.loads((path / name).read_text())
        fields["eos_token_id"] = eos
        (path / name).write_text(json.dumps(fields, indent=2))
    return params, eos


# ---------------------------------------------------------------- compile


def timed_ms(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t) * 1e3, out


def compile_times(tokenizer_json: Path, schema: dict[str, Any], vocab: int, eos: int,
                  repeats: int) -> list[tuple[str, list[float]]]:
    """(what, milliseconds of each repetition, the first in this process first)."""
    from rtpcore.engine.sample.grammar import GrammarCompiler
    from rtpcore.engine.text.tokenizer import Tokenizer

    rows: dict[str, list[float]] = {k: [] for k in (
        "GrammarCompiler(Tokenizer.from_pretrained(...))", "json_schema, cold (fresh compiler)", "json_schema, cached",
        "Grammar.state() (one request's matcher)", "first mask of a fresh matcher")}
    names = list(rows)
    bits = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    for _ in range(repeats):
        ms, compiler = timed_ms(lambda: GrammarCompiler(Tokenizer.from_pretrained(tokenizer_json.parent),
                                                        vocab_size=vocab, stop_token_ids=[eos]))
        rows[names[0]].append(ms)
        ms, grammar = timed_ms(lambda c=compiler: c.json_schema(schema))
        rows[names[1]].append(ms)
        rows[names[2]].append(timed_ms(lambda c=compiler: c.json_schema(schema))[0])
        ms, state = timed_ms(grammar.state)
        rows[names[3]].append(ms)
        if "llguidance.torch" not in sys.modules:  # GrammarState.fill imports it at a process's first mask
            ms, _ = timed_ms(lambda: importlib.import_module("llguidance.torch"))
            rows[IMPORT] = [ms]
        rows[names[4]].append(timed_ms(lambda s=state: s.fill(bits, 0))[0])
    return list(rows.items())


def compile_table(rows: list[tuple[str, list[float]]]) -> str:
    lines = ["| step | median (ms) | first in process (ms) | repetitions |", "|---|---:|---:|---:|"]
    for what, ms in rows:
        lines.append(f"| {what} | {statistics.median(ms):.2f} | {ms[0]:.2f} | {len(ms)} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- decode


@dataclass
class Run:
    """One round of one mode: wall seconds, this process's CPU seconds (all its threads), and
    per request its tokens and finish reason."""
    seconds: float
    cpu_seconds: float
    tokens: list[list[int]]
    reasons: list[str]
    grammar: GrammarTime | None = None  # the engine's time in the grammar during the round

    @property
    def tok_s(self) -> float:
        return sum(map(len, self.tokens)) / self.seconds

    @property
    def tok_cpu_s(self) -> float:
        return sum(map(len, self.tokens)) / self.cpu_seconds


@dataclass
class Result:
    """One batch size and sampling: the timed rounds of each mode."""
    batch: int
    sampling: str
    constrained: list[Run]
    plain: list[Run]
    valid: int  # constrained outputs ended by the grammar that parse, with the schema's keys
    stopped: int  # constrained outputs ended by the grammar

    @property
    def ratio(self) -> float:
        return median_tok_s(self.constrained) / median_tok_s(self.plain)

    @property
    def ratios(self) -> list[float]:
        """Constrained over plain tokens/s of each round (the two are adjacent in time)."""
        return [c.tok_s / p.tok_s for c, p in zip(self.constrained, self.plain, strict=True)]

    @property
    def cpu_ratio(self) -> float:
        """The ratio of the median tokens per CPU second: less sensitive to other tenants."""
        return (statistics.median(r.tok_cpu_s for r in self.constrained)
                / statistics.median(r.tok_cpu_s for r in self.plain))


def median_tok_s(runs: Sequence[Run]) -> float:
    return statistics.median(r.tok_s for r in runs)


def mean_tokens(runs: Sequence[Run]) -> float:
    return statistics.mean(len(t) for r in runs for t in r.tokens)


@dataclass
class GrammarTime:
    """What the engine spent in the grammar: each ``apply_grammar_masks`` call that masked a
    row (seconds), and the seconds in ``GrammarState.accept``."""
    masks: list[float] = field(default_factory=list)
    accept: float = 0.0


@contextlib.contextmanager
def grammar_timer() -> Iterator[GrammarTime]:
    """Time the engine's grammar work while inside: ``apply_grammar_masks`` as the sampler
    calls it (its module global) and ``GrammarState.accept`` (as the core calls it), each
    wrapped in two clock reads; restored on exit. The wrappers run on the engine's thread."""
    from rtpcore.engine.sample import sampler
    from rtpcore.engine.sample.grammar import GrammarState

    spent = GrammarTime()
    apply, accept = sampler.apply_grammar_masks, GrammarState.accept

    def timed_apply(x: torch.Tensor, states: Sequence[Any]) -> torch.Tensor:
        t = time.perf_counter()
        out = apply(x, states)
        if out is not x:  # some row masked
            spent.masks.append(time.perf_counter() - t)
        return out

    def timed_accept(self: Any, token_id: int) -> bool:
        t = time.perf_counter()
        ok = accept(self, token_id)
        spent.accept += time.perf_counter() - t
        return ok

    sampler.apply_grammar_masks = timed_apply  # type: ignore[assignment]
    GrammarState.accept = timed_accept  # type: ignore[method-assign]
    try:
        yield spent
    finally:
        sampler.apply_grammar_masks = apply  # type: ignore[assignment]
        GrammarState.accept = accept  # type: ignore[method-assign]


async def one_run(engine: Any, prompts: list[list[int]], params: list[Any], timed: bool = False) -> Run:
    """Every request streamed at once; the wall time to the last one's end; with ``timed``,
    the engine's time in the grammar too (:func:`grammar_timer`)."""

    async def one(prompt: list[int], p: Any) -> tuple[list[int], str]:
        tokens: list[int] = []
        reason = ""
        async for out in engine.stream(prompt, p):
            tokens.extend(out.token_ids)
            reason = out.finish_reason or reason
        return tokens, reason

    with grammar_timer() if timed else contextlib.nullcontext() as spent:
        t, cpu = time.perf_counter(), time.process_time()
        outs = await asyncio.gather(*(one(prompt, p) for prompt, p in zip(prompts, params, strict=True)))
        seconds, cpu_seconds = time.perf_counter() - t, time.process_time() - cpu
    return Run(seconds, cpu_seconds, [o[0] for o in outs], [o[1] for o in outs], spent)


def valid_json(tokenizer: Any, tokens: list[int], keys: set[str]) -> bool:
    """The tokens (special ones skipped: the stop token) decode to a JSON object with ``keys``."""
    try:
        value = json.loads(tokenizer.decode(tokens, skip_special_tokens=True))
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == keys


async def bench_config(engine: Any, grammar: Any, tokenizer: Any, keys: set[str], prompts: list[list[int]],
                       sampling: str, args: argparse.Namespace) -> Result:
    """Warm-up of each mode, then ``args.runs`` alternating rounds (the module docstring)."""
    from rtpcore.engine.sample.params import SamplingParams

    temperature = 0.0 if sampling == "greedy" else 1.0
    seeds = [None if sampling == "greedy" else args.seed * 100_003 + i for i in range(len(prompts))]
    constrained = [SamplingParams(max_tokens=args.tokens, temperature=temperature, seed=s, grammar=grammar)
                   for s in seeds]
    warm = await one_run(engine, prompts, constrained)
    plain = [SamplingParams(max_tokens=max(1, len(t)), temperature=temperature, seed=s, ignore_eos=True)
             for s, t in zip(seeds, warm.tokens, strict=True)]
    await one_run(engine, prompts, plain)
    runs_c: list[Run] = []
    runs_p: list[Run] = []
    for _ in range(args.runs):
        runs_c.append(await one_run(engine, prompts, constrained, timed=True))
        runs_p.append(await one_run(engine, prompts, plain))
    ended = [t for r in runs_c for t, why in zip(r.tokens, r.reasons, strict=True) if why == "stop"]
    valid = sum(valid_json(tokenizer, t, keys) for t in ended)
    return Result(len(prompts), sampling, runs_c, runs_p, valid, len(ended))


def decode_table(results: list[Result]) -> str:
    rows = ["| batch | sampling | plain tok/s | constrained tok/s | constrained / plain | per-round ratios (median) "
            "| by CPU time | tokens/request plain, constrained | constrained ended stop / length | valid JSON / stop |",
            "|---:|---|---:|---:|---:|---|---:|---|---|---|"]
    for r in results:
        reasons = [why for run in r.constrained for why in run.reasons]
        other = len(reasons) - reasons.count("stop") - reasons.count("length")
        ends = f"{reasons.count('stop')} / {reasons.count('length')}" + (f" (+{other} other)" if other else "")
        ratios = f"{', '.join(f'{x:.2f}' for x in r.ratios)} ({statistics.median(r.ratios):.2f}x)"
        rows.append(f"| {r.batch} | {r.sampling} | {median_tok_s(r.plain):.1f} | {median_tok_s(r.constrained):.1f} "
                    f"| {r.ratio:.2f}x | {ratios} | {r.cpu_ratio:.2f}x "
                    f"| {mean_tokens(r.plain):.0f}, {mean_tokens(r.constrained):.0f} "
                    f"| {ends} | {r.valid} / {r.stopped} |")
    return "\n".join(rows)


def engine_grammar_table(results: list[Result]) -> str:
    """Per configuration, over its constrained rounds: mask steps, ms per masked step (median
    and mean), accept ms per masked step, mask + accept as a share of the wall time, and the
    ratio that share implies were the rest of a round as fast as plain decoding (1 - share)."""
    rows = ["| batch | sampling | masked steps | apply_grammar_masks ms/step (median, mean) | accept ms/step "
            "| mask + accept / wall time | implied constrained / plain |", "|---:|---|---:|---|---:|---:|---:|"]
    for r in results:
        spent = [run.grammar for run in r.constrained if run.grammar is not None]
        masks = [m for g in spent for m in g.masks]
        if not masks:
            rows.append(f"| {r.batch} | {r.sampling} | 0 | - | - | - | - |")
            continue
        accept = sum(g.accept for g in spent)
        share = (sum(masks) + accept) / sum(run.seconds for run in r.constrained)
        rows.append(f"| {r.batch} | {r.sampling} | {len(masks)} | {statistics.median(masks) * 1e3:.3f}, "
                    f"{statistics.mean(masks) * 1e3:.3f} | {accept / len(masks) * 1e3:.3f} | {share:.1%} "
                    f"| {1 - share:.2f}x |")
    return "\n".join(rows)


# ---------------------------------------------------------------- mask


@dataclass
class MaskCost:
    rows: int  # logits rows; all with a matcher, or none (``with_grammar`` False)
    with_grammar: bool
    apply_ms: float  # apply_grammar_masks per step (medians, as the others)
    fill_ms: float  # of which llguidance's bitmask fill (0 without matchers)
    accept_ms: float  # GrammarState.accept of the step's tokens
    steps: int


def walk(grammar: Any, traces: list[list[int]], steps: int, step: Callable[[list[Any]], None]) -> tuple[float, float]:
    """Fresh matchers along ``traces``; per step ``step(states)`` then every state accepts its
    token. The median ms per step of ``step`` and of the accepts (a median: a step that
    another tenant of the host preempts does not weigh)."""
    states = [grammar.state() for _ in traces]
    spent, accepted = [], []
    for k in range(steps):
        t = time.perf_counter()
        step(states)
        t2 = time.perf_counter()
        for s, trace in zip(states, traces, strict=True):
            s.accept(trace[k])
        accepted.append(time.perf_counter() - t2)
        spent.append(t2 - t)
    return statistics.median(spent) * 1e3, statistics.median(accepted) * 1e3


def mask_costs(grammar: Any, traces: list[list[int]], vocab: int, sizes: list[int], seed: int) -> list[MaskCost]:
    """Per-step mask cost with N matchers for each N in ``sizes`` (the first N traces), and
    with none on the largest batch (the module docstring)."""
    from rtpcore.engine.sample.grammar import apply_grammar_masks

    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        chosen = traces[:n]
        steps = min(len(t) for t in chosen) - 1  # the last token (the stop) needs no mask after it
        logits = torch.randn((n, vocab), generator=gen)
        bits = torch.zeros((n, (vocab + 31) // 32), dtype=torch.int32)

        def fill(states: list[Any], bits: torch.Tensor = bits) -> None:
            bits.zero_()
            for j, s in enumerate(states):
                s.fill(bits, j)

        apply_ms, accept_ms = walk(grammar, chosen, steps, lambda states, x=logits: apply_grammar_masks(x, states))
        fill_ms, _ = walk(grammar, chosen, steps, fill)
        out.append(MaskCost(n, True, apply_ms, fill_ms, accept_ms, steps))
    n = max(sizes)
    logits = torch.randn((n, vocab), generator=gen)
    none: list[Any] = [None] * n
    reps = 1000
    noop = []
    for _ in range(reps):
        t = time.perf_counter()
        apply_grammar_masks(logits, none)
        noop.append(time.perf_counter() - t)
    out.append(MaskCost(n, False, statistics.median(noop) * 1e3, 0.0, 0.0, reps))
    return out


def mask_table(costs: list[MaskCost], step_ms: dict[int, float], vocab: int) -> str:
    rows = [f"| logits (N, {vocab}) | matchers | apply_grammar_masks (ms/step) | of which llguidance fill "
            "| of which torch (unpack, masked fill) | accept N tokens (ms/step) | mask + accept / plain step "
            "| implied constrained / plain | steps timed |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in costs:
        plain = step_ms.get(c.rows)
        extra = (c.apply_ms + c.accept_ms) / plain if plain else None
        share = "n/a" if extra is None else f"{extra:.1%}"
        implied = "n/a" if extra is None or not c.with_grammar else f"{1 / (1 + extra):.2f}x"
        matchers = c.rows if c.with_grammar else 0
        fill, rest = (f"{c.fill_ms:.3f}", f"{max(0.0, c.apply_ms - c.fill_ms):.3f}") if c.with_grammar else ("-", "-")
        rows.append(f"| N = {c.rows} | {matchers} | {c.apply_ms:.3f} | {fill} | {rest} | {c.accept_ms:.3f} "
                    f"| {share} | {implied} | {c.steps} |")
    return "\n".join(rows)


# ---------------------------------------------------------------- main


async def bench_decode(ckpt: Path, grammar: Any, keys: set[str], args: argparse.Namespace) -> list[Result]:
    from tokenizers import Tokenizer

    from rtpcore.engine.async_engine import AsyncEngine

    tokenizer = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size()
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(8, vocab) for _ in range(args.prompt_len)] for _ in range(max(args.batch_sizes))]
    engine = AsyncEngine.from_pretrained(ckpt, dtype="float32", device="cpu", max_batch_size=max(args.batch_sizes))
    results = []
    try:
        for batch in args.batch_sizes:
            for sampling in ("greedy", "sampled"):
                r = await bench_config(engine, grammar, tokenizer, keys, prompts[:batch], sampling, args)
                print(f"  batch {batch} {sampling}: plain {median_tok_s(r.plain):.1f} tok/s, constrained "
                      f"{median_tok_s(r.constrained):.1f} tok/s ({r.ratio:.2f}x)", flush=True)
                results.append(r)
    finally:
        await engine.aclose()
    return results


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes are >= 1, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="batch sizes 1 and 4, 32 tokens, 1 run: checks that the script runs")
    parser.add_argument("--batch-sizes", type=parse_sizes, default=None,
                        help="concurrent requests per round, comma-separated (default 1,16)")
    parser.add_argument("--tokens", type=int, default=None,
                        help="max_tokens of a constrained request (default 1024; the schema's JSON takes ~500)")
    parser.add_argument("--runs", type=int, default=None, help="timed rounds of each mode after a warm-up (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts, the sampled requests and the logits")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    quick = args.quick
    args.batch_sizes = args.batch_sizes or ([1, 4] if quick else [1, 16])
    args.tokens = args.tokens if args.tokens is not None else (32 if quick else 1024)
    args.runs = args.runs if args.runs is not None else (1 if quick else 3)
    if min(args.tokens, args.runs, args.prompt_len) < 1:
        parser.error("--tokens, --runs and --prompt-len must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)

    serve = _bench("bench_serve")
    print(_bench("bench_decode").cpu_line())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads"
          f"{'; --quick (validation settings, not a measurement)' if quick else ''}")
    schema = order_schema()
    keys = set(schema["properties"])
    with tempfile.TemporaryDirectory(prefix="bench_structured_") as tmp:
        ckpt = Path(tmp) / "llama-56m"
        params, eos = make_checkpoint(ckpt, args.vocab_size)
        vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
        print(f"Llama {params / 1e6:.0f}M parameters, vocab {vocab}, eos {EOS} = {eos}, float32; schema of "
              f"{len(keys)} fields ({len(json.dumps(schema))} characters of JSON)", flush=True)
        compiled = compile_times(ckpt / "tokenizer.json", schema, vocab, eos, repeats=3 if quick else 5)

        from rtpcore.engine.sample.grammar import GrammarCompiler
        from rtpcore.engine.text.tokenizer import Tokenizer

        grammar = GrammarCompiler(Tokenizer.from_pretrained(ckpt), vocab_size=vocab, stop_token_ids=[eos]).json_schema(schema)
        print(f"decode: batch sizes {args.batch_sizes}, greedy and sampled (temperature 1, a seed per request), "
              f"{args.prompt_len}-token prompts, constrained max_tokens {args.tokens}, plain as long as the same "
              f"request constrained; 1 warm-up + {args.runs} alternating rounds, medians", flush=True)
        results = asyncio.run(bench_decode(ckpt, grammar, keys, args))

    biggest = next(r for r in results if r.batch == max(args.batch_sizes) and r.sampling == "greedy")
    traces = biggest.constrained[-1].tokens
    with ThreadPoolExecutor(1) as worker:  # a thread of its own, as the engine's steps run on its loop thread
        costs = worker.submit(mask_costs, grammar, traces, vocab, sorted(set(args.batch_sizes)), args.seed).result()
    step_ms = {r.batch: r.batch / median_tok_s(r.plain) * 1e3 for r in results if r.sampling == "greedy"}

    print(f"\nGrammar compile: the {len(keys)}-field schema over the {vocab}-token vocabulary\n")
    print(compile_table(compiled))
    print(f"\nDecode: constrained (the schema's grammar, max_tokens {args.tokens}) against plain (no grammar, "
          f"ignore_eos, the same tokens per request), output tokens/s\n")
    print(decode_table(results))
    print("\nTargets:")
    for r in results:
        print(serve.target_line(f"batch {r.batch} {r.sampling}: constrained tokens/s >= {TARGET}x plain",
                                r.ratio, r.ratio >= TARGET))
    print("\nIn the engine: its time in the grammar during the constrained rounds (each apply_grammar_masks "
          "call and GrammarState.accept timed where the sampler and the core call them)\n")
    print(engine_grammar_table(results))
    print("\nPer-step mask cost alone (medians per step; matchers walking the greedy constrained outputs; "
          "plain step = batch / greedy plain tok/s)\n")
    print(mask_table(costs, step_ms, vocab))
    return 0


if __name__ == "__main__":
    sys.exit(main())

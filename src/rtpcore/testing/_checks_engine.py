"""The kit's engine checks (docs/design.md §19): a request's greedy output is its own.

Each check runs a model's demo checkpoint in float32 two ways and compares the greedy tokens
exactly: ``batch_invariance`` (each prompt alone, then all in one call), ``chunked_prefill_invariance``
(a step budget of :data:`_CHUNK_BUDGET` tokens, so prompts are prefilled in chunks beside other
requests' decodes), ``prefix_cache_invariance`` (prompts sharing a prefix, their first blocks
served from the cache, against caching off), ``preemption_invariance`` (a KV pool too small for
the batch, so requests are preempted and recomputed), ``tensor_parallel`` (two gloo ranks
against one), ``draft`` (the plugin's MTP draft against none), ``hf_parity`` (the transformers
class the plugin names in ``ModelPlugin.transformers_class``) and ``graph_replay`` (decode steps
replayed from CUDA graphs against eager ones).

The reference side of each comparison reports the top :data:`_TOP` log-probabilities of every
token it chose, so a difference is judged: where the other side's token is within
:data:`_NEAR_TIE` (relative) of the reference's token in the reference's own log-probabilities,
the two are a near-tie that float rounding may flip (random-weight demo models have them), and
the rest of that prompt is not compared (the ok note says where); any other difference fails,
naming the prompt, the first new token that differs and both tokens. A check that could not bring
about what it tests (no cache hit, no preemption, no mixed step, no proposal) fails: passing it
would prove nothing. Prompts are token ids built by a fixed formula, never drawn at random; a
plugin's own (``KitContext.prompts``, ``run_check(..., prompts=)``) replace them, except in the
prefix-cache and preemption checks, whose prompts are shaped by the block size.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from rtpcore.testing.kit import CheckSkipped, KitContext, fail

__all__: list[str] = []

_NEW = 12  # new tokens per prompt in the invariance checks
_HF_NEW = 16  # new tokens per prompt in hf_parity
_LENGTHS = (5, 17, 40, 11)  # prompt lengths of the batch checks
_HF_LENGTHS = (6, 13, 24)
_CHUNK_BUDGET = 7  # max_num_batched_tokens of chunked_prefill_invariance (with max_batch_size=2)
_TOP = 5  # top log-probabilities the reference side reports per token
_NEAR_TIE = 1e-4  # a gap of log-probabilities below this, relative, is a near-tie
_FLOAT32 = {"dtype": "float32"}
_NO_CACHE = {"dtype": "float32", "enable_prefix_caching": False}


@attrs.frozen
class _Reference:
    """One prompt's greedy tokens on the reference side, and per token its top log-probabilities."""

    tokens: tuple[int, ...]
    top: tuple[Mapping[int, float], ...]


# -- the checks --------------------------------------------------------------------------------


def batch_invariance(ctx: KitContext, model_type: str) -> str | None:
    path = ctx.demo_checkpoint(model_type)
    prompts = ctx.prompts or _prompts(_vocab(path), _LENGTHS)
    with ctx.engine(path, **_NO_CACHE) as engine:
        alone = _reference(engine, prompts, _NEW, solo=True)
        batched = _generate(engine, prompts, _NEW)
    return _compare("batch_invariance", prompts, alone, batched, reference="alone", other="batched",
                    done=f"{len(prompts)} prompts, {_NEW} new tokens each")


def chunked_prefill_invariance(ctx: KitContext, model_type: str) -> str | None:
    path = ctx.demo_checkpoint(model_type)
    prompts = ctx.prompts or _prompts(_vocab(path), _LENGTHS, salt=1)
    with ctx.engine(path, **_NO_CACHE) as engine:
        alone = _reference(engine, prompts, _NEW, solo=True)
    # Two requests at a time: chunks beside one other request's decodes, and never the 3+ rows of
    # batch_invariance, so a fault of large batches fails that check alone.
    with ctx.engine(path, **_NO_CACHE, max_num_batched_tokens=_CHUNK_BUDGET, max_batch_size=2) as engine:
        chunked = _generate(engine, prompts, _NEW)
        mixed = engine.stats().mixed_steps_total
    note = _compare("chunked_prefill_invariance", prompts, alone, chunked, reference="alone", other="chunked",
                    setting=f"max_num_batched_tokens={_CHUNK_BUDGET}", done=f"{mixed} mixed prefill/decode steps")
    if mixed == 0:
        raise fail("chunked_prefill_invariance", f"no step prefilled a prompt next to another request's decode "
                                                 f"(max_num_batched_tokens={_CHUNK_BUDGET}, prompts of "
                                                 f"{_LENGTHS} tokens): the check could not force chunked prefill")
    return note


def prefix_cache_invariance(ctx: KitContext, model_type: str) -> str | None:
    path = ctx.demo_checkpoint(model_type)
    with ctx.engine(path, **_NO_CACHE) as engine:
        block = engine.config.tokens_per_block
        shared = _prompts(_vocab(path), (2 * block + 3,), salt=2)[0]  # two full blocks and a bit
        prompts = [shared + tail for tail in _prompts(_vocab(path), (4, 9, 1), salt=3)]
        alone = _reference(engine, prompts, _NEW, solo=True)
    with _logged_warnings("rtpcore.engine") as warnings, ctx.engine(path, **_FLOAT32) as engine:
        cached = [_generate(engine, [p], _NEW)[0] for p in prompts]  # one after another: later ones hit
        stats = engine.stats()
    note = _compare("prefix_cache_invariance", prompts, alone, cached, reference="uncached", other="cached",
                    done=f"{stats.prefix_cache_hits_total} of {stats.prefix_cache_queries_total} prompt tokens "
                         "served from the cache")
    if stats.prefix_cache_hits_total == 0:
        reasons = [w for w in warnings if "prefix caching is off" in w]
        if reasons:
            raise CheckSkipped(f"the model does not use the prefix cache: {reasons[0]}")
        raise fail("prefix_cache_invariance", f"prompts sharing their first {len(shared)} tokens "
                                              f"({block} per block) got no prefix-cache hit "
                                              f"({stats.prefix_cache_queries_total} tokens looked up): "
                                              "the check proved nothing")
    return note


def preemption_invariance(ctx: KitContext, model_type: str) -> str | None:
    path = ctx.demo_checkpoint(model_type)
    with ctx.engine(path, **_NO_CACHE) as engine:
        block = engine.config.tokens_per_block
        block_bytes = sum(s.block_bytes for s in [*engine.kv_cache_specs, *engine.draft_kv_cache_specs])
        # Prompts within one block, each needing a second one as it decodes; one max_model_len
        # sequence needs two blocks, so a pool of about one block per prompt runs out mid-decode.
        new = min(_NEW, block)
        lengths = (max(1, block - 1), max(1, block - 4), max(1, block // 2), max(1, block - 2))
        prompts = _prompts(_vocab(path), lengths, salt=4)
        alone = _reference(engine, prompts, new, solo=True)
    max_model_len = 2 * block
    tried = []
    for blocks in sorted({len(prompts), len(prompts) - 1, len(prompts) + 1} - {0, 1}):
        with ctx.engine(path, **_NO_CACHE, kv_cache_memory=blocks * block_bytes, max_model_len=max_model_len) \
                as engine:
            got = _generate(engine, prompts, new)
            stats = engine.stats()
        note = _compare("preemption_invariance", prompts, alone, got, reference="alone", other="preempted",
                        setting=f"{stats.kv_blocks_total} KV blocks, {stats.preemptions_total} preemptions",
                        done=f"{stats.preemptions_total} preemptions in a pool of {stats.kv_blocks_total} blocks")
        if stats.preemptions_total:
            return note
        tried.append(f"{stats.kv_blocks_total} blocks")
    raise fail("preemption_invariance", f"the check could not force a preemption: {len(prompts)} prompts of "
                                        f"{lengths} tokens with {new} new tokens each, in pools of "
                                        f"{', '.join(tried)} ({block} tokens per block, {block_bytes} bytes each)")


def tensor_parallel(ctx: KitContext, model_type: str) -> str | None:
    from rtpcore.errors import ShardingError
    from rtpcore.plugins.model_plugin import ModelPlugin

    plugin = ctx.model_class(model_type)
    shard = getattr(plugin, "tensor_parallel_shard", None)
    if shard is None or getattr(shard, "__func__", None) is getattr(ModelPlugin.tensor_parallel_shard, "__func__", None):
        raise CheckSkipped(f"{plugin.__qualname__} does not implement tensor_parallel_shard(): it runs on one "
                           "rank only")
    if _device_type(ctx) == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            raise CheckSkipped(f"tensor_parallel_size=2 on cuda needs 2 devices; torch sees "
                               f"{torch.cuda.device_count()}")
    path = ctx.demo_checkpoint(model_type)
    prompts = ctx.prompts or _prompts(_vocab(path), _LENGTHS[:3], salt=5)
    with ctx.engine(path, **_NO_CACHE) as engine:
        one = _reference(engine, prompts, _NEW, solo=False)
    with contextlib.ExitStack() as stack:
        try:
            engine = stack.enter_context(ctx.engine(path, **_NO_CACHE, tensor_parallel_size=2))
        except ShardingError as exc:
            raise CheckSkipped(f"the demo config cannot be split across 2 ranks: {exc}") from None
        except Exception as exc:
            if getattr(exc, "cause_type", None) == "ShardingError":  # a WorkerError: a worker rank's split
                raise CheckSkipped(f"the demo config cannot be split across 2 ranks: {exc}") from None
            raise
        two = _generate(engine, prompts, _NEW)
    return _compare("tensor_parallel", prompts, one, two, reference="TP=1", other="TP=2",
                    done=f"{len(prompts)} prompts batched, {_NEW} new tokens each")


def draft(ctx: KitContext, model_type: str) -> str | None:
    from rtpcore.plugins.model_plugin import call_optional

    plugin = ctx.model_class(model_type)
    path = ctx.demo_checkpoint(model_type)
    if call_optional(plugin, "mtp_draft", plugin.config_from_hf(_hf_config(path))) is None:
        raise CheckSkipped(f"{plugin.__qualname__} offers no draft (mtp_draft returns None)")
    prompts = ctx.prompts or _prompts(_vocab(path), _LENGTHS[:3], salt=6)
    with ctx.engine(path, **_NO_CACHE) as engine:
        plain = _reference(engine, prompts, _NEW, solo=False)
    with ctx.engine(path, **_NO_CACHE, draft_model="mtp") as engine:
        drafted = _generate(engine, prompts, _NEW)
        stats = engine.stats()
    accepted = f"{stats.speculative_accepted_total} of {stats.speculative_proposed_total} proposed tokens accepted"
    if stats.speculative_proposed_total and not stats.speculative_accepted_total:
        accepted += " (the random-weight draft never agreed: only rejection was exercised)"
    note = _compare("draft", prompts, plain, drafted, reference="without the draft", other='with draft_model="mtp"',
                    done=accepted)
    if stats.speculative_proposed_total == 0:
        raise fail("draft", 'with draft_model="mtp" the draft proposed no token: the check proved nothing')
    return note


def hf_parity(ctx: KitContext, model_type: str) -> str | None:
    plugin = ctx.model_class(model_type)
    name = getattr(plugin, "transformers_class", None)
    if name is None:
        raise CheckSkipped(f"{plugin.__qualname__} names no transformers class (ModelPlugin.transformers_class)")
    if not isinstance(name, str):
        raise fail("hf_parity", f"{plugin.__qualname__}.transformers_class is {name!r}; it must be the name of a "
                                "class of the transformers package (a string such as 'LlamaForCausalLM') or None")
    try:
        import transformers
    except ImportError:
        raise CheckSkipped(f"transformers is not installed (the reference {name!r} lives there)") from None
    cls = getattr(transformers, name, None)
    if cls is None:
        raise fail("hf_parity", f"{plugin.__qualname__}.transformers_class is {name!r}, which transformers "
                                f"{transformers.__version__} does not define")
    path = ctx.demo_checkpoint(model_type)
    prompts = ctx.prompts or _prompts(_vocab(path), _HF_LENGTHS, salt=7)
    expected = _transformers_greedy(cls, path, prompts, _HF_NEW)
    with ctx.engine(path, **_NO_CACHE) as engine:
        got = [_generate(engine, [p], _HF_NEW)[0] for p in prompts]
    return _compare("hf_parity", prompts, expected, got, reference=f"transformers {name}", other="rtpcore",
                    done=f"{len(prompts)} prompts, {_HF_NEW} new tokens each")


def graph_replay(ctx: KitContext, model_type: str) -> str | None:
    if _device_type(ctx) != "cuda":
        raise CheckSkipped(f"needs a CUDA device; running on {ctx.device}")
    plugin = ctx.model_class(model_type)
    path = ctx.demo_checkpoint(model_type)
    prompts = ctx.prompts or _prompts(_vocab(path), _LENGTHS, salt=8)
    with ctx.engine(path, **_NO_CACHE, cuda_graphs=False) as engine:
        eager = _reference(engine, prompts, _NEW, solo=False)
    with ctx.engine(path, **_NO_CACHE, cuda_graphs=True) as engine:
        replayed = _generate(engine, prompts, _NEW)
        stats = engine.stats()
    note = _compare("graph_replay", prompts, eager, replayed, reference="eager", other="graph replay",
                    done=f"{stats.cuda_graph_replays_total} decode steps replayed")
    if stats.cuda_graph_replays_total == 0:
        if not getattr(plugin, "decode_reads_kv_in_place", True):
            raise CheckSkipped(f"{plugin.__qualname__} sets decode_reads_kv_in_place = False: its decode steps "
                               "never replay CUDA graphs")
        raise fail("graph_replay", f"with cuda_graphs=True no decode step replayed a CUDA graph "
                                   f"({stats.eager_decode_steps_total} ran eagerly): the check proved nothing")
    return note


# -- prompts, runs and their comparison -------------------------------------------------------


def _hf_config(path: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((Path(path) / "config.json").read_text())
    return config


def _vocab(path: Path) -> int:
    vocab = _hf_config(path).get("vocab_size")
    return vocab if isinstance(vocab, int) and vocab > 1 else 256


def _prompts(vocab: int, lengths: Sequence[int], *, salt: int = 0) -> list[list[int]]:
    """Token-id prompts of ``lengths``, ids in 1..min(vocab, 256) - 1 (byte ids of the demo
    tokenizers, no special token), by a fixed formula: the same prompts on every run."""
    span = max(1, min(vocab, 256) - 1)
    return [[(salt * 61 + i * 29 + j * 17 + j * j * 7) % span + 1 for j in range(n)] for i, n in enumerate(lengths)]


def _generate(engine: Any, prompts: Sequence[Sequence[int]], new: int) -> list[list[int]]:
    """Greedy tokens of ``prompts`` in one call (batched), ``new`` each: no stop token."""
    out: list[list[int]] = engine.generate([list(p) for p in prompts], max_new_tokens=new, stop_token_ids=[])
    return out


def _reference(engine: Any, prompts: Sequence[Sequence[int]], new: int, *, solo: bool) -> list[_Reference]:
    """Greedy tokens of ``prompts`` with their top log-probabilities: each prompt in its own call
    (``solo``), else all in one."""
    from rtpcore.engine.sample.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new, logprobs=_TOP, ignore_eos=True)
    groups = [[p] for p in prompts] if solo else [list(prompts)]
    refs = []
    for group in groups:
        for result in engine.generate([{"prompt_token_ids": list(p)} for p in group], params):
            seq = result.outputs[0]
            top = tuple({**dict(s.top), s.token_id: s.logprob} for s in seq.logprobs or ())
            refs.append(_Reference(tuple(seq.token_ids), top))
    return refs


def _transformers_greedy(cls: Any, path: Path, prompts: Sequence[Sequence[int]], new: int) -> list[_Reference]:
    """The transformers class's greedy tokens (a full forward per token, float32, no stop token)."""
    import torch
    import transformers
    from packaging.version import Version

    dtype_key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    with _quiet(transformers):  # a demo checkpoint's extra tensors (MTP layers) are expected
        model = cls.from_pretrained(str(path), **{dtype_key: torch.float32}).eval()
    refs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids, tokens, tops = list(prompt), [], []
            for _ in range(new):
                logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)  # (vocab,)
                values, indices = torch.topk(logprobs, _TOP)
                token = int(torch.argmax(logprobs))
                tops.append({**dict(zip(indices.tolist(), values.tolist(), strict=True)),
                             token: float(logprobs[token])})
                tokens.append(token)
                ids.append(token)
            refs.append(_Reference(tuple(tokens), tuple(tops)))
    return refs


def _compare(check: str, prompts: Sequence[Sequence[int]], references: Sequence[_Reference],
             got: Sequence[Sequence[int]], *, reference: str, other: str, done: str, setting: str = "") -> str:
    """The ok note (``done``, then any near-ties), or the failure of ``check`` at the first
    prompt whose ``other`` tokens leave its ``reference`` tokens other than at a near-tie
    (``setting``: what the other side ran with, for the failure's first line)."""
    notes = []
    for i, (prompt, ref, tokens) in enumerate(zip(prompts, references, got, strict=True)):
        at = next((j for j, (a, b) in enumerate(zip(ref.tokens, tokens, strict=False)) if a != b), None)
        head = f"prompt {i} ({len(prompt)} tokens){', ' + setting if setting else ''}"
        if at is None:
            if len(tokens) != len(ref.tokens):
                raise fail(check, f"{head}: {other} gave {len(tokens)} new tokens, {reference} "
                                  f"{len(ref.tokens)}\n  {reference}: {list(ref.tokens)}\n  {other}: {list(tokens)}")
            continue
        want, seen = ref.tokens[at], tokens[at]
        top = ref.top[at] if at < len(ref.top) else {}
        gap = top[want] - top[seen] if want in top and seen in top else None
        if gap is not None and abs(gap) <= _NEAR_TIE * max(1.0, abs(top[want])):
            notes.append(f"prompt {i}: new tokens from {at} on not compared (near-tie {want} / {seen}, "
                         f"log-probabilities {abs(gap):.1e} apart)")
            continue
        why = (f"{reference}'s log-probabilities {top[want]:.6g} and {top[seen]:.6g}" if gap is not None
               else f"{seen} is not among {reference}'s top {_TOP}")
        raise fail(check, f"{head}: {other} output left the {reference} output at new token {at}: {reference} "
                          f"{want}, {other} {seen} ({why})\n  prompt: {_short(prompt)}\n  {reference}: "
                          f"{list(ref.tokens)}\n  {other}: {list(tokens)}")
    return "; ".join([done, *notes])


def _short(ids: Sequence[int], keep: int = 12) -> str:
    return str(list(ids)) if len(ids) <= keep else f"[{', '.join(map(str, ids[:keep]))}, ...]"


def _device_type(ctx: KitContext) -> str:
    """``cuda``, ``cpu`` or a plugin platform's device type: what ``ctx.device`` names."""
    device = str(ctx.device)
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device.split(":")[0]


@contextlib.contextmanager
def _quiet(transformers: Any) -> Iterator[None]:
    """transformers without its progress bars and load reports during the block (then as before)."""
    tlog = transformers.utils.logging
    verbosity, bars = tlog.get_verbosity(), tlog.is_progress_bar_enabled()
    tlog.set_verbosity_error()
    tlog.disable_progress_bar()
    try:
        yield
    finally:
        tlog.set_verbosity(verbosity)
        if bars:
            tlog.enable_progress_bar()


@contextlib.contextmanager
def _logged_warnings(name: str) -> Iterator[list[str]]:
    """The messages of the warnings logged under the logger ``name`` during the block."""
    messages: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = _Collect(logging.WARNING)
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)

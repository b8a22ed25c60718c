"""``Engine``: a checkpoint, the plugin that serves it, a paged KV cache, and ``generate``.

:meth:`Engine.from_pretrained` is the one place that wires the stages of
docs/design.md §1 together: allowlist -> plan -> plugins -> model type -> config ->
pruned checkpoint -> model -> KV specs -> preallocated cache. Requests run through
the engine core (``rtpcore.engine.engine_core``: admission, one mixed prefill/decode step
of every running request, per-request sampling); ``generate`` and
``rtpcore.AsyncEngine`` share it.

Scheduling (docs/design.md §13; ``rtpcore.engine.core.scheduler``): a step schedules at most
``max_num_batched_tokens`` new tokens (default ``DEFAULT_BATCHED_TOKENS``: 8192 on a GPU,
256 on the CPU, where a step of a few hundred tokens already takes tens of milliseconds),
decodes first, long prompts in chunks; KV blocks are taken on demand and a running request
is preempted (to recompute later) when none is free; at most ``max_batch_size`` requests run.

KV memory: ``kv_cache_memory`` bytes per rank when given. Otherwise, on a GPU,
``gpu_memory_utilization`` of the device's memory minus what is in use once the weights are
loaded and minus the peak of one ``max_num_batched_tokens`` step, measured at start
(``rtpcore.engine.worker.memory.gpu_kv_cache_bytes``); on the CPU, enough blocks for
``max_batch_size`` sequences of ``max_model_len`` tokens each, capped at a quarter of the
memory this process may use (physical RAM, or the cgroup memory limit when smaller:
``rtpcore.engine.worker.memory``) over all tensor-parallel ranks. A pool that cannot hold one
``max_model_len`` sequence is refused when the engine is built
(:class:`~rtpcore.errors.KVCacheCapacityError` naming both sizes, ``--max-model-len`` and
``--kv-cache-memory``), so every request that passes the ``max_model_len`` check runs.

Prefix caching (docs/design.md §14, ``enable_prefix_caching``, on by default): full KV
blocks are shared by the requests whose tokens start alike, keyed by SHA-256 over their
tokens and the engine's identity (``prefix_cache_identity``). Every KV layout takes part:
the ``compact`` fp8 layout's pool-wide scale grows by powers of two, and the paged cache then
requantizes its whole pool -- cached blocks included -- so they stay valid. A layout whose
codec declares ``prefix_cacheable = False`` (a plugin's codec whose stored bytes depend on
other blocks and that cannot keep them valid) turns caching off, with a logged reason.
Tensor-parallel ranks follow the leader's block tables. A speculative draft's cache is in
the same blocks: a block is cached once both models computed it.

``dtype="auto"``: the checkpoint's ``torch_dtype`` on a GPU (float32 when config.json
names none), float32 on the CPU (exact, and the CPU kernels' fastest path for small
batches).

Threads: ``generate`` may be called from several threads at once, and while an
``AsyncEngine`` steps the same engine. Every call adds its requests to the one
core; whichever thread holds the step lock runs the next step for all of them (the
model's forward, and every rank's collectives, is not reentrant), the others wait
for their requests to finish. ``max_batch_size`` bounds the running batch of the
whole engine. A request that fits an empty cache waits for blocks other requests
hold and never fails for that; one that could never fit fails at once.

Lifetime: ``close()`` (or leaving ``with``) waits for the step in progress, ends
every request with :class:`~rtpcore.errors.EngineClosedError`, releases the model
and the KV pools on every rank and stops the worker processes; every later call
raises EngineClosedError. A failure while the engine is being built stops every
worker it started and raises one :class:`~rtpcore.errors.RtpcoreError`.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, overload

import torch

from rtpcore.checkpoint.generation_config import eos_token_ids
from rtpcore.checkpoint.gguf.reader import release_gguf_files
from rtpcore.engine.config import EngineConfig, EngineOptions, options_signature
from rtpcore.engine.core.block_pool import BlockAllocator
from rtpcore.engine.core.outputs import EngineStats, RequestOutput, StepReport
from rtpcore.engine.core.prefix_cache import namespace_key
from rtpcore.engine.engine_core import EngineCore
from rtpcore.engine.sample.logits_processors import LogitsProcessors, resolve_logits_processors
from rtpcore.engine.sample.params import SamplingParams
from rtpcore.engine.sample.speculative import SpeculativeStats
from rtpcore.engine.text.output_processor import PromptRun
from rtpcore.engine.text.outputs import GenerationOutput
from rtpcore.engine.text.prompts import Prompt, PromptInputs, TextSide, conversations, prompt_items
from rtpcore.engine.text.tokenizer import Tokenizer
from rtpcore.engine.worker.memory import kv_cache_blocks
from rtpcore.engine.worker.rank import WARM_UP_PROMPT, max_positions, warm_up_blocks
from rtpcore.errors import (
    EngineBuildError,
    EngineClosedError,
    InvalidRequestError,
    RtpcoreError,
)
from rtpcore.plugins.loading import load_plugins
from rtpcore.plugins.resolution import PlanEntry

__all__ = ["Engine"]

logger = logging.getLogger(__name__)



def _async_scheduling(config: EngineConfig, shard: Any) -> bool:
    """``config.async_scheduling``, or when None: whether rank 0's decode steps replay captured
    CUDA graphs (a single-rank GPU engine), where the host's work is worth hiding."""
    if config.async_scheduling is not None:
        return config.async_scheduling
    graphs = shard.graphs
    return bool(config.tensor_parallel_size == 1 and graphs is not None and graphs.capture and graphs.failure is None)


class Engine:
    """A loaded model with its paged KV cache. Build it with :meth:`from_pretrained`
    (or from a resolved :class:`EngineConfig`: ``Engine(config)``)."""

    config: EngineConfig
    model_type: str
    plugins: tuple[PlanEntry, ...]  # the plan entries that were loaded
    kv_cache_specs: list[Any]  # one rtpcore_native.KVCacheSpec per layer
    num_kv_blocks: int  # blocks per layer
    hf_config: dict[str, Any]  # the parsed config.json
    model_config: Any  # what the plugin's config_from_hf returned
    device: torch.device  # where this process's weights, KV pools and sampling live (rank 0's device)
    model: Any  # the plugin's model (forward contract of rtpcore.plugins.model_plugin); None once closed
    draft: Any  # rtpcore.engine.worker.rank.LoadedModel of the speculative draft on this rank, or None
    draft_kv_cache_specs: list[Any]  # the draft's, one per layer (empty without a draft)
    kv_caches: list[Any]  # one LayerKVCache / PackedLayerKVCache per layer
    _group: Any  # rtpcore.parallel.leader.WorkerGroup: every rank's EngineShard (rank 0 here)
    max_positions: int  # the checkpoint's max_position_embeddings
    max_model_len: int  # the longest prompt + output a request may ask for (at most max_positions)
    vocab_size: int | None
    eos_token_ids: tuple[int, ...]
    _allocator: BlockAllocator
    _core: EngineCore  # the requests of every generate call and AsyncEngine
    _closed: bool
    _step_lock: threading.Lock  # one model step at a time, and close() between steps
    _text: TextSide  # the checkpoint's tokenizer and chat template, for the outputs form of generate, and chat

    @classmethod
    @options_signature
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        plugins: Iterable[str] = (),
        external_model_packages: Iterable[str] = (),
        **options: Any,
    ) -> Engine:
        """Resolve the allowlist, load the plugins and the checkpoint at ``path``, and
        preallocate the KV cache (see the module docstring for its default size).

        ``options``: the engine's options, each a field of
        :class:`~rtpcore.engine.config.EngineOptions` with its default (``inspect.signature``
        lists them all; an unknown name is a TypeError). The ones that need a word:

        ``gguf_file``: the GGUF file to load within ``path``, a Hub id's repository (that file
        alone is fetched, every part of a split set named by any part: the file carries the
        config, tokenizer and template) or a local folder holding several ``.gguf`` files.
        Without it, a Hub repository that has no config.json but exactly one GGUF model gets
        that model; several are a CheckpointError listing them (``rtpcore.checkpoint.hub``).

        ``draft_model``: speculative decoding with a draft checkpoint (any model type the
        loaded plugins serve, inferred from its config.json) or ``"mtp"`` (the target's own
        multi-token-prediction layers, when its plugin offers them); it proposes
        ``num_speculative_tokens`` tokens per step (0, the default: 4 with a draft; see
        ``rtpcore.engine.sample.speculative``).

        ``device``: ``"auto"`` (the first CUDA or ROCm device when torch sees one, else
        the CPU), ``"cpu"``, ``"cuda"`` (``"cuda:0"``), ``"cuda:N"`` or a ``torch.device``;
        ROCm GPUs are ``cuda`` devices. Weights, KV pools, step batches and sampling live
        there. With ``tensor_parallel_size`` > 1 on CUDA rank r takes ``cuda:r`` (NCCL);
        on the CPU every rank uses gloo. A malformed or unavailable device raises
        :class:`~rtpcore.errors.DeviceError` before anything is loaded.

        ``cuda_graphs``: decode steps replayed from CUDA graphs (``rtpcore.engine.worker.graphs``);
        None (the default) turns them on for a single-rank engine on a GPU, False off.

        ``max_num_batched_tokens``, ``max_model_len``, ``enable_prefix_caching`` and
        ``gpu_memory_utilization``: scheduling and sizing, see the module docstring and
        docs/design.md §13.

        ``quantization``: None, or ``"int8"`` (CPU only): every ``rtpcore.models.layers.Linear``
        keeps its weight as int8 with one scale per output channel, quantized at load (the
        checkpoint stays float; embeddings and a plugin's own tensors stay float). A weight is
        off by at most half a step of its row; tests/test_int8.py states the logits bound.
        ``"gguf"`` (the default for a GGUF checkpoint on the CPU, ``rtpcore.quantization.GgufMethod``):
        the file's quantized weights stay in their blocks; ``"none"``: float weights whatever the
        checkpoint holds (a GGUF file's quantized tensors dequantized at load).

        ``native_decode``: on the CPU, decode steps of float32 (or int8) Llama-family models
        run in ``rtpcore_native`` (``rtpcore.models.native``: one call per step), with logits
        within float32 rounding of transformers'; False keeps torch's modules, whose float32
        decode is bit-identical to transformers' (docs/design.md §6).

        ``cpu_isa``: ``"avx2"``, ``"avx512"``, ``"avx512_bf16"`` or ``"amx"`` caps the CPU kernels
        (rtpcore's, and torch's where oneDNN has not run yet in this process) as on a CPU of that
        class, for this process and its workers (``RTPCORE_CPU_ISA``); None (the default): the
        best this CPU runs, or ``RTPCORE_CPU_ISA``'s cap. A value this CPU cannot run, or an
        unknown one, is an :class:`~rtpcore.errors.RtpcoreError` naming it and what the CPU runs
        (``rtpcore.models.cpu_isa``, docs/cpu-kernels.md).

        ``async_scheduling``: outputs one step behind (docs/design.md §13): the next step is
        planned and launched while the current one runs, for steps whose rows are all plain
        greedy; other steps run synchronously (counted in ``stats().async_fallback_steps_total``).
        None (the default) turns it on where it helps, a single-rank engine whose decode steps
        replay CUDA graphs; True forces it on (on the CPU it gains nothing: for tests).

        ``logits_processors``: the names of registered logits processors (``rtpcore.logits``;
        a plugin registers them, so list it in ``plugins``) that every step's logits go through,
        in order, before the engine's own processing; their per-request arguments are
        ``SamplingParams.extra_args``. An unknown name raises
        :class:`~rtpcore.errors.LogitsProcessorError` naming ``logits_processors=`` and the
        known ones before anything loads."""
        EngineOptions.check_names(options, "Engine.from_pretrained")
        config = EngineConfig.create(path, plugins=plugins, external_model_packages=external_model_packages, **options)
        return cls.from_config(config)

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        """Build the engine a resolved :class:`EngineConfig` describes."""
        return cls(config)

    def __init__(self, config: EngineConfig):
        """Wire the stages, in order: plugins, model type, config, KV specs, weights, model, cache."""
        self.config = config
        self._closed = True  # until fully built
        self._step_lock = threading.Lock()
        self._group = None
        self._broken: RtpcoreError | None = None
        self.model = None
        self.draft = None
        self.draft_kv_cache_specs = []
        self.warm_up_seconds = 0.0  # the warm-up forward at build (EngineShard.warm_up)
        self.kv_caches = []
        self.plugins = tuple(config.plan.entries)
        self.device = torch.device(config.device)
        self.logits_processors: LogitsProcessors | None = None
        try:
            if config.logits_processors:  # an unknown name fails before any weight loads
                resolve_logits_processors(config.logits_processors, load_plugins(config.plan))
            # Every rank builds an EngineShard (rtpcore.engine.worker.rank) from the config: this process is
            # rank 0; with tensor_parallel_size > 1, ranks 1..N-1 are worker processes that load
            # exactly config.plan (no discovery) and build their part of the model.
            self._group = _start_ranks(config)
            shard = self._group.local
            self.device = torch.device(self._group.context.device)  # what the group gave rank 0
            self.hf_config = hf = shard.hf_config
            self.model_type = shard.model_type
            self.model_config = shard.model_config
            self.kv_cache_specs = shard.kv_cache_specs  # this rank's part of each layer
            self.model = shard.model
            self.draft = shard.draft
            self.draft_kv_cache_specs = list(shard.draft.kv_cache_specs) if shard.draft else []
            specs = [*self.kv_cache_specs, *self.draft_kv_cache_specs]  # the draft's blocks are the target's
            self.max_positions = max_positions(hf)
            self.max_model_len = _max_model_len(config, self.max_positions)
            self.num_kv_blocks = kv_cache_blocks(specs, config, self.max_model_len, self._group)
            self._group.run("allocate", self.num_kv_blocks)
            self.kv_caches = shard.kv_caches
            # A model that cannot run fails here, not at its first request (EngineShard.warm_up).
            if self.max_model_len > WARM_UP_PROMPT and self.num_kv_blocks >= warm_up_blocks(config.tokens_per_block):
                started = time.perf_counter()
                self._group.run("warm_up")
                self.warm_up_seconds = time.perf_counter() - started
            self.eos_token_ids = eos_token_ids(hf, Path(config.checkpoint))
            self._text = TextSide(config.checkpoint, self.eos_token_ids, self.max_model_len)  # tokenizer, template: on first use
            vocab = hf.get("vocab_size")
            self.vocab_size = vocab if isinstance(vocab, int) else None
            self._allocator = BlockAllocator(self.num_kv_blocks)
            # Rank 0 samples: the processors live here, built once, on its device.
            self.logits_processors = LogitsProcessors.build(config.logits_processors, shard.registry, config, self.device)
            self._core = EngineCore(
                forward=self._forward,
                greedy_forward=self._greedy_forward,
                allocator=self._allocator,
                tokens_per_block=config.tokens_per_block,
                max_batch_size=config.max_batch_size,
                max_num_batched_tokens=config.max_num_batched_tokens,
                eos_token_ids=self.eos_token_ids,
                max_model_len=self.max_model_len,
                vocab_size=self.vocab_size,
                block_bytes=sum(s.block_bytes for s in specs),
                draft_forward=self._draft_forward if self.draft is not None else None,
                num_speculative_tokens=config.num_speculative_tokens,
                draft_shift=1 if config.draft_model == "mtp" else 0,
                draft_max_positions=max_positions(shard.draft.hf_config) if shard.draft else None,
                device=self.device,  # per-request generators and step inputs live there
                is_broken=lambda: self.failure is not None,
                prefix_cache_namespace=self._prefix_cache_namespace(),
                counters=self._graph_counters,  # rank 0's: it steps every batch
                async_scheduling=_async_scheduling(config, shard),
                logits_processors=self.logits_processors,
            )
        except BaseException as exc:
            self._release()  # every rank's model, pools and processes
            if isinstance(exc, Exception) and not isinstance(exc, RtpcoreError):
                raise EngineBuildError(
                    f"building the engine for {config.checkpoint!r} failed: {type(exc).__name__}: {exc}",
                    checkpoint=config.checkpoint,
                ) from exc
            raise
        self._closed = False
        logger.info(
            "engine ready: model_type=%s dtype=%s kv=%s on %s, %d blocks of %d tokens, "
            "max_model_len=%d, %d tokens per step; warm-up forward %.0f ms",
            self.model_type, config.dtype, config.kv_cache_dtype, self.device, self.num_kv_blocks,
            config.tokens_per_block, self.max_model_len, config.max_num_batched_tokens,
            1000 * self.warm_up_seconds,
        )

    def prefix_cache_identity(self) -> dict[str, Any]:
        """What besides the tokens changes the bytes of a KV block: the root of every prefix
        cache key (``rtpcore.engine.core.prefix_cache``)."""
        c = self.config
        return {
            "checkpoint": str(Path(c.checkpoint).resolve()),
            "model_type": self.model_type,
            "dtype": c.dtype,
            "kv_cache_dtype": c.kv_cache_dtype,
            "kv_layouts": [getattr(s, "tag", repr(s)) for s in self.kv_cache_specs],
            "draft_model": c.draft_model,
            "draft_kv_layouts": [getattr(s, "tag", repr(s)) for s in self.draft_kv_cache_specs],
            "tokens_per_block": c.tokens_per_block,
            "tensor_parallel_size": c.tensor_parallel_size,
        }

    def _prefix_cache_namespace(self) -> bytes | None:
        """The prefix cache's root key, or None when caching is off (asked, or a layout
        cannot keep cached blocks valid: logged)."""
        if not self.config.enable_prefix_caching:
            return None
        for cache in [*self.kv_caches, *self._group.local.draft_kv_caches]:
            codec = getattr(cache, "codec", None)
            if codec is not None and getattr(codec, "prefix_cacheable", True) is False:
                logger.warning(
                    "prefix caching is off: the KV layout %r stores bytes that depend on other blocks "
                    "(its codec %s sets prefix_cacheable = False)",
                    getattr(cache.spec, "tag", "?"), type(codec).__name__,
                )
                return None
        return namespace_key(self.prefix_cache_identity())

    # -- generation ------------------------------------------------------------------------

    # Token-id prompts without sampling_params are the token-id form (the first two overloads);
    # that they also fit the third is the overlap mypy reports, and the first match is the one.
    @overload
    def generate(  # type: ignore[overload-overlap]
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int = 16,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop_token_ids: Iterable[int] | None = None,
    ) -> list[list[int]]: ...

    @overload
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        /,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop_token_ids: Iterable[int] | None = None,
    ) -> list[list[int]]: ...

    @overload
    def generate(
        self, prompts: PromptInputs, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[GenerationOutput]: ...

    def generate(
        self,
        prompts: Any,
        sampling_params: Any = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop_token_ids: Iterable[int] | None = None,
        *,
        max_new_tokens: int | None = None,
    ) -> list[list[int]] | list[GenerationOutput]:
        """Generate for each prompt, in order. Two forms, told apart by the arguments:

        **Outputs** (vLLM's ``LLM.generate``): ``generate(prompts, sampling_params=None)``
        where ``sampling_params`` is a :class:`~rtpcore.engine.sample.params.SamplingParams` (or a
        list of them, one per prompt; None: ``SamplingParams()``) and ``prompts`` is one
        prompt or a list of them, each a string, a sequence of token ids,
        ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``. Returns one
        :class:`~rtpcore.engine.text.outputs.GenerationOutput` per prompt, with
        ``SamplingParams.n`` sequences in ``.outputs`` (text, token ids, finish and stop
        reason, logprobs and their sum). Text is encoded and decoded with the checkpoint's
        tokenizer (loaded on first use) as ``rtpcore serve`` does it, so a request gives the
        server's tokens and text: stop strings end the text, ``stop_token_ids`` are added to
        the end-of-sequence ids (the checkpoint's ``eos_token_id`` and the tokenizer's
        ``eos_token``; ``ignore_eos`` drops those). This form is taken whenever
        ``sampling_params`` is given or a prompt is text or a dict.

        **Token ids** (the original form, kept): ``generate(token_id_lists,
        max_new_tokens=16, temperature=0.0, top_k=None, top_p=None, seed=None,
        stop_token_ids=None)`` -- token-id prompts and no ``sampling_params`` -- returns one
        list of new token ids per prompt. Generation of a prompt ends after
        ``max_new_tokens`` tokens or at a stop token (included in the output);
        ``stop_token_ids``, when given, replaces the checkpoint's ``eos_token_id``. Its
        keywords are refused in the outputs form, naming the SamplingParams field to use.

        With a ``seed`` every prompt samples from its own generator seeded with it, so a
        prompt's tokens depend on the prompt and the seed only, not on the batch. Bad
        prompts and settings raise :class:`~rtpcore.errors.InvalidRequestError` naming the
        argument before anything runs.

        Safe to call from several threads at once (see the module docstring): each
        call gets the tokens it would get alone, steps of different calls take turns,
        and a call waits for KV blocks other calls hold.
        """
        self._check_open()
        if not _token_id_form(prompts, sampling_params):
            old = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                   "seed": seed, "stop_token_ids": stop_token_ids}
            for name, value in old.items():
                if value is not None:
                    field = "max_tokens" if name == "max_new_tokens" else name
                    raise InvalidRequestError(
                        f"{name} is an argument of generate's token-id form (token-id prompts, no sampling_params); "
                        f"with sampling_params or text prompts give SamplingParams({field}=...)",
                        field=name, value=value,
                    )
            items = prompt_items(prompts)
            params = _per_prompt(sampling_params, len(items))
            return self._run_prompts(self._text.encode(items), params)
        if sampling_params is not None:  # the token-id form's max_new_tokens, given positionally
            if max_new_tokens is not None:
                raise TypeError("generate() got multiple values for argument 'max_new_tokens'")
            max_new_tokens = sampling_params
        return self._generate_token_ids(
            prompts, 16 if max_new_tokens is None else max_new_tokens, 0.0 if temperature is None else temperature,
            top_k, top_p, seed, stop_token_ids,
        )

    def chat(
        self,
        messages: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[GenerationOutput]:
        """Generate the answer to each conversation (vLLM's ``LLM.chat``): ``messages`` is one
        conversation (``[{"role": "user", "content": "Hi"}, ...]``; a list ``content`` of text
        parts is joined) or a list of them. Each is rendered with the checkpoint's chat
        template (``chat_template.jinja`` or ``tokenizer_config.json``'s) as
        ``/v1/chat/completions`` renders it -- ``tools`` and ``chat_template_kwargs`` reach the
        template, ``add_generation_prompt`` opens the assistant's turn -- and generated as
        :meth:`generate` does. One GenerationOutput per conversation; its ``prompt`` is the
        rendered text. Note that ``max_tokens`` is the SamplingParams' (16 by default), not
        the rest of the context as on the server when a request names none."""
        self._check_open()
        convs = conversations(messages)
        params = _per_prompt(sampling_params, len(convs))
        prompts = self._text.render(convs, add_generation_prompt=add_generation_prompt,
                                    chat_template_kwargs=chat_template_kwargs, tools=tools)
        return self._run_prompts(prompts, params)

    def get_tokenizer(self) -> Tokenizer | None:
        """The checkpoint's tokenizer (``rtpcore.engine.text.tokenizer.Tokenizer``, loaded once on
        first use), None when it has no ``tokenizer.json``."""
        self._check_open()
        return self._text.tokenizer

    def _run_prompts(self, prompts: Sequence[Prompt], params: Sequence[SamplingParams]) -> list[GenerationOutput]:
        """The outputs form of generate and chat: every prompt's requests, run together."""
        runs = [PromptRun(uuid.uuid4().hex, p, sp, self._text) for p, sp in zip(prompts, params, strict=True)]
        requests = []
        for i, run in enumerate(runs):
            ids = self._core.check_prompt(list(run.prompt.token_ids), run.requests[0][1].max_tokens,
                                          name=f"prompt {i}", index=i)
            for (request_id, p), state in zip(run.requests, run.states, strict=True):
                requests.append((ids, p, request_id, state.add))
        self._run(requests)
        return [run.output() for run in runs]

    def _generate_token_ids(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        seed: int | None,
        stop_token_ids: Iterable[int] | None,
    ) -> list[list[int]]:
        """The token-id form of generate (see there)."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise InvalidRequestError(
                f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}",
                field="max_new_tokens", value=max_new_tokens,
            )
        params = SamplingParams.create(
            temperature, top_k, top_p, max_tokens=max(max_new_tokens, 1), seed=seed,
            stop_token_ids=stop_token_ids, ignore_eos=stop_token_ids is not None,
        )
        checked = [
            self._core.check_prompt(p, max_new_tokens, name=f"prompt {i}", index=i, max_tokens_name="max_new_tokens")
            for i, p in enumerate(prompts)
        ]
        if max_new_tokens == 0 or not checked:
            return [[] for _ in checked]
        results: list[list[int]] = [[] for _ in checked]

        def collect(i: int, out: RequestOutput) -> bool:
            results[i] += out.token_ids
            return out.finished

        self._run([(p, params, uuid.uuid4().hex, functools.partial(collect, i)) for i, p in enumerate(checked)])
        return results

    def _run(self, requests: Sequence[tuple[list[int], SamplingParams, str, Callable[[RequestOutput], bool]]]) -> None:
        """Add checked requests ``(prompt ids, params, request id, on_output)`` to the core and
        step until each has ended. ``on_output`` takes every output of its request and says
        whether the request is done; one done before the core ended it (a stop string) is
        aborted. The first request's error is raised; after it, or an interrupt, nothing of
        this call keeps running."""
        errors: list[RtpcoreError] = []
        pending = set(range(len(requests)))

        def deliver(i: int, out: RequestOutput) -> None:  # runs on whichever thread steps
            if i not in pending:
                return  # ended already: this is the abort of a request its text ended
            if out.error is not None:
                errors.append(out.error)
                pending.discard(i)
            elif requests[i][3](out) or out.finished:
                pending.discard(i)
                if not out.finished:
                    self._core.abort(requests[i][2])

        for _, params, _, _ in requests:  # every request's extra_args, before any is added
            self._core.check_params(params)
        try:
            for i, (ids, params, request_id, _) in enumerate(requests):
                self._core.add_request(ids, params, functools.partial(deliver, i), request_id=request_id, checked=True)
            while pending and not errors:
                if self._step_lock.acquire(timeout=0.005):  # else another thread steps for us
                    try:
                        self._check_open()
                        if pending and not errors:
                            self._core.step()
                    finally:
                        self._step_lock.release()
        finally:
            if pending:  # an error or an interrupt: nothing of this call may keep running
                for _, _, request_id, _ in requests:
                    self._core.abort(request_id)
        if errors:
            raise errors[0]

    def check_extra_args(self, params: SamplingParams, *, field: str = "extra_args") -> None:
        """Whether the engine's logits processors take ``params.extra_args``: an
        :class:`~rtpcore.errors.InvalidRequestError` naming ``field`` when one refuses them
        (what adding the request would raise; a server names its own field, ``vllm_xargs``)."""
        self._core.check_params(params, field=field)

    def _forward(self, batch: Any) -> Any:
        """(B, vocab) logits of one step; every rank steps."""
        return self._group.run("forward", batch, sync=False)

    def _greedy_forward(self, batch: Any) -> Any:
        """(B,) greedy picks of one step whose rows are all plain greedy; every rank steps."""
        return self._group.run("forward_greedy", batch, sync=False)

    def _draft_forward(self, batch: Any) -> Any:
        """The draft's logits for one proposal step; every rank steps."""
        return self._group.run("draft_forward", batch, sync=False)

    @property
    def speculative_stats(self) -> SpeculativeStats:
        """Tokens the draft ``proposed`` and the target ``accepted`` over the engine's life
        (both 0 without a draft)."""
        self._check_open()
        return self._core.speculative_stats

    def step(self) -> bool:
        """One core step under the step lock (what AsyncEngine's loop calls); False when there
        was nothing to run. ``generate`` steps for itself; call this only to drive requests
        added to :attr:`core` by hand."""
        with self._step_lock:
            self._check_open()
            return self._core.step()

    @property
    def core(self) -> EngineCore:
        """The request-level core (``rtpcore.engine.engine_core``) that ``generate``,
        :class:`~rtpcore.engine.async_engine.AsyncEngine` and the server share: requests are
        added and aborted there, from any thread."""
        return self._core

    @property
    def text(self) -> TextSide:
        """The checkpoint's text side -- tokenizer, chat template, stop ids -- that
        ``generate``'s outputs form, ``chat``, AsyncEngine and the server share (one text path)."""
        return self._text

    def add_step_observer(self, observe: Callable[[StepReport], None]) -> None:
        """Call ``observe(report)`` after every step, on the stepping thread (metrics read what
        each step ran). It must not block; an exception it raises is logged, never the step's."""
        self._core.step_observers.append(observe)

    def stats(self) -> EngineStats:
        """Running and waiting requests, KV blocks and counters (a snapshot)."""
        self._check_open()
        return self._core.stats()

    def _graph_counters(self) -> dict[str, Any]:
        """Rank 0's CUDA-graph replays and eager decodes (looked up each time: holding the shard
        would keep its KV pools alive after close)."""
        group = self._group
        return group.local.graph_counters() if group is not None and group.local is not None else {}

    @property
    def plugin_registry(self) -> Any:
        """The registry of the loaded plugins: their models, KV layouts and tool-call parsers."""
        self._check_open()
        return self._group.local.registry

    def reset_prefix_cache(self) -> int:
        """Empty the prefix cache (after changing what a cached block would hold, or to measure
        without it); requests running keep their blocks. How many blocks were cached."""
        self._check_open()
        return self._core.reset_prefix_cache()

    @property
    def num_free_kv_blocks(self) -> int:
        """Blocks per layer no request holds (all of them between calls)."""
        self._check_open()
        return self._allocator.num_free

    @property
    def broken(self) -> RtpcoreError | None:
        """The fault that broke the worker group (a lost rank, a device fault), or None -- also
        after ``close()``: a server exits non-zero when its engine broke. A request's own fault
        never breaks the engine (docs/design.md §13)."""
        if self._group is not None and self._group.failure is not None:
            return self._group.failure
        return self._broken

    @property
    def failure(self) -> RtpcoreError | None:
        """None while the engine can step; else why it cannot (it was closed, or a rank failed
        and the worker group is broken: every later request fails). A server's health check."""
        if self._closed or self._group is None:
            return EngineClosedError("this Engine is closed")
        return self._group.failure

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("this Engine is closed: its model and KV cache are released")

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Release the model and the KV cache on every rank and stop the worker
        processes; idempotent. Every request ends with EngineClosedError at once (no
        new step starts; the calls waiting on them return); the model is released
        after the step in progress. Every later call raises EngineClosedError."""
        core = getattr(self, "_core", None)
        if core is not None:  # first, so that no generate call competes for the step lock
            core.close(EngineClosedError("this Engine is closed: its model and KV cache are released"))
        with self._step_lock:
            if self._closed:
                return
            self._closed = True
            allocator = getattr(self, "_allocator", None)
            if allocator is not None:
                allocator.close()  # calls waiting for blocks raise EngineClosedError
            self._release()

    def _release(self) -> None:
        """Drop this process's model and KV cache and close the worker group (every
        rank's shard, pools and processes); safe to call more than once."""
        self.model = None
        self.draft = None
        self.kv_caches = []
        group, self._group = self._group, None
        if group is not None and group.failure is not None:
            self._broken = group.failure
        if group is not None:
            group.close()  # stops the worker processes, if any
        # A GGUF checkpoint's files stay mapped while open_gguf keeps them (config, weights, tokenizer
        # read them in turn) or a weight views them: with the model gone, nothing does.
        release_gguf_files()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.num_kv_blocks} KV blocks"
        return f"<Engine {self.model_type} {self.config.dtype} from {self.config.checkpoint!r}, {state}>"


def _token_id_form(prompts: Any, sampling_params: Any) -> bool:
    """Whether a generate call is the token-id form: no ``sampling_params`` (or an int, the
    form's ``max_new_tokens`` given positionally) and no prompt that is text or a dict."""
    if sampling_params is not None and (isinstance(sampling_params, bool) or not isinstance(sampling_params, int)):
        return False
    if isinstance(prompts, str | Mapping):
        return False
    return not (isinstance(prompts, Sequence) and any(isinstance(p, str | Mapping) for p in prompts))


def _per_prompt(sampling_params: Any, count: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: ``SamplingParams()`` for None, one shared, or one each."""
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    if isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str | bytes) and all(
        isinstance(p, SamplingParams) for p in sampling_params
    ):
        if len(sampling_params) != count:
            raise InvalidRequestError(
                f"{len(sampling_params)} sampling_params for {count} prompts: give one SamplingParams, or one per prompt",
                field="sampling_params", value=sampling_params,
            )
        return list(sampling_params)
    raise InvalidRequestError(
        f"sampling_params must be a SamplingParams or a list of them (one per prompt), got {sampling_params!r:.80}",
        field="sampling_params", value=sampling_params,
    )


def _start_ranks(config: EngineConfig) -> Any:
    """The worker group of every rank's EngineShard: spawned on this machine, or, when
    this process was launched for ``env://`` rendezvous (torchrun), joined as rank 0
    with the other ranks running ``python -m rtpcore.parallel.leader``."""
    from rtpcore.parallel.context import env_world_size
    from rtpcore.parallel.leader import WorkerGroup

    n = config.tensor_parallel_size
    # One rank runs on config.device itself; a group is "cuda" (rank r on cuda:r, nccl) or "cpu" (gloo).
    device = config.device if n == 1 else ("cpu" if config.device == "cpu" else "cuda")
    world = env_world_size() if n > 1 else None
    if world is None:
        return WorkerGroup.spawn("rtpcore.engine.worker.rank:build_shard", config, n, plan=config.plan, device=device)
    rank = int(os.environ["RANK"])
    if world != n or rank != 0:
        raise RtpcoreError(
            f"tensor_parallel_size={n} under env:// rendezvous needs WORLD_SIZE={n} and this "
            f"process to be RANK=0 (got WORLD_SIZE={world}, RANK={rank}); "
            "ranks > 0 run `python -m rtpcore.parallel.leader`"
        )
    return WorkerGroup.join_env("rtpcore.engine.worker.rank:build_shard", config, plan=config.plan, device=device)


def _max_model_len(config: EngineConfig, max_positions: int) -> int:
    """``config.max_model_len``, or the checkpoint's context; never beyond it."""
    if config.max_model_len is None:
        return max_positions
    if config.max_model_len > max_positions:
        raise RtpcoreError(
            f"max_model_len={config.max_model_len} exceeds the checkpoint's max_position_embeddings="
            f"{max_positions} ({config.checkpoint!r}); choose at most {max_positions}"
        )
    return config.max_model_len

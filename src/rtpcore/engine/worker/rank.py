"""One rank's part of an engine: its model shard and its KV cache.

Every rank of an engine holds one :class:`EngineShard`, built from the engine's
resolved, picklable :class:`~rtpcore.engine.EngineConfig` (which carries the
plugin plan). Rank 0 is the engine's own process; with
``tensor_parallel_size > 1`` ranks 1..N-1 are worker processes that build the
same object from the config they received at start (see ``rtpcore.parallel.leader``),
so a worker never discovers plugins: it loads the parent's plan.

Tensor parallelism is the model plugin's business, through one optional
classmethod::

    local_config, slices = Plugin.tensor_parallel_shard(config, rank, world_size)

``local_config`` describes this rank's part (e.g. ``num_attention_heads / N``);
it is what ``kv_cache_descs`` and ``build_model`` receive. ``slices`` maps
weight patterns to ``(dim, start, stop)``: the checkpoint reader loads only
those parts of those tensors. ``build_model`` also receives ``parallel``, the
rank's :class:`~rtpcore.parallel.context.ParallelContext`, whose ``all_reduce`` /
``all_gather`` finish row-parallel and vocabulary-parallel layers.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import attrs
import torch

from rtpcore.checkpoint.resolve import mtp_plugin
from rtpcore.engine.worker.memory import memory_limit
from rtpcore.errors import EngineBuildError, RtpcoreError
from rtpcore.models.cpu_isa import CPU_ISA_ENV, apply_cpu_isa, native_kernels
from rtpcore.models.kernel_table import representative_linear, step_kernel
from rtpcore.models.layers import linear_kernels, weight_quantization
from rtpcore.models.native import native_decode
from rtpcore.parallel.context import ParallelContext
from rtpcore.plugins.model_plugin import call_optional, forward_contract_problem

__all__ = ["EngineShard", "LoadedModel", "build_shard"]

logger = logging.getLogger(__name__)


@attrs.frozen(eq=False)
class LoadedModel:
    """One model of a rank -- the target, or the draft of speculative decoding -- with
    the plugin that built it and the KV specs of its layers on this rank."""

    model_type: str
    plugin: Any  # the ModelPlugin class
    hf_config: dict[str, Any]
    model_config: Any  # the whole model's config
    local_config: Any  # this rank's part
    kv_cache_specs: list[Any]
    model: Any
    bytes_read: int
    attention_backends: list[Any]  # one rtpcore.attention.AttentionBackend per layer (its KV pool's)


class EngineShard:
    """A rank's model shard and KV cache; the local object of the engine's worker group.

    Steps (run on every rank by ``WorkerGroup.run``): :meth:`profile_memory` (GPU sizing),
    :meth:`allocate`, :meth:`forward`, :meth:`forward_greedy`, :meth:`draft_forward`, :meth:`stats`.

    With ``config.draft_model`` the rank also builds the draft of speculative decoding
    (docs/design.md §10) from the same plan: a checkpoint of any model type a loaded
    plugin serves, or ``"mtp"``, the target plugin's ``mtp_draft``. The draft's KV pools
    have as many blocks as the target's and share its block tables.
    """

    def __init__(self, ctx: ParallelContext, config: Any):
        from rtpcore.checkpoint import read_hf_config
        from rtpcore.plugins.loading import load_plugins

        self.ctx = ctx
        self.config = config
        # Every rank caps its CPU kernels as the engine's process did (a torchrun rank has only its config).
        apply_cpu_isa(getattr(config, "cpu_isa", None))
        self.registry = registry = load_plugins(config.plan)  # already loaded: returns the registry
        self.hf_config = read_hf_config(config.checkpoint, registry)  # a GGUF file's: its plugin's reading
        self.model_type = config.model_type or registry.infer_model_type(self.hf_config)
        plugin = registry.get(self.model_type)
        with plugin_code(registry, self.model_type, plugin, "config_from_hf", config.checkpoint):
            model_config = plugin.config_from_hf(self.hf_config)  # the whole model's config
        # The draft's configuration is checked before any weight is read: a bad draft fails fast.
        draft = _draft_source(config, registry, self.model_type, plugin, model_config, self.hf_config)
        target = _load(ctx, config, registry, config.checkpoint, self.hf_config, self.model_type, plugin, model_config)
        self.target = target
        self.model_config = target.model_config
        self.local_config = target.local_config
        self.kv_cache_specs = target.kv_cache_specs
        self.model = target.model
        self.draft: LoadedModel | None = None
        if draft is not None:
            path, hf, draft_type, draft_plugin, draft_config = draft
            self.draft = _load(
                ctx, config, registry, path, hf, draft_type, draft_plugin, draft_config,
                target=target.model if config.draft_model == "mtp" else None,
            )
        self.bytes_read = target.bytes_read + (self.draft.bytes_read if self.draft else 0)
        self.kv_caches: list[Any] = []
        self.draft_kv_caches: list[Any] = []
        self.graphs: Any = None  # rtpcore.engine.worker.graphs.DecodeGraphs when decode steps replay CUDA graphs
        self.draft_graphs: Any = None  # the same for the draft's decode steps
        self.graphs_off: str | None = None  # why decode steps run eagerly on a GPU (None: graphs, or the CPU)
        self.eager_decodes = 0  # target decode steps no graph served
        # Attention calls per backend name: each forward calls every layer's backend once.
        self.attention_calls: dict[str, int] = {}
        self._target_calls = _per_name(target.attention_backends)
        # Target steps by the kernel that ran them (rtpcore.models.kernel_table.step_kernel).
        self.kernel_calls: dict[str, int] = {}
        self._step_linear = representative_linear(self.model)
        self._draft_calls = _per_name(self.draft.attention_backends) if self.draft is not None else {}

    def _check_committable(self, pool_blocks: int) -> None:
        """Refuse, before anything is allocated, pools that ``kv_cache_prefault`` could not commit:
        more bytes than the host has available (``rtpcore.platforms.available_memory``). Writing
        them would have the OS kill the process instead of an error naming the flags."""
        from rtpcore.errors import KVCacheCapacityError
        from rtpcore.platforms import available_memory

        specs = [*self.kv_cache_specs, *(self.draft.kv_cache_specs if self.draft is not None else ())]
        ranks = self.config.tensor_parallel_size  # CPU ranks share this host's memory, each its own pool
        need = pool_blocks * sum(s.block_bytes for s in specs) * ranks
        free = available_memory()
        if need > free:
            per = f" ({ranks} ranks' pools)" if ranks > 1 else ""
            raise KVCacheCapacityError(
                f"kv_cache_prefault: the KV cache's {pool_blocks} blocks per rank ({need} bytes{per}, "
                f"{need / (1 << 30):.2f} GiB) cannot be committed: this host has {free} bytes "
                f"({free / (1 << 30):.2f} GiB) available "
                "(MemAvailable, at most the memory limit); lower --kv-cache-memory (kv_cache_memory=), or "
                "--max-batch-size / --max-model-len for the default size, or pass --no-kv-cache-prefault "
                "(kv_cache_prefault=False) to commit pages as steps first write them",
                blocks_available=pool_blocks,
            )

    def allocate(self, num_blocks: int) -> None:
        """Preallocate ``num_blocks`` KV blocks per layer (rank 0 decides the number), for
        the draft's layers too."""
        from rtpcore.kv.pools import GatherWorkspace, allocate_kv_caches, commit_pages

        self.kv_caches, self.draft_kv_caches = [], []  # free the old pools first
        self.graphs = self.draft_graphs = None
        options = {"device": self.ctx.device, "compute_dtype": self.config.torch_dtype, "layouts": self.registry}
        graphs = self.uses_cuda_graphs
        # With graphs, one more block than the engine hands out: the padding rows' scratch block.
        pool_blocks = num_blocks + 1 if graphs else num_blocks
        if self.config.kv_cache_prefault and torch.device(self.ctx.device).type == "cpu":
            self._check_committable(pool_blocks)
        # Each model's layers share their gather buffers; the draft's forward never overlaps the target's.
        self.kv_caches = allocate_kv_caches(
            self.kv_cache_specs, pool_blocks, workspace=GatherWorkspace(),
            attention_backends=self.target.attention_backends, **options,
        )
        if self.draft is not None:
            self.draft_kv_caches = allocate_kv_caches(
                self.draft.kv_cache_specs, pool_blocks, workspace=GatherWorkspace(),
                attention_backends=self.draft.attention_backends, **options,
            )
        if self.config.kv_cache_prefault:
            start = time.perf_counter()
            committed = commit_pages([*self.kv_caches, *self.draft_kv_caches])
            if committed:
                logger.info("KV cache: committed %.2f GiB of pool memory in %.1f s (kv_cache_prefault)",
                            committed / (1 << 30), time.perf_counter() - start)
        if graphs:
            from rtpcore.engine.worker.graphs import in_place_problem

            problem = in_place_problem(self.kv_caches, self.ctx.device, self.target.plugin)
            if problem is None and self.draft is not None:
                problem = in_place_problem(self.draft_kv_caches, self.ctx.device, self.draft.plugin)
            if problem is not None:
                self._no_graphs(f"decode steps run eagerly, without CUDA graphs: {problem}")
                return
            self.graphs = self._decode_graphs(self.model, self.kv_caches, num_blocks)
            if self.graphs.failure is not None:
                self.graphs_off = f"capturing a CUDA graph failed: {self.graphs.failure}"
            if self.draft is not None:  # its proposals after the first are decode steps too
                self.draft_graphs = self._decode_graphs(self.draft.model, self.draft_kv_caches, num_blocks)

    def _no_graphs(self, reason: str) -> None:
        """Decode steps stay eager: an error with ``cuda_graphs=True``, a warning otherwise."""
        if self.config.cuda_graphs is True:
            raise RtpcoreError(f"cuda_graphs=True, but {reason}; pass cuda_graphs=None to run such steps eagerly")
        self.graphs_off = reason
        if self.ctx.rank == 0:
            logger.warning("%s", reason)

    def _decode_graphs(self, model: Any, caches: list[Any], scratch_block: int) -> Any:
        from rtpcore.engine.worker.graphs import DecodeGraphs

        return DecodeGraphs(
            model,
            caches,
            max_batch_size=self.config.max_batch_size,
            max_positions=max_positions(self.hf_config),
            tokens_per_block=self.config.tokens_per_block,
            scratch_block=scratch_block,
            device=self.ctx.device,
            strict=self.config.cuda_graphs is True,
        )

    @property
    def uses_cuda_graphs(self) -> bool:
        """``config.cuda_graphs``, or when None: a single rank on a CUDA/ROCm device. Never with
        an MTP draft: it reads the target's hidden states, which a replayed graph leaves in the
        buffers of its capture rather than where the model points."""
        choice = self.config.cuda_graphs
        on_gpu = torch.device(self.ctx.device).type == "cuda"
        if self.config.draft_model == "mtp":
            if choice is True:
                raise RtpcoreError("cuda_graphs=True cannot be honoured with draft_model='mtp': the draft reads the "
                                   "target's hidden states, which a replayed graph leaves in its capture buffers")
            return False
        return bool(on_gpu and (choice if choice is not None else self.ctx.world_size == 1))

    def forward(self, batch: Any) -> torch.Tensor | None:
        """Run the model on one step's batch; (B, vocab) logits on rank 0, None elsewhere
        (so nothing travels back)."""
        return self._forward(batch, greedy=False)

    def forward_greedy(self, batch: Any) -> torch.Tensor | None:
        """The greedy picks of one step's batch (``rtpcore.engine.sample.sampler.greedy_pick``: (B,)
        int64 on the device, -1 for a row that is not finite) on rank 0, None elsewhere: for a
        step whose rows are all plain greedy. A decode graph computes them in the graph, so
        the step reads back B ids, not B rows of logits."""
        return self._forward(batch, greedy=True)

    def _forward(self, batch: Any, *, greedy: bool) -> torch.Tensor | None:
        """A decode graph where one serves ``batch``, else the model eagerly (counted for a decode
        step); the logits, or their greedy picks."""
        from rtpcore.engine.sample.sampler import greedy_pick

        _tally(self.attention_calls, self._target_calls)
        if self.graphs is not None and self.graphs.supports(batch):
            out = self.graphs.run_greedy(batch) if greedy else self.graphs.run(batch)
            key = "cuda_graph"
        else:
            if batch.is_decode:
                self.eager_decodes += 1
            with torch.inference_mode():
                out = self.model(batch, self.kv_caches)
                if greedy:
                    out = greedy_pick(out)
            key = step_kernel(self.model, batch, self._step_linear, self.config.torch_dtype)
        self.kernel_calls[key] = self.kernel_calls.get(key, 0) + 1
        return out if self.ctx.rank == 0 else None

    def warm_up(self, _: Any = None) -> None:
        """Run the model once before the engine takes requests: a prefill of
        ``WARM_UP_PROMPT`` tokens, then one decode step, into the first KV blocks, as a
        request would (a separate draft model too; an ``"mtp"`` draft, which reads the
        target's hidden states of a real step, is not). A model whose weights do not fit
        what it computes -- a tensor of the wrong shape a plugin did not declare in
        ``weight_shapes`` -- fails here, at start-up, naming its plugin and
        distribution, instead of failing every request. The blocks it wrote hold no
        request's tokens: every request writes its positions before it reads them."""
        models = [("the model", self.target, self.kv_caches)]
        if self.draft is not None and self.config.draft_model != "mtp":
            models.append(("the draft model", self.draft, self.draft_kv_caches))
        for what, loaded, caches in models:
            with plugin_code(self.registry, loaded.model_type, loaded.plugin, "warm-up", self.config.checkpoint), \
                    torch.inference_mode():
                for batch in warm_up_batches(self.config.tokens_per_block, self.ctx.device):
                    # Eagerly: a decode graph replays what its capture ran, and the step counters
                    # count requests' steps.
                    logits = loaded.model(batch, caches)
                    if self.ctx.rank == 0:
                        _check_logits(logits, batch, what, loaded.hf_config.get("vocab_size"))

    def graph_counters(self) -> dict[str, Any]:
        """This rank's target decode steps replayed from a CUDA graph, and those run eagerly; its
        attention calls by backend and its steps by kernel."""
        replays = self.graphs.replays if self.graphs is not None else 0
        return {"cuda_graph_replays_total": replays, "eager_decode_steps_total": self.eager_decodes,
                "attention_calls": dict(self.attention_calls), "kernel_calls": dict(self.kernel_calls)}

    def draft_forward(self, batch: Any) -> torch.Tensor | None:
        """The draft model's forward over its own KV pools (rank 0 gets the logits)."""
        if self.draft is None:
            raise RtpcoreError("this engine has no draft model")
        if self.draft_graphs is not None and self.draft_graphs.supports(batch):
            logits = self.draft_graphs.run(batch)
        else:
            with torch.inference_mode():
                logits = self.draft.model(batch, self.draft_kv_caches)
        _tally(self.attention_calls, self._draft_calls)
        return logits if self.ctx.rank == 0 else None

    def profile_memory(self, num_tokens: int) -> tuple[int, int, int]:
        """Measure one prefill step of ``num_tokens`` tokens on this rank's GPU (before the KV
        pools exist): (the step's peak transient bytes, free bytes, total bytes) after it."""
        from rtpcore.kv.pools import allocate_kv_caches
        from rtpcore.models.forward_batch import ForwardBatch

        device = torch.device(self.ctx.device)
        tpb = self.config.tokens_per_block
        blocks = -(-num_tokens // tpb)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        options = {"device": device, "compute_dtype": self.config.torch_dtype, "layouts": self.registry}
        caches = allocate_kv_caches(self.kv_cache_specs, blocks, attention_backends=self.target.attention_backends,
                                    **options)
        pools = torch.cuda.memory_allocated(device) - base
        n = torch.arange(num_tokens, device=device)
        batch = ForwardBatch(
            input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
            positions=n,
            slots=n,
            query_lens=(num_tokens,),
            context_lens=torch.tensor([num_tokens], device=device),
            block_tables=torch.arange(blocks, device=device)[None],
            tokens_per_block=tpb,
            host_max_context_len=num_tokens,
            host_context_lens=(num_tokens,),
        )
        with torch.inference_mode():
            self.model(batch, caches)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base - pools
        del caches, batch
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return max(0, peak), int(free), int(total)

    def stats(self, _: Any = None) -> dict[str, Any]:
        """What this rank holds: for tests and diagnostics."""
        params = 0  # elements of every parameter and buffer (weights may be either)
        for model in (self.model, self.draft.model if self.draft else None):
            if isinstance(model, torch.nn.Module):
                params += sum(t.numel() for t in [*model.parameters(), *model.buffers()])
        specs = [*self.kv_cache_specs, *(self.draft.kv_cache_specs if self.draft else ())]
        native = native_kernels()
        return {
            "rank": self.ctx.rank,
            "bytes_read": self.bytes_read,
            "elements": params,
            "kv_block_bytes": sum(s.block_bytes for s in specs),
            # the CPU kernels this rank's process runs, and the caps it holds (rtpcore.models.cpu_isa)
            "cpu_kernels": None if native is None else str(native.isa()),
            "cpu_isa": os.environ.get(CPU_ISA_ENV),
            "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
        }


def _draft_source(
    config: Any, registry: Any, model_type: str, plugin: Any, model_config: Any, hf_config: dict[str, Any]
) -> tuple[str, dict[str, Any], str, Any, Any] | None:
    """(checkpoint, config.json, model type, plugin, config) of the engine's draft, or None."""
    from rtpcore.checkpoint import read_hf_config

    path = config.draft_model
    if path is None:
        return None
    if path == "mtp":
        draft_plugin = mtp_plugin(plugin, model_type, model_config, config.checkpoint)
        return config.checkpoint, hf_config, str(draft_plugin.model_type), draft_plugin, draft_plugin.config_from_hf(hf_config)
    hf = read_hf_config(path, registry)
    draft_type = registry.infer_model_type(hf)
    draft_plugin = registry.get(draft_type)
    target_vocab, draft_vocab = hf_config.get("vocab_size"), hf.get("vocab_size")
    if target_vocab != draft_vocab:
        raise RtpcoreError(
            f"the draft model {path!r} has vocab_size={draft_vocab!r} but the target {config.checkpoint!r} "
            f"has vocab_size={target_vocab!r}: a draft must share the target's vocabulary"
        )
    return path, hf, draft_type, draft_plugin, draft_plugin.config_from_hf(hf)


def _load(
    ctx: ParallelContext,
    config: Any,
    registry: Any,
    checkpoint: str,
    hf_config: dict[str, Any],
    model_type: str,
    plugin: Any,
    model_config: Any,
    *,
    target: Any = None,
) -> LoadedModel:
    """Shard, check the KV layout, read only the tensors the model names, build it."""
    from rtpcore.checkpoint import load_checkpoint
    from rtpcore.checkpoint.gguf.weights import release_unread_pages
    from rtpcore.checkpoint.request import WeightRequest
    from rtpcore.kv.specs import kv_cache_specs

    problem = forward_contract_problem(plugin, model_type)
    if problem is not None:  # before any weight is read: never run a model on a layout it does not know
        raise RtpcoreError(problem)
    # What the loader reads (fp8 block-quantized weights dequantized at load, for every model);
    # rtpcore.checkpoint.resolve.resolve_checkpoints fetches a Hub checkpoint's shards by the same request.
    # The quantization method (rtpcore.quantization): --quantization's, else config.json's quant_method.
    method = _quantization_method(config, registry, hf_config, checkpoint, ctx.device)
    request = WeightRequest.for_model(plugin, model_config, hf_config, quantization=method)
    local_config, slices = _shard(plugin, model_type, model_config, ctx)
    # Before the weights: a bad layout fails fast.
    specs = kv_cache_specs(
        plugin,
        local_config,
        kv_cache_dtype=config.kv_cache_dtype,
        kv_layout=config.kv_layout,
        tokens_per_block=config.tokens_per_block,
        registry=registry,
        model_type=model_type,
    )
    backends = attention_backends(config, registry, specs, ctx.device)  # before the weights too
    gguf_names = _gguf_names(plugin, checkpoint, hf_config)  # None: not a GGUF checkpoint
    weights = load_checkpoint(
        checkpoint,
        request.patterns,
        request.ranges,
        dtype=config.torch_dtype,
        expected_shapes=call_optional(plugin, "weight_shapes", model_config),
        slices=slices,
        dtypes=call_optional(plugin, "weight_dtypes", model_config),
        quantization=request.quantization,
        tensor_names=gguf_names,
    )
    bytes_read = weights.stats.tensor_bytes_read
    options: dict[str, Any] = {"dtype": config.torch_dtype, "device": ctx.device}
    if ctx.world_size > 1:
        options["parallel"] = ctx
    if target is not None:
        options["target"] = target
    with linear_kernels(batched_fp32=_fp32_batched_linear(config, weights, ctx.device)), \
            weight_quantization(method), native_decode(getattr(config, "native_decode", True)), \
            plugin_code(registry, model_type, plugin, "build_model", checkpoint):
        model = plugin.build_model(local_config, weights, **options)
    del weights
    if gguf_names is not None:
        release_unread_pages(model)  # the file pages only its fused and permuted copies read
    if isinstance(model, torch.nn.Module):
        model.eval()
    return LoadedModel(model_type, plugin, hf_config, model_config, local_config, specs, model, bytes_read, backends)


def _gguf_names(plugin: Any, checkpoint: str, hf_config: dict[str, Any]) -> dict[str, Any] | None:
    """The plugin's GGUF tensor name map for a GGUF checkpoint (None: safetensors)."""
    from rtpcore.checkpoint.gguf import gguf_tensor_names, is_gguf

    return gguf_tensor_names(plugin, checkpoint, hf_config) if is_gguf(checkpoint) else None


def _quantization_method(config: Any, registry: Any, hf_config: dict[str, Any], checkpoint: str, device: Any) -> Any:
    """The model's quantization method among the registered ones (None: float weights). A GGUF
    checkpoint's own (``gguf``) where the engine asks for none and the method runs on the device;
    on another device its weights are dequantized at load."""
    from rtpcore.checkpoint.gguf import is_gguf
    from rtpcore.quantization import quantization_method

    classes = registry.seam_classes("quantization_methods")
    requested = getattr(config, "quantization", None)
    method = quantization_method(hf_config, classes, requested=requested, gguf=is_gguf(checkpoint))
    problem = None if method is None else method.device_problem(torch.device(device).type)
    if requested is None and problem is not None:
        logger.info("GGUF weights are dequantized at load: %s", problem)
        return None
    return method


def attention_backends(config: Any, registry: Any, specs: list[Any], device: Any) -> list[Any]:
    """Each layer's attention backend (``rtpcore.attention.choose_attention_backends``): the
    engine's ``attention_backend``, else the platform's ``default_attention_backend`` where it
    serves the layer, else the automatic choice among the registered backends (``native_cpu``
    left out when ``native_decode`` is off)."""
    from rtpcore.attention import choose_attention_backends

    classes = registry.seam_classes("attention_backends")
    platform = registry.seam_class("platforms", getattr(config, "platform", "cpu"))
    return choose_attention_backends(
        specs, classes, device=device, dtype=config.torch_dtype,
        requested=getattr(config, "attention_backend", None),
        preferred=getattr(platform, "default_attention_backend", None),
        excluded=() if getattr(config, "native_decode", True) else ("native_cpu",),
    )


def _per_name(backends: list[Any]) -> dict[str, int]:
    """How many layers each backend serves, by name."""
    out: dict[str, int] = {}
    for backend in backends:
        out[backend.name] = out.get(backend.name, 0) + 1
    return out


def _tally(calls: dict[str, int], per_forward: dict[str, int]) -> None:
    for name, n in per_forward.items():
        calls[name] = calls.get(name, 0) + n


#: The warm-up's prompt length: a prefill of this many tokens, then one decode step.
WARM_UP_PROMPT = 3


def warm_up_batches(tokens_per_block: int, device: Any) -> list[Any]:
    """The warm-up's two steps (:meth:`EngineShard.warm_up`): one sequence's prefill of
    ``WARM_UP_PROMPT`` tokens (ids 0..), then its decode step, in blocks 0, 1, ..."""
    from rtpcore.models.forward_batch import ForwardBatch

    n = WARM_UP_PROMPT
    blocks = torch.arange(warm_up_blocks(tokens_per_block), device=device)[None]

    def step(start: int, length: int) -> ForwardBatch:
        positions = torch.arange(start, start + length, device=device)
        return ForwardBatch(
            input_ids=positions.clone(),
            positions=positions,
            slots=positions.clone(),  # block b holds slots b*tpb..: the table maps them to themselves
            query_lens=(length,),
            context_lens=torch.tensor([start + length], device=device),
            block_tables=blocks,
            tokens_per_block=tokens_per_block,
            host_max_context_len=start + length,
            host_context_lens=(start + length,),
        )

    return [step(0, n), step(n, 1)]


def warm_up_blocks(tokens_per_block: int) -> int:
    """KV blocks the warm-up writes (the engine needs at least these)."""
    return -(-(WARM_UP_PROMPT + 1) // tokens_per_block)


class ForwardOutputError(Exception):
    """A model's forward returned what the forward contract does not allow."""


def _check_logits(logits: Any, batch: Any, what: str, vocab: Any) -> None:
    """The forward contract's output: one row of logits per sequence (docs/plugins.md §8)."""
    rows = batch.num_seqs
    ok = isinstance(logits, torch.Tensor) and logits.dim() == 2 and logits.shape[0] == rows
    if not ok or (isinstance(vocab, int) and logits.shape[1] < vocab):
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ForwardOutputError(
            f"{what} returned {shape} for a {'decode' if batch.is_decode else 'prefill'} step of "
            f"{rows} sequence of {batch.num_tokens} tokens; the forward contract returns (num_seqs, "
            f"vocab_size) logits, one row per sequence at its last token"
            + (f" (vocab_size={vocab})" if isinstance(vocab, int) else "")
        )


@contextmanager
def plugin_code(registry: Any, model_type: str, plugin: Any, stage: str, checkpoint: str) -> Iterator[None]:
    """Run a plugin's code; its own exception (not an RtpcoreError) becomes an
    EngineBuildError naming the model type, class, plugin, distribution and stage, with
    what to change where the cause says (a missing module: a dependency to declare)."""
    try:
        yield
    except RtpcoreError:
        raise
    except Exception as exc:
        try:
            provider = registry.record(model_type).provider
        except Exception:  # a registry without the record: name the class only
            provider = None
        where = f"{plugin.__module__}:{plugin.__qualname__}"
        whose = f"{provider}" if provider is not None else "its plugin"
        doing = stage if stage != "warm-up" else (
            "the warm-up forward (one prefill and one decode step before the engine takes requests)"
        )
        cause = exc if isinstance(exc, ForwardOutputError) else f"{type(exc).__name__}: {exc}"
        message = (
            f"building the engine for {checkpoint!r} failed in {doing} of model type "
            f"{model_type!r} ({where}, from {whose}): {cause}"
        )
        dist = getattr(provider, "distribution", None)
        if isinstance(exc, ImportError) and getattr(exc, "name", None):
            owner = f"the distribution {dist!r}" if dist else "the plugin"
            message += (
                f"; {owner} imports {exc.name!r}, which is not installed here: install it, "
                f"and declare it in {dist or 'the plugin'}'s dependencies"
            )
        elif stage == "warm-up":
            message += (
                "; the model's weights do not fit what it computes, or its forward breaks the "
                "forward contract (docs/plugins.md §8): declare weight_shapes(config) so the loader "
                "names a tensor of the wrong shape"
            )
        raise EngineBuildError(
            message,
            checkpoint=checkpoint,
            plugin=getattr(provider, "plugin", None),
            distribution=dist,
            stage=stage,
        ) from exc


DEFAULT_MAX_POSITIONS = 4096  # when config.json has no max_position_embeddings


def max_positions(hf: dict[str, Any]) -> int:
    """``max_position_embeddings`` of config.json, the longest sequence the engine admits;
    ``DEFAULT_MAX_POSITIONS`` when missing or null."""
    from rtpcore import config_fields

    return config_fields.optional_int(hf, "max_position_embeddings", DEFAULT_MAX_POSITIONS, null_ok=True)


def build_shard(ctx: ParallelContext, config: Any) -> EngineShard:
    """The worker-group factory of an engine (``"rtpcore.engine.worker.rank:build_shard"``)."""
    return EngineShard(ctx, config)


def _shard(
    plugin: Any, model_type: str, config: Any, ctx: ParallelContext
) -> tuple[Any, dict[str, tuple[int, int, int]] | None]:
    if ctx.world_size == 1:
        return config, None
    unsupported = RtpcoreError(
        f"model type {model_type!r} ({plugin.__module__}.{plugin.__qualname__}) does not support "
        f"tensor_parallel_size={ctx.world_size}: it defines no tensor_parallel_shard(); use 1"
    )
    shard = getattr(plugin, "tensor_parallel_shard", None)
    if shard is None:
        raise unsupported
    try:
        local, slices = shard(config, ctx.rank, ctx.world_size)
    except NotImplementedError:  # the ModelPlugin default
        raise unsupported from None
    return local, dict(slices)


# The float32 copies of "packed+fp32" linear layers may take at most this share of the
# memory limit; beyond it a model keeps its reduced-precision weights only.
FP32_COPY_MEMORY_FRACTION = 0.25


def _fp32_batched_linear(config: Any, weights: Mapping[str, torch.Tensor], device: Any) -> bool | None:
    """The engine's ``fp32_batched_linear``; when automatic (None), False if float32 copies
    of this rank's bf16/fp16 weights would take more than FP32_COPY_MEMORY_FRACTION of the
    memory limit, else None (each Linear decides by the CPU's instructions, rtpcore.models.layers)."""
    choice = config.fp32_batched_linear
    if choice is not None or torch.device(device or "cpu").type != "cpu":
        return choice
    reduced = sum(t.numel() for t in weights.values() if t.dtype in (torch.bfloat16, torch.float16))
    budget = int(memory_limit() * FP32_COPY_MEMORY_FRACTION) // max(1, config.tensor_parallel_size)
    if 4 * reduced > budget:
        logger.info(
            "bf16/fp16 linear layers keep no float32 copies: %.1f GB would exceed %.0f%% of the memory limit",
            4 * reduced / 1e9, 100 * FP32_COPY_MEMORY_FRACTION,
        )
        return False
    return None

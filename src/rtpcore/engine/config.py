"""The engine's options, declared once (:class:`EngineOptions`), and their resolved form
(:class:`EngineConfig`). Above the engine's parts.

Each option is one attrs field of :class:`EngineOptions`: its name is the keyword of
``Engine.from_pretrained`` / ``AsyncEngine.from_pretrained`` / :meth:`EngineConfig.create`, its
default is theirs, and its :func:`option` metadata says how ``rtpcore generate`` / ``rtpcore
serve`` spell it (``rtpcore.cli._args.add_engine_arguments`` generates the flags from it, and
``engine_options`` reads them back). A new option is one field here; nothing else lists them.
:meth:`EngineConfig.create` validates and resolves them (the device, the dtypes, the token
budget, the allowlist's plan, a Hub id's folder) into an :class:`EngineConfig`: picklable, so
every rank rebuilds the same engine from it without rediscovering plugins.

This module imports no torch (the command line's ``--help`` reads the options).
"""

from __future__ import annotations

import difflib
import inspect
import os
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from rtpcore.checkpoint.resolve import resolve_checkpoints
from rtpcore.errors import RtpcoreError
from rtpcore.models.cpu_isa import CPU_ISAS, apply_cpu_isa
from rtpcore.plugins.resolution import Plan

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_BATCHED_TOKENS", "DEFAULT_MAX_BATCH_SIZE", "DTYPES", "QUANTIZATIONS", "CliFlag", "EngineConfig",
    "EngineOptions", "option", "options_signature",
]

DTYPES = ("float32", "bfloat16", "float16")  # the torch dtype names the engine runs
DEFAULT_BATCHED_TOKENS = {"cuda": 8192, "cpu": 256}  # max_num_batched_tokens by device type
DEFAULT_MAX_BATCH_SIZE = 256
QUANTIZATIONS = ("int8",)  # rtpcore.models.layers.QUANTIZATIONS (a test keeps the two equal)


@attrs.frozen
class CliFlag:
    """How an option is spelled on the command line. ``help`` names the default. ``kind``: how
    the CLI parses the value ("positive_int", "bytes", "fraction", "device", "names" for a
    comma-separated list, or None for plain text; the parsers are the CLI's); ``negative``: a ``--no-NAME`` switch that sets False, for
    an option that is on (or automatic, None) by default; ``commands``: the subcommands that
    take it (None: every one that runs an engine)."""

    help: str
    kind: str | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    negative: bool = False
    commands: tuple[str, ...] | None = None

    def flag(self, name: str) -> str:
        dashed = name.replace("_", "-")
        return f"--no-{dashed}" if self.negative else f"--{dashed}"


def option(default: Any, doc: str, cli: CliFlag | None = None, converter: Any = None) -> Any:
    """One engine option: its default, what it does (``doc``), and its command-line flag (None:
    a keyword of the Python API only, or a flag of the allowlist's own)."""
    return attrs.field(default=default, kw_only=True, metadata={"doc": doc, "cli": cli}, converter=converter)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RtpcoreError(f"{name} must be a positive integer, got {value!r}")
    return value


def _names(name: str, value: Any) -> tuple[str, ...]:
    """``value`` (a sequence of non-empty strings, not one string) as a tuple."""
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise RtpcoreError(f"{name} must be a list of names, got {value!r}")
    names = tuple(value)
    if not all(isinstance(n, str) and n for n in names):
        raise RtpcoreError(f"{name} must be a list of non-empty names, got {value!r}")
    return names


def _tristate(name: str, value: Any) -> None:
    if value not in (None, True, False):
        raise RtpcoreError(f"{name} must be None (automatic), True or False, got {value!r}")


@attrs.frozen
class EngineOptions:
    """Every option of an engine, as the caller gives it (see the module docstring)."""

    model_type: str | None = option(
        None, "the registered model type to build; None: inferred from config.json (docs/design.md §4)")
    gguf_file: str | None = option(None, "the GGUF file to load within the checkpoint's folder or Hub repository",
        CliFlag("the GGUF file to load within CHECKPOINT, a Hub id's repository (fetched alone, with the other "
                "parts of a split set, named by any part) or a folder holding several .gguf files, e.g. "
                "model-Q4_K_M.gguf (default: none: the checkpoint's config.json, else its only GGUF model)",
                metavar="NAME"))
    allow_plugin_patches: tuple[str, ...] = option(
        (), "plugins (entry point or distribution names) whose changes to rtpcore are accepted, logged, "
        "instead of refused (docs/design.md §18; --allow-plugin-patches)", converter=tuple)
    dtype: str = option("auto", "dtype of the weights and activations", CliFlag(
        "dtype of the weights and activations; auto (the default): the checkpoint's torch_dtype on a GPU, "
        "float32 on the CPU", choices=("auto", *DTYPES)))
    kv_cache_dtype: str = option("auto", "dtype of the KV cache", CliFlag(
        "dtype of the KV cache (fp8: e4m3 bytes, see --kv-layout); auto (the default) follows --dtype",
        choices=("auto", "fp32", "fp16", "bf16", "fp8")))
    kv_layout: str | None = option(None, "byte layout of fp8 MLA KV-cache layers", CliFlag(
        "byte layout of the fp8 MLA KV-cache layers: padded, compact, or one a loaded plugin registers "
        "(default: the one the model's plugin chooses)", metavar="NAME"))
    tokens_per_block: int = option(16, "tokens per KV block")
    kv_cache_prefault: bool | None = option(
        None, "commit the CPU KV pools' memory when the engine is built, not page by page as steps first write "
        "it (rtpcore.kv.pools.commit_pages); None: on for rtpcore serve, off for the Python API and rtpcore "
        "generate", CliFlag(
            "leave the KV pool's pages to be committed as steps first write them (default: rtpcore serve commits "
            "the whole pool at start, so a pool the machine cannot hold fails there and no step waits on page "
            "faults)", negative=True, commands=("serve",)))
    kv_cache_memory: int | None = option(None, "bytes of KV cache per rank", CliFlag(
        "bytes of KV cache per rank, e.g. 2GiB (default: on a GPU, what --gpu-memory-utilization leaves after "
        "the weights and one step; on the CPU, --max-batch-size sequences of --max-model-len tokens, at most a "
        "quarter of the memory)", kind="bytes", metavar="BYTES", commands=("serve",)))
    max_batch_size: int = option(DEFAULT_MAX_BATCH_SIZE, "most requests running at once", CliFlag(
        "most requests running at once (default: %(default)s)", kind="positive_int", metavar="N",
        commands=("serve",)))
    tensor_parallel_size: int = option(1, "tensor-parallel ranks", CliFlag(
        "tensor-parallel ranks the model's layers are split over; on GPUs rank r uses cuda:r "
        "(default: %(default)s)", kind="positive_int", metavar="N"))
    fp32_batched_linear: bool | None = option(
        None, "whether bf16/fp16 linear layers keep a float32 copy for several-row inputs "
        "(rtpcore.models.layers, kernel 'packed+fp32'); None: automatic, see rtpcore.engine.worker.rank")
    draft_model: str | os.PathLike[str] | None = option(None, "speculative decoding's draft", CliFlag(
        "speculative decoding: a draft checkpoint sharing the vocabulary (any model type the loaded plugins "
        "serve), or 'mtp' for the checkpoint's own multi-token-prediction layers (default: none, no "
        "speculative decoding)", metavar="PATH|mtp"))
    num_speculative_tokens: int = option(0, "tokens the draft proposes per step (0: 4 with a draft)", CliFlag(
        "tokens the draft proposes per step (default 0: 4 with --draft-model)", kind="positive_int", metavar="K"))
    device: Any = option("auto", "where weights, KV pools and sampling live", CliFlag(
        "auto (default: the available platform of highest priority: the first CUDA/ROCm GPU torch sees, else "
        "cpu, unless a loaded plugin's platform ranks higher), cpu, cuda, cuda:N, or a plugin platform's NAME "
        "or NAME:N", kind="device",
        metavar="DEVICE"))
    cuda_graphs: bool | None = option(None, "decode steps replayed from CUDA graphs; None: on for one GPU rank", CliFlag(
        "run every decode step eagerly on a GPU (default: replay CUDA graphs, one engine rank)", negative=True))
    max_num_batched_tokens: int | None = option(None, "most new tokens one step computes", CliFlag(
        "most new tokens one step computes: decodes first, long prompts in chunks (default: 8192 on a GPU, "
        "256 on the CPU)", kind="positive_int", metavar="N"))
    max_model_len: int | None = option(None, "longest prompt + output; None: the checkpoint's context", CliFlag(
        "longest prompt + output a request may ask for (default: the checkpoint's context)", kind="positive_int",
        metavar="N"))
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of prompts seen before", CliFlag(
        "do not reuse the KV blocks of prompts seen before (default: reuse them)", negative=True))
    gpu_memory_utilization: float = option(0.9, "share of a GPU's memory the engine fills", CliFlag(
        "share of a GPU's memory the engine fills, weights and KV cache (default: %(default)s)", kind="fraction",
        metavar="F"))
    quantization: str | None = option(None, "the quantization method of the model's linear layers", CliFlag(
        "the quantization method of the model's linear layers (rtpcore plugins list shows the registered ones): "
        "int8 (weight-only, quantized at load, on the CPU; one scale per output channel, the checkpoint stays "
        "float), fp8, gguf (a GGUF file's weights kept in their blocks, on the CPU), none (float weights: "
        "quantized checkpoints dequantized at load), or a plugin's (default: gguf for a GGUF checkpoint on the "
        "CPU, else the one config.json's quantization_config.quant_method names, else none)", metavar="NAME"))
    native_decode: bool = option(True, "CPU decode steps in rtpcore_native where the model allows", CliFlag(
        "run CPU decode steps with torch's modules, bit-identical to transformers in float32 (default: rtpcore's "
        "native decode step where the model allows it, within float32 rounding)", negative=True))
    attention_backend: str | None = option(None, "the attention backend of every layer; None: chosen per layer",
        CliFlag("the attention backend every layer runs (rtpcore plugins list shows the registered ones: torch, "
                "native_cpu and the plugins'); an error names a layer it cannot serve (default: per layer, the "
                "platform's default, else the highest-priority backend that supports the layer)", metavar="NAME"))
    logits_processors: tuple[str, ...] = option((), "registered logits processors every step's logits go through",
        CliFlag("logits processors every step's logits go through, in this order, before the engine's own "
                "sampling settings: names a loaded plugin registers (rtpcore_register_logits_processors; rtpcore "
                "plugins list shows them); their per-request arguments come from SamplingParams.extra_args, over "
                "HTTP vllm_xargs (default: none)", kind="names", metavar="NAME[,NAME]"))
    cpu_isa: str | None = option(None, "the most the CPU kernels may use: avx2, avx512, avx512_bf16 or amx "
        "(rtpcore.models.cpu_isa); None: the CPU's best, or RTPCORE_CPU_ISA's cap", CliFlag(
        "limit the CPU kernels to what a CPU of this class has, as ONEDNN_MAX_CPU_ISA limits oneDNN, so one machine "
        "can run every path: avx2 (rtpcore's avx2_vnni/avx2 kernels, oneDNN at AVX2_VNNI), avx512 (avx512_vnni/"
        "avx512, oneDNN at AVX512_CORE_VNNI), avx512_bf16, amx; sets RTPCORE_CPU_ISA for this process and its "
        "workers; a value this CPU cannot run is an error (default: the best this CPU runs; rtpcore info shows "
        "them)", choices=CPU_ISAS))
    async_scheduling: bool | None = option(None, "outputs one step behind; None: on with CUDA graphs", CliFlag(
        "read each step's tokens before planning the next (default: with CUDA graphs, plan and launch the next "
        "step while the current one runs, outputs one step behind)", negative=True))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in attrs.fields(cls))

    @classmethod
    def check_names(cls, options: Mapping[str, Any], what: str) -> None:
        """An unknown name in ``options`` is a TypeError from ``what`` naming it (and the
        closest known one)."""
        known = cls.names()
        for name in options:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"{what}() got an unexpected option {name!r}{hint} (options: {', '.join(known)})")


def options_signature(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` (whose ``**options`` are engine options) with a signature that lists each
    option as a keyword with its default, for ``help()``, ``inspect.signature`` and editors;
    ``func`` is returned (a decorator)."""
    sig = inspect.signature(func)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params += [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type or inspect.Parameter.empty)
        for f in attrs.fields(EngineOptions)
        if f.name not in sig.parameters
    ]
    func.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return func


@attrs.frozen(kw_only=True)
class EngineConfig(EngineOptions):
    """Everything needed to build an engine: the options resolved and validated (the fields
    below are the resolved forms of :class:`EngineOptions`' own), the checkpoint's folder and
    the allowlist's plan; picklable, so a worker process can rebuild the same engine from it
    without rediscovering plugins."""

    checkpoint: str
    plan: Plan
    dtype: str  # resolved: "float32", "bfloat16" or "float16"
    kv_cache_dtype: str  # resolved: "fp32", "fp16", "bf16" or "fp8_e4m3"
    device: str = "cpu"  # resolved (rtpcore.engine.worker.devices): "cpu", "cuda:N" or "TYPE:N", rank 0's when sharded
    platform: str = "cpu"  # the platform's name (rtpcore.platforms): "cpu", "cuda" or a plugin's
    draft_model: str | None = None  # a local folder or "mtp"
    max_num_batched_tokens: int = DEFAULT_BATCHED_TOKENS["cpu"]

    @classmethod
    @options_signature
    def create(
        cls,
        path: str | os.PathLike[str],
        *,
        plugins: Iterable[str] = (),
        external_model_packages: Iterable[str] = (),
        **options: Any,
    ) -> EngineConfig:
        """Validate the options (:class:`EngineOptions`' names), resolve the device
        (:func:`~rtpcore.engine.worker.devices.resolve_device`: a device torch cannot see raises
        DeviceError here, before anything loads) and the allowlist (imports no plugin). A Hub id
        as ``path`` or ``draft_model`` is fetched here, once, into the Hub cache
        (:func:`~rtpcore.checkpoint.resolve.resolve_checkpoints`: it loads the plan's plugins to
        learn which shards), so the config carries local folders to every rank; with ``gguf_file``,
        ``checkpoint`` is that GGUF file's local path (the first part's, for a split set)."""
        EngineOptions.check_names(options, "EngineConfig.create")
        o = EngineOptions(**options)
        # Before anything multiplies: the cap reaches this process's kernels, oneDNN (unless it ran
        # already) and, through the environment, the engine's workers.
        cpu_isa = apply_cpu_isa(o.cpu_isa)

        from rtpcore.engine.worker.devices import check_device_form, resolve_platform
        from rtpcore.kv.specs import resolve_kv_cache_dtype
        from rtpcore.parallel.context import env_world_size
        from rtpcore.plugins.allowlist import Allowlist

        if o.dtype != "auto" and o.dtype not in DTYPES:
            raise RtpcoreError(
                f"dtype {o.dtype!r} is not supported; choose 'auto' or one of {', '.join(map(repr, DTYPES))}"
            )
        _positive_int("tokens_per_block", o.tokens_per_block)
        _positive_int("max_batch_size", o.max_batch_size)
        if o.kv_cache_memory is not None:
            _positive_int("kv_cache_memory", o.kv_cache_memory)
        _positive_int("tensor_parallel_size", o.tensor_parallel_size)
        _tristate("fp32_batched_linear", o.fp32_batched_linear)
        draft, k = _speculative_options(o.draft_model, o.num_speculative_tokens)
        if o.gguf_file is not None:  # a bad name, or a file as the checkpoint, fails before any plugin loads
            from rtpcore.checkpoint.gguf.reader import check_gguf_name

            check_gguf_name(path, o.gguf_file)
        if isinstance(plugins, str) or isinstance(external_model_packages, str):
            raise RtpcoreError("plugins and external_model_packages take a sequence of strings, not one string")
        # Under env:// rendezvous (torchrun) the ranks may sit on other machines: this process
        # checks only its own device; every rank checks its own when the group forms.
        local_ranks = 1 if o.tensor_parallel_size > 1 and env_world_size() is not None else o.tensor_parallel_size
        check_device_form(o.device)  # a malformed device fails before any plugin loads
        plan = Allowlist.from_cli(plugins=plugins, external_model_packages=external_model_packages,
                                  allow_plugin_patches=o.allow_plugin_patches).resolve()
        registry = _platforms(plan)
        platform_name, resolved_device = resolve_platform(o.device, registry, tensor_parallel_size=local_ranks)
        platform = registry.seam_class("platforms", platform_name)
        _tristate("cuda_graphs", o.cuda_graphs)
        if o.cuda_graphs and not platform.supports_graphs:
            raise RtpcoreError(f"cuda_graphs=True needs a platform that replays CUDA graphs; the engine runs on "
                               f"{platform_name!r} ({resolved_device})")
        device_type = "cpu" if resolved_device == "cpu" else "cuda"
        max_num_batched_tokens = o.max_num_batched_tokens
        if max_num_batched_tokens is None:
            max_num_batched_tokens = DEFAULT_BATCHED_TOKENS[device_type]
        _positive_int("max_num_batched_tokens", max_num_batched_tokens)
        if max_num_batched_tokens < 1 + k:
            raise RtpcoreError(
                f"max_num_batched_tokens={max_num_batched_tokens} cannot hold one decode step with "
                f"num_speculative_tokens={k} (1 + {k} tokens); raise it"
            )
        if o.max_model_len is not None:
            _positive_int("max_model_len", o.max_model_len)
        if o.quantization is not None and o.quantization != "none":  # a registered method that runs on this device
            method = registry.seam_class("quantization_methods", o.quantization) if isinstance(o.quantization, str) else None
            if method is None:
                raise RtpcoreError(
                    f"quantization must be None, 'none' or one of "
                    f"{', '.join(registry.seam_names('quantization_methods'))}, got {o.quantization!r} (a plugin adds "
                    "more with rtpcore_register_quantization_methods)"
                )
            problem = method.device_problem(resolved_device.partition(":")[0])
            if problem is not None:
                raise RtpcoreError(f"quantization={o.quantization!r}: {problem}")
        if o.native_decode not in (True, False):
            raise RtpcoreError(f"native_decode must be True or False, got {o.native_decode!r}")
        if o.attention_backend is not None and (not isinstance(o.attention_backend, str) or not o.attention_backend):
            raise RtpcoreError(f"attention_backend must be None or a backend's name, got {o.attention_backend!r}")
        processors = _names("logits_processors", o.logits_processors)
        _tristate("async_scheduling", o.async_scheduling)
        _tristate("kv_cache_prefault", o.kv_cache_prefault)
        if o.async_scheduling and o.tensor_parallel_size > 1:
            raise RtpcoreError(
                f"async_scheduling=True needs tensor_parallel_size=1, got {o.tensor_parallel_size}: the next step's "
                "input ids stay on rank 0's device"
            )
        if o.enable_prefix_caching not in (True, False):
            raise RtpcoreError(f"enable_prefix_caching must be True or False, got {o.enable_prefix_caching!r}")
        if (
            isinstance(o.gpu_memory_utilization, bool)
            or not isinstance(o.gpu_memory_utilization, int | float)
            or not 0.0 < o.gpu_memory_utilization <= 1.0
        ):
            raise RtpcoreError(f"gpu_memory_utilization must be in (0, 1], got {o.gpu_memory_utilization!r}")
        # A Hub id (org/name[@revision]) becomes its snapshot folder, holding the shards the ranks read;
        # with gguf_file, the path of that file (in the folder, or fetched alone into the Hub cache).
        path, draft = resolve_checkpoints(path, draft, plan=plan, model_type=o.model_type, gguf_file=o.gguf_file)
        dtype = _resolve_dtype(o.dtype, resolved_device, path, registry)
        if dtype not in platform.supported_dtypes:
            raise RtpcoreError(f"dtype {dtype!r} is not one platform {platform_name!r} runs: "
                               f"{', '.join(platform.supported_dtypes)}")
        kv = resolve_kv_cache_dtype(o.kv_cache_dtype, dtype)
        resolved = {
            "dtype": dtype, "kv_cache_dtype": kv, "device": resolved_device, "platform": platform_name,
            "draft_model": draft,
            "num_speculative_tokens": k, "max_num_batched_tokens": max_num_batched_tokens,
            "gpu_memory_utilization": float(o.gpu_memory_utilization), "logits_processors": processors,
            "cpu_isa": cpu_isa,
        }
        given = {name: getattr(o, name) for name in EngineOptions.names()}
        return cls(checkpoint=str(path), plan=plan, **{**given, **resolved})

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype


def _platforms(plan: Plan) -> Any:
    """The registry of the plan's plugins (loaded once per plan), where the platforms are."""
    from rtpcore.plugins.loading import load_plugins

    return load_plugins(plan)


DEFAULT_SPECULATIVE_TOKENS = 4  # proposals per step when a draft is given without a count


def _speculative_options(draft_model: Any, num_speculative_tokens: Any) -> tuple[str | None, int]:
    """The checked ``draft_model`` (a path as a string, or "mtp") and proposal count."""
    unset = num_speculative_tokens is None or (num_speculative_tokens == 0 and not isinstance(num_speculative_tokens, bool))
    if draft_model is None:
        if not unset:
            raise RtpcoreError(
                f"num_speculative_tokens={num_speculative_tokens!r} needs a draft_model (a checkpoint path or 'mtp')"
            )
        return None, 0
    if isinstance(draft_model, os.PathLike):
        draft_model = os.fspath(draft_model)
    if not isinstance(draft_model, str) or not draft_model:
        raise RtpcoreError(
            f"draft_model must be a checkpoint path (str or os.PathLike) or 'mtp', got {draft_model!r}"
        )
    if unset:
        return draft_model, DEFAULT_SPECULATIVE_TOKENS  # 0, the default: 4 with a draft
    return draft_model, _positive_int("num_speculative_tokens", num_speculative_tokens)


def _resolve_dtype(dtype: str, device: str, path: str | os.PathLike[str], registry: Any = None) -> str:
    """``dtype`` itself, or for "auto": float32 on the CPU, the checkpoint's ``torch_dtype``
    (or ``dtype``) on a GPU, float32 when config.json names none we run."""
    if dtype != "auto":
        return dtype
    if device == "cpu":
        return "float32"
    from rtpcore.checkpoint import read_hf_config

    hf = read_hf_config(path, registry)
    named = hf.get("torch_dtype", hf.get("dtype"))
    return named if isinstance(named, str) and named in DTYPES else "float32"

"""The engine's options, validated and resolved once: :class:`EngineConfig` (picklable, so
every rank rebuilds the same engine from it without rediscovering plugins). Above the engine's
parts; ``Engine.from_pretrained`` builds one with :meth:`EngineConfig.create`."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import attrs
import torch

from rtpcore.checkpoint.resolve import resolve_checkpoints
from rtpcore.errors import RtpcoreError
from rtpcore.models.layers import QUANTIZATIONS
from rtpcore.plugins.resolution import Plan

__all__ = ["DEFAULT_BATCHED_TOKENS", "DEFAULT_MAX_BATCH_SIZE", "DTYPES", "EngineConfig"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_BATCHED_TOKENS = {"cuda": 8192, "cpu": 256}  # max_num_batched_tokens by device type
DEFAULT_MAX_BATCH_SIZE = 256


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RtpcoreError(f"{name} must be a positive integer, got {value!r}")
    return value


@attrs.frozen
class EngineConfig:
    """Everything needed to build an engine, resolved and validated; picklable, so a
    worker process can rebuild the same engine from it without rediscovering plugins."""

    checkpoint: str
    plan: Plan
    model_type: str | None
    dtype: str
    kv_cache_dtype: str  # resolved: "fp32", "fp16", "bf16" or "fp8_e4m3"
    kv_layout: str | None
    tokens_per_block: int
    kv_cache_memory: int | None
    max_batch_size: int
    tensor_parallel_size: int
    # resolved (rtpcore.engine.worker.devices): "cpu" or "cuda:N", rank 0's device when sharded
    device: str = "cpu"
    # Whether bf16/fp16 linear layers keep a float32 copy for several-row inputs
    # (rtpcore.models.layers, kernel "packed+fp32"); None: automatic, see rtpcore.engine.worker.rank.
    fp32_batched_linear: bool | None = None
    # Speculative decoding (docs/design.md §10): a draft checkpoint's path or "mtp", and
    # how many tokens it proposes per step (0: no speculation).
    draft_model: str | None = None
    num_speculative_tokens: int = 0
    # Decode steps replayed from CUDA graphs (rtpcore.engine.worker.graphs): None = on for a
    # single-rank engine on a CUDA/ROCm device, off otherwise.
    cuda_graphs: bool | None = None
    # Scheduling (docs/design.md §13), resolved: the token budget of a step, the longest
    # prompt + output (None: the checkpoint's max_position_embeddings), prefix caching, and
    # the share of a GPU's memory the engine may fill.
    max_num_batched_tokens: int = DEFAULT_BATCHED_TOKENS["cpu"]
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    # Weight-only quantization of every Linear at load (rtpcore.models.layers): None or "int8" (CPU).
    quantization: str | None = None
    # CPU decode steps of float32 / int8 Llama-family models in rtpcore_native
    # (rtpcore.models.native) where they can run; False keeps torch's modules.
    native_decode: bool = True
    # Outputs one step behind (rtpcore.engine.engine_core, docs/design.md §13): None = on for a
    # single-rank engine whose decode steps replay CUDA graphs, off otherwise.
    async_scheduling: bool | None = None

    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str],
        *,
        plugins: Iterable[str] = (),
        external_model_packages: Iterable[str] = (),
        model_type: str | None = None,
        dtype: str = "auto",
        kv_cache_dtype: str = "auto",
        kv_layout: str | None = None,
        tokens_per_block: int = 16,
        kv_cache_memory: int | None = None,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        tensor_parallel_size: int = 1,
        fp32_batched_linear: bool | None = None,
        draft_model: str | os.PathLike[str] | None = None,
        num_speculative_tokens: int = 0,
        device: Any = "auto",
        cuda_graphs: bool | None = None,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        gpu_memory_utilization: float = 0.9,
        quantization: str | None = None,
        native_decode: bool = True,
        async_scheduling: bool | None = None,
    ) -> EngineConfig:
        """Validate the arguments, resolve the device (:func:`~rtpcore.engine.worker.devices.resolve_device`:
        a device torch cannot see raises DeviceError here, before anything loads) and the
        allowlist (imports no plugin). A Hub id as ``path`` or ``draft_model`` is fetched here,
        once, into the Hub cache (:func:`~rtpcore.checkpoint.resolve.resolve_checkpoints`: it loads the
        plan's plugins to learn which shards), so the config carries local folders to every rank."""
        from rtpcore.engine.worker.devices import resolve_device
        from rtpcore.kv.specs import resolve_kv_cache_dtype
        from rtpcore.parallel.context import env_world_size
        from rtpcore.plugins.allowlist import Allowlist

        if dtype != "auto" and dtype not in DTYPES:
            raise RtpcoreError(
                f"dtype {dtype!r} is not supported; choose 'auto' or one of {', '.join(map(repr, DTYPES))}"
            )
        _positive_int("tokens_per_block", tokens_per_block)
        _positive_int("max_batch_size", max_batch_size)
        if kv_cache_memory is not None:
            _positive_int("kv_cache_memory", kv_cache_memory)
        _positive_int("tensor_parallel_size", tensor_parallel_size)
        if fp32_batched_linear not in (None, True, False):
            raise RtpcoreError(f"fp32_batched_linear must be None (automatic), True or False, got {fp32_batched_linear!r}")
        draft, k = _speculative_options(draft_model, num_speculative_tokens)
        if isinstance(plugins, str) or isinstance(external_model_packages, str):
            raise RtpcoreError("plugins and external_model_packages take a sequence of strings, not one string")
        # Under env:// rendezvous (torchrun) the ranks may sit on other machines: this process
        # checks only its own device; every rank checks its own when the group forms.
        local_ranks = 1 if tensor_parallel_size > 1 and env_world_size() is not None else tensor_parallel_size
        resolved_device = resolve_device(device, tensor_parallel_size=local_ranks)
        if cuda_graphs not in (None, True, False):
            raise RtpcoreError(f"cuda_graphs must be None (automatic), True or False, got {cuda_graphs!r}")
        if cuda_graphs and resolved_device == "cpu":
            raise RtpcoreError("cuda_graphs=True needs a CUDA/ROCm device; the engine runs on the CPU")
        device_type = "cpu" if resolved_device == "cpu" else "cuda"
        if max_num_batched_tokens is None:
            max_num_batched_tokens = DEFAULT_BATCHED_TOKENS[device_type]
        _positive_int("max_num_batched_tokens", max_num_batched_tokens)
        if max_num_batched_tokens < 1 + k:
            raise RtpcoreError(
                f"max_num_batched_tokens={max_num_batched_tokens} cannot hold one decode step with "
                f"num_speculative_tokens={k} (1 + {k} tokens); raise it"
            )
        if max_model_len is not None:
            _positive_int("max_model_len", max_model_len)
        if quantization is not None and quantization not in QUANTIZATIONS:
            raise RtpcoreError(f"quantization must be None or one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
        if quantization is not None and resolved_device != "cpu":
            raise RtpcoreError(
                f"quantization={quantization!r} runs on the CPU only for now (rtpcore's and torch's int8-weight CPU kernels); "
                f"this engine runs on {resolved_device}"
            )
        if native_decode not in (True, False):
            raise RtpcoreError(f"native_decode must be True or False, got {native_decode!r}")
        if async_scheduling not in (None, True, False):
            raise RtpcoreError(f"async_scheduling must be None (automatic), True or False, got {async_scheduling!r}")
        if async_scheduling and tensor_parallel_size > 1:
            raise RtpcoreError(
                f"async_scheduling=True needs tensor_parallel_size=1, got {tensor_parallel_size}: the next step's "
                "input ids stay on rank 0's device"
            )
        if enable_prefix_caching not in (True, False):
            raise RtpcoreError(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}")
        if (
            isinstance(gpu_memory_utilization, bool)
            or not isinstance(gpu_memory_utilization, int | float)
            or not 0.0 < gpu_memory_utilization <= 1.0
        ):
            raise RtpcoreError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        plan = Allowlist.from_cli(plugins=plugins, external_model_packages=external_model_packages).resolve()
        # A Hub id (org/name[@revision]) becomes its snapshot folder, holding the shards the ranks read.
        path, draft = resolve_checkpoints(path, draft, plan=plan, model_type=model_type)
        dtype = _resolve_dtype(dtype, resolved_device, path)
        kv = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
        return cls(
            checkpoint=str(path),
            plan=plan,
            model_type=model_type,
            dtype=dtype,
            kv_cache_dtype=kv,
            kv_layout=kv_layout,
            tokens_per_block=tokens_per_block,
            kv_cache_memory=kv_cache_memory,
            max_batch_size=max_batch_size,
            tensor_parallel_size=tensor_parallel_size,
            device=resolved_device,
            fp32_batched_linear=fp32_batched_linear,
            draft_model=draft,
            num_speculative_tokens=k,
            cuda_graphs=cuda_graphs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            gpu_memory_utilization=float(gpu_memory_utilization),
            quantization=quantization,
            native_decode=native_decode,
            async_scheduling=async_scheduling,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


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


def _resolve_dtype(dtype: str, device: str, path: str | os.PathLike[str]) -> str:
    """``dtype`` itself, or for "auto": float32 on the CPU, the checkpoint's ``torch_dtype``
    (or ``dtype``) on a GPU, float32 when config.json names none we run."""
    if dtype != "auto":
        return dtype
    if device == "cpu":
        return "float32"
    from rtpcore.checkpoint import read_hf_config

    hf = read_hf_config(path)
    named = hf.get("torch_dtype", hf.get("dtype"))
    return named if isinstance(named, str) and named in DTYPES else "float32"

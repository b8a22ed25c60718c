"""Load the tensors a model needs from a safetensors checkpoint, and nothing else.

::

    weights = load_checkpoint(path, Plugin.weight_patterns(cfg), Plugin.placeholder_ranges(cfg),
                              dtype=torch.bfloat16, expected_shapes=Plugin.weight_shapes(cfg))
    weights.stats.files_opened      # only the shards holding a wanted tensor

Patterns: ``{name}`` stands for one decimal index, everything else is literal, and the
whole tensor name must match. A placeholder with a range (``{"layer": range(n)}``) is
expanded over it into required names and matches only indices in it; a placeholder
without a range matches any index and requires nothing (optional tensors). A pattern
without placeholders is required.

The index (``checkpoint_index``) tells which file holds each wanted tensor; only those
files are opened (``checkpoint.request``: the same rule tells a pruned Hub download which
shards to fetch). Whole tensors are read with positioned reads into memory the tensor
owns (headers validated first), so a file changed later cannot fault the process;
``lazy=True`` keeps ``safetensors.safe_open``'s memory-mapped views instead, and
``slices`` read through its ``get_slice``. Pattern matching lives in
``checkpoint_patterns``.
"""

from __future__ import annotations

import ctypes
import io
import json
import logging
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attrs import frozen

from rtpcore.checkpoint.index import (
    CheckpointIndex,
    FileHeader,
    TensorInfo,
    build_index,
)
from rtpcore.checkpoint.patterns import PatternTable, WeightSelection
from rtpcore.checkpoint.request import WeightRequest, files_wanted
from rtpcore.errors import CheckpointError

if TYPE_CHECKING:
    import torch

__all__ = [
    "LoadStats",
    "LoadedWeights",
    "WeightSelection",
    "load_checkpoint",
    "read_hf_config",
]

logger = logging.getLogger(__name__)


def read_hf_config(path: str | os.PathLike[str], registry: Any = None) -> dict[str, Any]:
    """The parsed ``config.json`` of a checkpoint directory (or the file itself). A GGUF
    checkpoint (a ``.gguf`` file, split set or folder) has its ``config.json`` read from its
    metadata by the model plugin that declares its architecture among ``registry``'s
    (``rtpcore.checkpoint.gguf.gguf_hf_config``; without a registry, the built-in Llama
    family's reading)."""
    from rtpcore.checkpoint.gguf import gguf_hf_config, is_gguf

    if is_gguf(path):
        return gguf_hf_config(path, registry)
    p = Path(path)
    cfg = p if p.is_file() else p / "config.json"
    try:
        raw = cfg.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(
            f"config.json not found: {str(cfg)!r} does not exist", path=cfg
        ) from None
    except OSError as e:
        raise CheckpointError(
            f"config.json {str(cfg)!r} cannot be read ({e.strerror})", path=cfg
        ) from None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(
            f"config.json {str(cfg)!r} is not valid JSON ({str(e)[:120]})", path=cfg
        ) from None
    if not isinstance(doc, dict):
        raise CheckpointError(
            f"config.json {str(cfg)!r} must hold a JSON object, got {type(doc).__name__}", path=cfg
        )
    return doc


@frozen
class LoadStats:
    """What a load cost: proof that unrelated shards were never opened.

    ``files_opened``: shards opened to read tensor data; ``headers_read``: shards
    whose header (only) was read; ``shards_total``: shards the checkpoint has.
    ``tensor_bytes_read`` counts the stored bytes of the tensors (or slices) read.
    """

    shards_total: int
    files_opened: tuple[str, ...]
    headers_read: tuple[str, ...]
    tensors_loaded: int
    header_bytes_read: int
    tensor_bytes_read: int

    @property
    def bytes_read(self) -> int:
        return self.header_bytes_read + self.tensor_bytes_read


class LoadedWeights(dict[str, "torch.Tensor"]):
    """The loaded tensors by name, with ``.stats`` (a :class:`LoadStats`)."""

    stats: LoadStats


def _resolve_dtype(dtype: Any) -> torch.dtype | None:
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype {dtype!r} is not a torch dtype name (e.g. 'float32', 'bfloat16')")
    return value


def _slice_key(info: TensorInfo, spec: Any, file: Path) -> tuple[slice, ...]:
    try:
        dim, start, stop = spec
    except (TypeError, ValueError):
        raise ValueError(
            f"slice for tensor {info.name!r} must be (dim, start, stop), got {spec!r}"
        ) from None
    if not (0 <= dim < len(info.shape) and 0 <= start <= stop <= info.shape[dim]):
        raise CheckpointError(
            f"checkpoint file {str(file)!r}: slice (dim={dim}, {start}:{stop}) does not fit "
            f"tensor {info.name!r} of shape {list(info.shape)}",
            path=file,
        )
    return (slice(None),) * dim + (slice(start, stop),)


_Plan = dict[Path, tuple[FileHeader, list[TensorInfo]]]


def _check_shapes(plan: _Plan, shapes: PatternTable) -> None:
    bad, where = [], None
    for file, (_, infos) in plan.items():
        for info in infos:
            want = shapes.get(info.name)
            if want is not None and tuple(want) != info.shape:
                where = where or file
                bad.append(
                    f"{info.name!r} expected {list(want)}, got {list(info.shape)} in {file.name!r}"
                )
    if bad:
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise CheckpointError(f"tensor shape mismatch: {'; '.join(bad[:5])}{more}", path=where)


def _hub_snapshot(root: Path) -> bool:
    """Whether ``root`` is a snapshot folder of the Hugging Face cache
    (``models--org--name/snapshots/<commit>``)."""
    return root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--")


def _plan(index: CheckpointIndex, selection: WeightSelection) -> tuple[_Plan, list[FileHeader]]:
    """Needed file -> (its header, the wanted tensors in it), and the headers read to
    learn it (only the needed files' when there is an index)."""
    wanted = files_wanted(index, selection)
    absent = [f for f in index.files if f not in wanted and not f.exists()]
    if absent:
        # A Hub cache snapshot holds what was fetched (rtpcore.checkpoint.hub: only the shards
        # a model reads); elsewhere an index naming absent files is stale.
        logger.log(
            logging.DEBUG if _hub_snapshot(index.root) else logging.WARNING,
            "%s names %d file(s) that do not exist (%s); none holds a tensor this model needs",
            index.index_path,
            len(absent),
            ", ".join(f.name for f in absent[:3]),
        )
    plan: _Plan = {}
    headers = list(index.headers.values())
    for file in index.files:
        if file not in wanted:
            continue
        if not file.exists():
            raise CheckpointError(
                f"checkpoint index {str(index.index_path)!r} names {file.name!r}, which does not "
                f"exist; it holds needed tensors such as {wanted[file][0]!r}",
                path=file,
            )
        head = index.header(file)
        if index.source == "index":
            headers.append(head)
        plan[file] = (head, [head.tensors[n] for n in wanted[file]])
    return plan, headers


def _read_exact(f: io.FileIO, file: Path, head: FileHeader, info: TensorInfo) -> torch.Tensor:
    """Read one whole tensor with plain reads into memory it owns (no mapping)."""
    import torch

    n = info.nbytes
    buf = torch.empty(n, dtype=torch.uint8)
    if n:
        view = memoryview((ctypes.c_uint8 * n).from_address(buf.data_ptr())).cast("B")
        f.seek(head.header_bytes + info.begin)
        got = 0
        while got < n:  # a single read may return less (2 GiB per call on Linux)
            k = f.readinto(view[got:])
            if not k:
                raise CheckpointError(
                    f"checkpoint file {str(file)!r}: ended after {got} of {n} bytes of tensor "
                    f"{info.name!r} (changed while loading?)",
                    path=file,
                )
            got += k
    return buf.view(getattr(torch, info.torch_dtype_name)).reshape(info.shape)


def _read_file(
    file: Path,
    plan: tuple[FileHeader, list[TensorInfo]],
    slices: PatternTable,
    dtype: torch.dtype | None,
    dtypes: PatternTable,
    device: Any,
    lazy: bool,
) -> tuple[dict[str, torch.Tensor], int]:
    """The wanted tensors of one file, converted, and the stored bytes read.

    Whole tensors are read with plain reads into owned memory; slices (and every
    tensor when ``lazy``) go through ``safe_open``'s memory map.
    """
    head, infos = plan
    keys = {i.name: _slice_key(i, s, file) for i in infos if (s := slices.get(i.name)) is not None}
    mapped = [i for i in infos if lazy or i.name in keys]
    raw: dict[str, torch.Tensor] = {}
    try:
        if mapped:
            from safetensors import safe_open

            with safe_open(str(file), framework="pt", device="cpu") as sf:
                for info in mapped:
                    if info.name in keys:
                        raw[info.name] = sf.get_slice(info.name)[keys[info.name]]
                    else:
                        raw[info.name] = sf.get_tensor(info.name)
        if len(mapped) < len(infos):
            with open(file, "rb", buffering=0) as f:
                for info in infos:
                    if info.name not in raw:
                        raw[info.name] = _read_exact(f, file, head, info)
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointError(
            f"checkpoint file {str(file)!r}: cannot be read ({e.strerror})", path=file
        ) from e
    except Exception as e:  # safetensors raises SafetensorError or RuntimeError
        raise CheckpointError(
            f"checkpoint file {str(file)!r}: safetensors failed to read it ({e})", path=file
        ) from e
    out: dict[str, torch.Tensor] = {}
    nbytes = 0
    views = {i.name for i in mapped}
    for info in infos:
        t = raw[info.name]
        nbytes += t.numel() * t.element_size()
        storage = t.untyped_storage().data_ptr()
        target = dtypes.get(info.name) or dtype
        if target is not None and t.is_floating_point() and t.element_size() > 1:
            t = t.to(target)  # fp8 payloads stay as stored: scaling is the model's business
        if str(device) != "cpu":
            t = t.to(device)
        elif not lazy and info.name in views and t.untyped_storage().data_ptr() == storage:
            # A slice still viewing the file mapping: copy, so that the tensor owns its
            # memory and a file rewritten later cannot SIGBUS the process.
            t = t.clone()
        out[info.name] = t
    return out, nbytes


def load_checkpoint(
    path: str | os.PathLike[str],
    patterns: Iterable[str],
    ranges: Mapping[str, Iterable[int]] | None = None,
    *,
    dtype: Any = None,
    expected_shapes: Mapping[str, Sequence[int]] | None = None,
    device: Any = "cpu",
    slices: Mapping[str, tuple[int, int, int]] | None = None,
    lazy: bool = False,
    dtypes: Mapping[str, Any] | None = None,
    quantization: Any = None,
    tensor_names: Mapping[str, Any] | None = None,
) -> LoadedWeights:
    """Load the tensors matching ``patterns`` from the checkpoint at ``path``.

    ``dtype`` (a ``torch.dtype`` or its name) converts floating-point tensors wider
    than 8 bits; integer and fp8 tensors stay as stored. ``expected_shapes`` maps a
    pattern (or exact name) to the shape stored in the file, checked from the
    headers before any tensor data is read. ``slices`` maps a pattern to
    ``(dim, start, stop)``: only that part of the tensor is read (tensor parallel).
    ``dtypes`` maps a pattern to the dtype its tensors get instead of ``dtype``
    (e.g. a MoE router kept in float32 in a bfloat16 model).
    ``quantization``: the checkpoint's quantization method (``rtpcore.quantization``: the engine
    passes the one ``config.json`` declares or ``--quantization`` names), or an
    ``Fp8BlockQuantization.from_hf(hf_config)``: its ``select`` names the extra tensors read
    with the weights (fp8: each quantized tensor's ``_scale_inv`` companion) and its
    ``process_weights_after_loading`` turns them into what the model receives (fp8: the
    dequantized tensors in their dtype, see ``checkpoint_quant``; scales are not returned).

    Tensors own their memory: whole tensors are read with plain positioned reads
    (headers are validated first), slices through ``safe_open``'s ``get_slice``;
    the bytes are read before this returns. With ``lazy=True`` every tensor comes
    from ``safe_open``'s memory map and CPU tensors that need no conversion stay
    views of it (no copy, pages read on first touch, shared between processes);
    the files must then not be modified or truncated while the tensors live (the
    process would get SIGBUS).

    A GGUF checkpoint (``rtpcore.checkpoint.gguf``: a ``.gguf`` file, a split set, a folder
    holding one) is read from its memory map by ``rtpcore.checkpoint.gguf.weights``, with the
    same rules; ``tensor_names`` maps its GGUF names to the names ``patterns`` use (a model
    plugin's ``gguf_tensor_names``; a tensor it does not rename keeps its GGUF name). Its
    quantized tensors are dequantized, unless ``quantization`` is the ``gguf`` method
    (``rtpcore.quantization.GgufMethod``): then the 2-D tensors of the types it multiplies stay
    in their blocks, as :class:`~rtpcore.checkpoint.gguf.blocks.GGUFBlocks`.

    Raises :class:`MissingTensorsError` when a required tensor is in no file and
    :class:`CheckpointError` for any unusable file, naming it.
    """
    request = WeightRequest(patterns, ranges, quantization)
    WeightSelection.from_patterns(request.patterns, request.ranges)  # bad patterns fail before any file is read
    torch_dtype = _resolve_dtype(dtype)
    from rtpcore.checkpoint.gguf import is_gguf

    if is_gguf(path):
        return _load_gguf(path, request, torch_dtype, expected_shapes, device, slices, dtypes, tensor_names)
    index = build_index(path)
    selection, scaled = request.select(index.weight_map, slices)
    if scaled is not None:
        slices = {**(slices or {}), **scaled.extra_slices()}
        dtypes = {**(dtypes or {}), **scaled.extra_dtypes()}
    plan, headers = _plan(index, selection)
    if scaled is not None:
        scaled.check({info.name: info for _, infos in plan.values() for info in infos})
    _check_shapes(plan, PatternTable(expected_shapes))
    slice_lookup = PatternTable(slices)
    dtype_lookup = PatternTable(
        {pattern: _resolve_dtype(d) for pattern, d in (dtypes or {}).items()}
    )

    from tqdm import tqdm

    weights = LoadedWeights()
    tensor_bytes = 0
    for file in tqdm(plan, desc="loading shards", unit="shard", disable=not sys.stderr.isatty()):
        tensors, nbytes = _read_file(
            file, plan[file], slice_lookup, torch_dtype, dtype_lookup, device, lazy
        )
        weights.update(tensors)
        tensor_bytes += nbytes
        if scaled is not None:  # as soon as both halves are in: fp8 copies do not pile up
            scaled.process_weights_after_loading(weights, lambda name: dtype_lookup.get(name) or torch_dtype)
    weights.stats = LoadStats(
        shards_total=len(index.files),
        files_opened=tuple(f.name for f in plan),
        headers_read=tuple(h.path.name for h in headers),
        tensors_loaded=len(weights),
        header_bytes_read=sum(h.header_bytes for h in headers),
        tensor_bytes_read=tensor_bytes,
    )
    logger.info(
        "loaded %d tensors (%.1f MB) from %d of %d shards",
        len(weights),
        tensor_bytes / 1e6,
        len(plan),
        len(index.files),
    )
    return weights


def _load_gguf(
    path: str | os.PathLike[str],
    request: WeightRequest,
    dtype: torch.dtype | None,
    expected_shapes: Mapping[str, Sequence[int]] | None,
    device: Any,
    slices: Mapping[str, tuple[int, int, int]] | None,
    dtypes: Mapping[str, Any] | None,
    tensor_names: Mapping[str, Any] | None,
) -> LoadedWeights:
    """:func:`load_checkpoint` of a GGUF checkpoint (``rtpcore.checkpoint.gguf.weights``)."""
    from rtpcore.checkpoint.gguf import open_gguf
    from rtpcore.checkpoint.gguf.weights import load_gguf, renamed_tensors

    checkpoint = open_gguf(path)
    selection, scaled = request.select(renamed_tensors(checkpoint, tensor_names), slices)
    if scaled is not None:
        raise CheckpointError(
            f"GGUF file {str(checkpoint.path)!r}: quantization {request.quantization!r} reads tensors besides the "
            "weights (scales), which a GGUF file does not have",
            path=checkpoint.path,
        )
    tensors, nbytes = load_gguf(
        checkpoint, selection, tensor_names=tensor_names, dtype=dtype, expected_shapes=expected_shapes,
        device=device, slices=slices, dtypes=dtypes,
        # The types the quantization method multiplies in their blocks (rtpcore.quantization.GgufMethod).
        block_types=getattr(request.quantization, "gguf_types", ()),
    )
    weights = LoadedWeights(tensors)
    weights.stats = LoadStats(
        shards_total=len(checkpoint.files),
        files_opened=tuple(sorted({t.file.name for t in checkpoint.tensors.values()})),
        headers_read=tuple(f.name for f in checkpoint.files),
        tensors_loaded=len(weights),
        header_bytes_read=0,
        tensor_bytes_read=nbytes,
    )
    logger.info("loaded %d tensors (%.1f MB) from GGUF %s", len(weights), nbytes / 1e6, checkpoint.path)
    return weights

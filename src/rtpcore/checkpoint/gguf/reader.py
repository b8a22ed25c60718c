"""Open a GGUF checkpoint: one ``.gguf`` file, a split set, or a folder holding one model.

A GGUF file is::

    ┌───────┬─────────┬──────────────┬──────────────────────┬──────────────┬─────────────────────┐
    │ magic │ version │ counts (u64) │ metadata key/values  │ tensor infos │ aligned tensor data │
    └───────┴─────────┴──────────────┴──────────────────────┴──────────────┴─────────────────────┘

Each tensor info is (name, dims innermost first, GGML type, offset into the data region); a
quantized type stores a row as blocks (Q8_0: 32 weights in 34 bytes). The ``gguf`` package's
``GGUFReader`` parses the header and memory-maps the file: nothing here reads tensor data,
which stays in the mapping until :mod:`rtpcore.checkpoint.gguf.weights` asks for it.

The mapping is read-only and shared (``PROT_READ``, ``MAP_SHARED``): the weights kept in their
blocks are torch views of it (:meth:`GGUFCheckpoint.mapped_rows`), so their pages are the page
cache's -- counted once however many processes map the file, dropped under memory pressure and
read back from the file. Nothing may write through such a view (a write faults): only rtpcore's
kernels read them. Float tensors view a second, copy-on-write mapping of the file
(:meth:`GGUFCheckpoint.mapped_floats`; ``MAP_PRIVATE``): a model may change its float weights in
place, which makes the pages written private. Each view keeps its mapping alive; a mapping is
unmapped when the last view and the last :class:`GGUFCheckpoint` of the file are gone. A file
changed in place while mapped changes the weights (truncated: the process faults) -- as with
llama.cpp's ``mmap``.

The header is read by ``GGUFReader`` with two of its private methods replaced (``_get``,
``_get_field_parts``: see :func:`_reader`), reading it from a plain array over the mapping:
the package's own reading of a 49,152-entry vocabulary takes seconds.

A split set (``name-00001-of-00003.gguf`` ...) is written by ``llama-gguf-split``: every part
holds some tensors, the first the model's metadata (``split.count`` says how many parts). Any
part's name, or the folder, opens the whole set; a missing part is an error naming it.

Every problem is a :class:`~rtpcore.errors.CheckpointError` naming the file and, where there
is one, the metadata key or tensor (``.key``): a truncated file, a tensor of a type this
``gguf`` package does not know, a tensor whose data runs past the end of its file, a missing
part. Nothing is half-opened: :func:`open_gguf` returns a whole checkpoint or raises.
"""

from __future__ import annotations

import functools
import os
import posixpath
import re
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from attrs import field, frozen

from rtpcore.errors import CheckpointError

__all__ = [
    "GGUFCheckpoint",
    "GGUFTensor",
    "check_gguf_name",
    "describe_models",
    "gguf_file_in",
    "gguf_files",
    "gguf_models",
    "is_gguf",
    "open_gguf",
    "release_gguf_files",
    "release_unviewed_pages",
    "split_parts",
]

_SPLIT_RE = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


def _fail(path: object, problem: str, key: str | None = None) -> CheckpointError:
    return CheckpointError(f"GGUF file {str(path)!r}: {problem}", path=path, key=key)


@frozen
class GGUFTensor:
    """One tensor as its file's header describes it. ``shape`` is torch's order (outermost
    first: a linear weight is ``(out, in)``), ``type_name`` the GGML type (``"Q8_0"``,
    ``"F32"``), ``nbytes`` the bytes it takes in the file. :meth:`raw` is the stored bytes,
    still in their blocks: what a quantized kernel multiplies by, or
    :func:`gguf.quants.dequantize` turns into floats."""

    name: str
    type_name: str
    ggml_type: int
    shape: tuple[int, ...]
    nbytes: int
    offset: int  # absolute, in ``file``
    file: Path
    _data: Any = field(repr=False, eq=False)  # the reader's numpy view into the mapping

    def raw(self) -> Any:
        """The stored bytes as a numpy array viewing the file mapping (no copy): float types
        as their numpy dtype in ``shape``; quantized types as uint8 rows of blocks,
        ``(…, bytes per row)``. The file must stay unchanged while it is used."""
        return self._data

    @property
    def is_quantized(self) -> bool:
        """Whether the weights are stored in blocks (not F32, F16, BF16 or an integer type)."""
        return self.type_name not in _PLAIN_TYPES


_PLAIN_TYPES = frozenset({"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"})


@frozen
class GGUFCheckpoint:
    """A whole GGUF model: its metadata (key -> plain Python value: ``int``, ``float``,
    ``bool``, ``str`` or a list of them; the ``GGUF.*`` header fields left out) read from the
    first part, and every tensor of every part by its GGUF name (``blk.0.attn_q.weight``).
    ``files`` lists the parts in order; ``path`` is what was opened."""

    path: Path
    files: tuple[Path, ...]
    metadata: Mapping[str, Any]
    tensors: Mapping[str, GGUFTensor]
    # Each part's read-only np.memmap (the package's GGUFReader.data); the readers themselves, with a
    # numpy view per vocabulary entry, are dropped once the header is read.
    maps: tuple[Any, ...] = field(repr=False, eq=False)
    _mapped: dict[Path, Any] = field(factory=dict, init=False, repr=False, eq=False)  # file -> uint8 torch view
    _private: dict[Path, Any] = field(factory=dict, init=False, repr=False, eq=False)  # file -> (copy-on-write view, its np.memmap)

    @property
    def architecture(self) -> str:
        """``general.architecture`` (``"llama"``, ``"qwen2"``)."""
        return str(self.require("general.architecture", str))

    def require(self, key: str, kind: type | tuple[type, ...] | None = None) -> Any:
        """The metadata value of ``key``; a missing key, or one of another type than ``kind``,
        is a CheckpointError naming the file and the key."""
        if key not in self.metadata:
            raise _fail(self.files[0], f"metadata key {key!r} is missing", key)
        value = self.metadata[key]
        if kind is not None and not _is_kind(value, kind):
            names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            raise _fail(self.files[0], f"metadata key {key!r} must be {names}, got {value!r:.80}", key)
        return value

    def get(self, key: str, default: Any = None, kind: type | tuple[type, ...] | None = None) -> Any:
        """The metadata value of ``key``, ``default`` when absent; of the wrong type: an error."""
        return self.require(key, kind) if key in self.metadata else default

    def tensor(self, name: str) -> GGUFTensor:
        """The tensor ``name``; a missing one is a CheckpointError naming the file and it."""
        found = self.tensors.get(name)
        if found is None:
            raise _fail(self.path, f"tensor {name!r} is missing", name)
        return found

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def mapped_rows(self, tensor: GGUFTensor) -> Any:
        """``tensor``'s stored bytes as a uint8 torch tensor ``(rows, bytes per row)`` (a 1-D
        tensor: ``(1, nbytes)``) viewing the read-only file mapping: no byte is copied or read
        here. Every tensor of one file views one storage (the whole file), so the views of
        tensors stored back to back can be joined without a copy. The view keeps the mapping
        alive; nothing may write through it."""
        import warnings

        import torch

        mapping = self.maps[self.files.index(tensor.file)]
        base = self._mapped.get(tensor.file)
        if base is None:
            with warnings.catch_warnings():
                # torch has no read-only tensors and warns that a write through this one would
                # reach the buffer: here it would fault (PROT_READ), and nothing writes.
                warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
                base = torch.frombuffer(mapping, dtype=torch.uint8)
            self._mapped[tensor.file] = base
        rows = _count(tensor.shape[:-1]) if len(tensor.shape) > 1 else 1
        view = base[tensor.offset: tensor.offset + tensor.nbytes].view(rows, tensor.nbytes // max(rows, 1))
        return _handed_out(view, mapping)

    def mapped_floats(self, tensor: GGUFTensor) -> Any:
        """``tensor`` (F32, F16 or BF16) as a torch tensor of its dtype and shape viewing a
        copy-on-write mapping of its file (one per file, besides the read-only one): its pages are
        the page cache's until written, and a write -- a model is free to change its float weights
        in place -- makes the page private to the process, never reaching the file."""
        import numpy as np
        import torch

        dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}.get(tensor.type_name)
        if dtype is None:
            raise ValueError(f"tensor {tensor.name!r} is {tensor.type_name}, not F32, F16 or BF16")
        base = self._private.get(tensor.file)
        if base is None:
            mapping = np.memmap(tensor.file, mode="c")
            base = self._private[tensor.file] = (torch.frombuffer(mapping, dtype=torch.uint8), mapping)
        view = base[0][tensor.offset: tensor.offset + tensor.nbytes].view(dtype).view(tensor.shape)
        return _handed_out(view, base[1])


# -- pages only gone views read ----------------------------------------------------------------
#
# A weight the model does not keep as loaded -- q, k and v joined into one fused buffer, gate and
# up likewise, rows the converter permuted put back -- is read once from the mapping and copied.
# The pages it read stay mapped, and counted resident, for as long as the mapping lives (any other
# weight viewing it keeps it): an F32 file's fused projections counted twice, once in the copy and
# once in the file's pages. release_unviewed_pages gives those pages back.

#: Each view handed out of a mapping, weakly: (the view, the mapping's np.memmap, first byte, bytes).
_HANDED: list[tuple[Any, Any, int, int]] = []


def _handed_out(view: Any, mapping: Any) -> Any:
    if len(_HANDED) >= 4096:  # loads without a release after them: forget the unmapped files' views
        _HANDED[:] = [entry for entry in _HANDED if entry[1]() is not None]
    _HANDED.append((weakref.ref(view), weakref.ref(mapping), view.data_ptr(), view.numel() * view.element_size()))
    return view


def _extent(t: Any) -> tuple[int, int] | None:
    """``(first byte, end)`` of the memory a CPU tensor's elements lie in (None: no elements)."""
    try:
        if t.device.type != "cpu" or t.numel() == 0:
            return None
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()
    except RuntimeError:  # a wrapper subclass (no storage of its own): its views are listed instead
        return None


def release_unviewed_pages(live: Iterable[Any]) -> int:
    """Give back the pages of GGUF file mappings that no weight views any more (a weight copied
    into a fused or permuted buffer read them once), unmapping them (``madvise(MADV_DONTNEED)``);
    returns the bytes released. Only mappings a view was handed out of, and still mapped, are
    touched (a gone mapping's addresses may hold other memory by now), only those one of the
    ``live`` tensors (a model's parameters and buffers, and the views GGUF weights are made of)
    lies in (another model's mappings are left to its own call), and only after such a view is
    gone; every page a view still alive, or a ``live`` tensor, lies in is kept. A released
    page is the file's again: read later, it is mapped back from the file (never zeros); a write
    made to a copy-on-write page through a view now gone is lost with it, which no one can see.
    Linux (``madvise``); elsewhere, or without libc, nothing."""
    import ctypes
    import ctypes.util
    import mmap

    page = mmap.PAGESIZE
    entries, _HANDED[:] = list(_HANDED), []
    by_mapping: dict[int, tuple[Any, list[tuple[int, int]], bool]] = {}
    for view_ref, mapping_ref, start, size in entries:
        mapping = mapping_ref()
        if mapping is None:
            continue  # unmapped: its addresses are not ours to give back
        view = view_ref()
        if view is not None:
            _HANDED.append((view_ref, mapping_ref, start, size))
        held, kept, gone = by_mapping.get(id(mapping), (mapping, [], False))
        if view is not None:
            kept.append((start, start + size))
        by_mapping[id(mapping)] = (held, kept, gone or view is None)
    if not any(gone for _, _, gone in by_mapping.values()):
        return 0
    extents = [e for e in (_extent(t) for t in live) if e is not None]
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    released = 0
    for mapping, kept, gone in by_mapping.values():
        lo = mapping.ctypes.data
        hi = lo + mapping.nbytes
        viewed = [(s, e) for s, e in extents if s < hi and e > lo]
        if not gone or not viewed:
            continue
        first, last = -(-lo // page), hi // page  # whole pages of the mapping
        keep = [(max(s, lo) // page, (min(e, hi) - 1) // page) for s, e in (*kept, *viewed)]
        at = first  # the first page not known to be kept
        for a, b in [*sorted(keep), (last, last)]:
            end = min(a, last)
            if end > at and madvise(at * page, (end - at) * page, mmap.MADV_DONTNEED) == 0:
                released += (end - at) * page
            at = max(at, b + 1)
    return released


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _is_kind(value: Any, kind: type | tuple[type, ...]) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        return False  # True is no count
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        return True
    return isinstance(value, kinds)


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a GGUF checkpoint: a ``.gguf`` file, or a folder holding
    ``.gguf`` files and no safetensors (no file is opened)."""
    p = Path(path)
    if p.suffix == ".gguf":
        return True
    if not p.is_dir():
        return False
    names = [c.name for c in p.iterdir()]
    return any(n.endswith(".gguf") for n in names) and not any(n.endswith(".safetensors") for n in names)


def gguf_files(path: str | os.PathLike[str]) -> list[Path]:
    """The files of the GGUF checkpoint ``path`` in order: the file itself, every part of a
    split set (from any part's name), or the one model in a folder. A folder holding several
    models, a part whose set is incomplete or a path that is not there is a CheckpointError."""
    p = Path(path)
    if p.is_dir():
        found = sorted(c for c in p.iterdir() if c.name.endswith(".gguf") and c.is_file())
        if not found:
            raise CheckpointError(f"checkpoint directory {str(p)!r} holds no .gguf file", path=p)
        models = sorted({_set_name(f) for f in found})
        if len(models) > 1:
            raise CheckpointError(
                f"checkpoint directory {str(p)!r} holds {len(models)} GGUF models ({', '.join(models[:4])}); "
                "name the file to load",
                path=p,
            )
        return _parts(found[0])
    if not p.exists():
        raise _fail(p, "does not exist")
    return _parts(p)


def split_parts(name: str) -> list[str]:
    """Every part's name of the split set ``name`` belongs to, in order (``sub/m-00002-of-00003.gguf``:
    ``sub/m-00001-of-00003.gguf`` ... ``sub/m-00003-of-00003.gguf``), or ``[name]`` for a single file."""
    folder, base = posixpath.split(name)
    m = _SPLIT_RE.match(base)
    if m is None:
        return [name]
    count = int(m["count"])
    return [posixpath.join(folder, f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def gguf_models(names: Iterable[str]) -> list[str]:
    """The GGUF models among file names (a repository's or a folder's), sorted: each ``.gguf``
    file, and each split set once, as its first part's name (what ``gguf_file`` takes)."""
    return sorted({split_parts(n)[0] for n in names if n.endswith(".gguf")})


def describe_models(models: list[str]) -> str:
    """``models`` (:func:`gguf_models`) for a message: ``a.gguf, b-00001-of-00002.gguf (2 parts)``."""
    return ", ".join(m + (f" ({len(split_parts(m))} parts)" if len(split_parts(m)) > 1 else "") for m in models)


def check_gguf_name(checkpoint: str | os.PathLike[str], name: object) -> str:
    """``name`` if it can name a GGUF file within the checkpoint ``checkpoint`` (a Hub id's
    repository or a folder): a relative path ending in ``.gguf``, not leaving the folder, and
    ``checkpoint`` no file itself; else a CheckpointError naming both."""
    ref = os.fspath(checkpoint)
    if not isinstance(name, str) or not name.endswith(".gguf"):
        raise CheckpointError(
            f"gguf_file must name a .gguf file within the checkpoint {ref!r} (a Hub repository or a folder), "
            f"got {name!r}",
            path=ref,
        )
    parts = PurePosixPath(name).parts
    if name.startswith("/") or "\\" in name or ".." in parts:
        raise CheckpointError(
            f"gguf_file {name!r} must be a file's name (or relative path, with /) within the checkpoint {ref!r}",
            path=ref,
        )
    if os.path.isfile(ref):
        raise CheckpointError(
            f"gguf_file={name!r} picks a file within a Hub repository or a folder, but the checkpoint {ref!r} "
            "is a file itself: pass the file alone, or its folder with gguf_file",
            path=ref,
        )
    return name


def gguf_file_in(folder: str | os.PathLike[str], name: str) -> Path:
    """The GGUF checkpoint ``name`` (a ``.gguf`` file, or any part of a split set) in the local
    ``folder``: ``folder / name`` when it and every part of its set are there, else a
    CheckpointError naming the folder, the file and the folder's GGUF models."""
    root = Path(folder)
    check_gguf_name(root, name)
    if not root.is_dir():
        raise CheckpointError(
            f"checkpoint {str(root)!r} (with gguf_file={name!r}) is not a folder: no such path", path=root
        )
    missing = [part for part in split_parts(name) if not (root / part).is_file()]
    if missing:
        models = gguf_models(p.relative_to(root).as_posix() for p in root.rglob("*.gguf") if p.is_file())
        held = f"it holds {describe_models(models)}" if models else "it holds no .gguf file"
        what = f"file {name!r}" if missing == [name] else f"part {missing[0]!r} of the split set {name!r}"
        raise CheckpointError(f"checkpoint directory {str(root)!r} has no {what}; {held}", path=root / missing[0])
    return root / name


def _set_name(file: Path) -> str:
    m = _SPLIT_RE.match(file.name)
    return f"{m['stem']}-*-of-{m['count']}.gguf" if m else file.name


def _parts(file: Path) -> list[Path]:
    m = _SPLIT_RE.match(file.name)
    if m is None:
        return [file]
    count = int(m["count"])
    names = [file.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [n for n in names if not n.is_file()]
    if missing:
        raise _fail(
            missing[0],
            f"part {names.index(missing[0]) + 1} of the {count}-part set {file.name!r} belongs to is missing"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
            missing[0].name,
        )
    return names


def open_gguf(path: str | os.PathLike[str]) -> GGUFCheckpoint:
    """Open the GGUF checkpoint at ``path`` (:func:`gguf_files`): every part's header is
    parsed and its file memory-mapped; no tensor data is read. The last few checkpoints
    opened are kept (the engine asks for the config, the weights, the tokenizer and the
    template in turn): a file changed since (size or modification time) is opened again."""
    files = gguf_files(path)
    stamp = []
    for f in files:
        try:
            st = f.stat()
        except OSError as e:
            raise _fail(f, f"cannot be read ({e.strerror})") from None
        stamp.append((str(f), st.st_size, st.st_mtime_ns))
    return _open_cached(str(path), tuple(stamp))


def release_gguf_files() -> None:
    """Drop the checkpoints :func:`open_gguf` keeps open (the loader does once the weights are
    loaded, an engine when it closes): a file stays mapped while a checkpoint of it is kept or a
    weight loaded from it views its bytes (:meth:`GGUFCheckpoint.mapped_rows`,
    :meth:`GGUFCheckpoint.mapped_floats`), and is unmapped when neither is left. The next
    :func:`open_gguf` maps the file again."""
    _open_cached.cache_clear()


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, stamp: tuple[tuple[str, int, int], ...]) -> GGUFCheckpoint:
    files = [Path(f) for f, _, _ in stamp]
    readers = [_reader(f) for f in files]
    metadata = _metadata(files[0], readers[0])
    if len(files) > 1:
        declared = metadata.get("split.count")
        if declared is not None and declared != len(files):
            raise _fail(files[0], f"split.count is {declared!r} but the set has {len(files)} parts", "split.count")
    tensors: dict[str, GGUFTensor] = {}
    for file, reader in zip(files, readers, strict=True):
        for t in _tensors(file, reader):
            if t.name in tensors:
                raise _fail(file, f"tensor {t.name!r} is also in {tensors[t.name].file.name!r}", t.name)
            tensors[t.name] = t
    return GGUFCheckpoint(
        path=Path(path), files=tuple(files), metadata=metadata, tensors=tensors, maps=tuple(r.data for r in readers)
    )


def _reader(file: Path) -> Any:
    """The file's ``GGUFReader``, every failure a CheckpointError naming the file (and the
    tensor, for an unknown type or data past the end of the file)."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType

    # GGUFReader._build_tensors (private) is where the package turns tensor infos into arrays: the
    # infos are checked first. GGUFReader._get (private) reads every value of the header as a slice
    # of the file's np.memmap: a memmap slice runs numpy's Python-level memmap hooks, 4 of them per
    # entry of a 49,152-token vocabulary (1-4 s and 130 MiB of views on SmolLM2's file); slices of
    # a plain ndarray over the same mapping cost a fraction (the fix upstream proposes,
    # ggml-org/llama.cpp#13378). tests/test_gguf.py::test_the_private_reader_hooks_still_exist fails
    # loudly when a gguf release renames them or changes their arguments.
    class _CheckedReader(GGUFReader):
        _plain: Any = None

        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            if self._plain is None:
                self._plain = self.data.view(np.ndarray)
            count = int(count)
            dt = np.dtype(dtype)
            arr = self._plain[offset: offset + dt.itemsize * count].view(dt)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any], list[int], list[Any]]:
            # An array of scalars or strings read without the package's recursion per entry, into
            # the same parts (one per entry; a string's length then its bytes) and data indices.
            if raw_type != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            itype, n, offs = GGUFValueType(int(raw_itype[0])), int(alen[0]), orig_offs + 12
            types = [GGUFValueType.ARRAY] + ([itype] if n else [])
            parts: list[Any] = [raw_itype, alen]
            nptype = self.gguf_scalar_to_np.get(itype)
            if nptype is not None:
                values = self._get(offs, nptype, n)
                if len(values) != n:
                    raise IndexError(f"array of {n} entries runs past the end of the file")
                parts += [values[i: i + 1] for i in range(n)]
                return 12 + int(values.nbytes), parts, list(range(2, 2 + n)), types
            if itype != GGUFValueType.STRING:
                return super()._get_field_parts(orig_offs, raw_type)
            for _ in range(n):
                slen = self._get(offs, np.uint64)
                text = self._get(offs + 8, np.uint8, int(slen[0]))
                parts += (slen, text)
                offs += 8 + int(slen[0])
            return offs - orig_offs, parts, list(range(3, len(parts), 2)), types

        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            _check_tensor_infos(file, len(self.data), start_offs, fields)
            super()._build_tensors(start_offs, fields)

    try:
        size = file.stat().st_size
    except OSError as e:
        raise _fail(file, f"cannot be read ({e.strerror})") from None
    if not file.is_file():
        raise _fail(file, "is not a regular file")
    if size < 24:
        raise _fail(file, f"truncated: {size} bytes, shorter than a GGUF header")
    try:
        return _CheckedReader(file, "r")
    except CheckpointError:
        raise
    except OSError as e:
        raise _fail(file, f"cannot be read ({e.strerror})") from None
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, TypeError) as e:
        if "magic" in str(e):
            raise _fail(file, "is not a GGUF file (bad magic)") from None
        # The header parser reads past the end of the mapping as short arrays: a cut header.
        raise _fail(file, f"truncated or corrupt header ({type(e).__name__}: {str(e)[:160]})") from None


def _check_tensor_infos(file: Path, file_size: int, start: int, fields: list[Any]) -> None:
    """Each tensor info names a type the ``gguf`` package knows, and data inside the file."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    known = {int(t): t for t in GGMLQuantizationType}
    for info in fields:
        _name_len, name_data, _n_dims, dims, raw_type, offset = info.parts
        name = bytes(name_data).decode("utf-8", "replace")
        code = int(raw_type[0])
        qtype = known.get(code)
        if qtype is None or qtype not in GGML_QUANT_SIZES:
            raise _fail(
                file,
                f"tensor {name!r} has GGML type {code}, which this gguf package does not know "
                f"(known: {', '.join(t.name for t in GGML_QUANT_SIZES)})",
                name,
            )
        count = 1
        for d in dims.tolist():
            count *= int(d)
        block, size = GGML_QUANT_SIZES[qtype]
        if int(dims[0]) % block:
            raise _fail(file, f"tensor {name!r}: a row of {int(dims[0])} is not whole {qtype.name} blocks of {block}",
                        name)
        end = start + int(offset[0]) + count // block * size
        if end > file_size:
            raise _fail(
                file,
                f"truncated: tensor {name!r} ends at byte {end} but the file has {file_size} bytes",
                name,
            )


def _metadata(file: Path, reader: Any) -> dict[str, Any]:
    import numpy as np
    from gguf import GGUFValueType

    out: dict[str, Any] = {}
    for key, fld in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            value = fld.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as e:
            raise _fail(file, f"metadata key {key!r} cannot be read ({str(e)[:120]})", key) from None
        if fld.types and fld.types[0] == GGUFValueType.ARRAY and value is None:
            value = []
        elif fld.types == [GGUFValueType.FLOAT32]:
            value = float(str(np.float32(value)))  # 1e-06 as written, not 9.99999997e-07
        out[key] = value
    return out


def _tensors(file: Path, reader: Any) -> list[GGUFTensor]:
    out = []
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        out.append(
            GGUFTensor(
                name=t.name,
                type_name=t.tensor_type.name,
                ggml_type=int(t.tensor_type),
                shape=shape,
                nbytes=int(t.n_bytes),
                offset=int(t.data_offset),
                file=file,
                data=t.data,
            )
        )
    return out

"""Where every tensor of a safetensors checkpoint lives, read without touching tensor data.

A safetensors file is::

    ┌──────────────┬──────────────────────────┬───────────────────────────────┐
    │ u64 LE: N    │ N bytes of JSON header   │ data region (tensors, packed) │
    └──────────────┴──────────────────────────┴───────────────────────────────┘

The header maps tensor names to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets relative to the data region) plus an optional ``"__metadata__"`` string map.

This module validates headers itself, in pure Python, before ``safetensors`` ever
sees the file: every problem becomes a :class:`~rtpcore.errors.CheckpointError`
naming the file and the rule. It imports neither torch nor safetensors.

A checkpoint directory is indexed from ``model.safetensors.index.json`` (its
``weight_map``) when present, else from the header of every ``*.safetensors`` file.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from attrs import field, frozen

from rtpcore.errors import CheckpointError

__all__ = [
    "DTYPES",
    "INDEX_NAME",
    "MAX_HEADER_BYTES",
    "CheckpointIndex",
    "FileHeader",
    "TensorInfo",
    "build_index",
    "parse_header",
    "read_header",
]

logger = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
# The same bound safetensors itself enforces; a larger length prefix is garbage.
MAX_HEADER_BYTES = 100_000_000

# safetensors dtype code -> (bytes per element, torch dtype name). Sub-byte formats
# (F4, F6_*) are known to safetensors but not loadable here.
DTYPES: Mapping[str, tuple[int, str]] = {
    "BOOL": (1, "bool"),
    "U8": (1, "uint8"),
    "I8": (1, "int8"),
    "F8_E5M2": (1, "float8_e5m2"),
    "F8_E4M3": (1, "float8_e4m3fn"),
    "F8_E8M0": (1, "float8_e8m0fnu"),
    "I16": (2, "int16"),
    "U16": (2, "uint16"),
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "I32": (4, "int32"),
    "U32": (4, "uint32"),
    "F32": (4, "float32"),
    "I64": (8, "int64"),
    "U64": (8, "uint64"),
    "F64": (8, "float64"),
}
_MAX_ELEMENTS = 2**60
_UNSUPPORTED_DTYPES = frozenset({"F4", "F6_E2M3", "F6_E3M2", "C64"})


@frozen
class TensorInfo:
    """One tensor as its file header describes it; offsets are relative to the data region."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def torch_dtype_name(self) -> str:
        return DTYPES[self.dtype][1]


@frozen
class FileHeader:
    """The validated header of one safetensors file."""

    path: Path
    header_len: int
    file_size: int
    tensors: Mapping[str, TensorInfo]
    metadata: Mapping[str, str] = field(factory=dict)

    @property
    def header_bytes(self) -> int:
        """Bytes read to learn this header (length prefix included)."""
        return 8 + self.header_len


def _fail(path: object, problem: str) -> CheckpointError:
    return CheckpointError(f"checkpoint file {str(path)!r}: {problem}", path=path)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _reject_constant(token: str) -> Any:
    raise ValueError(f"{token} is not JSON")


def _is_int(value: object) -> bool:
    return type(value) is int


def _tensor_info(path: object, name: str, info: object, data_len: int) -> TensorInfo:
    if not isinstance(info, dict):
        raise _fail(
            path, f"tensor {name!r}: entry must be a JSON object, got {type(info).__name__}"
        )
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        raise _fail(path, f"tensor {name!r}: 'dtype' must be a string, got {dtype!r:.60}")
    if dtype not in DTYPES:
        kind = "unsupported" if dtype in _UNSUPPORTED_DTYPES else "unknown"
        raise _fail(
            path, f"tensor {name!r}: {kind} dtype {dtype!r:.40} (supported: {', '.join(DTYPES)})"
        )
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise _fail(
            path,
            f"tensor {name!r}: 'shape' must be a list of non-negative integers, got {shape!r:.80}",
        )
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise _fail(
            path,
            f"tensor {name!r}: 'data_offsets' must be [begin, end] integers, got {offsets!r:.80}",
        )
    begin, end = offsets
    if not 0 <= begin <= end:
        raise _fail(
            path, f"tensor {name!r}: data_offsets [{begin}, {end}] are not 0 <= begin <= end"
        )
    if end > data_len:
        raise _fail(
            path,
            f"tensor {name!r}: data_offsets [{begin}, {end}] are out of range: the data region "
            f"holds {data_len} bytes (file truncated?)",
        )
    count = 1
    for d in shape:
        count *= d
        if count > _MAX_ELEMENTS:  # safetensors multiplies in u64 and refuses an overflow
            raise _fail(path, f"tensor {name!r}: shape {shape!r:.80} overflows 64-bit sizes")
    needed = count * DTYPES[dtype][0]
    if needed != end - begin:
        raise _fail(
            path,
            f"tensor {name!r}: shape {shape} of {dtype} needs {needed} bytes but data_offsets "
            f"[{begin}, {end}] span {end - begin}",
        )
    return TensorInfo(name=name, dtype=dtype, shape=tuple(shape), begin=begin, end=end)


def _check_layout(path: object, tensors: Mapping[str, TensorInfo], data_len: int) -> None:
    """Tensors must tile the data region exactly: no overlap, no gap, no trailing bytes."""
    pos, prev = 0, None
    for t in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if t.begin < pos:
            assert prev is not None
            raise _fail(
                path,
                f"tensors {prev.name!r} [{prev.begin}, {prev.end}] and {t.name!r} "
                f"[{t.begin}, {t.end}] overlap",
            )
        if t.begin > pos:
            raise _fail(
                path,
                f"data region has a gap of {t.begin - pos} bytes at offset {pos} before tensor {t.name!r}",
            )
        pos, prev = t.end, t
    if pos != data_len:
        raise _fail(
            path,
            f"data region holds {data_len} bytes but tensors cover only {pos} (trailing bytes)",
        )


def parse_header(
    raw: bytes, *, file_size: int | None = None, path: object = "<bytes>"
) -> FileHeader:
    """Validate a safetensors header.

    ``raw`` starts at byte 0 of the file and holds at least the length prefix and
    the header (the whole file is fine); ``file_size`` is the size of the whole
    file (default ``len(raw)``). Raises :class:`CheckpointError` for anything
    safetensors would refuse, and nothing else.
    """
    size = len(raw) if file_size is None else file_size
    if size < 8 or len(raw) < 8:
        raise _fail(path, f"truncated: {size} bytes, shorter than the 8-byte header length prefix")
    n = int.from_bytes(raw[:8], "little")
    if n == 0:
        raise _fail(path, "header length is 0")
    if n > MAX_HEADER_BYTES:
        raise _fail(
            path,
            f"header length {n} exceeds the limit of {MAX_HEADER_BYTES} bytes (not a safetensors file?)",
        )
    if 8 + n > size or 8 + n > len(raw):
        raise _fail(
            path, f"header length {n} goes beyond the end of the file ({size} bytes; truncated?)"
        )
    try:
        text = raw[8 : 8 + n].decode("utf-8")
        header = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    # JSONDecodeError and UnicodeDecodeError are ValueErrors; deep nesting is a RecursionError.
    except (ValueError, RecursionError) as e:
        raise _fail(path, f"header is not valid JSON ({str(e)[:120]})") from None
    if not isinstance(header, dict):
        raise _fail(path, f"header must be a JSON object, got {type(header).__name__}")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _fail(path, "'__metadata__' must be an object of string values")
    data_len = size - 8 - n
    tensors = {name: _tensor_info(path, name, info, data_len) for name, info in header.items()}
    _check_layout(path, tensors, data_len)
    return FileHeader(
        path=Path(str(path)), header_len=n, file_size=size, tensors=tensors, metadata=metadata
    )


def _stat_regular(path: Path) -> os.stat_result:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise _fail(path, "does not exist") from None
    except OSError as e:
        raise _fail(path, f"cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        # A FIFO or device would block or stream forever; a directory is a mistake.
        raise _fail(path, "is not a regular file")
    return st


def read_header(path: Path) -> FileHeader:
    """Read and validate the header of one file: the length prefix and the JSON, no tensor data."""
    st = _stat_regular(path)
    try:
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) == 8:
                n = int.from_bytes(prefix, "little")
                if 0 < n <= MAX_HEADER_BYTES and 8 + n <= st.st_size:
                    prefix += f.read(n)
    except OSError as e:
        raise _fail(path, f"cannot be read ({e.strerror})") from None
    return parse_header(prefix, file_size=st.st_size, path=path)


@frozen
class CheckpointIndex:
    """Tensor name -> file for a whole checkpoint.

    ``source`` is ``"index"`` (from ``model.safetensors.index.json``; headers are
    read later, only for the files needed) or ``"headers"`` (every file's header
    was read; ``headers`` holds them all). ``files`` lists every shard the
    checkpoint names, in order.
    """

    root: Path
    source: str
    files: tuple[Path, ...]
    weight_map: Mapping[str, Path]
    headers: Mapping[Path, FileHeader] = field(factory=dict)
    index_path: Path | None = None

    def header(self, file: Path) -> FileHeader:
        """The validated header of ``file``, checked against the index when there is one."""
        if file in self.headers:
            return self.headers[file]
        head = read_header(file)
        assert self.index_path is not None
        expected = sorted(n for n, f in self.weight_map.items() if f == file)
        lacking = [n for n in expected if n not in head.tensors]
        if lacking:
            raise _fail(
                file,
                f"header disagrees with {self.index_path.name!r}: it lacks {len(lacking)} tensor(s) "
                f"the index maps to this file: {', '.join(map(repr, lacking[:5]))}",
            )
        elsewhere = [n for n in head.tensors if n in self.weight_map and self.weight_map[n] != file]
        if elsewhere:
            other = self.weight_map[elsewhere[0]].name
            raise _fail(
                file,
                f"header disagrees with {self.index_path.name!r}: tensor {elsewhere[0]!r} is "
                f"here but the index maps it to {other!r}",
            )
        return head


def _read_index(root: Path, index_path: Path) -> CheckpointIndex:
    def bad(problem: str) -> CheckpointError:
        return CheckpointError(f"checkpoint index {str(index_path)!r}: {problem}", path=index_path)

    try:
        doc = json.loads(index_path.read_bytes())
    except OSError as e:
        raise bad(f"cannot be read ({e.strerror})") from None
    except (ValueError, RecursionError) as e:
        raise bad(f"is not valid JSON ({str(e)[:120]})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise bad("must be a JSON object with a 'weight_map' object (tensor name -> file name)")
    resolved: dict[str, Path] = {}
    files: dict[Path, None] = {}
    for name, fname in weight_map.items():
        if not isinstance(fname, str) or not fname:
            raise bad(f"tensor {name!r} maps to {fname!r}, not a file name")
        rel = PurePosixPath(fname)
        if rel.is_absolute() or ".." in rel.parts:
            raise bad(f"tensor {name!r} maps to {fname!r}, outside the checkpoint directory")
        file = root / rel
        files[file] = None
        resolved[name] = file
    return CheckpointIndex(
        root=root,
        source="index",
        files=tuple(sorted(files)),
        weight_map=resolved,
        index_path=index_path,
    )


def _read_headers(root: Path, files: list[Path]) -> CheckpointIndex:
    headers = {f: read_header(f) for f in files}
    owner: dict[str, Path] = {}
    for file, head in headers.items():
        for name in head.tensors:
            if name in owner:
                raise _fail(
                    file, f"tensor {name!r} is also in {owner[name].name!r} (no index to choose)"
                )
            owner[name] = file
    return CheckpointIndex(
        root=root, source="headers", files=tuple(files), weight_map=owner, headers=headers
    )


def build_index(path: str | os.PathLike[str]) -> CheckpointIndex:
    """Index a checkpoint directory, a single ``.safetensors`` file, or an index file."""
    root = Path(path)
    if root.is_file():
        if root.name.endswith(".index.json"):
            return _read_index(root.parent, root)
        return _read_headers(root.parent, [root])
    if not root.is_dir():
        raise CheckpointError(f"checkpoint {str(root)!r} does not exist", path=root)
    index_path = root / INDEX_NAME
    if index_path.exists():
        return _read_index(root, index_path)
    files = sorted(p for p in root.glob("*.safetensors"))
    if not files:
        others = sorted(
            p.name for p in root.iterdir() if p.suffix in {".bin", ".pt", ".pth", ".gguf"}
        )
        hint = f" (found {', '.join(others[:3])}; only safetensors is supported)" if others else ""
        raise CheckpointError(
            f"checkpoint directory {str(root)!r} holds no *.safetensors files and no {INDEX_NAME}{hint}",
            path=root,
        )
    logger.debug("indexing %d safetensors files in %s from their headers", len(files), root)
    return _read_headers(root, files)

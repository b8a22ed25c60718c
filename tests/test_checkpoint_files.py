"""Broken checkpoint files and indexes: each is a CheckpointError naming the file and the problem.

Header validation is ours (pure Python, before safetensors sees a file); safetensors
itself is the oracle: whatever we accept it must accept too, and what we refuse it
refuses as well (except the few rules where we are deliberately stricter).
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import deserialize
from safetensors.torch import load as st_load
from safetensors.torch import save, save_file

from rtpcore.checkpoint import load_checkpoint
from rtpcore.checkpoint.index import DTYPES, INDEX_NAME, parse_header
from rtpcore.errors import CheckpointError

FUZZ = settings(max_examples=300, deadline=None, database=None)

VALID = save(
    {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.int8)}
)


def _raw(header: dict | bytes, data: bytes = b"", *, length: int | None = None) -> bytes:
    """Bytes of a safetensors file built by hand: prefix, header, data."""
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(h) if length is None else length) + h + data


def _t(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def _safetensors_refuses(blob: bytes) -> bool:
    try:
        deserialize(blob)
    except Exception:
        return True
    return False


F32x2 = _t("F32", [2], 0, 8)
BAD_FILES = {
    "empty file": (b"", "truncated: 0 bytes"),
    "shorter than the prefix": (b"\x10\x00\x00", "truncated: 3 bytes"),
    "header length beyond file": (
        _raw(b'{"a":1}', length=1000),
        "header length 1000 goes beyond the end of the file",
    ),
    "absurd header length": (struct.pack("<Q", 2**63) + b"{}", "exceeds the limit"),
    "header length zero": (_raw(b"", length=0) + b"{}", "header length is 0"),
    "header not JSON": (_raw(b"{not json"), "header is not valid JSON"),
    "header not UTF-8": (_raw(b'{"\xff\xfe": 1}'), "header is not valid JSON"),
    "header a list": (_raw(b"[]"), "header must be a JSON object, got list"),
    "NaN in header": (_raw(b'{"a": NaN}'), "header is not valid JSON"),
    "deep nesting": (
        _raw(b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        "header is not valid JSON",
    ),
    "entry not an object": (_raw({"a": [1, 2]}), "tensor 'a': entry must be a JSON object"),
    "dtype missing": (
        _raw({"a": {"shape": [1], "data_offsets": [0, 4]}}, bytes(4)),
        "'dtype' must be a string",
    ),
    "unknown dtype": (
        _raw({"a": _t("F33", [2], 0, 8)}, bytes(8)),
        "tensor 'a': unknown dtype 'F33'",
    ),
    "negative dim": (
        _raw({"a": _t("F32", [-1], 0, 4)}, bytes(4)),
        "'shape' must be a list of non-negative integers",
    ),
    "bool dim": (
        _raw({"a": _t("F32", [True], 0, 4)}, bytes(4)),
        "'shape' must be a list of non-negative integers",
    ),
    "offsets not a pair": (
        _raw({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, bytes(4)),
        "'data_offsets' must be [begin, end]",
    ),
    "offsets reversed": (_raw({"a": _t("F32", [0], 4, 0)}, bytes(4)), "are not 0 <= begin <= end"),
    "offsets out of range": (
        _raw({"a": F32x2}, bytes(5)),
        "data_offsets [0, 8] are out of range: the data region holds 5 bytes",
    ),
    "shape disagrees with offsets": (
        _raw({"a": _t("F32", [3], 0, 8)}, bytes(8)),
        "shape [3] of F32 needs 12 bytes but data_offsets [0, 8] span 8",
    ),
    "overlap": (
        _raw({"a": F32x2, "b": _t("F32", [1], 4, 8)}, bytes(8)),
        "tensors 'a' [0, 8] and 'b' [4, 8] overlap",
    ),
    "gap": (
        _raw({"a": _t("F32", [1], 0, 4), "b": _t("F32", [1], 8, 12)}, bytes(12)),
        "gap of 4 bytes at offset 4",
    ),
    "trailing bytes": (_raw({"a": F32x2}, bytes(12)), "holds 12 bytes but tensors cover only 8"),
    "bad metadata": (
        _raw({"__metadata__": {"k": 1}, "a": F32x2}, bytes(8)),
        "'__metadata__' must be an object of string values",
    ),
    "shape overflow": (_raw({"a": _t("U8", [2**40, 2**40, 0], 0, 0)}), "overflows 64-bit sizes"),
}
STRICTER_THAN_SAFETENSORS = {"duplicate tensor name", "unsupported dtype F4"}
BAD_FILES["duplicate tensor name"] = (
    _raw(
        b'{"a": {"dtype":"F32","shape":[1],"data_offsets":[0,4]}, "a": {"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
        bytes(4),
    ),
    "header is not valid JSON (duplicate key 'a')",
)
BAD_FILES["unsupported dtype F4"] = (
    _raw({"a": _t("F4", [2], 0, 1)}, bytes(1)),
    "unsupported dtype 'F4'",
)


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_is_a_checkpoint_error_naming_file_and_problem(tmp_path, case):
    """Each broken file fails to load with the file's path and the rule it broke."""
    blob, problem = BAD_FILES[case]
    path = tmp_path / "model.safetensors"
    path.write_bytes(blob)
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(tmp_path, ["a"], {})
    assert str(excinfo.value).startswith(f"checkpoint file {str(path)!r}: ")
    assert problem in str(excinfo.value)
    assert excinfo.value.path == path
    if case not in STRICTER_THAN_SAFETENSORS:
        assert _safetensors_refuses(blob), "the oracle accepts a file we refuse"


def test_truncated_real_file_is_named(tmp_path):
    """A real file cut short anywhere is a CheckpointError, never a crash."""
    path = tmp_path / "model.safetensors"
    for cut in (3, 8, 20, len(VALID) - 1):
        path.write_bytes(VALID[:cut])
        with pytest.raises(CheckpointError, match="truncated"):
            load_checkpoint(tmp_path, ["a"], {})


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_not_a_regular_file_is_refused_without_hanging(tmp_path, kind):
    """A FIFO (which would block forever on open) or a directory named *.safetensors is refused."""
    path = tmp_path / "model.safetensors"
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    with pytest.raises(CheckpointError, match="is not a regular file"):
        load_checkpoint(tmp_path, ["a"], {})


def test_empty_directory_says_so(tmp_path):
    """An empty checkpoint directory is a CheckpointError saying there is nothing to load."""
    with pytest.raises(
        CheckpointError,
        match=r"holds no \*\.safetensors files and no model\.safetensors\.index\.json",
    ) as excinfo:
        load_checkpoint(tmp_path, ["a"], {})
    assert excinfo.value.path == tmp_path


def test_pytorch_bin_only_directory_hints_at_format(tmp_path):
    """A directory with only pytorch_model.bin says that only safetensors is supported."""
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(
        CheckpointError, match=re.escape("found pytorch_model.bin; only safetensors is supported")
    ):
        load_checkpoint(tmp_path, ["a"], {})


def test_missing_path_is_named(tmp_path):
    """A checkpoint path that does not exist is named."""
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope", ["a"], {})


def test_same_tensor_in_two_files_without_index(tmp_path):
    """Without an index, two files holding one name is ambiguous and refused."""
    save_file({"a": torch.ones(1)}, tmp_path / "a.safetensors")
    save_file({"a": torch.zeros(1)}, tmp_path / "b.safetensors")
    with pytest.raises(CheckpointError, match=re.escape("tensor 'a' is also in 'a.safetensors'")):
        load_checkpoint(tmp_path, ["a"], {})


def _sharded(tmp_path: Path, weight_map: dict[str, str]) -> Path:
    save_file({"a": torch.ones(2)}, tmp_path / "s1.safetensors")
    save_file({"b": torch.zeros(3)}, tmp_path / "s2.safetensors")
    (tmp_path / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tmp_path


@pytest.mark.parametrize(
    ("doc", "problem"),
    [
        ("{", "is not valid JSON"),
        ('{"metadata": {}}', "must be a JSON object with a 'weight_map' object"),
        ('{"weight_map": {"a": 3}}', "tensor 'a' maps to 3, not a file name"),
        ('{"weight_map": {"a": "../s1.safetensors"}}', "outside the checkpoint directory"),
        ('{"weight_map": {"a": "/etc/passwd"}}', "outside the checkpoint directory"),
    ],
)
def test_bad_index_is_named(tmp_path, doc, problem):
    """A malformed index is a CheckpointError naming the index file."""
    _sharded(tmp_path, {})
    (tmp_path / INDEX_NAME).write_text(doc)
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(tmp_path, ["a"], {})
    assert str(excinfo.value).startswith(f"checkpoint index {str(tmp_path / INDEX_NAME)!r}: ")
    assert problem in str(excinfo.value)


def test_index_naming_a_missing_needed_file(tmp_path):
    """The index maps a needed tensor to a file that does not exist: error naming that file."""
    _sharded(tmp_path, {"a": "s1.safetensors", "b": "s9.safetensors"})
    with pytest.raises(
        CheckpointError,
        match=re.escape(
            "names 's9.safetensors', which does not exist; it holds needed tensors such as 'b'"
        ),
    ) as excinfo:
        load_checkpoint(tmp_path, ["b"], {})
    assert excinfo.value.path == tmp_path / "s9.safetensors"


def test_index_naming_a_missing_unneeded_file_only_warns(tmp_path, caplog):
    """A stale index entry for a file whose tensors nobody needs is logged, and loading goes on."""
    _sharded(tmp_path, {"a": "s1.safetensors", "mtp.x": "s9.safetensors"})
    with caplog.at_level(logging.WARNING, logger="rtpcore.checkpoint"):
        w = load_checkpoint(tmp_path, ["a"], {})
    assert list(w) == ["a"]
    assert any("s9.safetensors" in r.getMessage() for r in caplog.records)


def test_header_lacking_a_tensor_the_index_maps_to_it(tmp_path):
    """The index says 'b' is in s1 but s1's header does not hold it."""
    _sharded(tmp_path, {"a": "s1.safetensors", "b": "s1.safetensors"})
    with pytest.raises(
        CheckpointError,
        match=r"s1.safetensors': header disagrees with 'model.safetensors.index.json': it lacks 1 tensor\(s\) the index maps to this file: 'b'",
    ):
        load_checkpoint(tmp_path, ["a"], {})


def test_header_holding_a_tensor_the_index_puts_elsewhere(tmp_path):
    """s2 holds 'b' but the index says 'b' lives in s1 (which lacks it): either way it is named."""
    _sharded(tmp_path, {"a": "s2.safetensors", "b": "s2.safetensors"})
    (tmp_path / INDEX_NAME).write_text(
        json.dumps(
            {"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"}}
        )
    )
    save_file({"b": torch.zeros(3), "c": torch.ones(1)}, tmp_path / "s2.safetensors")
    with pytest.raises(
        CheckpointError,
        match=re.escape("tensor 'b' is here but the index maps it to 's1.safetensors'"),
    ):
        load_checkpoint(tmp_path, ["c"], {})


# ---------------------------------------------------------------- fuzzing


def _agrees_with_oracle(blob: bytes) -> None:
    """Our parser raises only CheckpointError; what it accepts, safetensors reads the same way
    (names, dtypes, shapes and the bytes our offsets point at)."""
    try:
        head = parse_header(blob)
    except CheckpointError:
        return
    theirs = dict(deserialize(blob))
    assert set(theirs) == set(head.tensors)
    start = 8 + head.header_len
    for name, info in head.tensors.items():
        assert (theirs[name]["dtype"], tuple(theirs[name]["shape"])) == (info.dtype, info.shape)
        assert theirs[name]["data"] == blob[start + info.begin : start + info.end]


@FUZZ
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(blob):
    """Random bytes never raise anything but CheckpointError."""
    _agrees_with_oracle(blob)


@FUZZ
@given(st.binary(max_size=200), st.binary(max_size=64))
def test_fuzz_random_header_with_valid_length(header, data):
    """Random header bytes behind a correct length prefix reach the JSON path."""
    _agrees_with_oracle(_raw(header, data))


@st.composite
def _mutated(draw: st.DrawFn) -> bytes:
    blob = bytearray(VALID)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "cut", "insert", "delete"]))
        i = draw(st.integers(0, max(len(blob) - 1, 0)))
        if op == "flip" and blob:
            blob[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and blob:
            blob[i] = draw(st.sampled_from(b'{}[]",:0123456789-eE .\x00\xff'))
        elif op == "cut":
            del blob[i:]
        elif op == "insert":
            blob[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del blob[i : i + draw(st.integers(1, 8))]
    return bytes(blob)


@FUZZ
@given(_mutated())
def test_fuzz_mutated_valid_file(blob):
    """Bit flips, cuts, insertions and deletions in a real file: CheckpointError or an exact load."""
    _agrees_with_oracle(blob)


_DTYPE_NAMES = st.sampled_from([*DTYPES, "F4", "F6_E2M3", "C64", "f32", ""])


@st.composite
def _headers(draw: st.DrawFn) -> tuple[dict, int]:
    """Mostly consistent headers (packed tensors, exact data length), then a few small lies."""
    header: dict = {}
    pos = 0
    for name in draw(st.lists(st.sampled_from("abcd"), unique=True, max_size=3)):
        dtype = draw(_DTYPE_NAMES)
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        size = DTYPES.get(dtype, (1, ""))[0]
        n = size
        for d in shape:
            n *= d
        header[name] = _t(dtype, shape, pos, pos + n)
        pos += n
    if header and draw(st.booleans()):
        entry = header[draw(st.sampled_from(sorted(header)))]
        what = draw(st.sampled_from(["begin", "end", "dim", "dtype"]))
        delta = draw(st.integers(-3, 3))
        if what in ("begin", "end"):
            entry["data_offsets"][what == "end"] += delta
        elif what == "dim" and entry["shape"]:
            entry["shape"][0] += delta
        else:
            entry["dtype"] = draw(_DTYPE_NAMES)
    data_len = pos + draw(st.sampled_from([0, 0, 0, -1, 1, 4]))
    return header, max(data_len, 0)


@settings(FUZZ, suppress_health_check=[HealthCheck.too_slow])
@given(_headers())
def test_fuzz_structured_headers_match_safetensors_exactly(case):
    """Plausible headers (dtypes, shapes, offsets, data lengths, small lies): we accept
    exactly what safetensors accepts."""
    header, data_len = case
    blob = _raw(header, bytes(data_len))
    try:
        parse_header(blob)
        ours = True
    except CheckpointError:
        ours = False
    if any(t["dtype"] in ("F4", "F6_E2M3", "C64") for t in header.values()):
        assert not ours  # sub-byte and complex formats: refused on purpose
    else:
        assert ours == (not _safetensors_refuses(blob)), (header, data_len)


@settings(max_examples=40, deadline=None, database=None)
@given(_mutated(), st.booleans())
def test_fuzz_mutated_files_through_load_checkpoint(tmp_path_factory, blob, lazy):
    """End to end on real files (plain reads, or safe_open when lazy): success or
    CheckpointError, nothing else."""
    d = tmp_path_factory.mktemp("fuzz")
    (d / "model.safetensors").write_bytes(blob)
    try:
        w = load_checkpoint(d, ["{x}", "a", "b"], {}, lazy=lazy)
    except CheckpointError as e:
        assert str(d / "model.safetensors") in str(e) or str(d) in str(e)
    else:
        theirs = st_load(blob)
        for name, t in w.items():  # compare bytes: a flipped bit may well be a NaN
            assert t.reshape(-1).view(torch.uint8).equal(theirs[name].reshape(-1).view(torch.uint8))

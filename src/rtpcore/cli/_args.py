"""Argument types shared by the subcommands."""

from __future__ import annotations

import argparse
import re


def positive_int(text: str) -> int:
    """argparse type: a positive integer, else a usage error (exit status 2) naming the text."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}  # fmt: skip
_BYTES_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_bytes(text: str) -> int:
    """argparse ``type=`` for ``--memory``: ``1073741824``, ``8GiB``, ``512MB``, ``1.5G``."""
    match = _BYTES_RE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"invalid byte count {text!r}: use an integer with an optional unit "
            "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    number = match.group(1)
    value = int(number) * _UNITS[unit] if "." not in number else int(float(number) * _UNITS[unit])
    return value

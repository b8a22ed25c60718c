"""Argument types shared by the subcommands."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse type: a positive integer, else a usage error (exit status 2) naming the text."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value

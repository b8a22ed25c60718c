"""The ``rtpcore`` command: a thin shell over the library.

This package is the only place that prints or chooses exit codes:
0 success, 2 bad usage (argparse, allowlist validation), 1 any other error,
printed as one line ``rtpcore: error: ...`` (a traceback only with ``--debug``).
It is also the only place that configures logging: while a command runs, one handler on
the root logger writes records to stderr, and ``--log-level`` (every subcommand takes it,
default ``info``) sets the level of the ``rtpcore`` loggers, so that rtpcore's warnings
reach the operator (the package itself installs only a ``NullHandler``).

Each subcommand lives in its own module exposing ``add_parser(subparsers)``;
the module is imported when the parser is built, and must not import torch at
module level (``--help``, ``--version`` and ``plugins list`` never import torch).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

from rtpcore.errors import AllowlistError, EngineBuildError, RtpcoreError

__all__ = ["main"]

_COMMANDS = ("rtpcore.cli._plugins", "rtpcore.cli._kv_spec", "rtpcore.cli._generate", "rtpcore.cli._serve",
             "rtpcore.cli._info")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rtpcore")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rtpcore",
        description="Load external model packages into an LLM inference engine.",
    )
    parser.add_argument("--version", action="version", version=f"rtpcore {_version()}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _COMMANDS:
        importlib.import_module(name).add_parser(sub)
    return parser


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """Print rtpcore's own warnings (e.g. an ignored environment variable) as one line."""
    from rtpcore.plugins.allowlist import IgnoredEnvironmentWarning

    if issubclass(category, IgnoredEnvironmentWarning):
        print(f"rtpcore: warning: {message}", file=sys.stderr)
    else:
        _default_show_warning(message, category, filename, lineno, file, line)


_default_show_warning: Any = warnings.showwarning

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@contextlib.contextmanager
def logging_to_stderr(level: str) -> Iterator[None]:
    """While the block runs: a handler on the root logger writing to stderr, and the
    ``rtpcore`` loggers at ``level`` (a :data:`rtpcore.cli._args.LOG_LEVELS` name). Other
    libraries' loggers keep their levels (``rtpcore serve`` hands uvicorn the same level);
    afterwards the handler is gone and the level restored, so that calling :func:`main` in a
    process (a test) leaves its logging as it found it."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root, ours = logging.getLogger(), logging.getLogger("rtpcore")
    saved = ours.level
    root.addHandler(handler)
    ours.setLevel(level.upper())
    try:
        yield
    finally:
        ours.setLevel(saved)
        root.removeHandler(handler)


def main(argv: Sequence[str] | None = None) -> int:
    from rtpcore.plugins.allowlist import IgnoredEnvironmentWarning

    with warnings.catch_warnings():
        warnings.simplefilter("always", IgnoredEnvironmentWarning)  # allowlist already dedups
        warnings.showwarning = _show_warning
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    from rtpcore.plugins.spelling import command_line

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with logging_to_stderr(args.log_level), command_line():  # errors name the flags
            return int(args.func(args) or 0)
    except AllowlistError as exc:
        parser.exit(2, f"rtpcore: error: {exc}\n")
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if args.debug:
            raise
        if isinstance(exc, EngineBuildError):  # wraps a plugin's own exception: where is in the traceback
            message = f"{exc} (run with --debug for the traceback)"
        elif isinstance(exc, RtpcoreError | OSError | ValueError):
            message = str(exc)
        else:  # not ours to explain: say what it is and how to see where it came from
            message = f"{type(exc).__name__}: {exc} (run with --debug for the traceback)"
        print(f"rtpcore: error: {message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

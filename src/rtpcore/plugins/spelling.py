"""How an error tells its reader to allow a plugin: the Python API's arguments or the flags.

Errors raised through the Python API (``Engine.from_pretrained(path, plugins=[...])``,
``Allowlist.from_cli(plugins=[...])``) name its arguments, ``plugins=['atom-plugin']``; the
``rtpcore`` command runs each subcommand under :func:`command_line`, so the same errors raised
there name its flags, ``--plugins atom-plugin``. The choice is a context variable: it holds
for the thread (and the asyncio tasks) that runs the command, and is the Python API's
everywhere else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

__all__ = ["allow_plugin", "command_line", "option_given"]

_CLI: ContextVar[bool] = ContextVar("rtpcore_allowlist_spelling_cli", default=False)


@contextlib.contextmanager
def command_line() -> Iterator[None]:
    """While the block runs, errors spell the allowlist as the command line's flags."""
    token = _CLI.set(True)
    try:
        yield
    finally:
        _CLI.reset(token)


def allow_plugin(item: str) -> str:
    """How to allow the ``--plugins`` item ``item``: ``pass plugins=['item']`` through Python,
    ``pass --plugins item`` on the command line."""
    return f"pass --plugins {item}" if _CLI.get() else f"pass plugins=[{item!r}]"


def option_given(name: str, value: str) -> str:
    """How the engine option ``name`` was given ``value``: ``--cpu-isa amx`` on the command line,
    ``cpu_isa='amx'`` through Python."""
    return f"--{name.replace('_', '-')} {value}" if _CLI.get() else f"{name}={value!r}"

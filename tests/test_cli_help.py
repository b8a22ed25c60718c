"""Every option of every ``rtpcore`` command says what it does and, when it has one, its default.

The options come from argparse's own parser objects (:func:`rtpcore.cli.build_parser`, every
subparser walked), so an option added without a help text fails here; each command's ``--help``
runs in a real subprocess and must show every one of those help texts.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from rtpcore.cli import build_parser

# Defaults that mean "nothing given": the help need not name them (an empty list is the
# default of the repeatable allowlist flags).
_NO_DEFAULT: tuple[object, ...] = (None, False, [], (), argparse.SUPPRESS)


def _commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """``(argv prefix, parser)`` of ``parser`` and of every subcommand below it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def _expanded_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help text as ``--help`` prints it (``%(default)s`` and the like filled in)."""
    return parser._get_formatter()._expand_help(action)


def _name(action: argparse.Action) -> str:
    return "/".join(action.option_strings) or str(action.metavar or action.dest)


def _default_shown(help_text: str, default: object) -> bool:
    """``help_text`` says "default" and, unless the default is a flag's, the value itself."""
    if "default" not in help_text.lower():
        return False
    if isinstance(default, bool):  # a store_false flag: "(default: reuse them)" reads better than True
        return True
    renderings = {str(default)}
    if isinstance(default, float):
        renderings.add(f"{default:g}")
    return any(r in help_text for r in renderings)


def help_problems(parser: argparse.ArgumentParser) -> list[str]:
    """What is missing from the help of ``parser``'s own arguments (not its subcommands'):
    one line per argument without a help text, or whose default the help does not name."""
    problems = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):  # each subcommand's one-line summary
            helped = {c.dest for c in action._get_subactions() if (c.help or "").strip()}
            names: dict[int, list[str]] = {}  # a parser's name and its aliases
            for name, sub in action.choices.items():
                names.setdefault(id(sub), []).append(name)
            problems += [f"subcommand {n[0]!r} has no help" for n in names.values() if helped.isdisjoint(n)]
            continue
        if action.help is argparse.SUPPRESS or not (action.help or "").strip():
            problems.append(f"{_name(action)} has no help")
            continue
        default = action.default
        if not any(default is d or (type(default) is type(d) and default == d) for d in _NO_DEFAULT):
            text = _expanded_help(parser, action)
            if not _default_shown(text, default):
                problems.append(f"{_name(action)}: the help {text!r} does not name the default {default!r}")
    return problems


COMMANDS = dict(_commands(build_parser()))


def test_the_walk_finds_every_command() -> None:
    """The parser walk reaches the top level and every subcommand, nested ones included."""
    assert {" ".join(p) for p in COMMANDS} >= {
        "", "generate", "serve", "kv-spec", "plugins", "plugins list", "plugins check",
    }


@pytest.mark.parametrize("path", list(COMMANDS), ids=lambda p: " ".join(p) or "rtpcore")
def test_every_option_has_a_help_text_that_names_its_default(path: tuple[str, ...]) -> None:
    """Every argument except -h has a non-empty help text, and every one whose default is a
    value (not None, False or empty) names that default in it."""
    assert help_problems(COMMANDS[path]) == []


@pytest.mark.parametrize("path", list(COMMANDS), ids=lambda p: " ".join(p) or "rtpcore")
def test_help_in_a_subprocess_shows_every_option_and_its_help(path: tuple[str, ...]) -> None:
    """`python -m rtpcore CMD --help` exits 0 and shows each option string and each help text
    of that command's parser."""
    env = {**os.environ, "COLUMNS": "10000", "NO_COLOR": "1", "PYTHON_COLORS": "0"}  # one line per option
    done = subprocess.run(
        [sys.executable, "-m", "rtpcore", *path, "--help"],
        capture_output=True, text=True, env=env, check=False,
    )
    assert done.returncode == 0, done.stderr
    shown = " ".join(done.stdout.split())
    parser = COMMANDS[path]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._get_subactions():
                assert f"{choice.dest} {choice.help}" in shown
            continue
        for option in action.option_strings:
            assert option in shown
        if action.help and action.help is not argparse.SUPPRESS:
            assert " ".join(_expanded_help(parser, action).split()) in shown, _name(action)


def test_the_check_reports_an_option_without_help_or_default() -> None:
    """An option added without a help text, or with one that hides its default, is reported
    by name; None, False and empty defaults need no mention."""
    parser = argparse.ArgumentParser(prog="x")
    parser.add_argument("--bare", type=int, default=3)
    parser.add_argument("--quiet-default", type=int, default=7, help="how many")
    parser.add_argument("--fraction", type=float, default=0.5, help="a share (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=30.0, help="a wait (default: 30)")
    parser.add_argument("--flag", action="store_true", help="turn it on")
    parser.add_argument("--off", dest="on", action="store_false", help="turn it off (default: on)")
    parser.add_argument("--items", action="extend", default=[], help="more of them")
    parser.add_argument("--maybe", default=None, help="an optional name")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("silent")
    sub.add_parser("spoken", help="says what it does")
    assert help_problems(parser) == [
        "--bare has no help",
        "--quiet-default: the help 'how many' does not name the default 7",
        "subcommand 'silent' has no help",
    ]

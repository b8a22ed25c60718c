"""The allowlist parser: items, validation rules, argparse types and ignored environment variables."""

from __future__ import annotations

import argparse
import keyword
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rtpcore.errors import AllowlistError
from rtpcore.plugins.allowlist import (
    Allowlist,
    PluginRequest,
    add_allowlist_arguments,
    parse_external_model_packages,
    parse_plugins,
)


def test_an_item_has_a_distribution_an_entry_point_and_a_specifier() -> None:
    """DIST[:ENTRY_POINT][SPECIFIER] parses into its three parts."""
    (request,) = parse_plugins(["atom-plugin:atom>=0.1"])
    assert (request.name, request.entry_point, request.specifier) == (
        "atom-plugin",
        "atom",
        ">=0.1",
    )


def test_a_piece_starting_with_an_operator_continues_the_previous_specifier() -> None:
    """'a>=0.1,<2,b' is two items: a with '>=0.1,<2', then b."""
    requests = parse_plugins(["a>=0.1,<2,b"])
    assert [r.name for r in requests] == ["a", "b"]
    assert requests[0].specifier_set.contains("1.5")
    assert not requests[0].specifier_set.contains("2.0")


def test_repeated_flags_accumulate_and_duplicates_keep_the_first() -> None:
    """Duplicates (after PEP 503 normalization) are removed keeping the first occurrence."""
    allowlist = Allowlist.from_cli(
        plugins=["b,Atom_Plugin", "atom-plugin,c", "b"], external_model_packages=["m.x,n", "m.x"]
    )
    assert [str(r) for r in allowlist.plugins] == ["b", "Atom_Plugin", "c"]
    assert allowlist.external_model_packages == ("m.x", "n")


def test_a_single_string_is_one_flag_value() -> None:
    """Passing a str instead of a list does not split it into characters."""
    assert [r.name for r in Allowlist.from_cli(plugins="ab,cd").plugins] == ["ab", "cd"]


def test_nothing_named_is_an_empty_allowlist() -> None:
    """No flags: no third-party code is requested."""
    allowlist = Allowlist.from_cli()
    assert not allowlist
    assert allowlist.plugins == () and allowlist.external_model_packages == ()


@pytest.mark.parametrize(
    ("value", "item", "rule"),
    [
        ("", "", "empty item"),
        ("a,,b", "", "empty item"),
        ("a,", "", "empty item"),
        ("atom plugin", "atom plugin", "whitespace"),
        (".atom", ".atom", "leading or trailing dot"),
        ("atom.", "atom.", "leading or trailing dot"),
        ("at..om", "at..om", "double dot"),
        ("atom:.x", "atom:.x", "leading or trailing dot"),
        ("atom:a..b", "atom:a..b", "double dot"),
        ("atom>=>1", "atom>=>1", "bad version specifier"),
        ("atom==1.0,<<2", "atom==1.0,<<2", "bad version specifier"),
        (">=1", ">=1", "needs a distribution name"),
        ("atom,<2", "atom,<2", "has none"),
        ("a:b:c", "a:b:c", "at most one ':'"),
        ("atom:", "atom:", "empty entry-point name"),
        ("at$om", "at$om", "PEP 508"),
        ("-atom", "-atom", "PEP 508"),
    ],
)
def test_a_bad_plugins_item_names_the_item_and_the_rule(value: str, item: str, rule: str) -> None:
    """Every parse rule raises AllowlistError carrying the item and the broken rule."""
    with pytest.raises(AllowlistError) as excinfo:
        Allowlist.from_cli(plugins=[value])
    assert excinfo.value.item == item
    assert rule in str(excinfo.value.rule)
    assert repr(item) in str(excinfo.value)
    assert "--plugins" in str(excinfo.value)


@pytest.mark.parametrize(
    ("value", "item", "rule"),
    [
        ("", "", "empty item"),
        ("a,,b", "", "empty item"),
        ("my pkg", "my pkg", "whitespace"),
        (".pkg", ".pkg", "leading or trailing dot"),
        ("pkg.", "pkg.", "leading or trailing dot"),
        ("pkg..mod", "pkg..mod", "double dot"),
        ("pkg.class.x", "pkg.class.x", "keyword"),
        ("pkg.1x", "pkg.1x", "not a Python identifier"),
        ("pkg-x", "pkg-x", "not a Python identifier"),
    ],
)
def test_a_bad_module_item_names_the_item_and_the_rule(value: str, item: str, rule: str) -> None:
    """--external-model-packages items must be dotted identifiers that are not keywords."""
    with pytest.raises(AllowlistError) as excinfo:
        Allowlist.from_cli(external_model_packages=[value])
    assert excinfo.value.item == item
    assert rule in str(excinfo.value.rule)
    assert "--external-model-packages" in str(excinfo.value)


_alnum = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789",
    min_size=1,
    max_size=6,
)
_sep = st.sampled_from(["-", "_", "."])
_dist = st.builds(
    lambda first, rest: first + "".join(s + p for s, p in rest),
    _alnum,
    st.lists(st.tuples(_sep, _alnum), max_size=3),
)
_entry_point = st.one_of(
    st.none(), st.builds(lambda a, b: a + b, _alnum, st.sampled_from(["", "_x", "-y", ".z"]))
)
_version = st.builds(
    lambda parts: ".".join(map(str, parts)), st.lists(st.integers(0, 30), min_size=1, max_size=3)
)
_clause = st.builds(
    lambda op, v: op + v, st.sampled_from([">=", "<=", "<", ">", "==", "!=", "~="]), _version
)
_specifier = (
    st.lists(_clause, max_size=3)
    .map(",".join)
    .filter(
        lambda s: "~=" not in s or all(c.count(".") for c in s.split(",") if c.startswith("~="))
    )
)


@settings(deadline=None)
@given(_dist, _entry_point, _specifier)
def test_valid_items_round_trip(name: str, entry_point: str | None, spec: str) -> None:
    """str(request) parses back to an equal request, alone or inside a comma-separated value."""
    text = name + (f":{entry_point}" if entry_point else "") + spec
    request = PluginRequest.parse(text)
    assert (request.name, request.entry_point) == (name, entry_point)
    assert PluginRequest.parse(str(request)) == request
    assert parse_plugins([f"{request},x-tail"]) == (request, PluginRequest("x-tail"))


@settings(deadline=None)
@given(st.lists(_dist, min_size=1, max_size=5))
def test_dedup_keeps_first_occurrence_order(names: list[str]) -> None:
    """Parsing the same names twice yields each normalized name once, in first-seen order."""
    requests = parse_plugins([",".join(names), ",".join(reversed(names))])
    keys = [r.key for r in requests]
    assert len(keys) == len(set(keys))
    assert keys == list(dict.fromkeys(r.key for r in map(PluginRequest, names)))


@settings(deadline=None)
@given(_dist, st.integers(0, 8), st.sampled_from([" ", "\t", "..", ",,"]))
def test_an_item_with_a_forbidden_piece_is_rejected_by_name(name: str, at: int, bad: str) -> None:
    """Inserting whitespace, a double dot or an empty piece anywhere is rejected, naming the item."""
    at = min(at, len(name))
    value = name[:at] + bad + name[at:]
    with pytest.raises(AllowlistError) as excinfo:
        parse_plugins([value])
    assert excinfo.value.item is not None
    assert excinfo.value.item in value
    assert repr(excinfo.value.item) in str(excinfo.value)


@settings(deadline=None)
@given(
    st.lists(st.from_regex(r"[a-z_][a-z0-9_]{0,5}", fullmatch=True), min_size=1, max_size=4),
    st.sampled_from(sorted(keyword.kwlist)),
)
def test_a_module_path_with_a_keyword_part_is_rejected(parts: list[str], kw: str) -> None:
    """A keyword anywhere in a dotted path is rejected; without it the path round-trips."""
    good = [p for p in parts if not keyword.iskeyword(p)]
    if good:
        assert parse_external_model_packages([".".join(good)]) == (".".join(good),)
    with pytest.raises(AllowlistError) as excinfo:
        parse_external_model_packages([".".join([*good, kw])])
    assert excinfo.value.rule == f"{kw!r} is a Python keyword"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prog")
    add_allowlist_arguments(parser)
    return parser


def test_argparse_flags_are_repeatable_and_feed_from_args() -> None:
    """--plugins and --external-model-packages accumulate; from_args builds the Allowlist."""
    args = _parser().parse_args(
        ["--plugins", "a>=1,<2", "--plugins", "b:c", "--external-model-packages", "m,n.o"]
    )
    allowlist = Allowlist.from_args(args)
    assert [str(r) for r in allowlist.plugins] == ["a<2,>=1", "b:c"]
    assert allowlist.external_model_packages == ("m", "n.o")


@pytest.mark.parametrize(
    "argv", [["--plugins", ""], ["--plugins", "a b"], ["--external-model-packages", "x.if"]]
)
def test_argparse_rejects_a_bad_item_with_exit_status_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad flag value exits with status 2 and a message naming the item."""
    with pytest.raises(SystemExit) as excinfo:
        _parser().parse_args(argv)
    assert excinfo.value.code == 2
    assert repr(argv[1]) in capsys.readouterr().err


def test_environment_variables_are_ignored_with_one_warning_each() -> None:
    """Each set variable is named once on stderr with the flag to use, and configures nothing."""
    code = (
        "from rtpcore import Allowlist\n"
        "a = Allowlist.from_cli(); b = Allowlist.from_cli(plugins=['x'])\n"
        "print(len(a.plugins), len(a.external_model_packages), len(b.plugins))\n"
    )
    env = dict(os.environ, RTPCORE_PLUGINS="evil", EXTERNAL_MODEL_PACKAGES="evil_mod")
    env.pop("RTPCORE_EXTERNAL_MODEL_PACKAGES", None)
    env.pop("PYTHONWARNINGS", None)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.split() == ["0", "0", "1"]
    assert out.stderr.count("RTPCORE_PLUGINS") == 1
    assert out.stderr.count("EXTERNAL_MODEL_PACKAGES;") == 1
    assert "use --plugins instead" in out.stderr
    assert "use --external-model-packages instead" in out.stderr
    assert "RTPCORE_EXTERNAL_MODEL_PACKAGES" not in out.stderr

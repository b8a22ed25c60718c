"""Where ``rtpcore serve`` takes its API key from: ``--api-key``, else ``--api-key-file PATH``
(the file's content, stripped), else ``$RTPCORE_API_KEY``; a key that cannot be used is a usage
error before anything loads. The served keys are checked against real server processes."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from rtpcore.cli import build_parser
from rtpcore.cli._serve import API_KEY_ENV, api_key


def _args(*argv: str) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    args = build_parser().parse_args(["serve", "--demo", "llama", *argv])
    return args, args._parser


def test_the_flag_comes_before_the_file_and_the_file_before_the_environment(tmp_path: Path) -> None:
    """--api-key wins over $RTPCORE_API_KEY, --api-key-file too; without either the variable
    is the key, and without all three there is none."""
    key_file = tmp_path / "key"
    key_file.write_text("from-file")
    env = {API_KEY_ENV: "from-env"}
    assert api_key(*_args("--api-key", "from-flag"), environ=env) == "from-flag"
    assert api_key(*_args("--api-key-file", str(key_file)), environ=env) == "from-file"
    assert api_key(*_args(), environ=env) == "from-env"
    assert api_key(*_args(), environ={}) is None


def test_surrounding_whitespace_is_not_part_of_the_key(tmp_path: Path) -> None:
    """A key file written by `echo` (a trailing newline) or an indented variable gives the bare key."""
    key_file = tmp_path / "key"
    key_file.write_text("  s3cret\n")
    assert api_key(*_args("--api-key-file", str(key_file)), environ={}) == "s3cret"
    assert api_key(*_args(), environ={API_KEY_ENV: "\ts3cret "}) == "s3cret"


@pytest.mark.parametrize("value", ["two words", "caf\u00e9", "line\nbreak"])
def test_a_key_no_bearer_header_can_carry_is_a_usage_error(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A key with inner whitespace, a non-ASCII or a control character exits 2 naming its source."""
    with pytest.raises(SystemExit) as excinfo:
        api_key(*_args(), environ={API_KEY_ENV: value})
    assert excinfo.value.code == 2
    assert f"the environment variable {API_KEY_ENV}: the API key must be printable ASCII" in capsys.readouterr().err


def _serve(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rtpcore", "serve", "--demo", "llama", *argv],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )


def _missing(tmp_path: Path) -> tuple[str, str]:
    return str(tmp_path / "absent"), "cannot read the API key: No such file or directory"


def _blank(tmp_path: Path) -> tuple[str, str]:
    (tmp_path / "blank").write_text(" \n\n")
    return str(tmp_path / "blank"), "the API key is empty"


def _folder(tmp_path: Path) -> tuple[str, str]:
    return str(tmp_path), "cannot read the API key: Is a directory"


@pytest.mark.parametrize("case", [_missing, _blank, _folder], ids=["missing", "blank", "folder"])
def test_an_unusable_key_file_exits_2_naming_the_flag_and_the_path(
    tmp_path: Path, case: Callable[[Path], tuple[str, str]]
) -> None:
    """A missing, blank or unreadable --api-key-file stops `rtpcore serve` with status 2 and one
    error line naming the flag, the path and what is wrong, before any model is built."""
    path, reason = case(tmp_path)
    proc = _serve("--api-key-file", path)
    assert proc.returncode == 2, proc.stderr
    error = proc.stderr.splitlines()[-1]
    assert error == f"rtpcore serve: error: --api-key-file {path!r}: {reason}"


def test_both_key_flags_exit_2_naming_them(tmp_path: Path) -> None:
    """--api-key and --api-key-file together are a usage error naming both flags."""
    (tmp_path / "key").write_text("k")
    proc = _serve("--api-key", "k", "--api-key-file", str(tmp_path / "key"))
    assert proc.returncode == 2
    assert "argument --api-key-file: not allowed with argument --api-key" in proc.stderr


def test_an_empty_environment_key_exits_2_instead_of_serving_without_one() -> None:
    """RTPCORE_API_KEY set to nothing (a failed secret lookup) is refused: the server does not
    start open to anyone."""
    proc = _serve(env=dict(os.environ, **{API_KEY_ENV: ""}))
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1].endswith(f"the environment variable {API_KEY_ENV}: the API key is empty")


# -- real servers ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from test_llama import make_checkpoint
    from test_serve import write_tokenizer

    path = tmp_path_factory.mktemp("served-key")
    make_checkpoint(path, vocab_size=write_tokenizer(path), max_position_embeddings=256)
    return path


def _statuses(url: str, *keys: str | None) -> list[int]:
    """/v1/models' status for each bearer key (None: no Authorization header)."""
    import httpx

    return [
        httpx.get(url + "/v1/models", timeout=30,
                  headers={} if key is None else {"Authorization": f"Bearer {key}"}).status_code
        for key in keys
    ]


@pytest.mark.slow
def test_a_key_from_the_environment_guards_the_api(checkpoint: Path) -> None:
    """With RTPCORE_API_KEY set, /v1/models is 401 without a bearer key or with another one,
    200 with it; /health needs none."""
    from test_serve import Server

    srv = Server(checkpoint, env=dict(os.environ, **{API_KEY_ENV: "env-key"}))
    try:
        assert _statuses(srv.url, None, "wrong", "env-key") == [401, 401, 200]
    finally:
        code, out = srv.stop()
    assert code == 0, out


@pytest.mark.slow
def test_a_key_from_a_file_guards_the_api_and_wins_over_the_environment(
    checkpoint: Path, tmp_path: Path
) -> None:
    """With --api-key-file (a trailing newline in the file), /v1/models is 401 without a bearer
    key, with a wrong one and with RTPCORE_API_KEY's, 200 with the file's key."""
    from test_serve import Server

    (tmp_path / "key").write_text("file-key\n")
    srv = Server(checkpoint, "--api-key-file", str(tmp_path / "key"),
                 env=dict(os.environ, **{API_KEY_ENV: "env-key"}))
    try:
        assert _statuses(srv.url, None, "wrong", "env-key", "file-key") == [401, 401, 401, 200]
    finally:
        code, out = srv.stop()
    assert code == 0, out

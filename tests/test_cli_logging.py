"""The ``rtpcore`` command configures logging: rtpcore's records reach stderr, one format
(time, level, logger, message), at ``--log-level`` (default ``info``), which every subcommand
takes. The warning used is a real one: a distribution whose entry_points.txt cannot be parsed
is skipped by ``plugins list`` with a warning from ``rtpcore.plugins.metadata``."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rtpcore.cli import build_parser, main

LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) ([\w.]+): (.*)$")
SKIPPED = "skipping the distribution at"


@pytest.fixture
def broken_site(tmp_path: Path) -> Path:
    """A site folder holding one distribution whose entry_points.txt has a line without '='."""
    dist = tmp_path / "site" / "broken_dist-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-dist\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[rtpcore.plugins]\nthis line has no equals sign\n")
    return dist.parent


def _rtpcore(site: Path, *argv: str) -> tuple[subprocess.CompletedProcess[str], list[tuple[str, str, str]]]:
    """Run ``python -m rtpcore ARGV`` with ``site`` on the path; the process and its log records
    (level, logger, message), every stderr line being one."""
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "rtpcore", *argv],
        capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=path), timeout=120, check=False,
    )
    records = []
    for line in proc.stderr.splitlines():
        match = LINE.match(line)
        assert match is not None, f"a stderr line not in the log format: {line!r}"
        level, logger, message = match.groups()
        records.append((level, logger, message))
    return proc, records


def test_a_warning_reaches_stderr_at_the_default_level(broken_site: Path) -> None:
    """Without --log-level, the skipped distribution's warning is on stderr, in the log format,
    naming its folder; stdout still carries only the table."""
    proc, records = _rtpcore(broken_site, "plugins", "list")
    assert proc.returncode == 0, proc.stderr
    warnings = [r for r in records if r[0] == "WARNING"]
    assert [(level, logger) for level, logger, _ in warnings] == [("WARNING", "rtpcore.plugins.metadata")]
    assert warnings[0][2].startswith(SKIPPED) and "broken_dist-1.0.dist-info" in warnings[0][2]
    assert not any(level == "DEBUG" for level, _, _ in records)
    assert "rtpcore.models (built-in)" in proc.stdout and SKIPPED not in proc.stdout


def test_log_level_error_hides_the_warning(broken_site: Path) -> None:
    """With --log-level error nothing below an error is shown: stderr is empty."""
    proc, records = _rtpcore(broken_site, "plugins", "list", "--log-level", "error")
    assert proc.returncode == 0
    assert records == []


def test_log_level_debug_shows_debug_records_too(broken_site: Path) -> None:
    """With --log-level debug, rtpcore's debug records (what plugin loading did) join the warning."""
    proc, records = _rtpcore(broken_site, "plugins", "list", "--log-level", "debug")
    assert proc.returncode == 0
    assert ("DEBUG", "rtpcore.plugins.loading") in {(level, logger) for level, logger, _ in records}
    assert any(level == "WARNING" and message.startswith(SKIPPED) for level, _, message in records)


def test_plugins_check_relays_its_child_process_records(broken_site: Path) -> None:
    """plugins check loads in a child process; the child's warning reaches this stderr once."""
    proc, records = _rtpcore(broken_site, "plugins", "check", "atom-plugin")
    assert proc.returncode == 0, proc.stderr
    assert [message.startswith(SKIPPED) for level, _, message in records if level == "WARNING"] == [True]
    proc, records = _rtpcore(broken_site, "plugins", "check", "atom-plugin", "--log-level", "error")
    assert records == []


@pytest.mark.parametrize(
    "argv",
    [
        ["plugins", "list"],
        ["plugins", "check", "some-plugin"],
        ["kv-spec", "checkpoint"],
        ["generate", "--demo", "llama", "--prompt", "hi"],
        ["serve", "--demo", "llama"],
    ],
    ids=lambda argv: " ".join(argv[:2]),
)
def test_every_subcommand_takes_log_level(argv: list[str]) -> None:
    """Each command's parser has --log-level, default info, any case of the five level names."""
    parser = build_parser()
    assert parser.parse_args(argv).log_level == "info"
    assert parser.parse_args([*argv, "--log-level", "DEBUG"]).log_level == "debug"
    with pytest.raises(SystemExit) as excinfo:
        parser.parse_args([*argv, "--log-level", "verbose"])
    assert excinfo.value.code == 2


def test_main_in_a_process_leaves_its_logging_as_it_found_it(capsys: pytest.CaptureFixture[str]) -> None:
    """main() adds its handler and sets rtpcore's level only while the command runs."""
    root, ours = logging.getLogger(), logging.getLogger("rtpcore")
    handlers, level = list(root.handlers), ours.level
    assert main(["plugins", "list", "--json", "--log-level", "debug"]) == 0
    assert (root.handlers, ours.level) == (handlers, level)
    capsys.readouterr()


# -- rtpcore serve: uvicorn logs the same way ------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from test_llama import make_checkpoint
    from test_serve import write_tokenizer

    path = tmp_path_factory.mktemp("served-logging")
    make_checkpoint(path, vocab_size=write_tokenizer(path), max_position_embeddings=256)
    return path


def _served_output(checkpoint: Path, *argv: str) -> str:
    """The output of a server that answered /health and /v1/models, then stopped with SIGTERM."""
    import httpx

    from test_serve import Server

    srv = Server(checkpoint, *argv)
    try:
        assert httpx.get(srv.url + "/v1/models", timeout=30).status_code == 200
    finally:
        code, out = srv.stop()
    assert code == 0, out
    return out


@pytest.mark.slow
def test_serve_logs_uvicorn_and_rtpcore_records_in_one_format(checkpoint: Path) -> None:
    """At the default level the server's output has rtpcore's serving line, rtpcore's own info
    records, and uvicorn's startup and access records, all in the one log format."""
    out = _served_output(checkpoint)
    lines = out.splitlines()
    assert any(line.startswith("rtpcore: serving 'tiny' (llama on ") for line in lines)
    records = [m.groups() for m in map(LINE.match, lines) if m is not None]
    loggers = {logger for _, logger, _ in records}
    assert "rtpcore.engine.engine" in loggers and "uvicorn.error" in loggers
    access = [message for level, logger, message in records if logger == "uvicorn.access"]
    assert any('"GET /v1/models HTTP/1.1" 200' in message for message in access), out


@pytest.mark.slow
def test_serve_log_level_warning_applies_to_uvicorn_too(checkpoint: Path) -> None:
    """With --log-level warning neither rtpcore's nor uvicorn's info records (access log
    included) are shown; the serving line still is."""
    out = _served_output(checkpoint, "--log-level", "warning")
    assert "rtpcore: serving 'tiny'" in out
    levels = {m.group(1) for m in map(LINE.match, out.splitlines()) if m is not None}
    assert levels <= {"WARNING", "ERROR", "CRITICAL"}, out
    assert "GET /v1/models" not in out

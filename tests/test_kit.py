"""The conformance kit's command line and pytest plugin (docs/design.md §19): what they accept,
refuse and print, on rtpcore's built-in plugin. The checks themselves are tested in
test_kit_engine.py, test_kit_seams.py and, with broken plugins, test_kit_broken.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rtpcore.testing import CHECKS, RULES, CheckFailed, CheckSkipped, run_check

pytest_plugins = ["pytester"]


def rtpcore(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rtpcore", *args], capture_output=True, text=True, check=False)


def test_an_unknown_check_is_a_usage_error_listing_the_checks() -> None:
    proc = rtpcore("plugins", "test", "rtpcore.models", "--check", "batch_invariant")
    assert proc.returncode == 2
    assert "unknown check 'batch_invariant'" in proc.stderr
    assert all(name in proc.stderr for name in CHECKS)


@pytest.mark.parametrize(("item", "status", "words"), [
    ("bad item", 2, "contains whitespace"),
    ("a,b", 2, "one plugin at a time"),
    ("no-such-plugin-dist", 1, "'no-such-plugin-dist' is not installed"),
])
def test_a_bad_item_is_refused_naming_it(item: str, status: int, words: str) -> None:
    proc = rtpcore("plugins", "test", item)
    assert proc.returncode == status
    assert words in proc.stderr
    assert proc.stdout == ""


def test_cuda_without_a_gpu_is_an_error_before_any_check() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = rtpcore("plugins", "test", "rtpcore.models", "--device", "cuda")
    assert proc.returncode == 1
    assert "device 'cuda' is not available" in proc.stderr
    assert "collected" not in proc.stdout


def test_json_has_one_object_per_check_and_subject() -> None:
    proc = rtpcore("plugins", "test", "rtpcore.models", "--json", "--check", "registration", "weight_patterns",
                   "--check", "reasoning_parser")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [(r["check"], r["subject"]) for r in rows] == [
        ("registration", None), ("weight_patterns", "llama"),
        ("reasoning_parser", "deepseek_r1"), ("reasoning_parser", "qwen3")]
    for row in rows:
        assert set(row) == {"check", "subject", "status", "seconds", "detail"}
        assert row["status"] == "ok"
        assert isinstance(row["seconds"], float)


def test_the_report_reads_like_pytest() -> None:
    proc = rtpcore("plugins", "test", "rtpcore.models", "--check", "registration", "kv_layout", "graph_replay")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "rtpcore plugin conformance" in lines[0]
    assert any(line.startswith("collected 3 checks") for line in lines)
    assert any(line.startswith("kv_layout[llama] ....") and " ok " in line for line in lines)
    assert any(line.startswith("graph_replay[llama] ....") and " skip " in line and "CUDA" in line for line in lines)
    assert "2 passed, 1 skipped" in lines[-1]


def test_run_check_raises_what_it_found() -> None:
    assert run_check("rtpcore.models", "forward_contract", "llama").status == "ok"
    with pytest.raises(CheckSkipped, match="CUDA"):
        run_check("rtpcore.models", "graph_replay", "llama")
    assert issubclass(CheckFailed, AssertionError)
    assert set(RULES) == set(CHECKS)


def test_importing_the_kit_and_the_pytest_plugin_imports_no_torch() -> None:
    code = "import sys, rtpcore.testing, rtpcore.testing.pytest_plugin; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "False"


def test_pytest_runs_the_kit_alone_without_test_paths(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_other="def test_unrelated():\n    assert False\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--rtpcore-plugin", "rtpcore.models",
                                           "-k", "registration or forward_contract", "-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*rtpcore.models::registration PASSED*",
                                 "*rtpcore.models::forward_contract?llama? PASSED*"])


def test_pytest_adds_the_kit_to_the_tests_of_given_paths(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_own=textwrap.dedent("""
        def test_own():
            pass

        def test_fixture(rtpcore_kit):
            rtpcore_kit("weight_patterns", "llama", item="rtpcore.models")

        def test_fixture_skips(rtpcore_kit):
            rtpcore_kit("graph_replay", "llama", item="rtpcore.models")
    """))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--rtpcore-plugin", "rtpcore.models",
                                           "-k", "own or fixture or registration", str(Path("test_own.py")))
    result.assert_outcomes(passed=3, skipped=1)

"""atom-plugin passes rtpcore's conformance kit (docs/design.md §19): every check that applies on
this machine is ok; the only skips are checks that need what it lacks (a GPU), or that do not
apply to a model (a draft where the model has no multi-token-prediction layers)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rtpcore.testing import RULES, run_check, run_kit

# Why a check may skip here, by check: GPU-only checks on a CPU, a draft where there is none.
ALLOWED_SKIPS = {"graph_replay": "CUDA", "draft": "no draft"}


@pytest.fixture(scope="module")
def results() -> list:
    return run_kit("atom-plugin")


def test_every_check_that_applies_passes(results: list) -> None:
    failed = [r for r in results if r.status == "FAIL"]
    assert not failed, "\n\n".join(f"{r.id}\n{r.detail}" for r in failed)
    unexpected = [r for r in results if r.status == "skip" and r.check not in ALLOWED_SKIPS]
    assert not unexpected, "\n".join(f"{r.id}: {r.detail}" for r in unexpected)


def test_the_kit_covers_every_model_and_seam(results: list) -> None:
    ids = {r.id for r in results}
    for model in ("deepseek_v2", "deepseek_v3"):
        for check in ("config_errors", "weight_patterns", "forward_contract", "kv_layout", "batch_invariance",
                      "chunked_prefill_invariance", "prefix_cache_invariance", "preemption_invariance",
                      "tensor_parallel", "draft", "hf_parity", "graph_replay"):
            assert f"{check}[{model}]" in ids
    assert {"kv_layout[ue8m0]", "attention_backend[atom_mla]", "quantization_method[atom_fp8]",
            "reasoning_parser[atom_deepseek_r1]", "registration", "import_cost", "no_patches"} <= ids
    ok = {r.id for r in results if r.status == "ok"}
    assert {"draft[deepseek_v3]", "hf_parity[deepseek_v3]", "tensor_parallel[deepseek_v3]"} <= ok


def test_the_command_line_reports_the_same_checks(results: list) -> None:
    proc = subprocess.run([sys.executable, "-m", "rtpcore", "plugins", "test", "atom-plugin", "--json",
                           "--check", "registration", "kv_layout"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [(r["check"], r["subject"], r["status"]) for r in rows] == [
        (r.check, r.subject, r.status) for r in results if r.check in ("registration", "kv_layout")]
    assert all(set(r) == {"check", "subject", "status", "seconds", "detail"} for r in rows)


def test_a_check_runs_on_the_plugins_own_checkpoint_and_prompts(v3_ckpt) -> None:
    """run_check on a checkpoint transformers wrote (not the demo one), with our own prompts."""
    result = run_check("atom-plugin", "batch_invariance", "deepseek_v3", checkpoints={"deepseek_v3": v3_ckpt},
                       prompts=[[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3] * 12])
    assert result.status == "ok"
    assert RULES["batch_invariance"]

"""The CPU kernel choice (rtpcore.models.cpu_isa, rtpcore_native/_cpu_features.hpp): features,
the AMX probe and its fallback, the --cpu-isa cap in the process and its workers, ``rtpcore
info`` and ``EngineStats.kernel_calls`` against the table ``info`` prints.

Claims about processes run real processes: the CLI, a tensor-parallel engine's spawned rank,
a probe that really executes an illegal instruction in its child (``RTPCORE_AMX_PROBE_FAIL``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

kernels = pytest.importorskip("rtpcore_native._kernels")

from rtpcore import Engine  # noqa: E402
from rtpcore.errors import RtpcoreError  # noqa: E402
from rtpcore.models.cpu_isa import CPU_ISA_SETS, CPU_ISAS, KERNEL_SETS  # noqa: E402
from rtpcore.models.kernel_table import kernel_table, weight_kinds  # noqa: E402
from rtpcore.models.layers import cpu_has_native_dot  # noqa: E402

FEATURES = kernels.cpu_features()
# A CPU whose flags and OS say AMX: the probe's fallback can be shown there by a failing probe.
AMX_CPU = all(FEATURES[f] for f in ("amx_tile", "amx_bf16", "amx_int8", "os_amx")) and "avx512_bf16" in (
    kernels.supported_isas())
CAP_VARS = ("RTPCORE_CPU_ISA", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS",
            "RTPCORE_AMX_PROBE_FAIL")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any cap (the test's own additions apart): the rtpcore this
    interpreter imports (installed, or an editable checkout) is the one the child imports."""
    env = {k: v for k, v in os.environ.items() if k not in CAP_VARS}
    return {**env, **extra}


def rtpcore(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rtpcore", *args], capture_output=True, text=True,
                          env=clean_env(**env), check=False)


def best_set(value: str) -> str:
    """The kernel set a --cpu-isa value gives on this CPU."""
    return next(s for s in CPU_ISA_SETS[value] if s in kernels.supported_isas())


# -- the features and the tables -----------------------------------------------------------------


def test_cpuid_features_agree_with_the_kernels_flags_in_proc_cpuinfo() -> None:
    """cpu_features() reads CPUID and XCR0 itself; Linux lists the same flags (it hides those
    whose register state it does not save, so a flag it lists is one we find)."""
    assert set(FEATURES) == {"avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                             "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
                             "amx_int8", "os_avx", "os_avx512", "os_amx", "amx_permitted"}
    assert all(isinstance(v, bool) for v in FEATURES.values())
    try:
        flags = next(line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags"))
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo flags here")
    for name in ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
                 "avx_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"):
        if name in flags:
            assert FEATURES[name], f"/proc/cpuinfo lists {name}; CPUID did not"


def test_the_python_tables_are_the_extensions() -> None:
    assert tuple(kernels.kernel_sets()) == KERNEL_SETS
    assert [(v, sets[-1], sets[0]) for v, sets in CPU_ISA_SETS.items()] == kernels.cpu_isas()
    assert tuple(CPU_ISA_SETS) == CPU_ISAS


def test_amx_is_a_kernel_set_exactly_when_the_probe_passed() -> None:
    ok, reason = kernels.amx_probe()
    assert isinstance(ok, bool) and reason
    assert ("amx" in kernels.supported_isas()) == (ok and "avx512_bf16" in kernels.supported_isas())
    if ok:  # a good probe asks for the tile permission for this process
        assert kernels.cpu_features()["amx_permitted"]
    if not (FEATURES["amx_tile"] and FEATURES["amx_bf16"] and FEATURES["amx_int8"]):
        assert not ok and reason.startswith(("no CPU flag", "not x86-64"))


# -- the probe's fallback, on a real failing probe ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(not AMX_CPU, reason="needs a CPU and an OS with AMX: the hook makes its probe fail")
@pytest.mark.parametrize(("hook", "reason"), [("sigill", "probe killed by SIGILL"), ("wrong", "wrong result")])
def test_a_failed_amx_probe_is_a_fallback_with_one_log_line(ckpt: Path, hook: str, reason: str) -> None:
    """The child really executes ud2 (or corrupts a product): the engine runs on avx512_bf16,
    says why once, and the process holds no tile permission."""
    out = rtpcore("generate", str(ckpt), "--prompt-ids", "5,9,33", "--max-new-tokens", "4", "--json",
                  RTPCORE_AMX_PROBE_FAIL=hook)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if "AMX kernels not used" in line]
    assert len(lines) == 1 and f"({reason}" in lines[0] and "running the avx512_bf16 kernels" in lines[0], out.stderr
    assert "WARNING" in lines[0]
    assert "decode steps run in rtpcore_native (avx512_bf16 kernels)" in out.stderr
    assert len(json.loads(out.stdout)["output_ids"]) == 4
    info = json.loads(rtpcore("info", "--json", RTPCORE_AMX_PROBE_FAIL=hook).stdout)
    assert info["amx_probe"]["ok"] is False and info["amx_probe"]["reason"].startswith(reason)
    assert info["kernel_set"] == "avx512_bf16" and "amx" not in info["supported_cpu_isas"]
    assert info["features"]["amx_permitted"] is False


# -- --cpu-isa: errors, the cap in the process and in its workers -------------------------------------


def test_an_unknown_cpu_isa_is_an_error_naming_the_values(ckpt: Path) -> None:
    with pytest.raises(RtpcoreError, match="cpu_isa='sse9': not one of avx2, avx512, avx512_bf16, amx"):
        Engine.from_pretrained(ckpt, cpu_isa="sse9")


@pytest.mark.slow
def test_cpu_isa_errors_through_the_cli_and_the_environment(ckpt: Path) -> None:
    """Unknown on the command line: a usage error; unknown in RTPCORE_CPU_ISA, or a value this CPU
    cannot run: an error naming it and what the CPU runs (never a silent fallback)."""
    out = rtpcore("generate", str(ckpt), "--prompt-ids", "5", "--cpu-isa", "sse9")
    assert out.returncode == 2 and "--cpu-isa: invalid choice: 'sse9'" in out.stderr
    out = rtpcore("generate", str(ckpt), "--prompt-ids", "5", RTPCORE_CPU_ISA="sse9")
    assert out.returncode == 1
    assert "rtpcore: error: RTPCORE_CPU_ISA=sse9: not one of avx2, avx512, avx512_bf16, amx" in out.stderr
    hook = {"RTPCORE_AMX_PROBE_FAIL": "sigill"} if AMX_CPU else {}
    runs = kernels.supported_cpu_isas() if not AMX_CPU else [v for v in CPU_ISAS if v != "amx"]
    cannot = next((v for v in reversed(CPU_ISAS) if v not in runs), None)
    if cannot is None:
        pytest.skip("this CPU runs every --cpu-isa value and cannot be made to fail the AMX probe")
    out = rtpcore("generate", str(ckpt), "--prompt-ids", "5", "--cpu-isa", cannot, **hook)
    assert out.returncode == 1, out.stderr
    assert f"rtpcore: error: --cpu-isa {cannot}: this CPU cannot run the '{cannot}' kernels" in out.stderr
    assert f"; it runs: {', '.join(runs)}" in out.stderr
    if cannot == "amx":
        assert "(AMX: " in out.stderr


@pytest.mark.slow
def test_the_cap_reaches_a_tensor_parallel_worker(ckpt: Path) -> None:
    """cpu_isa='avx2' in the engine's process: its spawned rank runs the AVX2 kernels with
    RTPCORE_CPU_ISA and oneDNN's cap in its environment, as the engine's own process does."""
    if "avx2" not in kernels.supported_cpu_isas():
        pytest.skip("this CPU cannot run the avx2 kernels")
    code = (
        "import json, sys\n"
        "from rtpcore import Engine\n"
        "with Engine.from_pretrained(sys.argv[1], tensor_parallel_size=2, cpu_isa='avx2') as e:\n"
        "    e.generate([[5, 9, 33]], max_new_tokens=3, stop_token_ids=[])\n"
        "    ranks = e._group.run('stats', None, gather=True)\n"
        "    print(json.dumps({'ranks': ranks, 'calls': e.stats().kernel_calls}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(ckpt)], capture_output=True, text=True, env=clean_env(),
                         check=False, timeout=600)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["rank"] for r in got["ranks"]] == [0, 1]
    for r in got["ranks"]:
        assert (r["cpu_kernels"], r["cpu_isa"], r["onednn_max_cpu_isa"]) == (best_set("avx2"), "avx2", "AVX2_VNNI")
    assert set(got["calls"]) == {"torch_step[torch (float32 GEMM)]"}  # a shard decodes with its torch modules


def test_the_cap_hides_bf16_and_fp16_dot_products(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Linear's bf16 / fp16 routes see the CPU as the cap's class does (cpuinfo: a CPU with both)."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 avx512_fp16 amx_fp16\n")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    expect = {None: (True, True), "amx": (True, True), "avx512_bf16": (True, False), "avx512": (False, False),
              "avx2": (False, False)}
    for value, (bf16, fp16) in expect.items():
        if value is None:
            monkeypatch.delenv("RTPCORE_CPU_ISA", raising=False)
        else:
            monkeypatch.setenv("RTPCORE_CPU_ISA", value)
        assert cpu_has_native_dot(torch.bfloat16, cpuinfo) is bf16, value
        assert cpu_has_native_dot(torch.float16, cpuinfo) is fp16, value


# -- rtpcore info ----------------------------------------------------------------------------------


def check_info_schema(info: dict[str, Any]) -> None:
    assert set(info) == {"cpu", "native_kernels", "features", "amx_probe", "caps", "kernel_set",
                         "supported_kernel_sets", "supported_cpu_isas", "thread_pool", "kernels"}
    assert info["thread_pool"] in ("openmp", "threads")
    assert info["features"] == {**FEATURES, "amx_permitted": info["features"]["amx_permitted"]}
    assert set(info["amx_probe"]) == {"ok", "reason"}
    assert set(info["caps"]) == {"RTPCORE_CPU_ISA", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY",
                                 "MKL_ENABLE_INSTRUCTIONS"}
    assert info["kernel_set"] in info["supported_kernel_sets"]
    assert [(r["weights"], r["step"]) for r in info["kernels"]] == [
        (w, s) for w in weight_kinds() for s in ("decode", "prefill", "mixed")]
    for row in info["kernels"]:
        assert row["kernels"] and all(set(k) == {"rows", "kernel"} for k in row["kernels"])
        assert all(k["kernel"].startswith(("native_decode[", "torch_step[")) for k in row["kernels"])


@pytest.mark.slow
def test_info_through_the_cli() -> None:
    """--json's schema; the text lists the same; --cpu-isa shows the capped choice, and a cap the
    user set on oneDNN is kept (the lower of the two caps wins for rtpcore's kernels)."""
    out = rtpcore("info", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    check_info_schema(info)
    assert info["kernel_set"] == info["supported_kernel_sets"][0]  # no cap: the best
    assert info["caps"] == dict.fromkeys(info["caps"])
    assert info["supported_cpu_isas"] == kernels.supported_cpu_isas()
    text = rtpcore("info").stdout
    assert f"kernel set: {info['kernel_set']} " in text
    assert info["thread_pool"] == kernels.pool_kind() and f"thread pool: {info['thread_pool']} " in text
    assert f"  float32   decode   {info['kernels'][0]['kernels'][0]['kernel']}" in text
    if "avx2" not in kernels.supported_cpu_isas():
        return
    capped = json.loads(rtpcore("info", "--json", "--cpu-isa", "avx2").stdout)
    check_info_schema(capped)
    assert capped["kernel_set"] == best_set("avx2")
    assert capped["caps"] == {"RTPCORE_CPU_ISA": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI",
                              "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert capped["kernels"][0]["kernels"] == [{"rows": "1+", "kernel": f"native_decode[{best_set('avx2')}]"}]
    if "avx512" in kernels.supported_cpu_isas():
        mine = json.loads(rtpcore("info", "--json", "--cpu-isa", "avx512", ONEDNN_MAX_CPU_ISA="AVX2").stdout)
        assert mine["caps"]["ONEDNN_MAX_CPU_ISA"] == "AVX2" and mine["kernel_set"] == "avx2"


# -- EngineStats.kernel_calls against the table ------------------------------------------------------


def table_key(kind: str, step: str, rows: int) -> str:
    """The key the table of ``rtpcore info`` gives a step of ``rows`` tokens of weights ``kind``."""
    (row,) = [r for r in kernel_table() if (r["weights"], r["step"]) == (kind, step)]
    for k in row["kernels"]:
        first, _, last = k["rows"].rstrip("+").partition("-")
        if int(first) <= rows and (k["rows"].endswith("+") or rows <= int(last or first)):
            return str(k["kernel"])
    raise AssertionError(f"no row of the table covers {rows} rows: {row}")


def run_engine(path: Path, prompts: list[list[int]], new: int, **options: Any) -> tuple[dict[str, int], Any]:
    with Engine.from_pretrained(path, **options) as engine:
        engine.generate(prompts, max_new_tokens=new, stop_token_ids=[])
        stats = engine.stats()
        model = engine.model
        return stats.kernel_calls, (stats.steps_total, model.decode_kernel, model.layers[0].qkv.kernel)


@pytest.mark.parametrize(("weights", "options"), [("float32", {}), ("bfloat16", {"dtype": "bfloat16"}),
                                                  ("int8", {"quantization": "int8"})])
def test_kernel_calls_count_every_step_under_the_tables_keys(ckpt: Path, weights: str, options: dict[str, Any]) -> None:
    """One prefill, then a decode step per further token: each counted once, under the key the
    table of ``rtpcore info`` gives for that dtype and step, which agrees with what the model says
    ran (its decode_kernel, its layers' kernel)."""
    calls, (steps, decode_kernel, linear) = run_engine(ckpt, [[5, 9, 33, 7, 81]], 6, **options)
    decode, prefill = table_key(weights, "decode", 1), table_key(weights, "prefill", 5)
    assert steps == 6
    assert calls == ({decode: 6} if decode == prefill else {decode: 5, prefill: 1})
    assert decode_kernel == ("native" if decode.startswith("native_decode[") else "torch")
    if decode_kernel == "native":
        assert decode == f"native_decode[{kernels.isa()}]"
    expected = {"packed": "torch (oneDNN)", "int8": f"native:{kernels.isa()}"}.get(linear)
    if expected is not None:
        assert prefill == f"torch_step[{expected}]"


def test_the_metrics_expose_steps_by_kernel(ckpt: Path) -> None:
    """/metrics' rtpcore_kernel_steps{kernel} is EngineStats.kernel_calls, read at scrape time."""
    from rtpcore.serving.metrics import ServerMetrics

    with Engine.from_pretrained(ckpt) as engine:
        engine.generate([[5, 9, 33]], max_new_tokens=3, stop_token_ids=[])
        text = ServerMetrics(lambda: engine.stats().as_dict()).render().decode()
        calls = engine.stats().kernel_calls
    assert calls and sum(calls.values()) == 3
    for key, n in calls.items():
        assert f'rtpcore_kernel_steps_total{{kernel="{key}"}} {float(n)}' in text


@pytest.mark.slow
def test_kernel_calls_of_a_gguf_model_follow_the_tables_rows(tmp_path: Path) -> None:
    """Q8_0 blocks: a short prompt's prefill in the native block kernels, one of GEMM_ROWS tokens
    or more in torch's float32 GEMM (with VNNI, or AVX2 on an EPYC, there is no such count: a 40-token prompt stays in
    the block kernels' GEMM), decode steps in the native step (the table's rows)."""
    pytest.importorskip("gguf")
    from gguf_files import write_gguf
    from rtpcore.checkpoint.gguf.linear import GEMM_ROWS as ROWS
    from rtpcore.checkpoint.gguf.linear import NEVER
    from test_llama import make_checkpoint
    from tokenizer_files import byte_bpe

    GEMM_ROWS = ROWS["q8_0"] if ROWS["q8_0"] < NEVER else 40
    make_checkpoint(tmp_path / "st", vocab_size=420)
    path = write_gguf(tmp_path / "st", tmp_path / "m.gguf", file_type="Q8_0", tokenizer=byte_bpe())
    short, long = table_key("q8_0", "prefill", 3), table_key("q8_0", "prefill", GEMM_ROWS)
    native = f"torch_step[native:{kernels.isa()}]"
    assert short == native and long == ("torch_step[torch (float32 GEMM)]" if ROWS["q8_0"] < NEVER else native)
    for prompt, want in (([5, 9, 33], short), (list(range(3, 3 + GEMM_ROWS + 4)), long)):
        calls, (_, decode_kernel, _) = run_engine(path, [prompt], 3)
        assert calls == {want: 1, table_key("q8_0", "decode", 1): 2}, calls
        assert decode_kernel == "native"

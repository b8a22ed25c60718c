"""Devices (docs/design.md §9): the forms ``device`` takes, what resolves where, and the engine and
command line on the CPU. Whatever needs a GPU is in test_gpu.py; these tests hold on any machine:
``cuda:{device_count}`` is never available, and the CPU-only cases skip where torch sees a GPU."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from rtpcore import Engine, errors
from rtpcore.engine.worker.devices import check_device_form, resolve_device, resolve_platform
from rtpcore.errors import DeviceError, RtpcoreError
from rtpcore.parallel.leader import WorkerGroup

COUNT = torch.cuda.device_count() if torch.cuda.is_available() else 0
AVAILABLE = ("cpu", *(f"cuda:{i}" for i in range(COUNT)))
MISSING = f"cuda:{COUNT}"  # one past the last device torch sees: never available
cpu_only = pytest.mark.skipif(COUNT > 0, reason=f"torch sees {COUNT} CUDA/ROCm device(s)")
PROMPTS = [[5, 9, 33], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [100]]


@pytest.mark.parametrize(("device", "want"), [
    ("cpu", "cpu"),
    (torch.device("cpu"), "cpu"),
    ("auto", "cuda:0" if COUNT else "cpu"),
    pytest.param("cuda", "cuda:0", marks=pytest.mark.skipif(COUNT < 1, reason="needs a CUDA/ROCm device")),
    pytest.param("cuda:0", "cuda:0", marks=pytest.mark.skipif(COUNT < 1, reason="needs a CUDA/ROCm device")),
    pytest.param(torch.device("cuda"), "cuda:0", marks=pytest.mark.skipif(COUNT < 1, reason="needs a CUDA/ROCm device")),
])  # fmt: skip
def test_well_formed_devices_resolve_to_their_canonical_form(device: Any, want: str) -> None:
    """"auto" is the first GPU torch sees, else "cpu"; "cuda" is "cuda:0"; a torch.device is accepted."""
    assert resolve_device(device) == want


@pytest.mark.parametrize("device", [
    "cuda:x", "cuda:-1", "cuda:01", "cuda:", " cpu", "cpu:0", "auto:1", "my-dev", "", 3, None, torch.device("meta"),
])  # fmt: skip
def test_a_value_of_none_of_the_forms_is_malformed(device: Any) -> None:
    """Anything but "auto", "cpu", "cuda", "cuda:N", a platform's NAME or NAME:N (or such a
    torch.device) raises DeviceError(malformed=True) whose message names the value and lists the
    forms; availability is never asked."""
    for check in (check_device_form, resolve_device, resolve_platform):
        with pytest.raises(DeviceError) as excinfo:
            check(device)
        err = excinfo.value
        assert (err.device, err.malformed, err.available) == (device, True, ())
        assert repr(device) in str(err) and "'auto', 'cpu', 'cuda', 'cuda:N', 'NAME', 'NAME:N'" in str(err)


@pytest.mark.parametrize("device", ["gpu", "CUDA", "mps", "npu:1"])
def test_a_name_no_platform_answers_to_is_unknown_listing_the_known_ones(device: str) -> None:
    """A well-formed name (a plugin platform's form) that no loaded platform has: DeviceError
    (malformed=False) naming it and listing the known platforms (docs/design.md §18)."""
    assert check_device_form(device) == device
    for check in (resolve_device, resolve_platform):
        with pytest.raises(DeviceError) as excinfo:
            check(device)
        err = excinfo.value
        assert (err.device, err.malformed, err.available) == (device, False, ("cpu", "cuda"))
        assert f"device {device!r} is not a platform here; known: cpu, cuda" in str(err)


def test_check_device_form_leaves_well_formed_values_as_given() -> None:
    """The syntax check keeps "auto", "cuda" and "cuda:N" as they are (whether the GPU exists is resolve's business)."""
    assert [check_device_form(d) for d in ("auto", "cpu", "cuda", "cuda:12")] == ["auto", "cpu", "cuda", "cuda:12"]
    assert check_device_form(torch.device("cuda", 3)) == "cuda:3"


@pytest.mark.parametrize("device", [MISSING, *(["cuda"] if COUNT == 0 else [])])
def test_a_device_torch_cannot_see_names_it_and_what_is_available(device: str) -> None:
    """A well-formed device beyond what torch sees is DeviceError(malformed=False) listing the available devices."""
    with pytest.raises(DeviceError) as excinfo:
        resolve_device(device)
    err = excinfo.value
    assert (err.device, err.malformed, err.available) == (device, False, AVAILABLE)
    assert f"device {device!r} is not available" in str(err)
    assert f"available: {', '.join(map(repr, AVAILABLE))}" in str(err)
    if COUNT == 0:
        assert f"this torch ({torch.__version__})" in str(err) and "sees no CUDA/ROCm device" in str(err)


@pytest.mark.parametrize(("device", "tp"), [("cuda", COUNT + 1), ("auto" if COUNT else "cuda", COUNT + 1), ("cuda:1", 2)])
def test_tensor_parallel_ranks_each_need_a_gpu_of_their_own(device: str, tp: int) -> None:
    """On CUDA rank r takes cuda:r: more ranks than GPUs, or "cuda:N" with N > 0, is DeviceError(malformed=False)."""
    with pytest.raises(DeviceError) as excinfo:
        resolve_device(device, tensor_parallel_size=tp)
    assert excinfo.value.malformed is False
    assert repr(device) in str(excinfo.value)


def test_cpu_takes_any_number_of_ranks_and_auto_follows_the_hardware() -> None:
    """On the CPU every rank uses gloo; "auto" with more ranks than GPUs is refused only where there are GPUs."""
    assert resolve_device("cpu", tensor_parallel_size=4) == "cpu"
    if COUNT == 0:
        assert resolve_device("auto", tensor_parallel_size=4) == "cpu"


def test_device_error_is_an_rtpcore_error_exported_with_the_others() -> None:
    assert issubclass(DeviceError, RtpcoreError)
    assert errors.DeviceError is DeviceError and "DeviceError" in errors.__all__


def test_the_form_check_and_the_cli_arguments_import_no_torch() -> None:
    """--device is checked without torch: the form check, `generate --help` and a malformed --device leave torch unloaded."""
    code = (
        "import sys\n"
        "from rtpcore.engine.worker.devices import check_device_form\n"
        "check_device_form('cuda:3')\n"
        "from rtpcore.cli import main\n"
        "for argv in (['generate', '--help'], ['serve', '--help'], ['generate', '--demo', 'llama', '--device', 'gpu:x']):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "print('TORCH', 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "TORCH False"


# -- the engine ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_tokens(ckpt: Path) -> list[list[int]]:
    with Engine.from_pretrained(ckpt, tokens_per_block=4) as engine:
        return engine.generate(PROMPTS, max_new_tokens=12, stop_token_ids=[])


@cpu_only
@pytest.mark.parametrize("device", ["cpu", "auto", torch.device("cpu")])
def test_cpu_engine_keeps_everything_on_the_cpu_and_gives_the_default_tokens(
    ckpt: Path, default_tokens: list[list[int]], device: Any
) -> None:
    """device="cpu", "auto" (no GPU here) or torch.device("cpu"): the default engine's tokens, and the weights,
    KV pools and engine.device all on the CPU."""
    with Engine.from_pretrained(ckpt, tokens_per_block=4, device=device) as engine:
        assert engine.device == torch.device("cpu") and engine.config.device == "cpu"
        assert engine.generate(PROMPTS, max_new_tokens=12, stop_token_ids=[]) == default_tokens
        tensors = [*engine.model.parameters(), *engine.model.buffers()]
        tensors += [t for cache in engine.kv_caches for t in (cache.k, cache.v)]
        assert tensors and {t.device for t in tensors} == {torch.device("cpu")}


def test_async_engine_takes_the_device(ckpt: Path) -> None:
    """AsyncEngine.from_pretrained forwards device to the engine."""
    from rtpcore import AsyncEngine

    engine = AsyncEngine.from_pretrained(ckpt, tokens_per_block=4, device="cpu")
    try:
        assert engine.engine.device == torch.device("cpu")
    finally:
        engine.close()


@pytest.mark.parametrize(("device", "malformed"), [(MISSING, False), ("gpu", False), ("gpu:x", True)])
@pytest.mark.parametrize("tp", [1, 2])
def test_an_unusable_device_fails_before_anything_loads_or_starts(
    tmp_path: Path, device: str, malformed: bool, tp: int
) -> None:
    """An unavailable or malformed device raises DeviceError before the checkpoint is read (a missing
    checkpoint is not what fails) and before any worker process starts."""
    before = multiprocessing.active_children()
    with pytest.raises(DeviceError) as excinfo:
        Engine.from_pretrained(tmp_path / "no-such-checkpoint", device=device, tensor_parallel_size=tp)
    assert excinfo.value.malformed is malformed
    assert multiprocessing.active_children() == before


def test_a_worker_group_refuses_a_numbered_gpu_before_starting_processes() -> None:
    """A tensor-parallel group's device is "cpu", "cuda" or None (rank r takes cuda:r): "cuda:1" is refused up front."""
    with pytest.raises(ValueError, match="'cuda:1'"):
        WorkerGroup.spawn("rtpcore.engine.worker.rank:build_shard", None, 2, device="cuda:1")
    assert multiprocessing.active_children() == []


# -- the command line ----------------------------------------------------------------------


def _rtpcore(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "xdg"))
    return subprocess.run(
        [sys.executable, "-m", "rtpcore", *argv], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.parametrize("command", [["generate", "--prompt-ids", "1"], ["serve"]])
def test_cli_malformed_device_is_a_usage_error(tmp_path: Path, command: list[str]) -> None:
    """`--device gpu:x` exits 2 naming the value, before anything loads; `--device gpu` (a platform's
    form, no platform here) exits 1 listing the known platforms, before a demo is built."""
    out = _rtpcore(tmp_path, *command, "--demo", "llama", "--device", "gpu:x")
    assert out.returncode == 2, out.stderr
    assert "argument --device: device 'gpu:x' is not one of" in out.stderr
    out = _rtpcore(tmp_path, *command, "--demo", "llama", "--device", "gpu")
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip() == ("rtpcore: error: device 'gpu' is not a platform here; known: cpu, cuda (a plugin "
                                  "adds one with rtpcore_register_platforms; load it with --plugins)")
    assert not (tmp_path / "xdg").exists()  # no demo was built


@pytest.mark.parametrize("command", [["generate", "--prompt-ids", "1"], ["serve"]])
def test_cli_unavailable_device_exits_1_with_one_line(tmp_path: Path, command: list[str]) -> None:
    """A device torch cannot see exits 1 with one `rtpcore: error:` line naming it, before a demo is built."""
    out = _rtpcore(tmp_path, *command, "--demo", "llama", "--device", MISSING)
    assert out.returncode == 1, out.stderr
    assert out.stderr.splitlines() == [out.stderr.strip()]
    assert out.stderr.startswith(f"rtpcore: error: device {MISSING!r} is not available")
    assert not (tmp_path / "xdg").exists()


@cpu_only
def test_cli_generate_on_the_cpu_gives_the_default_tokens(tmp_path: Path) -> None:
    """`generate --device cpu` and `--device auto` (no GPU here) print what the default prints."""
    argv = ("generate", "--demo", "llama", "--prompt-ids", "1,2,3", "--max-new-tokens", "6")
    outs = [_rtpcore(tmp_path, *argv, *extra) for extra in ((), ("--device", "cpu"), ("--device", "auto"))]
    assert [o.returncode for o in outs] == [0, 0, 0], outs[0].stderr
    assert outs[0].stdout.strip() and {o.stdout for o in outs} == {outs[0].stdout}

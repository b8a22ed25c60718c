"""The tensor-parallel worker group, with real spawned processes talking gloo."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from _tp_toys import (
    DiscoverySpy,
    build_toy,
    fail_on_follower,
    mlp_reference,
    mlp_weights,
    slow_build_on_follower,
    toy_inputs,
)
from plugin_env import hooks_source
from rtpcore.errors import PluginVersionError, RtpcoreError, WorkerError
from rtpcore.parallel.leader import WorkerGroup

pytestmark = pytest.mark.slow

#: How long a test waits for something that happens at once on a fast machine (a killed
#: process to be reaped, a spawned Python to start); only there so that nothing hangs.
PATIENCE_S = 120.0


def _gone(pid: int) -> bool:
    """True when no process (not even a zombie) has this pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    status = Path(f"/proc/{pid}/status")
    return not status.exists() or "zombie" in status.read_text()


@pytest.fixture(scope="module")
def group():
    with WorkerGroup.spawn(build_toy, {"seed": 0}, 2) as g:
        yield g


def test_run_executes_on_every_rank_and_gathers_in_rank_order(group):
    results = group.run("whoami", None, gather=True)
    assert [rank for rank, _ in results] == [0, 1]
    assert results[0][1] == os.getpid()
    assert results[1][1] == group.pids[1] != os.getpid()


def test_collectives_inside_a_step_see_every_rank(group):
    assert group.run("reduce_rank_plus_one") == 3.0


def test_row_and_column_parallel_mlp_equals_the_unsharded_mlp(group):
    x = toy_inputs()
    w = mlp_weights(0)
    out = group.run("forward", x)
    assert torch.allclose(out, mlp_reference(x, w), atol=1e-5)
    hidden = group.run("hidden", x)
    assert torch.allclose(hidden, torch.nn.functional.linear(x, w["w1"], w["b1"]), atol=1e-6)


def test_single_rank_group_runs_in_process_without_workers():
    with WorkerGroup.spawn(build_toy, {"seed": 0}, 1) as g:
        assert g.pids == {}
        assert g.run("whoami", None, gather=True) == [(0, os.getpid())]
        x = toy_inputs()
        assert torch.allclose(g.run("forward", x), mlp_reference(x, mlp_weights(0)), atol=1e-6)


@pytest.mark.parametrize(
    "error",
    [
        ValueError("bad request"),
        torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("CUDA error: out of memory"),  # cudaErrorMemoryAllocation: not sticky
        RuntimeError("the expanded size of the tensor (3) must match"),
        KeyboardInterrupt(),
    ],
    ids=["ValueError", "OutOfMemoryError", "cuda-out-of-memory", "RuntimeError", "KeyboardInterrupt"],
)
def test_a_single_rank_step_that_raises_propagates_it_unchanged_and_the_group_stays_usable(error):
    with WorkerGroup.spawn(build_toy, {"seed": 0}, 1) as g:
        with pytest.raises(type(error)) as excinfo:
            g.run("raise_on_rank0", error)
        assert excinfo.value is error
        assert g.failure is None
        x = toy_inputs()
        assert torch.allclose(g.run("forward", x), mlp_reference(x, mlp_weights(0)), atol=1e-6)
        assert g.run("whoami", None, gather=True) == [(0, os.getpid())]


def _wrapped_device_fault() -> RtpcoreError:
    error = RtpcoreError("the engine step failed")
    error.__cause__ = RuntimeError("CUDA error: an illegal memory access was encountered")
    return error


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("CUDA error: an illegal memory access was encountered"),
        RuntimeError("CUDA error: device-side assert triggered"),
        RuntimeError("../aten/src/ATen/native/cuda/IndexKernel.cu:92: device-side assert triggered"),
        RuntimeError("HIP error: an illegal memory access was encountered"),
        _wrapped_device_fault(),  # a device fault in the chain of causes
    ],
    ids=["illegal-access", "device-side-assert", "assert-message", "hip", "wrapped"],
)
def test_a_device_fault_in_a_single_rank_step_propagates_and_breaks_the_group(error):
    g = WorkerGroup.spawn(build_toy, {"seed": 0}, 1)
    with pytest.raises(type(error)) as excinfo:
        g.run("raise_on_rank0", error)
    assert excinfo.value is error
    assert g.failure is not None and g.failure.rank == 0
    assert f"rank 0 failed: {type(error).__name__}: {error}" in str(g.failure)
    assert g.local is None  # torn down: the device is unusable
    with pytest.raises(WorkerError, match="the worker group is broken: rank 0 failed") as later:
        g.run("whoami")
    assert later.value.rank == 0
    g.close()


def test_a_worker_that_raises_fails_the_step_naming_its_rank_and_leaves_no_process():
    g = WorkerGroup.spawn(build_toy, {"seed": 0}, 2)
    pid = g.pids[1]
    with pytest.raises(WorkerError) as excinfo:
        g.run("fail", "shard exploded")
    err = excinfo.value
    assert err.rank == 1 and err.cause_type == "ValueError"
    assert "rank 1" in str(err) and "shard exploded" in str(err)
    assert isinstance(err.__cause__, ValueError)  # the worker's own exception, rebuilt here
    assert "in fail" in str(err.__cause__.__cause__)  # and its traceback
    assert _gone(pid)
    with pytest.raises(WorkerError, match="broken"):
        g.run("whoami")
    g.close()


def test_rank_0s_own_exception_propagates_unchanged_and_stops_the_waiting_workers():
    g = WorkerGroup.spawn(build_toy, {"seed": 0}, 2)
    pid = g.pids[1]
    with pytest.raises(KeyError, match="bad request"):
        g.run("fail_on_rank0", "bad request")
    assert _gone(pid)  # it was waiting in an all-reduce that would never complete
    with pytest.raises(WorkerError, match=r"broken: rank 0 failed: KeyError") as excinfo:
        g.run("whoami")
    assert excinfo.value.rank == 0
    g.close()


def test_without_sync_a_follower_failure_is_raised_by_the_next_call():
    with WorkerGroup.spawn(build_toy, {"seed": 0}, 2) as g:
        assert g.run("fail", "late failure", sync=False) is None  # rank 0 did not wait
        with pytest.raises(WorkerError, match="rank 1 failed: ValueError: late failure"):
            g.run("whoami")


def test_debug_fail_point_raises_on_the_chosen_rank():
    with WorkerGroup.spawn(build_toy, {"seed": 0}, 2) as g:
        with pytest.raises(WorkerError, match=r"rank 1 failed: RuntimeError: boom") as excinfo:
            g.debug_raise_on(1, "boom")
        assert excinfo.value.rank == 1


def test_a_worker_killed_mid_step_fails_the_step_quickly_naming_its_rank():
    # A step timeout far above PATIENCE_S: the failure must come from the death, not the timeout.
    g = WorkerGroup.spawn(build_toy, {"seed": 0}, 2, timeout=timedelta(seconds=5 * PATIENCE_S))
    pid = g.pids[1]
    threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(WorkerError) as excinfo:
        g.run("slow_reduce", 10 * PATIENCE_S)  # rank 0 waits in the all-reduce; rank 1 sleeps
    assert time.monotonic() - start < PATIENCE_S
    assert excinfo.value.rank == 1 and excinfo.value.exitcode == -signal.SIGKILL
    assert "rank 1 was killed by signal SIGKILL" in str(excinfo.value)
    assert _gone(pid)
    g.close()


def test_a_silent_worker_fails_the_step_after_the_timeout_and_is_killed():
    # The step timeout is the one under test; the start has its own (default, generous) one.
    g = WorkerGroup.spawn(build_toy, {"seed": 0}, 2, timeout=timedelta(seconds=2))
    pid = g.pids[1]
    os.kill(pid, signal.SIGSTOP)  # alive, holding its sockets, answering nothing
    start = time.monotonic()
    with pytest.raises(WorkerError, match="no answer from the other ranks within the timeout"):
        g.run("whoami")
    assert time.monotonic() - start < PATIENCE_S  # the 2 s timeout, not the default 5 min
    assert _gone(pid)
    g.close()


def test_the_start_is_bounded_by_start_timeout_not_by_the_step_timeout():
    """A follower that takes longer to build than a step may take still starts."""
    g = WorkerGroup.spawn(
        slow_build_on_follower, {"seed": 0, "build_s": 1.0}, 2, timeout=timedelta(milliseconds=100)
    )
    try:
        assert g.failure is None and g.context.world_size == 2
        assert set(g.pids) == {1}
    finally:
        g.close()
    assert g.failure is None  # a clean stop, not a failure


def test_a_worker_that_fails_to_build_fails_spawn_naming_its_rank():
    with pytest.raises(
        WorkerError, match=r"rank 1 failed: OSError: shard 1 cannot be built: no disk"
    ) as excinfo:
        WorkerGroup.spawn(fail_on_follower, {"why": "no disk"}, 2)
    assert excinfo.value.rank == 1 and excinfo.value.cause_type == "OSError"


def test_close_stops_every_worker_and_is_idempotent():
    g = WorkerGroup.spawn("_tp_toys:build_toy", {"seed": 0}, 2)
    pid = g.pids[1]
    g.close()
    assert _gone(pid)
    g.close()
    with pytest.raises(WorkerError, match="closed"):
        g.run("whoami")


def test_bad_world_size_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer, got 0"):
        WorkerGroup.spawn(build_toy, {}, 0)


# -- the plugin plan travels in the start arguments ---------------------------------------

TP_PLUGIN = hooks_source(("TpModel", "tp_model", ("TpModelForCausalLM",)))


def _plan(plugin_env, source=TP_PLUGIN, version="1.0"):
    import rtpcore

    info = plugin_env.add_dist(
        "tp-plug",
        version,
        plugins={"tp": "wk_tp_plug.hooks"},
        modules={"wk_tp_plug/hooks.py": source},
    )
    return info, rtpcore.Allowlist.from_cli(
        plugins=["tp-plug"], external_model_packages=[]
    ).resolve()


def test_workers_load_the_plan_from_their_start_arguments_without_discovery(plugin_env):
    _, plan = _plan(plugin_env)
    with WorkerGroup.spawn(build_toy, DiscoverySpy(seed=0), 2, plan=plan) as g:
        calls = g.run("discovery_calls", gather=True)
        models = g.run("models", plan, gather=True)
        modules = g.run("modules", "wk_tp_plug", gather=True)
        control = g.run("discover", None, gather=True)
    assert calls[1] == []  # no discovery call in the worker, from its start to here...
    assert control[1][0] == "importlib_metadata.entry_points"  # ...though the spy was watching
    assert "tp_model" in models[1]
    assert modules[1] == ["wk_tp_plug", "wk_tp_plug.hooks"]


def test_a_plugin_upgraded_after_resolution_fails_spawn_naming_the_rank(plugin_env):
    info, plan = _plan(plugin_env)
    plugin_env.set_version(info, "2.0")
    with pytest.raises(
        WorkerError, match=r"rank 1 failed: PluginVersionError: .*version 2\.0"
    ) as excinfo:
        WorkerGroup.spawn(build_toy, {"seed": 0}, 2, plan=plan)
    assert excinfo.value.rank == 1
    assert isinstance(excinfo.value.__cause__, PluginVersionError)
    assert excinfo.value.__cause__.distribution == "tp-plug"


def test_a_plugin_that_fails_to_import_in_a_worker_fails_spawn_naming_rank_and_cause(plugin_env):
    _, plan = _plan(plugin_env, source="import wk_no_such_dependency\n")
    with pytest.raises(WorkerError, match=r"rank 1 failed: PluginLoadError: .*tp-plug") as excinfo:
        WorkerGroup.spawn(build_toy, {"seed": 0}, 2, plan=plan)
    assert excinfo.value.cause_type == "PluginLoadError"
    assert "wk_no_such_dependency" in str(
        excinfo.value.__cause__.__cause__
    )  # the worker's traceback


def test_workers_exit_when_the_coordinating_process_dies():
    script = Path(__file__).with_name("_tp_toys.py")
    parent = subprocess.run(  # two Pythons importing torch: generous, only against a hang
        [sys.executable, str(script), "orphan"], capture_output=True, text=True, timeout=300
    )
    assert parent.returncode == -signal.SIGKILL
    pid = int(parent.stdout.split()[0])
    deadline = time.monotonic() + PATIENCE_S
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pid)


def test_teardown_runs_even_when_diagnosing_the_failure_fails():
    """With the rendezvous store gone, a dead follower still fails the step with a WorkerError
    saying the diagnosis failed, and every other follower is stopped."""
    g = WorkerGroup.spawn(build_toy, {"seed": 0}, 3)
    pids = g.pids
    server = torch.distributed.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    gone = torch.distributed.TCPStore(  # connecting is not under test: a generous timeout
        "127.0.0.1", server.port, 1, is_master=False, timeout=timedelta(seconds=PATIENCE_S)
    )
    gone.set_timeout(timedelta(seconds=2))  # requests to the dead server fail within 2 s
    del server  # the store's server shuts down: every later request fails
    g._store = gone
    os.kill(pids[1], signal.SIGKILL)
    deadline = time.monotonic() + PATIENCE_S
    while not _gone(pids[1]) and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(WorkerError, match="finding the failing rank failed too"):
        g.run("whoami")
    assert _gone(pids[2])
    with pytest.raises(WorkerError, match="broken"):
        g.run("whoami")

"""ParallelContext: process groups and collectives, with real processes talking gloo."""

from __future__ import annotations

import json
import multiprocessing
import sys
from pathlib import Path

import pytest
import torch

from _tp_toys import (
    collective_follower,
    collectives,
    mlp_reference,
    mlp_weights,
    run_env_ranks,
    toy_inputs,
)
from rtpcore.errors import RtpcoreError
from rtpcore.parallel.context import ParallelContext, env_store, init_parallel, local_store

TOYS = Path(__file__).with_name("_tp_toys.py")


def test_single_rank_collectives_are_no_ops_returning_the_input():
    ctx = ParallelContext.single()
    x = torch.arange(4.0)
    assert ctx.all_reduce(x) is x and ctx.all_gather(x, 0) is x
    assert ctx.broadcast_object({"a": 1}) == {"a": 1}
    assert ctx.gather_objects("me") == ["me"]
    ctx.barrier()
    ctx.destroy()
    assert (ctx.rank, ctx.world_size, ctx.backend, ctx.is_first) == (0, 1, "none", True)


@pytest.mark.slow
def test_two_spawned_ranks_reduce_gather_and_broadcast():
    store = local_store(2)
    child = multiprocessing.get_context("spawn").Process(
        target=collective_follower, args=(store.port, store.secret)
    )
    child.start()
    try:
        ctx = init_parallel(store, 0, 2, device="cpu")
        assert (ctx.rank, ctx.world_size, ctx.backend, ctx.device) == (0, 2, "gloo", "cpu")
        mine = collectives(ctx)
        theirs = ctx.gather_objects(None)[1]
        ctx.destroy()
    finally:
        child.join(300)  # only against a hang: it exits once rank 0 has its objects
    assert child.exitcode == 0
    for seen in (mine, theirs):
        assert seen["sum"] == [3.0, 6.0]  # 1*[1, 2] + 2*[1, 2]
        assert seen["gathered"] == [[0.0, 1.0], [0.0, 1.0]]
        assert seen["message"] == {"from": 0}
    assert mine["objects"] == ["rank 0", "rank 1"] and theirs["objects"] is None
    with pytest.raises(RtpcoreError, match="rank 0 is closed"):
        ctx.all_reduce(torch.ones(1))


@pytest.mark.slow
def test_two_nodes_of_one_process_each_meet_over_env_rendezvous():
    """Rank 0 runs a script; rank 1 runs `python -m rtpcore.parallel.leader` and learns from rank 0
    what to build."""
    commands = ([sys.executable, str(TOYS)], [sys.executable, "-m", "rtpcore.parallel.leader"])
    (code0, out0, err0), (code1, out1, err1) = run_env_ranks(commands, pythonpath=[str(TOYS.parent)])
    assert (code0, code1) == (0, 0), err0 + err1
    assert out1 == ""  # only rank 0 reports
    outputs = [out0, out1]
    result = json.loads(outputs[0])
    assert result["world_size"] == 2
    expected = mlp_reference(toy_inputs(), mlp_weights(3))
    assert torch.allclose(torch.tensor(result["out"]), expected, atol=1e-5)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"MASTER_PORT": "1", "RANK": "0", "WORLD_SIZE": "1"},
            "needs the environment variable MASTER_ADDR",
        ),
        (
            {"MASTER_ADDR": "h", "MASTER_PORT": "x", "RANK": "0", "WORLD_SIZE": "1"},
            "MASTER_PORT='x' must be a non-negative integer",
        ),
        (
            {"MASTER_ADDR": "h", "MASTER_PORT": "1", "RANK": "2", "WORLD_SIZE": "2"},
            "RANK=2 must be below WORLD_SIZE=2",
        ),
    ],
)
def test_env_rendezvous_names_the_bad_variable(monkeypatch, env, message):
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RtpcoreError, match=message):
        env_store()


def test_an_unknown_device_is_refused():
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or None, got 'tpu'"):
        init_parallel(None, 0, 1, device="tpu")

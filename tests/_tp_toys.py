"""Local objects for tensor-parallel tests; imported by spawned worker processes.

Run as a script, this is rank 0 of an env:// group (see test_distributed.py): every
rank builds a shard of the toy MLP, and this one prints the forward result as JSON.
With the argument ``orphan`` it starts a group and kills itself (test_workers.py).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rtpcore.parallel.context import ParallelContext
from rtpcore.parallel.layers import GatherColumns, row_parallel
from rtpcore.parallel.sharding import column_shard, row_shard

IN, HIDDEN, OUT = 8, 12, 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_env_ranks(
    commands: Sequence[Sequence[str]],
    *,
    extra_env: Sequence[Mapping[str, str]] | None = None,
    pythonpath: Sequence[str] = (),
    timeout: float = 300,
) -> list[tuple[int, str, str]]:
    """Run one process per rank of an env:// group on loopback (MASTER_ADDR, MASTER_PORT, RANK,
    WORLD_SIZE set; ``extra_env[rank]`` added; ``pythonpath`` prepended), wait for all, kill
    any left over, and return (returncode, stdout, stderr) per rank.

    ``timeout`` only keeps a stuck group from hanging the test run: each rank is a Python
    process importing torch (and transformers), which takes tens of seconds on a slow,
    busy machine, so it is generous."""
    port, nodes = free_port(), []
    for rank, command in enumerate(commands):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(len(commands)),
            **(extra_env[rank] if extra_env else {}),
        )
        if pythonpath:
            env["PYTHONPATH"] = os.pathsep.join([*pythonpath, os.environ.get("PYTHONPATH", "")])
        nodes.append(
            subprocess.Popen(list(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    try:
        outputs = [node.communicate(timeout=timeout) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    return [(node.returncode, out, err) for node, (out, err) in zip(nodes, outputs, strict=True)]


def mlp_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """The full (unsharded) weights of a 2-layer MLP, the same in every process."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(HIDDEN, IN, generator=g),
        "b1": torch.randn(HIDDEN, generator=g),
        "w2": torch.randn(OUT, HIDDEN, generator=g),
        "b2": torch.randn(OUT, generator=g),
    }


def mlp_reference(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.linear(F.gelu(F.linear(x, w["w1"], w["b1"])), w["w2"], w["b2"])


def toy_inputs(seed: int = 1) -> torch.Tensor:
    return torch.randn(5, IN, generator=torch.Generator().manual_seed(seed))


class ShardedMLP:
    """fc1 column-parallel (rows of w1 and b1), fc2 row-parallel (columns of w2), one all-reduce."""

    def __init__(self, ctx: ParallelContext, seed: int):
        self.ctx = ctx
        w = mlp_weights(seed)
        cols = column_shard(HIDDEN, ctx.rank, ctx.world_size, name="hidden")
        rows = row_shard(HIDDEN, ctx.rank, ctx.world_size, name="hidden")
        self.fc1 = nn.Linear(IN, HIDDEN // ctx.world_size)  # (HIDDEN/N, IN): column-parallel
        self.fc1.weight.data, self.fc1.bias.data = cols.take(w["w1"]), cols.take(w["b1"])
        self.fc2 = row_parallel(_linear, rows.take(w["w2"]), w["b2"], ctx)  # (OUT, HIDDEN/N)
        self.hidden_layer = GatherColumns(self.fc1, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.fc2(F.gelu(self.fc1(x)))  # one all-reduce, bias b2 added once

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """fc1's full output, gathered from the column shards."""
        with torch.no_grad():
            return self.hidden_layer(x)  # (B, HIDDEN)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight.data = weight
    if bias is not None:
        layer.bias.data = bias
    return layer


class Toy(ShardedMLP):
    """A local object with a method per behaviour the worker tests need."""

    def __init__(self, ctx: ParallelContext, spec: Any):
        super().__init__(ctx, seed=spec.get("seed", 0))
        self.spec = spec

    def whoami(self, _: Any) -> tuple[int, int]:
        return self.ctx.rank, os.getpid()

    def reduce_rank_plus_one(self, _: Any) -> float:
        return float(self.ctx.all_reduce(torch.tensor([self.ctx.rank + 1.0]))[0])

    def slow_reduce(self, seconds: float) -> float:
        """Followers sleep first, so rank 0 waits inside the all-reduce."""
        if self.ctx.rank > 0:
            time.sleep(seconds)
        return float(self.ctx.all_reduce(torch.ones(1))[0])

    def fail_on_rank0(self, message: str) -> float:
        """Rank 0 raises while its followers wait for it in an all-reduce."""
        if self.ctx.rank == 0:
            raise KeyError(message)
        return float(self.ctx.all_reduce(torch.ones(1))[0])

    def fail(self, message: str) -> None:
        if self.ctx.rank > 0:
            raise ValueError(message)

    def raise_on_rank0(self, error: BaseException) -> None:
        """Rank 0 raises ``error`` itself (the same object); the other ranks return."""
        if self.ctx.rank == 0:
            raise error

    def discovery_calls(self, _: Any) -> list[str]:
        return list(DISCOVERY_CALLS)

    def discover(self, _: Any) -> list[str]:
        """Make one discovery call: proves the spy would have seen one."""
        import importlib_metadata

        importlib_metadata.entry_points(group="rtpcore.plugins")
        return list(DISCOVERY_CALLS)

    def models(self, plan: Any) -> list[str]:
        """Model types of the registry ``plan`` loaded in this process (already loaded: no import)."""
        from rtpcore.plugins.loading import load_plugins

        return sorted(r.model_type for r in load_plugins(plan).records())

    def modules(self, prefix: str) -> list[str]:
        return sorted(m for m in sys.modules if m.startswith(prefix))


#: Discovery calls seen in this process since a DiscoverySpy was unpickled here.
DISCOVERY_CALLS: list[str] = []


class DiscoverySpy(dict):  # type: ignore[type-arg]
    """A spec that, when unpickled in a worker (before it loads its plugins), starts
    recording every importlib-metadata discovery call made in that process."""

    def __reduce__(self) -> Any:
        return (_spy_spec, (dict(self),))


def _spy_spec(state: dict[str, Any]) -> DiscoverySpy:
    import importlib.metadata as std_metadata

    import importlib_metadata

    for module in (importlib_metadata, std_metadata):
        for fn in ("entry_points", "distributions", "distribution", "version", "metadata"):
            original = getattr(module, fn)

            def wrapper(
                *args: Any,
                _fn: Any = original,
                _label: str = f"{module.__name__}.{fn}",
                **kwargs: Any,
            ) -> Any:
                DISCOVERY_CALLS.append(_label)
                return _fn(*args, **kwargs)

            setattr(module, fn, wrapper)
        discover = module.Distribution.discover.__func__  # type: ignore[attr-defined]

        def counting(
            cls: Any,
            *args: Any,
            _fn: Any = discover,
            _label: str = f"{module.__name__}.Distribution.discover",
            **kwargs: Any,
        ) -> Any:
            DISCOVERY_CALLS.append(_label)
            return _fn(cls, *args, **kwargs)

        module.Distribution.discover = classmethod(counting)  # type: ignore[method-assign,assignment]
    return DiscoverySpy(state)


def build_toy(ctx: ParallelContext, spec: Any) -> Toy:
    return Toy(ctx, spec)


def slow_build_on_follower(ctx: ParallelContext, spec: Any) -> Toy:
    """Followers take ``spec["build_s"]`` seconds to build (loading weights, say)."""
    if ctx.rank > 0:
        time.sleep(spec["build_s"])
    return Toy(ctx, spec)


def fail_on_follower(ctx: ParallelContext, spec: Any) -> Toy:
    if ctx.rank > 0:
        raise OSError(f"shard {ctx.rank} cannot be built: {spec['why']}")
    return Toy(ctx, spec)


def collective_follower(port: int, secret: bytes) -> None:
    """Rank 1 of a 2-rank group built with rtpcore.parallel.context alone; sends rank 0 what it saw."""
    from rtpcore.parallel.context import connect_store, init_parallel

    ctx = init_parallel(connect_store("127.0.0.1", port, 2, secret=secret), 1, 2, device="cpu")
    ctx.gather_objects(collectives(ctx))
    ctx.destroy()


def refusing_follower(port: int, secret: bytes, out: str) -> None:
    """Rank 1 of a 2-rank group: waits for one broadcast object and writes to ``out``
    what happened (the object's repr, or the error that refused it)."""
    from rtpcore.errors import CollectiveError
    from rtpcore.parallel.context import connect_store, init_parallel

    ctx = init_parallel(connect_store("127.0.0.1", port, 2, secret=secret), 1, 2, device="cpu")
    try:
        seen = repr(ctx.broadcast_object())
    except CollectiveError as exc:
        seen = f"CollectiveError(op={exc.op!r}, rank={exc.rank}): {exc}"
    Path(out).write_text(seen)
    ctx.destroy()


class Booby:
    """Unpickling this creates the file ``marker`` (what a forged message would run)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def collectives(ctx: ParallelContext) -> dict[str, Any]:
    """Run each collective once; rank r contributes values derived from r."""
    return {
        "sum": ctx.all_reduce(torch.tensor([1.0, 2.0]) * (ctx.rank + 1)).tolist(),
        "gathered": ctx.all_gather(torch.full((2, 1), float(ctx.rank)), dim=1).tolist(),
        "message": ctx.broadcast_object({"from": ctx.rank} if ctx.rank == 0 else None),
        "objects": ctx.gather_objects(f"rank {ctx.rank}"),
    }


def _orphan_main() -> int:
    """Start a group, print the follower's pid, then die without closing anything."""
    import signal

    from rtpcore.parallel.leader import WorkerGroup

    group = WorkerGroup.spawn(build_toy, {"seed": 0}, 2)
    print(group.pids[1], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    return 1


def _node_main() -> int:
    from rtpcore.parallel.leader import WorkerGroup

    group = WorkerGroup.join_env("_tp_toys:build_toy", {"seed": 3}, device="cpu")
    assert group is not None, "run this script as RANK=0 only"
    with group:
        out = group.run("forward", toy_inputs())
    print(json.dumps({"world_size": group.world_size, "out": out.tolist()}))
    return 0


if __name__ == "__main__":
    sys.exit(_orphan_main() if sys.argv[1:] == ["orphan"] else _node_main())

"""The follower side of a tensor-parallel worker group: ranks 1..N-1.

A follower joins the process groups, loads the plugin plan it was given (no
discovery), builds its local object with ``factory(ctx, spec)``, then executes
rank 0's :class:`Step` messages in lockstep until rank 0 stops it. It writes a
failure report to the rendezvous store and exits on any exception (see
``rtpcore.parallel.failures``); a spawned follower also exits when its parent
process dies. Rank 0's side is ``rtpcore.parallel.leader``.

A spawned follower receives the engine's secret in its :class:`StartArgs`,
over the spawn pipe; every message it receives is checked with it before it is
unpickled (``rtpcore.parallel.sealing``).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from attrs import field, frozen

from rtpcore.parallel.context import (
    START_TIMEOUT,
    ParallelContext,
    Rendezvous,
    connect_store,
    init_parallel,
)
from rtpcore.parallel.failures import report_failure

__all__ = ["Factory", "Step", "execute", "follow", "resolve_factory"]

logger = logging.getLogger(__name__)

#: What every rank builds its local object with: ``factory(ctx, spec)``, given as a
#: picklable callable or as ``"module:qualname"``.
Factory = Callable[[ParallelContext, Any], Any] | str

STOP = "__rtpcore_stop__"
RAISE = "__rtpcore_raise__"  # test-only fail point, see WorkerGroup.debug_raise_on
JOINED = "rtpcore/joined/{}"


@frozen
class Step:
    """One message from rank 0: run ``local.<method>(payload)`` on every rank."""

    method: str
    payload: Any = None
    gather: bool = False
    sync: bool = True


@frozen
class StartArgs:
    rank: int
    world_size: int
    port: int
    parent_pid: int
    factory: Factory
    spec: Any
    plan: Any
    device: str | None
    timeout: timedelta
    idle_timeout: timedelta
    num_threads: int | None
    start_timeout: timedelta
    secret: bytes = field(repr=False)


def spawned_main(args: StartArgs) -> None:
    """Entry point of a spawned follower process."""
    threading.Thread(target=_exit_with_parent, args=(args.parent_pid,), daemon=True).start()
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    store = connect_store(
        "127.0.0.1", args.port, args.world_size, args.start_timeout, secret=args.secret
    )
    build = (args.factory, args.spec, args.plan)
    follow(
        store,
        args.rank,
        args.world_size,
        build,
        args.device,
        args.timeout,
        args.idle_timeout,
        args.start_timeout,
    )


def follow(
    store: Rendezvous,
    rank: int,
    world_size: int,
    build: tuple[Factory, Any, Any] | None,
    device: str | None,
    timeout: timedelta,
    idle_timeout: timedelta,
    start_timeout: timedelta = START_TIMEOUT,
) -> None:
    """Build this rank's local object from ``build`` = (factory, spec, plan), received
    from rank 0 when None, then execute rank 0's steps until it stops us.

    Joining the group and the build wait up to ``start_timeout`` for the other
    ranks; the steps are bounded by ``timeout`` (the wait for the next step by
    ``idle_timeout``)."""
    store.set_flag(JOINED.format(rank))
    try:
        ctx = init_parallel(
            store,
            rank,
            world_size,
            device=device,
            timeout=timeout,
            idle_timeout=idle_timeout,
            start_timeout=start_timeout,
        )
        factory, spec, plan = ctx.broadcast_object() if build is None else build
        if plan is not None:
            from rtpcore.plugins.loading import load_plugins

            load_plugins(plan)
        local = resolve_factory(factory)(ctx, spec)
        ctx.barrier(timeout=start_timeout)  # every rank has built its local object
        store.set_timeout(timeout)  # the start is over: steps are bounded by the step timeout
        while True:
            step = ctx.broadcast_object()
            if step.method == STOP:
                break
            result = execute(local, step, rank)
            if step.gather:
                ctx.gather_objects(result)
            elif step.sync:
                ctx.barrier()
    except BaseException as exc:
        logger.error("tensor-parallel rank %d failed", rank, exc_info=exc)
        report_failure(store, rank, exc)
        os._exit(1)  # skip destructors: peers may still hold our sockets
    ctx.destroy()


def execute(local: Any, step: Step, rank: int) -> Any:
    if step.method == RAISE:
        target, message = step.payload
        if rank == target:
            raise RuntimeError(message)
        return None
    return getattr(local, step.method)(step.payload)


def _exit_with_parent(parent_pid: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(1)


def resolve_factory(factory: Factory) -> Callable[[ParallelContext, Any], Any]:
    if callable(factory):
        return factory
    module, _, qualname = factory.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj

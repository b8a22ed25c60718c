"""Tensor-parallel worker processes: rank 0 leads, ranks 1..N-1 follow.

The coordinating process is rank 0 and computes its own shard. Every rank builds
one local object with ``factory(ctx, spec)`` (for the engine: its model shard and
KV cache) and the group then runs *steps* on all of them in lockstep::

    group = WorkerGroup.spawn("mypkg.shard:build", spec, world_size=2, plan=plan)
    logits = group.run("forward", batch)      # every rank: local.forward(batch)
    group.close()

``run`` broadcasts ``Step(method, payload)`` from rank 0 (followers wait for it
up to the long idle timeout); each follower calls ``getattr(local, method)(payload)``
and acknowledges with a barrier under the bounded timeout, so the call returns
only when every rank is done.

Two timeouts bound a group, and they are separate settings: ``start_timeout``
(default ``START_TIMEOUT``, 30 minutes) covers the start, from a follower process
starting through the rendezvous and the process groups to every rank having built
its local object (an engine shard loads its weights then); ``timeout`` (default
``DEFAULT_TIMEOUT``, 5 minutes) bounds every collective of every step afterwards.

Followers (``rtpcore.parallel.follower``) are started with the multiprocessing ``spawn``
method and receive the spec and the resolved plugin plan as start arguments;
they call ``load_plugins(plan)`` (no discovery scan) before building. Under
``torchrun`` (``env://``), :meth:`WorkerGroup.join_env` is the same code path:
rank 0 gets the group and sends the others factory, spec and plan; they serve
steps until rank 0 closes it (``python -m rtpcore.parallel.leader``).

Rank 0 and the followers accept objects only from each other: every message and
failure report is sealed with a per-engine secret and checked before it is
unpickled (``rtpcore.parallel.sealing``). Spawned followers get the secret over the spawn
pipe; ``env://`` ranks read the file named by ``RTPCORE_SECRET_FILE`` and,
without one, meet on a loopback MASTER_ADDR only.

Failures never hang: a follower that raises reports ``(rank, exception,
traceback)`` through the rendezvous store (``rtpcore.parallel.failures``) and exits,
which breaks rank 0's pending collective at once (a
:class:`~rtpcore.errors.CollectiveError`); a killed follower shows in its process
sentinel; a silent one hits the bounded timeout. Rank 0 then raises
:class:`~rtpcore.errors.WorkerError` naming the rank and the cause and tears the
group down. An exception of rank 0's own propagates unchanged (after the same
teardown): with several ranks, any failure in a step breaks the group, since a rank
may have stopped in the middle of a collective. Followers also exit when their
parent process dies.

A single rank (``world_size == 1``) runs its steps in this process and has no peer
to fall out of step with: an exception its step method raises propagates unchanged
and leaves the group usable (the engine above retries and isolates the faulty
request). So does an interrupt (KeyboardInterrupt, SystemExit and the other
BaseExceptions that are not Exceptions): it loses the interrupted step's result and
nothing else. Only a device fault breaks a single rank's group, because the device
is unusable for every later step: a RuntimeError (or one in the exception's chain of
causes and contexts) whose message says "CUDA error", "device-side assert" or "HIP
error", except out-of-memory errors (``torch.cuda.OutOfMemoryError``, "CUDA error: out
of memory"), after which the device is still usable; see :func:`is_device_fault`. The
exception then propagates, the group is torn down, and every later step raises
WorkerError ("the worker group is broken").
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import threading
import time
import weakref
from datetime import timedelta
from typing import Any

import torch

from rtpcore.errors import CollectiveError, RtpcoreError, WorkerError
from rtpcore.parallel.context import (
    DEFAULT_TIMEOUT,
    IDLE_TIMEOUT,
    START_TIMEOUT,
    ParallelContext,
    env_store,
    init_parallel,
    local_store,
)
from rtpcore.parallel.failures import describe_exit, read_failures, refuse_unguarded_main
from rtpcore.parallel.follower import (
    JOINED,
    RAISE,
    STOP,
    Factory,
    StartArgs,
    Step,
    execute,
    follow,
    resolve_factory,
    spawned_main,
)

__all__ = ["Step", "WorkerGroup", "is_device_fault", "serve"]

logger = logging.getLogger(__name__)

_REPORT_GRACE_S = 3.0  # how long rank 0 waits for a failing peer's report to land
_STOP_GRACE_S = 10.0  # how long close() lets followers exit on their own


class _PeerGone(Exception):
    """A follower process ended while rank 0 was not waiting on it."""


class WorkerGroup:
    """Rank 0's handle on a tensor-parallel group. Build it with :meth:`spawn` or
    :meth:`join_env`; use it as a context manager or call :meth:`close`."""

    def __init__(self, world_size: int, processes: dict[int, Any], store: Any):
        self.world_size = world_size
        self.context = ParallelContext.single()
        self.local: Any = None
        self._processes = processes  # rank -> multiprocessing.Process (spawned ranks only)
        self._store = store
        self._lock = threading.RLock()
        self._closed = False
        self._broken: WorkerError | None = None
        self._saved_threads: int | None = None
        atexit.register(_close_at_exit, weakref.ref(self))

    # -- construction -----------------------------------------------------------

    @classmethod
    def spawn(
        cls,
        factory: Factory,
        spec: Any,
        world_size: int,
        *,
        plan: Any = None,
        device: str | None = "cpu",
        timeout: timedelta = DEFAULT_TIMEOUT,
        idle_timeout: timedelta = IDLE_TIMEOUT,
        num_threads: int | None = None,
        start_timeout: timedelta = START_TIMEOUT,
    ) -> WorkerGroup:
        """Start ranks 1..world_size-1 as spawned processes on this machine; this
        process is rank 0. ``factory`` (a picklable callable or ``"module:name"``)
        is called as ``factory(ctx, spec)`` on every rank; followers first call
        ``load_plugins(plan)`` when a plan is given. Raises WorkerError naming
        the rank when a follower fails to start.

        ``start_timeout`` bounds the start: every follower process starting, joining
        the group and building its local object. ``timeout`` bounds each
        collective of every later step (a silent rank fails the step after it);
        ``idle_timeout`` is how long a follower waits for the next step.

        On CPU the ranks share this machine's cores: each rank (this process
        too, until :meth:`close`) uses ``num_threads`` torch threads, by default
        the usable cores divided by ``world_size`` (unless OMP_NUM_THREADS is
        set); oversubscribed ranks spin against each other in every collective.

        ``device``: for a group, ``"cpu"`` (gloo), ``"cuda"`` (rank r on ``cuda:r``,
        nccl) or None (nccl when every rank has a GPU, else gloo), see
        :func:`~rtpcore.parallel.context.init_parallel`. A single rank runs in this
        process on ``device`` itself: ``"cpu"`` (also for None), ``"cuda"`` (``"cuda:0"``)
        or ``"cuda:N"``; its context names it.
        """
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {world_size!r}")
        if world_size == 1:
            group = cls(1, {}, None)
            local = "cpu" if device is None else "cuda:0" if device == "cuda" else device
            group.context = ParallelContext.single(local)
            group.local = resolve_factory(factory)(group.context, spec)
            return group
        if device not in (None, "cpu", "cuda"):  # before any process starts
            raise ValueError(f"a group's device must be 'cpu', 'cuda' or None, got {device!r}")
        refuse_unguarded_main()  # a spawned rank re-running the parent's script exits, naming it
        threads = _cpu_threads(world_size, device, num_threads)
        store = local_store(world_size, start_timeout)
        mp = multiprocessing.get_context("spawn")
        processes = {}
        for rank in range(1, world_size):
            args = StartArgs(
                rank,
                world_size,
                store.port,
                os.getpid(),
                factory,
                spec,
                plan,
                device,
                timeout,
                idle_timeout,
                threads,
                start_timeout=start_timeout,
                secret=store.secret,  # travels over the spawn pipe only
            )
            processes[rank] = mp.Process(
                target=spawned_main, args=(args,), name=f"rtpcore-tp-rank{rank}", daemon=True
            )
        group = cls(world_size, processes, store)
        if threads is not None:
            group._saved_threads = torch.get_num_threads()
            torch.set_num_threads(threads)
        try:
            for proc in processes.values():
                proc.start()
            group._await_joined(start_timeout)
            group._start(factory, spec, store, device, timeout, idle_timeout, start_timeout)
        except BaseException as exc:
            group._fail(exc)
        return group

    @classmethod
    def join_env(
        cls,
        factory: Factory | None,
        spec: Any,
        *,
        plan: Any = None,
        device: str | None = "cpu",
        timeout: timedelta = DEFAULT_TIMEOUT,
        idle_timeout: timedelta = IDLE_TIMEOUT,
        start_timeout: timedelta = START_TIMEOUT,
    ) -> WorkerGroup | None:
        """``env://`` rendezvous (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE; what
        ``torchrun`` sets), for ranks on other machines or started by a launcher.

        On rank 0, returns the group; ``factory``, ``spec`` and ``plan`` are sent to
        the other ranks. On any other rank, this ignores its own ``factory``,
        ``spec`` and ``plan`` (pass None; see :func:`serve`), loads rank 0's plan,
        builds the local object, serves rank 0's steps until it closes the group,
        and returns None.

        ``start_timeout`` bounds the start (the rendezvous, joining the group, every
        rank building its local object), ``timeout`` each collective of every later
        step, as for :meth:`spawn`.
        """
        store, rank, world_size = env_store(start_timeout)
        if rank > 0:
            follow(store, rank, world_size, None, device, timeout, idle_timeout, start_timeout)
            return None
        if factory is None:
            raise RtpcoreError(
                "this process is RANK=0, which leads the group and must name what every rank "
                "builds: WorkerGroup.join_env(factory, spec); rtpcore.parallel.leader.serve() is for ranks > 0"
            )
        group = cls(world_size, {}, store)
        try:
            group._start(
                factory,
                spec,
                store,
                device,
                timeout,
                idle_timeout,
                start_timeout,
                send=(factory, spec, plan),
            )
        except BaseException as exc:
            group._fail(exc)
        return group

    def _start(
        self,
        factory: Factory,
        spec: Any,
        store: Any,
        device: str | None,
        timeout: timedelta,
        idle_timeout: timedelta,
        start_timeout: timedelta,
        send: tuple[Factory, Any, Any] | None = None,
    ) -> None:
        """Join the group, build rank 0's local object and wait for every follower's,
        each bounded by ``start_timeout``; then bound the store by ``timeout``."""
        self.context = init_parallel(
            store,
            0,
            self.world_size,
            device=device,
            timeout=timeout,
            idle_timeout=idle_timeout,
            start_timeout=start_timeout,
        )
        if send is not None:  # env:// followers learn what to build from us
            self.context.broadcast_object(send, timeout=start_timeout)
        self.local = resolve_factory(factory)(self.context, spec)
        self.context.barrier(timeout=start_timeout)  # every follower has built its local object
        store.set_timeout(timeout)  # the start is over: steps are bounded by the step timeout

    def _await_joined(self, start_timeout: timedelta) -> None:
        deadline = time.monotonic() + start_timeout.total_seconds()
        waiting = set(self._processes)
        while waiting:
            waiting = {r for r in waiting if not self._store.check([JOINED.format(r)])}
            for rank in sorted(waiting):
                if self._processes[rank].exitcode is not None:
                    raise _PeerGone(f"rank {rank} exited while starting")
            if time.monotonic() > deadline:
                raise WorkerError(
                    f"tensor-parallel rank {min(waiting)} did not start within {start_timeout} "
                    "(WorkerGroup start_timeout=...)",
                    rank=min(waiting),
                )
            time.sleep(0.01)

    # -- steps --------------------------------------------------------------------

    @property
    def pids(self) -> dict[int, int]:
        """Process id of each spawned follower rank."""
        return {r: p.pid for r, p in self._processes.items() if p.pid is not None}

    def run(
        self, method: str, payload: Any = None, *, gather: bool = False, sync: bool = True
    ) -> Any:
        """Run ``local.<method>(payload)`` on every rank; return rank 0's result, or
        with ``gather=True`` the list of every rank's result in rank order.

        With ``sync`` (the default) the call returns once every rank has finished
        the step, so a follower's failure in it is raised by this call. A step whose
        result on rank 0 already depends on every rank (one ending in a collective,
        like a model's forward) may pass ``sync=False`` to skip that acknowledgement;
        a follower failing after its last collective is then raised by the next call.

        With several ranks any failure breaks the group: a follower's failure raises
        WorkerError naming its rank; rank 0's own exception propagates; both tear the
        group down, and every later call raises WorkerError ("the worker group is
        broken"). With one rank, the step's exception propagates unchanged and the
        group stays usable (there is no peer to fall out of step with), interrupts
        included; only a device fault (see :func:`is_device_fault`) breaks it.
        """
        with self._lock:
            self._check_usable()
            if self.world_size == 1:
                return self._run_local(method, payload, gather)
            step = Step(method, payload, gather, sync)
            try:
                self.context.broadcast_object(step)
                result = execute(self.local, step, 0)
                if gather:
                    return self.context.gather_objects(result)
                if sync:
                    self.context.barrier()
                return result
            except BaseException as exc:
                self._fail(exc)

    def _run_local(self, method: str, payload: Any, gather: bool) -> Any:
        """A single rank's step: in this process, breaking the group on a device fault only."""
        try:
            result = getattr(self.local, method)(payload)
        except Exception as exc:
            if is_device_fault(exc):
                self._fail(exc)  # tears the group down and re-raises ``exc``
            raise
        return [result] if gather else result

    @property
    def failure(self) -> WorkerError | None:
        """Why the group can no longer step (a rank failed); None while it can."""
        return self._broken

    def debug_raise_on(self, rank: int, message: str = "debug fail point") -> None:
        """Test fail point: make follower ``rank`` raise RuntimeError(message) inside a step."""
        if not 0 < rank < self.world_size:
            raise ValueError(
                f"rank must be a follower rank in [1, {self.world_size}), got {rank!r}"
            )
        self.run(RAISE, (rank, message))

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise WorkerError(f"the worker group is broken: {self._broken}", rank=self._broken.rank)
        if self._closed:
            raise WorkerError("the worker group is closed")
        for rank, proc in self._processes.items():
            if proc.exitcode is not None:
                self._fail(_PeerGone(f"rank {rank} is gone"))

    # -- failure and shutdown ----------------------------------------------------------

    def _fail(self, exc: BaseException) -> Any:
        """Diagnose ``exc``, tear the group down and raise the right error.

        The teardown runs whatever the diagnosis does: when finding the failing
        rank fails too (the store is gone, an interrupt), the error says so.
        """
        error: WorkerError | None = None
        try:
            error = self._diagnose(exc)
        except Exception as diagnosis:
            logger.debug("diagnosing %r failed", exc, exc_info=True)
            error = WorkerError(
                f"the tensor-parallel group failed ({type(exc).__name__}: {exc}) and finding "
                f"the failing rank failed too ({type(diagnosis).__name__}: {diagnosis})",
                rank=None,
            )
            error.__cause__ = exc
        finally:
            self._broken = error or WorkerError(f"rank 0 failed: {type(exc).__name__}: {exc}", rank=0)
            self._teardown(graceful=False)
        if error is None:
            raise exc
        raise error

    def _diagnose(self, exc: BaseException) -> WorkerError | None:
        """The WorkerError that explains ``exc``, or None when rank 0 itself failed.

        A collective that failed on rank 0 means a peer failed: wait briefly for
        its report (it writes it before it exits) or for its process to end.
        """
        collective = isinstance(exc, CollectiveError) or (
            isinstance(exc, _PeerGone) and self.world_size > 1
        )
        if not collective:
            return None
        # A timeout means a peer is alive but silent: nothing more will arrive.
        timed_out = "timed out" in str(exc).lower()
        deadline = time.monotonic() + (0.0 if timed_out else _REPORT_GRACE_S)
        while True:
            reports = read_failures(self._store, self.world_size)
            dead = {r: p.exitcode for r, p in self._processes.items() if p.exitcode is not None}
            if reports or dead or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        if reports:
            _, rank, error = min(reports)
            return error
        if dead:
            rank = min(dead)
            return WorkerError(
                f"tensor-parallel rank {rank} {describe_exit(dead[rank])}",
                rank=rank,
                exitcode=dead[rank],
            )
        if timed_out:
            return WorkerError(
                f"no answer from the other ranks within the timeout: a rank is stuck or "
                f"slower than allowed (WorkerGroup timeout=...): {exc}",
                rank=None,
            )
        return WorkerError(f"rank 0 lost the other ranks: {exc}", rank=None)

    def _teardown(self, *, graceful: bool) -> None:
        self._closed = True
        if graceful and self.world_size > 1 and self.context.world_size > 1:
            try:
                self.context.broadcast_object(Step(STOP), timeout=timedelta(seconds=_STOP_GRACE_S))
            except Exception as exc:  # the followers are gone already: nothing to stop
                logger.debug("stop message not delivered: %s", exc)
        deadline = time.monotonic() + (_STOP_GRACE_S if graceful else 0.0)
        for proc in self._processes.values():
            if proc.pid is not None:
                proc.join(max(0.0, deadline - time.monotonic()))
        for rank, proc in self._processes.items():
            if proc.pid is not None and proc.exitcode is None:
                logger.debug("terminating tensor-parallel rank %d (pid %d)", rank, proc.pid)
                proc.kill()
                proc.join()
        self.local = None  # rank 0's model and KV cache go with the group
        try:
            self.context.destroy()
        finally:
            self._store = None
        if self._saved_threads is not None:
            torch.set_num_threads(self._saved_threads)
            self._saved_threads = None

    def close(self) -> None:
        """Stop every follower (killing those that do not exit), free the process
        groups; idempotent. No worker process outlives this call."""
        with self._lock:
            if not self._closed:
                self._teardown(graceful=self._broken is None)

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _close_at_exit(ref: weakref.ref[WorkerGroup]) -> None:
    group = ref()
    if group is not None:
        group.close()


# -- the follower side -------------------------------------------------------------


def serve(
    *,
    device: str | None = None,
    timeout: timedelta = DEFAULT_TIMEOUT,
    idle_timeout: timedelta = IDLE_TIMEOUT,
    start_timeout: timedelta = START_TIMEOUT,
) -> None:
    """Be rank RANK (> 0) of an ``env://`` group: build what rank 0 sends, follow its
    steps until it closes the group. ``python -m rtpcore.parallel.leader`` calls this.

    ``device`` None follows rank 0: the group uses nccl only if every rank, rank 0
    included, asks for (or allows) CUDA and has a GPU of its own.
    """
    WorkerGroup.join_env(
        None,
        None,
        device=device,
        timeout=timeout,
        idle_timeout=idle_timeout,
        start_timeout=start_timeout,
    )


#: Messages of a RuntimeError raised after a fault that leaves the device unusable.
_DEVICE_FAULT_MARKERS = ("CUDA error", "device-side assert", "HIP error")
#: ...unless it is an out-of-memory error: the device is still usable.
_OUT_OF_MEMORY_MARKER = "out of memory"


def is_device_fault(exc: BaseException) -> bool:
    """True when ``exc``, or an exception in its chain of causes and contexts, is a
    device fault after which the device is unusable: a RuntimeError whose message
    says "CUDA error", "device-side assert" or "HIP error". Out-of-memory errors
    (``torch.cuda.OutOfMemoryError``, a "CUDA error: out of memory") are recoverable
    and are not faults."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        err = todo.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, RuntimeError) and not isinstance(err, torch.cuda.OutOfMemoryError):
            message = str(err)
            if _OUT_OF_MEMORY_MARKER not in message and any(
                marker in message for marker in _DEVICE_FAULT_MARKERS
            ):
                return True
        todo += [err.__cause__, err.__context__]
    return False


def _cpu_threads(world_size: int, device: str | None, requested: int | None) -> int | None:
    """Torch threads per CPU rank: None leaves torch's default alone."""
    if requested is not None:
        if not isinstance(requested, int) or requested < 1:
            raise ValueError(f"num_threads must be a positive integer, got {requested!r}")
        return requested
    if device == "cuda" or os.environ.get("OMP_NUM_THREADS"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // world_size)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    serve()

"""How a failing tensor-parallel rank tells rank 0 what went wrong.

A follower that raises cannot answer over the process group: rank 0 may be
waiting in a different collective. So it writes a report (exception class name,
message, formatted traceback and, when it pickles, the exception itself) under
its own key in the rendezvous store, which rank 0 hosts, and exits; its closed
sockets break rank 0's pending collective at once. Rank 0 then reads the
reports and raises :class:`~rtpcore.errors.WorkerError` for the first failure
in time (a sequence number from the store orders them: a rank that fails
because a peer died reports later than the peer).

Reports are sealed with the engine's secret (``Rendezvous.put_object``) and
checked before anything in them is unpickled: a report that fails the check
(written into the store by some other process) becomes a WorkerError saying so,
and none of its bytes are unpickled.
"""

from __future__ import annotations

import inspect
import logging
import pickle
import signal
import sys
import traceback
from typing import TYPE_CHECKING

from rtpcore.errors import WorkerError
from rtpcore.parallel.sealing import BadSeal

if TYPE_CHECKING:
    from rtpcore.parallel.context import Rendezvous

__all__ = ["UNGUARDED_MAIN_EXIT", "describe_exit", "read_failures", "refuse_unguarded_main", "report_failure"]

logger = logging.getLogger(__name__)

_ERROR = "rtpcore/error/{}"
_ERROR_SEQ = "rtpcore/error-seq"


class RemoteTraceback(Exception):
    """A worker's formatted traceback, chained as the cause of its rebuilt exception."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0])


def report_failure(store: Rendezvous, rank: int, exc: BaseException) -> None:
    """Store rank's failure for rank 0; never raises (the store may be gone too)."""
    text = "".join(traceback.format_exception(exc))
    blob: bytes | None
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)  # some exceptions pickle but cannot be rebuilt
    except Exception:
        blob = None
    try:
        seq = store.add(_ERROR_SEQ, 1)
        record = (seq, type(exc).__qualname__, str(exc), text, blob)
        store.put_object(_ERROR.format(rank), record)
    except Exception as store_exc:  # rank 0 is gone too; our stderr is all that is left
        logger.error("rank %d could not report its failure: %s", rank, store_exc)


def read_failures(store: Rendezvous | None, world_size: int) -> list[tuple[int, int, WorkerError]]:
    """``(seq, rank, error)`` for each follower rank that reported a failure.

    ``error.__cause__`` is the worker's exception rebuilt here when possible,
    itself caused by a :class:`RemoteTraceback` holding the worker's traceback.
    A report that fails authentication is a WorkerError saying so, ordered after
    every authentic one.
    """
    if store is None:
        return []
    reports = []
    for rank in range(1, world_size):
        key = _ERROR.format(rank)
        if not store.check([key]):
            continue
        try:
            seq, type_name, message, text, blob = store.get_object(key)
        except BadSeal:
            forged = WorkerError(
                f"the failure report of tensor-parallel rank {rank} in the rendezvous store "
                f"({key!r}) failed authentication: it was not written by a rank of this "
                "engine, and was not unpickled",
                rank=rank,
            )
            reports.append((sys.maxsize, rank, forged))
            continue
        error = WorkerError(
            f"tensor-parallel rank {rank} failed: {type_name}: {message}",
            rank=rank,
            cause_type=type_name,
        )
        cause: BaseException = RemoteTraceback(text)
        if blob is not None:
            try:
                remote = pickle.loads(blob)
                remote.__cause__ = cause
                cause = remote
            except Exception:  # its class does not import here: the traceback still tells
                logger.debug("rank %d's exception could not be rebuilt here", rank)
        error.__cause__ = cause
        reports.append((seq, rank, error))
    return reports


#: The exit status of a spawned rank that found itself re-running the parent's main script
#: at import, where that script builds an engine (:func:`refuse_unguarded_main`).
UNGUARDED_MAIN_EXIT = 86


def unguarded_main_script() -> str | None:
    """The file of the main script this process is importing again as a spawned child, when
    the import itself is what is starting an engine's ranks; None otherwise.

    Python's ``spawn`` start method runs the parent's main script in every child it starts,
    as module ``__mp_main__``: its top-level code runs again there, and code under
    ``if __name__ == "__main__":`` does not. A frame of ``__mp_main__``'s top level on the
    stack means that top level is building an engine."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_globals.get("__name__") == "__mp_main__" and frame.f_code.co_name == "<module>":
            return frame.f_code.co_filename
        frame = frame.f_back
    return None


def refuse_unguarded_main() -> None:
    """In a spawned child re-running an unguarded main script: say so on stderr and exit
    with :data:`UNGUARDED_MAIN_EXIT`, which rank 0 names (:func:`describe_exit`), instead
    of starting ranks of its own."""
    script = unguarded_main_script()
    if script is not None:
        print(f"rtpcore: {unguarded_main_advice(script)}", file=sys.stderr, flush=True)
        raise SystemExit(UNGUARDED_MAIN_EXIT)


def unguarded_main_advice(script: str | None) -> str:
    where = f"the script {script!r}" if script else "the main script"
    return (
        f"{where} builds a tensor-parallel engine when it is imported; every rank is a process "
        "started with the 'spawn' method, which imports the main script again. Put the code that "
        "builds the engine under `if __name__ == \"__main__\":`"
    )


def describe_exit(code: int) -> str:
    """``"was killed by signal SIGKILL"`` / ``"exited with status 1"`` (with the advice of
    :func:`unguarded_main_advice` for :data:`UNGUARDED_MAIN_EXIT`)."""
    if code == UNGUARDED_MAIN_EXIT:
        main = sys.modules.get("__main__")
        return f"exited at start: {unguarded_main_advice(getattr(main, '__file__', None))}"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"

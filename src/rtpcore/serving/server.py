"""The HTTP server under the app: uvicorn, with the connection rules and the shutdown of
docs/design.md §22.

uvicorn serves the app; :class:`Server` and the protocol class of :func:`protocol_class` add
what an operator needs from a server facing clients it does not control:

- **Connections that never send a request** are closed: a connection whose request headers
  are not complete ``header_timeout`` seconds after it opened (or after its previous response
  ended) is closed without an answer. uvicorn alone holds such connections forever (it times
  out only idle keep-alive connections, after a response); a few hundred of them are a
  slowloris. A request whose headers have come is never cut by this rule, however long it runs.
- **Clients that stop reading** are cut off: a connection whose writes have been held back
  (the transport's buffer over its high-water mark: the client reads nothing) for
  ``stream_idle_timeout`` seconds is aborted, its buffered bytes dropped; the request it was
  answering sees the client gone, so a stream's engine requests are aborted and their KV blocks
  freed. Until then a stream's requests are paused once its unsent bytes pass
  ``--stream-buffer-bytes`` (``rtpcore.serving.streaming``): such a client costs a bounded
  buffer and no compute.
- **How many connections** are open is what the app's guard reads to refuse requests past
  ``--max-connections`` with a 503 (``/health`` always answered): :attr:`Server.open_connections`.
- **Shutdown** (SIGTERM, SIGINT, or the engine broken): the app stops taking requests (503), the
  requests running get ``drain_timeout`` seconds to finish, and then every one still running is
  cut: its engine requests are aborted, so each stream ends as a stream should -- a last chunk
  with ``finish_reason: "abort"`` and ``data: [DONE]`` -- and each non-streamed request answers
  with what it had, ``finish_reason: "abort"``. One log line says how many were cut. uvicorn's
  own timeout, which cancels the tasks of whatever is left (a client that reads nothing), is a
  backstop :data:`CUT_GRACE` seconds later.

The protocol is uvicorn's h11 one, extended: rtpcore always serves HTTP/1.1 through h11, also
where httptools is installed. It relies on two attributes of uvicorn's ``H11Protocol`` --
``cycle`` (the request being served, None before the first) and the cycle's
``response_complete`` -- which ``tests/test_serve_hardening.py`` checks by behaviour: a silent
connection is closed, a long stream on a connection is not.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["CUT_GRACE", "DEFAULT_HEADER_TIMEOUT", "DEFAULT_MAX_CONNECTIONS", "DEFAULT_STREAM_IDLE_TIMEOUT", "Server",
           "protocol_class"]

logger = logging.getLogger(__name__)

DEFAULT_HEADER_TIMEOUT = 10.0  # --header-timeout
DEFAULT_MAX_CONNECTIONS = 2048  # --max-connections
DEFAULT_STREAM_IDLE_TIMEOUT = 300.0  # --stream-idle-timeout
CUT_GRACE = 10.0  # after the cut, seconds the aborted requests get to write their last chunk


def protocol_class(header_timeout: float, stream_idle_timeout: float = DEFAULT_STREAM_IDLE_TIMEOUT) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request headers have not come
    ``header_timeout`` seconds after it opened or after its previous response, and aborting one
    whose client has read nothing of what was written for ``stream_idle_timeout`` seconds."""
    if not header_timeout > 0:
        raise ValueError(f"header_timeout must be > 0 seconds, got {header_timeout!r}")
    if not stream_idle_timeout > 0:
        raise ValueError(f"stream_idle_timeout must be > 0 seconds, got {stream_idle_timeout!r}")

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _write_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            self._disarm_write_timer()
            super().connection_lost(exc)

        # asyncio.Protocol's flow control: the transport calls these as its write buffer passes
        # its high-water mark and falls back under its low one.
        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_timer is None and not self.transport.is_closing():
                self._write_timer = self.loop.call_later(stream_idle_timeout, self._write_stalled)

        def resume_writing(self) -> None:
            self._disarm_write_timer()
            super().resume_writing()

        def _disarm_write_timer(self) -> None:
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _write_stalled(self) -> None:
            self._write_timer = None
            if self.transport.is_closing():
                return
            client = "{}:{}".format(*self.client) if self.client else "a client"
            logger.warning("aborting the connection of %s: it has read nothing of its answer for %g s "
                           "(--stream-idle-timeout); its requests are aborted", client, stream_idle_timeout)
            self.transport.abort()  # close() would wait to flush what the client does not read

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            if not self.transport.is_closing():
                self._header_timer = self.loop.call_later(header_timeout, self._header_timeout_expired)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout_expired(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a request is being served: its headers came in time
            client = "{}:{}".format(*self.client) if self.client else "a client"
            logger.debug("closing the connection of %s: no complete request headers within %g s "
                         "(--header-timeout)", client, header_timeout)
            self.transport.close()

    return HeaderTimeoutProtocol


class Server(uvicorn.Server):
    """uvicorn's server with the shutdown of this module's docstring. ``on_drain()`` runs
    when shutdown starts (the app refuses new requests from then on); ``on_cut()`` runs when
    ``drain_timeout`` seconds have passed with requests still running, aborts them and
    returns how many HTTP requests it cut."""

    def __init__(self, config: uvicorn.Config, *, drain_timeout: float, on_drain: Callable[[], None],
                 on_cut: Callable[[], int]):
        config.timeout_graceful_shutdown = drain_timeout + CUT_GRACE  # type: ignore[assignment]  # the backstop; uvicorn takes seconds as a float
        super().__init__(config)
        self.drain_timeout = drain_timeout
        self._on_drain = on_drain
        self._on_cut = on_cut

    @property
    def open_connections(self) -> int:
        """Connections open now, idle ones included."""
        return len(self.server_state.connections)

    async def shutdown(self, sockets: Any = None) -> None:
        self._on_drain()
        cut = asyncio.get_running_loop().call_later(self.drain_timeout, self._cut)
        try:
            await super().shutdown(sockets)
        finally:
            cut.cancel()

    def _cut(self) -> None:
        try:
            n = self._on_cut()
        except Exception:  # the shutdown goes on: uvicorn's backstop ends what is left
            logger.exception("cutting the running requests at shutdown failed")
            return
        if n:
            logger.warning("shutdown: %d request(s) still running after --shutdown-timeout %g s were cut; each "
                           "ends with finish_reason 'abort' (streams: a last chunk and [DONE])", n, self.drain_timeout)

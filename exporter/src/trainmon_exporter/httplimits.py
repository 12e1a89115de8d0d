"""Limits of the HTTP side: connections, slow clients, scrapes and API requests.

uvicorn (0.54, h11) gives ``limit_concurrency`` (past it, a new request is answered 503) and
``timeout_keep_alive`` (an idle connection *after* a response closes), but no timeout for a
request head that never completes: a client that connects and sends half a request holds its
connection and file descriptor forever, and with ``limit_concurrency`` set, enough of them make
every request, ``/healthz`` included, a 503. :func:`protocol_class` adds what is missing, as a
subclass of uvicorn's own h11 protocol:

- **header timeout**: a connection must complete its request head within
  ``header_timeout`` seconds of connecting (or of its previous response); else it is closed.
- **eviction**: when a new connection brings the count to ``limit_concurrency``, the oldest
  connection with no request in progress (idle keep-alive, or half-sent) is closed to make
  room (``evicted``); when every other one has a request in progress, the one whose answer
  has waited longest for its client to read it goes (``unread``). A probe always gets in
  while slow clients only push each other out.
- **write timeout**: a response the client has not read for ``write_timeout`` seconds (the
  transport stayed paused over its buffer's high-water mark) aborts the connection and frees
  the buffered body: an unread answer cannot pin memory. The kernel's share is capped too
  (:data:`SEND_BUFFER_BYTES`).

Each close is counted in ``trainmon_http_connections_closed_total{reason}``.

``/metrics`` is never refused (:mod:`trainmon_exporter.scrapes`): scrapes share collections
and hold no slot, and the bodies kept for clients still reading are bounded by closing the
one read least recently (``unread``). The JSON API (``/api/v1/*``) and the status page
are bounded by :class:`RequestGate` (``http_max_concurrent_api``): past it a request gets 503
with ``Retry-After: 1`` at once, counted in ``trainmon_http_requests_refused_total{reason}``;
such a request holds its slot until its body is written (or the write timeout aborts the
connection), so the bodies held in memory, and the worker threads building them, are bounded.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.metrics_core import Metric
from starlette.responses import Response
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from trainmon_exporter import catalog

log = logging.getLogger("trainmon_exporter.http")

CLOSE_REASONS = ("header_timeout", "evicted", "write_timeout", "unread")
"""``reason`` values of ``trainmon_http_connections_closed_total``."""
REFUSE_REASONS = ("api_limit",)
"""``reason`` values of ``trainmon_http_requests_refused_total``."""
SEND_BUFFER_BYTES = 256 * 1024
"""Kernel send buffer of each HTTP connection (``SO_SNDBUF``, which also stops Linux growing
it to ``tcp_wmem``'s 4 MiB): what an unread response can leave in the kernel. The rest waits in
the transport, where the write timeout can free it. 256 KiB still moves 250 MB/s at a 1 ms
round trip."""
_LINGER_RESET = struct.pack("ii", 1, 0)
"""``SO_LINGER`` on, 0 s: ``close()`` sends a reset and frees the socket's buffers at once."""
CONNECTION = "trainmon.connection"
"""Extension (a key of a request's ``scope["extensions"]``) whose ``abort`` is a function
``abort(reason)`` that closes the request's connection at once, counted as ``reason`` (one of
:data:`CLOSE_REASONS`). Set by :func:`protocol_class`'s protocol; absent under another
server."""

AbortFn = Callable[[str], None]


class HttpStats:
    """Counters of the HTTP limits (thread-safe), exported by :meth:`collect`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.closed = dict.fromkeys(CLOSE_REASONS, 0)
        self.refused = dict.fromkeys(REFUSE_REASONS, 0)

    def close(self, reason: str) -> None:
        """Count a connection the exporter closed for ``reason``."""
        with self._lock:
            self.closed[reason] += 1

    def refuse(self, reason: str) -> None:
        """Count a request answered 503 for ``reason``."""
        with self._lock:
            self.refused[reason] += 1

    def collect(self) -> Iterable[Metric]:
        """Both counter families, every reason from 0."""
        closed = catalog.HTTP_CONNECTIONS_CLOSED.counter()
        refused = catalog.HTTP_REQUESTS_REFUSED.counter()
        with self._lock:
            for r, n in self.closed.items():
                closed.add_metric([r], float(n))
            for r, n in self.refused.items():
                refused.add_metric([r], float(n))
        return [closed, refused]


def protocol_class(
    header_timeout: float, write_timeout: float, stats: HttpStats
) -> type[asyncio.Protocol]:
    """Return uvicorn's h11 protocol with a header timeout, eviction and a write timeout.

    Pass it as ``uvicorn.Config(http=...)``; ``limit_concurrency`` comes from the config.
    Each request's scope carries the :data:`CONNECTION` extension.
    """

    class LimitedH11Protocol(H11Protocol):
        _opened = 0.0
        _paused_since: float | None = None  # loop time the transport last went over its mark
        _head_timer: asyncio.TimerHandle | None = None
        _write_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._opened = self.loop.time()
            sock = transport.get_extra_info("socket")
            if sock is not None:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
                    # asyncio sets TCP_NODELAY only on sockets made with proto IPPROTO_TCP, and
                    # the listening socket is made with 0: without it the body waits behind the
                    # head for the client's delayed ACK, ~40 ms on every keep-alive request.
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError:
                    pass
            self._arm_head_timer()
            self._evict_if_full()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_timers()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle:  # a request head arrived complete
                self._request_started()

        def on_response_complete(self) -> None:
            self._arm_head_timer()  # the next request's head is due within the timeout too
            cycle = self.cycle
            super().on_response_complete()
            if self.cycle is not cycle:  # a pipelined request started at once
                self._request_started()

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._paused_since is None:
                self._paused_since = self.loop.time()
            if self._write_timer is None:
                self._write_timer = self.loop.call_later(write_timeout, self._on_write_timeout)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._paused_since = None
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        # ------------------------------------------------------------------ helpers

        def _busy(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _request_started(self) -> None:
            self._cancel_head_timer()
            # The request's task is created but has not run yet: the app sees the extension.
            if self.cycle is not None:
                extensions = self.cycle.scope.setdefault("extensions", {})
                extensions[CONNECTION] = {"abort": self._abort}

        def _abort(self, reason: str) -> None:
            if self.transport.is_closing():
                return
            stats.close(reason)
            if reason == "unread":
                log.info(
                    "closed an HTTP connection: its answer waited unread while a newer "
                    "request needed the room"
                )
                self._reset()
            else:
                self.transport.abort()  # connection_lost frees the cycle

        def _reset(self) -> None:
            """Abort with a reset, which frees the kernel's buffer too.

            A plain close keeps unsent data queued behind a zero window until TCP gives up.
            """
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
                except OSError:
                    pass
            self.transport.abort()  # connection_lost frees the cycle

        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            self._head_timer = self.loop.call_later(header_timeout, self._on_head_timeout)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _cancel_timers(self) -> None:
            self._cancel_head_timer()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _on_head_timeout(self) -> None:
            self._head_timer = None
            if self._busy() or self.transport.is_closing():
                return
            stats.close("header_timeout")
            log.info("closed an HTTP connection: no complete request in %g s", header_timeout)
            self.transport.abort()

        def _on_write_timeout(self) -> None:
            self._write_timer = None
            if self.transport.is_closing() and not self.flow.write_paused:
                return
            stats.close("write_timeout")
            log.info("closed an HTTP connection: response unread for %g s", write_timeout)
            self._reset()

        def _evict_if_full(self) -> None:
            limit = self.config.limit_concurrency
            if limit is None:
                return
            live = [c for c in self.connections if not c.transport.is_closing()]
            excess = len(live) - (limit - 1)
            if excess <= 0:
                return
            others = [c for c in live if c is not self and isinstance(c, LimitedH11Protocol)]
            idle = sorted((c for c in others if not c._busy()), key=lambda c: c._opened)
            for victim in idle[:excess]:
                victim._abort("evicted")
            excess -= len(idle[:excess])
            # Every other connection has a request in progress: the answers waiting longest
            # for a client that does not read go next. Those being read stay.
            stalled = sorted(
                (c for c in others if c._busy() and c._paused_since is not None),
                key=lambda c: c._paused_since or 0.0,
            )
            for victim in stalled[: max(0, excess)]:
                victim._abort("unread")

    return LimitedH11Protocol


class RequestGate:
    """At most ``limit`` requests of one kind in progress (event-loop thread only).

    ``reason``: what a refusal is counted as (one of :data:`REFUSE_REASONS`).
    """

    def __init__(self, limit: int, stats: HttpStats, reason: str = "api_limit") -> None:
        if reason not in REFUSE_REASONS:
            raise ValueError(f"unknown refusal reason {reason!r}")
        self.limit = limit
        self.stats = stats
        self.reason = reason
        self.active = 0

    def enter(self) -> bool:
        """Take a slot; False (and counted) when all are taken."""
        if self.active >= self.limit:
            self.stats.refuse(self.reason)
            return False
        self.active += 1
        return True

    def leave(self) -> None:
        """Give a slot back."""
        self.active -= 1


BODY_CHUNK_BYTES = 64 * 1024
"""Size of the pieces a large body is sent in. uvicorn waits, before each piece, while the
client is not reading (the transport is over its high-water mark), so the response is in
progress until the client has taken its body (or the write timeout aborts the connection)."""


class ChunkedResponse(Response):
    """A response sent in :data:`BODY_CHUNK_BYTES` pieces that says when it is done.

    Sent whole, a body would be handed to the transport at once and the response be complete
    while the body still waits in memory for a client that does not read. Subclasses say what
    happens after each piece (:meth:`sent`), whether to stop early (:meth:`stopped`), and what
    to give back at the end, also when the client went away (:meth:`done`).
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send in pieces, then :meth:`done`."""
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            body = self.body
            n = len(body)
            for i in range(0, max(n, 1), BODY_CHUNK_BYTES):
                if self.stopped():
                    break
                end = i + BODY_CHUNK_BYTES
                await send(
                    {"type": "http.response.body", "body": body[i:end], "more_body": end < n}
                )
                self.sent()
        finally:
            self.done()

    def stopped(self) -> bool:
        """True when the rest of the body is not to be sent (the connection was closed)."""
        return False

    def sent(self) -> None:
        """A piece was handed to the transport."""

    def done(self) -> None:
        """The response ended, complete or not."""


class GatedResponse(ChunkedResponse):
    """A response that gives its :class:`RequestGate` slot back once its body is written."""

    def __init__(self, gate: RequestGate, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = gate

    def done(self) -> None:
        """Give the slot back."""
        self.gate.leave()

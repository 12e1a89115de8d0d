"""The Unix-socket ingest server: accepts trainer connections and reads their packets.

Why this module is one module of about 850 lines: it is the socket server, whose parts (the
connection cap, per-tenant quota and fair share, the HELLO and idle deadlines, the EMFILE
back-off, the fair drain and the token bucket) share the server's connection table and event
loop, and are only correct together.
Everything about what a packet means is in :mod:`trainmon_exporter.apply`.

``asyncio.start_unix_server`` only speaks ``SOCK_STREAM``; trainmon uses ``SOCK_SEQPACKET``
(message boundaries kept, EOF the moment a trainer dies), so the server drives non-blocking
sockets directly (polled, or with ``loop.add_reader``).

Who connects: the kernel's ``SO_PEERCRED`` (pid, uid, gid), and on a Kubernetes node the
pod the process runs in (:mod:`trainmon_exporter.peers`, when a pod directory is set). A
connection's tenant is its pod's namespace where the node names one, else its uid
(:data:`~trainmon_exporter.state.rank.Tenant`).

Limits (each a setting, each refusal counted in ``trainmon_ingest_connections_refused_total``):
at most ``max_connections`` open connections (more are accepted and closed at once, so the
listen queue drains and the exporter keeps file descriptors for HTTP), and at most
``max_connections_per_uid`` of them from one tenant, so one user cannot take every slot from
the others. At the cap a tenant holding less than its fair share (the cap divided among the
tenants holding connections, itself included) takes a slot from the largest holder: its
oldest connection without a HELLO, else without a step since it connected, else its newest;
so a tenant that holds nothing always gets in. A HELLO within
``hello_timeout`` seconds of connecting; optionally an idle timeout; and when ``accept()`` fails
for lack of file descriptors (EMFILE, ENFILE) or memory, accepting pauses with an exponential
back-off instead of spinning on a listening socket that stays readable.

Fair draining: the drain works in rounds, and a round gives every open connection one turn,
whether or not its socket had data at its previous turn (in reader mode, every connection the
event loop found readable). A turn reads at most ``_TURN_PACKETS`` packets, and bytes up to a
budget that the connections of one tenant share (``_TURN_BYTES`` per tenant, at least
``_MIN_TURN_BYTES`` each), and each connection may deliver at most ``max_bytes_per_second`` (a
token bucket). The drain holds the event loop for at most ``_SLICE_S`` seconds plus one record:
no record starts after its slice's deadline, so a packet whose records take longer than a slice
to apply (a full 64 KiB packet of steps takes 15 to 30 ms) is applied over several turns, in
order. Between slices the drain lets the loop run everything else that is ready, for as long as
the loop has other work, a slice at most (serving one HTTP request takes several passes of the
loop, and a single ``sleep(0)`` gives it one). Connections sending valid packets flat out, one
or many, therefore never delay other trainers' packets by more than a round, nor ``/healthz``
by more than a slice or two; what they cannot deliver stays in their own socket buffers (their
clients count the drops). Accepting works in slices too: a new connection's first packet (its
HELLO) is read at once and the rest in the rounds, and a burst of accepts yields to the event
loop after ``_SLICE_S`` seconds.

The server only moves bytes: each packet read goes to :class:`~trainmon_exporter.apply.Applier`,
which applies its records to the :class:`~trainmon_exporter.state.store.Store`. Bad input never
raises out of here: every refused packet, record or value increments
``trainmon_ingest_messages_invalid_total{reason}`` or ``trainmon_ingest_values_dropped_total``.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import math
import resource
import select
import socket
import struct
import time
from collections.abc import Iterable
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge

from trainmon_client import _protocol as P
from trainmon_exporter import catalog
from trainmon_exporter.apply import (
    INTERNAL_ERROR,
    REFUSALS,
    Applier,
    Link,
    Packet,
    StampedCounter,
)
from trainmon_exporter.catalog import Family
from trainmon_exporter.peers import IDENTITIES, Peer, PeerResolver
from trainmon_exporter.sockfile import IngestSocket, SocketInUseError
from trainmon_exporter.state.rank import RankState, Tenant, describe_tenant, tenant_of
from trainmon_exporter.state.store import Store

__all__ = ["IngestMetrics", "IngestServer", "SocketInUseError"]

log = logging.getLogger("trainmon_exporter.ingest")

_ACCEPT_BURST = 64  # connections accepted per readable event of the listening socket
_TURN_PACKETS = 16
"""Packets read from one connection per turn before the next connection's turn."""
_TURN_BYTES = 128 * 1024
"""Bytes read from one connection per turn (about 10 ms of decoding at the ~80 ns per byte that
benchmarks/ingest.py measures)."""
_MIN_TURN_BYTES = 8 * 1024
"""Smallest byte budget of a turn, however many connections its tenant shares a round with."""
_SLICE_S = 0.005
"""Longest run of turns (s) before the drain yields to the event loop."""
_IDLE_PASS_S = 0.0002
"""A pass of the event loop that runs nothing but the drain takes less than this (s): an idle
pass costs tens of microseconds, and the smallest step of serving an HTTP request more."""
_ACCEPT_BACKOFF_MIN_S = 0.05
_ACCEPT_BACKOFF_MAX_S = 1.0
_FD_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
"""``accept()`` errors that mean "out of descriptors or memory": pause and retry later."""
FD_RESERVE = 64
"""File descriptors kept free beyond trainer connections and HTTP connections (listening
sockets, the lock file, NVML, log files, Python's own)."""
_RECV_BYTES = P.MAX_PACKET_BYTES + 1  # one byte more than allowed: a full read means oversized

EMPTY = "empty"
"""Reason of a zero-length packet (the connection stays open)."""
INVALID_REASONS = (*P.PROTOCOL_ERRORS, *REFUSALS, EMPTY, INTERNAL_ERROR)
"""``reason`` values of ``trainmon_ingest_messages_invalid_total`` (all exported from 0): the
protocol's errors, the refusals of :mod:`~trainmon_exporter.apply`, and two of this server's.
Built from the lists the exceptions check their reason against, so a reason raised is always
one of these. ``no_hello`` also counts each record that followed a refused HELLO in its packet
(the connection is closed after that packet); ``empty`` a zero-length packet (the connection
stays open); ``internal_error`` a record whose application raised an exception the exporter
did not foresee (logged with its traceback; the record is dropped, the rest of the packet
applies and the rank stays connected); ``name_cap`` counts NAME records past
:data:`~trainmon_exporter.apply.MAX_NAMES_PER_CONNECTION`; ``not_owner`` a HELLO from a uid
other than the one that opened the run; ``peer_not_allowed`` a HELLO from a process outside
``allowed_uids``/``allowed_gids``; ``series_budget`` a HELLO of a new rank when ``max_series``
is spent and no disconnected rank is left to evict."""
DROP_REASONS = (
    "unknown_field",
    "custom_cap",
    "layer_cap",
    "layer_rank",
    "unknown_hello_key",
    "operation_cap",
    "series_budget",
    "bad_counter",
    "unknown_stat",
    "label_rewritten",
    "pod_rewritten",
)
"""``reason`` values of ``trainmon_ingest_values_dropped_total``; ``pod_rewritten`` a HELLO's
pod name that is not the pod the node places its sender in (the node's name is kept);
``unknown_stat`` a LAYERS value under a stat code the protocol does not define;
``label_rewritten`` a HELLO value that becomes a label (hostname, GPU UUID, client version,
dtype) with characters outside :data:`~trainmon_exporter.apply.LABEL_CHARS`, kept with them
replaced; ``layer_rank`` counts layers of a rank outside ``layer_ranks``, analysed but not
exported as series; ``operation_cap`` operations (``Run.track``) past ``max_operations`` per
rank; ``series_budget`` values under a new name (custom metric, evaluation value, operation,
layer) refused because the exposition's series budget ``max_series`` is spent; ``bad_counter`` a
cumulative total of a STEP (tokens, samples, client overhead) that was NaN, infinite, negative
or lower than the previous one without a client restart: the total keeps its previous value."""
CONNECTION_REFUSALS = (
    "max_connections",
    "uid_quota",
    "fd_limit",
    "hello_timeout",
    "idle_timeout",
    "fair_share",
)
"""``reason`` values of ``trainmon_ingest_connections_refused_total``: ``max_connections``
(accepted and closed at once: the cap was reached and the connecting tenant holds its fair
share), ``uid_quota`` (accepted and closed at once: the connecting tenant already holds
``max_connections_per_uid``), ``fd_limit`` (one failed ``accept()``: EMFILE, ENFILE, ENOBUFS
or ENOMEM; accepting pauses), ``hello_timeout`` (closed: no HELLO in time), ``idle_timeout``
(closed: nothing received for ``ingest_idle_timeout_seconds``), ``fair_share`` (closed: the
cap was reached and a tenant below its fair share took this connection's slot, or the store
took its rank for one)."""
RECORD_TYPES = P.RECORD_NAMES


class IngestMetrics:
    """The exporter's own ingest counters (direct instruments on the app's registry).

    Names, HELP and labels are the catalog's ``INGEST_*`` rows.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(f: Family) -> Counter:
            assert f.type == catalog.COUNTER, f.name
            return Counter(f.name, f.help, f.labels, registry=registry)

        def gauge(f: Family) -> Gauge:
            assert f.type == catalog.GAUGE, f.name
            return Gauge(f.name, f.help, f.labels, registry=registry)

        self.packets = counter(catalog.INGEST_PACKETS)
        self.bytes = counter(catalog.INGEST_BYTES)
        self.messages = counter(catalog.INGEST_MESSAGES)
        self.invalid_total = counter(catalog.INGEST_MESSAGES_INVALID)
        invalid_at = gauge(catalog.INGEST_MESSAGES_INVALID_LAST_TIMESTAMP_SECONDS)
        self.invalid = StampedCounter(self.invalid_total, invalid_at)
        """What counts an invalid record: the counter, and the time of its last increment."""
        self.dropped_values = counter(catalog.INGEST_VALUES_DROPPED)
        self.connections_total = counter(catalog.INGEST_CONNECTIONS)
        self.connections = gauge(catalog.INGEST_OPEN_CONNECTIONS)
        self.refused_connections = counter(catalog.INGEST_CONNECTIONS_REFUSED)
        self.connection_limit = gauge(catalog.INGEST_MAX_CONNECTIONS)
        self.peer_identities = counter(catalog.INGEST_PEER_IDENTITIES)
        for t in RECORD_TYPES.values():
            self.messages.labels(t)
        for r in INVALID_REASONS:
            self.invalid_total.labels(r)  # the counter from 0; its time from the first one
        for r in DROP_REASONS:
            self.dropped_values.labels(r)
        self._refused = {r: self.refused_connections.labels(r) for r in CONNECTION_REFUSALS}
        self._invalid = {r: self.invalid.labels(r) for r in INVALID_REASONS}
        self._types = {k: self.messages.labels(v) for k, v in RECORD_TYPES.items()}


class Connection(Link):
    """One trainer connection: its socket, its read budget, and its :class:`Link`."""

    __slots__ = (
        "allowance",
        "closed",
        "fd",
        "last_mono",
        "opened_mono",
        "paused",
        "pending",
        "refilled_mono",
        "sock",
        "watched",
    )

    def __init__(
        self,
        sock: socket.socket,
        creds: tuple[int | None, int | None, int | None] | None = None,
        peer: Peer | None = None,
    ) -> None:
        super().__init__(
            *(creds if creds is not None else peer_credentials(sock)),
            peer_namespace=peer.namespace if peer is not None else "",
            peer_pod=peer.pod if peer is not None else "",
        )
        self.sock = sock
        self.fd = sock.fileno()
        self.opened_mono = self.last_mono = self.refilled_mono = time.monotonic()
        self.allowance = float(_TURN_BYTES)  # bytes it may still deliver (token bucket)
        self.paused = False  # reader mode: over its rate, not registered with the loop
        self.watched = False  # reader mode: registered with the event loop
        self.pending: Packet | None = None  # a packet read but not wholly applied yet
        self.closed = False


def turn_bytes(tenant_connections: int) -> int:
    """Byte budget of one turn of a connection whose tenant has ``tenant_connections`` open.

    A tenant's connections share :data:`_TURN_BYTES` per round (at least
    :data:`_MIN_TURN_BYTES` each), so a round costs about ``_TURN_BYTES`` per tenant plus one
    small turn per connection.
    """
    return max(_MIN_TURN_BYTES, _TURN_BYTES // max(1, tenant_connections))


def peer_credentials(sock: socket.socket) -> tuple[int | None, int | None, int | None]:
    """``(pid, uid, gid)`` of the connected process when it connected (``SO_PEERCRED``).

    The kernel fills these in at ``connect()``; the peer cannot choose them. They are in *this*
    process's namespaces: NVML reports host PIDs, so an exporter sharing the host's PID
    namespace sees the same PID even when the trainer runs in another container (whose own
    ``os.getpid()`` differs). Each is None where the kernel does not say (not Linux).
    """
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, gid = struct.unpack("3i", raw)
    except (OSError, AttributeError, struct.error):
        return None, None, None
    return (pid or None), uid, gid


_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13
_MAX_PEER_GROUPS = 256  # Python caps getsockopt buffers at 1,024 bytes


def peer_groups(sock: socket.socket) -> tuple[int, ...]:
    """Supplementary group ids of the connected process (``SO_PEERGROUPS``); () if unknown."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * _MAX_PEER_GROUPS)
    except OSError:  # ERANGE (more groups than asked for) or an old kernel
        return ()
    return struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4])


def connection_cap(requested: int, other_fds: int) -> int:
    """Trainer connections that fit the open-file limit, raising the soft limit if it helps.

    Every connection holds one descriptor. The soft ``RLIMIT_NOFILE`` is raised (up to the hard
    limit, as Go programs such as Prometheus do at start) to ``requested + other_fds +``
    :data:`FD_RESERVE`; if that does not fit, the cap is lowered so accepting trainers never
    leaves HTTP without descriptors, and a warning says so.

    Args:
        requested: ``ingest_max_connections``.
        other_fds: descriptors other users need (HTTP connections).

    Returns:
        The cap to use (at least 1).
    """
    need = requested + other_fds + FD_RESERVE
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < need:
            target = need if hard == resource.RLIM_INFINITY else min(need, hard)
            if target > soft:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
    except (OSError, ValueError):  # not permitted, or no such limit here
        return requested
    if soft == resource.RLIM_INFINITY or soft >= need:
        return requested
    cap = max(1, soft - other_fds - FD_RESERVE)
    log.warning(
        "ingest_max_connections %d lowered to %d: the open-file limit is %d (raise LimitNOFILE "
        "or ulimit -n to at least %d)",
        requested,
        cap,
        soft,
        need,
    )
    return cap


class IngestServer:
    """Listens on a ``SOCK_SEQPACKET`` Unix socket and feeds a :class:`Store`.

    Args:
        path: socket file to create (a stale one is replaced; a live one is an error).
        store: where rank state lives.
        metrics: ingest counters.
        mode: permissions of the socket file.
        poll_interval: seconds between drains of every connection (0: read on arrival).
        group: group id of the socket file (None: the default, see :mod:`.sockfile`).
        allowed_uids, allowed_gids: when either is non-empty, only processes whose uid is in
            ``allowed_uids`` or whose primary or supplementary group is in ``allowed_gids``
            may send a HELLO; others are refused (``peer_not_allowed``).
        listener: a socket already created by :meth:`IngestSocket.create` (the CLI creates
            it before serving HTTP, so start-up errors are one line); None creates it in
            :meth:`start`.
        max_connections: open connections at most; more are accepted and closed at once
            (``max_connections``).
        max_connections_per_uid: open connections of one tenant (its pod's namespace, else
            its uid: ``SO_PEERCRED`` at connect) at most; more of that tenant are accepted and
            closed at once (``uid_quota``). Every uid counts, root included (in containers
            without user namespaces, every root trainer is uid 0); a peer whose uid is
            unknown counts as one uid. None: no quota.
        hello_timeout: seconds a connection may stay open without a HELLO
            (``hello_timeout``).
        idle_timeout: seconds a connection with a HELLO may stay silent before it is closed
            (``idle_timeout``; the rank is marked disconnected, not crashed); 0: never.
        max_bytes_per_second: bytes one connection may deliver per second (token bucket);
            the rest waits in its socket buffer.
        peers: identifies each connection's pod (None: off Kubernetes, no look-up; every
            tenant is a uid).
    """

    def __init__(
        self,
        path: Path,
        store: Store,
        metrics: IngestMetrics,
        mode: int = 0o660,
        poll_interval: float = 0.1,
        *,
        group: int | None = None,
        allowed_uids: Iterable[int] = (),
        allowed_gids: Iterable[int] = (),
        listener: IngestSocket | None = None,
        max_connections: int = 1024,
        max_connections_per_uid: int | None = None,
        hello_timeout: float = 10.0,
        idle_timeout: float = 0.0,
        max_bytes_per_second: float = 4 * 2**20,
        peers: PeerResolver | None = None,
    ) -> None:
        self.path = path
        self.group = group
        self.allowed_uids = frozenset(allowed_uids)
        self.allowed_gids = frozenset(allowed_gids)
        self._listener = listener
        self.poll_interval = poll_interval
        self.max_connections = max_connections
        self.max_connections_per_uid = max_connections_per_uid or max_connections
        self.peers = peers
        # Each tenant's open connections, oldest first (the fair share picks from them).
        self._per_tenant: dict[Tenant, dict[int, Connection]] = {}
        self.hello_timeout = hello_timeout
        self.idle_timeout = idle_timeout
        self.rate = max_bytes_per_second
        # Burst a connection may deliver at once: one poll tick's worth, at least 2 turns.
        self.burst = max(2.0 * _TURN_BYTES, max_bytes_per_second * max(poll_interval, 0.1))
        self._tasks: list[asyncio.Task[None]] = []
        self.store = store
        self.metrics = metrics
        self.applier = Applier(store, metrics.invalid, metrics.messages, metrics.dropped_values)
        self.mode = mode
        self.listening = False
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conns: dict[int, Connection] = {}
        self._ready: dict[int, Connection] = {}  # connections the drain has yet to finish
        self._wake: asyncio.Event | None = None  # reader mode: set when one is ready
        self._accept_paused: asyncio.TimerHandle | None = None
        self._accept_backoff = _ACCEPT_BACKOFF_MIN_S
        metrics.connection_limit.set(max_connections)
        if peers is not None:
            for identity in IDENTITIES:
                metrics.peer_identities.labels(identity)

    # --------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Create the socket (unless given one) and serve it; call from the event loop's thread.

        Raises:
            SocketInUseError: a live exporter already listens on :attr:`path`.
            SocketSetupError: the socket cannot be created safely (one-line message).
        """
        self._loop = asyncio.get_running_loop()
        if self._listener is None:
            self._listener = IngestSocket.create(self.path, self.mode, self.group)
        sock = self._listener.sock
        self._sock = sock
        self._loop.add_reader(sock.fileno(), self._accept)
        if self.poll_interval > 0:
            self._tasks.append(self._loop.create_task(self._poll()))
        else:
            self._wake = asyncio.Event()
            self._tasks.append(self._loop.create_task(self._serve_readable()))
        self._tasks.append(self._loop.create_task(self._watch_timeouts()))
        self.listening = True
        log.info("ingest listening on %s", self.path)

    def close(self) -> None:
        """Stop accepting, close every connection (no crash is recorded) and unlink the file."""
        self.listening = False
        loop = self._loop
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        if self._accept_paused is not None:
            self._accept_paused.cancel()
            self._accept_paused = None
        for conn in list(self._conns.values()):
            self._close(conn, record=False)
        if self._sock is not None:
            if loop is not None:
                loop.remove_reader(self._sock.fileno())
            self._sock = None
        if self._listener is not None:
            self._listener.close()  # removes the file only if the path still is our socket
            self._listener = None

    def socket_problem(self) -> str | None:
        """Why trainers cannot reach this server through :attr:`path`, or None (``/readyz``)."""
        if not self.listening or self._listener is None:
            return "the ingest socket is not listening"
        return self._listener.problem()

    # --------------------------------------------------------------------------- I/O

    def _accept(self) -> None:
        """Accept up to :data:`_ACCEPT_BURST` connections, for at most :data:`_SLICE_S` s.

        The listening socket stays readable while connections wait, so the event loop calls
        this again after serving whatever else is ready (HTTP among it).
        """
        assert self._sock is not None and self._loop is not None
        end = time.perf_counter() + _SLICE_S
        for _ in range(_ACCEPT_BURST):
            if time.perf_counter() >= end:
                return
            try:
                sock, _addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _FD_ERRNOS:
                    self._pause_accepting(exc)
                else:  # ECONNABORTED and the like: that one connection is gone
                    log.warning("accept failed: %s", exc)
                return
            self._accept_backoff = _ACCEPT_BACKOFF_MIN_S
            creds = peer_credentials(sock)
            peer = self._identify(sock, creds[0])
            tenant = tenant_of(peer.namespace if peer is not None else "", creds[1])
            if len(self._conns) >= self.max_connections and not self._make_room(tenant):
                sock.close()  # the client sees EOF at once; the listen queue keeps draining
                self.metrics._refused["max_connections"].inc()
                log.warning(
                    "refused a trainer connection of %s: %d connections open "
                    "(ingest_max_connections), its fair share held",
                    describe_tenant(tenant),
                    len(self._conns),
                )
                continue
            held = len(self._per_tenant.get(tenant, ()))
            if held >= self.max_connections_per_uid:
                sock.close()  # the client sees EOF at once and retries with back-off
                self.metrics._refused["uid_quota"].inc()
                log.warning(
                    "refused a trainer connection of %s: it holds %d connections "
                    "(ingest_max_connections_per_uid)",
                    describe_tenant(tenant),
                    held,
                )
                continue
            sock.setblocking(False)
            conn = Connection(sock, creds, peer)
            conn.admitted = self._allowed(conn)  # the peer is fixed at connect()
            self._conns[conn.fd] = conn
            self._per_tenant.setdefault(conn.tenant, {})[conn.fd] = conn
            self.metrics.connections_total.inc()
            self.metrics.connections.inc()
            if self.poll_interval <= 0:
                self._watch(conn)
            # The HELLO is usually there already: read that one packet now, the rest in the
            # drain's rounds, so a burst of accepts costs the event loop one packet each.
            self._drain(conn, _MIN_TURN_BYTES, end, packets=1)
            if conn.pending is not None and not conn.closed and self.poll_interval <= 0:
                self._on_readable(conn)  # the rest of that packet is the drain's

    def _identify(self, sock: socket.socket, pid: int | None) -> Peer | None:
        """The pod of a new connection's process (None: no look-ups here), counted."""
        if self.peers is None:
            return None
        peer = self.peers.resolve(sock, pid)
        self.metrics.peer_identities.labels(peer.identity).inc()
        if peer.identity == "unknown_pod":
            log.warning(
                "a trainer (pid %s) runs in pod %s, which the kubelet's pod directory does not "
                "name: it is keyed by its uid",
                pid,
                peer.pod_uid,
            )
        return peer

    def _make_room(self, tenant: Tenant) -> bool:
        """At the cap: close a connection of the largest holder for ``tenant``, if it is owed one.

        ``tenant`` is owed a slot while it holds fewer than its fair share of
        ``max_connections`` (divided among the tenants holding connections, itself included)
        less one. The victim, of the tenant holding most: its oldest connection without a
        HELLO, else its oldest whose rank has not stepped since it connected, else its newest.
        Closed as ``fair_share``; a rank's client is told ``evicted``. O(tenants). No slot is
        freed for a tenant its quota then refuses: the cap is full only when the holders'
        quotas cover it, so a fair share is never above ``max_connections_per_uid``.
        """
        per_tenant = self._per_tenant
        fair = self.max_connections / (len(per_tenant) + (tenant not in per_tenant))
        if len(per_tenant.get(tenant, ())) + 1 > fair:
            return False
        largest = max(per_tenant, key=lambda t: len(per_tenant[t]))
        conns = per_tenant[largest]
        if largest == tenant or len(conns) <= fair:
            return False
        victim = next((c for c in conns.values() if c.state is None), None)
        if victim is None:
            victim = next((c for c in conns.values() if c.state and not c.state.stepping), None)
        if victim is None:
            victim = next(reversed(conns.values()))
        log.warning(
            "closed a trainer connection of %s (pid %s) for %s, below its fair share of "
            "ingest_max_connections",
            describe_tenant(largest),
            victim.peer_pid,
            describe_tenant(tenant),
        )
        self._refuse(victim, "evicted", idle=True)
        return True

    def _refuse(self, conn: Connection, reason: str, *, idle: bool = False) -> None:
        """Tell ``conn``'s trainer why (REFUSED: it has no other way to learn it), then close.

        ``evicted`` (its slot or its rank went to a tenant below its fair share) is counted as
        ``fair_share``, whichever path closes it.
        """
        if reason == "evicted":
            self.metrics._refused["fair_share"].inc()
        try:
            conn.sock.send(P.encode_refused(reason), socket.MSG_DONTWAIT)
        except (OSError, ValueError):
            pass  # a full buffer or a gone peer: the log still says why
        self._close(conn, record=False, idle=idle)

    def _pause_accepting(self, exc: OSError) -> None:
        """Out of descriptors: stop watching the listening socket for a while (no busy loop)."""
        assert self._sock is not None and self._loop is not None
        self.metrics._refused["fd_limit"].inc()
        delay = self._accept_backoff
        self._accept_backoff = min(delay * 2, _ACCEPT_BACKOFF_MAX_S)
        log.warning(
            "accept failed: %s (%d trainer connections open); pausing accepts for %.2f s",
            exc.strerror or exc,
            len(self._conns),
            delay,
        )
        self._loop.remove_reader(self._sock.fileno())
        self._accept_paused = self._loop.call_later(delay, self._resume_accepting)

    def _resume_accepting(self) -> None:
        self._accept_paused = None
        if self._sock is not None and self._loop is not None and self.listening:
            self._loop.add_reader(self._sock.fileno(), self._accept)

    async def _watch_timeouts(self) -> None:
        """Close connections past the HELLO deadline or the idle timeout (about 4 checks each)."""
        limits = [t for t in (self.hello_timeout, self.idle_timeout) if t > 0]
        period = min([1.0, *(t / 4 for t in limits)])
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for conn in list(self._conns.values()):
                if conn.state is None:
                    if self.hello_timeout > 0 and now - conn.opened_mono >= self.hello_timeout:
                        self.metrics._refused["hello_timeout"].inc()
                        log.warning(
                            "closed a trainer connection (pid %s, uid %s): no HELLO within %g s",
                            conn.peer_pid,
                            conn.peer_uid,
                            self.hello_timeout,
                        )
                        self._close(conn, record=False)
                elif conn.state.revoked:
                    # The store took its rank (for an owner claim, its namespace's pod, or a
                    # tenant below its fair share): a connection that sends nothing is told now.
                    self._refuse(conn, conn.state.revoked)
                elif self.idle_timeout > 0 and now - conn.last_mono >= self.idle_timeout:
                    self.metrics._refused["idle_timeout"].inc()
                    log.warning(
                        "closed the connection of run %s rank %d: silent for %g s",
                        conn.state.run_key,
                        conn.state.rank,
                        self.idle_timeout,
                    )
                    self._close(conn, record=False, idle=True)

    async def _poll(self) -> None:
        """Drain every connection each ``poll_interval`` seconds.

        Connections are deliberately not registered with the event loop: a client's send to a
        socket nobody sleeps on wakes no process, which is what keeps the flush inside the
        training loop cheap (measured in docs/performance.md). EOF (a dead trainer) is seen on
        the next tick.
        """
        while True:
            await asyncio.sleep(self.poll_interval)
            await self._drain_all()

    async def _drain_all(self) -> None:
        """Drain every open connection in rounds until a round finds nothing more to read."""
        await self._rounds(self._conns)

    async def _serve_readable(self) -> None:
        """Reader mode (``poll_interval`` 0): drain connections as they become readable."""
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._rounds(self._ready)

    async def _rounds(self, conns_of: dict[int, Connection]) -> None:
        """Drain ``conns_of`` in rounds until a round finds nothing more to read.

        ``conns_of`` is every open connection (poll mode: one whose socket was empty at its
        turn is read again next round) or, in reader mode, those the event loop found
        readable (one whose socket is empty goes back to being watched, and comes back when
        readable). A round gives each of them (those accepted meanwhile included) one turn,
        in order, whatever the others still hold: a connection whose turn ended on
        its budget is read again next round, so one that sends without pause cannot keep the
        others waiting for more than one round. The bytes of a turn are shared per tenant
        (:func:`turn_bytes`), so a tenant with many connections gets one tenant's share of a
        round, not one share per connection. No turn starts after its slice's deadline, and none
        goes on applying records past it (a large packet is applied over several turns), so
        the event loop waits at most about :data:`_SLICE_S` seconds plus one record; between
        slices the drain lets the loop run all its other work first (:meth:`_give_way`), so
        HTTP requests are served in between however much data is waiting.
        """
        slice_end = time.perf_counter() + _SLICE_S
        while conns_of:
            conns = list(conns_of.values())
            per_tenant = collections.Counter(c.tenant for c in conns)
            any_more = False
            for conn in conns:
                if time.perf_counter() >= slice_end:
                    await self._give_way()
                    slice_end = time.perf_counter() + _SLICE_S
                if conn.closed:
                    continue
                try:
                    more = self._drain(conn, turn_bytes(per_tenant[conn.tenant]), slice_end)
                except Exception:  # one bad connection must not stop the others
                    log.exception("ingest failed on a connection")
                    self._close(conn, record=True)
                    more = False
                if more:
                    any_more = True
                elif conns_of is self._ready:
                    self._rest(conn)
            if not any_more and conns_of is self._conns:
                return

    async def _give_way(self) -> None:
        """Yield to the event loop until one of its passes runs nothing but this drain.

        ``await asyncio.sleep(0)`` gives the loop one pass, and serving one HTTP request takes
        several (accept, read, the handler's task steps, write): after a slice of draining, the
        drain therefore yields again for as long as the pass it yielded to ran other work
        (took :data:`_IDLE_PASS_S` or more), for at most :data:`_SLICE_S` seconds. Under a
        flood the loop's other work thus goes first and ingest gets the rest, at least half;
        with nothing else to do the drain loses one empty pass (microseconds) per slice.
        """
        start = time.perf_counter()
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0)
            now = time.perf_counter()
            if now - before < _IDLE_PASS_S or now - start >= _SLICE_S:
                return

    def _watch(self, conn: Connection) -> None:
        """Reader mode: have the event loop call :meth:`_on_readable` when ``conn`` is."""
        assert self._loop is not None
        self._loop.add_reader(conn.fd, self._on_readable, conn)
        conn.watched = True

    def _on_readable(self, conn: Connection) -> None:
        """Reader mode: hand a readable connection to the drain (nothing is read here)."""
        if conn.watched and self._loop is not None:
            self._loop.remove_reader(conn.fd)
            conn.watched = False
        self._ready[conn.fd] = conn
        if self._wake is not None:
            self._wake.set()

    def _rest(self, conn: Connection) -> None:
        """Reader mode: ``conn`` has nothing more to read now: off the drain's list until it has.

        It is watched again, or, when over its rate, once its bucket has refilled one turn.
        """
        self._ready.pop(conn.fd, None)
        if conn.closed or self._loop is None:
            return
        if conn.allowance <= 0:
            conn.paused = True
            self._loop.call_later(_TURN_BYTES / self.rate, self._unpause, conn)
        else:
            self._watch(conn)

    def _unpause(self, conn: Connection) -> None:
        if not conn.closed and conn.paused and self._loop is not None:
            conn.paused = False
            self._watch(conn)

    def _drain(
        self,
        conn: Connection,
        turn: int = _TURN_BYTES,
        deadline: float = math.inf,
        packets: int = _TURN_PACKETS,
    ) -> bool:
        """One turn: apply at most ``packets`` packets or ``turn`` bytes, until ``deadline``.

        A packet left half applied by the previous turn is resumed first. The turn reads at
        least one packet when one is waiting and the connection is within its rate, whatever
        ``turn`` is, and applies at least one record; it starts no packet and no record after
        ``deadline`` (a :func:`time.perf_counter` time), leaving the rest of a packet for the
        next turn.

        Returns True when the turn ended on its budget or its deadline with more to do (a
        packet half applied, or allowance left: more may wait); False when the socket is empty,
        closed, or the connection is over its rate.
        """
        if conn.pending is not None and not self._apply(conn, conn.pending, deadline):
            return not conn.closed
        now = time.monotonic()
        conn.allowance = min(self.burst, conn.allowance + (now - conn.refilled_mono) * self.rate)
        conn.refilled_mono = now
        budget = min(float(turn), conn.allowance)
        got = False
        on_budget = True  # the turn ended on its budget or deadline, not on an empty socket
        for _ in range(packets):
            if conn.closed:
                return False
            if budget <= 0 or (got and time.perf_counter() >= deadline):
                break
            try:
                data = conn.sock.recv(_RECV_BYTES)
            except (BlockingIOError, InterruptedError):
                on_budget = False
                break
            except OSError as exc:
                if exc.errno != errno.ECONNRESET:
                    log.debug("recv failed: %s", exc)
                self._close(conn, record=True)
                return False
            if not data:
                if _peer_gone(conn.sock):
                    self._close(conn, record=True)
                    return False
                # A zero-length packet: SOCK_SEQPACKET delivers it as a 0-byte read, like EOF.
                self.metrics.packets.inc()
                self.metrics._invalid[EMPTY].inc()
                got = True
                budget -= 1
                conn.allowance -= 1
                continue
            got = True
            n = len(data)
            budget -= n
            conn.allowance -= n
            if not self.handle_packet(conn, data, deadline):
                conn.last_mono = now
                return not conn.closed
        if got:
            conn.last_mono = now
        return on_budget and not conn.closed and conn.allowance > 0

    def _close(self, conn: Connection, *, record: bool, idle: bool = False) -> None:
        """Close ``conn`` and update its rank.

        ``record``: the trainer went away (a crash unless it finished); ``idle``: the exporter
        closed a silent connection (disconnected, not crashed); neither: shutdown.
        """
        if conn.closed:
            return
        conn.closed = True
        if self._loop is not None and conn.watched:
            self._loop.remove_reader(conn.fd)
            conn.watched = False
        conn.sock.close()
        self._conns.pop(conn.fd, None)
        self._ready.pop(conn.fd, None)
        conn.pending = None
        held = self._per_tenant.get(conn.tenant)
        if held is not None:
            held.pop(conn.fd, None)
            if not held:
                del self._per_tenant[conn.tenant]
        self.metrics.connections.dec()
        if conn.state is not None:
            with self.store.lock:
                if record:
                    conn.state.disconnect(conn.finished)
                else:  # idle, or the exporter shutting down: not the trainer's fault
                    conn.state.closed_by_exporter(idle=idle)
            if record and not conn.finished:
                log.warning(
                    "run %s rank %d disconnected without finishing (crashed or killed)",
                    conn.state.run_key,
                    conn.state.rank,
                )

    def send_to(self, state: RankState, packet: bytes) -> str | None:
        """Send ``packet`` (a request of the exporter's) on the connection bound to ``state``.

        On the event loop's thread, never blocking. Returns None when the kernel took it,
        else why not (no connection, or its buffer is full).
        """
        for conn in self._conns.values():
            if conn.state is state and not conn.closed:
                try:
                    conn.sock.send(packet, socket.MSG_DONTWAIT)
                except OSError as exc:
                    return f"the rank's connection refused it ({exc.strerror or exc})"
                return None
        return "the rank has no connection"

    # --------------------------------------------------------------------------- packets

    def handle_packet(self, conn: Connection, data: bytes, deadline: float = math.inf) -> bool:
        """Count one packet and apply it, until ``deadline``; never raises.

        Public for benchmarks and tests. Returns True when the packet is done, False when its
        rest waits in ``conn.pending`` (see :meth:`_apply`).
        """
        m = self.metrics
        m.packets.inc()
        m.bytes.inc(len(data))
        return self._apply(conn, self.applier.begin(conn, data), deadline)

    def _apply(self, conn: Connection, packet: Packet, deadline: float) -> bool:
        """Apply ``packet`` until ``deadline``.

        Returns True when it is done (then ``conn`` is closed if the packet says so), False
        when the rest waits in ``conn.pending``.
        """
        if not self.applier.resume(conn, packet, deadline):
            conn.pending = packet
            return False
        conn.pending = None
        if packet.close:
            self._refuse(conn, conn.refusal or "bad_hello")
        return True

    def _allowed(self, conn: Connection) -> bool:
        """Whether the allow-lists (if any) admit the connected process to send a HELLO."""
        if not self.allowed_uids and not self.allowed_gids:
            return True
        if conn.peer_uid in self.allowed_uids or conn.peer_gid in self.allowed_gids:
            return True
        return bool(self.allowed_gids) and not self.allowed_gids.isdisjoint(peer_groups(conn.sock))


_HUP = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0x2000)


def _peer_gone(sock: socket.socket) -> bool:
    """Whether a 0-byte read was the end of the connection rather than an empty packet.

    ``SOCK_SEQPACKET`` reads both as ``b""``; only the peer's shutdown raises ``POLLHUP`` /
    ``POLLRDHUP``.
    """
    poller = select.poll()
    poller.register(sock, select.POLLIN | _HUP)
    try:
        events = poller.poll(0)
    except OSError:
        return True
    return any(ev & _HUP for _fd, ev in events)

"""The Unix-socket ingest server: accepts trainer connections and applies their packets.

``asyncio.start_unix_server`` only speaks ``SOCK_STREAM``; trainmon uses ``SOCK_SEQPACKET``
(message boundaries kept, EOF the moment a trainer dies), so the server drives non-blocking
sockets with ``loop.add_reader`` directly. Each readable event drains up to
``_BURST`` packets, so one busy rank cannot starve the others or the HTTP server.

Bad input never raises out of here: every refused packet, record or value increments
``trainmon_ingest_messages_invalid_total{reason}`` or ``trainmon_ingest_values_dropped_total``.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import struct
from collections.abc import Iterable
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from trainmon_client import _protocol as P
from trainmon_exporter.sockfile import IngestSocket, SocketInUseError
from trainmon_exporter.state import RankState, Store

__all__ = ["IngestMetrics", "IngestServer", "SocketInUseError"]

log = logging.getLogger("trainmon_exporter.ingest")

_BURST = 64
_POLL_BURST = 4096  # packets per connection per poll tick: far above any client's rate
_RECV_BYTES = P.MAX_PACKET_BYTES + 1  # one byte more than allowed: a full read means oversized

INVALID_REASONS = (
    "oversized",
    "truncated",
    "bad_magic",
    "unknown_version",
    "unknown_type",
    "malformed",
    "no_hello",
    "duplicate_hello",
    "bad_hello",
    "invalid_name",
    "duplicate_rank",
    "too_many_ranks",
    "name_cap",
    "not_owner",
    "peer_not_allowed",
)
"""``reason`` values of ``trainmon_ingest_messages_invalid_total`` (all exported from 0);
``name_cap`` counts NAME records past MAX_NAMES_PER_CONNECTION; ``not_owner`` a HELLO from a
uid other than the one that opened the run; ``peer_not_allowed`` a HELLO from a process outside
``allowed_uids``/``allowed_gids``."""
MAX_NAMES_PER_CONNECTION = 4096
"""Names one connection may bind (custom metrics, operations, layers): a memory bound. The
client binds at most 1,024 custom names plus its layers and operations."""
DROP_REASONS = ("unknown_field", "custom_cap", "layer_cap", "layer_rank", "unknown_hello_key")
"""``reason`` values of ``trainmon_ingest_values_dropped_total``; ``layer_rank`` counts layers
of a rank outside ``layer_ranks``, analysed but not exported as series."""
RECORD_TYPES = {
    P.HELLO: "hello",
    P.NAME: "name",
    P.STEP: "step",
    P.FINISH: "finish",
    P.EVAL: "eval",
    P.TRACK: "track",
    P.CHECKPOINT: "checkpoint",
    P.LAYERS: "layers",
}


def _printable(value: str, limit: int) -> str:
    if len(value) > limit or not value.isprintable():
        raise ValueError(f"must be at most {limit} printable characters")
    return value


class HelloMessage(BaseModel):
    """Validated HELLO record (keys: :data:`trainmon_client._protocol.HELLO_FIELDS`)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    run: str
    rank: int = Field(ge=0, le=1 << 20)
    local_rank: int = Field(ge=0, le=1 << 20)
    world_size: int = Field(ge=1, le=1 << 20)
    hostname: str = ""
    pid: int = Field(0, ge=0)
    client_version: str = ""
    gpu_uuid: str | None = None
    started_at: float = Field(0.0, allow_inf_nan=False)
    flops_per_token: float | None = Field(None, gt=0, allow_inf_nan=False)
    dtype: str = "bf16"

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        return _printable(v, 16).lower()

    @field_validator("run")
    @classmethod
    def _run(cls, v: str) -> str:
        if not P.valid_run_id(v):
            raise ValueError("invalid run id")
        return v

    @field_validator("hostname")
    @classmethod
    def _hostname(cls, v: str) -> str:
        return _printable(v, 253)

    @field_validator("client_version")
    @classmethod
    def _version(cls, v: str) -> str:
        return _printable(v, 64)

    @field_validator("gpu_uuid")
    @classmethod
    def _uuid(cls, v: str | None) -> str | None:
        return None if v is None else _printable(v, 96)


class IngestMetrics:
    """The exporter's own ingest counters (direct instruments on the app's registry)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.packets = Counter(
            "trainmon_ingest_packets",
            "Packets read from trainer sockets (one per client flush).",
            registry=registry,
        )
        self.bytes = Counter(
            "trainmon_ingest_bytes", "Bytes read from trainer sockets.", registry=registry
        )
        self.messages = Counter(
            "trainmon_ingest_messages",
            "Valid records applied, by record type (hello, name, step, finish).",
            ["type"],
            registry=registry,
        )
        self.invalid = Counter(
            "trainmon_ingest_messages_invalid",
            "Packets or records dropped as invalid, by reason (see docs/metrics.md).",
            ["reason"],
            registry=registry,
        )
        self.dropped_values = Counter(
            "trainmon_ingest_values_dropped",
            "Values of valid records that were dropped, by reason: unknown_field (no NAME for "
            "the id), custom_cap (over max_custom_metrics), layer_cap (over max_layers), "
            "layer_rank (layers of a rank outside layer_ranks: analysed, not exported), "
            "unknown_hello_key.",
            ["reason"],
            registry=registry,
        )
        self.connections_total = Counter(
            "trainmon_ingest_connections",
            "Trainer connections accepted on the Unix socket.",
            registry=registry,
        )
        self.connections = Gauge(
            "trainmon_ingest_open_connections",
            "Trainer connections open now.",
            registry=registry,
        )
        for t in RECORD_TYPES.values():
            self.messages.labels(t)
        for r in INVALID_REASONS:
            self.invalid.labels(r)
        for r in DROP_REASONS:
            self.dropped_values.labels(r)
        self._invalid = {r: self.invalid.labels(r) for r in INVALID_REASONS}
        self._types = {k: self.messages.labels(v) for k, v in RECORD_TYPES.items()}


class Connection:
    """One trainer connection and the names it bound."""

    __slots__ = (
        "capped",
        "closed",
        "fd",
        "finished",
        "names",
        "peer_gid",
        "peer_pid",
        "peer_uid",
        "sock",
        "state",
    )

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.peer_pid, self.peer_uid, self.peer_gid = peer_credentials(sock)
        self.state: RankState | None = None
        self.names: dict[int, str] = {}
        self.finished = False
        self.closed = False


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
    ) -> None:
        self.path = path
        self.group = group
        self.allowed_uids = frozenset(allowed_uids)
        self.allowed_gids = frozenset(allowed_gids)
        self._listener = listener
        self.poll_interval = poll_interval
        self._poller: asyncio.Task[None] | None = None
        self.store = store
        self.metrics = metrics
        self.mode = mode
        self.listening = False
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conns: dict[int, Connection] = {}

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
            self._poller = self._loop.create_task(self._poll())
        self.listening = True
        log.info("ingest listening on %s", self.path)

    def close(self) -> None:
        """Stop accepting, close every connection (no crash is recorded) and unlink the file."""
        self.listening = False
        loop = self._loop
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None
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
        assert self._sock is not None and self._loop is not None
        for _ in range(_BURST):
            try:
                sock, _addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: keep serving the others
                log.error("accept failed: %s", exc)
                return
            sock.setblocking(False)
            conn = Connection(sock)
            self._conns[conn.fd] = conn
            self.metrics.connections_total.inc()
            self.metrics.connections.inc()
            if self.poll_interval <= 0:
                self._loop.add_reader(conn.fd, self._readable, conn)
            else:
                self._readable(conn)  # the HELLO is usually there already

    async def _poll(self) -> None:
        """Drain every connection each ``poll_interval`` seconds.

        Connections are deliberately not registered with the event loop: a client's send to a
        socket nobody sleeps on wakes no process, which is what keeps the flush inside the
        training loop cheap (measured in docs/performance.md). EOF (a dead trainer) is seen on
        the next tick.
        """
        while True:
            await asyncio.sleep(self.poll_interval)
            for conn in list(self._conns.values()):
                try:
                    self._readable(conn, burst=_POLL_BURST)
                except Exception:  # one bad connection must not stop the others
                    log.exception("ingest failed on a connection")
                    self._close(conn, record=True)

    def _readable(self, conn: Connection, burst: int = _BURST) -> None:
        for _ in range(burst):
            if conn.closed:
                return
            try:
                data = conn.sock.recv(_RECV_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno != errno.ECONNRESET:
                    log.debug("recv failed: %s", exc)
                self._close(conn, record=True)
                return
            if not data:
                self._close(conn, record=True)
                return
            self.handle_packet(conn, data)

    def _close(self, conn: Connection, *, record: bool) -> None:
        if conn.closed:
            return
        conn.closed = True
        if self._loop is not None and self.poll_interval <= 0:
            self._loop.remove_reader(conn.fd)
        conn.sock.close()
        self._conns.pop(conn.fd, None)
        self.metrics.connections.dec()
        if conn.state is not None:
            with self.store.lock:
                if record:
                    conn.state.disconnect(conn.finished)
                else:  # exporter shutting down: not the trainer's fault
                    conn.state.connected = False
            if record and not conn.finished:
                log.warning(
                    "run %s rank %d disconnected without finishing (crashed or killed)",
                    conn.state.run,
                    conn.state.rank,
                )

    # --------------------------------------------------------------------------- parsing

    def handle_packet(self, conn: Connection, data: bytes) -> None:
        """Apply one packet; never raises. Public for benchmarks and tests."""
        m = self.metrics
        m.packets.inc()
        m.bytes.inc(len(data))
        counts: dict[int, int] = {}
        close = False
        with self.store.lock:
            try:
                for rtype, payload in P.iter_records(data):
                    outcome = self._record(conn, rtype, payload)
                    if outcome is _APPLIED:
                        counts[rtype] = counts.get(rtype, 0) + 1
                    elif outcome is _CLOSE:
                        close = True
                        break
            except P.ProtocolError as exc:
                m._invalid[exc.reason].inc()
        for rtype, n in counts.items():
            m._types[rtype].inc(n)
        if close:
            self._close(conn, record=False)

    def _record(self, conn: Connection, rtype: int, payload: memoryview) -> object:
        """Apply one record; returns ``_APPLIED``, ``_REFUSED`` or ``_CLOSE``.

        ``_REFUSED``: counted as invalid, the rest of the packet still applies. ``_CLOSE``:
        counted, and the connection must close (a HELLO that cannot be accepted).
        """
        try:
            if rtype == P.STEP:
                state = conn.state
                if state is None:
                    raise _Refused("no_hello")
                head, ids, values = P.decode_step(payload)
                unknown, capped = state.observe_step(
                    head,
                    ids,
                    values,
                    conn.names,
                    self.store.window_s,
                    self.store.max_custom_metrics,
                )
                if unknown:
                    self.metrics.dropped_values.labels("unknown_field").inc(unknown)
                if capped:
                    self.metrics.dropped_values.labels("custom_cap").inc(capped)
                return _APPLIED
            if rtype == P.NAME:
                if conn.state is None:
                    raise _Refused("no_hello")
                field_id, name = P.decode_name(payload)
                if not P.valid_name(name):
                    raise _Refused("invalid_name")
                if field_id not in conn.names and len(conn.names) >= MAX_NAMES_PER_CONNECTION:
                    raise _Refused("name_cap")
                conn.names[field_id] = name
                return _APPLIED
            if rtype == P.HELLO:
                return self._hello(conn, payload)
            if rtype in (P.EVAL, P.TRACK, P.CHECKPOINT, P.LAYERS):
                if conn.state is None:
                    raise _Refused("no_hello")
                return self._occasional(conn, conn.state, rtype, payload)
            if rtype == P.FINISH:
                if conn.state is None:
                    raise _Refused("no_hello")
                status, _when = P.decode_finish(payload)
                conn.state.finish(status)
                conn.finished = True
                return _APPLIED
            raise _Refused("unknown_type")
        except _Refused as exc:
            self.metrics._invalid[exc.reason].inc()
            return _CLOSE if exc.reason in _FATAL else _REFUSED
        except P.ProtocolError as exc:
            self.metrics._invalid[exc.reason].inc()
            return _CLOSE if rtype == P.HELLO else _REFUSED

    def _occasional(
        self, conn: Connection, state: RankState, rtype: int, payload: memoryview
    ) -> object:
        """EVAL, TRACK and CHECKPOINT records (rare: at most a few per minute)."""
        if rtype == P.LAYERS:
            (step, _when, checks, seconds), codes, ids, values = P.decode_layers(payload)
            names = [conn.names.get(i) for i in ids]
            export = state.rank in self.store.layer_ranks
            unknown, capped = state.observe_layers(
                names, codes, values, self.store.max_layers, export
            )
            if unknown:
                self.metrics.dropped_values.labels("unknown_field").inc(unknown)
            if capped:
                self.metrics.dropped_values.labels("layer_cap").inc(capped)
            if not export and len(names) > unknown + capped:
                self.metrics.dropped_values.labels("layer_rank").inc(len(names) - unknown - capped)
            state.ops["watch"] = [seconds, float(checks), 0.0]
            return _APPLIED
        if rtype == P.CHECKPOINT:
            step, when, seconds = P.decode_checkpoint(payload)
            state.checkpoint = (step, when, seconds)
            state.checkpoints_total += 1
            return _APPLIED
        if rtype == P.TRACK:
            field_id, active, seconds, count = P.decode_track(payload)
            name = conn.names.get(field_id)
            if name is None:
                self.metrics.dropped_values.labels("unknown_field").inc()
                return _REFUSED
            state.ops[name] = [seconds, float(count), 1.0 if active else 0.0]
            return _APPLIED
        step, _when, ids, values = P.decode_eval(payload)
        val_loss = None
        for fid, v in zip(ids, values, strict=True):
            if fid in (1, 6):  # loss or val_loss
                val_loss = v
                continue
            name = conn.names.get(fid)
            if name is None:
                self.metrics.dropped_values.labels("unknown_field").inc()
            elif (
                name in state.eval_values or len(state.eval_values) < self.store.max_custom_metrics
            ):
                state.eval_values[name] = v
            else:
                self.metrics.dropped_values.labels("custom_cap").inc()
        state.eval_step = step
        if val_loss is not None:
            state.eval_values["val_loss"] = val_loss
        state.analytics.observe_eval(val_loss)
        return _APPLIED

    def _allowed(self, conn: Connection) -> bool:
        """Whether the allow-lists (if any) admit the connected process."""
        if not self.allowed_uids and not self.allowed_gids:
            return True
        if conn.peer_uid in self.allowed_uids or conn.peer_gid in self.allowed_gids:
            return True
        return bool(self.allowed_gids) and not self.allowed_gids.isdisjoint(peer_groups(conn.sock))

    def _hello(self, conn: Connection, payload: memoryview) -> object:
        if conn.state is not None:
            raise _Refused("duplicate_hello")
        if not self._allowed(conn):
            log.warning(
                "refused a trainer of uid %s gid %s (pid %s): not in allowed_uids/allowed_gids",
                conn.peer_uid,
                conn.peer_gid,
                conn.peer_pid,
            )
            raise _Refused("peer_not_allowed")
        raw = P.decode_hello(payload)
        try:
            hello = HelloMessage.model_validate(raw)
        except ValidationError as exc:
            log.warning("refused HELLO: %s", exc.errors()[0].get("msg", "invalid"))
            raise _Refused("bad_hello") from None
        extra = sum(1 for k in raw if k not in HelloMessage.model_fields)
        if extra:
            self.metrics.dropped_values.labels("unknown_hello_key").inc(extra)
        result = self.store.attach(hello.model_dump(), conn.peer_uid)
        if isinstance(result, str):
            if result == "not_owner":
                owner = self.store.run_state(hello.run)
                log.warning(
                    "refused run %s rank %d from uid %s: the run belongs to uid %s",
                    hello.run,
                    hello.rank,
                    conn.peer_uid,
                    None if owner is None else owner.owner_uid,
                )
            else:
                log.warning("refused run %s rank %d: %s", hello.run, hello.rank, result)
            raise _Refused(result)
        conn.state = result
        result.peer_pid = conn.peer_pid
        # The client re-sends every NAME after HELLO; forget what an earlier connection bound.
        conn.names = {}
        return _APPLIED


class _Refused(Exception):
    def __init__(self, reason: str) -> None:
        self.reason = reason


_APPLIED = object()
_REFUSED = object()
_CLOSE = object()
_FATAL = frozenset(
    {"bad_hello", "duplicate_rank", "too_many_ranks", "not_owner", "peer_not_allowed"}
)
"""Refusals of a HELLO: the connection has no identity, so it is closed."""

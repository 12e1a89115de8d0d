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
import os
import socket
import stat
import struct
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from trainmon_client import _protocol as P
from trainmon_exporter.state import RankState, Store

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
)
"""``reason`` values of ``trainmon_ingest_messages_invalid_total`` (all exported from 0);
``name_cap`` counts NAME records past MAX_NAMES_PER_CONNECTION."""
MAX_NAMES_PER_CONNECTION = 4096
"""Names one connection may bind (custom metrics, operations, layers): a memory bound. The
client binds at most 1,024 custom names plus its layers and operations."""
DROP_REASONS = ("unknown_field", "custom_cap", "layer_cap", "unknown_hello_key")
"""``reason`` values of ``trainmon_ingest_values_dropped_total``."""
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

    __slots__ = ("capped", "closed", "fd", "finished", "names", "peer_pid", "sock", "state")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.peer_pid = _peer_pid(sock)
        self.state: RankState | None = None
        self.names: dict[int, str] = {}
        self.finished = False
        self.closed = False


def _peer_pid(sock: socket.socket) -> int | None:
    """The connected process's PID in *this* process's PID namespace (``SO_PEERCRED``).

    NVML reports host PIDs; an exporter sharing the host's PID namespace sees the same number
    even when the trainer runs in another container (whose own ``os.getpid()`` differs).
    """
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid = int(struct.unpack("3i", raw)[0])
    except (OSError, AttributeError, struct.error):
        return None
    return pid or None


class SocketInUseError(RuntimeError):
    """Another process is already listening on the socket path."""


class IngestServer:
    """Listens on a ``SOCK_SEQPACKET`` Unix socket and feeds a :class:`Store`.

    Args:
        path: socket file to create (a stale one is replaced; a live one is an error).
        store: where rank state lives.
        metrics: ingest counters.
        mode: permissions of the socket file.
    """

    def __init__(
        self,
        path: Path,
        store: Store,
        metrics: IngestMetrics,
        mode: int = 0o666,
        poll_interval: float = 0.1,
    ) -> None:
        self.path = path
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
        """Bind, chmod and listen; must be called from the running event loop's thread.

        Raises:
            SocketInUseError: a live exporter already listens on :attr:`path`.
            OSError: the directory cannot be created or written.
        """
        self._loop = asyncio.get_running_loop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._remove_stale()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.bind(os.fspath(self.path))
            os.chmod(self.path, self.mode)
            sock.listen(128)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
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
            self._sock.close()
            self._sock = None
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    def _remove_stale(self) -> None:
        try:
            st = self.path.lstat()
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise SocketInUseError(f"{self.path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            probe.connect(os.fspath(self.path))
        except OSError:
            self.path.unlink()  # nobody listens: a leftover of a killed exporter
            return
        finally:
            probe.close()
        raise SocketInUseError(f"another exporter is listening on {self.path}")

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
            unknown, capped = state.observe_layers(names, codes, values, self.store.max_layers)
            if unknown:
                self.metrics.dropped_values.labels("unknown_field").inc(unknown)
            if capped:
                self.metrics.dropped_values.labels("layer_cap").inc(capped)
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

    def _hello(self, conn: Connection, payload: memoryview) -> object:
        if conn.state is not None:
            raise _Refused("duplicate_hello")
        raw = P.decode_hello(payload)
        try:
            hello = HelloMessage.model_validate(raw)
        except ValidationError as exc:
            log.warning("refused HELLO: %s", exc.errors()[0].get("msg", "invalid"))
            raise _Refused("bad_hello") from None
        extra = sum(1 for k in raw if k not in HelloMessage.model_fields)
        if extra:
            self.metrics.dropped_values.labels("unknown_hello_key").inc(extra)
        result = self.store.attach(hello.model_dump())
        if isinstance(result, str):
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
_FATAL = frozenset({"bad_hello", "duplicate_rank", "too_many_ranks"})
"""Refusals of a HELLO: the connection has no identity, so it is closed."""

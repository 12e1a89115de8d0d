"""The connection to the exporter: connect, send without blocking, say what became of a packet.

Why this module is one module of about 510 lines: it is the one owner of the socket, and every
part (the backoff, the send outcomes, the read confirmation, the refusal, the words for a
connection that failed) reads or changes the same connection state.

A :class:`Transport` owns the ``SOCK_SEQPACKET`` socket and what only the connection knows: the
backoff schedule, the records sent on this connection and how many of them the exporter was
seen to read, and ``finish()``'s deadline. It keeps no count of the run's: every call says
what happened, and the run (``Run``) counts it in its totals (``Run.dropped``, ``Run.sent``).

Drop semantics, by :class:`Outcome` of :meth:`Transport.send`:

- ``SENT``: the kernel took the packet (``send`` with ``MSG_DONTWAIT``); the run counts its
  records as sent. It is *delivered* once the exporter has read it, which :meth:`check`
  confirms before each flush from the socket's unread byte count (``SIOCOUTQ``).
- ``BACKPRESSURE``: the socket buffer was full (``EAGAIN``, ``ENOBUFS``, ``EMSGSIZE``), or
  ``finish()`` waited for room until its deadline. The packet is dropped and the connection
  kept. If the packet carried NAME records, the run announces every name again.
- ``DISCONNECTED``: no connection, or the send failed for good (the connection is then
  closed). The packet is dropped. :meth:`connect` makes one lazily, at the next send after
  the backoff (0.1 s, doubling to 2 s after each failure): no listener, a missing directory,
  or with ``TRAINMON_EXPORTER_UID`` a listener of another uid, are all the same failure.
- *in flight*: when a connection ends (a failed send, or a hang-up that :meth:`check` sees),
  the records it carried that were never confirmed read are returned
  (:attr:`SendResult.in_flight`, :meth:`check`); so are those still unconfirmed at
  ``finish()``'s deadline (:meth:`await_read`). An upper bound of what an exporter that froze,
  died or restarted never read.

*Refused*: an exporter that refuses the connection's HELLO (another user's run id, a rank
already connected, a quota) sends one REFUSED packet saying why, then closes. When the
connection ends (a hang-up :meth:`check` sees, or a failed send), the transport reads what
is left to read: a refusal is kept (:attr:`Transport.refusal`) and logged once, with the
reason and what to do (:data:`REFUSAL_FIXES`).

*Requests*: a CAPTURE_REQUEST (the rank was judged hung) comes on a live connection. The
``poll()`` :meth:`check` makes for the hang-up also asks for readable data, and only then is
it read: requests are kept (:attr:`Transport.requests`) for the sender. ``log()`` never reads.

Only ``finish()`` waits: :meth:`start_deadline` sets the one deadline
(:data:`FINISH_TIMEOUT_S`) that its sends (``wait=``) and :meth:`await_read` share.

The clock of :meth:`connect`'s backoff is the caller's (``now``); the deadline's is this
module's ``time.perf_counter``.
"""

from __future__ import annotations

import enum
import errno
import fcntl
import grp
import logging
import math
import os
import select
import socket
import stat
import sys
import termios
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import NamedTuple

from trainmon_client import _env
from trainmon_client import _protocol as P
from trainmon_client._env import note

__all__ = [
    "BACKOFF_MAX_S",
    "BACKOFF_MIN_S",
    "FINISH_TIMEOUT_S",
    "REFUSAL_FIXES",
    "Outcome",
    "SendResult",
    "Transport",
    "expected_exporter_uid",
]

log = logging.getLogger("trainmon_client")

BACKOFF_MIN_S = 0.1
"""Seconds before the first reconnect attempt after a failure."""
BACKOFF_MAX_S = 2.0
"""Longest wait between reconnect attempts (the backoff doubles up to it)."""
FINISH_TIMEOUT_S = 1.0
"""Total time (s) ``finish()`` may wait for socket buffer space to deliver what is left and its
FINISH record, however many packets that is, and then for the exporter to read them; what
does not fit in time is dropped and counted (``backpressure``, ``in_flight``)."""
SEND_BUFFER_BYTES = 256 * 1024
"""``SO_SNDBUF`` the client asks for on each connection. Linux doubles it for its own
bookkeeping, within twice ``net.core.wmem_max`` (212,992 by default): 416 KiB to 512 KiB of
queued packets, against ``net.core.wmem_default``'s 208 KiB. That holds the first flush of
the busiest documented trainer (1,024 custom metrics at 43 steps a second queue about 220 KB
per 0.5 s, before the flusher knows the pace) and four of its later, paced ones
(``FLUSH_BURST_BYTES``), while the exporter reads every 0.1 s; measured in
docs/performance.md."""
_SEND_FLAGS = getattr(socket, "MSG_DONTWAIT", 0) | getattr(socket, "MSG_NOSIGNAL", 0)
_WAIT_FLAGS = _SEND_FLAGS & ~getattr(socket, "MSG_DONTWAIT", 0)
_OUTQ = getattr(termios, "TIOCOUTQ", 0x5411)  # SIOCOUTQ: bytes the peer has not read yet
_SKB_MIN_OVERHEAD = 384
"""Bytes a queued packet adds to ``SIOCOUTQ`` beyond its length, at least: the kernel counts
each one's buffer (``skb->truesize``: the data rounded up, plus ``struct sk_buff`` and
``skb_shared_info``, over 512 bytes on 64-bit Linux; measured 768 for a 100-byte packet)."""
_HUP = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0x2000)
MAX_REQUESTS = 4
"""Requests from the exporter kept unanswered at most (older ones are replaced)."""
_READS = 8  # packets read per check at most
# Python 3.9: a timed-out blocking send raises socket.timeout, not yet an alias of TimeoutError.
_FULL_ERRORS = (BlockingIOError, InterruptedError, TimeoutError, socket.timeout)
_perf = time.perf_counter

REFUSAL_FIXES: dict[str, tuple[str, str]] = {
    "not_owner": (
        "run id {run!r} belongs to another user",
        "pick another run id with init(run=...) or TRAINMON_RUN",
    ),
    "duplicate_rank": (
        "rank {rank} of run {run!r} is already connected",
        "give each process its own rank (init(rank=...), or the launcher's RANK), or another "
        "run id",
    ),
    "too_many_ranks": (
        "the exporter tracks as many ranks as its max_ranks setting allows",
        "let old runs finish and expire, or raise TRAINMON_MAX_RANKS on the exporter",
    ),
    "series_budget": (
        "the exporter's series budget is spent",
        "let old runs finish and expire, or raise TRAINMON_MAX_SERIES on the exporter",
    ),
    "uid_rank_quota": (
        "this user (this pod's namespace, on Kubernetes) has as many ranks as the exporter "
        "allows one",
        "finish other runs of this user, or ask the exporter's admin to raise the quota",
    ),
    "uid_series_quota": (
        "this user's (this pod's namespace's, on Kubernetes) series quota is spent",
        "finish other runs of this user, or ask the exporter's admin to raise the quota",
    ),
    "uid_quota": (
        "this user (this pod's namespace, on Kubernetes) holds as many connections as the "
        "exporter allows one",
        "end other processes of this user, or ask the exporter's admin to raise the quota",
    ),
    "evicted": (
        "the exporter gave this connection's slot to a user holding less than its fair share "
        "of the node, as this user holds more",
        "finish other runs of this user; the run resumes when a slot is free",
    ),
    "namespace_mismatch": (
        "the HELLO names a namespace that is not this pod's",
        "set POD_NAMESPACE from the downward API (fieldPath: metadata.namespace), or leave it "
        "unset",
    ),
    "peer_not_allowed": (
        "uid {uid} is not in the exporter's allowed_uids or allowed_gids",
        "ask the exporter's admin to allow this user (TRAINMON_ALLOWED_UIDS or "
        "TRAINMON_ALLOWED_GIDS)",
    ),
    "bad_hello": (
        "it could not validate this client's HELLO",
        "use a client of the exporter's version (trainmon-exporter --version)",
    ),
}
"""What a trainer is told for each reason of a REFUSED record: (what happened, the fix).
``{run}``, ``{rank}`` and ``{uid}`` are this process's. An unknown reason gets
:data:`REFUSAL_FIX_OTHER`."""
REFUSAL_FIX_OTHER = "the exporter's log says more"
"""The fix printed for a reason this client does not know."""


class Outcome(enum.Enum):
    """What became of one packet (see the module docstring for what the run counts)."""

    SENT = "sent"
    BACKPRESSURE = "backpressure"
    DISCONNECTED = "disconnected"


class SendResult(NamedTuple):
    """The result of :meth:`Transport.send`.

    Attributes:
        outcome: what became of the packet.
        in_flight: with ``DISCONNECTED`` after a failed send, the records the connection
            carried that were never confirmed read (0 otherwise).
    """

    outcome: Outcome
    in_flight: int = 0

    @property
    def resend_names(self) -> bool:
        """Whether the dropped packet may have held names (the run checks: ``carries_names``)."""
        return self.outcome is Outcome.BACKPRESSURE


_SENT = SendResult(Outcome.SENT)
_FULL = SendResult(Outcome.BACKPRESSURE)
_NO_CONNECTION = SendResult(Outcome.DISCONNECTED)


def expected_exporter_uid(env: Mapping[str, str], issues: list[str] | None = None) -> int | None:
    """``TRAINMON_EXPORTER_UID``: the uid the exporter must run as, or None (no check).

    A value that is not a uid (a non-negative integer) fails closed: -1, which no listener
    has, so nothing is sent (counted as ``disconnected``); one warning, noted in ``issues``.
    """
    value = env.get("TRAINMON_EXPORTER_UID", "").strip()
    if not value:
        return None
    if not value.isdigit():
        note(
            issues,
            "TRAINMON_EXPORTER_UID",
            f"TRAINMON_EXPORTER_UID={value[:60]!r} is not a uid (a non-negative integer); no "
            "listener is trusted, so metrics are dropped and counted until it is fixed",
        )
        return -1
    return int(value)


def _check_listener(sock: socket.socket, expected: int) -> None:
    """Refuse a listener that does not run as ``expected`` (its ``SO_PEERCRED`` uid).

    Raises:
        OSError: ``EPERM`` when it runs as another uid, ``ENOTSUP`` without ``SO_PEERCRED``
            (the caller drops and counts, as for any failed connect).
    """
    peercred = getattr(socket, "SO_PEERCRED", None)
    if peercred is None:  # not Linux: nothing to check with, so nothing is sent
        raise OSError(errno.ENOTSUP, "TRAINMON_EXPORTER_UID needs SO_PEERCRED (Linux)")
    raw = sock.getsockopt(socket.SOL_SOCKET, peercred, 12)
    uid = int.from_bytes(raw[4:8], sys.byteorder)
    if uid != expected:
        raise OSError(errno.EPERM, f"it runs as uid {uid}, not TRAINMON_EXPORTER_UID={expected}")


def _who(st: os.stat_result) -> str:
    """A file's owner, group and mode in words: ``uid 0, group trainmon (998), mode 0660``."""
    try:
        group = f"group {grp.getgrgid(st.st_gid).gr_name} ({st.st_gid})"
    except KeyError:  # a gid without a name here
        group = f"group {st.st_gid}"
    return f"uid {st.st_uid}, {group}, mode {stat.S_IMODE(st.st_mode):04o}"


def unreachable(path: str, exc: OSError, env: Mapping[str, str] | None = None) -> str:
    """Why a connection to ``path`` failed, in one line for the user, with what to do.

    Permission denied is never "no exporter": an exporter may well listen there, and the
    user needs the socket's (or its directory's) group, not to start one. Where nothing
    listens at the client's default path and that default left an ``/run/trainmon`` of no use
    to this user (:func:`trainmon_client._env.choose_socket`), the line says so.
    """
    tail = "metrics are dropped and counted until it connects"
    if exc.errno == errno.EACCES:
        where = path
        try:
            st = os.stat(path)
        except PermissionError:  # the directory does not let this user in
            where = os.path.dirname(path)
            try:
                st = os.stat(where)
            except OSError:
                st = None
        except OSError:
            st = None
        owner = f" ({_who(st)})" if st is not None else ""
        return (
            f"permission denied connecting to {path}: this user (uid {os.geteuid()}) may not "
            f"use {where}{owner}; an exporter may be listening there for other users. Ask its "
            "admin to add this user to the socket's group, or start your own exporter and set "
            f"TRAINMON_SOCKET to its socket; {tail}"
        )
    line = f"no exporter at {path} ({exc.strerror or exc})"
    choice = _env.choose_socket("client", env)
    if choice.path == path and choice.fallback:
        line += f": not {os.path.dirname(_env.DEFAULT_SOCKET)}, which {choice.fallback}"
    return f"{line}; {tail}"


def _grow_send_buffer(sock: socket.socket) -> None:
    """Ask for :data:`SEND_BUFFER_BYTES` of send buffer; keep the default if it is refused."""
    try:
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) < 2 * SEND_BUFFER_BYTES:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    except OSError:  # not permitted or not supported: the default buffer still works
        pass


class Transport:
    """One client's connection to the exporter's socket at ``path``; not thread-safe.

    Args:
        path: the exporter's Unix socket.
        exporter_uid: the uid the listener must run as (``TRAINMON_EXPORTER_UID``), or None.

    Attributes:
        sent_connection: data records handed to the kernel on this connection (0 again after
            every connect): TOTALS ``sent_connection`` before the next packet.
    """

    def __init__(
        self, path: str, exporter_uid: int | None = None, run_id: str = "", rank: int = 0
    ) -> None:
        self.path = path
        self.exporter_uid = exporter_uid
        self.run_id, self.rank = run_id, rank  # named in the refusal's warning
        self.refusal: P.Refusal | None = None
        """The last refusal the exporter sent (REFUSED), or None."""
        self.refusals = 0
        """Connections the exporter refused with a REFUSED record."""
        self._sock: socket.socket | None = None
        self._next_connect = 0.0
        self._backoff = BACKOFF_MIN_S
        self._warned = False
        self._deadline = math.inf
        self._no_outq = False  # SIOCOUTQ failed: nothing can be confirmed read
        self.sent_connection = 0
        self._confirmed = 0  # of sent_connection, records the exporter was seen to read
        # Packets sent since the last confirmation: (bytes, sent_connection after it).
        self._unconfirmed: deque[tuple[int, int]] = deque(maxlen=4096)
        self.requests: deque[P.CaptureRequest] = deque(maxlen=MAX_REQUESTS)
        """What the exporter asked of this connection (CAPTURE_REQUEST), oldest first."""
        self.requests_replaced = 0
        """Requests pushed out of :attr:`requests` by newer ones before they were taken."""

    @property
    def connected(self) -> bool:
        """Whether a connection is up (as far as the last send or check knows)."""
        return self._sock is not None

    def connect(self, now: float, hello: Callable[[], list[bytes]]) -> bool:
        """Connect, unless a failure's backoff runs past ``now``; send the ``hello()`` packets.

        Returns:
            True when connected. A failure logs a warning (once per run) and sets the backoff.
        """
        if now < self._next_connect:
            return False
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.setblocking(False)
            _grow_send_buffer(sock)
            sock.connect(self.path)
            if self.exporter_uid is not None:
                _check_listener(sock, self.exporter_uid)
            for packet in hello():
                sock.send(packet, _SEND_FLAGS)
        except OSError as exc:
            sock.close()
            self._next_connect = now + self._backoff
            self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
            if not self._warned:
                self._warned = True
                log.warning("trainmon: %s", unreachable(self.path, exc))
            return False
        self._backoff = BACKOFF_MIN_S
        self._sock = sock
        self.sent_connection = self._confirmed = 0
        self._unconfirmed.clear()
        return True

    def retry_now(self) -> None:
        """Let the next :meth:`connect` try at once, whatever the backoff (``finish()``)."""
        self._next_connect = 0.0

    def send(self, wire: bytes, n: int, now: float, wait: float | None = None) -> SendResult:
        """Send one packet that holds ``n`` data records; never raises ``OSError``.

        Args:
            wire: the whole packet, its TOTALS record included.
            n: its data records.
            now: the caller's clock, for the backoff should the connection end.
            wait: seconds to wait for buffer space (``finish()`` only); None: never wait.
        """
        sock = self._sock
        if sock is None:
            return _NO_CONNECTION
        flags = _SEND_FLAGS
        if wait is not None:
            sock.settimeout(wait)
            flags = _WAIT_FLAGS
        try:
            sock.send(wire, flags)
        except _FULL_ERRORS:
            return _FULL
        except OSError as exc:
            if exc.errno in (errno.ENOBUFS, errno.EMSGSIZE):
                return _FULL
            log.debug("trainmon_client: send failed (%s); reconnecting", exc)
            return SendResult(Outcome.DISCONNECTED, self._lose(now))
        self.sent_connection += n
        self._unconfirmed.append((len(wire), self.sent_connection))
        return _SENT

    def check(self, now: float) -> int:
        """Before a flush: note what the exporter has read, or notice that it went away.

        An empty send queue (``SIOCOUTQ``) while the peer is still there means the exporter
        has read every packet sent so far. The queue is read *before* the hang-up check: the
        kernel flags the hang-up before it discards the queue, so a 0 seen on a live socket
        is never a discarded queue.

        Returns:
            The records lost in flight when the connection turned out to be gone, else 0.
        """
        sock = self._sock
        if sock is None:
            return 0
        try:
            raw = fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0")
            outq = int.from_bytes(raw, sys.byteorder, signed=True)
        except OSError:  # a kernel without SIOCOUTQ on Unix sockets: nothing is confirmed
            outq = -1
            self._no_outq = True
        try:
            poller = select.poll()
            poller.register(sock, _HUP | select.POLLIN)
            events = 0
            for _fd, ev in poller.poll(0):
                events |= ev
            gone = bool(events & _HUP)
        except OSError:
            gone = True
        if gone:
            return self._lose(now)
        if events & select.POLLIN:
            self._read_requests(sock)
        if outq == 0:
            self._confirmed = self.sent_connection
            self._unconfirmed.clear()
        elif outq > 0:
            # The unread packets are the newest, and each holds at least its length plus
            # _SKB_MIN_OVERHEAD of the queue's bytes (the kernel counts buffer sizes): every
            # packet older than the newest ones whose minimum sizes add up past ``outq`` has
            # been read.
            q = self._unconfirmed
            acc = 0
            for i in range(len(q) - 1, -1, -1):
                acc += q[i][0] + _SKB_MIN_OVERHEAD
                if acc > outq:
                    self._confirmed = q[i][1]
                    for _ in range(i + 1):
                        q.popleft()
                    break
        return 0

    def _read_requests(self, sock: socket.socket) -> None:
        """Read what the exporter sent on a live connection; keep its requests. Never blocks."""
        for _ in range(_READS):
            try:
                data = sock.recv(P.MAX_PACKET_BYTES, socket.MSG_DONTWAIT)
            except OSError:  # nothing more (EAGAIN), or an error the next check sees
                return
            if not data:
                return
            refusal = P.decode_refused(data)
            if refusal is not None:  # not sent on a live connection, but should one come
                self._refused(refusal)
            for request in P.decode_capture_requests(data):
                if len(self.requests) == self.requests.maxlen:
                    self.requests_replaced += 1
                self.requests.append(request)

    def start_deadline(self) -> None:
        """Start ``finish()``'s one deadline, :data:`FINISH_TIMEOUT_S` from now."""
        self._deadline = _perf() + FINISH_TIMEOUT_S

    def time_left(self) -> float:
        """Seconds to ``finish()``'s deadline (infinite before :meth:`start_deadline`)."""
        return self._deadline - _perf()

    def await_read(self) -> int:
        """``finish()``: wait until the exporter has read everything sent, or the deadline.

        Returns:
            The records not seen read by then, or carried by a connection that ended
            meanwhile (``in_flight``): an exporter that is frozen (or about to die) would lose
            them with no one the wiser. 0 when the kernel cannot tell (no ``SIOCOUTQ``).
        """
        lost = 0
        while self._sock is not None and self._confirmed < self.sent_connection:
            if self._no_outq:
                return lost
            if _perf() >= self._deadline:
                lost += self.sent_connection - self._confirmed
                self._confirmed = self.sent_connection
                self._unconfirmed.clear()
                return lost
            time.sleep(0.001)
            lost += self.check(_perf())
        return lost

    def close(self) -> None:
        """Close the socket (the next send connects again)."""
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None

    def _read_refusal(self) -> None:
        """Read what the ended connection left to read: a REFUSED packet is kept and logged.

        Never blocks. The first read may report ``ECONNRESET`` (the exporter closed with our
        packets unread) before the packets queued for us: it reads on.
        """
        sock = self._sock
        if sock is None:
            return
        for _ in range(4):
            try:
                data = sock.recv(P.MAX_PACKET_BYTES, socket.MSG_DONTWAIT)
            except ConnectionResetError:
                continue
            except OSError:
                return
            if not data:
                return
            refusal = P.decode_refused(data)
            if refusal is not None:
                self._refused(refusal)
                return

    def _refused(self, refusal: P.Refusal) -> None:
        first = self.refusal is None
        self.refusal = refusal
        self.refusals += 1
        if not first:
            return
        what, fix = REFUSAL_FIXES.get(refusal.reason, ("", REFUSAL_FIX_OTHER))
        what = what.format(run=self.run_id, rank=self.rank, uid=os.geteuid())
        detail = "; ".join(x for x in (what, refusal.detail) if x)
        log.warning(
            "trainmon: the exporter at %s refused this run (%s%s); %s",
            self.path,
            refusal.reason,
            f": {detail}" if detail else "",
            fix,
        )

    def abandon(self) -> None:
        """Forget the socket without closing it: a forked child's, which the parent owns."""
        self._sock = None

    def _lose(self, now: float) -> int:
        """The connection ended: read a refusal, close, back off; the records never seen read."""
        lost = self.sent_connection - self._confirmed
        self.sent_connection = self._confirmed = 0
        self._unconfirmed.clear()
        self._read_refusal()
        self.close()
        self._next_connect = now + self._backoff
        return lost

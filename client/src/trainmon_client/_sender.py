"""A run's sender: the flusher thread, and the way from the queue ``log()`` fills to the socket.

A :class:`Sender` belongs to one run (``Run``, known here as a :class:`SendingRun`) and owns
what lies between the run's queue and the exporter: the
:class:`~trainmon_client._encoder.Encoder`, the :class:`~trainmon_client._transport.Transport`,
the flusher thread and the lock that wakes it.

- **The flush** (:meth:`Sender.flush`): apply the device copies that landed, note what the
  exporter has read, encode the queued steps and any rare record, send the packets, count
  what became of each.
- **The flusher thread** (:meth:`Sender.loop`): asleep on :attr:`Sender.wake` until ``log()``
  releases it or the interval passes, then one flush under the run's lock, paced by
  :data:`FLUSH_BURST_BYTES`.
- **HELLO** (:meth:`Sender.hello_packets`): the run's identity, sent first on every
  connection.
- **The last flush** (:meth:`Sender.send_finish`): ``finish()``'s packets and FINISH record
  within the transport's one deadline.
- **The fork guard**: a forked child never sends the parent's steps (:meth:`Sender.prepare`)
  nor touches its socket (:meth:`Sender.abandon`).

What the exporter sends back comes on the same connection: the transport reads it (REFUSED,
read once the connection ends, which :meth:`Transport.check` before each flush or a failed
send finds out; CAPTURE_REQUEST, read by the same check while the connection lives), and the
answer to it belongs here, on the flusher thread, off the training loop:

- **Requests** (:meth:`Sender.answer`): the exporter judged the rank hung and asks for its
  stacks and collective state; the flusher takes them (:func:`~trainmon_client._capture.capture`)
  outside the run's lock and sends one CAPTURE record back. The flusher looks for requests at
  every flush and at least every :data:`REQUEST_POLL_S` seconds (then without flushing), so a
  hung rank answers within a second or so whatever its ``flush_interval``.

The sender keeps no count: what it sends, drops and refuses is counted on its run, the one
owner of every total (docs/architecture.md), and it reads the run's queue, device copies and
identity as they are at each flush; :class:`SendingRun` lists all it touches. It works under
the run's lock (the flusher takes it; the run's methods call in holding it), and ``log()``
never calls it: the run keeps the attributes the hot path reads on itself, this sender's
:attr:`~Sender.wake` among them.

Clocks: ``_perf`` and ``_wall`` are read through these module globals at call time, as in
:mod:`~trainmon_client._run`; a test that puts steps on a fake clock replaces both modules'.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from typing import Any, Protocol

from trainmon_client import _protocol as P
from trainmon_client._capture import capture
from trainmon_client._device import Deferred, DeviceCopies, add_allocator_stats, torch_gpu_uuid
from trainmon_client._encoder import Encoder, carries_names
from trainmon_client._transport import Outcome, Transport
from trainmon_client._version import __version__

__all__ = ["FLUSH_BURST_BYTES", "MIN_FLUSH_WAIT_S", "REQUEST_POLL_S", "Sender", "SendingRun"]

log = logging.getLogger("trainmon_client")

FLUSH_BURST_BYTES = 96 * 1024
"""Bytes of packets one flush should hand the socket at most: a quarter of the smallest send
buffer the client gets (``SO_SNDBUF``, see :mod:`~trainmon_client._transport`), so the exporter,
reading every 0.1 s, empties it long before it fills. The flusher waits the time these take to
queue at the rate of its last flush (within ``flush_interval``)."""
MIN_FLUSH_WAIT_S = 0.02
"""Shortest wait between two flushes that :data:`FLUSH_BURST_BYTES` makes."""
MIN_CAPTURE_INTERVAL_S = 1.0
"""Shortest time between two captures: requests that come faster wait, and only the newest
of those waiting is answered (the exporter takes the answer to its latest request only)."""
REQUEST_POLL_S = 1.0
"""Longest the flusher sleeps before it looks for the exporter's requests: with a
``flush_interval`` of 0 (woken by ``log()`` only) or above this, it wakes this often to look,
and flushes only when a flush is due."""
_perf = time.perf_counter
_wall = time.time


class SendingRun(Protocol):
    """What a sender reads and counts on its run (``Run``): its whole contract with the run."""

    # Who the run is (HELLO); the sender fills in gpu_uuid when it was left to detect.
    run_id: str
    rank: int
    local_rank: int
    world_size: int
    socket_path: str
    flush_interval: float
    flops_per_token: float | None
    gpu_uuid: str | None
    dtype: str
    cuda_memory: bool
    namespace: str
    pod: str
    _detect_uuid: bool
    _started_at: float
    # Its state: closed, the lock every flush holds, the queue log() fills, the device copies.
    _closed: bool
    _lock: threading.RLock
    _pending: deque[tuple[Any, float, dict[str, Any]]]
    _waiting: deque[Deferred]
    _copies: DeviceCopies
    # Its counts: read into every TOTALS record, and counted here for what the sender does.
    _overhead: float
    _flush_seconds: float
    _sent_total: int
    _dropped_disconnected: int
    _dropped_backpressure: int
    _dropped_encode: int
    _dropped_in_flight: int
    _refused: int
    _internal_errors: int
    # The thread that calls log() (noted when it wakes the flusher): the capture's training
    # thread; and what became of the exporter's requests for a capture.
    _train_ident: int | None
    _captures_sent: int
    _captures_dropped: int


class Sender:
    """The encoder, the socket and the flusher thread of one run (see the module's text).

    Not thread-safe: its methods run under the run's lock, but :meth:`start` (the run's
    constructor), :meth:`loop` (which takes the lock to flush) and :meth:`abandon` (a forked
    child, where no other thread runs).

    Attributes:
        encoder: names, plans, totals and packets (the run builds its rare records with it).
        transport: the socket and what became of each packet.
        wake: held while no flush is asked for; releasing it (one C call, safe in a signal
            handler, unlike ``Event.set()``) wakes the flusher. The run keeps it as ``_wake``.
        pid: the process that built the run; in any other (a forked child) nothing is sent.
        thread: the flusher thread once :meth:`start` ran, None before and in a forked child.
    """

    def __init__(self, run: SendingRun, exporter_uid: int | None) -> None:
        self._run = run
        self.pid = os.getpid()
        self.transport = Transport(run.socket_path, exporter_uid, run_id=run.run_id, rank=run.rank)
        self.encoder = Encoder(lambda: self.transport.connected)
        self._resend_names = False
        self.wake = threading.Lock()
        self.wake.acquire()
        self.thread: threading.Thread | None = None
        self._last_capture = -MIN_CAPTURE_INTERVAL_S

    def start(self) -> None:
        """Start the flusher thread (by the run's constructor: never in a signal handler)."""
        self.thread = threading.Thread(
            target=self.loop, name=f"trainmon-flush-{self._run.rank}", daemon=True
        )
        self.thread.start()

    def loop(self) -> None:
        """The flusher thread: sleep until woken or ``flush_interval`` passes, then flush.

        It sleeps on the wake lock (no GIL held) and ends once the run is closed. With a
        ``flush_interval`` of 0 it only wakes when ``log()`` wakes it, once per step. The next
        sleep is the time :data:`FLUSH_BURST_BYTES` takes to queue at the rate of the last
        flush (bytes over the time since the one before), within :data:`MIN_FLUSH_WAIT_S` and
        ``flush_interval``: a trainer that logs many values a step sends them in bursts its
        socket's send buffer holds between two reads of the exporter, and one that logs a few
        still flushes once an interval.
        """
        run = self._run
        wake = self.wake
        interval = run.flush_interval if run.flush_interval > 0.0 else -1
        timeout = interval
        last = _perf()
        while not run._closed:
            wait = REQUEST_POLL_S
            if interval > 0:
                wait = min(max(timeout - (_perf() - last), 0.0), REQUEST_POLL_S)
            woken = wake.acquire(True, wait)
            sent = 0
            with run._lock:
                if run._closed:
                    return
                cpu0 = time.thread_time()
                now = _perf()
                due = woken or (interval > 0 and now - last >= timeout)
                try:
                    if due:
                        sent = self.flush(now)
                    elif self.transport.connected:  # only a look for the exporter's requests
                        run._dropped_in_flight += self.transport.check(now)
                except Exception:
                    run._internal_errors += 1
                    log.debug("trainmon_client: flush failed internally", exc_info=True)
                run._flush_seconds += time.thread_time() - cpu0
            if self.transport.requests:
                self.answer()
            if not due:
                continue
            if interval > 0:
                # The wait that lets FLUSH_BURST_BYTES queue at the rate of the last flush.
                timeout = interval
                if sent > 0 and now > last:
                    timeout = (now - last) * FLUSH_BURST_BYTES / sent
                    timeout = min(interval, max(MIN_FLUSH_WAIT_S, timeout))
            last = now

    def answer(self) -> None:
        """Answer the exporter's newest request for a capture with one CAPTURE packet.

        On the flusher thread. The capture (about :data:`~trainmon_client._capture.CPU_SAMPLE_S`
        plus its frames) runs outside the run's lock, so a ``log()``, ``eval()`` or
        ``track()`` of a rank that was only slow never waits for it; the send takes the lock.
        Its CPU time counts in the client's overhead. An answer that cannot be sent (no
        connection, a full buffer) is counted dropped and not retried: the exporter, which
        waits for it, says that none came. At most one capture per
        :data:`MIN_CAPTURE_INTERVAL_S`, for the newest request (older ones waiting are
        dropped): an exporter that asks without pause costs the trainer little.
        """
        run = self._run
        transport = self.transport
        if transport.requests and _perf() - self._last_capture >= MIN_CAPTURE_INTERVAL_S:
            request = transport.requests.pop()
            run._captures_dropped += len(transport.requests) + transport.requests_replaced
            transport.requests.clear()
            transport.requests_replaced = 0
            self._last_capture = _perf()
            cpu0 = time.thread_time()
            try:
                body = capture(run._train_ident, min(request.max_bytes, P.MAX_CAPTURE_BYTES))
                packet = P.packet_header() + P.encode_capture(request.request_id, body)
            except Exception:
                run._internal_errors += 1
                log.debug("trainmon_client: capture failed internally", exc_info=True)
                return
            with run._lock:
                run._flush_seconds += time.thread_time() - cpu0
                if run._closed:
                    return
                if transport.send(packet, 0, _perf()).outcome is Outcome.SENT:
                    run._captures_sent += 1
                else:
                    run._captures_dropped += 1

    def flush(self, now: float) -> int:
        """Encode what is pending and send it (or drop and count it); its bytes, sent or not.

        Never raises OSError.
        """
        packets = self.prepare(now)
        if not packets:
            return 0
        self.send_packets(packets, now)
        return sum(len(packet) for packet, _ in packets)

    def send_now(self, record: bytes, now: float) -> None:
        """Queue ``record`` after every pending step and flush at once (rare records)."""
        self.encode_steps()
        self.encoder.add(record, data=True)
        self.flush(now)

    def add_layers(
        self,
        step: int,
        names: list[str],
        codes: list[int],
        values: list[float],
        checks_total: int,
        seconds_total: float,
    ) -> None:
        """Queue the watcher's LAYERS record after every pending step (sent with the next flush).

        ``values``: the ``[layers, codes]`` table, flattened row by row.
        """
        ids, values, refused = self.encoder.layer_ids(names, codes, values)
        self._run._refused += refused
        self.encode_steps()
        record = P.encode_layers(step, _wall(), checks_total, seconds_total, ids, codes, values)
        self.encoder.add(record, data=True)

    def prepare(self, now: float, finish: int | None = None) -> list[tuple[bytes, int]] | None:
        """Apply landed device copies, check the connection, encode; the packets to send.

        ``finish``: a FINISH status, to wait for every copy and close with a FINISH record.
        None in a forked child, which never touches the parent's socket.
        """
        run = self._run
        if os.getpid() != self.pid:
            run._pending.clear()
            return None
        if run.cuda_memory and run._pending:
            add_allocator_stats(run._pending[-1][2])
        if run._waiting:
            run._copies.resolve(block=finish is not None)
        transport = self.transport
        if transport.connected:
            run._dropped_in_flight += transport.check(now)
        if self._resend_names and transport.connected:
            self._resend_names = False
            self.encoder.add_names()
        self.encode_steps()
        if finish is not None:
            self.encoder.add(P.encode_finish(finish, _wall()))
        return self.encoder.take_packets()

    def encode_steps(self) -> None:
        """Encode the steps ``log()`` queued (up to the first one waiting for device copies)."""
        run = self._run
        refused, failed = self.encoder.add_steps(
            run._pending,
            run._copies.owners,
            _wall() - _perf(),  # perf_counter -> Unix time, read once per flush
            run._overhead + run._flush_seconds,
            run._dropped_disconnected,
            run._dropped_backpressure,
            run._refused,
        )
        run._refused += refused
        run._dropped_encode += failed

    def send_packets(
        self, packets: list[tuple[bytes, int]], now: float, wait: bool = False
    ) -> None:
        """Send ``packets`` (each with its data-record count) in order; count what is lost.

        With ``wait`` (``finish()``), each send waits for room until the one deadline;
        whatever is left then is dropped as ``backpressure``.
        """
        run = self._run
        for i, (packet, n) in enumerate(packets):
            left = None
            if wait:
                left = self.transport.time_left()
                if left <= 0.0:
                    run._dropped_backpressure += sum(m for _, m in packets[i:])
                    return
            if not self.send(packet, n, now, left):
                run._dropped_disconnected += sum(m for _, m in packets[i + 1 :])
                return

    def send(self, packet: bytes, n: int, now: float, wait: float | None = None) -> bool:
        """Send one packet holding ``n`` data records with its TOTALS; False when disconnected.

        Connects first if needed. Counts the outcome (see :mod:`trainmon_client._transport`).
        ``wait``: seconds ``finish()`` may wait for room. The first packet on a connection
        this call opens never waits, as its HELLO did not: the buffer is empty, and waiting
        would only let an exporter that refuses the HELLO close the connection first (the
        packet is then ``disconnected`` rather than sent and ``in_flight``).
        """
        run = self._run
        transport = self.transport
        if not transport.connected:
            if not transport.connect(now, self.hello_packets):
                run._dropped_disconnected += n
                return False
            wait = None
        totals = P.Totals(
            transport.sent_connection + n,
            run._sent_total + n,
            run._dropped_disconnected,
            run._dropped_backpressure,
            run._dropped_encode,
            run._dropped_in_flight,
            run._refused,
        )
        result = transport.send(packet + P.encode_totals(totals), n, now, wait)
        if result.outcome is Outcome.SENT:
            run._sent_total += n
            return True
        if result.outcome is Outcome.BACKPRESSURE:
            run._dropped_backpressure += n
            if not self._resend_names:  # a dropped NAME leaves its values unreadable
                self._resend_names = carries_names(packet)
            return True
        run._dropped_in_flight += result.in_flight
        run._dropped_disconnected += n
        return False

    def hello_packets(self) -> list[bytes]:
        """The HELLO of a new connection: the run's identity (and the names it uses)."""
        run = self._run
        if run._detect_uuid and run.gpu_uuid is None:
            # init() often runs before the model moves to the GPU; by the first flush CUDA
            # is initialised.
            run.gpu_uuid = torch_gpu_uuid(run.local_rank)
        return self.encoder.hello_packets(
            {
                "run": run.run_id,
                "rank": run.rank,
                "local_rank": run.local_rank,
                "world_size": run.world_size,
                "hostname": socket.gethostname(),
                "pid": self.pid,
                "client_version": __version__,
                "gpu_uuid": run.gpu_uuid,
                "started_at": run._started_at,
                "flops_per_token": run.flops_per_token,
                "dtype": run.dtype,
                # Only in a pod: elsewhere the HELLO stays what older exporters know.
                **({"namespace": run.namespace} if run.namespace else {}),
                **({"pod": run.pod} if run.pod else {}),
            }
        )

    def send_finish(self, status: int) -> None:
        """``finish()``'s last flush: what is left and a FINISH record with ``status``.

        Off the hot path: it waits (briefly) for room rather than lose the FINISH record,
        which is how the exporter tells a finished rank from a crashed one, then for the
        exporter to read it; one deadline for everything left, however many packets.
        """
        transport = self.transport
        if not transport.connected:
            transport.retry_now()  # one last attempt, whatever the backoff
        now = _perf()
        packets = self.prepare(now, finish=status)
        if packets is not None:
            transport.start_deadline()
            self.send_packets(packets, now, wait=True)
            self._run._dropped_in_flight += transport.await_read()

    def close(self) -> None:
        """Close the socket."""
        self.transport.close()

    def abandon(self) -> None:
        """In a forked child: forget the parent's socket (unclosed) and flusher thread."""
        self.transport.abandon()  # the parent owns the descriptor; the child must not close it
        self.thread = None

"""The client's run handle: ``init()`` builds one, ``Run.log()`` is the training loop's only call.

Design (see docs/client.md): ``log()`` keeps the keyword dict the call already built (after
converting anything that is not a plain float or int, so a tensor changed later cannot change
what was logged), appends it to a queue and returns: no encoding and no syscall, ever. A
flusher thread, asleep between flushes, wakes every ``flush_interval`` seconds (and at once
for a run's first step, a NaN or infinite value, or ``MAX_PENDING`` queued steps), encodes
the queued steps as fixed-layout binary STEP records and sends them as ``SOCK_SEQPACKET``
packets without blocking. It holds the GIL only while it encodes (tens of microseconds a
flush), so it never competes with the training loop step by step. A failed send drops the
packet and counts it; the socket reconnects lazily with exponential backoff. ``finish()``
flushes in the caller's thread. Nothing in ``log()`` raises.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import logging
import math
import operator
import os
import select
import socket
import sys
import termios
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, NamedTuple

from trainmon_client import _protocol as P
from trainmon_client._device import Deferred, copy_async, is_device_tensor
from trainmon_client._env import default_socket, detect_ranks, detect_run_id
from trainmon_client._version import __version__

log = logging.getLogger("trainmon_client")

FLUSH_BYTES = 48 * 1024
"""A buffer this large (bytes) is sent at once, well below :data:`MAX_PACKET_BYTES`."""
MAX_CUSTOM_NAMES = 1024
"""Distinct custom metric names one client interns; further names are refused and counted."""
MAX_LAYER_NAMES = 1024
"""Room kept for watched layers' names beyond the custom names."""
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 2.0
_SEND_FLAGS = getattr(socket, "MSG_DONTWAIT", 0) | getattr(socket, "MSG_NOSIGNAL", 0)
_perf = time.perf_counter
_wall = time.time
_NAN = math.nan
_REFUSED: Any = object()  # marks a value _coerce refused
_PLAIN = frozenset({float, int})
MAX_PENDING = 256
"""Records queued by ``log()`` before a flush is forced, whatever the interval."""
FINISH_TIMEOUT_S = 1.0
"""Total time (s) ``finish()`` may wait for socket buffer space to deliver what is left and its
FINISH record, however many packets that is; what does not fit in time is dropped and counted
(``backpressure``)."""
_OUTQ = getattr(termios, "TIOCOUTQ", 0x5411)  # SIOCOUTQ: bytes the peer has not read yet
_SKB_MIN_OVERHEAD = 384
"""Bytes a queued packet adds to ``SIOCOUTQ`` beyond its length, at least: the kernel counts
each one's buffer (``skb->truesize``: the data rounded up, plus ``struct sk_buff`` and
``skb_shared_info``, over 512 bytes on 64-bit Linux; measured 768 for a 100-byte packet)."""
_HUP = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0x2000)
MAX_WAITING = 1024
"""Device-to-host copies in flight at most; beyond it a CUDA tensor is read with ``float()``."""


def _as_step(step: Any) -> int | None:
    """A valid step number (0 to 2**64 - 1), or None.

    Accepts an int, a NumPy or tensor integer, or an integral float. Refuses strings (``'5'``)
    and booleans (``True``, NumPy and tensor booleans), which convert to numbers but are not
    step numbers.
    """
    if type(step) is int:
        return step if 0 <= step <= P.MAX_STEP else None
    if isinstance(step, (str, bytes, bytearray, bool)) or "bool" in str(
        getattr(step, "dtype", type(step).__name__)
    ):
        return None
    try:
        value = operator.index(step)
    except Exception:
        try:
            f = float(step)
        except Exception:
            return None
        if not f.is_integer():
            return None
        value = int(f)
    return value if 0 <= value <= P.MAX_STEP else None


_live_runs: weakref.WeakSet[Run] = weakref.WeakSet()
_uncaught_exception = False


def _excepthook_chain() -> None:
    """Remember whether the interpreter dies of an uncaught exception (FINISH status)."""
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        global _uncaught_exception
        _uncaught_exception = True
        previous(exc_type, exc, tb)

    sys.excepthook = hook


_excepthook_chain()


def _after_fork_in_child() -> None:
    # A forked child (e.g. a DataLoader worker) shares the parent's socket: it must never write
    # to it, nor send FINISH at exit.
    for run in list(_live_runs):
        run._disable_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _Plan(NamedTuple):
    """How one set of ``log()`` keyword names is encoded; built once per distinct key tuple."""

    struct_pack: Callable[..., bytes]
    payload_length: int
    ids: tuple[int, ...]
    value_index: tuple[int, ...] | None  # None: every key is a field, in order
    tokens_index: int  # -1 when absent
    samples_index: int
    batch_index: int
    seq_index: int
    refused: int  # keys dropped at every call (bad name, over the name cap)


class Run:
    """A handle on one training process's stream of step metrics.

    Build it with :func:`trainmon_client.init`; do not construct it directly.

    Example:
        >>> import trainmon_client
        >>> run = trainmon_client.init(run="demo", socket_path="/nonexistent/trainmon.sock")
        >>> for step in range(3):
        ...     run.log(step, loss=2.5 - step * 0.1, lr=3e-4, tokens=4096)
        >>> run.finish()
        >>> run.dropped["disconnected"]  # no exporter listening: counted, never raised
        4
    """

    def __init__(
        self,
        *,
        run_id: str,
        rank: int,
        local_rank: int,
        world_size: int,
        socket_path: str,
        flush_interval: float,
        flops_per_token: float | None,
        gpu_uuid: str | None,
        enabled: bool,
        dtype: str = "bf16",
        cuda_memory: bool = False,
    ) -> None:
        self.run_id = run_id
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size
        self.socket_path = socket_path
        self.flush_interval = flush_interval
        self.flops_per_token = flops_per_token
        self.gpu_uuid = gpu_uuid
        self.dtype = dtype
        self.cuda_memory = cuda_memory
        self._detect_uuid = gpu_uuid is None
        self._closed = not enabled
        self._pid = os.getpid()
        self._started_at = _wall()
        self._header = P.packet_header()
        self._buf = bytearray(self._header)
        self._buf_records = 0
        self._buf_steps = 0  # data records (not NAME/HELLO/FINISH) in _buf: what a drop loses
        self._full: list[tuple[bytes, int]] = []  # (packet, its STEP records) waiting to be sent
        # Steps queued by log(), encoded by the flusher: append (log) and popleft (flusher) are
        # each atomic, so the hot path takes no lock.
        # Entries are (step, perf_counter at the call, metrics); the wall time is derived from
        # the perf_counter at encode time (the offset between the clocks is read then).
        self._pending: deque[tuple[Any, float, dict[str, Any]]] = deque()
        # Device-to-host copies in flight, oldest first (see trainmon_client._device).
        self._waiting: deque[Deferred] = deque()
        self._waiting_owners: dict[int, int] = {}  # id(pending metrics dict) -> its copies
        self._resend_names = False
        self._ops: dict[int, list[float]] = {}  # TRACK name id -> [seconds_total, count]
        self._plans: dict[tuple[str, ...], _Plan] = {}
        self._names: dict[str, int] = {}
        self._n_custom_names = 0  # custom metric and operation names interned
        self._n_layer_names = 0
        self._sock: socket.socket | None = None
        self._exporter_uid = _expected_exporter_uid(os.environ)
        self._next_connect = 0.0
        self._backoff = BACKOFF_MIN_S
        self._warned = False
        # The first log() sends at once: the exporter knows the rank from its first step, so a
        # trainer that dies within its first flush interval still counts as crashed.
        self._last_flush = -math.inf
        self._prev_t = _NAN
        self._steps = 0
        self._tokens = 0.0
        self._samples = 0.0
        self._overhead = 0.0  # seconds inside log() and the other calls (caller's thread)
        self._flush_seconds = 0.0  # CPU seconds of the flusher thread's flushes
        self._dropped_disconnected = 0
        self._dropped_backpressure = 0
        self._dropped_encode = 0
        self._dropped_in_flight = 0
        # Delivery accounting of data records (see TOTALS in _protocol): sent over every
        # connection, sent on the current one, and how many of those the exporter was seen to
        # have read (the socket's send queue was empty while the connection was up).
        self._sent_total = 0
        self._finish_deadline = math.inf
        self._no_outq = False  # SIOCOUTQ failed: finish() cannot wait for reads
        self._sent_conn = 0
        self._confirmed_conn = 0
        # Packets sent on this connection since the last confirmation: (bytes, _sent_conn after).
        self._unconfirmed: deque[tuple[int, int]] = deque(maxlen=4096)
        self._refused = 0
        self._internal_errors = 0
        # Guards everything but the hot path's queue: the encoder state, the buffer, the socket
        # and the device copies, between log()'s rare slow paths, the flusher and finish().
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._flusher: threading.Thread | None = None
        # Queue length at which log() wakes the flusher: 0 (every call) until the flusher runs
        # (the first step is sent at once), then MAX_PENDING, or 0 with a flush_interval of 0.
        self._wake_at = 0
        if not self._closed:
            _live_runs.add(self)
            atexit.register(self._atexit)

    # ------------------------------------------------------------------------- public API

    def log(self, step: int, /, **metrics: Any) -> None:
        """Record one training step. Never raises, never blocks.

        Args:
            step: the step number (int >= 0; NumPy and 0-d tensor integers accepted).
            **metrics: scalars: Python numbers, NumPy scalars or 0-d torch tensors. Standard
                names: ``loss``; ``lr`` (learning rate); ``grad_norm`` (global gradient L2
                norm, before clipping); ``tokens`` and ``samples`` (processed in *this* step;
                the client sends running totals); ``batch_size`` (samples per step; counts as
                ``samples`` when ``samples`` is not given); ``seq_len`` (tokens per sample;
                with ``batch_size`` counts as ``tokens`` when ``tokens`` is not given). Any other
                name is a custom metric: 1 to 128 of letters, digits and ``_ . : / -``, starting
                with a letter or ``_``. NaN and infinities are data and are sent as such.
                CUDA tensors are never read in this call: they are copied to pinned host
                memory asynchronously and the step is sent once the copy has landed (see
                :mod:`trainmon_client._device`), so ``log()`` adds no device synchronisation.

        Invalid names or values are dropped and counted in :attr:`refused`.

        Example:
            >>> run = init(run="doc", socket_path="/nonexistent/x.sock")
            >>> run.log(10, loss=float("nan"), grad_norm=1.5, tokens=2048, my_signal=0.3)
            >>> run.log(11, loss="oops")  # refused and counted, no exception
            >>> run.refused
            1
        """
        t0 = _perf()
        if self._closed:
            return
        try:
            # The common case (plain floats and ints) reads as few attributes as it can: each
            # is a cache miss right after optimizer.step().
            # A Python loop over __class__ beats _PLAIN.issuperset(map(type, values)) here:
            # in situ (cold caches) it saves about 1.5 us of the 12 (benchmarks/client_log.py).
            values = metrics.values()
            pending = self._pending
            for value in values:
                cls = value.__class__
                if cls is not float and cls is not int:
                    break
            else:
                cls = None
            if cls is None:
                pending.append((step, t0, metrics))
                total = sum(values)
            else:
                with self._lock:
                    metrics = self._snapshot(metrics)
                values = metrics.values()
                pending.append((step, t0, metrics))
                total = sum(values)
            if self._waiting and self._lock.acquire(False):  # the flusher resolves otherwise
                try:
                    if self._resolve(block=False):
                        total = _NAN  # a device value that just arrived is not finite
                finally:
                    self._lock.release()
            # A NaN or an infinity is sent now; so is a full queue, and the first step (the
            # exporter learns the rank then), or every step with a flush_interval of 0.
            if total - total != 0.0 or len(pending) >= self._wake_at:
                self._wake_flusher()
        except Exception:  # never raise into the training loop
            self._internal_errors += 1
            log.debug("trainmon_client: log() failed internally", exc_info=True)
        self._overhead += _perf() - t0

    def finish(self, *, failed: bool = False) -> None:
        """Send everything buffered and a FINISH record, then close the socket. Idempotent.

        Called automatically at interpreter exit (``atexit``) and by ``with`` blocks. The
        exporter then reports the rank as finished (``failed=True``, or an exception leaving a
        ``with`` block or the interpreter, marks it as failed) instead of crashed.

        Returns within :data:`FINISH_TIMEOUT_S` (1 s) of the call, plus the time to encode what
        is queued and to wait for device copies in flight, whatever the exporter does: it
        waits for socket buffer space, then for the exporter to read what was sent, and stops
        at that one deadline. Records it could not send in time count as ``backpressure``;
        records sent but not seen read by then (or on a connection that ended) as
        ``in_flight`` (see :attr:`dropped`).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self._sock is None:
                    self._next_connect = 0.0  # one last attempt, whatever the backoff
                self._flush(_perf(), finish=P.FINISH_FAILED if failed else P.FINISH_OK)
                self._await_read()
            except Exception:
                self._internal_errors += 1
                log.debug("trainmon_client: finish() failed internally", exc_info=True)
            finally:
                self._close_socket()
                _live_runs.discard(self)
                atexit.unregister(self._atexit)
        self._wake.set()  # the flusher sees _closed and ends

    def eval(self, step: int, /, **metrics: Any) -> None:
        """Record the results of one evaluation. Never raises; sent at once.

        Args:
            step: the training step the evaluation belongs to.
            **metrics: ``val_loss`` (validation loss; the exporter derives improvement rate,
                train/validation gap and plateau from it) and any named scalar
                (e.g. ``accuracy``), with the same name rules as :meth:`log`.

        Example:
            >>> run = init(run="doc", socket_path="/nonexistent/x.sock")
            >>> run.eval(1000, val_loss=2.31, accuracy=0.41)
        """
        if self._closed:
            return
        now = _perf()
        try:
            with self._lock:
                values = self._snapshot(metrics, defer=False)
                ids: list[int] = []
                vals: list[float] = []
                for key, value in values.items():
                    field_id = P.STANDARD_FIELDS.get(key) or self._intern(key)
                    if field_id:
                        ids.append(field_id)
                        vals.append(value)
                    else:
                        self._refused += 1
                s = _as_step(step)
                if s is None:
                    self._refused += 1
                    return
                head = P.EVAL_HEADER.pack(s, _wall())
                self._send_now(P.encode_fields(P.EVAL, head, ids, vals), now)
        except Exception:
            self._internal_errors += 1
            log.debug("trainmon_client: eval() failed internally", exc_info=True)
        finally:
            self._overhead += _perf() - now

    @contextlib.contextmanager
    def track(self, name: str) -> Iterator[None]:
        """Time a monitoring operation (validation, sample generation, checkpoint writing).

        The exporter exports the time per operation and the total monitoring share of wall
        time, and does not call a rank hung while one of its operations runs. Entry and exit
        each send at once (about 0.1 ms), so wrap operations that take time, not per-step
        arithmetic. Exceptions of the block propagate; trainmon's own never do.

        Args:
            name: operation name, same rules as a custom metric name.

        Example:
            >>> run = init(run="doc", socket_path="/nonexistent/x.sock")
            >>> with run.track("validation"):
            ...     pass  # evaluate the model here
        """
        field_id = self._track_begin(name)
        t0 = _perf()
        try:
            yield
        finally:
            self._track_end(field_id, _perf() - t0)

    def checkpoint(self, step: int, /, *, seconds: float | None = None) -> None:
        """Record that a checkpoint of ``step`` was written, taking ``seconds``. Never raises.

        Example:
            >>> run = init(run="doc", socket_path="/nonexistent/x.sock")
            >>> run.checkpoint(5000, seconds=12.5)
        """
        if self._closed:
            return
        now = _perf()
        try:
            with self._lock:
                s = _as_step(step)
                sec = _NAN if seconds is None else self._coerce(seconds)
                if s is None or sec is _REFUSED or sec < 0:
                    self._refused += 1
                    return
                self._send_now(P.encode_checkpoint(s, _wall(), sec), now)
        except Exception:
            self._internal_errors += 1
            log.debug("trainmon_client: checkpoint() failed internally", exc_info=True)
        finally:
            self._overhead += _perf() - now

    def watch(
        self,
        model: Any,
        optimizer: Any,
        *,
        every: int = 100,
        quantiles_every: int = 1000,
        activations: bool = False,
        exact_update: bool = True,
        budget: float = 0.01,
        max_layers: int = 128,
    ) -> Any:
        """Watch per-layer gradients, weights and updates every ``every`` optimizer steps.

        Needs torch (imported here, not before). Statistics, their cost and the back-off are
        described in :mod:`trainmon_client._watch`. The exporter exports them with a
        ``layer`` label and watches update ratios and the layer-to-layer gradient gain.

        Args:
            model: the ``torch.nn.Module`` (the unwrapped one under DDP).
            optimizer: its ``torch.optim.Optimizer`` (hooks on its ``step``).
            every: optimizer steps between checks (doubled when over ``budget``).
            quantiles_every: steps between gradient-distribution quantiles (0: never).
            activations: also record layer outputs' mean, std and dead-unit share.
            exact_update: copy the weights before watched steps for an exact update ratio.
            budget: largest share of wall time the checks may take.
            max_layers: layers watched at most (the first ones in module order).

        Returns:
            A ``Watcher``; its ``remove()`` detaches every hook.

        Raises:
            ValueError: invalid ``every``, ``budget`` or ``max_layers``.
            ImportError: torch is not installed.

        Example:
            >>> watcher = run.watch(model, optimizer, every=100)  # doctest: +SKIP
        """
        if every < 1 or not 0 < budget <= 1 or max_layers < 1 or quantiles_every < 0:
            raise ValueError("watch(): every >= 1, 0 < budget <= 1, max_layers >= 1 needed")
        from trainmon_client._watch import Watcher

        return Watcher(
            self,
            model,
            optimizer,
            every=every,
            quantiles_every=quantiles_every,
            activations=activations,
            exact_update=exact_update,
            budget=budget,
            max_layers=max_layers,
        )

    def _send_layer_table(
        self,
        step: int,
        names: list[str],
        codes: list[int],
        table: Any,
        checks_total: int,
        seconds_total: float,
    ) -> None:
        """Queue the watcher's ``[layers, codes]`` table; a CUDA table is copied without a sync."""
        if self._closed:
            return
        if is_device_tensor(table) and len(self._waiting) < MAX_WAITING:

            def apply(values: list[float] | None) -> None:  # called under the lock
                if values is None:
                    self._refused += len(names)
                else:
                    self._send_layers(step, names, codes, values, checks_total, seconds_total)

            with self._lock:
                self._defer([table], apply, flatten=True)
        else:
            values = table.flatten().tolist()
            with self._lock:
                self._send_layers(step, names, codes, values, checks_total, seconds_total)

    def _send_layers(
        self,
        step: int,
        names: list[str],
        codes: list[int],
        values: list[float],
        checks_total: int,
        seconds_total: float,
    ) -> None:
        """Queue one LAYERS record (from the watcher); sent with the next flush."""
        if self._closed:
            return
        ids = [self._intern(n, layer=True) for n in names]
        if not all(ids):
            self._refused += sum(1 for i in ids if not i)
            keep = [k for k, i in enumerate(ids) if i]
            k = len(codes)
            values = [v for row in keep for v in values[row * k : (row + 1) * k]]
            ids = [ids[r] for r in keep]
        self._encode_pending()
        record = P.encode_layers(step, _wall(), checks_total, seconds_total, ids, codes, values)
        self._add_record(record, data=True)

    def _track_begin(self, name: str) -> int:
        if self._closed:
            return 0
        now = _perf()
        try:
            with self._lock:
                field_id = self._intern(name)
                if not field_id:
                    self._refused += 1
                    return 0
                totals = self._ops.setdefault(field_id, [0.0, 0])
                self._send_now(P.encode_track(field_id, True, totals[0], int(totals[1])), now)
                return field_id
        except Exception:
            self._internal_errors += 1
            log.debug("trainmon_client: track() failed internally", exc_info=True)
            return 0
        finally:
            self._overhead += _perf() - now

    def _track_end(self, field_id: int, seconds: float) -> None:
        if self._closed or not field_id:
            return
        now = _perf()
        try:
            with self._lock:
                totals = self._ops[field_id]
                totals[0] += seconds
                totals[1] += 1
                self._send_now(P.encode_track(field_id, False, totals[0], int(totals[1])), now)
        except Exception:
            self._internal_errors += 1
            log.debug("trainmon_client: track() failed internally", exc_info=True)
        finally:
            self._overhead += _perf() - now

    def __enter__(self) -> Run:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.finish(failed=exc_type is not None and not issubclass(exc_type, KeyboardInterrupt))

    @property
    def dropped(self) -> dict[str, int]:
        """Data records (steps, evaluations, checkpoints, tracked operations) dropped, by reason.

        ``disconnected``: no exporter was reachable; ``backpressure``: the socket buffer was
        full, or :meth:`finish` ran out of its deadline; ``encode_error``: a step with a value
        that cannot be encoded (e.g. an int beyond a float's range); ``in_flight``: records
        sent on a connection that ended before the exporter was seen to read them (the socket's
        send queue had not drained): an upper bound of what a frozen, killed or restarted
        exporter never read. Every record logged is either in :attr:`sent`, here, or still
        queued; bad values and steps are in :attr:`refused` instead.
        """
        return {
            "disconnected": self._dropped_disconnected,
            "backpressure": self._dropped_backpressure,
            "encode_error": self._dropped_encode,
            "in_flight": self._dropped_in_flight,
        }

    @property
    def sent(self) -> int:
        """Data records handed to the kernel, over every connection (TOTALS ``sent_total``)."""
        return self._sent_total

    @property
    def refused(self) -> int:
        """Values (or whole records) refused for a bad name, type or step number."""
        return self._refused

    @property
    def overhead_seconds(self) -> float:
        """Cumulative seconds the client cost the training process.

        Wall time inside :meth:`log`, :meth:`eval`, :meth:`track` and :meth:`checkpoint`
        (``time.perf_counter``), plus the CPU time of the flusher thread's flushes
        (``time.thread_time``). Sent with every step as ``overhead_seconds_total``.
        """
        return self._overhead + self._flush_seconds

    @property
    def connected(self) -> bool:
        """Whether the last send reached an exporter."""
        return self._sock is not None

    def __repr__(self) -> str:
        return (
            f"Run(run={self.run_id!r}, rank={self.rank}, world_size={self.world_size}, "
            f"socket={self.socket_path!r}, connected={self.connected})"
        )

    # ------------------------------------------------------------------------- flusher

    def _wake_flusher(self) -> None:
        """Wake the flusher thread now (starting it on the first call)."""
        if self._flusher is None:
            thread = threading.Thread(
                target=self._flush_loop, name=f"trainmon-flush-{self.rank}", daemon=True
            )
            self._flusher = thread
            self._wake_at = 0 if self.flush_interval <= 0.0 else MAX_PENDING
            thread.start()
        self._wake.set()

    def _flush_loop(self) -> None:
        """The flusher thread: sleep until woken or ``flush_interval`` passes, then flush.

        It sleeps in ``Event.wait`` (no GIL held) and ends once the run is closed. With a
        ``flush_interval`` of 0 it only wakes when ``log()`` wakes it, once per step.
        """
        wake = self._wake
        timeout = self.flush_interval if self.flush_interval > 0.0 else None
        while not self._closed:
            wake.wait(timeout)
            wake.clear()
            with self._lock:
                if self._closed:
                    return
                cpu0 = time.thread_time()
                try:
                    self._flush(_perf())
                except Exception:
                    self._internal_errors += 1
                    log.debug("trainmon_client: flush failed internally", exc_info=True)
                self._flush_seconds += time.thread_time() - cpu0

    # ------------------------------------------------------------------------- flush path

    def _send_now(self, record: bytes, now: float) -> None:
        """Queue ``record`` after every pending step and flush at once (rare records)."""
        self._encode_pending()
        self._add_record(record, data=True)
        self._flush(now)

    def _snapshot(self, metrics: dict[str, Any], defer: bool = True) -> dict[str, Any]:
        """Convert every value that is not a plain float/int now (tensors may change later).

        With ``defer``, CUDA tensors are not read: they hold a 0.0 placeholder and an
        asynchronous copy fills them in (:meth:`_resolve`) before the step is encoded.
        """
        out: dict[str, Any] = {}
        keys: list[str] = []
        tensors: list[Any] = []
        for k, v in metrics.items():
            if v.__class__ in _PLAIN:
                out[k] = v
            elif defer and is_device_tensor(v) and len(self._waiting) < MAX_WAITING:
                out[k] = 0.0
                keys.append(k)
                tensors.append(v)
            else:
                f = self._coerce(v)
                if f is not _REFUSED:
                    out[k] = f
        if keys:
            try:
                self._defer(tensors, self._filler(out, keys), owner=out)
            except Exception:  # e.g. a tensor of several elements
                log.debug("trainmon_client: device copy failed", exc_info=True)
                for k in keys:
                    del out[k]
                self._refused += len(keys)
        return out

    def _filler(self, out: dict[str, Any], keys: list[str]) -> Callable[[list[float] | None], None]:
        def apply(values: list[float] | None) -> None:
            if values is None:
                for k in keys:
                    out.pop(k, None)
                self._refused += len(keys)
                return
            out.update(dict(zip(keys, values)))  # noqa: B905 (Python 3.9: no strict=)

        return apply

    def _defer(
        self,
        tensors: list[Any],
        apply: Callable[[list[float] | None], None],
        owner: dict[str, Any] | None = None,
        flatten: bool = False,
    ) -> None:
        """Start an asynchronous device-to-host copy; ``apply`` gets the values when it lands.

        ``owner``: the pending step's metrics dict the copy fills; the step (and every later
        one) is held back from encoding until then.
        """
        deferred = copy_async(tensors, apply, flatten=flatten)
        deferred.owner = owner
        self._waiting.append(deferred)
        if owner is not None:
            key = id(owner)
            self._waiting_owners[key] = self._waiting_owners.get(key, 0) + 1

    def _resolve(self, block: bool) -> bool:
        """Apply the device copies that have landed, oldest first; True if one is not finite.

        Polls with ``cudaEventQuery`` and stops at the first copy still in flight, unless
        ``block`` (``finish()`` only), which waits for each. A failed copy drops its values
        and counts them in :attr:`refused`.
        """
        urgent = False
        waiting = self._waiting
        while waiting:
            deferred = waiting[0]
            values: list[float] | None
            try:
                if not deferred.ready():
                    if not block:
                        break
                    deferred.wait()
                values = deferred.values()
            except Exception:
                self._internal_errors += 1
                log.debug("trainmon_client: reading a device copy failed", exc_info=True)
                values = None
            waiting.popleft()
            owner = deferred.owner
            if owner is not None:
                key = id(owner)
                left = self._waiting_owners[key] - 1
                if left:
                    self._waiting_owners[key] = left
                else:
                    del self._waiting_owners[key]
            if values is not None and any(v - v != 0.0 for v in values):
                urgent = True
            deferred.apply(values)
        return urgent

    def _coerce(self, v: Any) -> Any:
        """Convert a scalar that is not a float or int; count and return ``_REFUSED`` if bad."""
        if isinstance(v, (str, bytes)):
            self._refused += 1
            return _REFUSED
        try:
            # NumPy scalars, 0-d torch tensors, Decimal, Fraction, bool. A CUDA tensor is
            # copied here, which synchronises with the device (see docs/client.md).
            return float(v)
        except Exception:
            self._refused += 1
            return _REFUSED

    def _encode_pending(self) -> None:
        """Encode the records ``log()`` queued since the last flush into ``self._buf``.

        Stops before the first step whose device values are still being copied (steps are
        sent in order); that step and the later ones stay pending.
        """
        pending = self._pending
        owners = self._waiting_owners
        to_wall = _wall() - _perf()  # perf_counter -> Unix time, read once per flush
        while pending:
            if owners and id(pending[0][2]) in owners:
                break
            step, t0, metrics = pending.popleft()
            if type(step) is not int or not 0 <= step <= P.MAX_STEP:
                step = _as_step(step)  # NumPy / tensor integers, integral floats, or None
                if step is None:
                    self._refused += 1
                    continue
            keys = tuple(metrics)
            plan = self._plans.get(keys)
            if plan is None:
                plan = self._plan(keys)
            vals = list(metrics.values())
            tokens, samples = self._tokens, self._samples
            refused = plan.refused
            try:
                if plan.tokens_index >= 0:
                    add = vals[plan.tokens_index]
                elif plan.batch_index >= 0 and plan.seq_index >= 0:
                    add = vals[plan.batch_index] * vals[plan.seq_index]
                else:
                    add = 0
                if 0 <= add < math.inf:  # NaN, negative or infinite: never into the total
                    tokens += add
                else:
                    refused += 1
                if plan.samples_index >= 0:
                    add = vals[plan.samples_index]
                elif plan.batch_index >= 0:
                    add = vals[plan.batch_index]
                else:
                    add = 0
                if 0 <= add < math.inf:
                    samples += add
                else:
                    refused += 1
                fields = vals if plan.value_index is None else [vals[i] for i in plan.value_index]
                record = plan.struct_pack(
                    P.STEP,
                    plan.payload_length,
                    step,
                    self._steps + 1,
                    t0 + to_wall,
                    t0 - self._prev_t,
                    tokens,
                    samples,
                    self._overhead + self._flush_seconds,
                    self._dropped_disconnected,
                    self._dropped_backpressure,
                    self._refused + refused,
                    *plan.ids,
                    *fields,
                )
            except Exception:  # e.g. an int beyond a float's range: this step only
                self._dropped_encode += 1
                log.debug("trainmon_client: a step could not be encoded", exc_info=True)
                continue
            self._tokens, self._samples = tokens, samples
            self._refused += refused
            self._steps += 1
            self._prev_t = t0
            self._add_record(record, data=True)

    def _add_record(self, record: bytes, data: bool = False) -> None:
        if len(self._buf) + len(record) > FLUSH_BYTES:
            self._full.append((bytes(self._buf), self._buf_steps))
            self._buf = bytearray(self._header)
            self._buf_records = 0
            self._buf_steps = 0
        self._buf += record
        self._buf_records += 1
        self._buf_steps += data

    # ------------------------------------------------------------------------- slow paths

    def _plan(self, keys: tuple[str, ...]) -> _Plan:
        """Build (and cache) the encoding of one key tuple; interns new custom names."""
        ids: list[int] = []
        index: list[int] = []
        refused = 0
        special = {"tokens": -1, "samples": -1, "batch_size": -1, "seq_len": -1}
        for i, key in enumerate(keys):
            if key in ("tokens", "samples"):
                special[key] = i
                continue
            if key in ("batch_size", "seq_len"):
                special[key] = i
            field_id = P.STANDARD_FIELDS.get(key) or self._intern(key)
            if field_id:
                ids.append(field_id)
                index.append(i)
            else:
                refused += 1
        s = P.step_struct(len(ids))
        all_fields = len(index) == len(keys)
        plan = _Plan(
            struct_pack=s.pack,
            payload_length=P.step_payload_length(len(ids)),
            ids=tuple(ids),
            value_index=None if all_fields else tuple(index),
            tokens_index=special["tokens"],
            samples_index=special["samples"],
            batch_index=special["batch_size"],
            seq_index=special["seq_len"],
            refused=refused,
        )
        if len(self._plans) < 4096:
            self._plans[keys] = plan
        return plan

    def _intern(self, name: str, layer: bool = False) -> int:
        """Field id for a custom name, or 0 when it is refused (bad name or over the cap).

        The caller counts refusals (per call, through the plan).
        """
        field_id = self._names.get(name)
        if field_id is not None:
            return field_id
        if layer:
            if not P.valid_name(name) or self._n_layer_names >= MAX_LAYER_NAMES:
                return 0
            self._n_layer_names += 1
        else:
            if not P.valid_metric_name(name) or self._n_custom_names >= MAX_CUSTOM_NAMES:
                return 0
            self._n_custom_names += 1
        field_id = P.FIRST_CUSTOM_ID + len(self._names)
        self._names[name] = field_id
        if self._sock is not None:  # otherwise the next connect sends it after HELLO
            self._add_record(P.encode_name(field_id, name))
        return field_id

    def _hello_packets(self) -> list[bytes]:
        if self._detect_uuid and self.gpu_uuid is None:
            # init() often runs before the model moves to the GPU; by the first flush CUDA
            # is initialised.
            self.gpu_uuid = _torch_gpu_uuid(self.local_rank)
        hello = P.encode_hello(
            {
                "run": self.run_id,
                "rank": self.rank,
                "local_rank": self.local_rank,
                "world_size": self.world_size,
                "hostname": socket.gethostname(),
                "pid": self._pid,
                "client_version": __version__,
                "gpu_uuid": self.gpu_uuid,
                "started_at": self._started_at,
                "flops_per_token": self.flops_per_token,
                "dtype": self.dtype,
            }
        )
        packets = []
        current = bytearray(self._header) + hello
        for name, field_id in self._names.items():
            record = P.encode_name(field_id, name)
            if len(current) + len(record) > FLUSH_BYTES:
                packets.append(bytes(current))
                current = bytearray(self._header)
            current += record
        packets.append(bytes(current))
        return packets

    def _connect(self, now: float) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.setblocking(False)
            sock.connect(self.socket_path)
            if self._exporter_uid is not None:
                _check_listener(sock, self._exporter_uid)
            for packet in self._hello_packets():
                sock.send(packet, _SEND_FLAGS)
        except OSError as exc:
            sock.close()
            self._next_connect = now + self._backoff
            self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
            if not self._warned:
                self._warned = True
                log.warning(
                    "trainmon: no exporter at %s (%s); metrics are dropped and counted until "
                    "one listens",
                    self.socket_path,
                    exc.strerror or exc,
                )
            return None
        self._backoff = BACKOFF_MIN_S
        self._sock = sock
        self._sent_conn = self._confirmed_conn = 0
        self._unconfirmed.clear()
        return sock

    def _flush(self, now: float, finish: int | None = None) -> None:
        """Encode what is pending and send it (or drop and count it). Never raises OSError."""
        self._last_flush = now
        if os.getpid() != self._pid:  # forked child: never touch the parent's socket
            self._pending.clear()
            return
        if self.cuda_memory and self._pending:
            _add_allocator_stats(self._pending[-1][2])
        if self._waiting:
            self._resolve(block=finish is not None)
        if self._sock is not None:
            self._check_connection(now)
        if self._resend_names and self._sock is not None:
            self._resend_names = False
            for name, field_id in self._names.items():
                self._add_record(P.encode_name(field_id, name))
        self._encode_pending()
        if finish is not None:
            self._add_record(P.encode_finish(finish, _wall()))
        packets = self._full
        self._full = []
        if self._buf_records:
            packets.append((bytes(self._buf), self._buf_steps))
        self._buf = bytearray(self._header)
        self._buf_records = 0
        self._buf_steps = 0
        flags = _SEND_FLAGS
        deadline = math.inf
        if finish is not None:
            # Off the hot path: wait (briefly) for room rather than lose the FINISH record,
            # which is how the exporter tells a finished rank from a crashed one; one deadline
            # for everything left, however many packets.
            deadline = self._finish_deadline = _perf() + FINISH_TIMEOUT_S
            flags = _SEND_FLAGS & ~getattr(socket, "MSG_DONTWAIT", 0)
        for i, (packet, n) in enumerate(packets):
            if finish is not None:
                left = deadline - _perf()
                if left <= 0.0:
                    self._dropped_backpressure += sum(m for _, m in packets[i:])
                    return
                if self._sock is not None:
                    self._sock.settimeout(left)
            if not self._send(packet, n, now, flags):
                self._dropped_disconnected += sum(m for _, m in packets[i + 1 :])
                return

    def _send(self, packet: bytes, n: int, now: float, flags: int = _SEND_FLAGS) -> bool:
        """Send one packet holding ``n`` steps; False when disconnected (drops are counted)."""
        sock = self._sock
        if sock is None:
            if now < self._next_connect or self._connect(now) is None:
                self._dropped_disconnected += n
                return False
            sock = self._sock
            assert sock is not None
        totals = P.Totals(
            self._sent_conn + n,
            self._sent_total + n,
            self._dropped_disconnected,
            self._dropped_backpressure,
            self._dropped_encode,
            self._dropped_in_flight,
            self._refused,
        )
        wire = packet + P.encode_totals(totals)
        try:
            sock.send(wire, flags)
        except (BlockingIOError, InterruptedError, TimeoutError):
            self._dropped_backpressure += n
            self._resend_names = True  # the packet may have carried NAME records
            return True
        except OSError as exc:
            if exc.errno in (errno.ENOBUFS, errno.EMSGSIZE):
                self._dropped_backpressure += n
                self._resend_names = True
                return True
            log.debug("trainmon_client: send failed (%s); reconnecting", exc)
            self._connection_lost(now)
            self._dropped_disconnected += n
            return False
        self._sent_conn += n
        self._sent_total += n
        self._unconfirmed.append((len(wire), self._sent_conn))
        return True

    def _check_connection(self, now: float) -> None:
        """Before a flush: note what the exporter has read, or notice that it went away.

        An empty send queue (``SIOCOUTQ``) while the peer is still there means the exporter
        has read every packet sent so far. The queue is read *before* the hang-up check: the
        kernel flags the hang-up before it discards the queue, so a 0 seen on a live socket
        is never a discarded queue.
        """
        sock = self._sock
        assert sock is not None
        try:
            raw = fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0")
            outq = int.from_bytes(raw, sys.byteorder, signed=True)
        except OSError:  # a kernel without SIOCOUTQ on Unix sockets: nothing is confirmed
            outq = -1
            self._no_outq = True
        try:
            poller = select.poll()
            poller.register(sock, _HUP)
            gone = any(ev & _HUP for _fd, ev in poller.poll(0))
        except OSError:
            gone = True
        if gone:
            self._connection_lost(now)
        elif outq == 0:
            self._confirmed_conn = self._sent_conn
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
                    self._confirmed_conn = q[i][1]
                    for _ in range(i + 1):
                        q.popleft()
                    break

    def _await_read(self) -> None:
        """``finish()``: wait until the exporter has read everything sent, or the deadline.

        What it has not read by then is counted ``in_flight``: an exporter that is frozen (or
        about to die) would lose it with no one the wiser.
        """
        deadline = self._finish_deadline
        while self._sock is not None and self._confirmed_conn < self._sent_conn:
            if self._no_outq:
                return
            if _perf() >= deadline:
                self._dropped_in_flight += self._sent_conn - self._confirmed_conn
                self._confirmed_conn = self._sent_conn
                self._unconfirmed.clear()
                return
            time.sleep(0.001)
            self._check_connection(_perf())

    def _connection_lost(self, now: float) -> None:
        """The connection ended: what it carried that was never seen read is ``in_flight``."""
        self._dropped_in_flight += self._sent_conn - self._confirmed_conn
        self._sent_conn = self._confirmed_conn = 0
        self._unconfirmed.clear()
        self._close_socket()
        self._next_connect = now + self._backoff

    def _close_socket(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None

    def _atexit(self) -> None:
        self.finish(failed=_uncaught_exception)

    def _disable_in_child(self) -> None:
        self._closed = True
        self._sock = None  # the parent owns the descriptor; the child must not close it
        self._lock = threading.RLock()  # the parent's flusher may have held it at the fork
        self._flusher = None


def _expected_exporter_uid(env: Any) -> int | None:
    """``TRAINMON_EXPORTER_UID``: the uid the exporter must run as, or None (no check).

    Raises:
        ValueError: it is set but not a non-negative integer.
    """
    value = env.get("TRAINMON_EXPORTER_UID", "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"TRAINMON_EXPORTER_UID={value!r} is not a uid (a non-negative integer)")
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


def init(
    run: str | None = None,
    *,
    socket_path: str | os.PathLike[str] | None = None,
    rank: int | None = None,
    local_rank: int | None = None,
    world_size: int | None = None,
    num_params: int | None = None,
    flops_per_token: float | None = None,
    gpu_uuid: str | None = None,
    dtype: str = "bf16",
    cuda_memory: bool = False,
    flush_interval: float | None = None,
    enabled: bool = True,
) -> Run:
    """Start reporting a training process to the node's trainmon exporter.

    Connects lazily: nothing happens on the network until the first flush, and a missing
    exporter is not an error (records are dropped and counted in :attr:`Run.dropped`).

    Args:
        run: run id shared by every rank (1-128 of letters, digits, ``_ . : @ + -``). Default:
            ``TRAINMON_RUN``, ``slurm-$SLURM_JOB_ID``, ``TORCHELASTIC_RUN_ID``, or generated
            from the launcher's start time (see :func:`trainmon_client._env.detect_run_id`).
        socket_path: the exporter's Unix socket. Default: ``TRAINMON_SOCKET``, else
            :func:`trainmon_client._env.default_socket`: ``/run/trainmon/trainmon.sock`` for
            root or where ``/run/trainmon`` exists, else
            ``$XDG_RUNTIME_DIR/trainmon/trainmon.sock`` (the exporter's default, same rule).
        rank: global rank; default from the launcher's environment (torchrun ``RANK``,
            Slurm ``SLURM_PROCID`` in tasks ``srun`` started, Open MPI, PMI), else 0.
        local_rank: rank within the node (``LOCAL_RANK``, ``SLURM_LOCALID``, ...).
        world_size: number of ranks (``WORLD_SIZE``, ``SLURM_NTASKS``, ...), else 1.
        num_params: model parameter count; sets ``flops_per_token = 6 * num_params`` (dense
            decoder forward + backward, Kaplan et al. 2020, "Scaling Laws", §2.1) for MFU.
        flops_per_token: training FLOPs per token, when known better than ``6 * num_params``.
        gpu_uuid: this rank's GPU UUID as NVML prints it (``GPU-…``); default: detected from
            torch when CUDA is initialised (at ``init()`` or at the first flush).
        dtype: the training dtype MFU is judged against: ``bf16`` (default), ``fp16``,
            ``fp8``, ``tf32`` or ``fp32``; the exporter looks up that dtype's peak.
        cuda_memory: also send ``torch.cuda`` allocator figures, read once per flush (at most
            every ``flush_interval``) from ``torch.cuda.memory_stats()``: ``mem_allocated``,
            ``mem_reserved``, ``mem_peak`` (``allocated_bytes.all.peak``), ``alloc_retries``
            (``num_alloc_retries``: cudaMalloc retries after freeing the cache, the sign of
            fragmentation before an OOM) and ``ooms`` (``num_ooms``). Values you log under
            those names win. Host-side counters: no device synchronisation.
        flush_interval: longest time (seconds) a record waits in the buffer before the flusher
            thread sends it (0: each step as it comes).
            Default: ``TRAINMON_FLUSH_INTERVAL`` or 0.5. Non-finite values are sent at once.
        enabled: ``False`` returns a handle whose methods do nothing (e.g. on ranks you skip).

    Returns:
        The :class:`Run` handle.

    Raises:
        ValueError: an invalid run id, rank numbers, interval or FLOP count (programmer
            errors; the only exceptions trainmon ever raises).

    Example:
        >>> import trainmon_client
        >>> run = trainmon_client.init(run="gpt2-124m", socket_path="/nonexistent/t.sock")
        >>> run.log(0, loss=10.9, lr=6e-4, tokens=524288)
        >>> run.finish()
    """
    env = os.environ
    d_rank, d_local, d_world = detect_ranks(env)
    rank = d_rank if rank is None else rank
    local_rank = d_local if local_rank is None else local_rank
    world_size = d_world if world_size is None else world_size
    for name, value in (("rank", rank), ("local_rank", local_rank), ("world_size", world_size)):
        if type(value) is not int or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if world_size < 1 or rank >= world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    run_id = run if run is not None else detect_run_id(world_size, env)
    if not P.valid_run_id(run_id):
        raise ValueError(
            f"run id {str(run_id)[:60]!r} is invalid: use 1-{P.MAX_NAME_CHARS} letters, digits "
            "and _ . : @ + -"
        )
    if flush_interval is None:
        flush_interval = float(env.get("TRAINMON_FLUSH_INTERVAL", "0.5"))
    if not (0.0 <= flush_interval <= 60.0):
        raise ValueError(f"flush_interval must be within [0, 60] seconds, got {flush_interval}")
    if flops_per_token is None and num_params is not None:
        flops_per_token = 6.0 * num_params
    if flops_per_token is not None and not (math.isfinite(flops_per_token) and flops_per_token > 0):
        raise ValueError(f"flops_per_token must be a positive number, got {flops_per_token!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if gpu_uuid is None:
        gpu_uuid = _torch_gpu_uuid(local_rank)
    path = os.fspath(socket_path) if socket_path is not None else None
    path = path or env.get("TRAINMON_SOCKET") or default_socket(env)
    return Run(
        run_id=run_id,
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        socket_path=path,
        flush_interval=flush_interval,
        flops_per_token=flops_per_token,
        gpu_uuid=gpu_uuid,
        enabled=enabled,
        dtype=dtype,
        cuda_memory=cuda_memory,
    )


DTYPES = ("bf16", "fp16", "fp8", "tf32", "fp32")
"""Values of ``init(dtype=...)``."""

_ALLOCATOR_STATS = (
    ("mem_allocated", "allocated_bytes.all.current"),
    ("mem_reserved", "reserved_bytes.all.current"),
    ("mem_peak", "allocated_bytes.all.peak"),
    ("alloc_retries", "num_alloc_retries"),
    ("ooms", "num_ooms"),
)


def _add_allocator_stats(metrics: dict[str, Any]) -> None:
    """Add ``torch.cuda.memory_stats()`` figures to one step's metrics (user values win)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    try:
        if not torch.cuda.is_initialized():
            return
        stats = torch.cuda.memory_stats()
    except Exception:
        return
    for key, stat in _ALLOCATOR_STATS:
        if key not in metrics and stat in stats:
            metrics[key] = stats[stat]


def _torch_gpu_uuid(local_rank: int) -> str | None:
    """The current CUDA device's UUID, only if torch is already imported and CUDA initialised.

    Uses ``torch.cuda.get_device_properties(i).uuid``, which names the physical GPU whatever
    ``CUDA_VISIBLE_DEVICES`` does, formatted like NVML's ``nvmlDeviceGetUUID`` (``GPU-…``).
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
    except Exception:
        return None

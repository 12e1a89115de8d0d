"""The client's run handle: ``init()`` builds one, ``Run.log()`` is the training loop's only call.

Design (see docs/client.md): ``log()`` keeps the keyword dict the call already built (after
converting anything that is not a plain float or int, so a tensor changed later cannot change
what was logged), appends it to a queue and returns: no encoding and no syscall, ever. It
wakes the flusher thread at once for a run's first step, a NaN or infinite value, or
``MAX_PENDING`` queued steps; otherwise the flusher wakes on its own schedule, encodes the
queued steps and sends them without blocking (:mod:`~trainmon_client._sender`). A failed send
drops the packet and counts it. ``finish()`` flushes in the caller's thread. Nothing in
``log()`` raises.

This module is the public surface: :func:`init` and :class:`Run`, and :class:`Operation` (the
handle :meth:`Run.track` returns, from ``_operation``). The run's parts each have a module
(docs/architecture.md lists them): ``_sender`` (the flusher thread, the flush, HELLO,
``finish()``'s last flush, the fork guard), ``_encoder``, ``_transport``, ``_device``,
``_lifecycle`` and ``_watch``.

The run keeps its lock (with the guard against a signal handler re-entering it), the queue
``log()`` fills, and every cumulative count (refused, dropped by reason, sent, overhead,
internal errors): the parts return or report what happened, and the run counts it (the sender
counts on the run itself). ``log()`` reads only the run's own attributes (``_waiting`` is the
device copies' queue, ``_wake`` the sender's wake lock, both shared), so the split adds
nothing to the hot path; the calls that send at once pay one attribute hop into the sender.

Why this module is one module over 500 lines: most of it is the public API's docstrings, the
client's reference documentation, and ``init()`` with its checks is another hundred.

Clocks: ``_perf`` (``time.perf_counter``) and ``_wall`` (``time.time``) are read through these
module globals at call time, for ``log()``'s stamps and the wall-clock times of records;
tests replace them, and the sender's (which map the stamps to wall-clock time), to put steps
on a fake clock.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any, TypeVar

from trainmon_client import _lifecycle
from trainmon_client import _names as N
from trainmon_client import _protocol as P
from trainmon_client._device import REFUSED, DeviceCopies, torch_gpu_uuid
from trainmon_client._encoder import as_step
from trainmon_client._env import (
    default_socket,
    detect_flush_interval,
    detect_pod,
    detect_ranks,
    detect_run_id,
    misspelt_variables,
)
from trainmon_client._operation import Operation
from trainmon_client._sender import Sender
from trainmon_client._transport import expected_exporter_uid

log = logging.getLogger("trainmon_client")

MAX_PENDING = 256
"""Records queued by ``log()`` before a flush is forced, whatever the interval."""
DTYPES = ("bf16", "fp16", "fp8", "tf32", "fp32")
"""Values of ``init(dtype=...)``."""
T = TypeVar("T")
_perf = time.perf_counter
_wall = time.time
_NAN = math.nan


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
        3
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
        sanitised_env: tuple[str, ...] = (),
        namespace: str = "",
        pod: str = "",
        started_at: float | None = None,
    ) -> None:
        self.run_id = run_id
        self.namespace = namespace
        """The Kubernetes namespace of this pod (:func:`~trainmon_client._env.detect_pod`),
        ``""`` off Kubernetes: the exporter keys the run by it."""
        self.pod = pod
        """The Kubernetes pod's name (``POD_NAME``), ``""`` unknown: on ``trainmon_rank_info``."""
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
        self._started_at = _wall() if started_at is None else started_at
        # Steps queued by log(), encoded by the flusher: append (log) and popleft (flusher) are
        # each atomic, so the hot path takes no lock.
        # Entries are (step, perf_counter at the call, metrics); the wall time is derived from
        # the perf_counter at encode time (the offset between the clocks is read then).
        self._pending: deque[tuple[Any, float, dict[str, Any]]] = deque()
        self._copies = DeviceCopies(self)
        self._waiting = self._copies.waiting  # device copies in flight: log() polls them
        issues = list(sanitised_env)
        self._sender = Sender(self, expected_exporter_uid(os.environ, issues))
        self.sanitised_env = tuple(issues)
        """Environment variables whose values were bad and were replaced or ignored at start
        (e.g. ``("TRAINMON_RUN",)``), each warned about once and counted in :attr:`refused`."""
        # The run's cumulative counts (see dropped, sent, refused, overhead_seconds).
        self._overhead = 0.0  # seconds inside log() and the other calls (caller's thread)
        self._data_wait = 0.0  # seconds timed() waited for items since the last log()
        self._flush_seconds = 0.0  # CPU seconds of the flusher thread's flushes
        self._sent_total = 0
        self._dropped_disconnected = 0
        self._dropped_backpressure = 0
        self._dropped_encode = 0
        self._dropped_in_flight = 0
        self._refused = len(issues)
        self._internal_errors = 0
        self._dropped_reentrant = 0
        # The thread that calls log() (noted as it wakes the flusher), for a capture.
        self._train_ident: int | None = threading.get_ident()
        self._captures_sent = 0
        self._captures_dropped = 0
        # Guards everything but the hot path's queue: the encoder, the transport and the
        # device copies, between log()'s rare slow paths, the flusher and finish(). Taken only
        # through _enter(), never by a thread already inside it (a signal handler that
        # interrupted the holder would otherwise deadlock, or re-enter the encoder midway).
        self._lock = threading.RLock()
        self._inside: set[int] = set()  # thread ids taking or holding _lock
        self._finish_deferred: bool | None = None  # a finish(failed=...) a handler asked for
        self._wake = self._sender.wake  # log() releases it to wake the flusher
        # Queue length at which log() wakes the flusher: 0 (every call) until the first wake
        # (the first step is sent at once), then MAX_PENDING, or 0 with a flush_interval of 0.
        self._wake_at = 0
        if not self._closed:
            _lifecycle.attach(self)
            # Started here, not by the first log(): starting a thread takes locks of the
            # threading module, which a signal handler's log() must never wait for.
            self._sender.start()

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
                with ``batch_size`` counts as ``tokens`` when ``tokens`` is not given);
                ``data_time`` (seconds this step waited for its input; :meth:`timed` fills it
                in when the loop does not pass it). Any other
                name is a custom metric: 1 to 128 of letters, digits and ``_ . : / -``, starting
                with a letter or ``_``. NaN and infinities are data and are sent as such.
                CUDA tensors are never read in this call: they are copied to pinned host
                memory asynchronously and the step is sent once the copy has landed (see
                :mod:`trainmon_client._device`), so ``log()`` adds no device synchronisation.

        Invalid names or values are dropped and counted in :attr:`refused`.

        Safe in a signal handler, as is every method of the run: none waits for a lock the
        interrupted code may hold. A call that would is dropped and counted
        (``dropped["reentrant"]``); plain numbers never are.

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
            if self._data_wait:  # what timed() measured since the last step
                metrics.setdefault("data_time", self._data_wait)
                self._data_wait = 0.0
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
                if not self._enter():
                    self._dropped_reentrant += 1
                    self._overhead += _perf() - t0
                    return
                try:
                    metrics = self._copies.snapshot(metrics)
                    pending.append((step, t0, metrics))
                finally:
                    self._leave()  # may run a finish() deferred by a signal handler
                total = sum(metrics.values())
            if self._waiting and self._enter(block=False):  # the flusher resolves otherwise
                try:
                    if self._copies.resolve(block=False):
                        total = _NAN  # a device value that just arrived is not finite
                finally:
                    self._leave()
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

        Returns within :data:`~trainmon_client._transport.FINISH_TIMEOUT_S` (1 s) of the call,
        plus the time to encode what is queued and to wait for device copies in flight,
        whatever the exporter does: it
        waits for socket buffer space, then for the exporter to read what was sent, and stops
        at that one deadline. Records it could not send in time count as ``backpressure``;
        records sent but not seen read by then (or on a connection that ended) as
        ``in_flight`` (see :attr:`dropped`).

        Safe in a signal handler: when the handler interrupted this thread inside the run (its
        lock held or being taken), the finish is done as soon as the interrupted call leaves
        the run, before control returns to the training code.
        """
        if not self._enter():
            if not self._closed:
                self._finish_deferred = bool(self._finish_deferred) or failed
            return
        try:
            if self._closed:
                return
            self._closed = True
            try:
                self._sender.send_finish(P.FINISH_FAILED if failed else P.FINISH_OK)
            except Exception:
                self._internal_errors += 1
                log.debug("trainmon_client: finish() failed internally", exc_info=True)
            finally:
                self._sender.close()
                _lifecycle.detach(self)
        finally:
            self._leave()
        self._wake_flusher()  # the flusher sees _closed and ends

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
        if not self._enter():
            self._dropped_reentrant += 1
            self._overhead += _perf() - now
            return
        try:
            if self._closed:  # finished meanwhile (a signal handler's finish())
                return
            values = self._copies.snapshot(metrics, defer=False)
            record, refused = self._sender.encoder.eval_record(step, _wall(), values)
            self._refused += refused
            if record is not None:
                self._sender.send_now(record, now)
        except Exception:
            self._internal_errors += 1
            log.debug("trainmon_client: eval() failed internally", exc_info=True)
        finally:
            self._leave()
            self._overhead += _perf() - now

    def track(self, name: str) -> Operation:
        """Time a monitoring operation (validation, sample generation, checkpoint writing).

        The exporter exports the time per operation and the total monitoring share of wall
        time, and does not call a rank hung while one of its operations runs. Entry and exit
        each send at once (about 0.1 ms), so wrap operations that take time, not per-step
        arithmetic. Exceptions of the block propagate; trainmon's own never do.

        Args:
            name: operation name, same rules as a custom metric name.

        Returns:
            An :class:`Operation`, which sends nothing until it starts: use it in a ``with``
            block, or call its ``start()`` and ``stop()`` where no one block spans the
            operation (e.g. from two callbacks).

        Example:
            >>> run = init(run="doc", socket_path="/nonexistent/x.sock")
            >>> with run.track("validation"):
            ...     pass  # evaluate the model here
        """
        return Operation(self, name)

    def checkpoint(
        self, step: int, /, *, seconds: float | None = None, restore: bool = False
    ) -> None:
        """Record that a checkpoint of ``step`` was written, taking ``seconds``. Never raises.

        With ``restore=True``: the checkpoint of ``step`` was loaded (the run resumes after
        ``step``), taking ``seconds``. The exporter counts the time as checkpoint restore and
        the step time logged after ``step`` before the restore as wasted (docs/goodput.md).

        Example:
            >>> run = init(run="doc", socket_path="/nonexistent/x.sock")
            >>> run.checkpoint(5000, seconds=12.5)
            >>> run.checkpoint(5000, seconds=30.0, restore=True)  # after loading it
        """
        if self._closed:
            return
        now = _perf()
        if not self._enter():
            self._dropped_reentrant += 1
            self._overhead += _perf() - now
            return
        try:
            if self._closed:
                return
            s = as_step(step)
            sec = _NAN if seconds is None else self._copies.coerce(seconds)
            if s is None or sec is REFUSED or sec < 0:
                self._refused += 1
                return
            self._sender.send_now(P.encode_checkpoint(s, _wall(), sec, bool(restore)), now)
            if not restore:  # the later STEPs carry it too: a lost CHECKPOINT is not lost
                self._sender.encoder.checkpointed(s, sec)
        except Exception:
            self._internal_errors += 1
            log.debug("trainmon_client: checkpoint() failed internally", exc_info=True)
        finally:
            self._leave()
            self._overhead += _perf() - now

    def timed(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield the items of ``iterable``, timing how long each took to arrive.

        The wait for each item (``time.perf_counter`` around its ``next()``, and around the
        ``iter()`` that starts a ``DataLoader``'s worker processes: no system call) is added
        up, and the next :meth:`log` sends the sum as ``data_time`` (seconds), unless it is
        given one. The exporter counts it as data-loading time and judges the rank
        input-bound when it exceeds a share of the step time (docs/goodput.md). Exceptions of
        the iterable propagate unchanged; after :meth:`finish` the items still pass through.

        Example:
            >>> run = init(run="doc", socket_path="/nonexistent/x.sock")
            >>> for step, batch in enumerate(run.timed([[1, 2], [3, 4]])):
            ...     run.log(step, loss=0.5)
        """
        t0 = _perf()
        it = iter(iterable)  # a DataLoader starts its worker processes here
        self._data_wait += _perf() - t0
        while True:
            t0 = _perf()
            try:
                item = next(it)
            except StopIteration:
                return
            self._data_wait += _perf() - t0
            yield item

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

    # ------------------------------------------------------------- for integrations (LayerSink)

    def count_refused(self, n: int = 1) -> None:
        """Count ``n`` values an integration refused, in :attr:`refused`. Never raises.

        For code that feeds the run from a framework's hooks (the watcher, the callbacks).
        """
        self._refused += n

    def count_internal_error(self) -> None:
        """Count one failure an integration swallowed, in :attr:`internal_errors`.

        For code in a framework's hooks that must never break training: catch, count, go on.
        """
        self._internal_errors += 1

    def send_layer_table(
        self,
        step: int,
        names: list[str],
        codes: list[int],
        table: Any,
        checks_total: int,
        seconds_total: float,
    ) -> None:
        """Queue the watcher's ``[layers, codes]`` table; a CUDA table is copied without a sync.

        The watcher's channel (``LayerSink``): one LAYERS record, sent with the next flush.
        """
        if self._closed:
            return

        def send(values: list[float] | None) -> None:  # called under the lock
            if values is None:
                self._refused += len(names)
            elif not self._closed:
                self._sender.add_layers(step, names, codes, values, checks_total, seconds_total)

        copies = self._copies
        if copies.has_room(table):
            if not self._enter():
                self._dropped_reentrant += 1
                return
            try:
                copies.defer([table], send, flatten=True)
            finally:
                self._leave()
        else:
            values = table.flatten().tolist()
            if not self._enter():
                self._dropped_reentrant += 1
                return
            try:
                send(values)
            finally:
                self._leave()

    def _track_begin(self, name: str) -> int:
        if self._closed:
            return 0
        now = _perf()
        if not self._enter():
            self._dropped_reentrant += 1
            self._overhead += _perf() - now
            return 0
        try:
            if self._closed:
                return 0
            sender = self._sender
            field_id = sender.encoder.intern(name)
            if not field_id:
                self._refused += 1
                return 0
            sender.send_now(sender.encoder.track_started(field_id), now)
            return field_id
        except Exception:
            self._internal_errors += 1
            log.debug("trainmon_client: track() failed internally", exc_info=True)
            return 0
        finally:
            self._leave()
            self._overhead += _perf() - now

    def _track_end(self, field_id: int, seconds: float) -> None:
        if self._closed or not field_id:
            return
        now = _perf()
        if not self._enter():
            self._dropped_reentrant += 1
            self._overhead += _perf() - now
            return
        try:
            if self._closed:
                return
            sender = self._sender
            sender.send_now(sender.encoder.track_stopped(field_id, seconds), now)
        except Exception:
            self._internal_errors += 1
            log.debug("trainmon_client: track() failed internally", exc_info=True)
        finally:
            self._leave()
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
        exporter never read; ``reentrant``: calls made while this thread was already inside
        the run, i.e. from a signal handler that interrupted it midway, which would otherwise
        deadlock (a :meth:`log` of plain numbers is never dropped: it takes no lock), and
        steps a :meth:`log` queued after a handler's :meth:`finish` interrupted it. Every
        record logged is either in :attr:`sent`, here, or still queued; bad values and steps
        are in :attr:`refused` instead. ``reentrant`` is the client's own: TOTALS records do
        not carry it.
        """
        return {
            "disconnected": self._dropped_disconnected,
            "backpressure": self._dropped_backpressure,
            "encode_error": self._dropped_encode,
            "in_flight": self._dropped_in_flight,
            # Steps a log() queued after a finish() (a signal handler's) interrupted it.
            "reentrant": self._dropped_reentrant + (len(self._pending) if self._closed else 0),
        }

    @property
    def sent(self) -> int:
        """Data records handed to the kernel, over every connection (TOTALS ``sent_total``)."""
        return self._sent_total

    @property
    def refused(self) -> int:
        """Values (or whole records) refused for a bad name, type or step number.

        Bad environment values replaced or ignored at start count here too, one each
        (:attr:`sanitised_env`), so that the exporter sees them.
        """
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
    def internal_errors(self) -> int:
        """Failures inside trainmon itself, swallowed so that training goes on (0 normally).

        Each is logged at DEBUG on the ``trainmon_client`` logger; integrations count theirs
        here too (:meth:`count_internal_error`).
        """
        return self._internal_errors

    @property
    def connected(self) -> bool:
        """Whether the last send reached an exporter."""
        return self._sender.transport.connected

    @property
    def refused_reason(self) -> str | None:
        """Why the exporter last refused this run, or None.

        The reason it sent before closing the connection (``not_owner``, ``duplicate_rank``,
        ``too_many_ranks``, ``series_budget``, ``peer_not_allowed``...). The first refusal is
        also logged once as a warning with the fix. Records sent meanwhile count as
        ``disconnected`` or ``in_flight``.
        """
        refusal = self._sender.transport.refusal
        return None if refusal is None else refusal.reason

    @property
    def closed(self) -> bool:
        """Whether the run has ended; its methods then do nothing.

        True after :meth:`finish`, for a run built with ``enabled=False``, and in a forked child.
        """
        return self._closed

    def __repr__(self) -> str:
        return (
            f"Run(run={self.run_id!r}, rank={self.rank}, world_size={self.world_size}, "
            f"socket={self.socket_path!r}, connected={self.connected})"
        )

    # ------------------------------------------------------------- the lock and the flusher

    def _enter(self, block: bool = True) -> bool:
        """Take the run's lock, unless this thread is already taking or holding it: False then.

        A thread already inside is one a signal handler interrupted (Python runs handlers in
        the main thread, between two bytecodes of whatever it was doing): waiting would
        deadlock, re-entering would corrupt the encoder, so the caller drops its call and
        counts it (``dropped["reentrant"]``). ``block=False``: also False when another thread
        (the flusher) holds it. The thread's id is noted *before* it waits for the lock, so
        a handler that runs during the wait is refused too. Set operations on ints are atomic.
        """
        me = threading.get_ident()
        inside = self._inside
        if me in inside:
            return False
        inside.add(me)
        if self._lock.acquire(block):
            return True
        inside.discard(me)
        return False

    def _leave(self) -> None:
        """Release what :meth:`_enter` took; then do a finish a signal handler deferred."""
        self._lock.release()
        self._inside.discard(threading.get_ident())
        failed = self._finish_deferred
        if failed is not None:
            self._finish_deferred = None
            self.finish(failed=failed)

    def _wake_flusher(self) -> None:
        """Wake the flusher thread now: one C call, safe in a signal handler; note the thread."""
        self._wake_at = 0 if self.flush_interval <= 0.0 else MAX_PENDING
        self._train_ident = threading.get_ident()
        try:
            self._wake.release()
        except RuntimeError:  # not held: a wake-up is already pending
            pass

    def _disable_in_child(self) -> None:
        """A forked child (e.g. a DataLoader worker): never write to the parent's socket."""
        self._closed = True
        self._sender.abandon()  # the parent's socket and flusher thread
        self._lock = threading.RLock()  # the parent's flusher may have held it at the fork
        self._inside = set()
        self._pending.clear()  # the parent's steps: the parent sends them


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
    started_at: float | None = None,
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
            root, where a socket there accepts this user or this user may create one there,
            else ``$XDG_RUNTIME_DIR/trainmon/trainmon.sock`` (where the exporter of a user who
            may not use ``/run/trainmon`` listens), with one notice when it leaves an existing
            ``/run/trainmon``.
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
        started_at: the process's start (Unix s; default now), where its start-up counts from.

    Returns:
        The :class:`Run` handle.

    Raises:
        ValueError: an invalid run id, rank numbers, interval or FLOP count passed as an
            argument (programmer errors; the only exceptions trainmon ever raises). A bad value
            from the environment (``TRAINMON_RUN`` with spaces or quotes, a ``RANK`` that is
            not a number, ``TRAINMON_FLUSH_INTERVAL``, ``TRAINMON_EXPORTER_UID``) never raises:
            it is sanitised or ignored with one warning and counted
            (:attr:`Run.sanitised_env`, :attr:`Run.refused`).

    Example:
        >>> import trainmon_client
        >>> run = trainmon_client.init(run="gpt2-124m", socket_path="/nonexistent/t.sock")
        >>> run.log(0, loss=10.9, lr=6e-4, tokens=524288)
        >>> run.finish()
    """
    env = os.environ
    issues: list[str] = []  # environment values sanitised (never raised for)
    misspelt_variables(env)
    d_rank, d_local, d_world = detect_ranks(env, issues)
    rank = d_rank if rank is None else rank
    local_rank = d_local if local_rank is None else local_rank
    world_size = d_world if world_size is None else world_size
    for name, value in (("rank", rank), ("local_rank", local_rank), ("world_size", world_size)):
        if type(value) is not int or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if world_size < 1 or rank >= world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    run_id = run if run is not None else detect_run_id(world_size, env, issues)
    namespace, pod = detect_pod(env, issues)
    if not N.valid_run_id(run_id):
        raise ValueError(
            f"run id {str(run_id)[:60]!r} is invalid: use 1-{N.MAX_NAME_CHARS} letters, digits "
            "and _ . : @ + -"
        )
    if flush_interval is None:
        flush_interval = detect_flush_interval(env, issues)
    if not (0.0 <= flush_interval <= 60.0):
        raise ValueError(f"flush_interval must be within [0, 60] seconds, got {flush_interval}")
    if flops_per_token is None and num_params is not None:
        flops_per_token = 6.0 * num_params
    if flops_per_token is not None and not (math.isfinite(flops_per_token) and flops_per_token > 0):
        raise ValueError(f"flops_per_token must be a positive number, got {flops_per_token!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if started_at is not None and not 0 < started_at <= _wall():
        raise ValueError(f"started_at must be a Unix time no later than now, got {started_at!r}")
    if gpu_uuid is None:
        gpu_uuid = torch_gpu_uuid(local_rank)
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
        sanitised_env=tuple(issues),
        namespace=namespace,
        pod=pod,
        started_at=None if started_at is None else float(started_at),
    )

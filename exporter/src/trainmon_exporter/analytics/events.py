"""What happened to a rank, and when: the detectors' firings and the growth of client totals.

Each rank keeps its last detector firings (:class:`EventLog`, for the API and the status page)
and, for the alerts, the wall-clock time of the latest event of each kind: of each detector
firing (:attr:`EventLog.last`) and of each growth of a total the client keeps
(:class:`ClientTotals`). Alerts fire on ``time() - that < window``: a time does not change when
Prometheus misses scrapes, restarts or sees the series under a new instance, so an event pages
once (docs/alerting.md#event-alerts).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from trainmon_client import _protocol as P

__all__ = ["CLIENT_TOTALS", "MAX_EVENTS", "STARTED_AT", "ClientTotals", "Event", "EventLog"]

MAX_EVENTS = 64
"""Detector firings kept per rank for the API and the status page."""


@dataclass(slots=True)
class Event:
    """A detector firing: what, at which training step, when (exporter Unix s), the value.

    Firings of the same kind on consecutive steps are one event with a ``count`` and
    ``last_step``, so a NaN that repeats every step after it appears does not evict the first
    firing.
    """

    kind: str
    step: int | None
    time: float
    value: float | None
    count: int = 1
    last_step: int | None = None


class EventLog(deque[Event]):
    """A rank's last :data:`MAX_EVENTS` detector firings, oldest first.

    A firing on the step right after the last firing of the same kind extends that event
    (``count``, ``last_step``) instead of adding one, whatever fired in between.
    """

    def __init__(self, size: int = MAX_EVENTS) -> None:
        super().__init__(maxlen=size)
        self._latest: dict[str, Event] = {}  # newest event of each kind, for coalescing
        self.last: dict[str, float] = {}
        """Kind -> wall-clock time (exporter ``time.time()``, Unix s) of its latest firing,
        coalesced ones included; kept for every kind that ever fired, whatever the deque
        evicted (a rank has a few dozen kinds at most)."""

    def add(self, kind: str, step: int | None, value: float | None = None) -> None:
        """Record a firing of ``kind`` at training ``step`` (None: before any step)."""
        now = time.time()
        self.last[kind] = now
        prev = self._latest.get(kind)
        if (
            prev is not None
            and step is not None
            and prev.last_step is not None
            and 0 <= step - prev.last_step <= 1
        ):
            prev.count += 1
            prev.last_step = step
            return
        ev = Event(kind, step, now, value, 1, step)
        self.append(ev)
        self._latest[kind] = ev


STARTED_AT = time.time()
"""When this exporter process started (Unix s; when it loaded its analytics, within a second of
its start): what a client's totals are compared with (:class:`ClientTotals`)."""

CLIENT_TOTALS = (
    "dropped_disconnected",
    "dropped_backpressure",
    "dropped_encode_error",
    "dropped_in_flight",
    "alloc_retries",
    "ooms",
)
"""The totals a client keeps over its process's life and reports cumulatively: its dropped
records by reason (STEP header and TOTALS record) and its allocator's retries and OOMs (the
standard fields ``alloc_retries``, ``ooms``)."""
_FIELD_ALLOC_RETRIES = P.FIELD_ALLOC_RETRIES
_FIELD_OOMS = P.FIELD_OOMS


class _Totals(Protocol):
    """What :class:`ClientTotals` reads of a rank (a ``RankState``)."""

    pid: int
    started_at: float
    dropped_disconnected: int
    dropped_backpressure: int
    dropped_encode_error: int
    dropped_in_flight: int
    values: dict[str, float]


class ClientTotals:
    """When each total a rank's client keeps last grew, as this exporter saw it.

    A client counts its drops and its allocator's retries and OOMs over its process's life and
    sends the totals; what this exporter sees is a number, not when it grew. The time of a
    growth is when a record showed it here (``time.time()``), and what counts as growth:

    - the first totals of a client process that started before this exporter did (an exporter
      restart, or an exporter pod replaced: its clients reconnect) are a baseline, not an
      event: they were counted before this exporter existed, where an earlier exporter reported
      them or, for drops, while no exporter was there to take the records (the restart itself);
    - the first totals of a process that started after this exporter are events where above 0
      (drops before its first message, an OOM in its first step);
    - after that, each total above the last one this exporter saw from the same process is an
      event, whichever connection it came on (a reconnect to this same exporter included).

    A new process resuming the rank (another ``pid`` or ``started_at``) starts again from its
    own first totals. Only the totals a record carries are compared: the STEP header's
    disconnected and backpressure drops, the ``alloc_retries`` and ``ooms`` fields where the
    step has them, and the TOTALS record's four drop totals.
    """

    __slots__ = ("_baseline", "_process", "_seen", "_step", "last", "since")

    def __init__(self, since: float | None = None) -> None:
        self.since = STARTED_AT if since is None else since
        """The exporter's start (Unix s): processes that started before it give a baseline."""
        self._process: tuple[int, float] | None = None
        self._baseline = False
        self._seen: dict[str, float] = {}
        self._step: tuple[int, float, int, int] | None = None  # the last STEP's, compared
        self.last: dict[str, float] = {}
        """Name of :data:`CLIENT_TOTALS` -> wall-clock time (Unix s) of its latest growth."""

    def _process_of(self, s: _Totals) -> None:
        process = (s.pid, s.started_at)
        if process != self._process:
            self._process = process
            self._baseline = s.started_at < self.since
            self._seen = {}

    def _compare(self, name: str, value: float) -> None:
        seen = self._seen
        old = seen.get(name)
        seen[name] = value
        if old is None:
            if value > 0 and not self._baseline:
                self.last[name] = time.time()
        elif value > old:
            self.last[name] = time.time()

    def observe_step(self, s: _Totals, ids: tuple[int, ...]) -> None:
        """After a STEP record with field ids ``ids`` updated ``s``.

        The usual step (same process, no drop, no allocator field) returns after one tuple
        comparison: about 2 % of applying the STEP (measured against
        ``benchmarks/ingest.py``'s per-step cost in the same process).
        """
        key = (s.pid, s.started_at, s.dropped_disconnected, s.dropped_backpressure)
        if key == self._step and _FIELD_ALLOC_RETRIES not in ids and _FIELD_OOMS not in ids:
            return  # the same process, and the drops the step carries did not move
        self._step = key
        self._process_of(s)
        self._compare("dropped_disconnected", s.dropped_disconnected)
        self._compare("dropped_backpressure", s.dropped_backpressure)
        if _FIELD_ALLOC_RETRIES in ids:
            self._compare("alloc_retries", s.values["alloc_retries"])
        if _FIELD_OOMS in ids:
            self._compare("ooms", s.values["ooms"])

    def observe_totals(self, s: _Totals) -> None:
        """After a TOTALS record updated ``s``."""
        self._process_of(s)
        self._compare("dropped_disconnected", s.dropped_disconnected)
        self._compare("dropped_backpressure", s.dropped_backpressure)
        self._compare("dropped_encode_error", s.dropped_encode_error)
        self._compare("dropped_in_flight", s.dropped_in_flight)

"""Logging for the exporter process: one stderr handler whose lines are rate-limited.

Much of what the exporter logs is triggered by other processes (a refused HELLO, a crashed
rank, a malformed HTTP request), so without a limit anyone who can reach the socket or the port
could fill the disk through the log. :class:`RepeatLimiter` lets through at most
``max_repeats`` lines per call site (the same ``logger.warning(...)`` line of code, whatever
values it fills in) per ``interval`` seconds. The next line let through from that call site says
how many were suppressed, and ``trainmon_exporter_log_messages_suppressed_total{level}`` counts
them all (:class:`LogMetrics`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from prometheus_client.metrics_core import Metric

from trainmon_exporter import catalog

LEVELS = ("debug", "info", "warning", "error", "critical")
"""``level`` values of ``trainmon_exporter_log_messages_suppressed_total``."""
MAX_SITES = 1024
"""Call sites tracked at once; past it, untracked sites share one budget (a memory bound)."""
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_suppressed = dict.fromkeys(LEVELS, 0)
_suppressed_lock = threading.Lock()
_installed: RepeatLimiter | None = None


def _level(levelno: int) -> str:
    if levelno >= logging.CRITICAL:
        return "critical"
    if levelno >= logging.ERROR:
        return "error"
    if levelno >= logging.WARNING:
        return "warning"
    return "info" if levelno >= logging.INFO else "debug"


def suppressed_totals() -> dict[str, int]:
    """Log lines suppressed by every :class:`RepeatLimiter` of this process, by level."""
    with _suppressed_lock:
        return dict(_suppressed)


class RepeatLimiter(logging.Filter):
    """A handler filter: at most ``max_repeats`` lines per call site per ``interval`` seconds.

    A call site is ``(file, line, level)`` of the logging call: bounded by the code, however
    the values in the message vary. Thread-safe; O(1) per record.

    Args:
        max_repeats: lines let through per call site per interval (>= 1).
        interval: the interval, seconds.
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(
        self, max_repeats: int, interval: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.max_repeats = max_repeats
        self.interval = interval
        self.clock = clock
        self._sites: dict[tuple[str, int, int], list[float]] = {}  # -> [start, passed, dropped]
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        """Let ``record`` through, or count it as suppressed; notes earlier suppressions."""
        now = self.clock()
        key = (record.pathname, record.lineno, record.levelno)
        with self._lock:
            site = self._sites.get(key)
            if site is None:
                if len(self._sites) >= MAX_SITES:
                    self._prune(now)
                if len(self._sites) >= MAX_SITES:
                    key = ("", 0, record.levelno)  # one shared budget past the bound
                    site = self._sites.get(key)
                if site is None:
                    site = self._sites[key] = [now, 0.0, 0.0]
            if now - site[0] >= self.interval:
                dropped = int(site[2])
                site[0], site[1], site[2] = now, 0.0, 0.0
                if dropped:
                    record.msg = f"{record.msg} [{dropped} similar lines suppressed before this]"
            if site[1] < self.max_repeats:
                site[1] += 1
                return True
            site[2] += 1
        with _suppressed_lock:
            _suppressed[_level(record.levelno)] += 1
        return False

    def _prune(self, now: float) -> None:
        """Forget call sites whose interval ended with nothing suppressed."""
        stale = [k for k, s in self._sites.items() if now - s[0] >= self.interval and not s[2]]
        for k in stale:
            del self._sites[k]

    def pending(self) -> int:
        """Lines suppressed in the current intervals and not yet reported in a log line."""
        with self._lock:
            return int(sum(s[2] for s in self._sites.values()))


UVICORN_LIFECYCLE = (
    "Started server process",
    "Waiting for application startup",
    "Application startup complete",
    "Waiting for application shutdown",
    "Application shutdown complete",
    "Finished server process",
)
"""uvicorn's start and stop lines: DEBUG here, since the exporter's own lines say the same
(its ``Shutting down``, the one line that a signal was received, stays INFO)."""


class UvicornRecords(logging.Filter):
    """A filter on uvicorn's ``uvicorn.error`` logger, which logs far more than errors.

    Its records are named ``uvicorn`` (``INFO uvicorn.error: Started server process`` read
    like an error), and its start and stop lines (:data:`UVICORN_LIFECYCLE`) become DEBUG:
    the exporter's banner on stdout and its own INFO lines already say that it started and
    stopped. uvicorn's warnings and errors pass unchanged but for the name.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        """Rename ``record``; demote (and drop below DEBUG) a start or stop line."""
        record.name = "uvicorn"
        if record.levelno == logging.INFO and str(record.msg).startswith(UVICORN_LIFECYCLE):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger().isEnabledFor(logging.DEBUG)
        return True


def setup(level: str, max_repeats: int, interval: float) -> RepeatLimiter:
    """Send every logger (uvicorn's included) to one rate-limited stderr handler.

    Returns the handler's :class:`RepeatLimiter`. Run uvicorn with ``log_config=None`` so its
    loggers propagate here instead of getting handlers of their own; uvicorn's records are
    renamed and its start and stop lines demoted (:class:`UvicornRecords`).
    """
    global _installed
    limiter = _installed = RepeatLimiter(max_repeats, interval)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(limiter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    uvicorn_log = logging.getLogger("uvicorn.error")
    for old_filter in list(uvicorn_log.filters):
        if isinstance(old_filter, UvicornRecords):
            uvicorn_log.removeFilter(old_filter)
    uvicorn_log.addFilter(UvicornRecords())
    return limiter


def report_pending(log: logging.Logger) -> None:
    """Log how many lines are suppressed and not yet summed up (at shutdown)."""
    n = _installed.pending() if _installed is not None else 0
    if n:
        log.warning("%d log lines were suppressed since their last report (log_max_repeats)", n)


class LogMetrics:
    """``trainmon_exporter_log_messages_suppressed_total{level}`` for a registry."""

    def collect(self) -> Iterable[Metric]:
        """The counter family, every level from 0."""
        fam = catalog.EXPORTER_LOG_MESSAGES_SUPPRESSED.counter()
        for level, n in suppressed_totals().items():
            fam.add_metric([level], float(n))
        return [fam]

"""What the detectors fired: each rank keeps its last firings, for the API and the status page."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

__all__ = ["MAX_EVENTS", "Event", "EventLog"]

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

    def add(self, kind: str, step: int | None, value: float | None = None) -> None:
        """Record a firing of ``kind`` at training ``step`` (None: before any step)."""
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
        ev = Event(kind, step, time.time(), value, 1, step)
        self.append(ev)
        self._latest[kind] = ev

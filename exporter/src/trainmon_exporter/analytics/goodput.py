"""Where a rank's time goes: productive step time and badput by kind, in seconds.

Why this module is one module of about 520 lines: it is one account whose buckets must add up
to the wall-clock at every instant, kept by one state machine (start-up, running, down,
ended) that every event moves; split, the identity would hold only across modules.

One :class:`Goodput` per (run, rank), told by :class:`~trainmon_exporter.state.RankState` of
every step, checkpoint, evaluation, tracked operation, hang, crash, restart and rollback. It
splits the rank's wall-clock, from its trainer's ``init()`` to now (or to its finish), into
buckets that never overlap (definitions and the anchors they follow: docs/goodput.md):

- ``productive``: step time that advanced the run and was not lost later;
- badput :data:`KINDS`: ``startup`` (``init()`` to the first step of each process),
  ``data_loading`` (the waits ``Run.timed()`` measured, or ``data_time`` as logged),
  ``checkpoint_save`` and ``checkpoint_restore`` (``Run.checkpoint(seconds=...)``),
  ``evaluation`` (tracked operations named in :data:`EVALUATION_OPERATIONS`, and the time
  from a step to the ``Run.eval()`` that follows it), ``hang`` (from one usual step time
  after the last step, once the hang detector judges the rank hung, until the next step),
  ``wasted_progress`` (step time a crash or a rollback threw away),
  ``recovery`` (from a crash to the restarted process's ``init()``) and ``other`` (the rest:
  the time after the last step to a finish or a closed connection).

Clock: everything is placed on the exporter's ``time.monotonic()``. A record's own time (the
client's wall clock, same host) is mapped onto it with the offset between the two clocks read
at that moment, and clamped between the last accounted instant and now, so a wrong or
hostile clock can move time between buckets of its own rank but never make time go backward
or exceed the wall-clock.

Time is accounted interval by interval: each step closes the interval since the previous
accounted instant (the cursor). Spans reported meanwhile (a checkpoint's duration, a tracked
evaluation, a hang) take their overlap with the interval, by :data:`PRIORITY`, never twice;
the step's ``data_time`` comes out of what is left; the rest is the step's own time
(``startup`` for a process's first step). Hangs are accounted as they last (on the detector
clock), so the counters grow during a hang too.

Counters never go down, so step time is not counted ``productive`` at once: it is held as
*uncheckpointed* time (a gauge, per step) until a checkpoint covers its step (``productive``),
a clean finish (``productive``), a restart or a rollback that resumes past it (``productive``),
or one that resumes before it (``wasted_progress``). ``productive + badput + uncheckpointed``
is the wall-clock at every instant; at a finish ``uncheckpointed`` is 0. The options weighed:
docs/goodput.md#why-uncheckpointed-time-is-held-back.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

__all__ = [
    "EVALUATION_OPERATIONS",
    "KINDS",
    "MAX_PENDING_SPANS",
    "MAX_STARTUP_S",
    "MAX_UNCHECKPOINTED_RANGES",
    "PRIORITY",
    "Goodput",
]

KINDS = (
    "startup",
    "data_loading",
    "checkpoint_save",
    "checkpoint_restore",
    "evaluation",
    "hang",
    "wasted_progress",
    "recovery",
    "other",
)
"""``kind`` label values of ``trainmon_train_badput_seconds_total``, in display order."""
PRIORITY = ("checkpoint_restore", "checkpoint_save", "evaluation", "hang")
"""Which span takes an instant that two spans claim (first wins); ``data_loading``, an amount
without a position, comes out of what no span claimed."""
EVALUATION_OPERATIONS = frozenset(
    {"validation", "validate", "evaluation", "evaluate", "eval", "val"}
)
"""Tracked operation names (``Run.track``) counted as ``evaluation``."""
MAX_PENDING_SPANS = 64
"""Spans held for the next interval; the oldest beyond it are accounted at once."""
MAX_UNCHECKPOINTED_RANGES = 256
"""Step ranges held as uncheckpointed time; beyond it the two oldest are merged (a later
resume inside a merged range splits it in proportion to its steps)."""
MAX_STARTUP_S = 86_400.0
"""The earliest an ``init()`` time is believed, before the HELLO that carries it (s)."""
INPUT_WINDOW_MAXLEN = 4096
"""Steps kept for the data-loading share over the rate window."""


@dataclass(slots=True)
class _Span:
    kind: str
    start: float | None  # None: from the start of the interval that holds its end
    end: float


@dataclass(slots=True)
class Goodput:
    """The time accounting of one (run, rank); every time is exporter ``time.monotonic()``.

    Not thread-safe: its :class:`~trainmon_exporter.state.Store`'s lock guards it.
    """

    init: float
    """The first process's ``init()`` (s, monotonic)."""
    cursor: float = 0.0
    """Everything before this instant is accounted."""
    phase: str = "startup"
    """``startup`` (no step yet in this process), ``running``, ``down`` (crashed, not back)
    or ``ended`` (finished or closed)."""
    productive: float = 0.0
    badput: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    spans: list[_Span] = field(default_factory=list)
    ranges: deque[list[float]] = field(default_factory=deque)
    """Uncheckpointed step time: ``[first_step, last_step, seconds]``, in step order."""
    partial: float = 0.0
    """Step time of the step in progress accounted before it ended (a hang opened)."""
    hang_open: bool = False
    ended_at: float | None = None
    data_window: deque[tuple[float, float, float]] = field(
        default_factory=lambda: deque(maxlen=INPUT_WINDOW_MAXLEN)
    )
    """``(monotonic time, cumulative data wait, cumulative step intervals)`` per step: the
    steps of the longest window :meth:`data_share` was asked for (``rate_window_seconds``,
    read at every scrape), at most :data:`INPUT_WINDOW_MAXLEN` of them."""
    data_horizon: float = math.inf
    """The longest window :meth:`data_share` was asked for (s); older steps are let go."""
    data_total: float = 0.0
    interval_total: float = 0.0
    _op_seconds: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.cursor = self.init

    @classmethod
    def start(cls, init_wall: float, now: float, offset: float) -> Goodput:
        """A new accounting from a HELLO: ``init_wall`` its ``started_at`` (Unix s).

        ``now`` is the monotonic time of the HELLO, ``offset`` wall minus monotonic time.
        """
        return cls(init=_clamp(init_wall - offset, now - MAX_STARTUP_S, now))

    # ------------------------------------------------------------------ read

    @property
    def uncheckpointed(self) -> float:
        """Step time not yet covered by a checkpoint, a finish or a resume (s)."""
        return sum(r[2] for r in self.ranges) + self.partial

    def accounted(self) -> float:
        """``productive + badput + uncheckpointed`` (s): the wall-clock accounted so far."""
        return self.productive + sum(self.badput.values()) + self.uncheckpointed

    def totals(self) -> tuple[float, float]:
        """``(productive + uncheckpointed, accounted)`` in seconds, in O(1) per call.

        From the identity the accounting keeps, ``accounted = cursor - init``, so no sum over
        the uncheckpointed ranges (up to :data:`MAX_UNCHECKPOINTED_RANGES`) is needed: the
        store records these two after every step for the goodput sparkline.
        """
        accounted = self.cursor - self.init
        return accounted - sum(self.badput.values()), accounted

    def goodput_ratio(self) -> float | None:
        """``productive / accounted`` (None before anything is accounted).

        Uncheckpointed time counts as not yet good; :meth:`optimistic_ratio` counts it good.
        """
        total = self.accounted()
        return self.productive / total if total > 0 else None

    def optimistic_ratio(self) -> float | None:
        """``(productive + uncheckpointed) / accounted``: what the recording rules show."""
        total = self.accounted()
        return (self.productive + self.uncheckpointed) / total if total > 0 else None

    def largest_badput(self) -> tuple[str, float] | None:
        """The badput kind with the most seconds, or None while every kind is at 0."""
        kind = max(KINDS, key=self.badput.__getitem__)
        return (kind, self.badput[kind]) if self.badput[kind] > 0 else None

    def data_share(self, now: float, window_s: float) -> float | None:
        """Data waits over step time in the last ``window_s`` seconds (0..1), or None.

        Over the steps of the window (at least two, spanning step time above 0).
        """
        win = self.data_window
        if window_s > self.data_horizon or math.isinf(self.data_horizon):
            self.data_horizon = window_s
        self._forget_data(now)
        if len(win) < 2:
            return None
        horizon = now - window_s
        first = None
        for point in win:
            if point[0] >= horizon:
                first = point
                break
        last = win[-1]
        if first is None or first is last:
            return None
        span = last[2] - first[2]
        return (last[1] - first[1]) / span if span > 0 else None

    # ------------------------------------------------------------------ events

    def step(
        self,
        step: int,
        when: float,
        now: float,
        data_time: float | None,
        *,
        restarted: bool = False,
        rolled_back: bool = False,
        unseen_before: bool = False,
    ) -> None:
        """A step logged at ``when`` (monotonic, mapped from the client's clock).

        ``data_time``: the wait for its input (s), None when not reported. ``restarted``: the
        first step of a new process; ``rolled_back``: a step below the last one in the same
        process. Both resolve the uncheckpointed time: steps at or above ``step`` are wasted,
        the ones below kept. ``unseen_before``: the process logged steps this exporter never
        saw (it restarted, or started after the trainer): on the process's first step here,
        the time before it is not start-up, and the accounting starts at this step.
        """
        c = self.cursor
        if (
            self.phase == "running"
            and not self.spans
            and not self.hang_open
            and not (restarted or rolled_back)
            and c < when <= now
        ):  # the usual step: nothing else happened since the last one
            rest = when - c
            data = 0.0
            if data_time is not None and 0.0 < data_time < math.inf:
                data = data_time if data_time < rest else rest
                self.badput["data_loading"] += data
                rest -= data
            self.cursor = when
            self.data_total += data
            self.interval_total += rest + data
            self.data_window.append((when, self.data_total, self.interval_total))
            self._forget_data(when)
            self._hold(step, rest)
            return
        if restarted or rolled_back:
            self._resume(step - 1)
        if unseen_before and self.phase == "startup":
            start = _clamp(when, self.cursor, now)
            if self.init == self.cursor and not self.spans:
                self.init = start  # nothing accounted yet: this rank's clock starts here
            else:
                self.badput["other"] += start - self.cursor
            self.cursor = start
            self.phase = "running"
        t = _clamp(when, self.cursor, now)
        base = "startup" if self.phase == "startup" else "productive"
        rest = self._interval(t, base)
        data = 0.0
        if data_time is not None and math.isfinite(data_time) and data_time > 0:
            data = min(data_time, rest)
            self.badput["data_loading"] += data
            rest -= data
        if base == "startup":
            self.badput["startup"] += rest + self.partial
        else:
            self.data_total += data
            self.interval_total += rest + data + self.partial
            self.data_window.append((t, self.data_total, self.interval_total))
            self._forget_data(t)
            self._hold(step, rest + self.partial)
        self.partial = 0.0
        self.phase = "running"
        self.hang_open = False

    def checkpoint(self, step: int, when: float, seconds: float, now: float, restore: bool) -> None:
        """A checkpoint of ``step`` saved (or loaded, ``restore``), completed at ``when``.

        ``seconds`` (NaN: unknown) is a span ending at ``when``. A save makes the step time of
        every step up to ``step`` productive; a restore resumes at ``step`` (later steps are
        wasted, earlier ones kept).
        """
        end = _clamp(when, self.init, now)
        if math.isfinite(seconds) and seconds > 0:
            kind = "checkpoint_restore" if restore else "checkpoint_save"
            self._add_span(_Span(kind, max(self.init, end - seconds), end))
        if restore:
            self._resume(step)
        else:
            self._commit(step)

    def evaluation(self, when: float, now: float) -> None:
        """``Run.eval()`` at ``when``: the time since the step before it was evaluation."""
        self._add_span(_Span("evaluation", None, _clamp(when, self.init, now)))

    def operation(self, name: str, seconds_total: float, now: float) -> None:
        """A tracked operation's cumulative seconds; evaluation ones add the growth as a span."""
        if name not in EVALUATION_OPERATIONS or not math.isfinite(seconds_total):
            return
        grew = seconds_total - self._op_seconds.get(name, 0.0)
        self._op_seconds[name] = seconds_total
        if grew > 0:
            self._add_span(_Span("evaluation", max(self.init, now - grew), now))

    def hung(self, now: float, expected: float | None = None) -> None:
        """The detectors judge the rank hung at ``now``: account the hang up to ``now``.

        ``expected``: the rank's usual time between steps (s). The stuck step's first
        ``expected`` seconds are step time; the hang starts where the step should have ended
        (at the detection when ``expected`` is None), however long the detector took to be
        sure.
        """
        if self.phase != "running" or now <= self.cursor:
            return
        if not self.hang_open:
            end = now if expected is None else min(now, self.cursor + max(0.0, expected))
            self.partial += self._interval(end, "partial")
            self.hang_open = True
        self._account(self.cursor, now, "hang", None)
        self.cursor = max(self.cursor, now)

    def finish(self, now: float, ok: bool) -> None:
        """A FINISH: clean (``ok``), every uncheckpointed step is kept; failed, a crash."""
        if not ok:
            self.crash(now)
            return
        self._interval(now, "other")
        self._commit(None)
        self.phase = "ended"
        self.ended_at = now

    def crash(self, now: float) -> None:
        """The process ended without a clean finish: its step in progress is lost."""
        if self.phase in ("down", "ended"):
            return
        if self.phase == "startup":
            self.badput["startup"] += self._interval(now, "startup")
        else:
            self._interval(now, "wasted_progress")
        self.badput["wasted_progress"] += self.partial
        self.partial = 0.0
        self.phase = "down"
        self.ended_at = now
        self.hang_open = False

    def closed(self, now: float) -> None:
        """The exporter closed the connection (idle or shutdown): the rest is ``other``."""
        if self.phase in ("down", "ended"):
            return
        self._interval(now, "other")
        self.phase = "ended"
        self.ended_at = now

    def reconnect(self, init_wall: float, now: float, offset: float, same_process: bool) -> None:
        """A new HELLO for this rank: ``init_wall`` its ``started_at`` (Unix s).

        The same process (a lost connection): accounting goes on. A new one after a crash:
        ``recovery`` from the crash to its ``init()``, then its start-up.
        """
        if same_process and self.phase != "ended":
            if self.phase == "down":
                self.phase = "running"
            return
        init = _clamp(init_wall - offset, self.cursor, now)
        if self.phase == "down":
            self.badput["recovery"] += init - self.cursor
        else:
            self.badput["other"] += init - self.cursor
        self.cursor = init
        self.phase = "startup"
        self.ended_at = None
        self.hang_open = False

    # ------------------------------------------------------------------ internals

    def _forget_data(self, now: float) -> None:
        """Let go of the data-wait points no window read can reach.

        Those older than :attr:`data_horizon` before ``now``; the newest of them stays, as
        the window's start. Without it the points piled up to :data:`INPUT_WINDOW_MAXLEN` a
        rank, whatever the window: 37 MiB for 64 ranks at 10 steps/s, reached after 7 minutes
        (the soak's RSS growth, docs/reliability.md).
        """
        win = self.data_window
        horizon = now - self.data_horizon
        while len(win) > 2 and win[1][0] <= horizon:
            win.popleft()

    def _add_span(self, span: _Span) -> None:
        if span.end <= self.cursor:
            self._reclaim(span)
            return
        self.spans.append(span)
        if len(self.spans) > MAX_PENDING_SPANS:
            old = self.spans.pop(0)
            self._reclaim(old)

    def _reclaim(self, span: _Span) -> None:
        """A span that ended before the cursor: take its time back from uncheckpointed time.

        Only uncheckpointed step time of this process can move (counters never go down); a
        span over time already counted elsewhere is not counted again.
        """
        if self.phase != "running" or span.start is None:
            return
        start = span.start
        want = max(0.0, min(span.end, self.cursor) - start)
        while want > 0 and self.ranges:
            last = self.ranges[-1]
            take = min(want, last[2])
            last[2] -= take
            self.badput[span.kind] += take
            want -= take
            if last[2] <= 0:
                self.ranges.pop()
            else:
                break

    def _interval(self, t: float, base: str) -> float:
        """Account ``(cursor, t]``: spans first, the rest to ``base``; move the cursor.

        Returns the seconds left to ``base`` (added to the bucket unless ``base`` is
        ``startup``, ``productive`` or ``partial``, which the caller places).
        """
        c = self.cursor
        if t <= c:
            return 0.0
        rest = self._account(c, t, base, self.spans)
        self.cursor = t
        return rest

    def _account(self, c: float, t: float, base: str, spans: list[_Span] | None) -> float:
        covered: list[tuple[float, float]] = []
        if spans:
            keep: list[_Span] = []
            for kind in PRIORITY:
                for sp in spans:
                    if sp.kind != kind:
                        continue
                    start = c if sp.start is None else sp.start
                    lo, hi = max(start, c), min(sp.end, t)
                    if hi > lo:
                        self.badput[kind] += _uncovered(lo, hi, covered)
                        covered.append((lo, hi))
            for sp in spans:
                if sp.start is not None and sp.start < c:
                    self._reclaim(_Span(sp.kind, sp.start, min(sp.end, c)))
                if sp.end > t:
                    if sp.start is not None and sp.start < t:
                        sp.start = t
                    keep.append(sp)
            spans[:] = keep
        rest = (t - c) - _union(covered)
        if base not in ("startup", "productive", "partial"):
            self.badput[base] += rest
        return rest

    def _hold(self, step: int, seconds: float) -> None:
        ranges = self.ranges
        if ranges and ranges[-1][1] >= step:
            self._resume(step - 1)  # a step at or below a held one: the later ones are lost
        if seconds <= 0:
            return
        if ranges and ranges[-1][1] == step - 1 and len(ranges) >= MAX_UNCHECKPOINTED_RANGES:
            ranges[-1][1] = step
            ranges[-1][2] += seconds
        else:
            ranges.append([float(step), float(step), seconds])
        if len(ranges) > MAX_UNCHECKPOINTED_RANGES:
            a = ranges.popleft()
            ranges[0][0] = a[0]
            ranges[0][2] += a[2]

    def _commit(self, step: int | None) -> None:
        """Steps up to ``step`` (every step, for None) become productive."""
        ranges = self.ranges
        while ranges and (step is None or ranges[0][1] <= step):
            self.productive += ranges.popleft()[2]
        if step is not None and ranges and ranges[0][0] <= step:
            first, last, seconds = ranges[0]
            share = seconds * (step - first + 1) / (last - first + 1)
            self.productive += share
            ranges[0][0], ranges[0][2] = step + 1, seconds - share

    def _resume(self, step: int) -> None:
        """The run goes on from ``step``: later steps are wasted, the rest kept."""
        ranges = self.ranges
        while ranges and ranges[-1][0] > step:
            self.badput["wasted_progress"] += ranges.pop()[2]
        if ranges and ranges[-1][1] > step:
            first, last, seconds = ranges[-1]
            lost = seconds * (last - step) / (last - first + 1)
            self.badput["wasted_progress"] += lost
            ranges[-1][1], ranges[-1][2] = step, seconds - lost
        self._commit(None)


def _clamp(x: float, lo: float, hi: float) -> float:
    if not math.isfinite(x):
        return hi
    return lo if x < lo else hi if x > hi else x


def _uncovered(lo: float, hi: float, covered: list[tuple[float, float]]) -> float:
    """Length of ``[lo, hi]`` outside every interval of ``covered``."""
    return (hi - lo) - sum(max(0.0, min(hi, b) - max(lo, a)) for a, b in _merged(covered))


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _union(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in _merged(intervals))

"""Where a rank's time goes: productive step time and badput by kind, in seconds.

One :class:`Goodput` per (run, rank), told by :class:`~trainmon_exporter.state.rank.RankState` of
every step, checkpoint, evaluation, tracked operation, hang, crash, restart and rollback. It
splits the rank's wall-clock, from its trainer's ``init()`` to now (or to its finish), into
buckets that never overlap (definitions and the anchors they follow: docs/goodput.md):

- ``productive``: step time that advanced the run and was not lost later;
- badput :data:`KINDS`: ``startup`` (``init()`` to the first step of each process, less the
  steps that ran in it when the trainer logs every n-th step),
  ``data_loading`` (the waits ``Run.timed()`` measured, or ``data_time`` as logged),
  ``checkpoint_save`` and ``checkpoint_restore`` (``Run.checkpoint(seconds=...)``),
  ``evaluation`` (tracked operations named in :data:`EVALUATION_OPERATIONS`, and the time
  from a step to the ``Run.eval()`` that follows it), ``hang`` (from one usual step time
  after the last step, once the hang detector judges the rank hung, until the next step),
  ``wasted_progress`` (step time a crash or a rollback threw away),
  ``recovery`` (from a crash to the restarted process's ``init()``) and ``other`` (the rest:
  the time after the last step to a clean finish);
- step time not yet kept: *uncheckpointed* while the process that ran it may still keep it,
  *at risk* once that process ended without a clean finish (lost unless a restart here
  resumes past it).

Clock: everything is placed on the exporter's ``time.monotonic()``. A record's own time (the
client's wall clock, same host) is mapped onto it with the offset between the two clocks read
at that moment, and clamped between the last accounted instant and now, so a wrong or
hostile clock can move time between buckets of its own rank but never make time go backward
or exceed the wall-clock.

Time is accounted interval by interval: each step closes the interval since the previous
accounted instant (the cursor). Spans reported meanwhile (a checkpoint's duration, a tracked
evaluation, a hang) take their overlap with the interval, by :data:`PRIORITY`, never twice;
the step's ``data_time`` comes out of what is left; the rest is the step's own time. A
process's first interval holds its start-up and, when it logs every n-th step, the steps
before the first one it logs: it is split once the next step gives the time per step. Hangs
are accounted as they last (on the detector clock), so the counters grow during a hang too.

Counters never go down, so step time is not counted ``productive`` at once: it is held, per
range of steps, until a checkpoint covers its steps (``productive``), a clean finish
(``productive``), a restart or a rollback that resumes past it (``productive``), or one that
resumes before it (``wasted_progress``). A crash makes the held time *at risk*; the record
leaving the exporter (:meth:`Goodput.settle`) wastes what is still at risk.
``productive + badput + uncheckpointed + at_risk`` is the wall-clock at every instant; at a
finish the last two are 0. The options weighed:
docs/goodput.md#why-uncheckpointed-time-is-held-back.

Why this module is one module of about 700 lines: :class:`Goodput` is one ledger whose every
event (a step, a checkpoint, a span, a hang, a crash, a restart) moves time between the same
buckets under one identity; its events and the interval arithmetic they share are read and
checked together (tests/exporter/test_goodput.py checks the identity after each). Its record
in the exporter's state file is :mod:`trainmon_exporter.state.ledger`'s.
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
    "PHASES",
    "PRIORITY",
    "Goodput",
    "Span",
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
PHASES = ("startup", "running", "down", "detached", "ended")
"""``startup``: no step yet in this process; ``running``; ``down``: the connection ended
without a clean finish (a crash) and no process is back; ``detached``: the exporter closed the
connection (idle, or its own shutdown or restart) and the process is presumed alive: the time
since its last step is placed by what it reports next; ``ended``: finished."""
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
class Span:
    """A span of badput reported with its position: ``kind`` from ``start`` to ``end``."""

    kind: str
    start: float | None  # None: from the start of the interval that holds its end
    end: float


@dataclass(slots=True)
class Goodput:
    """The time accounting of one (run, rank); every time is exporter ``time.monotonic()``.

    Not thread-safe: its :class:`~trainmon_exporter.state.store.Store`'s lock guards it.
    """

    init: float
    """The first process's ``init()`` (s, monotonic)."""
    cursor: float = 0.0
    """Everything before this instant is accounted."""
    phase: str = "startup"
    """One of :data:`PHASES`."""
    productive: float = 0.0
    badput: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    spans: list[Span] = field(default_factory=list)
    ranges: deque[list[float]] = field(default_factory=deque)
    """Held step time: ``[first_step, last_step, seconds]``, in step order."""
    partial: float = 0.0
    """Step time of the step in progress accounted before it ended (a hang opened)."""
    first: list[float] | None = None
    """``[step, seconds]``: a process's first interval after its spans and data waits, held
    until the next step tells how much of it was steps rather than start-up."""
    risk: bool = False
    """The held step time is at risk: its process ended without a clean finish."""
    last_step: int | None = None
    """The last step this process logged (None: none yet)."""
    stride: int = 1
    """Steps between the rank's last two logged steps (it logs every ``stride``-th step)."""
    restored_step: int | None = None
    """The checkpoint this process restored before its first step (None: none reported)."""
    saved_step: int | None = None
    """The latest checkpoint saved (its step), by any process of the rank."""
    fresh: bool = True
    """No process of the rank ended yet: the first process counts its steps from 0."""
    data_seen: bool = False
    """The rank reported how long it waited for its input (``data_time``) at least once."""
    wire_data: float | None = None
    """This process's ``data_time_total`` in its last STEP (None: none yet)."""
    saves_seen: float = 0.0
    """This process's checkpoint save seconds from its CHECKPOINT records."""
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
    op_seconds: dict[str, float] = field(default_factory=dict)
    """The cumulative seconds of each tracked evaluation operation, as last reported."""

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
    def held(self) -> float:
        """Step time not yet kept or lost, at risk or not (s)."""
        return sum(r[2] for r in self.ranges) + self.partial + (self.first[1] if self.first else 0)

    @property
    def uncheckpointed(self) -> float:
        """Held step time whose process may still keep it (s; 0 while it is at risk).

        Step time not yet covered by a checkpoint, a clean finish or a resume past its step.
        """
        return 0.0 if self.risk else self.held

    @property
    def at_risk(self) -> float:
        """Held step time of a process that ended without a clean finish (s).

        Lost unless a restart here resumes past it.
        """
        return self.held if self.risk else 0.0

    def accounted(self) -> float:
        """``productive + badput + uncheckpointed + at_risk`` (s): the wall-clock accounted."""
        return self.productive + sum(self.badput.values()) + self.held

    def totals(self) -> tuple[float, float]:
        """``(productive + uncheckpointed, accounted)`` in seconds, in O(1) per call.

        From the identity the accounting keeps, ``accounted = cursor - init``, so no sum over
        the held ranges (up to :data:`MAX_UNCHECKPOINTED_RANGES`) is needed while nothing is
        at risk: the store records these two after every step for the goodput sparkline.
        """
        accounted = self.cursor - self.init
        good = accounted - sum(self.badput.values())
        return (good - self.held if self.risk else good), accounted

    def goodput_ratio(self) -> float | None:
        """``productive / accounted`` (None before anything is accounted).

        Uncheckpointed time counts as not yet good; :meth:`optimistic_ratio` counts it good.
        """
        total = self.accounted()
        return self.productive / total if total > 0 else None

    def optimistic_ratio(self) -> float | None:
        """``(productive + uncheckpointed) / accounted``: what the recording rules show.

        Time at risk counts as lost.
        """
        total = self.accounted()
        return (self.productive + self.uncheckpointed) / total if total > 0 else None

    def lost(self) -> dict[str, float]:
        """Badput by kind as the rules count it: time at risk is ``wasted_progress``."""
        out = dict(self.badput)
        if self.risk:
            out["wasted_progress"] += self.held
        return out

    def largest_badput(self) -> tuple[str, float] | None:
        """The badput kind with the most seconds (at risk counted as wasted), or None at 0."""
        lost = self.lost()
        kind = max(KINDS, key=lost.__getitem__)
        return (kind, lost[kind]) if lost[kind] > 0 else None

    def data_share(self, now: float, window_s: float) -> float | None:
        """Data waits over step time in the last ``window_s`` seconds (0..1), or None.

        Over the steps of the window (at least two, spanning step time above 0). None for a
        rank that never reported its data waits: not measured is not 0.
        """
        win = self.data_window
        if window_s > self.data_horizon or math.isinf(self.data_horizon):
            self.data_horizon = window_s
        self._forget_data(now)
        if len(win) < 2 or not self.data_seen:
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
        data_total: float | None = None,
        saved: tuple[float, float] | None = None,
        lost: bool = False,
    ) -> None:
        """A step logged at ``when`` (monotonic, mapped from the client's clock).

        ``data_time``: the wait for its input (s), None when not reported. ``restarted``: the
        first step of a new process; ``rolled_back``: a step below the last one in the same
        process. Both resolve the held time: a run that logs every ``stride``-th step resumed
        from ``step - stride``; later steps are wasted, the ones before kept. ``unseen_before``:
        the process logged steps this exporter never saw (it started after the trainer, with
        no record of it): on the process's first step here, the time before it is not
        start-up, and the accounting starts at this step.

        The process's running totals, when its client sends them, make up for its records
        this exporter never got (``lost``: the STEP says steps or records went missing
        since the last one, or this exporter restarted): ``data_total`` (its
        ``data_time_total``) gives the waits of every step since the last one seen, and
        ``saved`` (its ``checkpoint_step`` and ``checkpoint_time_total``) the checkpoints: the
        step saved last is kept, and save seconds no CHECKPOINT record brought are a save in
        this step's interval.
        """
        c = self.cursor
        if data_time is not None:
            self.data_seen = True
        if data_total is not None and math.isfinite(data_total):
            prev = self.wire_data
            if prev is not None and not restarted and data_total >= prev:
                data_time = data_total - prev  # every wait since the last STEP seen
            self.wire_data = data_total
        save = 0.0
        if saved is not None and lost and saved[1] > self.saves_seen + 1e-6:
            save = saved[1] - self.saves_seen  # seconds of saves whose records were lost
            self.saves_seen = saved[1]
        if (
            self.phase == "running"
            and not self.spans
            and not self.hang_open
            and self.first is None
            and not (restarted or rolled_back or save)
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
            back = step - max(1, self.stride)
            self._resume(back)
            if rolled_back:
                self.last_step = back if back >= 0 else None
        if unseen_before and self.phase == "startup":
            start = _clamp(when, self.cursor, now)
            if self.init == self.cursor and not self.spans:
                self.init = start  # nothing accounted yet: this rank's clock starts here
            else:
                self.badput["other"] += start - self.cursor
            self.cursor = start
            self.phase = "running"
            self.last_step = step
        t = _clamp(when, self.cursor, now)
        startup = self.phase == "startup"
        rest = self._interval(t, "startup" if startup else "productive")
        if save:
            save = min(save, rest)
            self.badput["checkpoint_save"] += save
            rest -= save
        data = 0.0
        if data_time is not None and math.isfinite(data_time) and data_time > 0:
            data = min(data_time, rest)
            self.badput["data_loading"] += data
            rest -= data
        if startup:
            self._settle_first()
            if self._steps_before(step) > 1:
                # Start-up, and the steps before this one that ran in it: split at the next step.
                self.first = [float(step), rest + self.partial]
            else:
                self.badput["startup"] += rest + self.partial
            self.last_step = step
        else:
            held = rest + self.partial
            self.data_total += data
            self.interval_total += held + data
            self.data_window.append((t, self.data_total, self.interval_total))
            self._forget_data(t)
            if self.first is not None:
                self._split_first(step, held)
            self._hold(step, held)
        if saved is not None and lost and saved[0] > (self.saved_step or -1):
            self.saved_step = int(saved[0])  # a save whose record was lost
            self._commit(self.saved_step)
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
            self._add_span(Span(kind, max(self.init, end - seconds), end))
        if restore:
            self._resume(step)
            if self.phase == "startup":
                self.restored_step = step
            else:
                self.last_step = step  # a reload mid-run: the run goes on after ``step``
        else:
            self.saved_step = step if self.saved_step is None else max(self.saved_step, step)
            if math.isfinite(seconds) and seconds > 0:
                self.saves_seen += seconds
            self._commit(step)

    def evaluation(self, when: float, now: float) -> None:
        """``Run.eval()`` at ``when``: the time since the step before it was evaluation.

        Before the first step of a process there is no step before it: where the evaluation
        began is unknown, and its time stays start-up (a tracked evaluation, ``Run.track``,
        is placed from its own duration).
        """
        if self.phase != "running":
            return
        self._add_span(Span("evaluation", None, _clamp(when, self.init, now)))

    def operation(self, name: str, seconds_total: float, now: float) -> None:
        """A tracked operation's cumulative seconds; evaluation ones add the growth as a span."""
        if name not in EVALUATION_OPERATIONS or not math.isfinite(seconds_total):
            return
        grew = seconds_total - self.op_seconds.get(name, 0.0)
        self.op_seconds[name] = seconds_total
        if grew > 0:
            self._add_span(Span("evaluation", max(self.init, now - grew), now))

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
        """A FINISH: clean (``ok``), every held step is kept; failed, a crash."""
        if not ok:
            self.crash(now)
            return
        self._interval(now, "other")
        self._settle_first()
        self._commit(None)
        self.partial = 0.0
        self.risk = False
        self.phase = "ended"
        self.ended_at = now

    def crash(self, now: float) -> None:
        """The process ended without a clean finish: its step in progress is lost.

        What it held is at risk.
        """
        if self.phase in ("down", "ended", "detached"):
            return
        if self.phase == "startup":
            self.badput["startup"] += self._interval(now, "startup")
        else:
            self._interval(now, "wasted_progress")
        self.badput["wasted_progress"] += self.partial
        self.partial = 0.0
        self._settle_first()
        self.risk = bool(self.ranges)
        self.phase = "down"
        self.ended_at = now
        self.hang_open = False

    def closed(self, now: float) -> None:
        """The exporter closed the connection (idle, shutdown or restart).

        The process is presumed alive: what it reports next places the time since its last
        step.
        """
        if self.phase in ("down", "ended", "detached"):
            return
        self.phase = "detached"
        self.ended_at = now
        self.hang_open = False

    def reconnect(self, init_wall: float, now: float, offset: float, same_process: bool) -> None:
        """A new HELLO for this rank: ``init_wall`` its ``started_at`` (Unix s).

        The same process (a lost connection, or this exporter restarted): accounting goes on.
        A new one: ``recovery`` from the crash (or the last instant known of a process that
        went away unseen) to its ``init()``, then its start-up.
        """
        if same_process and self.phase != "ended":
            if self.phase in ("down", "detached"):
                self.phase = "startup" if self.last_step is None else "running"
                self.risk = False
                self.ended_at = None
            return
        init = _clamp(init_wall - offset, self.cursor, now)
        if self.phase in ("down", "detached"):
            self.badput["recovery"] += init - self.cursor
        else:
            self.badput["other"] += init - self.cursor
        self._settle_first()
        self.badput["wasted_progress"] += self.partial
        self.partial = 0.0
        self.risk = bool(self.ranges)  # the old process is gone: a resume decides
        self.cursor = init
        self.phase = "startup"
        self.ended_at = None
        self.hang_open = False
        self.last_step = None
        self.restored_step = None
        self.fresh = False
        self.wire_data = None
        self.saves_seen = 0.0
        self.spans.clear()
        self.op_seconds.clear()  # the new process counts its operations from 0

    def settle(self) -> None:
        """The record leaves the exporter's live ranks (expiry): time it holds is lost."""
        self._settle_first()
        if self.phase == "ended":
            return
        self.badput["wasted_progress"] += self.partial
        self.partial = 0.0
        self._resume(-1)  # every held step is after "step -1": wasted
        if self.phase in ("running", "startup"):
            self.phase = "detached"

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

    def _add_span(self, span: Span) -> None:
        if span.end <= self.cursor:
            self._reclaim(span)
            return
        self.spans.append(span)
        if len(self.spans) > MAX_PENDING_SPANS:
            old = self.spans.pop(0)
            self._reclaim(old)

    def _reclaim(self, span: Span) -> None:
        """A span that ended before the cursor: take its time back from held step time.

        Only held step time of this process can move (counters never go down); a span over
        time already counted elsewhere is not counted again.
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

    def _account(self, c: float, t: float, base: str, spans: list[Span] | None) -> float:
        covered: list[tuple[float, float]] = []
        if spans:
            keep: list[Span] = []
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
                    self._reclaim(Span(sp.kind, sp.start, min(sp.end, c)))
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
        """Hold ``seconds`` of step time for the steps since the last logged one to ``step``."""
        ranges = self.ranges
        last = self.last_step
        if ranges and ranges[-1][1] >= step:
            self._resume(step - 1)  # a step at or below a held one: the later ones are lost
        if last is not None and last < step:
            self.stride = step - last
            first = last + 1
        else:
            first = step
        self.last_step = step
        if seconds <= 0:
            return
        if ranges and ranges[-1][1] == first - 1 and len(ranges) >= MAX_UNCHECKPOINTED_RANGES:
            ranges[-1][1] = step
            ranges[-1][2] += seconds
        else:
            ranges.append([float(first), float(step), seconds])
        if len(ranges) > MAX_UNCHECKPOINTED_RANGES:
            a = ranges.popleft()
            ranges[0][0] = a[0]
            ranges[0][2] += a[2]

    def _split_first(self, step: int, held: float) -> None:
        """The second step of a process: split its first interval into start-up and steps.

        ``held``: this step's own time, over the ``step - first step`` steps it covers, gives
        the time per step. The first interval covered ``n`` steps: from the checkpoint the
        process restored (or step 0 for a rank's first process) to its first logged step, at
        most as many as this interval; without either, as many. The first of them is start-up
        (where it began is not observed: it holds compilation and warm-up); ``n - 1`` step
        times are step time, the rest start-up.
        """
        assert self.first is not None
        s1, seconds = int(self.first[0]), self.first[1]
        self.first = None
        stride = step - s1
        if stride <= 1 or held <= 0:
            self.badput["startup"] += seconds
            return
        n = min(stride, self._steps_before(s1))
        steps = min(seconds, (n - 1) * held / stride)
        self.badput["startup"] += seconds - steps
        if steps > 0:
            self.ranges.appendleft([float(s1 - n + 2), float(s1), steps])
            if self.saved_step is not None and self.saved_step >= s1 - n + 2:
                self._commit(self.saved_step)

    def _steps_before(self, step: int) -> int:
        """How many steps a process's first interval may hold, up to its first logged ``step``.

        From the checkpoint it restored (or step 0, for the rank's first process) when known;
        else the rank's stride (1 until it logged two steps).
        """
        base = self.restored_step if self.restored_step is not None else (0 if self.fresh else None)
        return max(1, self.stride if base is None else step - base)

    def _settle_first(self) -> None:
        """A first interval that no second step splits is start-up."""
        if self.first is not None:
            self.badput["startup"] += self.first[1]
            self.first = None

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
        self._settle_first()
        ranges = self.ranges
        while ranges and ranges[-1][0] > step:
            self.badput["wasted_progress"] += ranges.pop()[2]
        if ranges and ranges[-1][1] > step:
            first, last, seconds = ranges[-1]
            lost = seconds * (last - step) / (last - first + 1)
            self.badput["wasted_progress"] += lost
            ranges[-1][1], ranges[-1][2] = step, seconds - lost
        self._commit(None)
        self.risk = False


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

"""Judgements on the detector clock, across every rank: hangs, throughput, leaks, stragglers.

Steps judge themselves as they arrive (:class:`~.detectors.RankAnalytics`); what depends on
time passing without steps, or on the other ranks of a run, is judged here, periodically.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Protocol, TypeVar

from trainmon_exporter.analytics.detectors import RankAnalytics
from trainmon_exporter.analytics.goodput import Goodput

__all__ = ["RankClock", "RunAnalytics", "stepping"]


class RankClock(Protocol):
    """What the periodic judgement reads of a rank (a :class:`~.state.rank.RankState`)."""

    @property
    def run_key(self) -> str:
        """The rank's run as the store keys it: ``namespace/run`` in a namespace, else the id.

        Stragglers are judged among the ranks of one run, never across namespaces.
        """

    @property
    def connected(self) -> bool:
        """Whether its trainer is connected now."""

    @property
    def status(self) -> str:
        """``running`` until its client sent FINISH (``finished``, ``failed``) or it crashed."""

    @property
    def last_step_mono(self) -> float | None:
        """When its last step arrived, on the exporter's monotonic clock (s); None before one.

        Never the client's wall time, which NTP or an operator can step.
        """

    @property
    def quiet_since_mono(self) -> float | None:
        """Its last sign of progress (s); None before its first step.

        When its last step arrived, or its last tracked operation ended, or its last
        evaluation or checkpoint arrived, whichever is latest. On the exporter's monotonic
        clock, never the client's wall time, which NTP or an operator can step.
        """

    @property
    def goodput(self) -> Goodput:
        """Its time accounting, whose ``phase`` says whether its process has stepped yet.

        A new process after a crash connects again before its first step: until that step
        (phase ``startup``), ``last_step_mono`` is the dead process's, and the time since is
        the crash and the new process's start-up (loading its checkpoint), not a hang.
        """

    @property
    def analytics(self) -> RankAnalytics:
        """Its detectors."""

    def busy(self) -> bool:
        """Whether a tracked operation runs now (a rank in validation is not hung)."""


R = TypeVar("R", bound=RankClock)


def stepping(rank: RankClock) -> bool:
    """Whether ``rank`` runs now: connected, and its process has logged a step.

    Before that (no step yet, or a new process after a crash, loading its checkpoint), its
    time without a step is start-up, which goodput accounts as ``recovery`` and ``startup``:
    neither a hang nor overdue.
    """
    return rank.connected and rank.last_step_mono is not None and rank.goodput.phase != "startup"


class RunAnalytics:
    """Judges every rank on the detector clock (the exporter ticks every 0.1 s).

    Hangs on every tick; throughput drops, memory leaks and stragglers on ``rates`` ticks
    (medians over hundreds of steps, so judged less often: every 1 s). A rank that is not
    running (disconnected, finished, or its process has not stepped yet: :func:`stepping`) is
    neither hung nor compared (:meth:`RankAnalytics.stopped`).
    """

    @staticmethod
    def straggler_ratios(recent: Sequence[float]) -> list[float | None]:
        """Each rank's ratio to the others of its run: leave-one-out, so two ranks work too.

        ``recent``: the recent median step time of each rank of one run (s). A rank's ratio is
        its own over the median of the *other* ranks' (None where that median is not above 0,
        e.g. a rank alone in its run).
        """
        ratios: list[float | None] = []
        for i, mine in enumerate(recent):
            others = [*recent[:i], *recent[i + 1 :]]
            median = statistics.median(others) if others else 0.0
            ratios.append(mine / median if median > 0 else None)
        return ratios

    def check(
        self, ranks: Iterable[R], now_mono: float, *, rates: bool = True
    ) -> list[tuple[R, str]]:
        """Judge ``ranks`` at ``now_mono`` (the exporter's ``time.monotonic()``, s).

        A hang is ``now_mono - quiet_since_mono`` over the limit: both on one monotonic clock,
        so a wall clock stepped forward (NTP, a VM resumed) is no hang; and counted from the
        end of a tracked operation (a checkpoint save, an evaluation) when that came after the
        last step, so the rank has its usual step time to step again after one.

        Returns the ``(rank, kind)`` episodes that just started (``hang``,
        ``throughput_drop``, ``memory_leak``, ``straggler``), each also counted and kept as an
        event by the rank's detectors.
        """
        started: list[tuple[R, str]] = []
        runs: dict[str, list[tuple[R, float]]] = {}
        for s in ranks:
            a = s.analytics
            quiet = s.quiet_since_mono
            if quiet is None or not stepping(s) or s.status != "running":  # ended: no hang
                a.stopped()
                continue
            if a.check_hang(now_mono - quiet, s.busy()):
                started.append((s, "hang"))
            if not rates:
                continue
            if a.check_throughput():
                started.append((s, "throughput_drop"))
            if a.check_memory():
                started.append((s, "memory_leak"))
            recent = a.recent_step_time()
            if recent is not None:
                runs.setdefault(s.run_key, []).append((s, recent))
        for members in runs.values():
            ratios = self.straggler_ratios([recent for _, recent in members])
            for (s, _), ratio in zip(members, ratios, strict=True):
                if s.analytics.set_straggler(ratio):
                    started.append((s, "straggler"))
        return started

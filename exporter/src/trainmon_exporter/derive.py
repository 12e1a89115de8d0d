"""Read-side figures and verdicts: what a rank's state means, derived when it is read.

Collectors and the JSON API ask here, so each figure has one definition: the rates over the
rate window, MFU (the join of a rank to its GPU), how overdue the next step is, the
read-side verdicts on evaluations and monitoring cost, and the health findings the API and
the status page list. Nothing here changes state; every function is called under
:attr:`Store.lock <trainmon_exporter.state.store.Store.lock>` (a scrape or a snapshot holds it) and
costs microseconds.

Verdicts that depend on time passing or on other ranks (hangs, throughput drops, stragglers)
are the detectors' (:mod:`trainmon_exporter.analytics`); here they are only read.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_right
from collections.abc import Mapping
from typing import NamedTuple, Protocol, TypeVar

from trainmon_exporter.analytics import RankAnalytics, stepping
from trainmon_exporter.peaks import Mfu, rank_mfu
from trainmon_exporter.settings import AnalyticsSettings
from trainmon_exporter.state.evidence import GpuEvidence
from trainmon_exporter.state.rank import HistoryPoint, RankState

__all__ = [
    "MARK_KINDS",
    "MIN_RATE_SPAN_S",
    "TREND_POINTS",
    "Rates",
    "SampledGpu",
    "findings",
    "gpu_evidence",
    "input_bound",
    "mfu",
    "over_budget",
    "overdue_ratio",
    "overfitting",
    "process_pid",
    "rates",
    "slow_improvement",
    "stopped",
    "trend",
    "trend_input",
]

MIN_RATE_SPAN_S = 0.5
"""Rates need steps spanning at least this long (s); shorter spans say nothing useful."""


class Rates(NamedTuple):
    """A rank's rates over the rate window (``rate_window_seconds``)."""

    tokens_per_second: float
    samples_per_second: float
    client_overhead_ratio: float
    """Share of wall time the client cost its trainer."""
    monitoring_ratio: float
    """The client's share plus tracked operations (``Run.track``)."""


def stopped(state: RankState) -> bool:
    """Whether the rank does no work now: finished, failed, crashed, or its connection closed.

    Such a rank has no current throughput: it is not running at its last speed.
    """
    return not state.connected or state.status != "running"


def rates(state: RankState, now: float, window_s: float) -> Rates | None:
    """The rank's :class:`Rates` at wall time ``now`` (Unix s); None before they mean anything.

    Formula: Δ cumulative total / Δ client wall time between the oldest and the newest step
    inside the window. None before the window spans :data:`MIN_RATE_SPAN_S`. When the newest
    step is older than the window, or the rank :func:`stopped` (finished, failed, crashed or
    disconnected), all are 0: a stopped rank shows 0, not its last speed.
    """
    win = state.window
    if len(win) < 2:
        return None
    if stopped(state):
        return Rates(0.0, 0.0, 0.0, 0.0)
    first, last = win[0], win[-1]
    dt = last.time - first.time
    if dt < MIN_RATE_SPAN_S:  # e.g. two steps 1 ms apart, the first paying the connect
        return None
    if now - last.time > window_s:
        return Rates(0.0, 0.0, 0.0, 0.0)
    return Rates(
        (last.tokens - first.tokens) / dt,
        (last.samples - first.samples) / dt,
        (last.overhead - first.overhead) / dt,
        (last.monitoring - first.monitoring) / dt,
    )


class SampledGpu(Protocol):
    """What the MFU join reads of a sampled GPU (the NVML sampler's per-GPU sample)."""

    @property
    def name(self) -> str:
        """NVML's product name."""

    @property
    def pci_device_id(self) -> int:
        """PCI device id (0: unknown)."""


G = TypeVar("G", bound=SampledGpu)


def mfu(
    state: RankState,
    tokens_per_second: float | None,
    gpus: Mapping[str, G],
    override: float | None,
) -> tuple[Mfu, G | None]:
    """A rank's MFU (:func:`trainmon_exporter.peaks.rank_mfu`) and the GPU it joined to.

    ``gpus``: the sampled GPUs by UUID; the join key is the UUID the client reports, never a
    device index. ``override``: the ``peak_flops`` setting.
    """
    g = gpus.get(state.gpu_uuid) if state.gpu_uuid else None
    m = rank_mfu(
        tokens_per_second,
        state.flops_per_token,
        state.dtype,
        state.gpu_uuid,
        None if g is None else (g.name, g.pci_device_id),
        override,
    )
    return m, g


class GpuReadingsLike(Protocol):
    """What the hang evidence reads of a GPU's readings (``sampler.GpuReadings``)."""

    @property
    def power_usage_watts(self) -> float | None: ...
    @property
    def power_limit_watts(self) -> float | None: ...
    @property
    def sm_active_ratio(self) -> float | None: ...


def gpu_evidence(readings: GpuReadingsLike | None) -> GpuEvidence | None:
    """A hung rank's GPU as evidence: power, its limit and SM activity (GPM), not utilisation.

    ``readings``: the rank's GPU in the sampler's last pass (joined on the client's UUID), or
    None. None when none of the three was read.
    """
    if readings is None:
        return None
    ev = GpuEvidence(
        readings.power_usage_watts, readings.power_limit_watts, readings.sm_active_ratio
    )
    return None if ev == GpuEvidence(None, None, None) else ev


def process_pid(state: RankState) -> int:
    """The PID to look the rank's process up by in NVML's process list.

    The kernel's (``SO_PEERCRED``, in the exporter's PID namespace), else the client's own.
    """
    return state.peer_pid or state.pid


def overdue_ratio(state: RankState, now_mono: float) -> float | None:
    """Seconds since the rank's last step over its median time between steps, while connected.

    Both on the exporter's monotonic clock (``now_mono``, ``last_step_mono``), as hangs are.

    1: a step is about due. None while disconnected, before its process logged a step
    (:func:`~trainmon_exporter.analytics.stepping`: a new process after a crash is starting,
    not late), or before the median.
    """
    median = state.analytics.median_interval()
    last = state.last_step_mono
    if last is None or not median or not stepping(state):
        return None
    return max(0.0, now_mono - last) / median


def slow_improvement(a: RankAnalytics) -> bool | None:
    """Whether the last evaluation improved by less than ``eval_slow_improvement``."""
    improvement = a.eval_improvement()
    return None if improvement is None else improvement < a.cfg.eval_slow_improvement


def overfitting(a: RankAnalytics) -> bool | None:
    """Whether the generalization gap exceeds ``eval_overfit_gap``."""
    gap = a.eval_gap()
    return None if gap is None else gap > a.cfg.eval_overfit_gap


def over_budget(monitoring_ratio: float, cfg: AnalyticsSettings) -> bool:
    """Whether monitoring costs more than ``monitoring_budget_ratio`` of wall time."""
    return monitoring_ratio > cfg.monitoring_budget_ratio


def input_bound(state: RankState, window_s: float, cfg: AnalyticsSettings) -> bool | None:
    """Whether the rank waits for its input above ``input_bound_ratio`` of its step time.

    Over the steps of the last ``window_s`` seconds (the rate window), from the waits
    ``Run.timed()`` measured or ``data_time`` reported (:meth:`Goodput.data_share
    <trainmon_exporter.analytics.goodput.Goodput.data_share>`). False for a rank that
    :func:`stopped`; None before two steps with a data wait fall in the window.
    """
    if stopped(state):
        return False
    share = state.goodput.data_share(time.monotonic(), window_s)
    return None if share is None else share > cfg.input_bound_ratio


def findings(state: RankState, m: Mfu) -> list[str]:
    """The problems seen on a rank, one human-readable line each (empty: none).

    ``m``: the rank's MFU (:func:`mfu`); above 1 it is a finding, since no GPU beats its
    dense peak: an input is wrong.
    """
    out = []
    nonfinite = state.nonfinite
    if nonfinite["loss"] or nonfinite["grad_norm"]:
        out.append(
            f"non-finite values: loss x{nonfinite['loss']}, grad_norm x{nonfinite['grad_norm']}"
        )
    if state.status == "crashed":
        out.append("disconnected without finishing (crashed or killed)")
    elif state.status == "failed":
        out.append("finished with an uncaught exception")
    a = state.analytics
    if a.hung:
        out.append("hung: no step for longer than usual")
    if a.throughput_dropped:
        out.append("throughput dropped")
    if a.straggling:
        out.append("straggler")
    if m.mfu is not None and m.mfu > 1.0:
        out.append("MFU above 100 %: check flops per token, tokens per step and the peak")
    lost = (
        state.dropped_disconnected
        + state.dropped_backpressure
        + state.dropped_encode_error
        + state.dropped_in_flight
    )
    if lost:
        out.append(f"client dropped {lost} messages")
    if state.unapplied_total:
        out.append(f"{state.unapplied_total} messages sent here were never applied")
    return out


TREND_POINTS = 60
"""Points of a rank's :func:`trend`: its recent steps (``state.HISTORY_STEPS``), grouped."""
MARK_KINDS = ("nonfinite", "spike", "hang", "restart")
"""What a trend point can be marked with: a NaN or infinite loss, a loss spike (any
severity), a hang after the step, the first step after a restart or rollback."""


class Trend(NamedTuple):
    """A rank's recent steps for a sparkline, oldest first, one entry per point.

    A point groups consecutive logged steps (one step while the rank has logged at most
    ``points`` of them).
    """

    steps: list[int]
    """The last training step of each point."""
    loss: list[float | None]
    """Mean of the point's finite losses; None when it has none (none logged, or NaN only)."""
    tokens_per_second: list[float | None]
    """Δ tokens / Δ client wall time over the point's steps, each measured from the step
    before it; None without a measurable interval or when the rank never logged tokens."""
    marks: list[tuple[int, str, int]]
    """``(point index, kind, step)`` with ``kind`` one of :data:`MARK_KINDS`, by index."""
    goodput: list[float | None]
    """The rank's goodput ratio so far at the point's last step: (productive +
    uncheckpointed) / accounted wall-clock seconds, as the goodput column and
    ``Goodput.optimistic_ratio`` (:mod:`.analytics.goodput`, recorded in ``state.history``);
    None while nothing is accounted."""


class TrendInput(NamedTuple):
    """What :func:`trend` reads of a rank, copied under the store lock (:func:`trend_input`)."""

    history: list[HistoryPoint]
    events: list[tuple[str, int | None, float]]
    """``(kind, step, time)`` of the rank's detector events that mark a trend."""


def trend_input(state: RankState) -> TrendInput:
    """Copy what :func:`trend` needs from ``state`` (call under the lock; a list copy)."""
    return TrendInput(
        list(state.history),
        [
            (e.kind, e.step, e.time)
            for e in state.analytics.events
            if e.kind == "hang" or e.kind.startswith("loss_spike_")
        ],
    )


def _finite_mean(values: list[float]) -> float:
    """The mean of finite ``values``, finite where their sum overflows (1e308 twice).

    It is kept within their range, which rounding can step past.
    """
    m = sum(values) / len(values)
    if not math.isfinite(m):
        m = sum(v / len(values) for v in values)
    return min(max(m, min(values)), max(values))


def trend(state: RankState | TrendInput, points: int = TREND_POINTS) -> Trend:
    """The rank's last logged steps (``state.history``) as at most ``points`` points.

    Marks come from the history (non-finite losses, restarts) and from the rank's detector
    events (``loss_spike_*``, ``hang``), each placed on the point holding its step. Costs
    O(history); pass a :func:`trend_input` copied under the store lock to compute it after
    the lock is released.
    """
    given = state if isinstance(state, TrendInput) else trend_input(state)
    h = given.history
    n = len(h)
    if not n:
        return Trend([], [], [], [], [])
    m = min(points, n)
    bounds = [i * n // m for i in range(m + 1)]
    has_tokens = h[-1].tokens > 0 or h[0].tokens > 0
    steps: list[int] = []
    loss: list[float | None] = []
    tps: list[float | None] = []
    good: list[float | None] = []
    marks: dict[tuple[int, str], int] = {}
    for c in range(m):
        lo, hi = bounds[c], bounds[c + 1]
        finite: list[float] = []
        for p in h[lo:hi]:
            if p.loss is not None:
                if math.isfinite(p.loss):
                    finite.append(p.loss)
                else:
                    marks.setdefault((c, "nonfinite"), p.step)
            if p.restarted:
                marks.setdefault((c, "restart"), p.step)
        dtok = dt = 0.0
        for j in range(max(lo, 1), hi):
            a, b = h[j - 1], h[j]
            if not b.restarted and b.time > a.time and b.tokens >= a.tokens:
                dt += b.time - a.time
                dtok += b.tokens - a.tokens
        steps.append(h[hi - 1].step)
        loss.append(_finite_mean(finite) if finite else None)
        tps.append(dtok / dt if dt > 0 and has_tokens else None)
        last = h[hi - 1]
        good.append(last.good / last.accounted if last.accounted > 0 else None)
    by_step: dict[int, list[int]] = {}
    for j, p in enumerate(h):
        by_step.setdefault(p.step, []).append(j)
    for kind_name, step, when in given.events:
        kind = "hang" if kind_name == "hang" else "spike"
        found = by_step.get(step) if step is not None else None
        if not found:
            continue
        # After a rollback a step number can repeat: the newest point logged before the event.
        j = next((j for j in reversed(found) if h[j].time <= when + 1.0), found[-1])
        marks.setdefault((bisect_right(bounds, j) - 1, kind), h[j].step)
    ordered = sorted(marks.items(), key=lambda kv: (kv[0][0], MARK_KINDS.index(kv[0][1])))
    return Trend(steps, loss, tps, [(c, kind, step) for (c, kind), step in ordered], good)

"""Per-rank detectors: :class:`RankAnalytics` judges every step, watch check and evaluation.

It owns its state transitions (episodes start and end here) and exposes read-only verdicts;
the formulas are in :mod:`trainmon_exporter.analytics`.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections import deque

from trainmon_client import _protocol as P
from trainmon_exporter.analytics.events import ClientTotals, EventLog
from trainmon_exporter.analytics.stats import RollingStats, is_outlier, judge_spike, least_squares
from trainmon_exporter.settings import SEVERITIES, AnalyticsSettings

__all__ = ["RankAnalytics"]


class RankAnalytics:
    """Per-rank detector state; :meth:`observe_step` costs a few microseconds."""

    def __init__(self, cfg: AnalyticsSettings) -> None:
        self.cfg = cfg
        self._slope_key: tuple[int, tuple[float, float]] | None = None
        self._slope: float | None = None
        self.ema: float | None = None
        self.loss_stats = RollingStats(cfg.window_steps)
        self.grad_stats = RollingStats(cfg.window_steps)  # grad norms, for the mean
        self.grad_log_stats = RollingStats(cfg.window_steps)  # log grad norms, for z-scores
        self.loss_z = math.nan
        self.grad_z = math.nan
        self.loss_ratio = math.nan
        self.loss_spikes = dict.fromkeys(SEVERITIES, 0)
        self._loss_streak = 0  # consecutive loss spikes kept out of the window
        self._grad_streak = 0
        self.grad_spikes = dict.fromkeys(SEVERITIES, 0)
        self.explosions = 0
        self.vanishing = 0
        self.step_times: deque[float] = deque(maxlen=cfg.step_time_window_steps)  # per step
        self.intervals: deque[float] = deque(maxlen=cfg.step_time_window_steps)  # per log()
        self.restarts = 0
        self.rates: deque[float] = deque(maxlen=cfg.throughput_baseline_steps)
        self.trend: deque[tuple[int, float]] = deque(maxlen=cfg.trend_window_steps)
        self.memory: deque[tuple[int, float]] = deque(maxlen=cfg.leak_window_steps)
        self.memory_growth: float | None = None  # bytes per step, least squares
        self.leaking = False
        self.leaks = 0
        self.hung = False
        self.hangs = 0
        self.evals: deque[float] = deque(maxlen=max(cfg.eval_plateau_evals, 2))
        self.eval_total = 0
        self.eval_loss: float | None = None
        self.last_step: int | None = None
        self.events = EventLog()
        self.totals = ClientTotals()  # when the client's own totals last grew
        self.rollback_times: deque[float] = deque(maxlen=cfg.rollback_repeats)
        """Wall-clock times (Unix s) of the rank's latest ``rollback_repeats`` rollbacks."""
        self.throughput_dropped = False
        self.throughput_drops = 0
        self.straggling = False
        self.straggler: float | None = None  # last run-level ratio (RunAnalytics.check)
        self.straggler_episodes = 0
        self.update_high = 0
        self.update_low = 0
        self.gain_mean: float | None = None
        self.gain_baseline: float | None = None
        self.gain_drift: float | None = None
        self.gain_drifts = 0
        self._gain_history: list[float] = []
        self._gain_recent: deque[float] = deque(maxlen=cfg.gain_window_checks)
        self._gain_drifted = False
        self._gain_streak = 0  # consecutive checks disagreeing with _gain_drifted

    def _keep(self, stats: RollingStats, x: float, severity: str | None, streak: int) -> int:
        """Add ``x`` to ``stats`` unless it is a spike; returns the new spike streak.

        Spikes stay out of the window, so one bad batch does not inflate the standard
        deviation and mask the next for a whole window. After ``spike_persist_steps``
        consecutive spikes the values are a new level, and they enter the window.
        """
        if severity is None:
            stats.add(x)
            return 0
        streak += 1
        if streak >= self.cfg.spike_persist_steps:
            stats.add(x)
        return streak

    def event(self, kind: str, value: float | None = None) -> None:
        """Record a detector firing at the last step seen.

        A firing on the step right after the last firing of the same kind extends that event
        (count, last_step) instead of adding one, whatever fired in between.
        """
        self.events.add(kind, self.last_step, value)

    def observe_nonfinite(self, step: int, field: str, value: float) -> None:
        """A NaN or infinite ``value`` of ``field`` (loss, grad_norm, lr or custom) at ``step``."""
        self.last_step = step
        self.event(f"nonfinite_{field}", value)

    # ----------------------------------------------------------------------------- per step

    def observe_step(
        self,
        step: int,
        loss: float | None,
        grad_norm: float | None,
        step_time: float,
        tokens: float,
        mem_allocated: float | None = None,
        stride: int = 1,
    ) -> None:
        """Apply one logged step.

        ``loss``/``grad_norm``: None when not logged. ``step_time``: seconds since the previous
        ``log()`` of the process (the client's ``perf_counter``, immune to wall-clock steps).
        ``tokens``: tokens since that call. ``stride``: training steps since that call (a rank
        that logs every 100th step has stride 100), so ``step_time / stride`` is the time of
        one training step: what stragglers and the step-time median compare across ranks.
        """
        cfg = self.cfg
        self.last_step = step
        if mem_allocated is not None and math.isfinite(mem_allocated):
            self.memory.append((step, mem_allocated))
        if loss is not None and math.isfinite(loss):
            stats = self.loss_stats
            z, severity = judge_spike(stats, loss, cfg)
            self.loss_z = z
            if severity is not None:
                self.loss_spikes[severity] += 1
                self.event(f"loss_spike_{severity}", loss)
            mean = stats.mean()
            self.loss_ratio = loss / mean if len(stats) and mean != 0 else math.nan
            d = cfg.ema_decay
            # A value absurdly far from the EMA (either way, or before spikes are judged) is
            # kept out like a spike: one outlier must not poison the window or the EMA.
            if severity is None and self.ema is not None and is_outlier(loss, self.ema):
                severity = "absurd"
            self._loss_streak = self._keep(stats, loss, severity, self._loss_streak)
            if severity is not None and self._loss_streak < cfg.spike_persist_steps:
                pass  # a spike stays out of the EMA as it stays out of the window
            elif self.ema is None:
                self.ema = loss
            else:
                self.ema = d * self.ema + (1.0 - d) * loss
            if self.ema is not None:
                self.trend.append((step, self.ema))
        if grad_norm is not None and math.isfinite(grad_norm) and grad_norm > 0.0:
            stats = self.grad_stats
            log_norm = math.log(grad_norm)
            z, severity = judge_spike(self.grad_log_stats, log_norm, cfg)
            self.grad_z = z
            if severity is not None:
                self.grad_spikes[severity] += 1
                self.event(f"grad_norm_spike_{severity}", grad_norm)
            if grad_norm > cfg.grad_explosion_norm or (
                len(stats) >= cfg.min_history_steps
                and grad_norm > cfg.grad_explosion_ratio * stats.mean()
            ):
                self.explosions += 1
                self.event("grad_explosion", grad_norm)
            if grad_norm < cfg.grad_vanishing_norm:
                self.vanishing += 1
                self.event("grad_vanishing", grad_norm)
            self._grad_streak = self._keep(
                self.grad_log_stats, log_norm, severity, self._grad_streak
            )
            if severity is None or self._grad_streak == 0:
                stats.add(grad_norm)
        elif grad_norm == 0.0:
            self.vanishing += 1
            self.event("grad_vanishing", grad_norm)
        elif grad_norm is not None and grad_norm == math.inf:
            self.explosions += 1
            self.event("grad_explosion", grad_norm)
        if step_time > 0.0 and step_time < math.inf:
            self.intervals.append(step_time)
            self.step_times.append(step_time / max(stride, 1))
            # Per logged interval: tokens and seconds cover the same steps, whatever the stride.
            self.rates.append((tokens if tokens > 0 else 1.0) / step_time)
        self.hung = False

    def reseed(self, rollback: bool = False) -> None:
        """Start the statistics over after a restart; the counters of what happened stay.

        A restart is a step number going backward on the same (run, rank) (a checkpoint
        rollback) or a new process resuming it. The loss, grad-norm, step-time, throughput,
        memory and gradient-gain baselines of the old trajectory would judge the new one
        against the wrong level (a rolled-back loss reads as a spike, its EMA trend as
        divergence), so they are emptied and rebuilt from the next steps, as at the start.
        ``rollback``: the restart is a rollback (its time is kept in :attr:`rollback_times`).
        """
        cfg = self.cfg
        self.restarts += 1
        if rollback:
            self.rollback_times.append(time.time())
        self.event("restart")
        self.ema = None
        self.loss_stats = RollingStats(cfg.window_steps)
        self.grad_stats = RollingStats(cfg.window_steps)
        self.grad_log_stats = RollingStats(cfg.window_steps)
        self.loss_z = self.grad_z = self.loss_ratio = math.nan
        self._loss_streak = self._grad_streak = 0
        self.trend.clear()
        self._slope_key, self._slope = None, None
        self.step_times.clear()
        self.intervals.clear()
        self.rates.clear()
        self.memory.clear()
        self.memory_growth = None
        self.leaking = self.hung = self.throughput_dropped = False
        self.gain_mean = self.gain_baseline = self.gain_drift = None
        self._gain_history = []
        self._gain_recent.clear()
        self._gain_drifted = False
        self._gain_streak = 0

    # ----------------------------------------------------------------------------- derived

    def rollbacks_repeat_time(self) -> float | None:
        """When the rank's latest ``rollback_repeats`` rollbacks began (Unix s), or None.

        The time of the ``rollback_repeats``-th latest rollback; None before the rank rolled
        back that often. ``rollback_repeats`` rollbacks happened within ``w`` seconds of now
        exactly when ``now - this < w``.
        """
        times = self.rollback_times
        return times[0] if len(times) == times.maxlen else None

    def median_step_time(self) -> float | None:
        """Median of the recent times per training step (s).

        None before ``min_history_steps`` of them.
        """
        if len(self.step_times) < min(self.cfg.min_history_steps, self.step_times.maxlen or 1):
            return None
        return statistics.median(self.step_times)

    def median_interval(self) -> float | None:
        """Median of the recent times between ``log()`` calls (s): what a hang is judged by.

        Equal to :meth:`median_step_time` for a rank that logs every step; None before
        ``min_history_steps`` of them.
        """
        if len(self.intervals) < min(self.cfg.min_history_steps, self.intervals.maxlen or 1):
            return None
        return statistics.median(self.intervals)

    def check_hang(self, seconds_since_step: float, busy: bool) -> bool:
        """Update the hang state; returns True when a new hang episode starts.

        ``seconds_since_step``: on the exporter's monotonic clock (:meth:`RunAnalytics.check
        <trainmon_exporter.analytics.RunAnalytics.check>`), never a wall-clock difference.
        """
        median = self.median_interval()
        if busy or median is None:
            self.hung = False
            return False
        limit = self.cfg.hang_factor * median + self.cfg.hang_grace_seconds
        now_hung = seconds_since_step > limit
        started = now_hung and not self.hung
        if started:
            self.hangs += 1
            self.event("hang", seconds_since_step)
        self.hung = now_hung
        return started

    def check_memory(self) -> bool:
        """Fit allocated memory over the window; True when a new leak episode starts.

        Leak: a full window whose least-squares growth ``slope * (last step - first step)``
        exceeds ``leak_min_growth_ratio`` of the mean, with ``R^2 >= leak_min_r2`` (steady
        growth, not a one-off jump or noise).
        """
        pts = self.memory
        fit = least_squares(pts) if len(pts) == pts.maxlen else None
        if fit is None:
            self.memory_growth = None
            return False
        slope, r2 = fit
        self.memory_growth = slope
        my = sum(p[1] for p in pts) / len(pts)
        growth = slope * (pts[-1][0] - pts[0][0])
        leaking = growth > self.cfg.leak_min_growth_ratio * abs(my) and r2 >= self.cfg.leak_min_r2
        started = leaking and not self.leaking
        if started:
            self.leaks += 1
            self.event("memory_leak", slope)
        self.leaking = leaking
        return started

    def check_throughput(self) -> bool:
        """Update the throughput-drop state; True when a new drop episode starts."""
        ratio = self.throughput_ratio()
        dropped = ratio is not None and ratio < self.cfg.throughput_drop_ratio
        started = dropped and not self.throughput_dropped
        if started:
            self.throughput_drops += 1
            self.event("throughput_drop", ratio)
        self.throughput_dropped = dropped
        return started

    def stopped(self) -> None:
        """The rank is not running (disconnected, or no step yet): not hung, no straggler ratio.

        Episodes stay as they were; a rank that runs again continues them.
        """
        self.hung = False
        self.straggler = None

    def is_straggling(self) -> bool:
        """The straggler verdict: the rank runs, and its last ratio was above ``straggler_ratio``.

        A rank that stopped (:meth:`stopped`) is no longer compared, so it is not straggling,
        though its episode stays open until it is compared again.
        """
        return self.straggling and self.straggler is not None

    def set_straggler(self, ratio: float | None) -> bool:
        """Update the straggler state from the run-level ratio; True when an episode starts."""
        self.straggler = ratio
        straggling = ratio is not None and ratio > self.cfg.straggler_ratio
        started = straggling and not self.straggling
        if started:
            self.straggler_episodes += 1
            self.event("straggler", ratio)
        self.straggling = straggling
        return started

    def throughput_ratio(self) -> float | None:
        """Recent median rate over baseline median rate; None until the baseline is 3x recent."""
        cfg = self.cfg
        n = len(self.rates)
        if n < 3 * cfg.throughput_recent_steps:
            return None
        rates = list(self.rates)
        baseline = statistics.median(rates)
        recent = statistics.median(rates[-cfg.throughput_recent_steps :])
        return recent / baseline if baseline > 0 else None

    def recent_step_time(self) -> float | None:
        """Median of the last ``throughput_recent_steps`` step times (s)."""
        k = self.cfg.throughput_recent_steps
        if len(self.step_times) < min(k, self.step_times.maxlen or k):
            return None
        return statistics.median(list(self.step_times)[-k:])

    def ema_slope(self) -> float | None:
        """Least-squares slope of the EMA over the trend window (loss units per step)."""
        if len(self.trend) < self.cfg.min_history_steps:
            return None
        key = (len(self.trend), self.trend[-1])
        if key != self._slope_key:  # scrapes and the API ask between steps: fit once per step
            fit = least_squares(self.trend)
            self._slope_key, self._slope = key, None if fit is None else fit[0]
        return self._slope

    def plateau(self) -> bool | None:
        """Whether a full trend window changed the EMA by less than the tolerance."""
        pts = self.trend
        if len(pts) < (pts.maxlen or 0):
            return None
        first, last = pts[0][1], pts[-1][1]
        if first == 0:
            return None
        return abs(last - first) / abs(first) < self.cfg.plateau_tolerance

    # ----------------------------------------------------------------------------- layers

    def observe_layers(self, rows: list[tuple[str, dict[int, float]]]) -> None:
        """Apply one watch check: ``(layer, {stat code: value})`` in module order.

        Stat codes are :data:`trainmon_client._protocol.LAYER_STATS`; the detectors read the
        update ratio (``STAT_UPDATE_RATIO``) and the gradient norm (``STAT_GRAD_NORM``).
        """
        cfg = self.cfg
        high = low = 0
        worst = 0.0
        ratios = [
            r
            for _, row in rows
            if (r := row.get(P.STAT_UPDATE_RATIO)) is not None and math.isfinite(r)
        ]
        learning = bool(ratios) and statistics.median(ratios) >= cfg.update_ratio_low
        for ratio in ratios:
            if ratio > cfg.update_ratio_high:
                high += 1
                worst = max(worst, ratio)
            elif ratio < cfg.update_ratio_low and learning:
                low += 1
        if high:
            self.update_high += high
            self.event("update_ratio_high", worst)
        if low:
            self.update_low += low
            self.event("update_ratio_low")
        norms = [row.get(P.STAT_GRAD_NORM) for _, row in rows]
        logs = [
            math.log(a) - math.log(b)  # a / b of finite extremes under- or overflows
            for a, b in itertools.pairwise(norms)
            if a is not None
            and b is not None
            and a > 0
            and b > 0
            and math.isfinite(a)
            and math.isfinite(b)
        ]
        if not logs:
            return
        self.gain_mean = math.exp(min(sum(logs) / len(logs), 709.0))  # exp(709.8) overflows
        if len(self._gain_history) < cfg.gain_baseline_checks:
            self._gain_history.append(self.gain_mean)
            self.gain_baseline = statistics.median(self._gain_history)
        self._gain_recent.append(self.gain_mean)
        recent = statistics.median(self._gain_recent)
        drift = recent / self.gain_baseline if self.gain_baseline else None
        self.gain_drift = drift
        drifted = (
            drift is not None
            and drift > 0.0
            and abs(math.log(drift)) > math.log(cfg.gain_drift_factor)
        )
        if drifted == self._gain_drifted:
            self._gain_streak = 0
            return
        self._gain_streak += 1
        if self._gain_streak < cfg.gain_drift_checks:
            return
        self._gain_drifted = drifted
        self._gain_streak = 0
        if drifted:
            self.gain_drifts += 1
            self.event("grad_gain_drift", drift)

    # ----------------------------------------------------------------------------- evaluation

    def observe_eval(self, val_loss: float | None) -> None:
        """Apply one evaluation's validation loss (None when it reported none)."""
        self.eval_total += 1
        if val_loss is not None and math.isfinite(val_loss):
            self.eval_loss = val_loss
            self.evals.append(val_loss)

    def eval_improvement(self) -> float | None:
        """``(previous - last) / |previous|`` validation loss; None before two evaluations."""
        if len(self.evals) < 2 or self.evals[-2] == 0:
            return None
        return (self.evals[-2] - self.evals[-1]) / abs(self.evals[-2])

    def eval_gap(self) -> float | None:
        """``(val_loss - train EMA) / train EMA``; None without both."""
        if self.eval_loss is None or not self.ema:
            return None
        return (self.eval_loss - self.ema) / self.ema

    def eval_plateau(self) -> bool | None:
        """Whether the last ``eval_plateau_evals`` evaluations each changed under the tolerance."""
        k = self.cfg.eval_plateau_evals
        vals = list(self.evals)
        if len(vals) < k:
            return None
        recent = vals[-k:]
        tol = self.cfg.eval_plateau_change
        return all(abs(b - a) <= tol * abs(a) for a, b in itertools.pairwise(recent))

"""The detectors' statistics: rolling mean and standard deviation, spike z-scores, line fits.

Pure functions and one small class, no detector state; the formulas are in
:mod:`trainmon_exporter.analytics`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

from trainmon_exporter.settings import SEVERITIES, AnalyticsSettings

__all__ = [
    "OUTLIER_FACTOR",
    "RollingStats",
    "SpikeResult",
    "is_outlier",
    "judge_spike",
    "least_squares",
]


class RollingStats:
    """Mean and population standard deviation of the last ``size`` values, O(1) per value.

    Running sums drift with floating-point error, so they are recomputed from the window
    every ``size`` updates.
    """

    __slots__ = ("_since_exact", "_sum", "_sumsq", "size", "values")

    def __init__(self, size: int) -> None:
        self.size = size
        self.values: deque[float] = deque(maxlen=size)
        self._sum = 0.0
        self._sumsq = 0.0
        self._since_exact = 0

    def __len__(self) -> int:
        return len(self.values)

    def add(self, x: float) -> None:
        """Append ``x`` (finite), evicting the oldest value when full."""
        if len(self.values) == self.size:
            old = self.values[0]
            self._sum -= old
            self._sumsq -= old * old
        self.values.append(x)
        self._sum += x
        self._sumsq += x * x
        self._since_exact += 1
        if self._since_exact >= self.size:
            try:
                self._sum = math.fsum(self.values)
                self._sumsq = math.fsum(v * v for v in self.values)
            except OverflowError:  # finite extremes (1e308): plain sums overflow to inf instead
                self._sum = sum(self.values)
                self._sumsq = sum(v * v for v in self.values)
            self._since_exact = 0

    def mean(self) -> float:
        """Mean of the window (NaN when empty)."""
        n = len(self.values)
        return self._sum / n if n else math.nan

    def std(self) -> float:
        """Population standard deviation of the window (NaN when empty)."""
        n = len(self.values)
        if not n:
            return math.nan
        m = self._sum / n
        return math.sqrt(max(self._sumsq / n - m * m, 0.0))


OUTLIER_FACTOR = 1e3
"""A loss more than this many times the EMA's magnitude away from it is kept out of the EMA and
the rolling window like a spike (also before ``min_history_steps``, when no z-score exists, and
below the mean, which the one-sided z-score does not judge)."""


def is_outlier(x: float, ref: float) -> bool:
    """Whether ``x`` is more than :data:`OUTLIER_FACTOR` times ``ref``'s magnitude away from it."""
    return abs(x - ref) > OUTLIER_FACTOR * max(abs(ref), 1e-12)


class SpikeResult(NamedTuple):
    """Outcome of judging one value: its z-score (NaN before enough history) and severity."""

    z: float
    severity: str | None


def judge_spike(stats: RollingStats, x: float, cfg: AnalyticsSettings) -> SpikeResult:
    """One-sided z-score of ``x`` against ``stats`` (before ``x`` is added) and its severity."""
    if len(stats) < cfg.min_history_steps:
        return SpikeResult(math.nan, None)
    mean = stats.mean()
    std = max(stats.std(), cfg.rel_std_floor * abs(mean), 1e-12)
    z = (x - mean) / std
    severity = None
    for name in SEVERITIES:
        if z >= cfg.spike_z[name]:
            severity = name
    return SpikeResult(z, severity)


def least_squares(points: Iterable[tuple[float, float]]) -> tuple[float, float] | None:
    """``(slope, R^2)`` of the least-squares line through ``points``; None when x is constant.

    One pass over sums of the points shifted by the first one (shifting keeps the sums small,
    so ``Σx² − (Σx)²/n`` does not cancel when x are large step numbers).
    """
    it = iter(points)
    first = next(it, None)
    if first is None:
        return None
    x0, y0 = first
    n = 1
    sx = sy = sxx = sxy = syy = 0.0
    for x, y in it:
        dx = x - x0
        dy = y - y0
        n += 1
        sx += dx
        sy += dy
        sxx += dx * dx
        sxy += dx * dy
        syy += dy * dy
    if n < 2:
        return None
    sxx -= sx * sx / n
    if sxx <= 0:
        return None
    sxy -= sx * sy / n
    syy -= sy * sy / n
    r2 = sxy * sxy / (sxx * syy) if syy > 0 else 0.0
    return sxy / sxx, r2

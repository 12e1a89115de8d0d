"""Training-health analytics at step resolution, one :class:`RankAnalytics` per (run, rank).

Prometheus samples gauges every scrape (15 s by default), so a one-step spike between two
scrapes is invisible in a gauge. Every step-level event is therefore detected here, on every
step the exporter receives, and exported as a counter. The detectors and their formulas:

- **EMA of the loss**: ``ema = d * ema + (1 - d) * loss`` with ``d = ema_decay`` (0.99). It is
  initialised from the first finite loss, and continues when a rank reconnects under the same
  run id while the exporter still holds its state. Spikes stay out of it as they stay out of
  the window, and so does a loss more than ``OUTLIER_FACTOR`` (1,000) times the EMA's
  magnitude away from it, either way (robust to one absurd value such as 1e308).
- **Rolling statistics**: mean and standard deviation of the loss and grad norm over the last
  ``window_steps`` finite values (running sums, O(1) per step).
- **Spikes** (loss and grad norm): the one-sided z-score of a value against the *preceding*
  window, ``z = (x - mean) / max(std, rel_std_floor * |mean|)``, judged once
  ``min_history_steps`` values are in. The severity is the highest of ``spike_z`` it reaches.
  The floor keeps a near-constant series from turning round-off into spikes.
  - The grad norm is judged in log space (``x = ln(grad_norm)``): norms are heavy-tailed, and
    a tenfold jump should weigh the same at any scale.
  - Spikes stay out of the window (robust statistics), so one bad batch does not mask the next.
    After ``spike_persist_steps`` consecutive spikes the values are taken as a new level.
- **Loss-to-average ratio**: ``loss / rolling mean``, so a "10x the moving average" rule is one
  comparison.
- **Gradient explosion**: ``grad_norm > grad_explosion_norm``, or ``grad_norm >
  grad_explosion_ratio * rolling mean`` once the history is in.
  **Vanishing**: ``grad_norm < grad_vanishing_norm``.
- **Hang**: connected, no operation under ``Run.track`` running, and no step for longer than
  ``hang_factor * median step time + hang_grace_seconds``, counted from the last step or,
  when later, the end of the last tracked operation or the last evaluation or checkpoint
  (out of a long save, a rank has its usual time to step again). It is judged only after
  ``min_history_steps`` step times and once the rank's process has logged a step (a new
  process after a crash, loading its checkpoint, is starting, not hung), and counted once
  per episode; an episode's start asks the rank for its stacks (docs/hangs.md).
- **Throughput**: the median per-step rate (tokens/s, or steps/s without tokens) of the last
  ``throughput_recent_steps``, over the median of the last ``throughput_baseline_steps``.
- **Straggler** (across the ranks of a run): the rank's recent median step time over the median
  of the *other* ranks' recent medians (leave-one-out, so two ranks work too). Under
  synchronous data parallelism, collectives equalise the time between ``log()`` calls, so this
  shows stragglers only where ranks do not wait for each other (see docs/detection.md).
- **Trend**: the least-squares slope of the EMA over the last ``trend_window_steps`` steps
  (loss units per step). **Plateau**: a full window whose EMA changed by less than
  ``plateau_tolerance`` (relative).
- **Memory leak**: over the last ``leak_window_steps`` of ``mem_allocated``, the
  least-squares growth ``slope * steps`` above ``leak_min_growth_ratio`` of the mean, with
  ``R^2 >= leak_min_r2`` (steady growth, not a jump).
- **Layers** (``Run.watch``): a layer's update ratio ``||dw||/||w||`` above
  ``update_ratio_high`` is counted per layer and check; below ``update_ratio_low`` too, while
  the check's median layer ratio is at or above it (one layer frozen while the others learn).
  A whole model below the floor is the learning rate, not a layer: a cosine schedule ends
  near 0 (the example trainer's last checks of a 6,000-step run had every layer under 1e-7,
  which paged ``TrainmonUpdateRatioOutOfRange`` on a healthy run); it counts nothing. The
  *gradient gain* between consecutive layers (module order) is ``||g_i|| / ||g_{i+1}||``. Its
  mean is the geometric mean over the layer pairs. The baseline is the median mean gain of the
  first ``gain_baseline_checks`` checks. Drift is the median mean gain of the last
  ``gain_window_checks`` checks over the baseline (one noisy check cannot move it). An episode
  starts after ``gain_drift_checks`` consecutive checks with ``|ln drift| > ln
  gain_drift_factor`` and ends after as many consecutive checks back within it; each start is
  counted. On a healthy 2-layer MLP (one layer pair: the noisiest gain), single checks
  against a 5-check baseline counted 33 episodes in six clean 3,000-step runs; these defaults
  count none and find a 4x step change 5 checks after it
  (``benchmarks/detection/gain_drift.py``, ``docs/detection.md``).
- **Evaluation**:
  - improvement per evaluation ``(prev - cur) / |prev|``, slow under ``eval_slow_improvement``;
  - gap ``(val_loss - train EMA) / train EMA``, overfitting over ``eval_overfit_gap``;
  - plateau: the last ``eval_plateau_evals`` evaluations each within ``eval_plateau_change``
    of the one before.
"""

from __future__ import annotations

from trainmon_exporter.analytics.detectors import RankAnalytics
from trainmon_exporter.analytics.events import MAX_EVENTS, Event, EventLog
from trainmon_exporter.analytics.run import RankClock, RunAnalytics, stepping
from trainmon_exporter.analytics.stats import (
    OUTLIER_FACTOR,
    RollingStats,
    SpikeResult,
    judge_spike,
    least_squares,
)
from trainmon_exporter.settings import SEVERITIES, AnalyticsSettings

__all__ = [
    "MAX_EVENTS",
    "OUTLIER_FACTOR",
    "SEVERITIES",
    "AnalyticsSettings",
    "Event",
    "EventLog",
    "RankAnalytics",
    "RankClock",
    "RollingStats",
    "RunAnalytics",
    "SpikeResult",
    "judge_spike",
    "least_squares",
    "stepping",
]

"""Training-health series: detectors of :mod:`trainmon_exporter.analytics` per (run, rank).

Event counters (spikes, explosions, hangs, evaluations, checkpoints) exist at 0 from a rank's
first message, so the first event of a run shows up in ``increase()``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from trainmon_exporter import derive
from trainmon_exporter.analytics import SEVERITIES, RankAnalytics
from trainmon_exporter.collectors import CollectorContext, register
from trainmon_exporter.state import RankState

RL = ["run", "rank"]

_GAUGES: tuple[tuple[str, str, Callable[[RankState, RankAnalytics], float | None]], ...] = (
    (
        "trainmon_train_loss_ema",
        "EMA of the loss: ema = d*ema + (1-d)*loss, d = ema_decay "
        "(0.99), started at the first finite loss.",
        lambda s, a: a.ema,
    ),
    (
        "trainmon_train_loss_mean",
        "Mean of the last window_steps finite losses.",
        lambda s, a: _fin(a.loss_stats.mean()),
    ),
    (
        "trainmon_train_loss_stddev",
        "Standard deviation of the last window_steps finite losses.",
        lambda s, a: _fin(a.loss_stats.std()),
    ),
    (
        "trainmon_train_loss_zscore",
        "z-score of the last loss against the preceding window.",
        lambda s, a: _fin(a.loss_z),
    ),
    (
        "trainmon_train_loss_to_average_ratio",
        "Last loss divided by the mean of the preceding "
        "window (10 means ten times the moving average).",
        lambda s, a: _fin(a.loss_ratio),
    ),
    (
        "trainmon_train_grad_norm_mean",
        "Mean of the last window_steps finite grad norms.",
        lambda s, a: _fin(a.grad_stats.mean()),
    ),
    (
        "trainmon_train_grad_norm_stddev",
        "Standard deviation of the last window_steps grad norms.",
        lambda s, a: _fin(a.grad_stats.std()),
    ),
    (
        "trainmon_train_grad_norm_zscore",
        "z-score of the last grad norm against the preceding window.",
        lambda s, a: _fin(a.grad_z),
    ),
    (
        "trainmon_train_step_time_median_seconds",
        "Median of the last step_time_window_steps per-step times (s; the time between log() "
        "calls over the steps between them): the rank's usual step time.",
        lambda s, a: a.median_step_time(),
    ),
    (
        "trainmon_train_hung",
        "1 while the rank is connected, runs no tracked operation and has "
        "not stepped for hang_factor x median step time + hang_grace_seconds.",
        lambda s, a: 1.0 if a.hung else 0.0,
    ),
    (
        "trainmon_train_throughput_ratio",
        "Median per-step tokens/s of the last "
        "throughput_recent_steps over that of the last throughput_baseline_steps (1 = as usual).",
        lambda s, a: a.throughput_ratio(),
    ),
    (
        "trainmon_train_throughput_dropped",
        "1 while the rank's throughput is judged dropped: trainmon_train_throughput_ratio below "
        "throughput_drop_ratio at the last check (every 1 s), else 0.",
        lambda s, a: 1.0 if a.throughput_dropped else 0.0,
    ),
    (
        "trainmon_train_straggler_ratio",
        "Rank's recent median step time over the median of its run's other connected ranks, judged "
        "every 1 s (1 = typical; only meaningful where ranks do not synchronise every step).",
        lambda s, a: a.straggler,
    ),
    (
        "trainmon_train_straggling",
        "1 while the rank is judged a straggler: trainmon_train_straggler_ratio above "
        "straggler_ratio at the last check (every 1 s, while connected), else 0.",
        lambda s, a: 1.0 if a.is_straggling() else 0.0,
    ),
    (
        "trainmon_train_grad_gain_mean",
        "Geometric mean over consecutive layers of ||g_i|| / ||g_i+1|| at the last watch check.",
        lambda s, a: a.gain_mean,
    ),
    (
        "trainmon_train_grad_gain_drift_ratio",
        "Median mean gradient gain of the last gain_window_checks over its baseline "
        "(the median of the first gain_baseline_checks).",
        lambda s, a: a.gain_drift,
    ),
    (
        "trainmon_train_memory_growth_bytes_per_step",
        "Least-squares slope of mem_allocated over the last leak_window_steps (bytes/step).",
        lambda s, a: a.memory_growth,
    ),
    (
        "trainmon_train_step_overdue_ratio",
        "Seconds since the rank's last step over its median step time, while connected "
        "(1: a step is about due; hung past hang_factor x median + grace).",
        lambda s, a: derive.overdue_ratio(s, time.time()),
    ),
    (
        "trainmon_train_loss_ema_slope",
        "Least-squares slope of the loss EMA over the last "
        "trend_window_steps (loss per step; above 0: diverging).",
        lambda s, a: a.ema_slope(),
    ),
    (
        "trainmon_train_loss_plateau",
        "1 when the loss EMA moved less than plateau_tolerance "
        "(relative) across a full trend window.",
        lambda s, a: _flag(a.plateau()),
    ),
    (
        "trainmon_eval_loss",
        "Validation loss of the last evaluation (Run.eval val_loss).",
        lambda s, a: a.eval_loss,
    ),
    (
        "trainmon_eval_step",
        "Training step of the last evaluation.",
        lambda s, a: None if s.eval_step is None else float(s.eval_step),
    ),
    (
        "trainmon_eval_improvement_ratio",
        "(previous - last) / |previous| validation loss.",
        lambda s, a: a.eval_improvement(),
    ),
    (
        "trainmon_eval_slow_improvement",
        "1 when the last evaluation improved by less than eval_slow_improvement.",
        lambda s, a: _flag(derive.slow_improvement(a)),
    ),
    (
        "trainmon_eval_generalization_gap_ratio",
        "(validation loss - training loss EMA) / training loss EMA.",
        lambda s, a: a.eval_gap(),
    ),
    (
        "trainmon_eval_overfitting",
        "1 when the generalization gap exceeds eval_overfit_gap.",
        lambda s, a: _flag(derive.overfitting(a)),
    ),
    (
        "trainmon_eval_plateau",
        "1 when the last eval_plateau_evals evaluations each changed by "
        "less than eval_plateau_change.",
        lambda s, a: _flag(a.eval_plateau()),
    ),
    (
        "trainmon_checkpoint_last_timestamp_seconds",
        "When the last checkpoint was written (Unix s, Run.checkpoint).",
        lambda s, a: None if s.checkpoint is None else s.checkpoint.time,
    ),
    (
        "trainmon_checkpoint_last_duration_seconds",
        "How long the last checkpoint took (s).",
        lambda s, a: None if s.checkpoint is None else _fin(s.checkpoint.seconds),
    ),
    (
        "trainmon_checkpoint_last_step",
        "Training step of the last checkpoint.",
        lambda s, a: None if s.checkpoint is None else float(s.checkpoint.step),
    ),
)

_COUNTERS: tuple[tuple[str, str, Callable[[RankState, RankAnalytics], float]], ...] = (
    (
        "trainmon_train_grad_explosions",
        "Steps whose grad norm exceeded grad_explosion_norm, "
        "or grad_explosion_ratio x its rolling mean, or was +Inf.",
        lambda s, a: a.explosions,
    ),
    (
        "trainmon_train_grad_vanishing",
        "Steps whose grad norm was below grad_vanishing_norm.",
        lambda s, a: a.vanishing,
    ),
    (
        "trainmon_train_update_ratio_high",
        "Layer checks (Run.watch) whose update ratio ||dw||/||w|| exceeded update_ratio_high.",
        lambda s, a: a.update_high,
    ),
    (
        "trainmon_train_update_ratio_low",
        "Layer checks whose update ratio was below update_ratio_low while the median layer's "
        "was not (a frozen layer).",
        lambda s, a: a.update_low,
    ),
    (
        "trainmon_train_grad_gain_drifts",
        "Episodes of the mean layer-to-layer gradient gain off its baseline by gain_drift_factor "
        "for gain_drift_checks checks in a row.",
        lambda s, a: a.gain_drifts,
    ),
    (
        "trainmon_train_memory_leaks",
        "Episodes of steady mem_allocated growth (trainmon_train_memory_growth_bytes_per_step).",
        lambda s, a: a.leaks,
    ),
    ("trainmon_train_hangs", "Hang episodes (see trainmon_train_hung).", lambda s, a: a.hangs),
    (
        "trainmon_train_throughput_drops",
        "Episodes of trainmon_train_throughput_ratio below throughput_drop_ratio (0.7).",
        lambda s, a: a.throughput_drops,
    ),
    (
        "trainmon_train_straggler_episodes",
        "Episodes of trainmon_train_straggler_ratio above straggler_ratio (1.5).",
        lambda s, a: a.straggler_episodes,
    ),
    ("trainmon_eval_evaluations", "Evaluations reported (Run.eval).", lambda s, a: a.eval_total),
    (
        "trainmon_checkpoints",
        "Checkpoints reported (Run.checkpoint).",
        lambda s, a: s.checkpoints_total,
    ),
)


def _fin(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _flag(v: bool | None) -> float | None:
    return None if v is None else (1.0 if v else 0.0)


@register("health")
class HealthCollector:
    """Spikes, explosions, hangs, throughput, stragglers, trend, evaluation, monitoring cost."""

    name = "health"

    def __init__(self, ctx: CollectorContext) -> None:
        self.store = ctx.store
        self.window_s = ctx.settings.rate_window_seconds
        self.cfg = ctx.settings.analytics

    def collect(self) -> Iterable[Metric]:
        """Return the health families (formulas: trainmon_exporter.analytics)."""
        now = time.time()
        gauges = [(GaugeMetricFamily(n, h, labels=RL), f) for n, h, f in _GAUGES]
        counters = [(CounterMetricFamily(n, h, labels=RL), f) for n, h, f in _COUNTERS]
        loss_spikes = CounterMetricFamily(
            "trainmon_train_loss_spikes",
            "Steps whose loss z-score against the preceding window reached spike_z[severity] "
            "(the highest severity reached is counted).",
            labels=[*RL, "severity"],
        )
        grad_spikes = CounterMetricFamily(
            "trainmon_train_grad_norm_spikes",
            "Steps whose grad-norm z-score reached spike_z[severity].",
            labels=[*RL, "severity"],
        )
        mon_ratio = GaugeMetricFamily(
            "trainmon_monitoring_overhead_ratio",
            "Share of wall time spent in monitoring over rate_window_seconds: the client's own "
            "log() time plus operations timed with Run.track.",
            labels=RL,
        )
        over_budget = GaugeMetricFamily(
            "trainmon_monitoring_over_budget",
            "1 when trainmon_monitoring_overhead_ratio exceeds monitoring_budget_ratio (0.05).",
            labels=RL,
        )
        op_seconds = CounterMetricFamily(
            "trainmon_monitoring_seconds",
            "Wall time of finished runs of each tracked operation (s, Run.track).",
            labels=[*RL, "operation"],
        )
        op_count = CounterMetricFamily(
            "trainmon_monitoring_operations",
            "Finished runs of each tracked operation.",
            labels=[*RL, "operation"],
        )
        op_active = GaugeMetricFamily(
            "trainmon_monitoring_active",
            "1 while the tracked operation runs.",
            labels=[*RL, "operation"],
        )
        eval_value = GaugeMetricFamily(
            "trainmon_eval_value",
            "Last value of each metric reported with Run.eval (capped like custom metrics).",
            labels=[*RL, "name"],
        )
        for s in self.store.iter_ranks():
            a = s.analytics
            labels = [s.run, str(s.rank)]
            for fam, fn in gauges:
                v = fn(s, a)
                if v is not None:
                    fam.add_metric(labels, v)
            for cfam, cfn in counters:
                cfam.add_metric(labels, float(cfn(s, a)))
            for sev in SEVERITIES:
                loss_spikes.add_metric([*labels, sev], float(a.loss_spikes[sev]))
                grad_spikes.add_metric([*labels, sev], float(a.grad_spikes[sev]))
            rates = derive.rates(s, now, self.window_s)
            if rates is not None:
                mon_ratio.add_metric(labels, rates.monitoring_ratio)
                over = derive.over_budget(rates.monitoring_ratio, self.cfg)
                over_budget.add_metric(labels, 1.0 if over else 0.0)
            for name, op in s.ops.items():
                op_seconds.add_metric([*labels, name], op.seconds_total)
                op_count.add_metric([*labels, name], float(op.runs_total))
                op_active.add_metric([*labels, name], 1.0 if op.active else 0.0)
            for name, v in s.eval_values.items():
                if v is not None and name != "val_loss":
                    eval_value.add_metric([*labels, name], v)
        out: list[Metric] = [fam for fam, _ in gauges]
        out += [fam for fam, _ in counters]
        out += [loss_spikes, grad_spikes, mon_ratio, over_budget]
        out += [op_seconds, op_count, op_active, eval_value]
        return out

"""Training-health series: detectors of :mod:`trainmon_exporter.analytics` per (run, rank).

Event counters (spikes, explosions, hangs, evaluations, checkpoints) exist at 0 from a rank's
first message, so the first event of a run shows up in ``increase()``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

from prometheus_client.metrics_core import Metric

from trainmon_exporter import catalog, derive
from trainmon_exporter.analytics import SEVERITIES, RankAnalytics
from trainmon_exporter.analytics.goodput import Goodput
from trainmon_exporter.catalog import Family
from trainmon_exporter.collectors import CollectorContext, register
from trainmon_exporter.state.rank import RankState

_Getter = Callable[[RankState, RankAnalytics], float | None]

_GAUGES: tuple[tuple[Family, _Getter], ...] = (
    (catalog.TRAIN_LOSS_EMA, lambda s, a: a.ema),
    (catalog.TRAIN_LOSS_MEAN, lambda s, a: _fin(a.loss_stats.mean())),
    (catalog.TRAIN_LOSS_STDDEV, lambda s, a: _fin(a.loss_stats.std())),
    (catalog.TRAIN_LOSS_ZSCORE, lambda s, a: _fin(a.loss_z)),
    (catalog.TRAIN_LOSS_TO_AVERAGE_RATIO, lambda s, a: _fin(a.loss_ratio)),
    (catalog.TRAIN_GRAD_NORM_MEAN, lambda s, a: _fin(a.grad_stats.mean())),
    (catalog.TRAIN_GRAD_NORM_STDDEV, lambda s, a: _fin(a.grad_stats.std())),
    (catalog.TRAIN_GRAD_NORM_ZSCORE, lambda s, a: _fin(a.grad_z)),
    (catalog.TRAIN_STEP_TIME_MEDIAN_SECONDS, lambda s, a: a.median_step_time()),
    (catalog.TRAIN_HUNG, lambda s, a: 1.0 if a.hung else 0.0),
    (catalog.TRAIN_THROUGHPUT_RATIO, lambda s, a: a.throughput_ratio()),
    (catalog.TRAIN_THROUGHPUT_DROPPED, lambda s, a: 1.0 if a.throughput_dropped else 0.0),
    (catalog.TRAIN_STRAGGLER_RATIO, lambda s, a: a.straggler),
    (catalog.TRAIN_STRAGGLING, lambda s, a: 1.0 if a.is_straggling() else 0.0),
    (catalog.TRAIN_GRAD_GAIN_MEAN, lambda s, a: a.gain_mean),
    (catalog.TRAIN_GRAD_GAIN_DRIFT_RATIO, lambda s, a: a.gain_drift),
    (catalog.TRAIN_MEMORY_GROWTH_BYTES_PER_STEP, lambda s, a: a.memory_growth),
    (catalog.TRAIN_STEP_OVERDUE_RATIO, lambda s, a: derive.overdue_ratio(s, time.monotonic())),
    (catalog.TRAIN_LOSS_EMA_SLOPE, lambda s, a: a.ema_slope()),
    (catalog.TRAIN_LOSS_PLATEAU, lambda s, a: _flag(a.plateau())),
    (catalog.EVAL_LOSS, lambda s, a: a.eval_loss),
    (catalog.EVAL_STEP, lambda s, a: None if s.eval_step is None else float(s.eval_step)),
    (catalog.EVAL_IMPROVEMENT_RATIO, lambda s, a: a.eval_improvement()),
    (
        catalog.EVAL_SLOW_IMPROVEMENT,
        lambda s, a: _flag(derive.slow_improvement(a)),
    ),
    (catalog.EVAL_GENERALIZATION_GAP_RATIO, lambda s, a: a.eval_gap()),
    (catalog.EVAL_OVERFITTING, lambda s, a: _flag(derive.overfitting(a))),
    (catalog.EVAL_PLATEAU, lambda s, a: _flag(a.eval_plateau())),
    (
        catalog.CHECKPOINT_LAST_TIMESTAMP_SECONDS,
        lambda s, a: None if s.checkpoint is None else s.checkpoint.time,
    ),
    (
        catalog.CHECKPOINT_LAST_DURATION_SECONDS,
        lambda s, a: None if s.checkpoint is None else _fin(s.checkpoint.seconds),
    ),
    (
        catalog.CHECKPOINT_LAST_STEP,
        lambda s, a: None if s.checkpoint is None else float(s.checkpoint.step),
    ),
)

_COUNTERS: tuple[tuple[Family, Callable[[RankState, RankAnalytics], float]], ...] = (
    (catalog.TRAIN_GRAD_EXPLOSIONS, lambda s, a: a.explosions),
    (catalog.TRAIN_GRAD_VANISHING, lambda s, a: a.vanishing),
    (catalog.TRAIN_UPDATE_RATIO_HIGH, lambda s, a: a.update_high),
    (catalog.TRAIN_UPDATE_RATIO_LOW, lambda s, a: a.update_low),
    (catalog.TRAIN_GRAD_GAIN_DRIFTS, lambda s, a: a.gain_drifts),
    (catalog.TRAIN_MEMORY_LEAKS, lambda s, a: a.leaks),
    (catalog.TRAIN_HANGS, lambda s, a: a.hangs),
    (catalog.TRAIN_THROUGHPUT_DROPS, lambda s, a: a.throughput_drops),
    (catalog.TRAIN_STRAGGLER_EPISODES, lambda s, a: a.straggler_episodes),
    (catalog.EVAL_EVALUATIONS, lambda s, a: a.eval_total),
    (catalog.CHECKPOINTS, lambda s, a: s.checkpoints_total),
)

_EVENT_TIMES: tuple[tuple[Family, str], ...] = (
    (catalog.TRAIN_GRAD_EXPLOSIONS_LAST_TIMESTAMP_SECONDS, "grad_explosion"),
    (catalog.TRAIN_UPDATE_RATIO_HIGH_LAST_TIMESTAMP_SECONDS, "update_ratio_high"),
    (catalog.TRAIN_UPDATE_RATIO_LOW_LAST_TIMESTAMP_SECONDS, "update_ratio_low"),
    (catalog.TRAIN_GRAD_GAIN_DRIFTS_LAST_TIMESTAMP_SECONDS, "grad_gain_drift"),
    (catalog.TRAIN_MEMORY_LEAKS_LAST_TIMESTAMP_SECONDS, "memory_leak"),
)
"""(family, detector event kind): when the event last fired (Unix s; omitted before the first)."""
_SPIKE_KINDS = {sev: f"loss_spike_{sev}" for sev in SEVERITIES}


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
        gauges = [(f.gauge(), fn) for f, fn in _GAUGES]
        counters = [(f.counter(), fn) for f, fn in _COUNTERS]
        times = [(f.gauge(), kind) for f, kind in _EVENT_TIMES]
        loss_spikes_at = catalog.TRAIN_LOSS_SPIKES_LAST_TIMESTAMP_SECONDS.gauge()
        loss_spikes = catalog.TRAIN_LOSS_SPIKES.counter()
        grad_spikes = catalog.TRAIN_GRAD_NORM_SPIKES.counter()
        mon_ratio = catalog.MONITORING_OVERHEAD_RATIO.gauge()
        over_budget = catalog.MONITORING_OVER_BUDGET.gauge()
        op_seconds = catalog.MONITORING_SECONDS.counter()
        op_count = catalog.MONITORING_OPERATIONS.counter()
        op_active = catalog.MONITORING_ACTIVE.gauge()
        eval_value = catalog.EVAL_VALUE.gauge()
        badput = catalog.TRAIN_BADPUT_SECONDS.counter()
        input_bound = catalog.TRAIN_INPUT_BOUND.gauge()
        frame = catalog.HANG_FRAME_INFO.gauge()
        sequence = catalog.HANG_COLLECTIVE_SEQUENCE.gauge()
        productive = catalog.TRAIN_PRODUCTIVE_SECONDS.counter()
        unchecked = catalog.TRAIN_UNCHECKPOINTED_SECONDS.gauge()
        at_risk = catalog.TRAIN_AT_RISK_SECONDS.gauge()
        started = catalog.TRAIN_ACCOUNTING_START_TIMESTAMP_SECONDS.gauge()
        measured = catalog.TRAIN_DATA_LOADING_MEASURED.gauge()
        offset = now - time.monotonic()

        def goodput(labels: list[str], g: Goodput) -> None:
            held = g.held  # one pass over the held ranges for both gauges
            productive.add_metric(labels, g.productive)
            unchecked.add_metric(labels, 0.0 if g.risk else held)
            at_risk.add_metric(labels, held if g.risk else 0.0)
            started.add_metric(labels, g.init + offset)
            measured.add_metric(labels, 1.0 if g.data_seen else 0.0)
            for kind, seconds in g.badput.items():
                badput.add_metric([*labels, kind], seconds)

        for s in self.store.iter_ranks():
            a = s.analytics
            labels = [s.namespace, s.run, str(s.rank)]
            for fam, fn in gauges:
                v = fn(s, a)
                if v is not None:
                    fam.add_metric(labels, v)
            for cfam, cfn in counters:
                cfam.add_metric(labels, float(cfn(s, a)))
            for sev in SEVERITIES:
                loss_spikes.add_metric([*labels, sev], float(a.loss_spikes[sev]))
                grad_spikes.add_metric([*labels, sev], float(a.grad_spikes[sev]))
            last = a.events.last
            if last:
                for tfam, kind in times:
                    t = last.get(kind)
                    if t is not None:
                        tfam.add_metric(labels, t)
                for sev, kind in _SPIKE_KINDS.items():
                    t = last.get(kind)
                    if t is not None:
                        loss_spikes_at.add_metric([*labels, sev], t)
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
            goodput(labels, s.goodput)
            bound = derive.input_bound(s, self.window_s, self.cfg)
            input_bound.add_metric(labels, 1.0 if bound else 0.0)
            ev = s.hang
            if a.hung and s.connected and ev is not None:  # while hung, and only then
                where = ev.label()
                if where is not None:
                    frame.add_metric([*labels, where, ev.collective()], 1.0)
                for group, state, value in ev.sequences():
                    sequence.add_metric([*labels, group, state], float(value))
        with self.store.lock:  # departed ranks: their accounting alone, kept for retention
            departed = [([d.namespace, d.run, str(d.rank)], d.goodput) for d in self.store.ledger]
            for labels, g in departed:
                goodput(labels, g)
        out: list[Metric] = [fam for fam, _ in gauges]
        out += [fam for fam, _ in counters]
        out += [fam for fam, _ in times]
        out += [loss_spikes, loss_spikes_at, grad_spikes, mon_ratio, over_budget]
        out += [op_seconds, op_count, op_active, eval_value]
        out += [productive, unchecked, at_risk, started, measured, badput, input_bound]
        out += [frame, sequence]
        return out

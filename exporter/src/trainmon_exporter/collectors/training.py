"""Per-(run, rank) training series, built from :class:`~trainmon_exporter.state.store.Store`.

Every series carries ``run`` and ``rank``; identity (hostname, GPU UUID, world size) lives in
``trainmon_rank_info``. Step-level events are counters (a NaN between two scrapes still moves
them); every event counter of a rank exists at 0 from its first message.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.metrics_core import Metric

from trainmon_exporter import catalog, derive
from trainmon_exporter.catalog import Family
from trainmon_exporter.collectors import CollectorContext, register
from trainmon_exporter.state.rank import NONFINITE_FIELDS, RankState

# (family, value of a state or None to omit the sample)
_GAUGES: tuple[tuple[Family, Callable[[RankState], float | None]], ...] = (
    (catalog.RUN_UP, lambda s: 1.0 if s.connected else 0.0),
    (catalog.RUN_START_TIMESTAMP_SECONDS, lambda s: s.started_at),
    (catalog.TRAIN_STEP, lambda s: None if s.step is None else float(s.step)),
    (catalog.TRAIN_LAST_STEP_TIMESTAMP_SECONDS, lambda s: s.last_step_time),
    (catalog.TRAIN_LOSS, lambda s: s.values.get("loss")),
    (catalog.TRAIN_LEARNING_RATE, lambda s: s.values.get("lr")),
    (catalog.TRAIN_GRAD_NORM, lambda s: s.values.get("grad_norm")),
    (catalog.TRAIN_MEMORY_ALLOCATED_BYTES, lambda s: s.values.get("mem_allocated")),
    (catalog.TRAIN_MEMORY_RESERVED_BYTES, lambda s: s.values.get("mem_reserved")),
    (catalog.TRAIN_MEMORY_PEAK_BYTES, lambda s: s.values.get("mem_peak")),
    (catalog.TRAIN_BATCH_SIZE, lambda s: s.values.get("batch_size")),
    (catalog.TRAIN_SEQUENCE_LENGTH, lambda s: s.values.get("seq_len")),
)

# Counters the client sends only when it reads the CUDA allocator (omitted otherwise):
# (family, client field).
_OPTIONAL_COUNTERS: tuple[tuple[Family, str], ...] = (
    (catalog.TRAIN_ALLOCATOR_RETRIES, "alloc_retries"),
    (catalog.TRAIN_OOM_ERRORS, "ooms"),
)

_COUNTERS: tuple[tuple[Family, Callable[[RankState], float]], ...] = (
    (catalog.TRAIN_STEPS, lambda s: float(s.steps_total)),
    (catalog.TRAIN_TOKENS, lambda s: s.tokens_total),
    (catalog.TRAIN_SAMPLES, lambda s: s.samples_total),
    (catalog.CLIENT_OVERHEAD_SECONDS, lambda s: s.overhead_total),
    (catalog.CLIENT_SENT_MESSAGES, lambda s: float(s.sent_total)),
    (catalog.INGEST_MESSAGES_UNAPPLIED, lambda s: float(s.unapplied_total)),
    (catalog.CLIENT_REFUSED_VALUES, lambda s: float(s.refused_values)),
    (catalog.RUN_CRASHES, lambda s: float(s.crashes)),
    (catalog.RUN_RESTARTS, lambda s: float(s.analytics.restarts)),
    (catalog.TRAIN_STEP_ROLLBACKS, lambda s: float(s.rollbacks)),
)

# When an event last happened (Unix s; omitted before the first): crashes and failed finishes
# (detector events), the client's allocator totals (their rises, analytics.events.ClientTotals),
# the rollbacks that repeat.
_EVENT_TIMES: tuple[tuple[Family, Callable[[RankState], float | None]], ...] = (
    (catalog.RUN_CRASHES_LAST_TIMESTAMP_SECONDS, lambda s: _latest(s.analytics.events.last)),
    (
        catalog.TRAIN_STEP_ROLLBACKS_REPEAT_TIMESTAMP_SECONDS,
        lambda s: s.analytics.rollbacks_repeat_time(),
    ),
    (
        catalog.TRAIN_ALLOCATOR_RETRIES_LAST_TIMESTAMP_SECONDS,
        lambda s: s.analytics.totals.last.get("alloc_retries"),
    ),
    (
        catalog.TRAIN_OOM_ERRORS_LAST_TIMESTAMP_SECONDS,
        lambda s: s.analytics.totals.last.get("ooms"),
    ),
)
DROP_REASONS = ("disconnected", "backpressure", "encode_error", "in_flight")
"""``reason`` values of ``trainmon_client_dropped_messages_total``, each the client total
``dropped_<reason>``."""


def _latest(last: dict[str, float]) -> float | None:
    """The later of the rank's last crash and last failed finish (detector events)."""
    crash, failed = last.get("crash"), last.get("failed")
    if crash is None or failed is None:
        return crash if failed is None else failed
    return max(crash, failed)


@register("training")
class TrainingCollector:
    """Builds the training families from the store (one lock hold per scrape)."""

    name = "training"

    def __init__(self, ctx: CollectorContext) -> None:
        self.store = ctx.store
        self.window_s = ctx.settings.rate_window_seconds

    def collect(self) -> Iterable[Metric]:
        """Return every training family (types and units: docs/metrics.md)."""
        now = time.time()
        gauges = [(f.gauge(), fn) for f, fn in _GAUGES]
        counters = [(f.counter(), fn) for f, fn in _COUNTERS]
        times = [(f.gauge(), fn) for f, fn in _EVENT_TIMES]
        optional = [(f.counter(), key) for f, key in _OPTIONAL_COUNTERS]
        rank_info = catalog.RANK_INFO.gauge()
        run_info = catalog.RUN_INFO.gauge()
        world_size = catalog.RUN_WORLD_SIZE.gauge()
        tps = catalog.TRAIN_TOKENS_PER_SECOND.gauge()
        sps = catalog.TRAIN_SAMPLES_PER_SECOND.gauge()
        ovr = catalog.CLIENT_OVERHEAD_RATIO.gauge()
        step_hist = catalog.TRAIN_STEP_DURATION_SECONDS.histogram()
        nonfinite = catalog.TRAIN_NONFINITE_VALUES.counter()
        dropped = catalog.CLIENT_DROPPED_MESSAGES.counter()
        nonfinite_at = catalog.TRAIN_NONFINITE_VALUES_LAST_TIMESTAMP_SECONDS.gauge()
        dropped_at = catalog.CLIENT_DROPPED_MESSAGES_LAST_TIMESTAMP_SECONDS.gauge()
        custom = catalog.TRAIN_CUSTOM_VALUE.gauge()
        runs: dict[tuple[str, str], int] = {}
        buckets = self.store.buckets
        for s in self.store.iter_ranks():
            labels = [s.namespace, s.run, str(s.rank)]
            ns_run = (s.namespace, s.run)
            runs[ns_run] = max(runs.get(ns_run, 0), s.world_size)
            for fam, fn in gauges:
                v = fn(s)
                if v is not None:
                    fam.add_metric(labels, v)
            for cfam, cfn in counters:
                cfam.add_metric(labels, cfn(s))
            for tfam, tfn in times:
                t = tfn(s)
                if t is not None:
                    tfam.add_metric(labels, t)
            for ofam, key in optional:
                v = s.values.get(key)
                if v is not None:
                    ofam.add_metric(labels, v)
            rank_info.add_metric(
                [
                    s.namespace,
                    s.run,
                    str(s.rank),
                    str(s.local_rank),
                    str(s.world_size),
                    s.hostname,
                    s.gpu_uuid or "",
                    s.client_version,
                    s.dtype,
                    s.pod,
                ],
                1.0,
            )
            rates = derive.rates(s, now, self.window_s)
            if rates is not None:
                tps.add_metric(labels, rates.tokens_per_second)
                sps.add_metric(labels, rates.samples_per_second)
                ovr.add_metric(labels, rates.client_overhead_ratio)
            step_hist.add_metric(labels, _cumulative(buckets, s.hist_counts), s.hist_sum)
            last = s.analytics.events.last
            for field in NONFINITE_FIELDS:
                nonfinite.add_metric([*labels, field], float(s.nonfinite[field]))
                t = last.get(f"nonfinite_{field}")
                if t is not None:
                    nonfinite_at.add_metric([*labels, field], t)
            dropped.add_metric([*labels, "disconnected"], float(s.dropped_disconnected))
            dropped.add_metric([*labels, "backpressure"], float(s.dropped_backpressure))
            dropped.add_metric([*labels, "encode_error"], float(s.dropped_encode_error))
            dropped.add_metric([*labels, "in_flight"], float(s.dropped_in_flight))
            rises = s.analytics.totals.last
            if rises:
                for reason in DROP_REASONS:
                    t = rises.get(f"dropped_{reason}")
                    if t is not None:
                        dropped_at.add_metric([*labels, reason], t)
            for name, v in s.custom.items():
                if v is not None:  # None: name bound, no value yet
                    custom.add_metric([*labels, name], v)
        for (namespace, run), world in runs.items():
            run_info.add_metric([namespace, run, str(world)], 1.0)
            world_size.add_metric([namespace, run], float(world))
        out: list[Any] = [fam for fam, _ in gauges]
        out += [fam for fam, _ in counters]
        out += [fam for fam, _ in times]
        out += [fam for fam, _ in optional]
        out += [
            rank_info,
            run_info,
            world_size,
            tps,
            sps,
            ovr,
            step_hist,
            nonfinite,
            nonfinite_at,
            dropped,
            dropped_at,
            custom,
        ]
        return out


def _cumulative(bounds: tuple[float, ...], counts: list[int]) -> list[tuple[str, float]]:
    """Prometheus histogram buckets from per-bucket counts (last entry: +Inf)."""
    out = []
    acc = 0
    for bound, n in zip(bounds, counts[:-1], strict=True):
        acc += n
        out.append((_fmt(bound), float(acc)))
    acc += counts[-1]
    out.append(("+Inf", float(acc)))
    return out


def _fmt(bound: float) -> str:
    return repr(float(bound))

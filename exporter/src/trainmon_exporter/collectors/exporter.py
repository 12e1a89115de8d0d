"""The exporter's own identity and state sizes."""

from __future__ import annotations

import platform
from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from trainmon_exporter import __version__
from trainmon_exporter._build import REVISION
from trainmon_exporter.collectors import CollectorContext, register


@register("exporter")
class ExporterCollector:
    """``trainmon_build_info``, tracked, expired and evicted ranks, and the series estimate."""

    name = "exporter"

    def __init__(self, ctx: CollectorContext) -> None:
        self.store = ctx.store

    def collect(self) -> Iterable[Metric]:
        """Return the exporter's self-describing families."""
        info = GaugeMetricFamily(
            "trainmon_build_info",
            "Always 1; labels name the exporter version, git revision and Python version.",
            labels=["version", "revision", "python_version"],
        )
        info.add_metric([__version__, REVISION, platform.python_version()], 1.0)
        with self.store.lock:
            n = len(self.store.ranks)
            expired = self.store.expired_total
            evicted = dict(self.store.evicted)
            series = self.store.series_used
        ranks = GaugeMetricFamily(
            "trainmon_exporter_ranks", "(run, rank) pairs whose series are exported now."
        )
        ranks.add_metric([], float(n))
        exp = CounterMetricFamily(
            "trainmon_exporter_ranks_expired",
            "(run, rank) pairs dropped after series_ttl_seconds without a connection.",
        )
        exp.add_metric([], float(expired))
        ev = CounterMetricFamily(
            "trainmon_exporter_ranks_evicted",
            "Disconnected (run, rank) pairs dropped before series_ttl_seconds to make room for a "
            "new rank (max_ranks or max_series reached), by the status they ended with; "
            "finished and failed go first, then crashed, then running (closed by the exporter).",
            labels=["status"],
        )
        for status, count in evicted.items():
            ev.add_metric([status], float(count))
        used = GaugeMetricFamily(
            "trainmon_exporter_series",
            "Estimated series of every rank in the exposition, against the max_series budget "
            "(per rank, custom metric, evaluation value, operation and exported layer).",
        )
        used.add_metric([], float(series))
        return [info, ranks, exp, ev, used]

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
    """``trainmon_build_info``, tracked ranks and expired ranks."""

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
        ranks = GaugeMetricFamily(
            "trainmon_exporter_ranks", "(run, rank) pairs whose series are exported now."
        )
        ranks.add_metric([], float(n))
        exp = CounterMetricFamily(
            "trainmon_exporter_ranks_expired",
            "(run, rank) pairs dropped after series_ttl_seconds without a connection.",
        )
        exp.add_metric([], float(expired))
        return [info, ranks, exp]

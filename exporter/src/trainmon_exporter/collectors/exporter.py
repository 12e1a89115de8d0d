"""The exporter's own identity and state sizes."""

from __future__ import annotations

import platform
from collections.abc import Iterable

from prometheus_client.metrics_core import Metric

from trainmon_exporter import __version__, catalog
from trainmon_exporter._build import revision
from trainmon_exporter.collectors import CollectorContext, register


@register("exporter")
class ExporterCollector:
    """The exporter's own series: build info, ranks, series, refused HELLOs, owner claims.

    And its hang evidence: requests, what became of them, drops, bytes held.
    """

    name = "exporter"

    def __init__(self, ctx: CollectorContext) -> None:
        self.store = ctx.store

    def collect(self) -> Iterable[Metric]:
        """Return the exporter's self-describing families."""
        info = catalog.BUILD_INFO.gauge()
        info.add_metric([__version__, revision(), platform.python_version()], 1.0)
        with self.store.lock:
            n = len(self.store.ranks)
            expired = self.store.expired_total
            evicted = dict(self.store.admission.evicted)
            series = self.store.admission.series_used
            refused = dict(self.store.admission.hellos_refused)
            claims = self.store.claims
            bad_claims = dict(claims.invalid) if claims is not None else {}
            hangs = self.store.hangs
            requests, held = hangs.requests, hangs.bytes
            captures, dropped = dict(hangs.results), dict(hangs.dropped)
        ranks = catalog.EXPORTER_RANKS.gauge()
        ranks.add_metric([], float(n))
        exp = catalog.EXPORTER_RANKS_EXPIRED.counter()
        exp.add_metric([], float(expired))
        ev = catalog.EXPORTER_RANKS_EVICTED.counter()
        for status, count in evicted.items():
            ev.add_metric([status], float(count))
        used = catalog.EXPORTER_SERIES.gauge()
        used.add_metric([], float(series))
        hellos = catalog.INGEST_HELLOS_REFUSED.counter()
        for (reason, uid), count in sorted(refused.items()):
            hellos.add_metric([reason, uid], float(count))
        invalid = catalog.OWNER_CLAIMS_INVALID.counter()
        for problem, count in bad_claims.items():
            invalid.add_metric([problem], float(count))
        asked = catalog.HANG_CAPTURE_REQUESTS.counter()
        asked.add_metric([], float(requests))
        answered = catalog.HANG_CAPTURES.counter()
        for result, count in captures.items():
            answered.add_metric([result], float(count))
        drops = catalog.HANG_EVIDENCE_DROPPED.counter()
        for reason, count in dropped.items():
            drops.add_metric([reason], float(count))
        evidence = catalog.HANG_EVIDENCE_BYTES.gauge()
        evidence.add_metric([], float(held))
        return [info, ranks, exp, ev, used, hellos, invalid, asked, answered, drops, evidence]

"""The exporter's own identity and state sizes."""

from __future__ import annotations

import platform
from collections.abc import Iterable

from prometheus_client.metrics_core import Metric

from trainmon_exporter import __version__, catalog
from trainmon_exporter._build import revision
from trainmon_exporter.collectors import CollectorContext, register
from trainmon_exporter.state.statefile import REFUSALS

TENANTS_LABELLED = 32
"""Tenants with series of their own in ``trainmon_exporter_tenant_ranks`` and
``trainmon_exporter_tenant_series`` (those holding most ranks); the rest are summed."""


@register("exporter")
class ExporterCollector:
    """``trainmon_build_info``, ranks, series, tenants' holdings, refused HELLOs, bad claims.

    And what outlives a rank (departed ranks, the state file), and its hang evidence:
    requests, what became of them, drops, bytes held.
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
            refused_at = dict(self.store.admission.hellos_refused_at)
            holdings = list(self.store.admission.holdings(TENANTS_LABELLED))
            claims = self.store.claims
            bad_claims = dict(claims.invalid) if claims is not None else {}
            ledger = self.store.ledger
            departed, departed_evicted = len(ledger), ledger.evicted
            fs = self.store.file_stats
            saves = {"ok": fs.saves_ok, "error": fs.save_errors}
            last_save, refused_files = fs.last_save, dict(fs.refused)
            restored = {"rank": fs.restored_ranks, "departed": fs.restored_departed}
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
        tenant_ranks = catalog.EXPORTER_TENANT_RANKS.gauge()
        tenant_series = catalog.EXPORTER_TENANT_SERIES.gauge()
        for namespace, uid, n_ranks, n_series in holdings:
            tenant_ranks.add_metric([namespace, uid], float(n_ranks))
            tenant_series.add_metric([namespace, uid], float(n_series))
        hellos = catalog.INGEST_HELLOS_REFUSED.counter()
        for labels, count in sorted(refused.items()):
            hellos.add_metric(list(labels), float(count))
        hellos_at = catalog.INGEST_HELLOS_REFUSED_LAST_TIMESTAMP_SECONDS.gauge()
        for labels, when in sorted(refused_at.items()):
            hellos_at.add_metric(list(labels), when)
        invalid = catalog.OWNER_CLAIMS_INVALID.counter()
        for problem, count in bad_claims.items():
            invalid.add_metric([problem], float(count))
        dep = catalog.EXPORTER_DEPARTED_RANKS.gauge()
        dep.add_metric([], float(departed))
        dep_ev = catalog.EXPORTER_DEPARTED_EVICTED.counter()
        dep_ev.add_metric([], float(departed_evicted))
        save = catalog.EXPORTER_STATE_SAVES.counter()
        for result, count in saves.items():
            save.add_metric([result], float(count))
        last = catalog.EXPORTER_STATE_LAST_SAVE_TIMESTAMP_SECONDS.gauge()
        last.add_metric([], last_save)
        refused_fam = catalog.EXPORTER_STATE_REFUSED.counter()
        for reason in (*REFUSALS, "bad_row"):
            refused_fam.add_metric([reason], float(refused_files.get(reason, 0)))
        rest = catalog.EXPORTER_STATE_RESTORED.gauge()
        for kind, count in restored.items():
            rest.add_metric([kind], float(count))
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
        return [
            info,
            ranks,
            exp,
            ev,
            used,
            tenant_ranks,
            tenant_series,
            hellos,
            hellos_at,
            invalid,
            dep,
            dep_ev,
            save,
            last,
            refused_fam,
            rest,
            asked,
            answered,
            drops,
            evidence,
        ]

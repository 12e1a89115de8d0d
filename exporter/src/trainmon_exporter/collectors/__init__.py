"""Collectors: one per file, registered by name, each switchable in settings.

A collector builds fresh ``*MetricFamily`` objects at every scrape (prometheus-client's custom
collector protocol). :class:`ScrapeCollector` runs the enabled ones and adds, per collector,
``trainmon_scrape_collector_duration_seconds`` and ``trainmon_scrape_collector_success``, so one
broken collector never hides the others (node_exporter's ``execute()`` pattern).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from prometheus_client.metrics_core import Metric

from trainmon_exporter import catalog
from trainmon_exporter.sampler import GpuSampler
from trainmon_exporter.settings import Settings
from trainmon_exporter.state.store import Store

log = logging.getLogger("trainmon_exporter.collectors")


@dataclass(frozen=True)
class CollectorContext:
    """What a collector factory gets: the settings, the shared state and the GPU sampler."""

    settings: Settings
    store: Store
    gpus: GpuSampler | None = None


class CollectorFailed(Exception):
    """A collector cannot produce its series for a known reason (one line, no traceback).

    The message goes to the log once per change, to ``/readyz`` and to the status page.
    """


class Collector(Protocol):
    """A named source of metric families, called at scrape time in a worker thread."""

    name: str

    def collect(self) -> Iterable[Metric]:
        """Return fresh metric families."""
        ...


FACTORIES: dict[str, Callable[[CollectorContext], Collector]] = {}
ORDER = ("rank_gpu", "exporter", "gpu", "health", "layers", "process", "training")
"""The order collectors run in, hence the order of families in ``/metrics``
(tests/golden/session.exposition.txt); others registered run after these."""


def register(
    name: str,
) -> Callable[[Callable[[CollectorContext], Collector]], Callable[[CollectorContext], Collector]]:
    """Class decorator: make a collector available under ``name`` (its settings toggle)."""

    def deco(
        factory: Callable[[CollectorContext], Collector],
    ) -> Callable[[CollectorContext], Collector]:
        FACTORIES[name] = factory
        return factory

    return deco


class ScrapeCollector:
    """Runs the enabled collectors with per-collector timing and failure isolation."""

    def __init__(self, collectors: list[Collector]) -> None:
        self.collectors = collectors
        self.last_success: dict[str, bool] = {}
        self.last_error: dict[str, str] = {}

    def collect(self) -> Iterator[Metric]:
        """prometheus-client entry point."""
        duration = catalog.SCRAPE_COLLECTOR_DURATION_SECONDS.gauge()
        success = catalog.SCRAPE_COLLECTOR_SUCCESS.gauge()
        for c in self.collectors:
            t0 = time.perf_counter()
            try:
                families = list(c.collect())
                ok = True
                self.last_error.pop(c.name, None)
            except CollectorFailed as exc:
                if self.last_error.get(c.name) != str(exc):
                    log.warning("collector %s failed: %s", c.name, exc)
                self.last_error[c.name] = str(exc)
                families, ok = [], False
            except Exception as exc:
                log.exception("collector %s failed", c.name)
                self.last_error[c.name] = f"{type(exc).__name__}: {exc}"
                families, ok = [], False
            duration.add_metric([c.name], time.perf_counter() - t0)
            success.add_metric([c.name], 1.0 if ok else 0.0)
            self.last_success[c.name] = ok
            yield from families
        yield duration
        yield success


def build_collectors(ctx: CollectorContext) -> list[Collector]:
    """Instantiate the collectors enabled in ``ctx.settings.collectors``."""
    # Import for the side effect of registration.
    from trainmon_exporter.collectors import (  # noqa: F401
        exporter,
        gpu,
        health,
        layers,
        process,
        rank_gpu,
        training,
    )

    toggles = ctx.settings.collectors.model_dump()
    names = sorted(FACTORIES, key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER))
    return [FACTORIES[name](ctx) for name in names if toggles.get(name, True)]

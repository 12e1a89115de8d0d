"""The exposition's sample budget: never more samples than Prometheus scrapes with.

Prometheus fails a whole scrape whose samples pass the target's ``sample_limit`` (a
PodMonitor's ``sampleLimit``): ``up`` becomes 0 and every series of the node goes stale, its
run health and GPU telemetry with its per-layer series. :class:`SampleBudget` stands between
the registry and the encoders of ``/metrics``: it collects every family, counts every sample
the exposition would carry (each histogram bucket, ``_sum`` and ``_count``, GPU, process and
the exporter's own series) and, past ``scrape_sample_limit``, leaves out series of the least
important class first, until what remains fits:

1. ``layer``: the per-layer series of ``Run.watch`` (one layer of one rank at a time);
2. ``custom``: custom metrics (one name of one rank at a time);
3. ``evaluation``: the named values of ``Run.eval``;
4. ``operation``: the tracked operations of ``Run.track``;
5. ``rank``: every remaining series of whole ranks. Never reached while every rank's own
   series (``state.admission.SERIES_PER_RANK``) fit the limit with the node's; it keeps the
   guarantee when they do not, and the alert says so;
6. ``node``: whole families of the node from the end of the exposition. Never reached while
   the node's own series, its GPUs' included, fit the limit.

Within a class the series go in reverse order of their labels (the last run's highest rank's
last layer first), so the same series are left out scrape after scrape rather than a
different set each time. Run health, the crash and non-finite counters and GPU telemetry are
in none of the first four classes. What was left out is exported, per class, in
``trainmon_exporter_series_shed`` (series of the last scrape left out), next to the limit
(``trainmon_exporter_sample_limit``) and the samples sent (``trainmon_exporter_samples``);
those three families' own samples are reserved out of the limit.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client.metrics_core import Metric

from trainmon_exporter import catalog

CLASSES = ("layer", "custom", "evaluation", "operation", "rank", "node")
"""Shed classes, the first shed first (values of the ``class`` label)."""

_GROUP_LABELS: dict[str, tuple[str, ...]] = {
    "layer": ("run", "rank", "layer", "namespace"),
    "custom": ("run", "rank", "name", "namespace"),
    "evaluation": ("run", "rank", "name", "namespace"),
    "operation": ("run", "rank", "operation", "namespace"),
    "rank": ("run", "rank", "namespace"),
}
"""Labels whose values make one unit of shedding in each class: a unit goes whole (the
namespace last, so that the order of shedding off Kubernetes is by run and rank alone)."""

CLASS_OF: dict[str, str] = {
    **{f.name: "layer" for f in catalog.ALL if f.collector == "layers"},
    catalog.TRAIN_CUSTOM_VALUE.name: "custom",
    catalog.EVAL_VALUE.name: "evaluation",
    catalog.MONITORING_SECONDS.name: "operation",
    catalog.MONITORING_OPERATIONS.name: "operation",
    catalog.MONITORING_ACTIVE.name: "operation",
}
"""Family name -> shed class for the named classes; a family with ``run`` and ``rank``
labels not named here is in ``rank``, any other in ``node``."""

OWN_SAMPLES = len(CLASSES) + 2
"""Samples of the budget's own families (the shed gauge per class, the limit, the count)."""


class _Collects(Protocol):
    def collect(self) -> Any: ...


def _sort_key(values: tuple[str, ...]) -> tuple[tuple[int, int | str], ...]:
    """Label values ordered as people read them: a rank number as a number."""
    return tuple((0, int(v)) if v.isdecimal() else (1, v) for v in values)


def _class(metric: Metric) -> str:
    cls = CLASS_OF.get(metric.name)
    if cls is not None:
        return cls
    first = metric.samples[0].labels if metric.samples else {}
    return "rank" if "run" in first and "rank" in first else "node"


def fit(families: list[Metric], room: int) -> tuple[list[Metric], dict[str, int]]:
    """Leave out series by class until ``families`` carry at most ``room`` samples.

    Args:
        families: fresh families of one scrape (their ``samples`` lists are replaced).
        room: most samples the result may carry (>= 0).

    Returns:
        The families (a family whose samples all went stays, empty: its HELP and TYPE lines
        cost no sample) and the samples left out per class of :data:`CLASSES`.
    """
    shed = dict.fromkeys(CLASSES, 0)
    excess = sum(len(m.samples) for m in families) - room
    if excess <= 0:
        return families, shed
    by_class: dict[str, list[Metric]] = {}
    for m in families:
        by_class.setdefault(_class(m), []).append(m)
    for cls, names in _GROUP_LABELS.items():
        members = by_class.get(cls, [])
        units: dict[tuple[str, ...], int] = {}
        for m in members:
            for s in m.samples:
                unit = tuple(s.labels.get(n, "") for n in names)
                units[unit] = units.get(unit, 0) + 1
        dropped = set()
        for unit in sorted(units, key=_sort_key, reverse=True):
            if excess <= 0:
                break
            dropped.add(unit)
            excess -= units[unit]
            shed[cls] += units[unit]
        if dropped:
            for m in members:
                m.samples = [
                    s for s in m.samples if tuple(s.labels.get(n, "") for n in names) not in dropped
                ]
        if excess <= 0:
            break
    kept = families
    if excess > 0:
        gone: set[int] = set()
        for m in reversed(by_class.get("node", [])):
            if excess <= 0:
                break
            gone.add(id(m))
            excess -= len(m.samples)
            shed["node"] += len(m.samples)
        kept = [m for m in families if id(m) not in gone]
    return kept, shed


class SampleBudget:
    """A registry view whose ``collect()`` never yields more than ``limit`` samples.

    Wraps anything with ``collect()`` (the exporter's registry) and is passed to the
    encoders in its place. Thread-safe: each scrape fits its own families; the last shed
    figures are kept under a lock for the views.
    """

    def __init__(self, registry: _Collects, limit: int) -> None:
        if limit < OWN_SAMPLES:
            raise ValueError(f"a sample limit of {limit} leaves no room for any series")
        self.registry = registry
        self.limit = limit
        self._lock = threading.Lock()
        self.last_shed: dict[str, int] = dict.fromkeys(CLASSES, 0)
        self.last_samples = 0

    def collect(self) -> Iterator[Metric]:
        """Every family of the registry that fits, then the budget's own three."""
        kept, shed = fit(list(self.registry.collect()), self.limit - OWN_SAMPLES)
        samples = sum(len(m.samples) for m in kept) + OWN_SAMPLES
        with self._lock:
            self.last_shed, self.last_samples = shed, samples
        yield from kept
        limit = catalog.EXPORTER_SAMPLE_LIMIT.gauge()
        limit.add_metric([], float(self.limit))
        sent = catalog.EXPORTER_SAMPLES.gauge()
        sent.add_metric([], float(samples))
        gauge = catalog.EXPORTER_SERIES_SHED.gauge()
        for cls in CLASSES:
            gauge.add_metric([cls], float(shed[cls]))
        yield limit
        yield sent
        yield gauge

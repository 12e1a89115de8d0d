"""``process_*`` series of the exporter itself (CPU seconds, resident memory, open fds)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import ProcessCollector as _ProcessCollector
from prometheus_client.metrics_core import Metric

from trainmon_exporter.collectors import CollectorContext, register


@register("process")
class ProcessCollector:
    """prometheus-client's own process collector, from ``/proc/self``."""

    name = "process"

    def __init__(self, ctx: CollectorContext) -> None:
        self._inner = _ProcessCollector(registry=None)

    def collect(self) -> Iterable[Metric]:
        """Return the ``process_*`` families."""
        return self._inner.collect()

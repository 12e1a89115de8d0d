"""Per-layer series from ``Run.watch`` checks (label ``layer``, at most ``max_layers``)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.metrics_core import Metric

from trainmon_client import _protocol as P
from trainmon_exporter import catalog
from trainmon_exporter.catalog import Family
from trainmon_exporter.collectors import CollectorContext, register

# (client statistic, family): the statistic's code is trainmon_client._protocol.LAYER_STATS.
_FAMILIES: tuple[tuple[str, Family], ...] = (
    ("grad_norm", catalog.LAYER_GRAD_NORM),
    ("grad_mean", catalog.LAYER_GRAD_MEAN),
    ("grad_std", catalog.LAYER_GRAD_STDDEV),
    ("weight_norm", catalog.LAYER_WEIGHT_NORM),
    ("update_ratio", catalog.LAYER_UPDATE_RATIO),
    ("activation_mean", catalog.LAYER_ACTIVATION_MEAN),
    ("activation_std", catalog.LAYER_ACTIVATION_STDDEV),
    ("dead_ratio", catalog.LAYER_DEAD_UNITS_RATIO),
)


@register("layers")
class LayersCollector:
    """Last watch check of every layer: gradients, weights, updates, activations, quantiles."""

    name = "layers"

    def __init__(self, ctx: CollectorContext) -> None:
        self.store = ctx.store

    def collect(self) -> Iterable[Metric]:
        """Return the per-layer families (client side: trainmon_client._watch)."""
        fams = [(P.LAYER_STATS[stat], f.gauge()) for stat, f in _FAMILIES]
        percentile = catalog.LAYER_GRAD_PERCENTILE.gauge()
        qcodes = [(P.QUANTILE_CODE0 + i, f"{q * 100:g}") for i, q in enumerate(P.LAYER_QUANTILES)]
        for s in self.store.iter_ranks():
            for layer, row in s.layers.items():
                lv = [s.namespace, s.run, str(s.rank), layer]
                for code, fam in fams:
                    v = row.get(code)
                    if v is not None and v == v:
                        fam.add_metric(lv, v)
                for code, q in qcodes:
                    v = row.get(code)
                    if v is not None and v == v:
                        percentile.add_metric([*lv, q], v)
        return [fam for _, fam in fams] + [percentile]

"""Per-layer series from ``Run.watch`` checks (label ``layer``, at most ``max_layers``)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from trainmon_client import _protocol as P
from trainmon_exporter.collectors import CollectorContext, register

_FAMILIES = (
    ("grad_norm", "trainmon_layer_grad_norm", "L2 norm of the layer's gradients."),
    ("grad_mean", "trainmon_layer_grad_mean", "Mean of the layer's gradient values."),
    ("grad_std", "trainmon_layer_grad_stddev", "Standard deviation of its gradient values."),
    ("weight_norm", "trainmon_layer_weight_norm", "L2 norm of the layer's weights."),
    (
        "update_ratio",
        "trainmon_layer_update_ratio",
        "||w_after - w_before|| / ||w_before|| of the last watched optimizer step (or "
        "lr*||g||/||w|| when the client runs watch(exact_update=False)).",
    ),
    ("activation_mean", "trainmon_layer_activation_mean", "Mean of the layer's output."),
    ("activation_std", "trainmon_layer_activation_stddev", "Standard deviation of its output."),
    (
        "dead_ratio",
        "trainmon_layer_dead_units_ratio",
        "Share of the layer's output units never above 0 in the watched batch.",
    ),
)


@register("layers")
class LayersCollector:
    """Last watch check of every layer: gradients, weights, updates, activations, quantiles."""

    name = "layers"

    def __init__(self, ctx: CollectorContext) -> None:
        self.store = ctx.store

    def collect(self) -> Iterable[Metric]:
        """Return the per-layer families (client side: trainmon_client._watch)."""
        labels = ["run", "rank", "layer"]
        fams = [
            (P.LAYER_STATS[stat], GaugeMetricFamily(name, f"{doc} (Run.watch)", labels=labels))
            for stat, name, doc in _FAMILIES
        ]
        percentile = GaugeMetricFamily(
            "trainmon_layer_grad_percentile",
            "Percentile of the layer's gradient values (Run.watch, at most 65,536 strided "
            "elements).",
            labels=[*labels, "percentile"],
        )
        qcodes = [(P.QUANTILE_CODE0 + i, f"{q * 100:g}") for i, q in enumerate(P.LAYER_QUANTILES)]
        for s in self.store.iter_ranks():
            for layer, row in s.layers.items():
                lv = [s.run, str(s.rank), layer]
                for code, fam in fams:
                    v = row.get(code)
                    if v is not None and v == v:
                        fam.add_metric(lv, v)
                for code, q in qcodes:
                    v = row.get(code)
                    if v is not None and v == v:
                        percentile.add_metric([*lv, q], v)
        return [fam for _, fam in fams] + [percentile]

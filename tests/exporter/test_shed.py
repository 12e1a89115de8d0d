"""The sample budget of ``/metrics``: what is shed first, and that the limit always holds."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.metrics_core import Metric

from trainmon_exporter import catalog
from trainmon_exporter.exposition import TextExposition
from trainmon_exporter.shed import CLASS_OF, CLASSES, OWN_SAMPLES, SampleBudget, fit

RANKS = [("a", 0), ("a", 1), ("b", 0)]
LAYERS = ("blocks.0", "blocks.1", "head")
GPUS = 2


class Families:
    """One scrape's families of a node: ranks with layers, custom, evaluation, operations."""

    def __init__(self, layers: tuple[str, ...] = LAYERS) -> None:
        self.layers = layers

    def collect(self) -> list[Metric]:
        up = catalog.RUN_UP.gauge()
        hung = catalog.TRAIN_HUNG.gauge()
        crashes = catalog.RUN_CRASHES.counter()
        nonfinite = catalog.TRAIN_NONFINITE_VALUES.counter()
        steps = catalog.TRAIN_STEP_DURATION_SECONDS.histogram()
        custom = catalog.TRAIN_CUSTOM_VALUE.gauge()
        evaluation = catalog.EVAL_VALUE.gauge()
        op_seconds = catalog.MONITORING_SECONDS.counter()
        op_active = catalog.MONITORING_ACTIVE.gauge()
        grad = catalog.LAYER_GRAD_NORM.gauge()
        weight = catalog.LAYER_WEIGHT_NORM.gauge()
        for run, rank in RANKS:
            lv = ["", run, str(rank)]  # no namespace: left out of the samples
            up.add_metric(lv, 1.0)
            hung.add_metric(lv, 0.0)
            crashes.add_metric(lv, 0.0)
            for field in ("loss", "grad_norm"):
                nonfinite.add_metric([*lv, field], 0.0)
            steps.add_metric(lv, [("0.1", 1.0), ("1.0", 2.0), ("+Inf", 3.0)], 1.5)
            for name in ("tokens_seen", "aux_loss"):
                custom.add_metric([*lv, name], 1.0)
                evaluation.add_metric([*lv, name], 2.0)
            op_seconds.add_metric([*lv, "data"], 3.0)
            op_active.add_metric([*lv, "data"], 0.0)
            for layer in self.layers:
                grad.add_metric([*lv, layer], 0.5)
                weight.add_metric([*lv, layer], 9.0)
        util = catalog.GPU_UTILIZATION_RATIO.gauge()
        xid = catalog.GPU_XID_ERRORS.counter()
        for i in range(GPUS):
            util.add_metric([str(i), f"GPU-{i}"], 0.9)
            xid.add_metric([str(i), f"GPU-{i}", "79"], 0.0)
        ranks = catalog.EXPORTER_RANKS.gauge()
        ranks.add_metric([], float(len(RANKS)))
        rank_families = [up, hung, crashes, nonfinite, steps, custom, evaluation]
        return [*rank_families, op_seconds, op_active, grad, weight, util, xid, ranks]


def samples(families: list[Metric]) -> int:
    return sum(len(m.samples) for m in families)


def names(families: list[Metric]) -> dict[str, list[dict[str, str]]]:
    out: dict[str, list[dict[str, str]]] = {}
    for m in families:
        for s in m.samples:
            out.setdefault(s.name, []).append(s.labels)
    return out


TOTAL = samples(Families().collect())
PER_RANK = {  # samples per rank in each class of Families
    "layer": 2 * len(LAYERS),
    "custom": 2,
    "evaluation": 2,
    "operation": 2,
}
RANK_OWN = 1 + 1 + 1 + 2 + 5  # up, hung, crashes, two non-finite fields, 3 buckets + sum + count
NODE = 2 * GPUS + 1


def test_the_counts_of_the_fixture_add_up() -> None:
    assert len(RANKS) * (sum(PER_RANK.values()) + RANK_OWN) + NODE == TOTAL


def test_nothing_is_shed_under_the_limit() -> None:
    fams = Families().collect()
    kept, shed = fit(fams, TOTAL)
    assert kept is fams and samples(kept) == TOTAL
    assert shed == dict.fromkeys(CLASSES, 0)


def test_layers_go_first_one_layer_of_the_last_rank_at_a_time() -> None:
    kept, shed = fit(Families().collect(), TOTAL - 1)
    # One layer is the smallest unit: both its statistics go, the last layer of rank b/0.
    assert shed == {**dict.fromkeys(CLASSES, 0), "layer": 2}
    gone = [
        labels
        for labels in names(Families().collect())["trainmon_layer_grad_norm"]
        if labels not in names(kept)["trainmon_layer_grad_norm"]
    ]
    assert gone == [{"run": "b", "rank": "0", "layer": "head"}]


def test_the_classes_are_shed_in_order_and_health_and_gpus_stay() -> None:
    every_layer = len(RANKS) * PER_RANK["layer"]
    # All layers and one custom name of the last rank.
    kept, shed = fit(Families().collect(), TOTAL - every_layer - 1)
    assert shed["layer"] == every_layer and shed["custom"] == 1
    assert "trainmon_layer_grad_norm" not in names(kept)
    assert len(names(kept)["trainmon_train_custom_value"]) == len(RANKS) * 2 - 1
    assert shed["evaluation"] == shed["operation"] == shed["rank"] == 0
    # Everything but the ranks' own series and the node's: the four classes go, nothing else.
    room = len(RANKS) * RANK_OWN + NODE
    kept, shed = fit(Families().collect(), room)
    assert samples(kept) == room
    assert shed == {
        **{cls: len(RANKS) * n for cls, n in PER_RANK.items()},
        "rank": 0,
        "node": 0,
    }
    found = names(kept)
    assert len(found["trainmon_run_up"]) == len(found["trainmon_train_hung"]) == len(RANKS)
    assert len(found["trainmon_train_nonfinite_values_total"]) == 2 * len(RANKS)
    assert len(found["trainmon_gpu_utilization_ratio"]) == GPUS
    assert len(found["trainmon_gpu_xid_errors_total"]) == GPUS
    assert "trainmon_train_custom_value" not in found and "trainmon_eval_value" not in found
    assert "trainmon_monitoring_seconds_total" not in found


def test_past_the_four_classes_whole_ranks_go_last_rank_first() -> None:
    room = len(RANKS) * RANK_OWN + NODE - 1
    kept, shed = fit(Families().collect(), room)
    assert shed["rank"] == RANK_OWN and shed["node"] == 0
    found = names(kept)
    assert {(x["run"], x["rank"]) for x in found["trainmon_run_up"]} == {("a", "0"), ("a", "1")}
    # A histogram stays whole: its buckets, sum and count went with the rank.
    assert len(found["trainmon_train_step_duration_seconds_bucket"]) == 2 * 3
    assert len(found["trainmon_train_step_duration_seconds_count"]) == 2


@pytest.mark.parametrize("room", range(0, TOTAL + 2))
def test_the_result_never_passes_the_room_and_sheds_no_more_than_a_unit_too_many(
    room: int,
) -> None:
    kept, shed = fit(Families().collect(), room)
    assert samples(kept) <= room
    assert samples(kept) + sum(shed.values()) == TOTAL
    # Shed classes form a prefix of the order: no class goes while an earlier one has series.
    went = [cls for cls in CLASSES if shed[cls]]
    assert went == list(CLASSES[: len(went)])


def text_samples(body: bytes) -> int:
    return sum(1 for line in body.decode().splitlines() if line and not line.startswith("#"))


@pytest.mark.parametrize("limit", [OWN_SAMPLES, TOTAL // 2, TOTAL + OWN_SAMPLES, 10_000])
def test_the_exposition_carries_at_most_the_limit_and_says_what_it_shed(limit: int) -> None:
    budget = SampleBudget(Families(), limit)
    body = TextExposition().render(budget)
    assert text_samples(body) <= limit
    lines = body.decode().splitlines()
    assert f"trainmon_exporter_sample_limit {float(limit)}" in lines
    assert f"trainmon_exporter_samples {float(text_samples(body))}" in lines
    shed: dict[str, Any] = {}
    for line in lines:
        if line.startswith("trainmon_exporter_series_shed{"):
            cls = line.split('"')[1]
            shed[cls] = float(line.rsplit(" ", 1)[1])
    assert set(shed) == set(CLASSES)
    assert text_samples(body) - OWN_SAMPLES + sum(shed.values()) == TOTAL
    assert budget.last_shed == {k: int(v) for k, v in shed.items()}


def test_a_limit_without_room_for_its_own_series_is_refused() -> None:
    with pytest.raises(ValueError, match="no room"):
        SampleBudget(Families(), OWN_SAMPLES - 1)


def test_the_named_classes_hold_only_series_of_their_unit() -> None:
    """A family shed by layer, name or operation has that label: run-level verdicts that
    come from layer checks (gradient gain, update ratio) stay with run health."""
    unit_label = {
        "layer": "layer",
        "custom": "name",
        "evaluation": "name",
        "operation": "operation",
    }
    for name, cls in CLASS_OF.items():
        assert unit_label[cls] in catalog.BY_NAME[name].labels, name
    kept = [f for f in catalog.ALL if f.name not in CLASS_OF]
    for family in (
        catalog.TRAIN_GRAD_GAIN_DRIFTS,
        catalog.TRAIN_UPDATE_RATIO_HIGH,
        catalog.RUN_UP,
        catalog.RUN_CRASHES,
        catalog.TRAIN_NONFINITE_VALUES,
        catalog.TRAIN_HUNG,
    ):
        assert family in kept, family.name
    assert all(f in kept for f in catalog.GPU_TABLE)

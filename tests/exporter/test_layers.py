"""Per-layer series from Run.watch, through the real exporter, and the layer detectors."""

from __future__ import annotations

import collections
import inspect
import math
import random
from collections.abc import Callable

import pytest

import trainmon_client
from trainmon_exporter.analytics import AnalyticsSettings, RankAnalytics

from ..conftest import (
    InProcessExporter,
    connect,
    promtool_check_metrics,
    sample,
    tiny_model,
    wait_for,
)

torch = pytest.importorskip("torch")


def train(run: trainmon_client.Run, steps: int, every: int = 2) -> None:
    model, opt = tiny_model()
    run.watch(model, opt, every=every, quantiles_every=every, activations=True, budget=1.0)
    for i in range(steps):
        loss = (model(torch.randn(16, 8)) - 1).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        run.log(i, loss=loss.detach(), mem_allocated=1e9)
    run.finish()


def test_layer_series_reach_metrics(exporter: InProcessExporter) -> None:
    run = connect(exporter, "lay")
    train(run, 6)
    wait_for(lambda: (k := exporter.rank("lay", 0)) and k["status"] == "finished")
    m = exporter.metrics()
    lbl = {"run": "lay", "rank": "0"}
    for layer in ("0", "2", "4"):
        for name in (
            "grad_norm",
            "grad_mean",
            "grad_stddev",
            "weight_norm",
            "update_ratio",
            "activation_mean",
            "activation_stddev",
            "dead_units_ratio",
        ):
            assert sample(m, f"trainmon_layer_{name}", layer=layer, **lbl) is not None, name
        qs = [
            sample(m, "trainmon_layer_grad_percentile", layer=layer, percentile=q, **lbl)
            for q in ("0", "25", "50", "75", "95", "99", "100")
        ]
        assert None not in qs and qs == sorted(qs)  # type: ignore[type-var]
    assert sample(m, "trainmon_train_grad_gain_mean", **lbl) is not None
    assert sample(m, "trainmon_monitoring_operations_total", operation="watch", **lbl) == 3


def test_layer_cap(make_exporter: Callable[..., InProcessExporter]) -> None:
    ex = make_exporter(max_layers=2)
    run = connect(ex, "cap")
    train(run, 2)
    wait_for(lambda: (k := ex.rank("cap", 0)) and k["status"] == "finished")
    m = ex.metrics()
    layers = {dict(lbl)["layer"] for (n, lbl) in m if n == "trainmon_layer_grad_norm"}
    assert layers == {"0", "2"}
    assert sample(m, "trainmon_ingest_values_dropped_total", reason="layer_cap") == 1


def test_layers_of_ranks_outside_layer_ranks_are_analysed_not_exported(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    """Only rank 0's layers become series by default; rank 1's are counted and still judged."""
    # every layer's update reads as too high (ratio below update_ratio_low needs learning peers)
    ex = make_exporter(analytics={"update_ratio_high": 1e-12, "update_ratio_low": 0.0})
    for rank in (0, 1):
        run = connect(ex, "sub", rank=rank, world_size=2)
        train(run, 4)
        wait_for(lambda r=rank: (k := ex.rank("sub", r)) and k["status"] == "finished")
    m = ex.metrics()
    ranks = {dict(lbl)["rank"] for (n, lbl) in m if n.startswith("trainmon_layer_")}
    assert ranks == {"0"}
    # 3 layers x 2 watch checks of rank 1, analysed but not exported
    assert sample(m, "trainmon_ingest_values_dropped_total", reason="layer_rank") == 6
    for rank in ("0", "1"):
        high = sample(m, "trainmon_train_update_ratio_high_total", run="sub", rank=rank)
        assert high == 6, (rank, high)

    ex_all = make_exporter(layer_ranks="all")
    run = connect(ex_all, "every", rank=1, world_size=2)
    train(run, 2)
    wait_for(lambda: (k := ex_all.rank("every", 1)) and k["status"] == "finished")
    m = ex_all.metrics()
    assert sample(m, "trainmon_layer_grad_norm", run="every", rank="1", layer="0") is not None
    assert sample(m, "trainmon_ingest_values_dropped_total", reason="layer_rank") == 0


def rows(norms: list[float], ratio: float = 1e-3) -> list[tuple[str, dict[int, float]]]:
    return [(f"l{i}", {1: n, 5: ratio}) for i, n in enumerate(norms)]


def test_gradient_gain_and_drift() -> None:
    a = RankAnalytics(
        AnalyticsSettings(
            gain_baseline_checks=3, gain_window_checks=1, gain_drift_checks=2, gain_drift_factor=2
        )
    )
    for _ in range(3):
        a.observe_layers(rows([4.0, 2.0, 1.0]))  # each layer has twice the next one's norm
    assert a.gain_mean == pytest.approx(2.0) and a.gain_drift == pytest.approx(1.0)
    a.observe_layers(rows([16.0, 4.0, 1.0]))  # gain 4: drifted by 2x... not beyond
    assert a.gain_drift == pytest.approx(2.0) and a.gain_drifts == 0
    a.observe_layers(rows([64.0, 8.0, 1.0]))  # gain 8: 4x the baseline, once: not yet
    assert a.gain_drift == pytest.approx(4.0) and a.gain_drifts == 0
    a.observe_layers(rows([64.0, 8.0, 1.0]))  # twice in a row: an episode
    a.observe_layers(rows([64.0, 8.0, 1.0]))  # same episode
    assert a.gain_drifts == 1
    a.observe_layers(rows([4.0, 2.0, 1.0]))  # one check back in range does not end it
    a.observe_layers(rows([64.0, 8.0, 1.0]))
    assert a.gain_drifts == 1
    a.observe_layers(rows([4.0, 2.0, 1.0]))
    a.observe_layers(rows([4.0, 2.0, 1.0]))  # two in range: ended
    a.observe_layers(rows([0.5, 2.0, 8.0]))  # vanishing towards the input: 0.25 = 1/8x
    a.observe_layers(rows([0.5, 2.0, 8.0]))
    assert a.gain_drifts == 2
    assert [e.kind for e in a.events] == ["grad_gain_drift", "grad_gain_drift"]


def test_gain_drift_ignores_noise_and_finds_a_step_change() -> None:
    """Default settings: log-normal noise (sd 0.3 in ln, one check in ~50 beyond 2x) is no
    drift; a 4x step change is an episode within 5 checks."""
    rng = random.Random(1)
    a = RankAnalytics(AnalyticsSettings())
    for _ in range(500):
        a.observe_layers(rows([math.exp(rng.gauss(0, 0.3)), 1.0]))
    assert a.gain_drifts == 0
    checks = 0
    while not a.gain_drifts and checks < 5:
        a.observe_layers(rows([4 * math.exp(rng.gauss(0, 0.3)), 1.0]))
        checks += 1
    assert a.gain_drifts == 1, checks
    assert a.events[-1].kind == "grad_gain_drift"


@pytest.mark.slow
def test_no_gain_drift_on_a_healthy_two_layer_model(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    """A 2-layer MLP learning the next byte of real text (stdlib source), watched every 10
    steps for 3,000 steps, through the client and the exporter: no drift episode. Judged one
    check at a time against a 5-check baseline it counted one."""
    ex = make_exporter()
    run = connect(ex, "healthy-mlp")
    torch.manual_seed(0)
    data = torch.tensor(list(inspect.getsource(collections).encode()), dtype=torch.long)
    model = torch.nn.Sequential(
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 256, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 256),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    run.watch(model, opt, every=10)
    for step in range(3000):
        idx = torch.randint(0, len(data) - 9, (32,))
        ctx = torch.stack([data[i : i + 8] for i in idx.tolist()])
        x = torch.nn.functional.one_hot(ctx, 256).float()
        loss = torch.nn.functional.cross_entropy(model(x), data[idx + 8])
        opt.zero_grad()
        loss.backward()
        opt.step()
        run.log(step, loss=loss.item())
    run.finish()
    wait_for(lambda: (r := ex.rank("healthy-mlp", 0)) and r["status"] == "finished")
    m = ex.metrics()
    lbl = {"run": "healthy-mlp", "rank": "0"}
    assert sample(m, "trainmon_train_grad_gain_mean", **lbl) is not None  # it was judged
    assert loss.item() < 3.0  # it learned (ln 256 = 5.5 at chance)
    assert sample(m, "trainmon_train_grad_gain_drifts_total", **lbl) == 0


def test_update_ratio_bounds() -> None:
    a = RankAnalytics(AnalyticsSettings(update_ratio_high=0.1, update_ratio_low=1e-7))
    a.observe_layers(rows([1.0, 1.0], ratio=0.5))
    a.observe_layers(rows([1.0, 1.0], ratio=1e-3))
    frozen = rows([1.0, 1.0, 1.0], ratio=1e-3)
    frozen[1][1][5] = 1e-9  # one layer frozen while the others learn
    a.observe_layers(frozen)
    assert (a.update_high, a.update_low) == (2, 1)


def test_a_learning_rate_near_zero_is_not_a_frozen_layer() -> None:
    """The end of a cosine schedule: every layer's update ratio under the floor at once."""
    a = RankAnalytics(AnalyticsSettings(update_ratio_low=1e-7))
    a.observe_layers(rows([1.0, 1.0, 1.0], ratio=1e-10))
    a.observe_layers(rows([1.0, 1.0, 1.0], ratio=0.0))
    assert a.update_low == 0
    assert [e.kind for e in a.events] == []


def test_layer_exposition_passes_promtool_and_is_documented(exporter: InProcessExporter) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from ..conftest import ROOT

    run = connect(exporter, "lint")
    train(run, 4)
    wait_for(lambda: (k := exporter.rank("lint", 0)) and k["status"] == "finished")
    text = exporter.metrics_text()
    doc = (ROOT / "docs" / "metrics.md").read_text()
    for fam in text_string_to_metric_families(text):
        if fam.name.startswith(("trainmon_layer_", "trainmon_train_grad_gain")):
            assert f"`{fam.name}" in doc, fam.name
    promtool_check_metrics(text)

"""Run.watch on a real torch model and optimizer: what it measures and what it sends."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from trainmon_client import _protocol as P  # noqa: E402

from ..helpers.client import Listener, layer_records, make_run, table, tiny, train_step  # noqa: E402


def test_watch_sends_per_layer_statistics_every_n_steps(listener: Listener) -> None:
    model, opt = tiny()
    run = make_run(listener.path, flush_interval=0.0)
    watcher = run.watch(model, opt, every=5, quantiles_every=0, budget=1.0)
    for i in range(20):
        train_step(model, opt)
        run.log(i, loss=1.0)
    listener.accept()
    run.finish()
    recs = layer_records(listener)
    assert [r[0][0][0] for r in recs] == [5, 10, 15, 20]  # optimizer steps of the checks
    t = table(recs[-1])
    assert list(t) == ["0", "2", "4"]  # the Linear layers, in module order
    for row in t.values():
        assert row[P.LAYER_STATS["grad_norm"]] > 0 and row[P.LAYER_STATS["weight_norm"]] > 0
        assert 0 < row[P.LAYER_STATS["update_ratio"]] < 1
    assert watcher.checks == 4 and run.internal_errors == 0


def test_update_ratio_and_grad_stats_are_exact(listener: Listener) -> None:
    model, opt = tiny()
    run = make_run(listener.path, flush_interval=0.0)
    run.watch(model, opt, every=1, quantiles_every=0, budget=1.0)
    x = torch.randn(32, 8)
    loss = (model(x) - 1.0).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    last = model[4]
    g = torch.cat([last.weight.grad.reshape(-1), last.bias.grad.reshape(-1)])
    w_before = torch.cat([last.weight.reshape(-1), last.bias.reshape(-1)]).detach().clone()
    opt.step()
    w_after = torch.cat([last.weight.reshape(-1), last.bias.reshape(-1)]).detach()
    run.log(0, loss=1.0)
    listener.accept()
    run.finish()
    row = table(layer_records(listener)[0])["4"]
    s = P.LAYER_STATS
    assert row[s["grad_norm"]] == pytest.approx(g.norm().item(), rel=1e-5)
    assert row[s["grad_mean"]] == pytest.approx(g.mean().item(), rel=1e-4, abs=1e-9)
    assert row[s["grad_std"]] == pytest.approx(g.std(unbiased=False).item(), rel=1e-4)
    expected = ((w_after - w_before).norm() / w_before.norm()).item()
    assert row[s["update_ratio"]] == pytest.approx(expected, rel=1e-5)
    # For SGD the update is exactly lr * g: the approximation agrees.
    assert expected == pytest.approx(0.1 * g.norm().item() / w_before.norm().item(), rel=1e-4)


def test_quantiles_and_activations(listener: Listener) -> None:
    model, opt = tiny()
    run = make_run(listener.path, flush_interval=0.0)
    run.watch(model, opt, every=2, quantiles_every=2, activations=True, budget=1.0)
    for i in range(2):
        train_step(model, opt)
        run.log(i, loss=1.0)
    listener.accept()
    run.finish()
    t = table(layer_records(listener)[0])
    row = t["2"]
    qs = [row[P.QUANTILE_CODE0 + i] for i in range(len(P.LAYER_QUANTILES))]
    assert qs == sorted(qs)
    g = model[2].weight.grad  # the gradient of the watched step (not zeroed since)
    assert qs[0] <= g.min().item() + 1e-6 and qs[-1] >= g.max().item() - 1e-6
    assert 0 <= row[P.LAYER_STATS["dead_ratio"]] <= 1
    assert math.isfinite(row[P.LAYER_STATS["activation_std"]])


def test_watch_backs_off_when_over_budget(listener: Listener) -> None:
    model, opt = tiny()
    run = make_run(listener.path, flush_interval=0.0)
    watcher = run.watch(model, opt, every=1, quantiles_every=1, budget=1e-9)
    for _ in range(8):
        train_step(model, opt)
    assert watcher.every > 1  # any cost is over a 1e-9 budget: it doubled
    run.finish()


def test_remove_and_pause_leave_training_alone(listener: Listener) -> None:
    model, opt = tiny()
    run = make_run(listener.path, flush_interval=0.0)
    watcher = run.watch(model, opt, every=1, budget=1.0)
    watcher.enabled = False
    train_step(model, opt)
    assert watcher.checks == 0
    watcher.remove()
    watcher.enabled = True
    train_step(model, opt)
    assert watcher.checks == 0
    run.finish()


def test_watch_argument_errors_raise(tmp_path: Path) -> None:
    model, opt = tiny()
    run = make_run(tmp_path / "none.sock")
    with pytest.raises(ValueError):
        run.watch(model, opt, every=0)
    with pytest.raises(ValueError):
        run.watch(model, opt, budget=0)


def test_layers_record_round_trip() -> None:
    rec = P.encode_layers(7, 1.5, 3, 0.25, [64, 65], [1, 5], [1.0, 2.0, 3.0, 4.0])
    [(rtype, payload)] = list(P.iter_records(P.packet_header() + rec))
    assert rtype == P.LAYERS
    assert P.decode_layers(payload) == ((7, 1.5, 3, 0.25), (1, 5), (64, 65), (1.0, 2.0, 3.0, 4.0))
    with pytest.raises(P.ProtocolError):
        P.decode_layers(payload[:-1])

"""Read-side figures and verdicts on hand-built rank states (no socket, no sleep)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from trainmon_client import _protocol as P
from trainmon_exporter import derive
from trainmon_exporter.peaks import Mfu
from trainmon_exporter.settings import AnalyticsSettings
from trainmon_exporter.state.rank import Operation, RankState

from ..helpers.exporter import make_state


def feed(s: RankState, steps: range, tokens: Any = None, step_time: float = 1.0) -> None:
    """One step a second from Unix time 100; ``tokens(i)`` is the cumulative total."""
    for i in steps:
        total = 10.0 * i if tokens is None else tokens(i)
        head = P.StepHeader(i, i + 1, 100.0 + i, step_time, total, 1.0 * i, 0.01 * i, 0, 0, 0)
        s.observe_step(P.Step(head, (), ()), {}, 30.0)


def test_rates_are_zero_when_steps_stop() -> None:
    s = make_state()
    feed(s, range(11))
    assert derive.rates(s, 110.5, 30.0) == pytest.approx((10.0, 1.0, 0.01, 0.01))
    assert derive.rates(s, 100.0 + 10 + 31, 30.0) == (0.0, 0.0, 0.0, 0.0)
    # The window slides: only the last 30 s count.
    feed(s, range(11, 100), tokens=lambda i: 10.0 * i + (i - 10) * 90)
    r = derive.rates(s, 199.0, 30.0)
    assert r is not None and r.tokens_per_second == pytest.approx(100.0)


@pytest.mark.parametrize(
    "stop",
    [
        lambda s: s.disconnect(finished=False),  # crashed
        lambda s: s.finish(P.FINISH_OK),  # finished, still connected
        lambda s: s.finish(P.FINISH_FAILED),  # failed
        lambda s: s.closed_by_exporter(idle=True),  # disconnected, not a crash
    ],
)
def test_a_rank_that_stopped_has_no_current_rate(stop: Any) -> None:
    s = make_state()
    feed(s, range(11))
    assert not derive.stopped(s)
    assert derive.rates(s, 110.5, 30.0) == pytest.approx((10.0, 1.0, 0.01, 0.01))
    stop(s)
    # Within the rate window of its last step: 0, not the speed it had.
    assert derive.stopped(s)
    assert derive.rates(s, 110.5, 30.0) == (0.0, 0.0, 0.0, 0.0)


def test_rates_need_a_span_and_count_tracked_operations_as_monitoring() -> None:
    s = make_state()
    assert derive.rates(s, 100.0, 30.0) is None
    feed(s, range(1))
    head = P.StepHeader(1, 2, 100.1, 0.1, 10.0, 1.0, 0.0, 0, 0, 0)  # 0.1 s later: too short
    s.observe_step(P.Step(head, (), ()), {}, 30.0)
    assert derive.rates(s, 100.1, 30.0) is None
    s = make_state()
    feed(s, range(2))
    s.ops["validation"] = Operation(0.5, 1)
    feed(s, range(2, 3))
    r = derive.rates(s, 102.0, 30.0)
    assert r is not None
    assert r.client_overhead_ratio == pytest.approx(0.01)
    assert r.monitoring_ratio == pytest.approx(0.01 + 0.5 / 2)


@dataclass(frozen=True)
class Gpu:
    name: str = "NVIDIA H100 80GB HBM3"
    pci_device_id: int = 0x2330
    index: int = 3


def test_mfu_joins_the_rank_to_its_gpu_by_uuid() -> None:
    s = make_state()
    s.gpu_uuid, s.flops_per_token = "GPU-a", 6e9
    gpus = {"GPU-a": Gpu(), "GPU-b": Gpu(index=4)}
    m, g = derive.mfu(s, 1e4, gpus, None)
    assert g is gpus["GPU-a"] and m.model_flops == 6e13 and m.peak is not None
    assert m.mfu == pytest.approx(6e13 / m.peak) and m.reason == ""
    m, g = derive.mfu(s, 1e4, gpus, 1e14)  # the peak_flops setting wins
    assert m.mfu == pytest.approx(0.6)
    s.gpu_uuid = "GPU-gone"
    m, g = derive.mfu(s, 1e4, gpus, None)
    assert g is None and m.mfu is None and m.reason == "gpu_not_sampled"
    s.flops_per_token = None
    assert derive.mfu(s, 1e4, gpus, None)[0].reason == "no_flops_per_token"


def test_the_process_is_found_by_the_kernels_pid_first() -> None:
    s = make_state()
    assert derive.process_pid(s) == s.pid == 1
    s.peer_pid = 4242
    assert derive.process_pid(s) == 4242


def test_overdue_ratio_while_connected() -> None:
    s = make_state()
    assert derive.overdue_ratio(s, 1000.0) is None  # no step, no median
    feed(s, range(30), step_time=2.0)
    assert s.last_step_mono is not None  # when the last step arrived (monotonic s)
    s.last_step_mono = 50.0
    assert derive.overdue_ratio(s, 50.0 + 3.0) == pytest.approx(1.5)
    assert derive.overdue_ratio(s, 40.0) == 0.0  # a clock behind the step's: not negative
    s.goodput.phase = "startup"  # a new process after a crash, not stepped yet: starting
    assert derive.overdue_ratio(s, 200.0) is None
    s.goodput.phase = "running"
    s.connected = False
    assert derive.overdue_ratio(s, 200.0) is None


def test_evaluation_verdicts_use_the_settings() -> None:
    s = make_state(eval_slow_improvement=0.05, eval_overfit_gap=0.3)
    a = s.analytics
    assert derive.slow_improvement(a) is None and derive.overfitting(a) is None
    a.ema = 1.0
    a.observe_eval(2.0)
    a.observe_eval(1.96)  # 2 % better: slow under 5 %
    assert derive.slow_improvement(a) is True
    assert derive.overfitting(a) is True  # (1.96 - 1) / 1 > 0.3
    a.ema = 1.8
    assert derive.overfitting(a) is False


def test_over_budget_uses_the_setting() -> None:
    cfg = AnalyticsSettings(monitoring_budget_ratio=0.05)
    assert not derive.over_budget(0.05, cfg) and derive.over_budget(0.051, cfg)


def test_findings_of_a_troubled_rank() -> None:
    s = make_state()
    assert derive.findings(s, Mfu()) == []
    s.nonfinite["loss"] = 2
    s.status = "crashed"
    s.analytics.hung = s.analytics.throughput_dropped = s.analytics.straggling = True
    s.dropped_backpressure, s.dropped_in_flight, s.unapplied_total = 3, 1, 2
    assert derive.findings(s, Mfu(mfu=1.2)) == [
        "non-finite values: loss x2, grad_norm x0",
        "disconnected without finishing (crashed or killed)",
        "hung: no step for longer than usual",
        "throughput dropped",
        "straggler",
        "MFU above 100 %: check flops per token, tokens per step and the peak",
        "client dropped 4 messages",
        "2 messages sent here were never applied",
    ]
    s.status = "failed"
    assert "finished with an uncaught exception" in derive.findings(s, Mfu(mfu=0.5))


def steps_with_loss(s: RankState, losses: list[float], start: int = 0, t0: float = 100.0) -> None:
    """One step a second from ``t0``, 10 tokens each, logging ``losses`` in turn."""
    for k, loss in enumerate(losses):
        i = start + k
        head = P.StepHeader(i, s.steps_total + 1, t0 + k, 1.0, s.tokens_total + 10.0, 0, 0, 0, 0, 0)
        s.observe_step(P.Step(head, (P.FIELD_LOSS,), (loss,)), {}, 30.0)


def test_a_trend_is_the_recent_steps_with_their_rate() -> None:
    s = make_state()
    assert derive.trend(s) == ([], [], [], [], [])
    steps_with_loss(s, [3.0, 2.0, 1.0])
    t = derive.trend(s)
    assert t.steps == [0, 1, 2] and t.loss == [3.0, 2.0, 1.0]
    assert t.tokens_per_second == [None, 10.0, 10.0]  # the first step has no interval
    assert t.marks == []


def test_a_long_history_is_grouped_into_points_and_bounded() -> None:
    from trainmon_exporter.state.rank import HISTORY_STEPS

    s = make_state()
    steps_with_loss(s, [float(i) for i in range(1000)])
    assert len(s.history) == HISTORY_STEPS == 240
    t = derive.trend(s)
    assert len(t.steps) == derive.TREND_POINTS == 60
    assert t.steps[0] == 763 and t.steps[-1] == 999  # 4 steps a point, the newest last
    assert t.loss[0] == pytest.approx(761.5) and t.loss[-1] == pytest.approx(997.5)
    assert t.tokens_per_second == pytest.approx([10.0] * 60)


def test_nan_spike_hang_and_rollback_are_marked_on_their_points() -> None:
    s = make_state()
    losses = [2.0 + 0.01 * (i % 3) for i in range(30)]
    losses[25] = 50.0  # a spike after 25 steps of history
    steps_with_loss(s, losses)
    steps_with_loss(s, [float("nan")], start=30, t0=130.0)
    s.analytics.check_hang(1000.0, busy=False)  # no step for a long time after step 30
    steps_with_loss(s, [2.0], start=31, t0=1200.0)  # it goes on
    steps_with_loss(s, [2.0, 2.0], start=20, t0=1201.0)  # a checkpoint reload: back to step 20
    t = derive.trend(s)
    assert [(t.steps[i], kind, step) for i, kind, step in t.marks] == [
        (25, "spike", 25),
        (30, "nonfinite", 30),
        (30, "hang", 30),
        (20, "restart", 20),
    ]
    assert t.loss[30] is None  # NaN only: no value, a mark
    assert t.tokens_per_second[32] is None  # no rate across a restart
    # The hour without a step shows as a slow point, not as the speed before it.
    assert t.tokens_per_second[31] == pytest.approx(10.0 / 1070.0)


def test_a_new_process_resuming_the_rank_is_a_restart_and_no_negative_rate() -> None:
    s = make_state()
    steps_with_loss(s, [3.0] * 5)
    head = P.StepHeader(5, 1, 106.0, 1.0, 10.0, 0, 0, 0, 0, 0)  # its own counts, from 1
    s.observe_step(P.Step(head, (P.FIELD_LOSS,), (2.9,)), {}, 30.0)
    t = derive.trend(s)
    assert t.marks == [(5, "restart", 5)]
    assert t.tokens_per_second[5] is None


def test_a_rank_that_logs_no_tokens_has_no_throughput_line() -> None:
    s = make_state()
    for i in range(5):
        s.observe_step(
            P.Step(P.StepHeader(i, i + 1, 100.0 + i, 1.0, 0, 0, 0, 0, 0, 0), (), ()), {}, 30.0
        )
    t = derive.trend(s)
    assert t.tokens_per_second == [None] * 5 and t.loss == [None] * 5


def test_the_goodput_of_a_trend_point_is_the_ratio_at_its_last_step() -> None:
    from trainmon_exporter.state.rank import HistoryPoint

    # (productive + uncheckpointed, accounted) seconds after each step; nothing yet at first.
    totals = [(0.0, 0.0), (1.0, 4.0), (3.0, 5.0), (3.0, 6.0), (9.0, 10.0), (9.0, 12.0)]
    h = [HistoryPoint(i, 100.0 + i, 2.0, 10.0 * i, False, g, a) for i, (g, a) in enumerate(totals)]
    t = derive.trend(derive.TrendInput(h, []))
    assert t.goodput == [None, 0.25, 0.6, 0.5, 0.9, 0.75]
    grouped = derive.trend(derive.TrendInput(h, []), points=3)  # two steps a point: the last
    assert grouped.steps == [1, 3, 5] and grouped.goodput == [0.25, 0.5, 0.75]
    assert derive.trend(make_state()).goodput == []


def test_a_trend_ends_at_the_goodput_the_rank_reports() -> None:
    from ..helpers import trends

    for s in trends.states():  # steps arriving on a reproducible clock, one rolled back
        t = derive.trend(s)
        ratio = s.goodput.optimistic_ratio()
        assert len(t.goodput) == len(t.steps) and ratio is not None
        assert t.goodput[-1] == pytest.approx(ratio)

"""Detectors on synthetic sequences, including the edge cases: constant loss, the first steps,
warm-up, restarts, non-finite values."""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from trainmon_client import _protocol as P
from trainmon_exporter import derive
from trainmon_exporter.analytics import AnalyticsSettings, RankAnalytics, RollingStats, RunAnalytics
from trainmon_exporter.analytics.goodput import Goodput
from trainmon_exporter.collectors import CollectorContext
from trainmon_exporter.collectors.health import HealthCollector
from trainmon_exporter.settings import Settings
from trainmon_exporter.state.store import Store

from ..helpers.exporter import HELLO, store_of


def feed(
    a: RankAnalytics,
    losses: list[float],
    grads: list[float] | None = None,
    step_time: float = 0.1,
    tokens: float = 1000.0,
    start: int = 0,
) -> None:
    for i, loss in enumerate(losses):
        g = grads[i] if grads is not None else 1.0
        a.observe_step(start + i, loss, g, step_time, tokens)


def noisy(n: int, mean: float = 2.0, sd: float = 0.05, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [rng.gauss(mean, sd) for _ in range(n)]


def test_ema_weights_the_history_not_the_new_value() -> None:
    a = RankAnalytics(AnalyticsSettings())
    feed(a, [2.0, 4.0])
    assert a.ema == pytest.approx(0.99 * 2.0 + 0.01 * 4.0)  # 2.02, not 3.98


def test_rolling_stats_match_a_direct_computation() -> None:
    r = RollingStats(50)
    xs = noisy(1000, mean=1e4, sd=3.0)
    for x in xs:
        r.add(x)
    tail = xs[-50:]
    m = sum(tail) / 50
    assert r.mean() == pytest.approx(m)
    assert r.std() == pytest.approx(math.sqrt(sum((x - m) ** 2 for x in tail) / 50), rel=1e-6)


def test_clean_noisy_run_has_no_spikes() -> None:
    a = RankAnalytics(AnalyticsSettings())
    feed(a, noisy(5000), noisy(5000, mean=1.0, sd=0.1, seed=1))
    assert sum(a.loss_spikes.values()) == 0
    assert sum(a.grad_spikes.values()) == 0
    assert a.explosions == 0 and a.vanishing == 0


def test_warm_up_descent_is_not_a_spike() -> None:
    a = RankAnalytics(AnalyticsSettings())
    warmup = [5.5 * math.exp(-i / 40) + 2.0 + n for i, n in enumerate(noisy(400, 0, 0.02))]
    feed(a, warmup)
    assert sum(a.loss_spikes.values()) == 0


def test_first_steps_are_not_judged() -> None:
    a = RankAnalytics(AnalyticsSettings(min_history_steps=20))
    feed(a, [1.0] * 19 + [100.0])
    assert math.isnan(a.loss_z) and sum(a.loss_spikes.values()) == 0
    feed(a, [100.0], start=20)  # 21st value: judged now (against a window containing 100)
    assert not math.isnan(a.loss_z)


@pytest.mark.parametrize(
    ("jump", "severity"),
    [(1.0 + 0.25, "minor"), (1.0 + 0.35, "major"), (1.0 + 0.6, "severe")],
)
def test_spike_severity_buckets(jump: float, severity: str) -> None:
    a = RankAnalytics(AnalyticsSettings())
    feed(a, noisy(200, mean=1.0, sd=0.05, seed=3))
    feed(a, [jump], start=200)
    assert a.loss_spikes == {s: int(s == severity) for s in ("minor", "major", "severe")}
    assert a.loss_ratio == pytest.approx(jump / a.loss_stats.values[-2], rel=0.05)


def test_ten_times_the_average() -> None:
    a = RankAnalytics(AnalyticsSettings())
    feed(a, noisy(100, mean=2.0, sd=0.01))
    feed(a, [20.0], start=100)
    assert a.loss_ratio == pytest.approx(10.0, rel=0.01)
    assert a.loss_spikes["severe"] == 1


def test_constant_loss_uses_the_relative_floor() -> None:
    a = RankAnalytics(AnalyticsSettings())
    feed(a, [2.0] * 100)
    feed(a, [2.0 + 1e-9], start=100)  # round-off: not a spike
    assert sum(a.loss_spikes.values()) == 0 and a.loss_z < 1e-3
    feed(a, [2.1], start=101)  # +5 %: z = 0.1 / (1e-3 * 2) = 50
    assert a.loss_spikes["severe"] == 1


def test_downward_moves_are_not_spikes() -> None:
    a = RankAnalytics(AnalyticsSettings())
    feed(a, noisy(100, mean=2.0, sd=0.01))
    feed(a, [0.5], start=100)
    assert sum(a.loss_spikes.values()) == 0 and a.loss_z < 0


def test_nonfinite_values_do_not_poison_the_statistics() -> None:
    a = RankAnalytics(AnalyticsSettings())
    feed(a, noisy(50))
    ema = a.ema
    a.observe_step(50, math.nan, math.nan, 0.1, 1000)
    a.observe_step(51, math.inf, 1.0, 0.1, 1000)
    assert a.ema == ema and math.isfinite(a.loss_stats.mean())


def test_gradient_explosion_absolute_relative_and_infinite() -> None:
    a = RankAnalytics(AnalyticsSettings(grad_explosion_norm=100.0, grad_explosion_ratio=10.0))
    feed(a, [1.0] * 5, grads=[150.0] * 5)  # above the absolute bound from the first step
    assert a.explosions == 5
    b = RankAnalytics(AnalyticsSettings())
    feed(b, [1.0] * 50, grads=noisy(50, mean=1.0, sd=0.1))
    feed(b, [1.0], grads=[11.0], start=50)  # 11x its mean, far below 100
    assert b.explosions == 1 and b.grad_spikes["severe"] == 1
    b.observe_step(51, 1.0, math.inf, 0.1, 1000)
    assert b.explosions == 2
    feed(b, [1.0], grads=[1e-10], start=52)
    assert b.vanishing == 1


def test_hang_needs_history_respects_busy_and_counts_episodes() -> None:
    a = RankAnalytics(AnalyticsSettings(hang_factor=2.0, hang_grace_seconds=1.0))
    assert a.check_hang(1e6, busy=False) is False  # no step-time history: not judged
    feed(a, [1.0] * 30, step_time=0.1)
    assert a.median_step_time() == pytest.approx(0.1)
    assert a.check_hang(1.19, busy=False) is False  # limit = 2 * 0.1 + 1 = 1.2 s
    assert a.check_hang(1.21, busy=False) is True
    assert a.check_hang(5.0, busy=False) is False and a.hung  # same episode: counted once
    assert a.hangs == 1
    assert a.check_hang(60.0, busy=True) is False and not a.hung  # in validation: not hung
    feed(a, [1.0], step_time=0.1, start=30)  # a step arrives: over
    assert a.check_hang(2.0, busy=False) is True and a.hangs == 2


def test_throughput_ratio() -> None:
    a = RankAnalytics(AnalyticsSettings())
    feed(a, [1.0] * 59, step_time=0.1)
    assert a.throughput_ratio() is None  # not enough baseline
    feed(a, [1.0] * 400, step_time=0.1, start=59)
    assert a.throughput_ratio() == pytest.approx(1.0)
    feed(a, [1.0] * 20, step_time=0.2, start=459)  # half the speed
    assert a.throughput_ratio() == pytest.approx(0.5)


def test_trend_slope_and_plateau() -> None:
    a = RankAnalytics(AnalyticsSettings(ema_decay=0.5, trend_window_steps=50))
    feed(a, [2.0 + 0.01 * i for i in range(60)])
    assert a.ema_slope() == pytest.approx(0.01, rel=0.05)
    assert a.plateau() is False
    b = RankAnalytics(AnalyticsSettings(trend_window_steps=50))
    feed(b, [3.0] * 49)
    assert b.plateau() is None  # window not full yet
    feed(b, [3.0], start=49)
    assert b.plateau() is True and b.ema_slope() == pytest.approx(0.0)


def test_evaluation_signals() -> None:
    a = RankAnalytics(AnalyticsSettings())
    feed(a, [2.0] * 10)
    a.observe_eval(3.0)
    assert a.eval_improvement() is None and a.eval_gap() == pytest.approx(0.5)  # 50 % gap
    a.observe_eval(2.97)  # 1 % better
    assert a.eval_improvement() == pytest.approx(0.01)
    a.observe_eval(2.969)
    assert a.eval_plateau() is True  # 3 evaluations within 1 % of each other
    a.observe_eval(2.5)
    assert a.eval_plateau() is False and a.eval_total == 4
    a.observe_eval(None)  # an evaluation without val_loss counts but changes nothing
    assert a.eval_total == 5 and a.eval_loss == 2.5


def test_state_survives_a_reconnect_under_the_same_run() -> None:
    store = Store(max_ranks=4, max_custom_metrics=4, buckets=(1.0,), window_s=30, ttl_s=60)
    hello: dict[str, Any] = {
        "run": "r",
        "rank": 0,
        "local_rank": 0,
        "world_size": 1,
        "hostname": "h",
        "pid": 1,
        "client_version": "t",
        "gpu_uuid": None,
        "started_at": 0.0,
        "flops_per_token": None,
        "dtype": "bf16",
    }
    s = store.attach(hello)
    assert not isinstance(s, str)
    feed(s.analytics, [2.0, 4.0])
    s.disconnect(finished=False)
    again = store.attach(hello | {"pid": 2})
    assert again is s and again.analytics.ema == pytest.approx(2.02) and again.pid == 2


def test_settings_validation() -> None:
    with pytest.raises(ValidationError):
        AnalyticsSettings(spike_z={"minor": 5.0, "major": 4.0, "severe": 10.0})
    with pytest.raises(ValidationError):
        AnalyticsSettings(spike_z={"low": 1.0})
    with pytest.raises(ValidationError):
        AnalyticsSettings(ema_decay=1.0)
    with pytest.raises(ValidationError):
        AnalyticsSettings(throughput_recent_steps=600)


def test_a_spike_does_not_mask_the_next_one() -> None:
    """Spikes stay out of the window: a big one must not hide a smaller one right after."""
    a = RankAnalytics(AnalyticsSettings())
    base = noisy(300, mean=2.0, sd=0.05, seed=4)
    feed(a, base[:100])
    feed(a, [8.0], start=100)  # a severe bad batch
    feed(a, base[100:150], start=101)
    feed(a, [2.4], start=151)  # +0.4 = 8 sigma: must still be judged against sd 0.05
    assert a.loss_spikes["severe"] == 1 and a.loss_spikes["major"] == 1
    assert a.loss_stats.std() < 0.1


def test_a_persistent_level_shift_becomes_the_new_normal() -> None:
    a = RankAnalytics(AnalyticsSettings(spike_persist_steps=10))
    feed(a, noisy(100, mean=2.0, sd=0.02, seed=5))
    feed(a, noisy(200, mean=3.0, sd=0.02, seed=6), start=100)
    spikes = sum(a.loss_spikes.values())
    assert 10 <= spikes < 30  # the shift is flagged at first, then accepted as a level
    assert a.loss_stats.mean() == pytest.approx(3.0, abs=0.05)


def test_grad_norm_spikes_are_judged_in_log_space() -> None:
    small = RankAnalytics(AnalyticsSettings())
    big = RankAnalytics(AnalyticsSettings())
    g = [x for x in noisy(100, mean=1.0, sd=0.1, seed=7)]
    feed(small, [1.0] * 100, grads=[x * 1e-3 for x in g])
    feed(big, [1.0] * 100, grads=[x * 1e3 for x in g])
    feed(small, [1.0], grads=[3e-3], start=100)
    feed(big, [1.0], grads=[3e3], start=100)
    assert small.grad_z == pytest.approx(big.grad_z)  # scale-free
    assert small.grad_spikes == big.grad_spikes and sum(small.grad_spikes.values()) == 1


def test_repeated_firings_coalesce_per_kind() -> None:
    a = RankAnalytics(AnalyticsSettings())
    for step in range(100, 200):  # NaN loss and grad norm interleaved every step
        a.last_step = step
        a.event("nonfinite_loss")
        a.event("nonfinite_grad_norm")
    kinds = [(e.kind, e.step, e.count, e.last_step) for e in a.events]
    assert kinds == [("nonfinite_loss", 100, 100, 199), ("nonfinite_grad_norm", 100, 100, 199)]
    a.last_step = 250  # a new episode later is a new event
    a.event("nonfinite_loss")
    assert [(e.kind, e.step) for e in a.events][-1] == ("nonfinite_loss", 250)


def mem_feed(a: RankAnalytics, values: list[float], start: int = 0) -> None:
    for i, v in enumerate(values):
        a.observe_step(start + i, 1.0, 1.0, 0.1, 100.0, mem_allocated=v)


def test_memory_leak_needs_steady_growth() -> None:
    cfg = AnalyticsSettings(leak_window_steps=100)
    flat = RankAnalytics(cfg)
    mem_feed(flat, [1e9 + x * 1e6 for x in noisy(300, mean=0, sd=1, seed=8)])
    assert flat.check_memory() is False and flat.leaks == 0
    jump = RankAnalytics(cfg)
    mem_feed(jump, [1e9] * 90 + [1.2e9] * 10)  # one allocation, then flat: not steady
    assert jump.check_memory() is False
    leak = RankAnalytics(cfg)
    mem_feed(leak, [1e9 + 1e6 * i for i in range(100)])  # +1 MB a step: +10 % per window
    assert leak.check_memory() is True and leak.leaks == 1
    assert leak.memory_growth == pytest.approx(1e6)
    mem_feed(leak, [1.1e9 + 1e6 * i for i in range(50)], start=100)
    assert leak.check_memory() is False and leak.leaks == 1  # same episode
    short = RankAnalytics(cfg)
    mem_feed(short, [1e9 + 1e6 * i for i in range(99)])
    assert short.check_memory() is False  # window not full yet


@dataclass
class Rank:
    """A rank as the periodic judgement sees it (RankState has the same members)."""

    run_key: str
    connected: bool = True
    last_step_mono: float | None = 100.0
    goodput: Goodput = field(default_factory=lambda: Goodput(0.0, phase="running"))
    analytics: RankAnalytics = field(default_factory=lambda: RankAnalytics(AnalyticsSettings()))
    running_operation: bool = False
    phase_end_mono: float | None = None
    status: str = "running"

    def busy(self) -> bool:
        return self.running_operation

    @property
    def quiet_since_mono(self) -> float | None:
        if self.last_step_mono is None or self.phase_end_mono is None:
            return self.last_step_mono
        return max(self.last_step_mono, self.phase_end_mono)


def with_step_times(rank: Rank, seconds: float, n: int = 30) -> Rank:
    rank.analytics.step_times.extend([seconds] * n)
    rank.analytics.intervals.extend([seconds] * n)
    return rank


def test_straggler_ratios_leave_the_rank_itself_out() -> None:
    ratios = RunAnalytics.straggler_ratios([0.1, 0.1, 0.2])
    assert ratios == pytest.approx([0.1 / 0.15, 0.1 / 0.15, 2.0])
    assert RunAnalytics.straggler_ratios([0.1, 0.3]) == pytest.approx([1 / 3, 3.0])
    assert RunAnalytics.straggler_ratios([0.1]) == [None]  # alone in its run
    assert RunAnalytics.straggler_ratios([0.1, 0.0]) == [None, 0.0]


def test_stragglers_are_judged_within_each_run_and_counted_once_per_episode() -> None:
    ranks = [with_step_times(Rank("a"), t) for t in (0.1, 0.1, 0.2)]
    ranks.append(with_step_times(Rank("b"), 0.5))  # alone: no ratio
    judge = RunAnalytics()
    started = judge.check(ranks, 100.5)
    assert [(ranks.index(r), kind) for r, kind in started] == [(2, "straggler")]
    assert judge.check(ranks, 101.0) == []  # the same episode
    assert [r.analytics.straggler for r in ranks] == pytest.approx([2 / 3, 2 / 3, 2.0, None])
    assert [r.analytics.straggler_episodes for r in ranks] == [0, 0, 1, 0]
    assert [e.kind for e in ranks[2].analytics.events] == ["straggler"]


def test_two_namespaces_runs_of_one_id_are_judged_apart() -> None:
    """team-a's r1 and team-b's r1 on one exporter: neither's ranks are the other's peers."""
    ranks = [with_step_times(Rank("team-a/r1"), t) for t in (0.1, 0.1)]
    ranks.append(with_step_times(Rank("team-b/r1"), 0.5))  # slow, but alone in its run
    assert RunAnalytics().check(ranks, 100.5) == []
    assert [r.analytics.straggler for r in ranks] == pytest.approx([1.0, 1.0, None])


def test_hangs_are_judged_on_every_tick_the_rest_on_rate_ticks() -> None:
    rank = with_step_times(Rank("a"), 0.1)
    other = with_step_times(Rank("a"), 0.3)
    judge = RunAnalytics()
    limit = 2.0 * 0.1 + 30.0  # hang_factor x median + grace
    assert judge.check([rank, other], 100.0 + limit + 1, rates=False) == [
        (rank, "hang"),
        (other, "hang"),
    ]
    assert rank.analytics.hung and rank.analytics.straggler is None  # not a rate tick
    rank.running_operation = True
    assert judge.check([rank], 100.0 + limit + 2, rates=False) == []
    assert not rank.analytics.hung  # in validation: not hung


def test_the_hang_clock_starts_again_when_a_tracked_operation_ends() -> None:
    """Out of a long checkpoint save, a rank has its usual time to step again: no episode."""
    rank = with_step_times(Rank("a"), 0.1)
    judge = RunAnalytics()
    limit = 2.0 * 0.1 + 30.0
    rank.running_operation = True  # a save of ten minutes
    assert judge.check([rank], 100.0 + 600, rates=False) == []
    rank.running_operation, rank.phase_end_mono = False, 100.0 + 600  # it ends
    assert judge.check([rank], 100.0 + 600.05, rates=False) == []
    assert not rank.analytics.hung and rank.analytics.hangs == 0
    assert judge.check([rank], 100.0 + 600 + limit + 1, rates=False) == [(rank, "hang")]


def test_a_rank_that_is_not_running_is_neither_hung_nor_compared() -> None:
    a, b = with_step_times(Rank("a"), 0.1), with_step_times(Rank("a"), 0.3)
    judge = RunAnalytics()
    judge.check([a, b], 1000.0)
    assert a.analytics.hung and b.analytics.straggler == pytest.approx(3.0)
    b.connected = False
    a.last_step_mono = None  # no step yet (a fresh rank)
    assert judge.check([a, b], 1000.0) == []
    assert not a.analytics.hung and b.analytics.straggler is None
    assert b.analytics.straggler_episodes == 1  # what happened stays counted


def test_the_store_judges_its_ranks_under_its_lock() -> None:
    store = Store(max_ranks=4, max_custom_metrics=4, buckets=(1.0,), window_s=30, ttl_s=60)
    assert store.check_conditions(0.0) == []
    assert isinstance(store.judge, RunAnalytics)


def test_the_verdicts_follow_the_settings_and_are_exported_from_zero() -> None:
    """trainmon_train_straggling and trainmon_train_throughput_dropped are the judgements the
    alerts read: 0 from a rank's first message, 1 while the detector says so."""
    settings = Settings(analytics=AnalyticsSettings(straggler_ratio=2.5))
    store = store_of(analytics=settings.analytics)
    ranks = []
    for rank, seconds in enumerate((0.1, 0.1, 0.2)):
        s = store.attach(HELLO | {"rank": rank, "local_rank": rank, "world_size": 3}, uid=1)
        assert not isinstance(s, str)
        s.last_step_mono, s.goodput.phase = 100.0, "running"  # its process has stepped
        s.analytics.step_times.extend([seconds] * 30)
        ranks.append(s)
    registry = CollectorRegistry()
    registry.register(HealthCollector(CollectorContext(settings, store)))  # type: ignore[arg-type]

    def verdicts(name: str) -> list[float | None]:
        return [registry.get_sample_value(name, {"run": "raw", "rank": str(i)}) for i in range(3)]

    assert verdicts("trainmon_train_straggling") == [0.0, 0.0, 0.0]
    assert verdicts("trainmon_train_throughput_dropped") == [0.0, 0.0, 0.0]
    store.check_conditions(100.5)
    assert ranks[2].analytics.straggler == pytest.approx(2.0)
    assert verdicts("trainmon_train_straggling") == [0.0, 0.0, 0.0]  # 2.0 is not above 2.5
    ranks[2].analytics.step_times.extend([0.3] * 30)
    store.check_conditions(100.5)
    assert verdicts("trainmon_train_straggling") == [0.0, 0.0, 1.0]
    ranks[2].connected = False  # no longer compared: no longer straggling
    store.check_conditions(100.5)
    assert verdicts("trainmon_train_straggling") == [0.0, 0.0, 0.0]
    a = ranks[0].analytics
    a.rates.extend([100.0] * 50 + [10.0] * 15)  # the recent median rate: a tenth of the usual
    store.check_conditions(100.5)
    assert a.throughput_ratio() is not None and a.throughput_dropped
    assert verdicts("trainmon_train_throughput_dropped") == [1.0, 0.0, 0.0]


class SteppingClock:
    """``time.time`` and ``time.monotonic`` for a node whose wall clock NTP steps forward."""

    def __init__(self) -> None:
        self.wall, self.mono = 1.7e9, 5_000.0

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


def test_a_wall_clock_stepped_forward_is_no_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps every 0.1 s while the wall clock jumps 3 hours ahead mid-run: the hang check and
    the overdue ratio, judged every 0.1 s as the exporter does, see no gap. Then the steps
    stop: the same check finds the hang (the test can fail)."""
    clock = SteppingClock()
    monkeypatch.setattr(time, "time", lambda: clock.wall)
    monkeypatch.setattr(time, "monotonic", lambda: clock.mono)
    store = store_of()
    s = store.attach(HELLO, uid=1)
    assert not isinstance(s, str)
    limit = 2.0 * 0.1 + 30.0  # hang_factor x median + hang_grace_seconds
    episodes, overdue = [], []
    for i in range(200):  # 20 s of steps, the wall clock stepped at 5 s
        head = P.StepHeader(i, i + 1, clock.wall, 0.1, 10.0 * i, 1.0 * i, 0.0, 0, 0, 0)
        s.observe_step(P.Step(head, (), ()), {}, 30.0)
        if i == 50:  # between a step and the next check, as a step of the clock would fall
            clock.wall += 3 * 3600.0
        clock.advance(0.1)
        episodes += store.check_conditions()
        overdue.append(derive.overdue_ratio(s, time.monotonic()))
    assert episodes == [] and not s.analytics.hung and s.analytics.hangs == 0
    assert max(r for r in overdue if r is not None) < 2
    for _ in range(int(limit / 0.1) + 2):  # the trainer stops: a real hang
        clock.advance(0.1)
        episodes += store.check_conditions()
    assert episodes == [(s, "hang")] and s.analytics.hangs == 1


def test_a_crash_and_restart_is_no_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank steps every 0.1 s, its process dies, and a new one connects and spends far
    longer than the hang limit loading its checkpoint before its first step: no hang is
    counted, logged or marked, and no step is overdue; goodput calls that time recovery and
    start-up. Once the new process steps and then stops, the same check finds the hang (the
    test can fail)."""
    clock = SteppingClock()
    monkeypatch.setattr(time, "time", lambda: clock.wall)
    monkeypatch.setattr(time, "monotonic", lambda: clock.mono)
    store = store_of()
    s = store.attach(HELLO | {"started_at": clock.wall}, uid=1)
    assert not isinstance(s, str)
    limit = 2.0 * 0.1 + 30.0  # hang_factor x median + hang_grace_seconds
    episodes: list[tuple[Any, str]] = []

    def steps(first: int, n: int) -> None:  # by one process, from its first step
        for k, i in enumerate(range(first, first + n)):
            head = P.StepHeader(i, k + 1, clock.wall, 0.1, 10.0 * k, 1.0 * k, 0.0, 0, 0, 0)
            s.observe_step(P.Step(head, (), ()), {}, 30.0)
            clock.advance(0.1)
            episodes.extend(store.check_conditions())

    def wait(seconds: float) -> None:
        for _ in range(int(seconds / 0.1)):
            clock.advance(0.1)
            episodes.extend(store.check_conditions())

    steps(0, 100)
    s.disconnect(finished=False)  # killed: a crash
    wait(5.0)  # down
    again = store.attach(HELLO | {"pid": 2, "started_at": clock.wall}, uid=1)
    assert again is s and s.connected
    wait(3 * limit)  # the new process loads its checkpoint
    assert derive.overdue_ratio(s, time.monotonic()) is None
    assert episodes == [] and not s.analytics.hung and s.analytics.hangs == 0
    assert [e.kind for e in s.analytics.events] == ["crash"]
    assert s.goodput.badput["hang"] == 0.0
    steps(50, 30)  # resumed from a checkpoint of step 50
    assert s.goodput.badput["recovery"] == pytest.approx(5.0, abs=0.2)
    assert s.goodput.badput["startup"] >= 3 * limit - 0.2
    assert episodes == [] and "hang" not in sparkline_marks(s)
    wait(limit + 0.5)  # the new process stops stepping: a real hang
    assert episodes == [(s, "hang")] and s.analytics.hangs == 1
    assert "hang" in sparkline_marks(s)


def sparkline_marks(s: Any) -> set[str]:
    """The kinds of mark the views draw over the rank's recent steps (``hang``: the H)."""
    return {kind for _, kind, _ in derive.trend(s).marks}

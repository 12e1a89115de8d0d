"""The time accounting of a rank (``analytics/goodput.py``) on explicit monotonic times.

Every scenario checks the identity the metrics promise: productive + every badput kind +
uncheckpointed time is the wall-clock from ``init()`` to the last accounted instant, and no
counter ever goes down.
"""

from __future__ import annotations

import math

import pytest

from trainmon_exporter.analytics.goodput import KINDS, MAX_UNCHECKPOINTED_RANGES, Goodput

INIT = 100.0


class Ledger:
    """A :class:`Goodput` whose every counter is checked never to go down."""

    def __init__(self) -> None:
        self.g = Goodput.start(INIT, INIT, 0.0)
        self.seen = self.counters()

    def counters(self) -> dict[str, float]:
        return {"productive": self.g.productive, **self.g.badput}

    def steps(self, last: int) -> float:
        """Steps 1 to ``last`` of a fresh rank, one a second from INIT; returns the time."""
        t = INIT
        for n in range(1, last + 1):
            t += 1.0
            self.g.step(n, t, t, None)
        return t

    def check(self, until: float) -> None:
        now = self.counters()
        for k, v in now.items():
            assert v >= self.seen[k] - 1e-9, f"{k} went down: {self.seen[k]} -> {v}"
        self.seen = now
        assert self.g.accounted() == pytest.approx(until - INIT, abs=1e-9)
        good, accounted = self.g.totals()  # the O(1) form the history records
        assert accounted == pytest.approx(self.g.accounted(), abs=1e-9)
        assert good == pytest.approx(self.g.productive + self.g.uncheckpointed, abs=1e-9)


def test_startup_data_checkpoint_and_step_time_are_separate_buckets() -> None:
    led = Ledger()
    g = led.g
    t = INIT
    # start-up: 5 s to the first step, of which 1 s was a checkpoint restore
    g.checkpoint(0, INIT + 3.0, 1.0, INIT + 3.0, restore=True)
    t += 5.0
    g.step(1, t, t, data_time=0.2)
    led.check(t)
    assert g.badput["startup"] == pytest.approx(3.8)
    assert g.badput["checkpoint_restore"] == pytest.approx(1.0)
    assert g.badput["data_loading"] == pytest.approx(0.2)
    for n in range(2, 11):
        t += 1.0
        g.step(n, t, t, data_time=0.25)
        led.check(t)
    assert g.uncheckpointed == pytest.approx(9 * 0.75)
    assert g.productive == 0.0
    # a 2 s save after step 10, inside step 11's interval
    g.checkpoint(10, t + 2.0, 2.0, t + 2.0, restore=False)
    assert g.productive == pytest.approx(9 * 0.75)
    t += 3.0
    g.step(11, t, t, data_time=0.25)
    led.check(t)
    assert g.badput["checkpoint_save"] == pytest.approx(2.0)
    assert g.uncheckpointed == pytest.approx(0.75)
    g.finish(t + 0.5, ok=True)
    led.check(t + 0.5)
    assert g.uncheckpointed == 0.0
    assert g.productive == pytest.approx(10 * 0.75)
    assert g.badput["other"] == pytest.approx(0.5)
    assert g.badput["data_loading"] == pytest.approx(0.2 + 10 * 0.25)


def test_a_crash_wastes_the_steps_after_the_checkpoint_the_restart_resumes_from() -> None:
    led = Ledger()
    g = led.g
    t = INIT + 2.0
    g.step(1, t, t, None)
    for n in range(2, 21):
        t += 1.0
        g.step(n, t, t, None)
        if n == 10:
            g.checkpoint(10, t, math.nan, t, restore=False)
    led.check(t)
    assert g.productive == pytest.approx(9.0)  # steps 2..10
    assert g.uncheckpointed == pytest.approx(10.0)  # steps 11..20
    crash = t + 0.4
    g.crash(crash)
    led.check(crash)
    assert g.badput["wasted_progress"] == pytest.approx(0.4)  # the step in progress
    # the scheduler restarts the process 6 s later; it takes 3 s to its first step
    g.reconnect(crash + 6.0, crash + 6.5, 0.0, same_process=False)
    led.check(crash + 6.0)
    assert g.badput["recovery"] == pytest.approx(6.0)
    g.checkpoint(10, crash + 8.0, 1.5, crash + 8.0, restore=True)
    assert g.badput["wasted_progress"] == pytest.approx(10.4)
    assert g.uncheckpointed == 0.0
    t = crash + 9.0
    g.step(11, t, t, None, restarted=True)
    led.check(t)
    assert g.badput["checkpoint_restore"] == pytest.approx(1.5)
    assert g.badput["startup"] == pytest.approx(2.0 + 1.5)


def test_a_restart_without_a_restore_record_resumes_at_its_first_step() -> None:
    led = Ledger()
    g = led.g
    t = led.steps(10)
    g.crash(t)
    g.reconnect(t + 1.0, t + 1.0, 0.0, same_process=False)
    t += 2.0
    g.step(6, t, t, None, restarted=True)  # steps 6..10 are done again
    led.check(t)
    assert g.badput["wasted_progress"] == pytest.approx(5.0)
    assert g.productive == pytest.approx(4.0)  # steps 2..5 (step 1 was start-up)


def test_a_rollback_in_the_same_process_wastes_the_steps_it_undoes() -> None:
    led = Ledger()
    g = led.g
    t = led.steps(30)
    t += 1.0
    g.step(21, t, t, None, rolled_back=True)
    led.check(t)
    assert g.badput["wasted_progress"] == pytest.approx(10.0)  # steps 21..30
    assert g.productive == pytest.approx(19.0)  # steps 2..20
    assert g.uncheckpointed == pytest.approx(1.0)


def test_evaluation_hang_and_late_spans_never_count_twice() -> None:
    led = Ledger()
    g = led.g
    t = INIT + 1.0
    g.step(1, t, t, None)
    # a tracked validation of 4 s and the eval() at its end: one 4 s evaluation
    g.operation("validation", 4.0, t + 4.0)
    g.evaluation(t + 4.0, t + 4.0)
    t += 5.0
    g.step(2, t, t, 0.5)
    led.check(t)
    assert g.badput["evaluation"] == pytest.approx(4.0)
    assert g.badput["data_loading"] == pytest.approx(0.5)
    assert g.uncheckpointed == pytest.approx(0.5)
    # a hang judged 3 s after step 2 (usual step time 1 s), accounted on the detector clock
    # from where the step should have ended until step 3
    g.hung(t + 3.0, 1.0)
    led.check(t + 3.0)
    for k in range(4, 11):
        g.hung(t + k, 1.0)
        led.check(t + k)
    assert g.badput["hang"] == pytest.approx(9.0)
    assert g.uncheckpointed == pytest.approx(0.5 + 1.0)  # step 2, and step 3's first second
    t += 11.0
    g.step(3, t, t, None)
    led.check(t)
    assert g.badput["hang"] == pytest.approx(9.0)
    # a checkpoint span reported after the interval it was in: taken from step time
    g.checkpoint(3, t - 1.0, 1.0, t, restore=False)
    led.check(t)
    assert g.badput["checkpoint_save"] == pytest.approx(1.0)


def test_uncheckpointed_ranges_are_bounded_and_split_in_proportion() -> None:
    led = Ledger()
    g = led.g
    n_steps = 4 * MAX_UNCHECKPOINTED_RANGES
    t = led.steps(n_steps)
    assert len(g.ranges) <= MAX_UNCHECKPOINTED_RANGES
    g.checkpoint(n_steps // 2, t, math.nan, t, restore=False)
    assert g.productive == pytest.approx(n_steps // 2 - 1, rel=0.02)
    assert g.accounted() == pytest.approx(t - INIT)


def test_a_hostile_clock_cannot_move_time_backward_or_past_now() -> None:
    g = Goodput.start(-1e18, INIT, 0.0)  # an init() time from long before the HELLO
    assert g.init >= INIT - 86_400.0
    g = Goodput.start(INIT, INIT, 0.0)
    g.step(1, math.inf, INIT + 1.0, math.nan)
    g.step(2, -5.0, INIT + 2.0, -3.0)
    g.checkpoint(2, 1e300, 1e300, INIT + 3.0, restore=False)
    assert g.accounted() == pytest.approx(1.0)
    assert all(v >= 0 for v in g.badput.values())
    assert set(g.badput) == set(KINDS)


def test_a_process_first_seen_after_its_steps_began_is_accounted_from_that_step() -> None:
    # The exporter restarted (or started after the trainer): the trainer's init() was an hour
    # ago and its first steps went nowhere. That hour is not start-up; the clock starts here.
    g = Goodput.start(INIT - 3600.0, INIT, 0.0)
    g.step(500, INIT + 1.0, INIT + 1.0, 0.1, unseen_before=True)
    assert g.accounted() == 0.0 and g.badput["startup"] == 0.0
    g.step(501, INIT + 2.0, INIT + 2.0, 0.25)
    assert g.accounted() == pytest.approx(1.0)
    assert g.badput["data_loading"] == pytest.approx(0.25)


def test_data_waits_are_kept_for_the_window_read_not_for_4096_steps() -> None:
    """A rank at 10 steps/s for 10 minutes, its data share read every 15 s over 30 s (as
    scrapes read it): the points kept cover the window, where 4,096 of them were (37 MiB for
    the soak's 64 ranks, reached after 7 minutes: the RSS growth it measured), and every share
    read is the one the whole history gives."""
    g = Goodput.start(INIT, INIT, 0.0)
    kept_all: list[tuple[float, float, float]] = []
    t = INIT
    for n in range(1, 6001):
        t += 0.1
        g.step(n, t, t, 0.02 * (1 + n % 3))
        if g.data_window and (not kept_all or g.data_window[-1] is not kept_all[-1]):
            kept_all.append(g.data_window[-1])  # the whole history, as it was made
        if n % 150 == 0:
            share = g.data_share(t, 30.0)
            inside = [p for p in kept_all if p[0] >= t - 30.0]
            want = (inside[-1][1] - inside[0][1]) / (inside[-1][2] - inside[0][2])
            assert share == pytest.approx(want, rel=1e-12)
    assert len(g.data_window) <= 30.0 / 0.1 + 2
    assert g.data_share(t, 60.0) is not None  # a longer window asked later: from now on

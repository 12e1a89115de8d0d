"""The time accounting of a rank (``analytics/goodput.py``) on explicit monotonic times.

Every scenario checks the identity the metrics promise: productive + every badput kind +
uncheckpointed time is the wall-clock from ``init()`` to the last accounted instant, and no
counter ever goes down.
"""

from __future__ import annotations

import math

import pytest

from trainmon_exporter.analytics.goodput import KINDS, MAX_UNCHECKPOINTED_RANGES, Goodput
from trainmon_exporter.state.records import goodput_from_record, goodput_record

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


def test_time_a_crash_holds_is_at_risk_until_a_resume_here_or_the_record_leaves() -> None:
    led = Ledger()
    g = led.g
    t = led.steps(20)  # held: steps 2..20 (step 1's interval is start-up)
    g.checkpoint(10, t, math.nan, t, restore=False)
    g.crash(t + 0.5)
    led.check(t + 0.5)
    # Steps 11..20 are at risk: not good (optimistic ratio), counted wasted by lost().
    assert g.uncheckpointed == 0.0 and g.at_risk == pytest.approx(10.0)
    assert g.optimistic_ratio() == pytest.approx(9.0 / (t + 0.5 - INIT))
    assert g.lost()["wasted_progress"] == pytest.approx(10.5)
    assert g.totals()[0] == pytest.approx(9.0)
    # A restart here that resumes from step 15 (a checkpoint this rank did not report) keeps
    # steps 11..15.
    g.reconnect(t + 3.0, t + 3.0, 0.0, same_process=False)
    g.checkpoint(15, t + 4.0, 1.0, t + 4.0, restore=True)
    led.check(t + 3.0)
    assert g.at_risk == 0.0 and g.productive == pytest.approx(9.0 + 5.0)
    assert g.badput["wasted_progress"] == pytest.approx(0.5 + 5.0)
    assert g.badput["recovery"] == pytest.approx(2.5)


def test_settling_a_crashed_record_wastes_what_is_at_risk() -> None:
    led = Ledger()
    g = led.g
    t = led.steps(10)
    g.crash(t)
    g.settle()
    led.check(t)
    assert g.at_risk == 0.0 and g.badput["wasted_progress"] == pytest.approx(9.0)
    # Adopted later by a restarted process: recovery from the crash to its init().
    g.reconnect(t + 100.0, t + 100.0, 0.0, same_process=False)
    led.check(t + 100.0)
    assert g.badput["recovery"] == pytest.approx(100.0)


def test_a_connection_the_exporter_closed_is_placed_by_what_the_process_reports_next() -> None:
    led = Ledger()
    g = led.g
    t = led.steps(10)
    g.closed(t + 0.2)  # the exporter restarts: nothing is placed yet
    led.check(t)
    assert g.phase == "detached" and g.uncheckpointed == pytest.approx(9.0)
    g.reconnect(INIT, t + 5.0, 0.0, same_process=True)
    g.step(15, t + 5.0, t + 5.0, 0.5)  # steps 11..15 ran meanwhile
    led.check(t + 5.0)
    assert g.badput["other"] == 0.0 and g.badput["recovery"] == 0.0
    assert g.uncheckpointed == pytest.approx(9.0 + 4.5)
    # Detached again, and a new process comes instead: the old one went away unseen.
    g.closed(t + 6.0)
    g.reconnect(t + 8.0, t + 8.0, 0.0, same_process=False)
    led.check(t + 8.0)
    assert g.badput["recovery"] == pytest.approx(3.0)
    assert g.at_risk == pytest.approx(13.5)


def test_a_rank_that_logs_every_tenth_step_counts_only_start_up_as_start_up() -> None:
    led = Ledger()
    g = led.g
    # 2 s of start-up, then 10 steps of 1 s each before the first log at step 10
    t = INIT + 12.0
    g.step(10, t, t, None)
    for n in (20, 30):
        t += 10.0
        g.step(n, t, t, None)
        led.check(t)
    assert g.badput["startup"] == pytest.approx(3.0)  # 2 s, and step 1's compute
    assert g.uncheckpointed == pytest.approx(29.0)  # steps 2..30


def test_a_checkpoint_between_two_logged_steps_keeps_the_steps_it_saved() -> None:
    led = Ledger()
    g = led.g
    t = INIT + 1.0
    g.step(0, t, t, None)
    for n in (10, 20, 30):
        t += 10.0
        g.step(n, t, t, None)
    g.checkpoint(25, t, math.nan, t, restore=False)  # saves every 25, logs every 10
    g.crash(t + 1.0)
    g.reconnect(t + 2.0, t + 2.0, 0.0, same_process=False)
    g.checkpoint(25, t + 3.0, math.nan, t + 3.0, restore=True)
    led.check(t + 2.0)
    assert g.productive == pytest.approx(25.0)  # steps 1..25
    assert g.badput["wasted_progress"] == pytest.approx(5.0 + 1.0)  # 26..30, in progress


def test_an_evaluation_before_the_first_step_leaves_start_up_alone() -> None:
    led = Ledger()
    g = led.g
    g.evaluation(INIT + 5.0, INIT + 5.0)  # an eval() with no step before it
    g.operation("validation", 2.0, INIT + 5.0)  # tracked: 2 s of it
    t = INIT + 6.0
    g.step(1, t, t, None)
    g.step(2, t + 1.0, t + 1.0, None)
    led.check(t + 1.0)
    assert g.badput["evaluation"] == pytest.approx(2.0)
    assert g.badput["startup"] == pytest.approx(4.0)


def test_a_record_round_trips_through_the_state_file_and_bad_ones_are_refused() -> None:
    led = Ledger()
    g = led.g
    t = led.steps(12)
    g.checkpoint(10, t, 0.5, t, restore=False)
    g.operation("validation", 0.5, t)  # taken back from step 12's time, as the save
    g.crash(t + 0.5)
    assert g.at_risk == pytest.approx(1.0)
    rec = goodput_record(g, offset=1000.0)
    back = goodput_from_record(rec, offset=1000.0, now=t + 60.0)
    assert back.accounted() == pytest.approx(g.accounted())
    assert back.at_risk == pytest.approx(g.at_risk) and back.risk
    assert back.badput == pytest.approx(g.badput)
    assert back.cursor - back.init == pytest.approx(g.cursor - g.init)
    # The same process resumes: nothing is counted twice or lost.
    back.reconnect(INIT + 1000.0, t + 60.0, 1000.0, same_process=True)
    assert back.uncheckpointed == pytest.approx(g.at_risk)
    for bad in (
        {**rec, "v": 2},
        {**rec, "phase": "flying"},
        {**rec, "productive": -1.0},
        {**rec, "badput": {"startup": 1.0}},
        {**rec, "ranges": [[5, 3, 1.0]]},
        {**rec, "ranges": [[1, 2, math.inf]]},
        {**rec, "spans": [["hang", None, "x"]]},
        {**rec, "last_step": -3},
        {**rec, "init": True},
    ):
        with pytest.raises(ValueError):
            goodput_from_record(bad, offset=0.0, now=t)


def test_a_rank_that_never_reports_data_time_says_so() -> None:
    g = Goodput.start(INIT, INIT, 0.0)
    g.step(1, INIT + 1.0, INIT + 1.0, None)
    assert not g.data_seen
    g.step(2, INIT + 2.0, INIT + 2.0, 0.0)
    assert g.data_seen


def test_running_totals_make_up_for_the_records_an_exporter_never_got() -> None:
    """Steps 6..9 and the save of step 8 were sent while this exporter was down: step 10's
    running totals bring their data waits and the save, and keep the steps it saved."""
    led = Ledger()
    g = led.g
    t = INIT
    for n in range(1, 6):
        t += 1.0
        g.step(n, t, t, 0.2, data_total=0.2 * n)
    t += 5.0
    g.step(10, t, t, 0.2, data_total=2.0, saved=(8.0, 0.6), lost=True)
    led.check(t)
    assert g.badput["data_loading"] == pytest.approx(2.0)
    assert g.badput["checkpoint_save"] == pytest.approx(0.6)
    assert g.productive == pytest.approx(4 * 0.8 + (5.0 - 0.6 - 1.0) * 3 / 5)  # 2..5, 6..8
    # Without a loss the totals change nothing: records already counted are not counted twice.
    g.checkpoint(12, t + 1.5, 0.5, t + 1.5, restore=False)
    g.step(12, t + 2.0, t + 2.0, 0.1, data_total=2.1, saved=(12.0, 1.1))
    led.check(t + 2.0)
    assert g.badput["checkpoint_save"] == pytest.approx(1.1)
    assert g.badput["data_loading"] == pytest.approx(2.1)


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

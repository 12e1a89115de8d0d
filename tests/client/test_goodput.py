"""What the client sends for the time accounting: ``Run.timed()``'s waits as ``data_time``,
``data_time`` logged directly, and checkpoint restores (docs/goodput.md)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import pytest

from trainmon_client import _protocol as P

from ..helpers.client import Listener, make_run, steps_of


def slow_items(waits: list[float]) -> Iterator[int]:
    """Items that each take ``waits[i]`` seconds to arrive (a data loader)."""
    for i, w in enumerate(waits):
        time.sleep(w)
        yield i


def data_times(listener: Listener) -> list[float | None]:
    """Each STEP's ``data_time`` field (None when it has none)."""
    out: list[float | None] = []
    for rec in steps_of(listener.records()):
        fields = dict(zip(rec.ids, rec.values, strict=True))
        out.append(fields.get(P.FIELD_DATA_TIME))
    return out


def test_timed_sends_each_items_wait_with_the_next_step(listener: Listener) -> None:
    run = make_run(listener.path, flush_interval=0.05)
    waits = [0.05, 0.0, 0.12, 0.02]
    for step, item in enumerate(run.timed(slow_items(waits))):
        time.sleep(0.03)  # the step's compute is not a wait
        run.log(step, loss=1.0 / (item + 1))
    run.log(len(waits), loss=0.1)  # no item waited for before it
    run.finish()
    listener.accept()
    got = data_times(listener)
    assert len(got) == len(waits) + 1
    for measured, wait in zip(got, waits, strict=False):
        if wait == 0.0:
            assert measured is None or measured < 0.01
        else:
            assert measured is not None and wait <= measured < wait + 0.04
    assert got[-1] is None


def test_waits_between_two_logs_add_up_and_a_logged_data_time_wins(listener: Listener) -> None:
    run = make_run(listener.path, flush_interval=0.05)
    items = run.timed(slow_items([0.04, 0.04, 0.04]))
    next(items), next(items)  # two micro-batches for one step
    run.log(0, loss=1.0)
    next(items)
    run.log(1, loss=1.0, data_time=0.5)  # the loop's own measurement is sent as given
    run.finish()
    listener.accept()
    first, second = data_times(listener)
    assert first is not None and 0.08 <= first < 0.13
    assert second == 0.5


def test_timed_passes_the_iterables_exceptions_through(listener: Listener) -> None:
    run = make_run(listener.path)

    def broken() -> Iterator[int]:
        yield 1
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        list(run.timed(broken()))
    run.finish()
    assert list(run.timed([1, 2])) == [1, 2]  # after finish() the items still pass


def test_a_restore_is_sent_with_its_flag_and_a_save_without(listener: Listener) -> None:
    run = make_run(listener.path)
    run.checkpoint(100, seconds=3.5, restore=True)
    run.checkpoint(200, seconds=1.25)
    run.checkpoint(300)
    run.finish()
    listener.accept()
    got = [r for t, r in listener.records() if t == P.CHECKPOINT]
    assert [(c.step, c.seconds, c.restore) for c in got[:2]] == [
        (100, 3.5, True),
        (200, 1.25, False),
    ]
    assert got[2].step == 300 and math.isnan(got[2].seconds) and not got[2].restore


def test_the_restore_byte_is_optional_and_checked() -> None:
    save = P.encode_checkpoint(7, 1.0, 2.0)
    restore = P.encode_checkpoint(7, 1.0, 2.0, restore=True)
    assert len(restore) == len(save) + 1  # a save is byte for byte what it was
    assert P.decode_checkpoint(memoryview(save[3:])) == P.Checkpoint(7, 1.0, 2.0, False)
    assert P.decode_checkpoint(memoryview(restore[3:])) == P.Checkpoint(7, 1.0, 2.0, True)
    with pytest.raises(P.ProtocolError) as bad:
        P.decode_checkpoint(memoryview(save[3:] + b"\x02"))  # an unknown flag
    assert bad.value.reason == "malformed"


class SlowStart:
    """An iterable whose iterator takes ``start`` seconds to make (a DataLoader starting its
    worker processes) and then hands its items out at once."""

    def __init__(self, start: float, n: int) -> None:
        self.start, self.n = start, n

    def __iter__(self) -> Iterator[int]:
        time.sleep(self.start)
        return iter(range(self.n))


def test_timed_counts_the_start_of_the_iterator_as_the_first_wait(listener: Listener) -> None:
    run = make_run(listener.path, flush_interval=0.05)
    for step, _ in enumerate(run.timed(SlowStart(0.15, 3))):
        run.log(step, loss=1.0)
    run.finish()
    listener.accept()
    got = data_times(listener)
    assert got[0] is not None and got[0] >= 0.15
    assert all(t is None or t < 0.05 for t in got[1:])


def fields_of(listener: Listener) -> list[dict[int, float]]:
    return [dict(zip(r.ids, r.values, strict=True)) for r in steps_of(listener.records())]


def test_steps_carry_running_totals_so_a_lost_record_loses_nothing(listener: Listener) -> None:
    """data_time_total in every STEP with a data_time; once a checkpoint is saved, the step it
    saved and the saves' seconds so far in every STEP after it (a restore is not a save)."""
    run = make_run(listener.path, flush_interval=0.0)
    run.log(1, loss=1.0, data_time=0.25)
    run.log(2, loss=1.0)
    run.checkpoint(2, seconds=1.5)
    run.checkpoint(0, seconds=9.0, restore=True)
    run.log(3, loss=1.0, data_time=0.5)
    run.checkpoint(3, seconds=math.nan)  # an unknown duration adds nothing
    run.log(4, loss=1.0)
    run.finish()
    listener.accept()
    got = fields_of(listener)
    assert got[0][P.FIELD_DATA_TIME_TOTAL] == 0.25
    assert P.FIELD_DATA_TIME_TOTAL not in got[1] and P.FIELD_CHECKPOINT_STEP not in got[1]
    assert got[2][P.FIELD_DATA_TIME_TOTAL] == 0.75
    assert (got[2][P.FIELD_CHECKPOINT_STEP], got[2][P.FIELD_CHECKPOINT_TIME_TOTAL]) == (2, 1.5)
    assert (got[3][P.FIELD_CHECKPOINT_STEP], got[3][P.FIELD_CHECKPOINT_TIME_TOTAL]) == (3, 1.5)

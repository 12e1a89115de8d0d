"""Realistic training events are not judged as failures: a checkpoint rollback, a run id used
again, a rank that logs every n-th step, a wall clock stepped back.

Real in-process exporters on real Unix sockets. The STEP records are built by hand (the wire
format of ``trainmon_client._protocol``) so that step numbers, the client's clocks and the
step times are exactly the ones each event produces; the rollback and the reused id also run
through the real client.
"""

from __future__ import annotations

import math
import random
import time
from typing import Any

import pytest

from trainmon_client import _protocol as P

from ..conftest import InProcessExporter, connect, raw_connect, sample, wait_for
from ..helpers.exporter import hello, pkt


def step_record(
    step: int,
    steps_total: int,
    when: float,
    step_time: float,
    tokens_total: float,
    loss: float = 2.0,
) -> bytes:
    """One STEP record: ``loss`` plus the header fields an event changes."""
    head = (step, steps_total, when, step_time, tokens_total, 0.0, 0.0, 0, 0, 0)
    s = P.step_struct(1)
    return s.pack(P.STEP, P.step_payload_length(1), *head, 1, loss)


def loss_at(step: int, rng: random.Random) -> float:
    """A healthy loss curve: 4 exp(-step / 300) + 1.5, with 1 % noise."""
    return (4.0 * math.exp(-step / 300) + 1.5) * (1.0 + 0.01 * rng.gauss(0.0, 1.0))


def spikes(ex: InProcessExporter, run: str, rank: str = "0") -> float:
    m = ex.metrics()
    return sum(
        sample(m, "trainmon_train_loss_spikes_total", run=run, rank=rank, severity=sev) or 0.0
        for sev in ("minor", "major")
    )


def rank_metric(ex: InProcessExporter, name: str, run: str, rank: str = "0") -> float | None:
    return sample(ex.metrics(), name, run=run, rank=rank)


def send_steps(sock: Any, records: list[bytes], per_packet: int = 50) -> None:
    for i in range(0, len(records), per_packet):
        sock.send(pkt(*records[i : i + per_packet]))


def test_a_checkpoint_rollback_is_a_restart_not_a_spike_or_a_divergence(
    exporter: InProcessExporter,
) -> None:
    """Before: stepping back from 600 to 300 (the loss back at step 300's level) counted loss
    spikes and turned the EMA trend positive ("diverging")."""
    rng = random.Random(0)
    run = connect(exporter, "rollback")
    for i in range(600):
        run.log(i, loss=loss_at(i, rng), tokens=1000)
    wait_for(lambda: (r := exporter.rank("rollback", 0)) and r["step"] == 599)
    assert spikes(exporter, "rollback") == 0
    assert rank_metric(exporter, "trainmon_run_restarts_total", "rollback") == 0
    # The job reloads its step-300 checkpoint and trains on: the loss is back at that level.
    for i in range(300, 400):
        run.log(i, loss=loss_at(i, rng), tokens=1000)
    wait_for(lambda: (r := exporter.rank("rollback", 0)) and r["step"] == 399)
    assert rank_metric(exporter, "trainmon_run_restarts_total", "rollback") == 1
    assert rank_metric(exporter, "trainmon_train_step_rollbacks_total", "rollback") == 1
    assert spikes(exporter, "rollback") == 0
    slope = rank_metric(exporter, "trainmon_train_loss_ema_slope", "rollback")
    assert slope is not None and slope < 0, slope
    run.finish()


def test_a_new_process_resuming_a_rank_is_a_restart(exporter: InProcessExporter) -> None:
    """A crashed rank's replacement (same run id and rank, its own counts from 1) resumes from
    a checkpoint: counted once, judged from fresh statistics, the rank's counters kept."""
    rng = random.Random(1)
    now = time.time()
    first = raw_connect(exporter.socket)
    first.send(pkt(hello(run="resume")))
    send_steps(
        first,
        [
            step_record(i, i + 1, now - 60 + 0.05 * i, 0.05, 0.0, loss_at(i, rng))
            for i in range(400)
        ],
    )
    wait_for(lambda: (r := exporter.rank("resume", 0)) and r["step"] == 399)
    first.close()  # killed: no FINISH
    wait_for(lambda: (r := exporter.rank("resume", 0)) and not r["up"])
    second = raw_connect(exporter.socket)
    second.send(pkt(hello(run="resume")))
    send_steps(
        second,
        [
            step_record(i, i - 99, now - 5 + 0.05 * (i - 100), 0.05, 0.0, loss_at(i, rng))
            for i in range(100, 200)
        ],
    )
    wait_for(lambda: (r := exporter.rank("resume", 0)) and r["up"] and r["step"] == 199)
    m = exporter.metrics()
    assert sample(m, "trainmon_run_restarts_total", run="resume", rank="0") == 1
    assert sample(m, "trainmon_train_step_rollbacks_total", run="resume", rank="0") == 0
    assert sample(m, "trainmon_run_crashes_total", run="resume", rank="0") == 1
    assert spikes(exporter, "resume") == 0
    second.close()


def test_a_reused_run_id_starts_from_fresh_state(exporter: InProcessExporter) -> None:
    """Before: a second run under a finished run's id was judged against the first run's
    final loss: a loss back at its starting level read as 11 major spikes."""
    rng = random.Random(2)
    first = connect(exporter, "reused")
    for i in range(1500):
        first.log(i, loss=loss_at(i, rng), tokens=100)
    first.finish()
    wait_for(
        lambda: (r := exporter.rank("reused", 0)) and r["status"] == "finished" and not r["up"]
    )
    second = connect(exporter, "reused")
    for i in range(50):
        second.log(i, loss=loss_at(i, rng), tokens=100)
    wait_for(lambda: (r := exporter.rank("reused", 0)) and r["up"] and r["step"] == 49)
    m = exporter.metrics()
    assert spikes(exporter, "reused") == 0
    # Fresh counters: the second run's own steps, no restart, no spike of the first run.
    assert sample(m, "trainmon_train_steps_total", run="reused", rank="0") == 50
    assert sample(m, "trainmon_run_restarts_total", run="reused", rank="0") == 0
    assert sample(m, "trainmon_run_crashes_total", run="reused", rank="0") == 0
    second.finish()


def test_a_rank_logging_every_tenth_step_is_not_a_straggler(
    make_exporter: Any,
) -> None:
    """Before: the time between a rank's log() calls was taken as its step time, so a rank
    logging every 10th step read as a 10x straggler (and its histogram 10x slower)."""
    ex = make_exporter()
    now = time.time()
    socks = []
    for rank, stride in ((0, 1), (1, 10), (2, 1)):
        s = raw_connect(ex.socket)
        s.send(pkt(hello(run="stride", rank=rank, world_size=3)))
        records = []
        for k in range(60):
            step = k * stride
            when = now - 60 + 0.1 * step
            # The client sends NaN as the first step time: nothing to measure yet.
            step_time = 0.1 * stride if k else math.nan
            records.append(step_record(step, k + 1, when, step_time, 1000.0 * step))
        send_steps(s, records)
        socks.append(s)

    def ratios() -> dict[str, float] | None:
        m = ex.metrics()
        out = {
            r: sample(m, "trainmon_train_straggler_ratio", run="stride", rank=r)
            for r in ("0", "1", "2")
        }
        return out if all(v is not None for v in out.values()) else None  # type: ignore[return-value]

    got = wait_for(ratios, timeout=30)
    assert got["1"] == pytest.approx(1.0, rel=0.01), got
    m = ex.metrics()
    for r in ("0", "1", "2"):
        median = sample(m, "trainmon_train_step_time_median_seconds", run="stride", rank=r)
        assert median == pytest.approx(0.1, rel=0.01), (r, median)
        # One histogram observation per log() call, each the time of one training step.
        total = sample(m, "trainmon_train_step_duration_seconds_sum", run="stride", rank=r)
        count = sample(m, "trainmon_train_step_duration_seconds_count", run="stride", rank=r)
        assert count is not None and total is not None
        assert total / count == pytest.approx(0.1, rel=0.01), (r, total, count)
    for s in socks:
        s.close()


def test_a_wall_clock_stepped_back_does_not_hide_the_rates(exporter: InProcessExporter) -> None:
    """Before: steps stamped an hour ahead (a clock then corrected back by NTP) stayed in the
    rate window, and tokens/s read nothing for the next 2,048 steps."""
    now = time.time()
    s = raw_connect(exporter.socket)
    s.send(pkt(hello(run="clock")))
    ahead = [step_record(i, i + 1, now + 3600 + 0.1 * i, 0.1, 1000.0 * (i + 1)) for i in range(50)]
    send_steps(s, ahead)
    wait_for(lambda: (r := exporter.rank("clock", 0)) and r["step"] == 49)
    # The clock is corrected back by an hour; training goes on at 10 steps/s.
    back = [
        step_record(i, i + 1, now - 5 + 0.1 * (i - 50), 0.1, 1000.0 * (i + 1))
        for i in range(50, 100)
    ]
    send_steps(s, back)
    wait_for(lambda: (r := exporter.rank("clock", 0)) and r["step"] == 99)
    tps = rank_metric(exporter, "trainmon_train_tokens_per_second", "clock")
    assert tps == pytest.approx(10_000.0, rel=0.01), tps
    s.close()

"""When each event last happened, as the alerts read it (``*_last_timestamp_seconds``).

Event alerts fire on ``time() - <event time> < window`` (docs/alerting.md#event-alerts), so
the exporter stamps every event it judges or sees with its wall clock, and a series exists
only once its event happened. The client's own totals (drops, allocator retries, OOMs) are
stamped when they rise; the first totals of a client process that started before this
exporter (a reconnect after an exporter restart) are a baseline, not a rise.

Real in-process exporters on real Unix sockets, fed hand-made records (the wire format of
``trainmon_client._protocol``) so that the totals and the process identity are exactly the
ones each case needs.
"""

from __future__ import annotations

import math
import time
from typing import Any

from trainmon_client import _protocol as P
from trainmon_exporter.analytics import AnalyticsSettings, RankAnalytics
from trainmon_exporter.analytics.events import STARTED_AT, ClientTotals

from ..conftest import InProcessExporter, raw_connect, sample, wait_for
from ..fakes.nvml_backend import FakeGpu, FakeNvmlBackend
from ..helpers.exporter import hello, pkt

DROPS = "trainmon_client_dropped_messages_last_timestamp_seconds"
RETRIES = "trainmon_train_allocator_retries_last_timestamp_seconds"
OOMS = "trainmon_train_oom_errors_last_timestamp_seconds"


def step(
    n: int,
    disconnected: int = 0,
    backpressure: int = 0,
    loss: float = 2.0,
    retries: float | None = None,
    ooms: float | None = None,
) -> bytes:
    """A STEP record of step ``n`` with the client's drop totals in its header."""
    ids, values = [P.FIELD_LOSS], [loss]
    if retries is not None:
        ids.append(P.FIELD_ALLOC_RETRIES)
        values.append(retries)
    if ooms is not None:
        ids.append(P.FIELD_OOMS)
        values.append(ooms)
    head = (n, n, time.time(), 0.1, 10.0 * n, float(n), 0.0, disconnected, backpressure, 0)
    s = P.step_struct(len(ids))
    return s.pack(P.STEP, P.step_payload_length(len(ids)), *head, *ids, *values)


def totals(
    sent: int,
    *,
    disconnected: int = 0,
    backpressure: int = 0,
    encode_error: int = 0,
    in_flight: int = 0,
) -> bytes:
    """A TOTALS record: the client's delivery accounting, as its STEP headers say it too."""
    return P.encode_totals(
        P.Totals(sent, sent, disconnected, backpressure, encode_error, in_flight, 0)
    )


def rank_samples(ex: InProcessExporter, name: str, run: str) -> dict[frozenset[Any], float]:
    """Samples of ``name`` for ``run`` rank 0, keyed by their label set."""
    return {
        labels: v
        for (metric, labels), v in ex.metrics().items()
        if metric == name and ("run", run) in labels and ("rank", "0") in labels
    }


def applied(ex: InProcessExporter, run: str, n: int) -> bool:
    r = ex.rank(run, 0)
    return r is not None and r["step"] == n


def send(ex: InProcessExporter, sock: Any, run: str, n: int, *records: bytes) -> None:
    sock.send(pkt(*records))
    wait_for(lambda: applied(ex, run, n))


# ------------------------------------------------------------------ detector events


def test_a_nan_is_stamped_with_when_it_arrived_and_only_its_field(
    exporter: InProcessExporter,
) -> None:
    sock = raw_connect(exporter.socket)
    try:
        send(exporter, sock, "nan", 1, hello(run="nan"), step(1))
        assert (
            rank_samples(exporter, "trainmon_train_nonfinite_values_last_timestamp_seconds", "nan")
            == {}
        )
        before = time.time()
        send(exporter, sock, "nan", 2, step(2, loss=math.nan))
        after = time.time()
        got = rank_samples(
            exporter, "trainmon_train_nonfinite_values_last_timestamp_seconds", "nan"
        )
        assert len(got) == 1
        ((labels, when),) = got.items()
        assert ("field", "loss") in labels
        assert before <= when <= after
        # Later steps without a NaN leave the time where it was: it is the event's, not a scrape's.
        send(exporter, sock, "nan", 3, step(3))
        assert rank_samples(
            exporter, "trainmon_train_nonfinite_values_last_timestamp_seconds", "nan"
        ) == {labels: when}
    finally:
        sock.close()


def test_a_crash_is_stamped_and_a_clean_finish_is_not(exporter: InProcessExporter) -> None:
    name = "trainmon_run_crashes_last_timestamp_seconds"
    clean = raw_connect(exporter.socket)
    send(exporter, clean, "clean", 1, hello(run="clean"), step(1))
    clean.send(pkt(P.encode_finish(P.FINISH_OK, time.time())))
    clean.close()
    crashed = raw_connect(exporter.socket)
    send(exporter, crashed, "crashed", 1, hello(run="crashed"), step(1))
    before = time.time()
    crashed.close()  # EOF without FINISH
    wait_for(lambda: rank_samples(exporter, name, "crashed"))
    assert before <= next(iter(rank_samples(exporter, name, "crashed").values())) <= time.time()
    wait_for(lambda: (r := exporter.rank("clean", 0)) is not None and r["status"] == "finished")
    assert rank_samples(exporter, name, "clean") == {}


def test_the_repeat_time_is_that_of_the_third_latest_rollback() -> None:
    a = RankAnalytics(AnalyticsSettings())
    times = []
    for _ in range(2):
        a.reseed(rollback=True)
        times.append(a.rollback_times[-1])
    a.reseed()  # a new process resuming the rank: a restart, not a rollback
    assert a.rollbacks_repeat_time() is None
    for _ in range(2):
        time.sleep(0.01)
        a.reseed(rollback=True)
        times.append(a.rollback_times[-1])
    assert a.rollbacks_repeat_time() == times[-3] > times[0]
    assert RankAnalytics(AnalyticsSettings(rollback_repeats=1)).rollbacks_repeat_time() is None


def test_three_rollbacks_export_their_repeat_time(exporter: InProcessExporter) -> None:
    name = "trainmon_train_step_rollbacks_repeat_timestamp_seconds"
    sock = raw_connect(exporter.socket)
    try:
        send(exporter, sock, "rb", 10, hello(run="rb"), *(step(n) for n in range(1, 11)))
        steps = 10
        for back in range(3):
            assert rank_samples(exporter, name, "rb") == {}
            steps += 1  # the rollback's own step, the same client process (steps_total rises)
            head = (5, steps, time.time(), 0.1, 10.0 * steps, float(steps), 0.0, 0, 0, 0)
            record = P.step_struct(1).pack(P.STEP, P.step_payload_length(1), *head, 1, 2.0)
            send(exporter, sock, "rb", 5, record)
            assert (
                sample(
                    exporter.metrics(), "trainmon_train_step_rollbacks_total", run="rb", rank="0"
                )
                == back + 1
            )
            if back < 2:
                # back to step 10 before the next rollback
                steps += 1
                head = (10, steps, time.time(), 0.1, 10.0 * steps, float(steps), 0.0, 0, 0, 0)
                record = P.step_struct(1).pack(P.STEP, P.step_payload_length(1), *head, 1, 2.0)
                send(exporter, sock, "rb", 10, record)
        assert len(rank_samples(exporter, name, "rb")) == 1
    finally:
        sock.close()


# ------------------------------------------------------------------ the client's own totals


def test_totals_of_a_process_older_than_the_exporter_are_a_baseline(
    exporter: InProcessExporter,
) -> None:
    """An exporter restart: the client reconnects with the drops the restart caused (records
    sent while no exporter listened, records in flight) and its old allocator totals. None of
    them is an event; a rise after that is."""
    assert STARTED_AT > 1.0  # the HELLO's started_at: the process predates this exporter
    sock = raw_connect(exporter.socket)
    try:
        send(
            exporter,
            sock,
            "old",
            100,
            hello(run="old"),
            step(100, disconnected=40, backpressure=2, retries=7, ooms=1),
            totals(1, disconnected=40, backpressure=2, in_flight=5),
        )
        for name in (DROPS, RETRIES, OOMS):
            assert rank_samples(exporter, name, "old") == {}, name
        # Sent again unchanged: still nothing.
        send(
            exporter,
            sock,
            "old",
            101,
            step(101, disconnected=40, backpressure=2, retries=7, ooms=1),
        )
        for name in (DROPS, RETRIES, OOMS):
            assert rank_samples(exporter, name, "old") == {}, name
        # Now the totals rise on this exporter's watch.
        before = time.time()
        send(
            exporter,
            sock,
            "old",
            102,
            step(102, disconnected=40, backpressure=3, retries=8, ooms=1),
        )
        drops = rank_samples(exporter, DROPS, "old")
        assert [dict(k)["reason"] for k in drops] == ["backpressure"]
        assert before <= next(iter(drops.values())) <= time.time()
        assert len(rank_samples(exporter, RETRIES, "old")) == 1
        assert rank_samples(exporter, OOMS, "old") == {}
    finally:
        sock.close()


def test_totals_of_a_process_younger_than_the_exporter_are_events(
    exporter: InProcessExporter,
) -> None:
    """A trainer that started after the exporter and dropped records before its first
    message, or hit an OOM in its first step: those happened on this exporter's watch."""
    sock = raw_connect(exporter.socket)
    try:
        send(
            exporter,
            sock,
            "young",
            1,
            hello(run="young", started_at=time.time()),
            step(1, disconnected=3, retries=0, ooms=1),
        )
        assert [dict(k)["reason"] for k in rank_samples(exporter, DROPS, "young")] == [
            "disconnected"
        ]
        assert rank_samples(exporter, RETRIES, "young") == {}  # 0 is no event
        assert len(rank_samples(exporter, OOMS, "young")) == 1
    finally:
        sock.close()


def test_a_new_process_resuming_the_rank_is_judged_from_its_own_totals() -> None:
    """The old process's TOTALS figures stay in the rank's state until the new process sends
    its own: they are not the new process's events."""

    class Rank:
        def __init__(self, pid: int, started_at: float) -> None:
            self.pid, self.started_at = pid, started_at
            self.dropped_disconnected = self.dropped_backpressure = 0
            self.dropped_encode_error = self.dropped_in_flight = 0
            self.values: dict[str, float] = {}

    t = ClientTotals(since=100.0)
    old = Rank(1, 50.0)  # started before the exporter: a baseline
    old.dropped_in_flight, old.values["ooms"] = 9, 2.0
    t.observe_step(old, (P.FIELD_OOMS,))
    t.observe_totals(old)
    assert t.last == {}
    new = Rank(2, 150.0)  # resumes the rank; the state still holds the old figures
    new.dropped_in_flight, new.values["ooms"] = 9, 2.0
    t.observe_step(new, (P.FIELD_LOSS,))  # its first STEP carries neither
    assert t.last == {}
    new.dropped_in_flight = 0  # its own TOTALS
    t.observe_totals(new)
    assert t.last == {}
    new.values["ooms"] = 1.0  # its first OOM
    t.observe_step(new, (P.FIELD_OOMS,))
    assert list(t.last) == ["ooms"]


def test_a_reconnect_to_the_same_exporter_reports_the_drops_of_the_gap(
    exporter: InProcessExporter,
) -> None:
    """The exporter stayed up; the client lost its connection and counted drops meanwhile:
    those happened while this exporter was there to take the records, so they are events."""
    first = raw_connect(exporter.socket)
    send(exporter, first, "gap", 1, hello(run="gap", pid=77), step(1, disconnected=0))
    first.send(pkt(totals(1)))
    first.close()
    wait_for(lambda: (r := exporter.rank("gap", 0)) is not None and not r["up"])
    assert rank_samples(exporter, DROPS, "gap") == {}
    second = raw_connect(exporter.socket)
    try:
        send(exporter, second, "gap", 5, hello(run="gap", pid=77), step(5, disconnected=3))
        assert [dict(k)["reason"] for k in rank_samples(exporter, DROPS, "gap")] == ["disconnected"]
    finally:
        second.close()


# ------------------------------------------------------------------ the exporter's own events


def test_refusals_and_invalid_records_are_stamped_from_their_first(
    exporter: InProcessExporter,
) -> None:
    m = exporter.metrics()
    invalid_at = "trainmon_ingest_messages_invalid_last_timestamp_seconds"
    assert not [k for k in m if k[0] == invalid_at]  # no series at 0 for reasons never seen
    assert sample(m, "trainmon_ingest_messages_invalid_total", reason="bad_magic") == 0
    live = raw_connect(exporter.socket)
    dup = raw_connect(exporter.socket)
    bad = raw_connect(exporter.socket)
    try:
        send(exporter, live, "dup", 1, hello(run="dup"), step(1))
        before = time.time()
        dup.send(pkt(hello(run="dup")))  # rank 0 is connected: refused
        bad.send(b"XX\x01\x00")  # bad magic
        wait_for(
            lambda: (
                sample(exporter.metrics(), invalid_at, reason="bad_magic") is not None
                and [
                    k
                    for k in exporter.metrics()
                    if k[0].startswith("trainmon_ingest_hellos_refused_last")
                ]
            )
        )
        m = exporter.metrics()
        refused = {
            k: v
            for k, v in m.items()
            if k[0] == "trainmon_ingest_hellos_refused_last_timestamp_seconds"
        }
        assert [dict(k[1])["reason"] for k in refused] == ["duplicate_rank"]
        for when in [*refused.values(), sample(m, invalid_at, reason="bad_magic")]:
            assert when is not None and before <= when <= time.time()
        stamped = {dict(k[1])["reason"] for k in m if k[0] == invalid_at}
        assert stamped == {"duplicate_rank", "bad_magic"}
    finally:
        for s in (live, dup, bad):
            s.close()


def test_an_xid_is_stamped_per_gpu_and_code(make_exporter: Any) -> None:
    gpu = FakeGpu()
    ex = make_exporter(nvml=FakeNvmlBackend([gpu, FakeGpu()]))
    name = "trainmon_gpu_xid_errors_last_timestamp_seconds"
    assert not [k for k in ex.metrics() if k[0] == name]
    before = time.time()
    gpu.xids.append(79)
    wait_for(lambda: [k for k in ex.metrics() if k[0] == name], timeout=10)
    ((labels, when),) = [(dict(k[1]), v) for k, v in ex.metrics().items() if k[0] == name]
    assert labels["xid"] == "79" and labels["gpu"] == "0"
    assert before <= when <= time.time()


def test_a_gradient_explosion_is_stamped(exporter: InProcessExporter) -> None:
    name = "trainmon_train_grad_explosions_last_timestamp_seconds"
    sock = raw_connect(exporter.socket)
    try:
        send(exporter, sock, "boom", 1, hello(run="boom"), step(1))
        assert rank_samples(exporter, name, "boom") == {}
        head = (2, 2, time.time(), 0.1, 20.0, 2.0, 0.0, 0, 0, 0)
        record = P.step_struct(1).pack(
            P.STEP, P.step_payload_length(1), *head, P.FIELD_GRAD_NORM, 1e6
        )
        send(exporter, sock, "boom", 2, record)
        assert len(rank_samples(exporter, name, "boom")) == 1
    finally:
        sock.close()


def test_a_gpu_lost_while_sampled_is_stamped_and_one_lost_before_the_start_is_not() -> None:
    from trainmon_exporter.sampler import GpuSampler

    gpus = [FakeGpu(), FakeGpu(), FakeGpu()]
    gpus[2].lost = True  # lost before the exporter enumerated it: its loss predates us
    s = GpuSampler(FakeNvmlBackend(gpus))
    s.open()
    snap = s.sample_once()
    assert (snap.lost_total, snap.lost_at) == (1, None)
    before = time.time()
    gpus[1].lost = True  # falls off the bus while sampled
    snap = s.sample_once()
    s.stop()
    assert snap.lost_total == 2
    assert snap.lost_at is not None and before <= snap.lost_at <= time.time()

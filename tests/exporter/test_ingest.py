"""The exporter against real clients and hand-made bad packets on its real Unix socket.

Every bad input must be dropped with a counter saying why, while the exporter keeps serving
and other ranks' data stays untouched.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable

import pytest

import trainmon_client
from trainmon_client import _protocol as P
from trainmon_exporter.apply import MAX_NAMES_PER_CONNECTION

from ..conftest import InProcessExporter, connect, raw_connect, sample, wait_for
from ..helpers.exporter import dropped, hello, invalid, pkt, step


@pytest.fixture
def healthy(exporter: InProcessExporter) -> trainmon_client.Run:
    """A well-behaved rank whose data must survive everyone else's garbage."""
    run = connect(exporter, "good")
    run.log(1, loss=2.0, tokens=10)
    wait_for(lambda: exporter.rank("good", 0))
    return run


def assert_healthy_untouched(ex: InProcessExporter, run: trainmon_client.Run) -> None:
    run.log(2, loss=1.5, tokens=10)
    r = wait_for(lambda: (k := ex.rank("good", 0)) and k["step"] == 2 and k)
    assert r["values"]["loss"] == 1.5 and r["tokens_total"] == 20.0 and r["up"]
    assert ex.client.get("/healthz").status_code == 200


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"\x00", "truncated"),
        (b"garbage!", "bad_magic"),
        (b"TM\x02\x00" + hello(), "unknown_version"),
        (pkt(hello())[:-3], "truncated"),
        (pkt(struct.pack("<BH", P.HELLO, 5) + b"{oops"), "malformed"),
        (pkt(hello(rank="zero")), "bad_hello"),  # wrong type
        (pkt(hello(rank=1.5)), "bad_hello"),
        (pkt(hello(world_size=0)), "bad_hello"),
        (pkt(hello(run='quote"run')), "bad_hello"),
        (pkt(hello(run="new\nline")), "bad_hello"),
        (pkt(hello(run="r" * 10_000)), "bad_hello"),
        (pkt(hello(hostname="h" * 1000)), "bad_hello"),
        (pkt(hello(flops_per_token=-1.0)), "bad_hello"),
        (pkt(step(1)), "no_hello"),
        (pkt(hello(), struct.pack("<BH", 99, 0)), "unknown_type"),
        (pkt(hello(), hello()), "duplicate_hello"),
        (pkt(hello(), P.encode_name(64, 'bad"name')), "invalid_name"),
        (pkt(hello(), P.encode_name(64, "x" * 10_000)), "invalid_name"),
        (pkt(hello(), P.encode_name(64, "new\nline")), "invalid_name"),
        (pkt(hello(), struct.pack("<BH", P.STEP, 3) + b"abc"), "truncated"),
        (pkt(hello(), struct.pack("<BH", P.FINISH, 9) + struct.pack("<Bd", 5, 1.0)), "malformed"),
    ],
)
def test_bad_input_is_counted_and_harmless(
    exporter: InProcessExporter, healthy: trainmon_client.Run, data: bytes, reason: str
) -> None:
    before = invalid(exporter, reason)
    s = raw_connect(exporter.socket)
    s.send(data)
    wait_for(lambda: invalid(exporter, reason) == before + 1)
    s.close()
    assert_healthy_untouched(exporter, healthy)


def test_oversized_packet(exporter: InProcessExporter, healthy: trainmon_client.Run) -> None:
    s = raw_connect(exporter.socket)
    s.send(pkt(hello()) + b"\x00" * P.MAX_PACKET_BYTES)
    wait_for(lambda: invalid(exporter, "oversized") == 1)
    s.close()
    assert_healthy_untouched(exporter, healthy)


def test_unknown_fields_and_hello_keys_are_dropped_and_counted(
    exporter: InProcessExporter, healthy: trainmon_client.Run
) -> None:
    s = raw_connect(exporter.socket)
    s.send(pkt(hello(run="extra", future_key=1, another=2), step(1, (1, 300), (0.5, 7.0))))
    wait_for(lambda: exporter.rank("extra", 0))
    assert dropped(exporter, "unknown_field") == 1
    assert dropped(exporter, "unknown_hello_key") == 2
    assert exporter.rank("extra", 0)["values"] == {"loss": 0.5}  # type: ignore[index]
    s.close()
    assert_healthy_untouched(exporter, healthy)


def test_records_after_an_invalid_one_still_apply(exporter: InProcessExporter) -> None:
    s = raw_connect(exporter.socket)
    s.send(
        pkt(
            hello(run="mixed"),
            P.encode_name(64, "bad name"),
            P.encode_name(65, "ok"),
            step(1, (1, 64, 65), (1.0, 2.0, 3.0)),
        )
    )
    r = wait_for(lambda: exporter.rank("mixed", 0))
    assert r["custom"] == {"ok": 3.0}
    assert invalid(exporter, "invalid_name") == 1
    assert dropped(exporter, "unknown_field") == 1  # the value sent under the refused name
    s.close()


def test_a_hundred_thousand_custom_names_are_capped(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    ex = make_exporter(max_custom_metrics=50)
    good = connect(ex, "good")
    good.log(0, loss=1.0, mine=1.0)
    s = raw_connect(ex.socket)
    try:
        s.send(pkt(hello(run="flood")))
        # 2,000 names and a step that uses them, then 98,000 more names (ids are u16: rebound).
        s.send(pkt(b"".join(P.encode_name(64 + i, f"m{i}") for i in range(2000))))
        s.send(pkt(step(1, tuple(range(64, 2064)), tuple(float(i) for i in range(2000)))))
        bound: set[int] = set(range(64, 2064))
        refused = 0
        for start in range(2000, 100_000, 2000):
            ids = [64 + i % 60000 for i in range(start, start + 2000)]
            for fid in ids:  # the rule: a new id binds while the connection has room
                if fid in bound or len(bound) < MAX_NAMES_PER_CONNECTION:
                    bound.add(fid)
                else:
                    refused += 1
            names = (
                P.encode_name(fid, f"m{i}")
                for fid, i in zip(ids, range(start, start + 2000), strict=True)
            )
            s.send(pkt(b"".join(names)))
        s.send(pkt(step(2)))
        r = wait_for(lambda: (k := ex.rank("flood", 0)) and k["step"] == 2 and k, timeout=60)
        assert len(r["custom"]) == 50  # the first 50 names that carried a value
        assert dropped(ex, "custom_cap") == 1950
        assert refused > 90_000 and invalid(ex, "name_cap") == refused
        assert ex.rank("good", 0)["custom"] == {"mine": 1.0}  # type: ignore[index]
        m = ex.metrics()
        assert sum(1 for (n, lbl) in m if n == "trainmon_train_custom_value") == 51
    finally:
        s.close()
        good.finish()


def test_duplicate_rank_is_refused(exporter: InProcessExporter) -> None:
    a = raw_connect(exporter.socket)
    a.send(pkt(hello(run="dup"), step(1)))
    wait_for(lambda: exporter.rank("dup", 0))
    b = raw_connect(exporter.socket)
    b.send(pkt(hello(run="dup"), step(99)))
    wait_for(lambda: invalid(exporter, "duplicate_rank") == 1)
    assert exporter.rank("dup", 0)["step"] == 1  # type: ignore[index]
    assert P.decode_refused(b.recv(P.MAX_PACKET_BYTES)) == ("duplicate_rank", "")  # told why
    assert b.recv(10) == b""  # then the exporter closed the impostor
    b.close()
    a.close()


def test_too_many_ranks(make_exporter: Callable[..., InProcessExporter]) -> None:
    ex = make_exporter(max_ranks=2)
    socks = []
    for rank in range(3):
        s = raw_connect(ex.socket)
        s.send(pkt(hello(run="many", rank=rank, world_size=3)))
        socks.append(s)
    wait_for(lambda: invalid(ex, "too_many_ranks") == 1)
    assert len(ex.runs()["runs"][0]["ranks"]) == 2
    for s in socks:
        s.close()


def test_crash_finish_and_failure_are_told_apart(exporter: InProcessExporter) -> None:
    ok = raw_connect(exporter.socket)
    ok.send(pkt(hello(run="r", rank=0, world_size=3), step(1), P.encode_finish(P.FINISH_OK, 2.0)))
    failed = raw_connect(exporter.socket)
    failed.send(
        pkt(hello(run="r", rank=1, world_size=3), step(1), P.encode_finish(P.FINISH_FAILED, 2.0))
    )
    crashed = raw_connect(exporter.socket)
    crashed.send(pkt(hello(run="r", rank=2, world_size=3), step(1)))
    silent = raw_connect(exporter.socket)
    silent.send(pkt(hello(run="r2"), step(1)))
    wait_for(
        lambda: len(exporter.runs()["runs"]) == 2 and len(exporter.runs()["runs"][0]["ranks"]) == 3
    )
    for s in (ok, failed, crashed):
        s.close()

    def statuses() -> list[str]:
        return [k["status"] for k in exporter.runs()["runs"][0]["ranks"]]

    wait_for(lambda: statuses() == ["finished", "failed", "crashed"])
    m = exporter.metrics()
    assert [sample(m, "trainmon_run_up", run="r", rank=str(i)) for i in range(3)] == [0, 0, 0]
    assert [sample(m, "trainmon_run_crashes_total", run="r", rank=str(i)) for i in range(3)] == [
        0,
        1,
        1,
    ]
    assert sample(m, "trainmon_run_up", run="r2", rank="0") == 1  # connected, silent: not crashed
    assert exporter.rank("r2", 0)["status"] == "running"  # type: ignore[index]
    silent.close()


def test_event_counters_exist_at_zero_from_the_first_message(exporter: InProcessExporter) -> None:
    s = raw_connect(exporter.socket)
    s.send(pkt(hello(run="fresh")))
    wait_for(lambda: exporter.rank("fresh", 0))
    m = exporter.metrics()
    for field in ("loss", "grad_norm", "lr", "custom"):
        assert (
            sample(m, "trainmon_train_nonfinite_values_total", run="fresh", rank="0", field=field)
            == 0
        )
    assert sample(m, "trainmon_run_crashes_total", run="fresh", rank="0") == 0
    for reason in ("disconnected", "backpressure"):
        assert (
            sample(
                m, "trainmon_client_dropped_messages_total", run="fresh", rank="0", reason=reason
            )
            == 0
        )
    s.close()


def test_nonfinite_values_are_counted_per_field(exporter: InProcessExporter) -> None:
    run = connect(exporter, "nan")
    run.log(0, loss=1.0, grad_norm=1.0, lr=0.1, q=1.0)
    run.log(1, loss=math.nan, grad_norm=math.inf, lr=0.1, q=-math.inf)
    run.log(2, loss=math.nan, grad_norm=1.0, lr=math.nan, q=1.0)
    run.finish()
    wait_for(lambda: (k := exporter.rank("nan", 0)) and k["status"] == "finished")
    m = exporter.metrics()

    def nf(field: str) -> float | None:
        return sample(m, "trainmon_train_nonfinite_values_total", run="nan", rank="0", field=field)

    assert (nf("loss"), nf("grad_norm"), nf("lr"), nf("custom")) == (2, 1, 1, 1)
    assert math.isnan(sample(m, "trainmon_train_loss", run="nan", rank="0"))  # type: ignore[arg-type]
    # The JSON API has no NaN: it says null, and the counters say what happened.
    assert exporter.rank("nan", 0)["values"]["loss"] is None  # type: ignore[index]
    json.dumps(exporter.runs(), allow_nan=False)

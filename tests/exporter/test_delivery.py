"""Data is never lost silently: every record a client logs is applied, or counted on one side
with a reason, and the exporter tells records it never received from records it applied.

Real exporters (in-process app and ``python -m trainmon_exporter`` processes) on real Unix
sockets, real clients and hand-made packets.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

import trainmon_client
from trainmon_client import _protocol as P
from trainmon_exporter.analytics import RankAnalytics

from ..conftest import (
    ExporterProcess,
    InProcessExporter,
    connect,
    raw_connect,
    sample,
    short_tmpdir,
    wait_for,
)
from ..helpers.exporter import dropped, hello, invalid, pkt, step


def accounted(run: trainmon_client.Run) -> int:
    """Records the client has an account of: sent, or dropped before sending with a reason."""
    return run.sent + sum(v for k, v in run.dropped.items() if k != "in_flight")


def totals(sent_connection: int, sent_total: int | None = None) -> bytes:
    return P.encode_totals(P.Totals(sent_connection, sent_total or sent_connection, 0, 0, 0, 0, 0))


def unapplied(metrics: dict[Any, float], run: str, rank: str = "0") -> float | None:
    return sample(metrics, "trainmon_ingest_messages_unapplied_total", run=run, rank=rank)


def client_dropped(metrics: dict[Any, float], run: str, reason: str) -> float | None:
    return sample(
        metrics, "trainmon_client_dropped_messages_total", run=run, rank="0", reason=reason
    )


def test_steps_sent_alongside_a_refused_hello_are_counted(exporter: InProcessExporter) -> None:
    """Before: of 40 steps sent by a second process claiming a connected rank, 20 vanished
    with no counter on either side."""
    first = connect(exporter, "dup")
    first.log(0, loss=1.0)
    wait_for(lambda: exporter.rank("dup", 0))
    # The same rank again, 40 steps buffered, all sent at finish(): its HELLO is refused.
    second = connect(exporter, "dup", flush_interval=60.0)
    for i in range(40):
        second.log(i, loss=1.0)
    second.finish()
    assert accounted(second) == 40
    assert second.sent == 40
    # The exporter closed the connection after the HELLO: it never read the steps, and the
    # client says so.
    assert second.dropped["in_flight"] == 40
    assert invalid(exporter, "duplicate_rank") == 1
    # Records packed behind a refused HELLO in one packet are counted by the exporter.
    before = invalid(exporter, "no_hello")
    s = raw_connect(exporter.socket)
    s.send(pkt(hello(run="dup"), step(1), step(2), step(3), totals(3)))
    wait_for(lambda: invalid(exporter, "no_hello") == before + 4)
    s.close()
    first.finish()


def test_the_exporter_exports_what_it_never_applied(exporter: InProcessExporter) -> None:
    s = raw_connect(exporter.socket)
    # The client says 5 records went out on this connection; 2 arrived, one of them invalid.
    s.send(pkt(hello(run="gap"), step(1), P.encode_fields(P.EVAL, b"x", [], []), totals(5)))
    wait_for(lambda: unapplied(exporter.metrics(), "gap") == 4.0)
    s.send(pkt(step(2), step(3), totals(7)))
    time.sleep(0.3)
    assert unapplied(exporter.metrics(), "gap") == 4.0  # the gap only grows when it grows
    s.send(pkt(step(4), totals(9)))
    wait_for(lambda: unapplied(exporter.metrics(), "gap") == 5.0)
    s.close()
    # A well-behaved client: nothing unapplied, sent counted.
    run = connect(exporter, "nogap")
    for i in range(20):
        run.log(i, loss=1.0)
    run.eval(19, val_loss=1.0)
    run.finish()
    m = wait_for(
        lambda: (
            (m := exporter.metrics())
            and sample(m, "trainmon_client_sent_messages_total", run="nogap", rank="0") == 21.0
            and m
        )
    )
    assert unapplied(m, "nogap") == 0.0
    assert run.dropped["in_flight"] == 0


def test_an_exception_in_ingest_costs_one_record_not_the_packet_nor_the_rank(
    exporter: InProcessExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the rest of the packet was lost and the live trainer recorded as crashed."""
    original = RankAnalytics.observe_step

    def buggy(self: RankAnalytics, step: int, loss: float | None, *a: Any, **k: Any) -> None:
        if loss == 13.0:
            raise RuntimeError("a bug in a detector")
        original(self, step, loss, *a, **k)

    monkeypatch.setattr(RankAnalytics, "observe_step", buggy)
    s = raw_connect(exporter.socket)
    s.send(pkt(hello(run="exc"), step(1), step(2, values=(13.0,)), step(3), totals(3)))
    r = wait_for(lambda: (k := exporter.rank("exc", 0)) and k["step"] == 3 and k)
    assert r["up"] and r["status"] == "running" and r["crashes"] == 0
    m = exporter.metrics()
    assert invalid(exporter, "internal_error") == 1
    assert unapplied(m, "exc") == 1.0  # the record that raised: never applied, and said so
    s.close()


def test_a_zero_length_packet_is_not_the_end_of_the_connection(
    exporter: InProcessExporter,
) -> None:
    """Before: SOCK_SEQPACKET reads an empty packet as b"" and the rank was marked crashed."""
    s = raw_connect(exporter.socket)
    s.send(pkt(hello(run="empty"), step(1)))
    wait_for(lambda: exporter.rank("empty", 0))
    s.send(b"")
    s.send(pkt(step(2)))
    r = wait_for(lambda: (k := exporter.rank("empty", 0)) and k["step"] == 2 and k)
    assert r["up"] and r["status"] == "running" and r["crashes"] == 0
    assert invalid(exporter, "empty") == 1
    s.close()
    r = wait_for(lambda: (k := exporter.rank("empty", 0)) and not k["up"] and k)
    assert r["status"] == "crashed"  # a real EOF still is one


@pytest.mark.parametrize("value", [1e308, -1e308, 1e-300, 5e-324, 1e300])
def test_finite_extremes_never_raise_in_ingest(exporter: InProcessExporter, value: float) -> None:
    """Before: 1e-300 and 1e300 layer norms and a 1e308 loss raised inside ingest, and the live
    trainer was recorded as crashed (a false page)."""
    run = connect(exporter, "ext")
    for i in range(150):  # past min_history and a whole rolling window
        v = value if i % 7 == 3 else 2.0
        run.log(i, loss=v, grad_norm=abs(v), lr=v, mem_allocated=abs(v), tokens=1, extreme=v)
    s = raw_connect(exporter.socket)
    s.send(pkt(hello(run="ext-layers")))
    codes = list(P.LAYER_STATS.values())
    rows = [value, 1e-300, 1e300, value, abs(value), 1e-300, 1e300, 0.5]
    for i in range(12):
        for n in range(4):
            s.send(pkt(P.encode_name(64 + n, f"layer{n}")))
        layers = P.encode_layers(i, 1.0, i, 0.1, [64, 65, 66, 67], codes, rows * 4)
        s.send(pkt(layers))
    run.eval(150, val_loss=value, acc=value)
    run.finish()
    wait_for(lambda: (k := exporter.rank("ext", 0)) and k["status"] == "finished")
    r = exporter.rank("ext", 0)
    assert r is not None and r["crashes"] == 0
    # One absurd loss every 7 steps never drags the EMA away from the real loss.
    if abs(value) > 1e3:
        assert r["loss_ema"] == pytest.approx(2.0, rel=0.01)
    # The raw connection is drained on its own turn: wait for its hello rather than race it.
    lr = wait_for(lambda: (k := exporter.rank("ext-layers", 0)) and k["up"] and k)
    assert lr["status"] == "running"
    assert invalid(exporter, "internal_error") == 0
    s.close()


def test_poisoned_cumulative_totals_are_refused_and_counted(exporter: InProcessExporter) -> None:
    """Before: one NaN or negative ``tokens`` poisoned the token counter forever."""
    s = raw_connect(exporter.socket)

    def st(n: int, tokens: float) -> bytes:
        head = (n, n, 1.0 + n, 0.1, tokens, float(n), 0.0, 0, 0, 0)
        return P.step_struct(1).pack(P.STEP, P.step_payload_length(1), *head, 1, 1.0)

    s.send(pkt(hello(run="tok"), st(1, 10.0), st(2, math.nan), st(3, -5.0), st(4, 5.0)))
    s.send(pkt(st(5, math.inf), st(6, 60.0)))
    r = wait_for(lambda: (k := exporter.rank("tok", 0)) and k["step"] == 6 and k)
    assert r["tokens_total"] == 60.0
    assert dropped(exporter, "bad_counter") == 4  # NaN, negative, backwards, infinite
    tokens = sample(exporter.metrics(), "trainmon_train_tokens_total", run="tok", rank="0")
    assert tokens == 60.0
    s.close()


def test_a_frozen_then_killed_exporter_loses_nothing_silently(
    exporter_process: Callable[..., ExporterProcess],
) -> None:
    """SIGSTOP the exporter, keep training, SIGKILL it, start another: before, ~450 steps per
    rank were gone while the final step counter looked complete. Now the client counts the
    steps the frozen exporter never read (``in_flight``) and the new exporter exports it."""
    d = short_tmpdir()
    first = exporter_process(socket_dir=d).start()
    assert first.proc is not None
    run = trainmon_client.init(
        run="frozen",
        rank=0,
        world_size=1,
        local_rank=0,
        socket_path=first.socket,
        flush_interval=0.02,
    )
    fields = {f"m{i}": float(i) for i in range(20)}
    i = 0

    def train(n: int) -> None:
        nonlocal i
        for _ in range(n):
            run.log(i, loss=2.0, tokens=1, **fields)
            i += 1
            time.sleep(0.0005)

    train(200)
    wait_for(lambda: run.connected and run.sent >= 100)
    os.kill(first.proc.pid, signal.SIGSTOP)
    train(1500)  # queued in the socket, then backpressure
    first.stop(signal.SIGKILL)
    second = exporter_process(socket_dir=d).start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not (run.connected and run.dropped["in_flight"]):
        train(20)
    train(50)
    run.finish()
    logged = i
    assert accounted(run) == logged
    assert run.dropped["in_flight"] > 0
    m = wait_for(
        lambda: (
            (m := second.metrics())
            and client_dropped(m, "frozen", "in_flight") == run.dropped["in_flight"]
            and m
        )
    )
    # The step counter alone looks complete; the drop counters say what it hides.
    assert sample(m, "trainmon_train_steps_total", run="frozen", rank="0") == logged - sum(
        v for k, v in run.dropped.items() if k in ("encode_error",)
    )
    assert client_dropped(m, "frozen", "backpressure") == run.dropped["backpressure"]
    assert sample(m, "trainmon_client_sent_messages_total", run="frozen", rank="0") == run.sent
    assert unapplied(m, "frozen") == 0.0
    print(
        f"logged {logged}: sent {run.sent}, in_flight {run.dropped['in_flight']}, "
        f"backpressure {run.dropped['backpressure']}, disconnected "
        f"{run.dropped['disconnected']}"
    )
    second.stop()

"""Backpressure: the documented maximum of custom metrics reaches an idle exporter at a busy
trainer's step rate, and a full socket buffer costs what it drops and no more.

What makes it fit: the send buffer the client asks for (``SEND_BUFFER_BYTES``), a flusher that
sends a heavy trainer's steps in bursts that buffer holds (``FLUSH_BURST_BYTES``), and names
announced again only when a dropped packet carried some.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from trainmon_client import _protocol as P
from trainmon_client._encoder import MAX_CUSTOM_NAMES, carries_names
from trainmon_client._sender import FLUSH_BURST_BYTES
from trainmon_client._transport import SEND_BUFFER_BYTES, Transport

from ..conftest import sample, wait_for
from ..helpers.client import Listener, make_run

RATE = 43.0
"""Steps a second of the busiest trainer docs/client.md promises the maximum at."""


def test_a_connection_asks_for_a_larger_send_buffer(listener: Listener) -> None:
    t = Transport(str(listener.path))
    assert t.connect(0.0, lambda: [P.packet_header() + P.encode_hello({"run": "t"})])
    try:
        assert t._sock is not None
        granted = t._sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        wmem_max = int(Path("/proc/sys/net/core/wmem_max").read_text())
        # Linux doubles what it is asked for, within twice net.core.wmem_max.
        assert granted >= 2 * min(SEND_BUFFER_BYTES, wmem_max)
    finally:
        t.close()


def test_carries_names() -> None:
    head = P.packet_header()
    step_only = head + P.encode_checkpoint(1, 0.0, 0.0)
    assert not carries_names(step_only)
    assert carries_names(step_only + P.encode_name(P.FIRST_CUSTOM_ID, "late"))
    assert carries_names(b"not a packet")  # unreadable: assume the worst


def names_read(listener: Listener) -> list[str]:
    return [rec.name for rtype, rec in listener.records() if rtype == P.NAME]


def fill(run: Any, step: int) -> int:
    """Log steps of built-in fields only until the unread send buffer drops one; the next step."""
    dropped = run.dropped["backpressure"]
    deadline = time.monotonic() + 30
    while run.dropped["backpressure"] == dropped:
        assert time.monotonic() < deadline, "the send buffer never filled"
        run.log(step, loss=1.0)
        step += 1
        if step % 64 == 0:
            time.sleep(0.001)  # let the flusher catch up
    for _ in range(20):  # dropped too: the buffer stays full
        run.log(step, loss=1.0)
        step += 1
    wait_for(lambda: run.dropped["backpressure"] + run.sent >= step)
    return step


def test_only_a_dropped_packet_that_held_names_announces_them_again(
    listener: Listener,
) -> None:
    run = make_run(listener.path, flush_interval=0.0)
    run.log(0, loss=1.0, early=1.0)  # this packet announces "early"
    listener.accept()  # read nothing yet: the send buffer fills
    step = fill(run, 1)
    assert names_read(listener) == ["early"]  # the buffer empties
    run.log(step, loss=1.0)
    step += 1
    wait_for(lambda: run.dropped["backpressure"] + run.sent >= step)
    assert names_read(listener) == []  # dropped steps held no name: none announced again

    step = fill(run, step)
    run.log(step, loss=1.0, late=2.0)  # a new name, in a packet the full buffer drops
    step += 1
    wait_for(lambda: run.dropped["backpressure"] + run.sent >= step)
    assert names_read(listener) == []  # the buffer empties; "late" never arrived
    run.log(step, loss=1.0, late=3.0)
    run.finish()
    assert sorted(names_read(listener)) == ["early", "late"]  # every name announced again


def custom_values(metrics: dict[Any, float], run: str) -> int:
    return sum(
        1
        for (name, labels) in metrics
        if name == "trainmon_train_custom_value" and ("run", run) in labels
    )


@pytest.mark.slow
def test_the_documented_maximum_of_custom_metrics_is_delivered_at_a_busy_rate(
    exporter_process: Any,
) -> None:
    ex = exporter_process(
        "--max-custom-metrics", str(MAX_CUSTOM_NAMES), "--scrape-sample-limit", "100000"
    ).start()
    run = make_run(ex.socket, run="busy")  # the default flush interval
    names = [f"custom_{i}" for i in range(MAX_CUSTOM_NAMES)]
    steps = int(RATE * 4)  # 4 s: eight flush intervals
    t0 = time.perf_counter()
    for step in range(steps):
        run.log(step, loss=1.0, **{n: float(step + i) for i, n in enumerate(names)})
        delay = t0 + (step + 1) / RATE - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
    run.finish()
    assert run.dropped == {k: 0 for k in run.dropped}
    assert run.sent == steps

    def scraped() -> dict[Any, float] | None:
        metrics: dict[Any, float] = ex.metrics()
        return metrics if custom_values(metrics, "busy") else None

    m = wait_for(scraped)
    assert sample(m, "trainmon_ingest_messages_total", type="step") == steps
    assert sum(v for (n, _), v in m.items() if n == "trainmon_ingest_values_dropped_total") == 0
    assert custom_values(m, "busy") == MAX_CUSTOM_NAMES
    assert sample(m, "trainmon_train_custom_value", run="busy", rank="0", name="custom_7") == (
        steps - 1 + 7
    )


def test_a_heavy_trainer_flushes_in_bursts_of_about_flush_burst_bytes(
    listener: Listener,
) -> None:
    """With a 1 s flush interval, 1,024 values a step at 43 steps/s would queue about 440 KB a
    flush: the flusher sends about ``FLUSH_BURST_BYTES`` at a time instead, several a second."""
    run = make_run(listener.path, flush_interval=1.0)
    names = [f"custom_{i}" for i in range(MAX_CUSTOM_NAMES)]
    run.log(0, loss=1.0)  # the first step goes at once: the connection opens
    conn = listener.accept()
    arrivals: list[tuple[float, int]] = []

    def read() -> None:
        conn.settimeout(5)
        try:
            while True:
                data = conn.recv(P.MAX_PACKET_BYTES + 1)
                if not data:
                    return
                arrivals.append((time.monotonic(), len(data)))
        except (TimeoutError, OSError):
            return

    reader = threading.Thread(target=read)
    reader.start()
    t0 = time.perf_counter()
    steps = int(RATE * 2.5)
    for step in range(1, steps):
        run.log(step, loss=1.0, **{n: float(step) for n in names})
        delay = t0 + step / RATE - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
    run.finish()
    reader.join()
    assert run.dropped == {k: 0 for k in run.dropped}
    bursts: list[int] = []  # bytes of each flush: packets less than 10 ms apart
    last = -1.0
    for when, size in arrivals:
        if when - last > 0.01:
            bursts.append(0)
        bursts[-1] += size
        last = when
    big = [b for b in bursts if b > 2 * FLUSH_BURST_BYTES]
    # Without pacing: [358, 460286, 445012, 206987] (one flush a second, then finish()'s).
    assert len(big) <= 2, bursts  # a late reader may join two bursts
    assert len(bursts) >= 6, bursts

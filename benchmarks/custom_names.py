"""The documented maximum of custom metrics, delivered at a busy trainer's step rate.

A real client logs 1,024 distinct custom metrics (``MAX_CUSTOM_NAMES``, the documented
maximum) every step at 43 steps a second into a real, otherwise idle exporter subprocess
(``--max-custom-metrics 1024``, so the exporter refuses nothing). Each step is a STEP record of
about 10 KiB, so the client queues about 220 KB per 0.5 s flush interval.

Four configurations, one after the other against the same exporter:

- *baseline*: the kernel's default send buffer (``net.core.wmem_default``, 208 KiB) and one
  flush per interval whatever its size: the client before it sized either;
- *default buffer, paced*: the flush pacing alone;
- *stock kernel*: the client's flush pacing (``FLUSH_BURST_BYTES``) with the send buffer a
  stock kernel grants it (``net.core.wmem_max`` of 212,992 bytes, doubled);
- *this client*: as shipped, on this machine's kernel.

    python benchmarks/custom_names.py [--names 1024] [--rate 43] [--seconds 10]

Prints, per configuration: the send buffer granted, steps logged, sent (``Run.sent``),
dropped (``Run.dropped``), the STEP records the exporter read and the values it dropped.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

from prometheus_client.parser import text_string_to_metric_families

import trainmon_client
from trainmon_client import _sender, _transport
from trainmon_client._encoder import MAX_CUSTOM_NAMES
from trainmon_exporter.local import LocalExporter

STOCK_WMEM_MAX = 212_992
"""``net.core.wmem_max`` of a stock Linux kernel: the most ``SO_SNDBUF`` grants a user, halved."""


def counters(ex: LocalExporter) -> dict[str, float]:
    """STEP records read, values dropped and packets refused so far (the exporter's counters)."""
    out = {"steps_read": 0.0, "values_dropped": 0.0, "invalid": 0.0}
    for fam in text_string_to_metric_families(ex.get("/metrics").decode()):
        for s in fam.samples:
            if s.name == "trainmon_ingest_messages_total" and s.labels.get("type") == "step":
                out["steps_read"] += s.value
            elif s.name == "trainmon_ingest_values_dropped_total":
                out["values_dropped"] += s.value
            elif s.name == "trainmon_ingest_messages_invalid_total":
                out["invalid"] += s.value
    return out


@contextmanager
def configured(buffer: int | None, burst: int | None) -> Iterator[None]:
    """Run with ``SEND_BUFFER_BYTES`` and ``FLUSH_BURST_BYTES`` replaced (None: as shipped)."""
    saved = _transport.SEND_BUFFER_BYTES, _sender.FLUSH_BURST_BYTES
    if buffer is not None:
        _transport.SEND_BUFFER_BYTES = buffer
    if burst is not None:
        _sender.FLUSH_BURST_BYTES = burst
    try:
        yield
    finally:
        _transport.SEND_BUFFER_BYTES, _sender.FLUSH_BURST_BYTES = saved


def trial(
    ex: LocalExporter, run_id: str, names: list[str], rate: float, seconds: float
) -> dict[str, float]:
    """Log ``len(names)`` custom metrics a step at ``rate`` steps/s for ``seconds``; the counts."""
    before = counters(ex)
    run = trainmon_client.init(run=run_id, socket_path=ex.socket)
    steps = int(rate * seconds)
    sndbuf = 0
    t0 = time.perf_counter()
    for step in range(steps):
        run.log(step, loss=1.0, **{n: float(step + i) for i, n in enumerate(names)})
        sock = run._sender.transport._sock
        if sock is not None and not sndbuf:
            sndbuf = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)  # as granted
        delay = t0 + (step + 1) / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
    elapsed = time.perf_counter() - t0
    run.finish()
    time.sleep(0.3)  # the exporter reads every 0.1 s
    after = counters(ex)
    return {
        "sndbuf": sndbuf,
        "rate": steps / elapsed,
        "logged": steps,
        "sent": run.sent,
        "dropped": sum(run.dropped.values()),
        **{k: after[k] - before[k] for k in after},
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--names", type=int, default=MAX_CUSTOM_NAMES)
    ap.add_argument("--rate", type=float, default=43.0, help="steps per second")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--smoke", action="store_true", help="2 s each (figures not meaningful)")
    args = ap.parse_args()
    if args.smoke:
        args.seconds = 2.0
    names = [f"custom_{i}" for i in range(args.names)]
    configs: list[tuple[str, Callable[[], AbstractContextManager[None]]]] = [
        ("baseline: default buffer, one flush/interval", lambda: configured(0, 1 << 40)),
        ("default buffer, flushes paced", lambda: configured(0, None)),
        ("stock kernel: wmem_max 212,992, paced", lambda: configured(STOCK_WMEM_MAX, None)),
        ("this client, this kernel", lambda: configured(None, None)),
    ]
    load = os.getloadavg()
    print(
        f"{args.names} custom metrics a step at {args.rate:g} steps/s for {args.seconds:g} s, "
        f"idle exporter; {os.cpu_count()} CPUs, load average {load[0]:.2f}"
    )
    print(
        f"{'configuration':46s} {'SO_SNDBUF':>9s} {'steps/s':>7s} {'logged':>6s} {'sent':>6s} "
        f"{'dropped':>7s} {'drop %':>6s} {'read':>6s} {'refused':>7s}"
    )
    with LocalExporter(
        "--max-custom-metrics", str(max(args.names, 1)), "--scrape-sample-limit", "100000"
    ) as ex:
        for i, (label, config) in enumerate(configs):
            with config():
                r = trial(ex, f"names-{i}", names, args.rate, args.seconds)
            refused = r["values_dropped"] + r["invalid"]
            print(
                f"{label:46s} {r['sndbuf']:9.0f} {r['rate']:7.1f} {r['logged']:6.0f} "
                f"{r['sent']:6.0f} {r['dropped']:7.0f} {100 * r['dropped'] / r['logged']:6.1f} "
                f"{r['steps_read']:6.0f} {refused:7.0f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
